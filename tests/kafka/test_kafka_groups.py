"""Kafka consumer groups: Kafka's rebalance moves partitions between members, which
drain and commit first; stage offsets travel in the commit metadata; fencing."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from benchmarks._tansu import TansuServer
from offsetstore import SqlOffsetStore, StoreFencedError
from stagedconsumer import (
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    KafkaBroker,
    Message,
    MessageListenerStagedConcurrently,
    MessageQueue,
    MessageQueueListener,
    PushConsumer,
)
from stagedconsumer.testing import (
    CallLog,
    RecordingListener,
    StagePlan,
    assert_at_least_once,
    assert_staged,
)
from tests.kafka.conftest import new_broker

pytestmark = [pytest.mark.anyio, pytest.mark.kafka]

OPTIONS = ConsumerOptions(
    persist_consumer_offset_interval=0.2,
    pull_long_polling_timeout=0.3,
    shutdown_timeout=5,
    pull_batch_size=8,
)


class Slow(MessageListenerStagedConcurrently):
    def __init__(self, cost: float = 0.01) -> None:
        self.cost = cost

    def get_stage_definitions(self) -> Sequence[int]:
        return (2, 4, 8, 16)

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        await anyio.sleep(self.cost)


class Queues(MessageQueueListener):
    def __init__(self) -> None:
        self.assigned: list[MessageQueue] = []
        self.revoked: list[MessageQueue] = []
        self.lock = threading.Lock()

    async def on_queues_assigned(self, queues: Sequence[MessageQueue]) -> None:
        self.assigned.extend(queues)

    async def on_queues_revoked(self, queues: Sequence[MessageQueue]) -> None:
        self.revoked.extend(queues)


def _finished(log: CallLog) -> set[str]:
    return {m.msg_id for c in log.calls if c.ended for m in c.messages}


async def _wait_for(condition: object, timeout: float = 60) -> None:
    with anyio.fail_after(timeout):
        while not condition():  # type: ignore[operator]
            await anyio.sleep(0.02)


async def _sent(broker: KafkaBroker, topic: str) -> list[Message]:
    """Every message of ``topic``, as stored."""
    out: list[Message] = []
    for mq in await broker.get_queues(topic):
        offset, end = 0, await broker.max_offset(mq)
        while offset < end:
            pulled = await broker.pull(mq, offset, 500, timeout=5)
            out.extend(pulled.messages)
            offset = pulled.next_offset
    return out


@pytest.mark.slow
async def test_a_member_joining_mid_stream_takes_partitions_drained_and_committed_by_the_first(
    tansu: TansuServer, name: str, tmp_path: Path
) -> None:
    """Kafka's rebalance moves partitions; stages hold across the handover. The
    progress goes to a SqlOffsetStore shared by the members, fenced by Kafka's group
    generations: Tansu 0.6 drops commit metadata, so stage offsets cannot travel in
    Kafka's commits there (test_commits_... checks what is committed to Kafka)."""
    n = 1000
    store = SqlOffsetStore(f"sqlite:///{tmp_path / 'progress.db'}")
    async with new_broker(tansu) as a_broker, new_broker(tansu) as b_broker:
        await a_broker.create_topic(name, 4)
        from stagedconsumer import Producer

        async with Producer(a_broker) as producer:
            for i in range(n):
                await producer.send(name, b"%d" % i, keys=f"k{i % 13}")
        sent = await _sent(a_broker, name)
        log = CallLog()
        inner = Slow(cost=0.05)  # slow until the second member has partitions
        a_queues, b_queues = Queues(), Queues()
        a = PushConsumer(
            name, a_broker, RecordingListener(inner, log=log), offset_store=store, options=OPTIONS
        )
        a.register_message_queue_listener(a_queues)
        a.subscribe(name)
        b = PushConsumer(
            name, b_broker, RecordingListener(inner, log=log), offset_store=store, options=OPTIONS
        )
        b.register_message_queue_listener(b_queues)
        b.subscribe(name)
        async with a:
            await _wait_for(lambda: len(a_queues.assigned) == 4 and len(_finished(log)) >= 50)
            member = a_broker.group_coordinator().member(name, a.client_id)
            old_epochs = dict(member.assigned)
            async with b:
                await _wait_for(lambda: b_queues.assigned)
                assert len(_finished(log)) < n
                inner.cost = 0.001
                await _wait_for(lambda: len(_finished(log)) >= n)
                assert a_queues.revoked, "the first member gave none up"
                moved = [mq for mq in a_queues.revoked if mq in b_queues.assigned]
                assert moved
                # the first member can no longer commit for a partition it gave up
                store.update_offset(name, moved[0], 0)
                with pytest.raises(StoreFencedError):
                    await store.persist_fenced(name, {moved[0]: old_epochs[moved[0]]})
        assert_at_least_once(log, sent)
        # stages held across the handover: the second member went on from the
        # stage offsets the first committed with its offsets
        assert_staged(log, StagePlan.of(inner, sent))
        ends = {mq: await a_broker.max_offset(mq) for mq in await a_broker.get_queues(name)}
        progress = await store.list_progress(name, name)
        assert {mq: p.consume_offset for mq, p in progress.items()} == ends
        assert all(p.stage_offsets for p in progress.values())
        await store.aclose()


@pytest.mark.slow
async def test_a_topic_written_by_a_plain_kafka_producer_is_consumed_staged(
    broker: KafkaBroker, tansu: TansuServer, name: str
) -> None:
    from confluent_kafka import Producer as PlainProducer

    await broker.create_topic(name, 3)

    def produce() -> None:
        producer = PlainProducer({"bootstrap.servers": tansu.bootstrap})
        for i in range(300):
            producer.produce(
                name, value=b"v%d" % i, key=b"user-%d" % (i % 11), headers=[("source", b"plain")]
            )
        producer.flush(30)

    await anyio.to_thread.run_sync(produce)
    sent = await _sent(broker, name)
    assert len(sent) == 300
    assert all(m.properties == {"source": "plain"} and m.keys for m in sent)
    log = CallLog()
    inner = Slow(cost=0.001)
    consumer = PushConsumer(name, broker, RecordingListener(inner, log=log), options=OPTIONS)
    consumer.subscribe(name)
    async with consumer:
        await _wait_for(lambda: len(_finished(log)) >= 300)
    assert_at_least_once(log, sent)
    assert_staged(log, StagePlan.of(inner, sent))
    # progress is in the group's Kafka commits
    progress = await broker.default_offset_store().list_progress(name, name)
    ends = {mq: await broker.max_offset(mq) for mq in await broker.get_queues(name)}
    assert {mq: p.consume_offset for mq, p in progress.items()} == ends
