"""RedisBroker retention: streams stay bounded (by length, by age) while groups
consume, never losing what a live group has not committed unless the hard limit is
reached; a consumer whose offset was trimmed says so and goes on per
``consume_from_where``; attached streams are never trimmed."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import anyio
import pytest
import redis

from offsetstore import MemoryOffsetStore, QueueProgress
from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumeFromWhere,
    ConsumerOptions,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
)
from stagedconsumer._sources._redis_broker import RedisBroker, StreamRetention

pytestmark = pytest.mark.anyio

MQ = MessageQueue("t", 0)
OPTIONS = ConsumerOptions(persist_consumer_offset_interval=0.1, pull_long_polling_timeout=0.5)


class Offsets(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.offsets: list[int] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.offsets.extend(m.queue_offset for m in msgs)


def _stream(broker: RedisBroker, topic: str = "t") -> str:
    return f"{broker.namespace}:q:{{{topic}:0}}"


async def _wait_for(condition: Callable[[], object], what: str) -> None:
    """Wait for ``condition`` (a minute at most: then fail naming ``what``)."""
    with anyio.move_on_after(60):
        while not condition():
            await anyio.sleep(0.02)
        return
    pytest.fail(f"waited a minute for {what}")


def test_retention_is_checked() -> None:
    assert StreamRetention().max_age == 72 * 3600  # RocketMQ's fileReservedTime
    for bad in (
        {"max_age": 0},
        {"max_length": 0},
        {"hard_max_length": -1},
        {"check_every": 0},
        {"group_ttl": float("inf")},
    ):
        with pytest.raises(ConfigurationError):
            StreamRetention(**bad)
    with pytest.raises(ConfigurationError, match="retention must be StreamRetention"):
        RedisBroker(retention=100)  # type: ignore[arg-type]


@pytest.mark.slow
async def test_a_stream_stays_bounded_while_a_group_consumes(
    redis_url: str, namespace: str, inspect: redis.Redis
) -> None:
    retention = StreamRetention(max_length=300, max_age=None, check_every=50)
    total = 6000
    async with (
        RedisBroker(redis_url, namespace=namespace, retention=retention) as broker,
        RedisBroker(redis_url, namespace=namespace, retention=None) as unbounded,
    ):
        try:
            await broker.create_topic("t", 1)
            await unbounded.create_topic("ref", 1)
            await unbounded.send_many("ref", [b"x" * 64] * total, chunk=100)
            listener = Offsets()
            consumer = PushConsumer("g", broker, listener, options=OPTIONS)
            consumer.subscribe("t")
            async with consumer:
                await _wait_for(lambda: consumer.statistics().queues, "the queue")
                sent = 0
                lengths = []
                while sent < total:
                    sent += await broker.send_many("t", [b"x" * 64] * 100, chunk=100)
                    lengths.append(inspect.xlen(_stream(broker)))
                    # A producer that the group keeps up with (lag at most 400).
                    while consumer.statistics().committed_offsets.get(MQ, 0) < sent - 400:
                        await anyio.sleep(0.01)
                await consumer.wait_caught_up(timeout=60)
                # the group commits, so a last batch trims what it consumed
                await _wait_for(
                    lambda: consumer.statistics().committed_offsets.get(MQ) == total, "commit"
                )
                await anyio.sleep(0.3)  # its floor is reported
                await broker.send_many("t", [b"x" * 64] * 100, chunk=100)
                await consumer.wait_caught_up(timeout=60)
            # Every message consumed, none lost to trimming (the group was live).
            assert sorted(set(listener.offsets)) == list(range(total + 100))
            assert consumer.statistics().trimmed_offsets == 0
            length = inspect.xlen(_stream(broker))
            # max_length, plus what a check lets through, plus one stream node
            assert length <= 300 + 50 + 100 + 100, lengths
            # (How long the stream grows during the run depends on when the group's
            # offset reports reach Redis: a run where none arrived before the last send
            # was seen, so only the bound after the group caught up is asserted.)
            used = inspect.memory_usage(_stream(broker))
            reference = inspect.memory_usage(_stream(unbounded, "ref"))
            assert used is not None
            assert reference is not None
            assert used * 5 < reference, (used, reference)
            assert broker.statistics().forced_trims == 0
        finally:
            await broker.delete_namespace()


async def test_entries_older_than_max_age_are_trimmed(
    redis_url: str, namespace: str, inspect: redis.Redis
) -> None:
    retention = StreamRetention(max_age=0.5, check_every=10)
    async with RedisBroker(redis_url, namespace=namespace, retention=retention) as broker:
        try:
            await broker.create_topic("t", 1)
            await broker.send_many("t", [b"old"] * 300, chunk=10)
            assert inspect.xlen(_stream(broker)) == 300  # younger than max_age
            await anyio.sleep(0.7)  # a lower bound only: older is as good
            await broker.send_many("t", [b"new"] * 20, chunk=10)
            assert inspect.xlen(_stream(broker)) <= 20 + 100  # plus one stream node
            assert await broker.min_offset(MQ) >= 200
            assert (await broker.pull(MQ, 319, 1)).messages[0].body == b"new"
        finally:
            await broker.delete_namespace()


async def test_a_live_group_keeps_its_entries_until_the_hard_limit(
    redis_url: str,
    namespace: str,
    inspect: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    retention = StreamRetention(max_length=100, hard_max_length=1000, max_age=None, check_every=50)
    async with RedisBroker(redis_url, namespace=namespace, retention=retention) as broker:
        try:
            await broker.create_topic("t", 1)
            listener = Offsets()
            consumer = PushConsumer("g", broker, listener, options=OPTIONS)
            consumer.subscribe("t")
            consumer.pause("t")  # holds the queue, consumes nothing: committed 0
            with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
                async with consumer:
                    await _wait_for(lambda: consumer.statistics().queues, "the queue")
                    await broker.send_many("t", [b"kept"] * 800, chunk=100)
                    assert inspect.xlen(_stream(broker)) == 800  # above max_length: kept
                    assert broker.statistics().forced_trims == 0
                    await broker.send_many("t", [b"over"] * 1200, chunk=100)
                    assert inspect.xlen(_stream(broker)) <= 1000 + 50 + 100
                    assert broker.statistics().forced_trims >= 900
                    first = await broker.min_offset(MQ)
                    assert first >= 850
                    consumer.resume("t")
                    await consumer.wait_caught_up(timeout=60)
                    stats = consumer.statistics()
            assert stats.trimmed_offsets == 1
            # CONSUME_FROM_FIRST_OFFSET (the default): from the first offset stored
            assert sorted(listener.offsets) == list(range(first, 2000))
            forced = [r for r in caplog.records if "hard max length" in r.getMessage()]
            assert forced
            assert all(r.levelno == logging.WARNING for r in forced)
            moved = [r.getMessage() for r in caplog.records if "no longer stored" in r.getMessage()]
            assert len(moved) == 1
            assert f"offset 0 of {MQ}" in moved[0]
            assert f"up to offset {first}" in moved[0]
        finally:
            await broker.delete_namespace()


@pytest.mark.parametrize(
    "where",
    [ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET, ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET],
)
async def test_a_stored_offset_trimmed_away_is_reported_and_resumed_per_consume_from_where(
    redis_url: str,
    namespace: str,
    caplog: pytest.LogCaptureFixture,
    where: ConsumeFromWhere,
) -> None:
    retention = StreamRetention(max_length=100, max_age=None, check_every=50)
    async with RedisBroker(redis_url, namespace=namespace, retention=retention) as broker:
        try:
            await broker.create_topic("t", 1)
            await broker.send_many("t", [b"x"] * 1000, chunk=100)  # no live group
            first = await broker.min_offset(MQ)
            assert 800 <= first <= 900
            store = MemoryOffsetStore()
            store.update_progress("g", MQ, QueueProgress(consume_offset=10))
            await store.persist_all("g", [MQ])
            listener = Offsets()
            options = ConsumerOptions(
                persist_consumer_offset_interval=0.1,
                pull_long_polling_timeout=0.5,
                consume_from_where=where,
            )
            consumer = PushConsumer("g", broker, listener, offset_store=store, options=options)
            consumer.subscribe("t")
            with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
                async with consumer:
                    await _wait_for(lambda: consumer.statistics().trimmed_offsets == 1, "report")
                    await broker.send("t", b"after", queue_id=0)
                    await consumer.wait_caught_up(timeout=60)
                    await _wait_for(
                        lambda: consumer.statistics().committed_offsets.get(MQ) == 1001, "commit"
                    )
            if where is ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET:
                assert sorted(listener.offsets) == list(range(first, 1001))
            else:
                assert listener.offsets == [1000]
            [report] = [r for r in caplog.records if "no longer stored" in r.getMessage()]
            assert report.levelno == logging.WARNING
            assert where.name in report.getMessage()
            assert (await store.read_progress("g", MQ)) == QueueProgress(consume_offset=1001)
        finally:
            await broker.delete_namespace()


async def test_attached_streams_are_never_trimmed(
    redis_url: str, namespace: str, inspect: redis.Redis
) -> None:
    retention = StreamRetention(max_length=10, hard_max_length=10, max_age=1.0, check_every=1)
    key = f"{namespace}:external"
    for i in range(500):
        inspect.xadd(key, {"body": str(i)})
    async with RedisBroker(redis_url, namespace=namespace, retention=retention) as broker:
        try:
            await broker.attach_stream("ext", key)
            listener = Offsets()
            consumer = PushConsumer("g", broker, listener, options=OPTIONS)
            consumer.subscribe("ext")
            async with consumer:
                await consumer.wait_caught_up(timeout=60)
                await anyio.sleep(0.3)  # commits and reports
            assert len(listener.offsets) == 500
            assert inspect.xlen(key) == 500
            assert not inspect.exists(f"{namespace}:floors:{{ext:0}}")
        finally:
            await broker.delete_namespace()


async def test_an_offset_trimmed_by_hand_is_reported_too(
    broker: RedisBroker, inspect: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """XTRIM by an operator (or a tool) is reported as retention's trimming is."""
    await broker.create_topic("t", 1)
    await broker.send_many("t", [b"x"] * 300, chunk=100)
    inspect.xtrim(_stream(broker), minid="201-0", approximate=False)  # offsets 0..199 gone
    store = MemoryOffsetStore()
    store.update_progress("g", MQ, QueueProgress(consume_offset=50))
    await store.persist_all("g", [MQ])
    listener = Offsets()
    consumer = PushConsumer("g", broker, listener, offset_store=store, options=OPTIONS)
    consumer.subscribe("t")
    with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
        async with consumer:
            await consumer.wait_caught_up(timeout=60)
            stats = consumer.statistics()
    assert sorted(listener.offsets) == list(range(200, 300))
    assert stats.trimmed_offsets == 1
    [report] = [r.getMessage() for r in caplog.records if "no longer stored" in r.getMessage()]
    assert "offset 50 of t#0" in report
    assert "up to offset 200" in report
    assert "150 messages" in report
