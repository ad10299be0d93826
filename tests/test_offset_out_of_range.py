"""A committed consume offset beyond the queue's max offset (a flushed Redis, a broker
that lost its messages, an embedded broker refilled with less): warned about with the
queue and both numbers, counted (``offsets_beyond_end``), and corrected where
``consume_from_where`` says: the queue's first offset (the default; every message of
the recreated queue is new to the group, none is skipped), its end
(``CONSUME_FROM_LAST_OFFSET``, RocketMQ's client rule for ``OFFSET_ILLEGAL``), or
``consume_timestamp``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from offsetstore import MemoryOffsetStore, QueueProgress, SqlOffsetStore, StageKey
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeFromWhere,
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


def beyond_end_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "beyond the queue's end" in r.getMessage()]


async def test_offset_beyond_the_end_is_warned_about_counted_and_consumed_from_the_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The default (CONSUME_FROM_FIRST_OFFSET): the queue was recreated, so its
    messages are all new to the group: none is skipped (it was: 0 of 10 consumed)."""
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
            assert consumer.statistics().offsets_beyond_end == 1
    assert listener.offsets == list(range(15))
    warnings = beyond_end_warnings(caplog)
    assert len(warnings) == 1
    assert "offset 500 of t#0" in warnings[0]
    assert "max offset 10" in warnings[0]
    assert "going on from offset 0 (CONSUME_FROM_FIRST_OFFSET)" in warnings[0]
    assert (await store.read_progress("g", MQ)) == QueueProgress(consume_offset=15)


async def test_from_last_offset_goes_on_from_the_end(caplog: pytest.LogCaptureFixture) -> None:
    """CONSUME_FROM_LAST_OFFSET: RocketMQ's client rule for an offset out of range:
    what is sent from then on is consumed."""
    broker = broker_with(10)
    store = await store_at(500)
    listener = Recording()
    options = ConsumerOptions(consume_from_where=ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET)
    consumer = PushConsumer("g", broker, listener, offset_store=store, options=options)
    consumer.subscribe("t")
    with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
        async with consumer:
            for i in range(5):
                broker.send("t", b"new %d" % i)
            await consumer.wait_caught_up(timeout=10)
            assert consumer.statistics().offsets_beyond_end == 1
    assert listener.offsets == [10, 11, 12, 13, 14]
    (warning,) = beyond_end_warnings(caplog)
    assert "offset 500 of t#0" in warning
    assert "max offset 10" in warning
    assert "going on from offset 10 (CONSUME_FROM_LAST_OFFSET)" in warning


async def test_from_timestamp_goes_on_from_the_first_message_born_then() -> None:
    broker = broker_with(2)
    (last,) = (await broker.pull(MQ, 1, 1)).messages
    while time.time() <= last.born_timestamp:  # the clock's resolution
        await anyio.sleep(0.001)
    since = time.time()
    broker.send("t", b"2")
    broker.send("t", b"3")
    store = await store_at(500)
    listener = Recording()
    options = ConsumerOptions(
        consume_from_where=ConsumeFromWhere.CONSUME_FROM_TIMESTAMP, consume_timestamp=since
    )
    consumer = PushConsumer("g", broker, listener, offset_store=store, options=options)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
        assert consumer.statistics().offsets_beyond_end == 1
    assert listener.offsets == [2, 3]


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
    # from the start, stage offsets 1..9 with definitions [2, 3]: stage 0, then 1, 1,
    # 1, then the tail
    assert sorted(listener.stages) == [
        (0, 0), (1, 1), (2, 1), (3, 1), *((o, -1) for o in range(4, 9))
    ]  # fmt: skip


async def test_an_offset_at_the_max_is_not_corrected(caplog: pytest.LogCaptureFixture) -> None:
    broker = broker_with(10)
    store = await store_at(10)
    consumer = PushConsumer("g", broker, Recording(), offset_store=store)
    consumer.subscribe("t")
    with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
        async with consumer:
            await consumer.wait_caught_up(timeout=10)
            assert consumer.statistics().offsets_beyond_end == 0
    assert not beyond_end_warnings(caplog)


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
    # the recreated queue's 3 messages are new to the group: consumed, then the 4 sent
    assert listener.offsets == [*range(20), *range(7)]
    warning = next(r.getMessage() for r in caplog.records if "beyond" in r.getMessage())
    assert "offset 20" in warning
    assert "max offset 3" in warning
    assert (await store.read_progress("g", MQ)) == QueueProgress(consume_offset=7)
