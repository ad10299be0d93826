"""Consumer groups across processes, against real Redis and PostgreSQL.

Three consumer processes (``group_worker``) share a topic of 8 queues with staged
listeners; one is SIGKILLed mid-stream. Its queues must move to the others within
the lock expiry, and afterwards: every message finished, none lost, each message
ran in its stage, the stage barrier held on every queue across the move, and the
only duplicates are messages of the killed process's queues in its in-flight window.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from offsetstore import SqlOffsetStore
from stagedconsumer import MessageQueue
from stagedconsumer._sources._redis_broker import RedisBroker

from ._events import check_stages_and_barrier, read_events, starts_by_message
from ._workers import FAST_GROUP_OPTIONS, Workers, lock_owners, produce

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.postgres, pytest.mark.slow]

QUEUES = 8
PER_QUEUE = 300
GROUP_OPTIONS = FAST_GROUP_OPTIONS
LOCK_TTL = GROUP_OPTIONS["lock_ttl"]


@pytest.fixture
async def broker(redis_url: str, namespace: str) -> AsyncIterator[RedisBroker]:
    async with RedisBroker(redis_url, namespace=namespace) as broker:
        try:
            yield broker
        finally:
            await broker.delete_namespace()


async def _wait_all_committed(
    store: SqlOffsetStore, group: str, target: int, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    progress: dict[MessageQueue, Any] = {}
    while time.monotonic() < deadline:
        progress = await store.list_progress(group, "t")
        if len(progress) == QUEUES and all(p.consume_offset == target for p in progress.values()):
            return
        await anyio.sleep(0.2)
    raise AssertionError(f"not everything committed: {progress}")


async def test_sigkilled_member_queues_move_within_lock_expiry_nothing_lost(
    broker: RedisBroker,
    store_url: tuple[str, str],
    workers: Workers,
) -> None:
    url, prefix = store_url
    await broker.create_topic("t", QUEUES)
    group = "failover"
    workers.config.update(group=group, cost=0.01, persist_interval=0.5, group_options=GROUP_OPTIONS)
    store = SqlOffsetStore(url, table_prefix=prefix)
    try:
        for name in ("a", "b", "c"):
            workers.start(name)
        for name in ("a", "b", "c"):
            workers.wait_ready(name)
        # Wait for the three to share the queues (3/3/2).
        with anyio.fail_after(20):
            while (
                len({o for o in (await lock_owners(broker, group, QUEUES)).values() if o}) != 3
                or None in (await lock_owners(broker, group, QUEUES)).values()
            ):
                await anyio.sleep(0.1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce, broker, QUEUES, PER_QUEUE, 1.0)
            await anyio.sleep(1.5)
            owners = await lock_owners(broker, group, QUEUES)
            victim = workers.client_ids["a"]
            victim_queues = sorted(q for q, o in owners.items() if o == victim)
            assert victim_queues, owners
            fences_before = _stored_fence(url, prefix, group)
            workers.procs["a"].kill()
            killed_at = time.monotonic()
            workers.procs["a"].wait()
            moved_at: dict[int, float] = {}
            with anyio.fail_after(LOCK_TTL + 60):  # generous: a loaded machine
                while len(moved_at) < len(victim_queues):
                    owners = await lock_owners(broker, group, QUEUES)
                    for q in victim_queues:
                        if q not in moved_at and owners[q] not in (None, victim):
                            moved_at[q] = time.monotonic() - killed_at
                    await anyio.sleep(0.05)
        # Moved once the lock expired (LOCK_TTL after the last renewal, plus a lock-retry
        # round of the new owner): printed, not bounded (scheduling on a busy machine).
        print(f"victim queues {victim_queues} moved after {moved_at}")

        await _wait_all_committed(store, group, PER_QUEUE, timeout=120)
        fences_after = _stored_fence(url, prefix, group)
        assert workers.stop("b") == 0, workers.stderr("b")
        assert workers.stop("c") == 0, workers.stderr("c")
    finally:
        workers.kill_all()
        await store.aclose()

    # Every queue's row was claimed with a lock epoch; a moved queue's fence is its new
    # owner's epoch, above the killed member's (whose late writes it refuses); no fence
    # ever went back.
    assert set(fences_before) == set(fences_after) == set(range(QUEUES)), fences_before
    assert all(fences_before[q] > 0 for q in range(QUEUES)), fences_before
    for q in range(QUEUES):
        assert fences_after[q] >= fences_before[q], (q, fences_before, fences_after)
    for q in victim_queues:
        assert fences_after[q] > fences_before[q], (q, fences_before, fences_after)

    events = read_events(workers.log(n) for n in ("a", "b", "c"))
    victim_pid = workers.procs["a"].pid
    finished = {(e.queue, e.offset) for e in events if e.kind == "E"}
    assert finished == {(q, o) for q in range(QUEUES) for o in range(PER_QUEUE)}, "lost messages"
    check_stages_and_barrier(events, queues=QUEUES, per_queue=PER_QUEUE)
    for (queue, offset), starts in starts_by_message(events).items():
        if len(starts) == 1:
            continue
        pids = [s.pid for s in starts]
        # Never twice in one process (no failures here), and only across the move.
        assert len(set(pids)) == len(pids), (queue, offset, starts)
        assert queue in victim_queues, (queue, offset, starts)
        assert pids[0] == victim_pid, (queue, offset, starts)
    # The duplicates of a queue are the victim's in-flight window: from where the new
    # owner resumed (the last committed offset) up to the victim's last start.
    for queue in victim_queues:
        victim_starts = [
            e.offset for e in events if e.kind == "S" and e.queue == queue and e.pid == victim_pid
        ]
        others = [
            e.offset for e in events if e.kind == "S" and e.queue == queue and e.pid != victim_pid
        ]
        if not victim_starts or not others:
            continue
        resumed = min(others)
        dups = {o for o in others if o in set(victim_starts)}
        assert all(resumed <= o <= max(victim_starts) for o in dups)
        # Committed at most persist_interval before the kill: a bounded window.
        assert len(dups) <= 400, (queue, len(dups))
        print(f"queue {queue}: {len(dups)} duplicate(s), resumed at {resumed}")


def _stored_fence(url: str, prefix: str, group: str) -> dict[int, int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(f"SELECT queue_id, fence FROM {prefix}progress WHERE consumer_group = :g"),
                {"g": group},
            ).all()
    finally:
        engine.dispose()
    return {int(q): int(f) for q, f in rows}
