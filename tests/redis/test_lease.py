"""A member frozen past its lease starts nothing on the queues it may have lost.

Two consumer processes (``group_worker``) share a topic of 4 queues over the real
Redis and PostgreSQL. One is frozen with SIGSTOP (a long GC pause, a suspended VM)
for longer than ``lock_ttl``; the other takes its queues. When the frozen member
resumes, its workers must not hand a single batch of those queues to a handler
before the member has taken the queue again with a new lock: the README promises a
member consumes a queue only while it holds its lock.

The frozen member reaches Redis through a proxy that stops forwarding just before
the freeze, and commits rarely (a commit refused for the fence of the member that
took its queues would tell it), so that once resumed it cannot learn that it lost its
locks:
only its lease deadline (the dispatcher's check before every batch, and the handler
thread's right before the call) keeps it from starting handlers on the cached
messages of those queues, which it has plenty of (the producer sends faster than the
group consumes). Without those checks it starts some at once: in every run on
asyncio, whose event loop runs the handler threads' completions before the timers
that end the membership's round (cut short by the freeze, its timeout passed);
trio may run that round's timeout first, and then the member drops the queues
before its workers ask.
"""

from __future__ import annotations

import signal
import time

import anyio
import pytest

from stagedconsumer._sources._redis_broker import RedisBroker

from ._events import read_events
from ._server import HangingProxy
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
    """Keep every queue supplied faster than the group consumes (4 threads of 20 ms
    handlers per member), so each member always has cached work."""
    while not stop.is_set():
        for q in range(QUEUES):
            await broker.send_many("t", [b"x"] * 20, queue_id=q)
        await anyio.sleep(0.05)


async def test_a_member_frozen_past_its_lease_starts_no_handler_on_a_lost_queue(
    redis_url: str,
    namespace: str,
    workers: Workers,
    hanging_proxy: HangingProxy,
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
            # "a" reaches Redis through the proxy, and commits rarely: a commit refused
            # with the fence of the member that took its queues would tell it too.
            for name, url, persist in (("a", hanging_proxy.url, 60.0), ("b", redis_url, 0.2)):
                workers.config.update(redis_url=url, persist_interval=persist)
                workers.start(name)
                await anyio.to_thread.run_sync(workers.wait_ready, name)
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
                hanging_proxy.hang()  # from now on "a" hears nothing from Redis
                await anyio.sleep(0.2)  # a reply already under way is swallowed too
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
                # Its handlers' sleeps end at once, and its workers ask for more: the
                # lease checks alone keep them off the lost queues (Redis cannot tell
                # it before its calls time out, after socket_timeout = 10 s).
                await anyio.sleep(3.0)
                stop.set()
            proc.kill()  # it cannot leave: Redis is out of its reach
            proc.wait()
            assert workers.stop("b") == 0, workers.stderr("b")
        finally:
            workers.kill_all()
            await broker.delete_namespace()

    events = read_events([workers.log("a")])
    pid = workers.procs["a"].pid
    mine = [e for e in events if e.pid == pid]
    assert any(e.kind == "S" and e.time < resumed_at and e.queue in lost for e in mine)
    assert not any(e.kind == "T" and e.time >= resumed_at for e in mine)  # it took nothing
    late = [e for e in mine if e.kind == "S" and e.time >= resumed_at and e.queue in lost]
    assert not late, (
        f"{len(late)} handler call(s) started on lost queues after the resume: first {late[0]}"
    )
