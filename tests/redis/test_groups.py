"""Consumer groups in one process over real Redis and PostgreSQL: joining and
leaving while consuming, a stolen lock, and the embedded broker's unchanged path."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import pytest
import redis

from offsetstore import MemoryOffsetStore, QueueProgress, SqlOffsetStore
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    GroupOptions,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PushConsumer,
)
from stagedconsumer._sources._redis_broker import RedisBroker

from ._events import Event, check_stages_and_barrier
from .group_worker import STAGES

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

FAST_GROUP = GroupOptions(
    lock_ttl=3.0, lock_renew_interval=0.3, rebalance_interval=0.3, member_ttl=1.0
)
OPTIONS = ConsumerOptions(
    persist_consumer_offset_interval=0.3, pull_long_polling_timeout=0.5, shutdown_timeout=5
)


class Recorder(MessageListenerStagedConcurrently):
    def __init__(self, name: int, events: list[Event], cost: float = 0.002) -> None:
        self.name = name
        self.events = events
        self.cost = cost
        self.lock = threading.Lock()

    def get_stage_definitions(self) -> Sequence[int]:
        return STAGES

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        for m in msgs:
            self.events.append(
                Event("S", m.queue_id, m.queue_offset, context.stage_index, time.time(), self.name)
            )
        await anyio.sleep(self.cost)
        for m in msgs:
            self.events.append(
                Event("E", m.queue_id, m.queue_offset, context.stage_index, time.time(), self.name)
            )


@pytest.fixture
async def group_broker(redis_url: str, namespace: str) -> AsyncIterator[RedisBroker]:
    async with RedisBroker(redis_url, namespace=namespace, group_options=FAST_GROUP) as broker:
        try:
            yield broker
        finally:
            await broker.delete_namespace()


async def _wait_for(condition: object, timeout: float = 15) -> None:
    with anyio.fail_after(timeout):
        while not condition():  # type: ignore[operator]
            await anyio.sleep(0.05)


@pytest.mark.postgres
@pytest.mark.slow
async def test_members_joining_and_leaving_while_consuming_lose_and_repeat_nothing(
    group_broker: RedisBroker, store_url: tuple[str, str], tmp_path: Path
) -> None:
    url, prefix = store_url
    broker = group_broker
    await broker.create_topic("t", 6)
    events: list[Event] = []
    stores = [SqlOffsetStore(url, table_prefix=prefix) for _ in range(3)]
    consumers = [
        PushConsumer("grp", broker, Recorder(i, events), offset_store=stores[i], options=OPTIONS)
        for i in range(3)
    ]
    for c in consumers:
        c.subscribe("t")
    total = 0

    async def produce(n: int) -> None:
        nonlocal total
        for _ in range(n // 60):
            await broker.send_many("t", [b"x"] * 60)
            total += 60
            await anyio.sleep(0.02)

    a, b, c = consumers
    async with a:
        assert len(a.assigned_queues) == 6  # alone: everything
        await produce(600)
        async with b:  # joins while a consumes
            await produce(600)
            await _wait_for(lambda: len(a.assigned_queues) == 3 and len(b.assigned_queues) == 3)
            assert set(a.assigned_queues).isdisjoint(b.assigned_queues)
            async with c:
                await produce(600)
                await _wait_for(lambda: all(len(x.assigned_queues) == 2 for x in consumers))
                await produce(600)
            # c left gracefully: its queues go back to a and b.
            await _wait_for(lambda: len(a.assigned_queues) + len(b.assigned_queues) == 6)
            await produce(600)
        await _wait_for(lambda: len(a.assigned_queues) == 6)
        await produce(600)
        await a.wait_caught_up(timeout=30)
    for store in stores:
        await store.aclose()

    finished = {(e.queue, e.offset) for e in events if e.kind == "E"}
    per_queue = total // 6
    assert finished == {(q, o) for q in range(6) for o in range(per_queue)}
    starts = [(e.queue, e.offset) for e in events if e.kind == "S"]
    # Graceful hand-overs drain and commit before unlocking: nothing runs twice.
    assert len(starts) == len(set(starts)) == total
    check_stages_and_barrier(events, queues=6, per_queue=per_queue)
    assert {e.pid for e in events} == {0, 1, 2}


@pytest.mark.slow
async def test_a_member_whose_lock_was_taken_releases_the_queue_without_committing(
    group_broker: RedisBroker,
    inspect: redis.Redis,
) -> None:
    broker = group_broker
    await broker.create_topic("t", 2)
    store = MemoryOffsetStore()
    events: list[Event] = []
    consumer = PushConsumer("grp", broker, Recorder(0, events), offset_store=store, options=OPTIONS)
    consumer.subscribe("t")
    coordinator = broker.group_coordinator()
    mq = MessageQueue("t", 0)
    async with consumer:
        assert consumer.assigned_queues == [mq, MessageQueue("t", 1)]
        await broker.send_many("t", [b"x"] * 100)
        await consumer.wait_caught_up(timeout=10)
        await anyio.sleep(0.5)  # a persist round
        # Another member takes the queue behind the consumer's back (its lock
        # expired during a pause, say) and claims the row with its newer epoch.
        inspect.delete(coordinator._lock_key("grp", mq))
        epoch = (await coordinator.lock("grp", "thief", [mq]))[mq]
        claimed = await store.claim("grp", mq, epoch)
        assert claimed is not None
        assert claimed == QueueProgress(consume_offset=50, stage_offsets=claimed.stage_offsets)
        await broker.send_many("t", [b"y"] * 20, queue_id=0)
        await _wait_for(lambda: mq not in consumer.assigned_queues, timeout=5)
        await anyio.sleep(1.0)
        # It keeps its other queue and does not take the stolen one back.
        assert consumer.assigned_queues == [MessageQueue("t", 1)]
        assert await coordinator.lock_owner("grp", mq) == "thief"
    stored = await store.list_progress("grp")
    assert stored[mq].consume_offset == 50  # the late commit was fenced off


async def test_embedded_broker_coordinates_groups_unless_told_not_to() -> None:
    assert MemoryBroker().group_coordinator() is not None  # in-process groups by default
    broker = MemoryBroker(coordinate_groups=False)
    broker.create_topic("t", 3)
    assert broker.group_coordinator() is None
    events: list[Event] = []
    first = PushConsumer("grp", broker, Recorder(0, events), options=OPTIONS)
    second = PushConsumer("grp", broker, Recorder(1, events), options=OPTIONS)
    first.subscribe("t")
    second.subscribe("t")
    async with first, second:  # without a coordinator, each owns every queue
        assert len(first.assigned_queues) == len(second.assigned_queues) == 3


class FailOnce(MessageListenerConcurrently):
    """Fails the first delivery of every message whose body starts with ``fail``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes, int, float]] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        context.delay_level_when_next_consume = 1  # 1 s
        for m in msgs:
            self.calls.append((m.topic, m.body, m.reconsume_times, time.monotonic()))
        if any(m.body.startswith(b"fail") and m.reconsume_times == 0 for m in msgs):
            return ConsumeConcurrentlyStatus.RECONSUME_LATER
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


@pytest.mark.slow
async def test_concurrent_member_retries_through_the_redis_retry_queue(
    group_broker: RedisBroker,
) -> None:
    broker = group_broker
    await broker.create_topic("t", 2)
    listener = FailOnce()
    consumer = PushConsumer("grp", broker, listener, options=OPTIONS)
    consumer.subscribe("t")
    async with consumer:
        assert MessageQueue("%RETRY%grp", 0) in consumer.assigned_queues
        await broker.send("t", b"ok-1")
        await broker.send("t", b"fail-1")
        await _wait_for(lambda: len(listener.calls) == 3, timeout=10)
        stats = consumer.statistics()
    first, retried = [c for c in listener.calls if c[1] == b"fail-1"]
    assert first[2] == 0
    assert retried[0] == "t"  # delivered under its original topic
    assert retried[2] == 1
    assert 0.5 <= retried[3] - first[3] <= 4.0  # delay level 1 = 1 s
    assert stats.sent_back == 1


class _CountingStore(MemoryOffsetStore):
    """Counts claims per queue; claims of ``block`` wait until cancelled."""

    def __init__(self, block: MessageQueue | None = None) -> None:
        super().__init__()
        self.claims: dict[MessageQueue, int] = {}
        self.block = block
        self.blocked = anyio.Event()

    async def claim(self, group: str, mq: MessageQueue, fence: int) -> QueueProgress | None:
        self.claims[mq] = self.claims.get(mq, 0) + 1
        if mq == self.block:
            self.blocked.set()
            await anyio.sleep_forever()
        return await super().claim(group, mq, fence)


@pytest.mark.slow
async def test_a_claim_refused_by_a_higher_fence_backs_off_and_is_reported(
    group_broker: RedisBroker, caplog: pytest.LogCaptureFixture
) -> None:
    broker = group_broker
    await broker.create_topic("t", 2)
    mq = MessageQueue("t", 0)
    store = _CountingStore()
    await store.claim("grp", mq, 2**62)  # a fence no epoch of this Redis reaches
    consumer = PushConsumer("grp", broker, Recorder(0, []), offset_store=store, options=OPTIONS)
    consumer.subscribe("t")
    async with consumer:
        await anyio.sleep(3.0)  # 10 rounds of 0.3 s
        assert consumer.assigned_queues == [MessageQueue("t", 1)]
        # 1 (the setup) + attempts at about 0, 0.3, 0.9 and 2.1 s: not one every round.
        assert store.claims[mq] <= 1 + 5
        stats = broker.group_coordinator().statistics()
    assert stats.aborted_takeovers >= 3
    assert mq in stats.backing_off
    reports = [r for r in caplog.records if r.levelno >= logging.ERROR and "gave up" in r.message]
    assert len(reports) == 1
    assert str(mq) in reports[0].message


async def test_a_shutdown_during_a_takeover_releases_that_lock(
    group_broker: RedisBroker,
) -> None:
    broker = group_broker
    await broker.create_topic("t", 2)
    coordinator = broker.group_coordinator()
    taken = MessageQueue("t", 1)
    assert await coordinator.lock("grp", "other", [taken])  # held elsewhere at first
    store = _CountingStore(block=taken)
    consumer = PushConsumer("grp", broker, Recorder(0, []), offset_store=store, options=OPTIONS)
    consumer.subscribe("t")
    async with consumer:
        assert consumer.assigned_queues == [MessageQueue("t", 0)]
        await coordinator.unlock("grp", "other", [taken])
        with anyio.fail_after(5):
            await store.blocked.wait()  # locked by the consumer, claiming
        assert await coordinator.lock_owner("grp", taken) == consumer.client_id
    # Released on the way out, not left to expire (lock_ttl is 3 s).
    assert await coordinator.lock_owner("grp", taken) is None
    assert await coordinator.lock_owner("grp", MessageQueue("t", 0)) is None
    assert coordinator.statistics().locks == 0


async def test_locking_a_queue_listed_twice_locks_it_once(group_broker: RedisBroker) -> None:
    # The rebalance loop asks for wanted + draining queues, which may overlap.
    coordinator = group_broker.group_coordinator()
    mq = MessageQueue("t", 0)
    first = await coordinator.lock("grp", "me", [mq, mq])
    assert list(first) == [mq]
    again = await coordinator.lock("grp", "me", [mq, MessageQueue("t", 1), mq])
    assert list(again) == [mq, MessageQueue("t", 1)]
    assert again[mq] == first[mq]  # renewed, same epoch
    await coordinator.leave("grp", "me")
    assert await coordinator.lock_owner("grp", mq) is None
    assert await coordinator.lock_owner("grp", MessageQueue("t", 1)) is None
