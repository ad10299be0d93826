"""A committed consume offset beyond the queue's max offset (a store reused with a new
broker, a broker that lost its messages): warned about with both numbers and
corrected to the max offset, as RocketMQ's client does with ``OFFSET_ILLEGAL``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from offsetstore import MemoryOffsetStore, QueueProgress, SqlOffsetStore, StageKey
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PushConsumer,
)
from stagedconsumer._sources._source import MessageSource, PullResult, SendBackResult

pytestmark = pytest.mark.anyio

MQ = MessageQueue("t", 0)
DEFAULT = StageKey("default", None)


class Recording(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.offsets: list[int] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.offsets.extend(m.queue_offset for m in msgs)


class Staged(MessageListenerStagedConcurrently):
    def __init__(self) -> None:
        self.stages: list[tuple[int, int]] = []

    def get_stage_definitions(self) -> Sequence[int]:
        return [2, 3]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        self.stages.extend((m.queue_offset, context.stage_index) for m in msgs)


def broker_with(count: int) -> MemoryBroker:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for i in range(count):
        broker.send("t", b"%d" % i)
    return broker


async def store_at(
    offset: int, stage_offsets: dict[StageKey, int] | None = None
) -> MemoryOffsetStore:
    store = MemoryOffsetStore()
    store.update_progress(
        "g", MQ, QueueProgress(consume_offset=offset, stage_offsets=stage_offsets)
    )
    await store.persist_all("g", [MQ])
    return store


async def test_offset_beyond_the_max_is_warned_about_and_moved_to_the_max(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = broker_with(10)
    store = await store_at(500)
    listener = Recording()
    consumer = PushConsumer("g", broker, listener, offset_store=store)
    consumer.subscribe("t")
    with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
        async with consumer:
            for i in range(5):
                broker.send("t", b"new %d" % i)
            await consumer.wait_caught_up(timeout=10)
    # RocketMQ's rule: go on from the max offset; what is sent from then on is consumed
    assert listener.offsets == [10, 11, 12, 13, 14]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "500" in warnings[0]
    assert "max offset 10" in warnings[0]
    assert "t#0" in warnings[0]
    assert (await store.read_progress("g", MQ)) == QueueProgress(consume_offset=15)


async def test_the_correction_is_stored_backwards_in_a_sql_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'progress.db'}"
    async with SqlOffsetStore(url) as store:
        store.update_progress("g", MQ, QueueProgress(consume_offset=500))
        await store.persist_all("g", [MQ])
    broker = broker_with(10)
    async with SqlOffsetStore(url) as store:
        consumer = PushConsumer("g", broker, Recording(), offset_store=store)
        consumer.subscribe("t")
        async with consumer:
            await consumer.wait_caught_up(timeout=10)
    async with SqlOffsetStore(url) as store:
        # increase-only commits could not have moved it back from 500
        assert (await store.list_progress("g"))[MQ].consume_offset == 10


async def test_stage_offsets_are_kept_across_the_correction() -> None:
    broker = broker_with(4)
    store = await store_at(100, {DEFAULT: 1})
    listener = Staged()
    consumer = PushConsumer("g", broker, listener, offset_store=store)
    consumer.subscribe("t")
    async with consumer:
        for _ in range(5):
            broker.send("t", b"x")
        await consumer.wait_caught_up(timeout=10)
    # stage offsets 1..5 with definitions [2, 3]: stage 0, then 1, 1, 1, then the tail
    assert sorted(listener.stages) == [(4, 0), (5, 1), (6, 1), (7, 1), (8, -1)]


async def test_an_offset_at_the_max_is_not_corrected(caplog: pytest.LogCaptureFixture) -> None:
    broker = broker_with(10)
    store = await store_at(10)
    consumer = PushConsumer("g", broker, Recording(), offset_store=store)
    consumer.subscribe("t")
    with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
        async with consumer:
            await consumer.wait_caught_up(timeout=10)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


class Swappable(MessageSource):
    """A source whose broker can be replaced while a consumer runs (a broker that
    restarted without its messages)."""

    def __init__(self, inner: MemoryBroker) -> None:
        self.inner = inner

    async def get_queues(self, topic: str) -> Sequence[MessageQueue]:
        return await self.inner.get_queues(topic)

    async def pull(
        self, mq: MessageQueue, offset: int, max_count: int, *, timeout: float = 0.0
    ) -> PullResult:
        return await self.inner.pull(mq, offset, max_count, timeout=min(timeout, 0.05))

    async def max_offset(self, mq: MessageQueue) -> int:
        return await self.inner.max_offset(mq)

    async def send_back(
        self, group: str, message: Message, *, delay_level: int = 0, max_reconsume_times: int = 16
    ) -> SendBackResult:
        return await self.inner.send_back(
            group, message, delay_level=delay_level, max_reconsume_times=max_reconsume_times
        )

    async def send_to_dlq(self, group: str, message: Message) -> None:
        await self.inner.send_to_dlq(group, message)


async def test_a_broker_that_loses_its_messages_while_consuming(
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = Swappable(broker_with(20))
    store = MemoryOffsetStore()
    listener = Recording()
    options = ConsumerOptions(pull_long_polling_timeout=0.05)
    consumer = PushConsumer("g", source, listener, offset_store=store, options=options)
    consumer.subscribe("t")
    with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
        async with consumer:
            await consumer.wait_caught_up(timeout=10)
            assert listener.offsets == list(range(20))
            source.inner = broker_with(3)  # the broker came back with 3 messages only
            with anyio.fail_after(10):
                while not any("beyond" in r.getMessage() for r in caplog.records):
                    await anyio.sleep(0.01)
            for i in range(4):
                source.inner.send("t", b"after %d" % i)
            await consumer.wait_caught_up(timeout=10)
    assert listener.offsets == [*range(20), 3, 4, 5, 6]
    warning = next(r.getMessage() for r in caplog.records if "beyond" in r.getMessage())
    assert "offset 20" in warning
    assert "max offset 3" in warning
    assert (await store.read_progress("g", MQ)) == QueueProgress(consume_offset=7)
