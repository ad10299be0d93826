"""Retries and dead letters the Kafka way: retry partitions per delay level, paused
until their head is due; dead-letter copies; poison records."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import pytest

from benchmarks._tansu import TansuServer
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    KafkaBroker,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
    UnknownTopicError,
)
from stagedconsumer._core import DELAY_LEVELS
from stagedconsumer._sources._source import (
    PROPERTY_DECODE_ERROR,
    PROPERTY_ORIGIN_MESSAGE_ID,
    PROPERTY_POISON_ENTRY_ID,
    PROPERTY_POISON_STREAM,
    PROPERTY_RETRY_TOPIC,
    SendBackResult,
)
from tests.kafka.conftest import send_messages

pytestmark = [pytest.mark.anyio, pytest.mark.kafka]


async def _send(broker: KafkaBroker, topic: str, n: int) -> list[Message]:
    return await send_messages(
        broker,
        topic,
        n,
        keys=lambda i: [f"k{i}", "x"],
        tags="t",
        properties=lambda i: {"p": str(i)},
    )


async def test_retry_partitions_are_per_delay_level_a_short_delay_passes_a_long_one(
    broker: KafkaBroker, name: str
) -> None:
    await broker.create_topic(name, 1)
    slow, fast = await _send(broker, name, 2)
    assert await broker.send_back(name, slow, delay_level=4) is SendBackResult.RETRY  # 30 s
    assert await broker.send_back(name, fast, delay_level=1) is SendBackResult.RETRY  # 1 s
    queues = await broker.get_queues("%RETRY%" + name)
    assert len(queues) == len(DELAY_LEVELS)
    # level 4's partition: its head is due in 30 s, nothing comes
    assert not (await broker.pull(queues[3], 0, 10, timeout=5)).messages
    # level 1's partition: the message handed back after it comes within its 1 s
    started = time.monotonic()
    got: list[Message] = []
    with anyio.fail_after(10):
        while not got:
            got = list((await broker.pull(queues[0], 0, 10, timeout=0.5)).messages)
    assert 0.3 < time.monotonic() - started < 5
    (again,) = got
    assert (again.body, again.reconsume_times, again.msg_id) == (b"m1", 1, fast.msg_id)
    assert again.keys == fast.keys
    assert again.tags == "t"
    assert again.properties["p"] == "1"
    assert again.properties[PROPERTY_RETRY_TOPIC] == name
    assert again.properties[PROPERTY_ORIGIN_MESSAGE_ID] == fast.msg_id
    assert again.offset_msg_id != fast.offset_msg_id  # a new stored copy


async def test_a_retry_partition_whose_head_is_not_due_is_paused_not_polled(
    broker: KafkaBroker, name: str
) -> None:
    await broker.create_topic(name, 1)
    (sent,) = await _send(broker, name, 1)
    await broker.send_back(name, sent, delay_level=1)  # due in 1 s
    mq = MessageQueue("%RETRY%" + name, 0)  # level 1's partition
    first = await broker.pull(mq, 0, 10, timeout=5)
    assert not first.messages
    assert first.max_offset == 1
    assert broker.statistics().retry_paused == 1
    fetches, pulls = broker.statistics().pulls, 0
    got: list[Message] = []
    with anyio.fail_after(10):
        while not got:
            got = list((await broker.pull(mq, 0, 10, timeout=0.05)).messages)
            pulls += 1
    # about 20 pulls waited; only the one once the head was due fetched
    assert pulls >= 5
    assert broker.statistics().pulls - fetches == 1
    assert broker.statistics().retry_paused == 0
    assert [m.body for m in got] == [b"m0"]


async def test_a_spent_message_goes_to_the_dead_letter_topic_as_it_was(
    broker: KafkaBroker, name: str
) -> None:
    await broker.create_topic(name, 1)
    (sent,) = await _send(broker, name, 1)
    assert await broker.send_back(name, sent, delay_level=-1) is SendBackResult.DLQ
    (dlq,) = await broker.get_queues("%DLQ%" + name)
    (dead,) = (await broker.pull(dlq, 0, 10, timeout=5)).messages
    assert (dead.body, dead.keys, dead.tags, dead.msg_id) == (b"m0", sent.keys, "t", sent.msg_id)
    assert dead.properties[PROPERTY_ORIGIN_MESSAGE_ID] == sent.msg_id
    assert dead.properties[PROPERTY_RETRY_TOPIC] == name
    assert dead.born_timestamp == pytest.approx(sent.born_timestamp, abs=0.002)


async def test_a_poison_record_comes_beside_its_neighbours_and_goes_to_the_dead_letters(
    broker: KafkaBroker, tansu: TansuServer, name: str
) -> None:
    from aiokafka import AIOKafkaProducer

    await broker.create_topic(name, 1)
    plain = AIOKafkaProducer(bootstrap_servers=tansu.bootstrap)
    await plain.start()
    try:
        await plain.send_and_wait(name, b"a", partition=0)
        await plain.send_and_wait(
            name, b"bad", key=b"kb", partition=0, headers=[("KEYS", b"{not json"), ("h", b"1")]
        )
        await plain.send_and_wait(name, b"c", partition=0)
    finally:
        await plain.stop()
    mq = MessageQueue(name, 0)
    pulled = await broker.pull(mq, 0, 10, timeout=5)
    assert [m.body for m in pulled.messages] == [b"a", b"c"]
    assert pulled.next_offset == 3
    (poison,) = pulled.undecodable
    assert poison.offset == 1
    assert poison.error.startswith("JSONDecodeError")
    await broker.send_undecodable_to_dlq(name, poison)
    (dlq,) = await broker.get_queues("%DLQ%" + name)
    (dead,) = (await broker.pull(dlq, 0, 10, timeout=5)).messages
    assert (dead.body, dead.keys) == (b"bad", ("kb",))
    assert dead.properties[PROPERTY_DECODE_ERROR] == poison.error
    assert dead.properties[PROPERTY_POISON_STREAM] == name
    assert dead.properties[PROPERTY_POISON_ENTRY_ID] == "0@1"
    assert dead.properties["raw:KEYS"] == "{not json"
    assert dead.properties["raw:h"] == "1"
    # the pulls after it are served as before
    again = await broker.pull(mq, 2, 10, timeout=5)
    assert [m.body for m in again.messages] == [b"c"]


class Collect(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.bodies.extend(m.body for m in msgs)


@pytest.mark.slow
async def test_a_consumer_moves_a_poison_record_to_the_dead_letters_and_goes_on(
    broker: KafkaBroker, tansu: TansuServer, name: str
) -> None:
    from aiokafka import AIOKafkaProducer

    await broker.create_topic(name, 1)
    plain = AIOKafkaProducer(bootstrap_servers=tansu.bootstrap)
    await plain.start()
    try:
        for body, headers in ((b"a", []), (b"bad", [("RECONSUME_TIMES", b"x")]), (b"c", [])):
            await plain.send_and_wait(name, body, partition=0, headers=headers)
    finally:
        await plain.stop()
    listener = Collect()
    options = ConsumerOptions(persist_consumer_offset_interval=0.2, pull_long_polling_timeout=0.5)
    consumer = PushConsumer(name, broker, listener, options=options)
    consumer.subscribe(name)
    async with consumer:
        with anyio.fail_after(30):
            while len(listener.bodies) < 2 or not await _dead_letters(broker, name):
                await anyio.sleep(0.1)
        assert sorted(listener.bodies) == [b"a", b"c"]
    (dead,) = await _dead_letters(broker, name)
    assert dead.body == b"bad"
    assert dead.properties[PROPERTY_DECODE_ERROR].startswith("ValueError")
    assert dead.properties["raw:RECONSUME_TIMES"] == "x"
    progress = await broker.default_offset_store().list_progress(name, name)
    assert progress[MessageQueue(name, 0)].consume_offset == 3


async def _dead_letters(broker: KafkaBroker, group: str) -> list[Message]:
    try:
        (dlq,) = await broker.get_queues("%DLQ%" + group)
    except UnknownTopicError:
        return []
    return list((await broker.pull(dlq, 0, 10, timeout=0.1)).messages)
