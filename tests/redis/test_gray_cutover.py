"""Gray release cut-over across processes, against real Redis and PostgreSQL.

Two normal and one gray consumer process (``group_worker``, staged listeners) share
a topic of 8 queues with ``gray_queue_ratio=0.25``: queues 6 and 7 are gray and
only the gray process consumes them. Then the gray process goes away, by SIGKILL
(its queues move once its locks expire) or by SIGTERM (a graceful hand-over), and
the normal processes take the gray queues over. Checked from the handler log:
nothing lost, each message in its stage, the stage barrier held across the move,
the gray queues handled only by the gray process until it went, and duplicates
only where at-least-once allows them (none on a graceful stop).
"""

from __future__ import annotations

import time

import anyio
import pytest

from offsetstore import SqlOffsetStore
from stagedconsumer._sources._redis_broker import RedisBroker

from ._events import check_stages_and_barrier, read_events, starts_by_message
from ._workers import Workers, lock_owners, produce
from .test_failover import GROUP_OPTIONS, LOCK_TTL, QUEUES
from .test_failover import _wait_all_committed as wait_all_committed
from .test_failover import broker as broker  # the fixtures

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.postgres, pytest.mark.slow]

PER_QUEUE = 300
GRAY_QUEUES = {6, 7}
GRAY = {"enable_gray_switch": True, "gray_tag": True, "gray_queue_ratio": 0.25}
NORMAL = {"enable_gray_switch": True, "gray_queue_ratio": 0.25}


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
async def test_gray_member_goes_away_and_normal_members_take_its_queues(
    how: str,
    broker: RedisBroker,
    store_url: tuple[str, str],
    workers: Workers,
) -> None:
    url, prefix = store_url
    await broker.create_topic("t", QUEUES)
    group = "cutover"
    workers.config.update(group=group, cost=0.01, persist_interval=0.5, group_options=GROUP_OPTIONS)
    base = dict(workers.config)
    store = SqlOffsetStore(url, table_prefix=prefix)
    try:
        for name, options in (("n1", NORMAL), ("n2", NORMAL), ("gray", GRAY)):
            workers.config = dict(base, consumer_options=options)
            workers.start(name)
        for name in ("n1", "n2", "gray"):
            workers.wait_ready(name)
        gray_id = workers.client_ids["gray"]
        assert gray_id.endswith("@gray[0.25]"), gray_id

        def split(owners: dict[int, str | None]) -> bool:
            gray_ok = all(owners[q] == gray_id for q in GRAY_QUEUES)
            normal = {owners[q] for q in range(QUEUES) if q not in GRAY_QUEUES}
            return gray_ok and None not in normal and gray_id not in normal and len(normal) == 2

        with anyio.fail_after(30):
            while not split(await lock_owners(broker, group, QUEUES)):
                await anyio.sleep(0.1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce, broker, QUEUES, PER_QUEUE, 1.0)
            await anyio.sleep(1.5)
            gone_at = time.monotonic()
            if how == "sigkill":
                workers.procs["gray"].kill()
                workers.procs["gray"].wait()
            else:
                assert workers.stop("gray") == 0, workers.stderr("gray")
            with anyio.fail_after(LOCK_TTL + 10):
                while True:
                    owners = await lock_owners(broker, group, QUEUES)
                    if all(owners[q] not in (None, gray_id) for q in GRAY_QUEUES):
                        break
                    await anyio.sleep(0.05)
            moved_after = time.monotonic() - gone_at
        print(f"gray queues moved {moved_after:.2f} s after the gray member went ({how})")
        if how == "sigterm":  # handed over at once, not after the lock expiry
            assert moved_after < LOCK_TTL, moved_after
        await wait_all_committed(store, group, PER_QUEUE, timeout=60)
        assert workers.stop("n1") == 0, workers.stderr("n1")
        assert workers.stop("n2") == 0, workers.stderr("n2")
    finally:
        workers.kill_all()
        await store.aclose()

    events = read_events(workers.log(n) for n in ("n1", "n2", "gray"))
    gray_pid = workers.procs["gray"].pid
    finished = {(e.queue, e.offset) for e in events if e.kind == "E"}
    assert finished == {(q, o) for q in range(QUEUES) for o in range(PER_QUEUE)}, "lost messages"
    check_stages_and_barrier(events, queues=QUEUES, per_queue=PER_QUEUE)
    # Before the gray member went, only it consumed the gray queues, and never the others.
    gray_events = [e for e in events if e.pid == gray_pid]
    assert gray_events, "the gray member handled nothing"
    assert {e.queue for e in gray_events} <= GRAY_QUEUES
    last_gray = max(e.time for e in gray_events)
    for e in events:
        if e.queue in GRAY_QUEUES and e.pid != gray_pid:
            assert e.time > last_gray, f"a normal member handled a gray queue too early: {e}"
    # Duplicates: none after a graceful stop; after a SIGKILL only on the gray queues,
    # first started by the gray member (its uncommitted in-flight window).
    for (queue, offset), starts in starts_by_message(events).items():
        if len(starts) == 1:
            continue
        assert how == "sigkill", f"{queue}:{offset} handled twice on a graceful hand-over"
        assert queue in GRAY_QUEUES, (queue, offset, starts)
        assert starts[0].pid == gray_pid, (queue, offset, starts)
