"""A member frozen past its lease starts nothing on the queues it may have lost.

Two consumer processes (``group_worker``) share a topic of 4 queues over the real
Redis and PostgreSQL. One is frozen with SIGSTOP (a long GC pause, a suspended VM)
for longer than ``lock_ttl``; the other takes its queues. When the frozen member
resumes, its workers must not hand a single batch of those queues to a handler
before the member has taken the queue again with a new lock: the README promises a
member consumes a queue only while it holds its lock.
"""

from __future__ import annotations

import signal
import time

import anyio
import pytest

from stagedconsumer._sources._redis_broker import RedisBroker

from ._events import read_events
from ._workers import Workers, lock_owners

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.postgres, pytest.mark.slow]

QUEUES = 4
LOCK_TTL = 2.0
GROUP_OPTIONS = {
    "lock_ttl": LOCK_TTL,
    "lock_renew_interval": 0.3,
    "rebalance_interval": 0.3,
    "member_ttl": 1.0,
}


async def _produce(broker: RedisBroker, stop: anyio.Event) -> None:
    """Keep every queue supplied, so each member always has cached work."""
    while not stop.is_set():
        for q in range(QUEUES):
            await broker.send_many("t", [b"x"] * 5, queue_id=q)
        await anyio.sleep(0.05)


async def test_a_member_frozen_past_its_lease_starts_no_handler_on_a_lost_queue(
    redis_url: str,
    namespace: str,
    workers: Workers,
) -> None:
    group = "lease"
    async with RedisBroker(redis_url, namespace=namespace) as broker:
        await broker.create_topic("t", QUEUES)
        workers.config.update(
            group=group,
            cost=0.02,
            persist_interval=0.2,
            group_options=GROUP_OPTIONS,
            log_takeovers=True,
        )
        try:
            for name in ("a", "b"):
                workers.start(name)
                workers.wait_ready(name)
            frozen = workers.client_ids["a"]
            with anyio.fail_after(20):  # the two share the queues
                while True:
                    holders = list((await lock_owners(broker, group, QUEUES)).values())
                    if holders.count(frozen) == QUEUES // 2 and None not in holders:
                        break
                    await anyio.sleep(0.1)
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_produce, broker, stop)
                await anyio.sleep(1.0)  # both consume
                lost = sorted(
                    q for q, o in (await lock_owners(broker, group, QUEUES)).items() if o == frozen
                )
                proc = workers.procs["a"]
                proc.send_signal(signal.SIGSTOP)
                try:
                    # The other member takes the frozen member's queues once its
                    # locks expire at the server.
                    with anyio.fail_after(LOCK_TTL + 10):
                        while True:
                            owners = await lock_owners(broker, group, QUEUES)
                            if all(owners[q] not in (None, frozen) for q in lost):
                                break
                            await anyio.sleep(0.05)
                    await anyio.sleep(0.5)
                finally:
                    resumed_at = time.time()
                    proc.send_signal(signal.SIGCONT)
                await anyio.sleep(3.0)  # it notices, rejoins and takes queues again
                stop.set()
            for name in ("a", "b"):
                assert workers.stop(name) == 0, workers.stderr(name)
        finally:
            workers.kill_all()
            await broker.delete_namespace()

    events = read_events([workers.log("a")])
    pid = workers.procs["a"].pid
    mine = [e for e in events if e.pid == pid]
    assert any(e.kind == "S" and e.time < resumed_at and e.queue in lost for e in mine)
    taken_again: dict[int, float] = {}
    for e in mine:
        if e.kind == "T" and e.time >= resumed_at:
            taken_again.setdefault(e.queue, e.time)
    late = [
        e
        for e in mine
        if e.kind == "S"
        and e.time >= resumed_at
        and e.queue in lost
        and not (e.queue in taken_again and e.time >= taken_again[e.queue])
    ]
    assert not late, (
        f"{len(late)} handler call(s) started on lost queues after the resume, before the"
        f" queue was taken again: first {late[0]}"
    )
