"""Exactly-once effects and sparse progress under faults, across processes.

A group of consumer processes (``group_worker``, staged listeners) over the real
Redis, with a ``SqlOffsetStore`` on a PostgreSQL server of the test's own. While
messages flow: one member is SIGKILLed, another frozen (SIGSTOP) past the lock TTL
and woken (a zombie whose queues moved), a fourth joins, and the database crashes
and restarts (``pg_ctl stop -m immediate``). Then:

- handlers that commit one effect row per message with ``context.transact``: every
  message's row exists exactly once;
- plain handlers: what ran twice is what the killed and the frozen member had in a
  handler, or had finished since their last progress commit (sparse progress);
  with ``sparse_progress_max_ranges=0`` (the committed offset alone) more comes again.

Stages and the barrier hold in both. The counts are printed (``-s``).
"""

from __future__ import annotations

import os
import pwd
import signal
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import sqlalchemy as sa

from offsetstore import OffsetStoreError, SqlOffsetStore
from stagedconsumer import MessageQueue
from stagedconsumer._sources._redis_broker import RedisBroker
from tests._postgres_server import PostgresServer, postgres_binaries
from tests.conftest import require_service

from ._events import Event, check_stages_and_barrier, read_events, starts_by_message
from ._workers import FAST_GROUP_OPTIONS, Workers, produce

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(240)]

QUEUES = 8
PER_QUEUE = 300
GROUP_OPTIONS = FAST_GROUP_OPTIONS
LOCK_TTL = GROUP_OPTIONS["lock_ttl"]
PERSIST_INTERVAL = 0.5
COMMIT_WINDOW = PERSIST_INTERVAL + 2.0
"""How long before a fault a message may have finished and still not be committed:
the interval, plus a commit's own time on a loaded machine."""


@pytest.fixture
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of the test's own, which it may crash and restart."""
    binaries = postgres_binaries()
    require_service("PostgreSQL binaries (initdb)", binaries is not None, "none found")
    if os.geteuid() == 0:  # PostgreSQL runs as postgres then
        require_service("PostgreSQL's user", _has_user("postgres"), "no user postgres")
    assert binaries is not None
    server = PostgresServer(binaries)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture
def store_url(postgres: PostgresServer) -> tuple[str, str]:
    """The workers' offset store: on the test's own server (its data go with it)."""
    return postgres.url, "eo_"


async def _wait_all_committed(store: SqlOffsetStore, group: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    progress: dict[MessageQueue, Any] = {}
    while time.monotonic() < deadline:
        try:
            progress = await store.list_progress(group, "t")
        except OffsetStoreError:  # the server may still be recovering
            progress = {}
        if len(progress) == QUEUES and all(
            p.consume_offset == PER_QUEUE for p in progress.values()
        ):
            return
        await anyio.sleep(0.2)
    raise AssertionError(f"not everything committed: {progress}")


async def _run_with_faults(
    broker: RedisBroker, workers: Workers, postgres: PostgresServer, group: str
) -> dict[str, float]:
    """Start members a, b, c; while 2,400 messages are sent over 8 s: SIGKILL a,
    freeze b past the lock TTL, wake it, start d, crash and restart PostgreSQL. Wait
    until everything is committed and stop b, c, d. Returns when each fault hit."""
    await broker.create_topic("t", QUEUES)
    workers.config.update(
        group=group, cost=0.01, persist_interval=PERSIST_INTERVAL, group_options=GROUP_OPTIONS
    )
    faults: dict[str, float] = {}
    store = SqlOffsetStore(postgres.url, table_prefix="eo_")
    try:
        for name in ("a", "b", "c"):
            workers.start(name)
        for name in ("a", "b", "c"):
            workers.wait_ready(name)
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce, broker, QUEUES, PER_QUEUE, 8.0)
            await anyio.sleep(1.0)
            faults["kill a"] = time.time()
            workers.procs["a"].kill()  # SIGKILL mid-stream
            workers.procs["a"].wait()
            await anyio.sleep(0.5)
            faults["freeze b"] = time.time()
            workers.procs["b"].send_signal(signal.SIGSTOP)  # past its leases
            await anyio.sleep(LOCK_TTL + 1.5)
            # Woken before d starts: a new owner's claim waits for a transaction b
            # froze in (it holds the queue's row), so d's start could wait on b.
            workers.procs["b"].send_signal(signal.SIGCONT)  # a zombie wakes up
            faults["wake b"] = time.time()
            workers.start("d")
            await anyio.to_thread.run_sync(workers.wait_ready, "d")
            faults["crash database"] = time.time()
            await anyio.to_thread.run_sync(postgres.restart, 1.0)
            faults["database back"] = time.time()
        await _wait_all_committed(store, group, timeout=90)
        for name in ("b", "c", "d"):
            assert workers.stop(name) == 0, workers.stderr(name)
    finally:
        workers.kill_all()
        await store.aclose()
    return faults


def _reruns(events: list[Event]) -> dict[tuple[int, int], list[Event]]:
    return {k: s for k, s in starts_by_message(events).items() if len(s) > 1}


async def test_effects_exactly_once_through_kills_a_frozen_member_and_a_database_crash(
    broker: RedisBroker,
    postgres: PostgresServer,
    workers: Workers,
) -> None:
    """Handlers commit one effect row per message with ``context.transact``."""
    table = "eo_effects"
    engine = sa.create_engine(postgres.url, pool_pre_ping=True)  # across the crash
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(f"CREATE TABLE {table} (queue_id INT, queue_offset BIGINT, pid INT)")
            )
        workers.config.update(effects_table=table)
        faults = await _run_with_faults(broker, workers, postgres, "effects")
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    f"SELECT queue_id, queue_offset, count(*) FROM {table}"
                    " GROUP BY queue_id, queue_offset"
                )
            ).all()
    finally:
        engine.dispose()
    counts = {(int(q), int(o)): int(n) for q, o, n in rows}
    assert set(counts) == {(q, o) for q in range(QUEUES) for o in range(PER_QUEUE)}, "lost"
    assert {k: n for k, n in counts.items() if n != 1} == {}, "an effect committed twice"
    events = read_events(workers.log(n) for n in ("a", "b", "c", "d"))
    check_stages_and_barrier(events, queues=QUEUES, per_queue=PER_QUEUE)
    reruns = _reruns(events)
    start = faults["kill a"] - 1.0
    when = ", ".join(f"{k} +{v - start:.1f} s" for k, v in faults.items())
    print(
        f"\ntransact: {sum(counts.values())} effect rows for {len(counts)} messages;"
        f" {len(reruns)} messages handed to a handler again"
        f" ({sum(len(s) - 1 for s in reruns.values())} starts); {when}"
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the runtime's, not the effects'
@pytest.mark.parametrize("max_ranges", [128, 0], ids=["sparse", "offset-only"])
async def test_plain_handlers_run_again_only_what_was_in_flight_or_uncommitted(
    broker: RedisBroker,
    postgres: PostgresServer,
    workers: Workers,
    max_ranges: int,
) -> None:
    """Plain handlers: a message runs again only if the killed or the frozen member
    had it in a handler, or finished it after its last commit (sparse progress)."""
    workers.config.update(consumer_options={"sparse_progress_max_ranges": max_ranges})
    faults = await _run_with_faults(broker, workers, postgres, "plain")
    events = read_events(workers.log(n) for n in ("a", "b", "c", "d"))
    finished = {(e.queue, e.offset) for e in events if e.kind == "E"}
    assert finished == {(q, o) for q in range(QUEUES) for o in range(PER_QUEUE)}, "lost"
    check_stages_and_barrier(events, queues=QUEUES, per_queue=PER_QUEUE)
    faulted = {workers.procs["a"].pid: faults["kill a"], workers.procs["b"].pid: faults["freeze b"]}
    # A member that hands a queue over (d joins, b wakes) while the database is down
    # cannot commit it: what it finished since its last commit comes again.
    outage = (faults["crash database"] - COMMIT_WINDOW, faults["database back"] + 3.0)
    ends = {(e.pid, e.queue, e.offset): e.time for e in events if e.kind == "E"}
    in_flight = uncommitted = in_outage = older = 0
    for (queue, offset), starts in _reruns(events).items():
        first = starts[0]
        end = ends.get((first.pid, queue, offset))
        fault = faulted.get(first.pid)
        if fault is not None and first.time <= fault and (end is None or end > fault):
            in_flight += 1  # in a handler when its member was killed or frozen
        elif fault is not None and end is not None and 0 <= fault - end < COMMIT_WINDOW:
            uncommitted += 1  # finished since the member's last commit
        elif end is not None and outage[0] <= end <= outage[1]:
            in_outage += 1
        else:
            older += 1
    print(
        f"\nplain, sparse_progress_max_ranges={max_ranges}: messages run again:"
        f" {in_flight + uncommitted + in_outage + older} = {in_flight} in flight at a kill"
        f" or freeze + {uncommitted} finished after the member's last commit +"
        f" {in_outage} handed over while the database was down + {older} others"
    )
    if max_ranges:
        assert older == 0, "sparse progress let a message that finished before come again"
