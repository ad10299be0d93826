"""Progress is the progress of one source (issue 32, item 10).

A new user points a consumer at a fresh Redis namespace with the group and offset
store of an earlier run: the store's offsets count the other namespace's messages,
and the consumer used to resume from them and consume nothing of the new ones. Now
progress is keyed by ``RedisBroker.source_id()`` (``redis://host:port/db#namespace``),
so the new namespace starts afresh. A namespace that was flushed keeps its identity:
its stored offsets lie beyond the recreated queues' ends, which the consumer reports
(WARNING, ``offsets_beyond_end``) and corrects per ``consume_from_where``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from offsetstore import SqlOffsetStore
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeFromWhere,
    ConsumerOptions,
    ConsumerStatistics,
    Message,
    MessageListenerConcurrently,
    PushConsumer,
)
from stagedconsumer._sources._redis_broker import RedisBroker

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

GROUP = "orders-app"


class Collect(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.seen: list[bytes] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.seen.extend(m.body for m in msgs)


async def _consume(
    broker: RedisBroker, store: SqlOffsetStore, options: ConsumerOptions | None = None
) -> tuple[Collect, ConsumerStatistics]:
    listener = Collect()
    consumer = PushConsumer(GROUP, broker, listener, offset_store=store, options=options)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=20)
        statistics = consumer.statistics()
    return listener, statistics


async def _send(broker: RedisBroker, prefix: str, count: int) -> None:
    for i in range(count):
        await broker.send("t", b"%s %d" % (prefix.encode(), i))


async def test_a_fresh_namespace_with_the_same_group_and_store_consumes_its_messages(
    redis_url: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'progress.db'}"
    first_ns, second_ns = (f"test-{uuid.uuid4().hex[:12]}" for _ in range(2))
    async with RedisBroker(redis_url, namespace=first_ns) as first:
        try:
            await first.create_topic("t", 4)
            await _send(first, "old", 200)
            async with SqlOffsetStore(url) as store:
                listener, _ = await _consume(first, store)
            assert len(listener.seen) == 200
        finally:
            await first.delete_namespace()
    async with RedisBroker(redis_url, namespace=second_ns) as second:
        try:
            await second.create_topic("t", 4)
            await _send(second, "new", 200)  # the same offsets in each queue as before
            async with SqlOffsetStore(url) as store:
                listener, statistics = await _consume(second, store)
        finally:
            await second.delete_namespace()
    # It consumed 0 of them: the first namespace's offsets were taken for its own.
    assert sorted(listener.seen) == sorted(b"new %d" % i for i in range(200))
    assert statistics.offsets_beyond_end == 0
    async with SqlOffsetStore(url, read_only=True) as store:
        sources = await store.list_sources(GROUP)
    assert sources == sorted([first.source_id(), second.source_id()])
    assert second.source_id() == f"redis://127.0.0.1:6379/0#{second_ns}"


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET, [b"again %d" % i for i in range(10)]),
        (ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET, []),
    ],
)
async def test_a_flushed_namespace_is_reported_and_corrected_per_consume_from_where(
    redis_url: str,
    namespace: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    where: ConsumeFromWhere,
    expected: list[bytes],
) -> None:
    url = f"sqlite:///{tmp_path / 'progress.db'}"
    options = ConsumerOptions(consume_from_where=where)
    async with RedisBroker(redis_url, namespace=namespace) as broker:
        try:
            await broker.create_topic("t", 1)
            await _send(broker, "old", 50)
            async with SqlOffsetStore(url) as store:
                listener, _ = await _consume(broker, store)
            assert len(listener.seen) == 50
            await broker.delete_namespace()  # FLUSHDB, as far as this namespace goes
            await broker.create_topic("t", 1)
            await _send(broker, "again", 10)
            with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
                async with SqlOffsetStore(url) as store:
                    listener, statistics = await _consume(broker, store, options)
        finally:
            await broker.delete_namespace()
    assert listener.seen == expected
    assert statistics.offsets_beyond_end == 1
    (warning,) = [
        r.getMessage() for r in caplog.records if "beyond the queue's end" in r.getMessage()
    ]
    assert "committed consume offset 50 of t#0" in warning
    assert "max offset 10" in warning
    assert where.name in warning
