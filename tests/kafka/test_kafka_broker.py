"""KafkaBroker against Tansu: records as messages, pulls by offset, every mode, retries."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.lowlevel
import attrs
import pytest

from benchmarks._tansu import TansuServer
from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    KafkaBroker,
    Message,
    MessageListener,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    MessageQueue,
    Ordering,
    Producer,
    PushConsumer,
    SelectMessageQueueByKafkaKey,
    UnknownTopicError,
)
from stagedconsumer._sources._source import PROPERTY_RETRY_TOPIC, SendBackResult
from stagedconsumer.testing import (
    CallLog,
    RecordingListener,
    StagePlan,
    assert_at_least_once,
    assert_key_order,
    assert_orderly,
    assert_staged,
)
from tests.kafka.conftest import send_messages

pytestmark = [pytest.mark.anyio, pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]

OPTIONS = ConsumerOptions(
    persist_consumer_offset_interval=0.2, pull_long_polling_timeout=0.5, shutdown_timeout=5
)


def _finished(log: CallLog) -> set[str]:
    return {m.msg_id for c in log.calls if c.ended for m in c.messages}


async def _wait_for(condition: object, timeout: float = 30) -> None:
    with anyio.fail_after(timeout):
        while not condition():  # type: ignore[operator]
            await anyio.sleep(0.02)


@pytest.mark.slow
async def test_records_round_trip_every_field_and_pull_by_offset(
    broker: KafkaBroker, name: str
) -> None:
    await broker.create_topic(name, 2)
    assert await broker.get_queues(name) == [MessageQueue(name, 0), MessageQueue(name, 1)]
    mq = MessageQueue(name, 1)
    async with Producer(broker) as producer:
        first = await producer.send(
            name,
            b"\x00body\xff",
            keys=["k1", "k2"],
            tags="tagA",
            properties={"a": "1", "b": ":"},
            queue_id=1,
        )
        for i in range(20):
            await producer.send(name, b"%d" % i, queue_id=1)
    assert first.queue_offset == 0
    pulled = await broker.pull(mq, 0, 5, timeout=5)
    got = pulled.messages[0]
    assert (got.body, got.keys, got.tags, got.properties.get("a"), got.properties.get("b")) == (
        b"\x00body\xff",
        ("k1", "k2"),
        "tagA",
        "1",
        ":",
    )
    assert got.msg_id == first.msg_id
    assert abs(got.born_timestamp - time.time()) < 60
    assert pulled.next_offset == pulled.messages[-1].queue_offset + 1
    # any offset, any order: each pull starts where it asks
    later = await broker.pull(mq, 15, 100, timeout=5)
    assert [m.queue_offset for m in later.messages] == list(range(15, 21))
    again = await broker.pull(mq, 3, 2, timeout=5)
    assert [m.body for m in again.messages] == [b"2", b"3"]
    assert later.max_offset == 21
    assert await broker.max_offset(mq) == 21
    assert await broker.min_offset(mq) == 0
    empty = await broker.pull(mq, 21, 10, timeout=0.1)
    assert (list(empty.messages), empty.next_offset) == ([], 21)


async def test_unknown_topic(broker: KafkaBroker, name: str) -> None:
    with pytest.raises(UnknownTopicError):
        await broker.get_queues(name)


class Staged(MessageListenerStagedConcurrently):
    def get_stage_definitions(self) -> Sequence[int]:
        return (3, 5, 10)

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        await anyio.sleep(0.001)


class Orderly(MessageListenerOrderly):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        await anyio.lowlevel.checkpoint()


class KeyOrdered(MessageListenerOrderly):
    ordering = Ordering.BY_KEY

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        await anyio.lowlevel.checkpoint()


class Concurrent(MessageListenerConcurrently):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        await anyio.lowlevel.checkpoint()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["staged", "orderly", "key-ordered", "concurrent"])
async def test_every_mode_consumes_a_topic_and_commits_to_kafka(
    broker: KafkaBroker, name: str, mode: str
) -> None:
    await broker.create_topic(name, 3)
    sent = await send_messages(broker, name, 120)
    kinds: dict[str, type[MessageListener]] = {
        "staged": Staged,
        "orderly": Orderly,
        "key-ordered": KeyOrdered,
        "concurrent": Concurrent,
    }
    inner = kinds[mode]()
    log = CallLog()
    listener = RecordingListener(inner, log=log)
    consumer = PushConsumer(name, broker, listener, options=OPTIONS)
    consumer.subscribe(name)
    async with consumer:
        await _wait_for(lambda: len(_finished(log)) >= 120)
    assert_at_least_once(log, sent)
    if mode == "staged":
        assert isinstance(inner, Staged)
        assert_staged(log, StagePlan.of(inner, sent))
    if mode == "orderly":
        assert_orderly(log)
    if mode == "key-ordered":
        assert_key_order(log)
    # progress is in the group's Kafka commits: every partition at its end
    store = broker.default_offset_store()
    stored = await store.list_progress(name, name)
    ends = {mq: await broker.max_offset(mq) for mq in await broker.get_queues(name)}
    assert {mq: p.consume_offset for mq, p in stored.items()} == ends
    if mode == "concurrent":  # the CLI reads a Kafka group's progress
        bootstrap = ",".join(broker.bootstrap_servers)
        command = ["offsets", "show", "--store", f"kafka://{bootstrap}", "--json"]
        shown = await anyio.run_process(
            [sys.executable, "-m", "stagedconsumer", *command, "--group", name, "--topic", name],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        queues = json.loads(shown.stdout)["queues"]
        assert {(q["topic"], q["queue_id"], q["consume_offset"]) for q in queues} == {
            (mq.topic, mq.queue_id, end) for mq, end in ends.items()
        }


class FailFirst(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.seen: list[Message] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.seen.extend(msgs)
        for m in msgs:
            if m.reconsume_times == 0 and m.body == b"m3":
                context.delay_level_when_next_consume = 1  # 1 s
                raise RuntimeError("try again")


@pytest.mark.slow
async def test_a_failed_message_comes_back_through_the_retry_topic_after_its_delay(
    broker: KafkaBroker, name: str
) -> None:
    await broker.create_topic(name, 1)
    await send_messages(broker, name, 5)
    listener = FailFirst()
    consumer = PushConsumer(
        name, broker, listener, options=attrs.evolve(OPTIONS, consume_message_batch_max_size=1)
    )
    consumer.subscribe(name)
    async with consumer:
        await _wait_for(lambda: any(m.reconsume_times == 1 for m in listener.seen))
    first = next(m for m in listener.seen if m.body == b"m3")
    again = next(m for m in listener.seen if m.reconsume_times == 1)
    assert again.body == b"m3"
    assert again.topic == name
    assert again.properties[PROPERTY_RETRY_TOPIC] == name
    assert again.born_timestamp == pytest.approx(first.born_timestamp, abs=0.002)


async def test_send_back_of_a_spent_message_goes_to_the_dead_letter_topic(
    broker: KafkaBroker, name: str
) -> None:
    await broker.create_topic(name, 1)
    (sent,) = await send_messages(broker, name, 1)
    assert await broker.send_back(name, sent, max_reconsume_times=0) is SendBackResult.DLQ
    (dlq,) = await broker.get_queues("%DLQ%" + name)
    pulled = await broker.pull(dlq, 0, 10, timeout=5)
    assert [m.body for m in pulled.messages] == [b"m0"]


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_on_trio_the_broker_says_plainly_it_needs_asyncio(tansu: TansuServer) -> None:
    broker = KafkaBroker(tansu.bootstrap)
    with pytest.raises(ConfigurationError, match="asyncio only"):
        await broker.get_queues("t")


async def test_gray_release_is_refused_kafka_assigns_partitions(broker: KafkaBroker) -> None:
    with pytest.raises(ConfigurationError, match="gray release"):
        PushConsumer(
            "g",
            broker,
            Concurrent(),
            options=ConsumerOptions(enable_gray_switch=True, gray_tag=True),
        )


async def test_the_kafka_key_selector_puts_a_key_where_kafka_producers_do(
    broker: KafkaBroker, tansu: TansuServer, name: str
) -> None:
    from aiokafka import AIOKafkaProducer

    await broker.create_topic(name, 5)
    keys = [f"user-{i}" for i in range(40)]
    plain = AIOKafkaProducer(bootstrap_servers=tansu.bootstrap)
    await plain.start()
    try:
        kafka_partitions = [
            (await plain.send_and_wait(name, b"x", key=key.encode())).partition for key in keys
        ]
    finally:
        await plain.stop()
    async with Producer(broker) as producer:
        ours = [
            (
                await producer.send(name, b"y", keys=key, selector=SelectMessageQueueByKafkaKey())
            ).message_queue.queue_id
            for key in keys
        ]
    assert ours == kafka_partitions
    assert len(set(ours)) > 1
