"""``stagedconsumer run`` over Redis and PostgreSQL, as real processes.

The application is tests/redis/run_app.py (a staged listener logging each handler
call's start and end, fsynced; a SqlOffsetStore). A SIGTERM in the middle of a run
must leave with exit status 0 and progress committed exactly up to what finished, so
that the next run replays nothing; ``--workers 3`` must split the queues and survive
a worker killed with SIGKILL (started again, nothing lost); ``/readyz`` must name a
broker that stopped answering.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from offsetstore import SqlOffsetStore
from stagedconsumer._sources._redis_broker import RedisBroker
from stagedconsumer.testing import assert_at_least_once
from tests._run_process import RunProcess, get

from ._events import Event, _message, call_log, check_stages_and_barrier, read_events
from ._server import RedisServer
from ._workers import lock_owners

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.postgres, pytest.mark.slow]

QUEUES = 4
PER_QUEUE = 120


@pytest.fixture
async def broker(redis_url: str, namespace: str) -> AsyncIterator[RedisBroker]:
    async with RedisBroker(redis_url, namespace=namespace) as broker:
        try:
            yield broker
        finally:
            await broker.delete_namespace()


@pytest.fixture
def processes() -> Iterator[list[RunProcess]]:
    started: list[RunProcess] = []
    yield started
    for process in started:
        process.kill()


@pytest.fixture
def config(
    tmp_path: Path, redis_url: str, namespace: str, store_url: tuple[str, str]
) -> dict[str, Any]:
    url, prefix = store_url
    return {
        "redis_url": redis_url,
        "namespace": namespace,
        "store_url": url,
        "table_prefix": prefix,
        "topic": "t",
        "group": "run",
        "log": str(tmp_path / "events.log"),
        "cost": 0.02,
        "threads": 4,
        "persist_interval": 0.5,
    }


async def _fill(broker: RedisBroker, queues: int = QUEUES, per_queue: int = PER_QUEUE) -> None:
    await broker.create_topic("t", queues)
    for q in range(queues):
        await broker.send_many("t", [b"x"] * per_queue, queue_id=q)


async def _committed(config: dict[str, Any]) -> dict[int, int]:
    store = SqlOffsetStore(config["store_url"], table_prefix=config["table_prefix"])
    try:
        progress = await store.list_progress(config["group"], "t")
    finally:
        await store.aclose()
    return {
        mq.queue_id: p.consume_offset for mq, p in progress.items() if p.consume_offset is not None
    }


async def _wait_all_committed(config: dict[str, Any], queues: int, target: int) -> None:
    deadline = time.monotonic() + 120  # a bound for a hung run only
    committed: dict[int, int] = {}
    while time.monotonic() < deadline:
        committed = await _committed(config)
        if len(committed) == queues and all(c == target for c in committed.values()):
            return
        await anyio.sleep(0.2)
    raise AssertionError(f"not everything committed: {committed}")


def _ends(events: list[Event]) -> int:
    return sum(1 for e in events if e.kind == "E")


async def test_sigterm_mid_run_commits_what_finished_and_a_restart_replays_none_of_it(
    broker: RedisBroker,
    config: dict[str, Any],
    tmp_path: Path,
    processes: list[RunProcess],
    anyio_backend: str,
) -> None:
    await _fill(broker)
    log = Path(config["log"])
    first = RunProcess(
        tmp_path, "tests.redis.run_app:make", "--backend", anyio_backend, config=config, name="1"
    )
    processes.append(first)
    first.wait_for("running tests.redis.run_app:make")
    while _ends(read_events([log])) < 40:
        await anyio.sleep(0.02)
    first.signal(signal.SIGTERM)
    assert first.wait() == 0, first.log()
    assert "leaving gracefully" in first.log()
    assert re.search(
        r"left in [\d.]+ s: \d+ handler call\(s\) were in flight, 0 abandoned", first.log()
    )

    # Every call started was let finish, and the committed offset of each queue is
    # exactly the end of what finished: the next owner starts where this one stopped.
    events = read_events([log])
    finished: dict[int, set[int]] = defaultdict(set)
    started: dict[int, set[int]] = defaultdict(set)
    for e in events:
        (finished if e.kind == "E" else started)[e.queue].add(e.offset)
    assert started == finished
    committed = await _committed(config)
    for q in range(QUEUES):
        assert finished[q] == set(range(committed.get(q, 0))), (q, committed)
    assert 0 < sum(committed.values()) < QUEUES * PER_QUEUE, committed  # stopped midway

    second = RunProcess(
        tmp_path, "tests.redis.run_app:make", "--backend", anyio_backend, config=config, name="2"
    )
    processes.append(second)
    await _wait_all_committed(config, QUEUES, PER_QUEUE)
    second.signal(signal.SIGTERM)
    assert second.wait() == 0, second.log()

    events = read_events([log])
    replayed = [
        e for e in events if e.kind == "S" and e.pid == second.pid and e.offset < committed[e.queue]
    ]
    assert not replayed
    check_stages_and_barrier(events, queues=QUEUES, per_queue=PER_QUEUE)
    sent = [_message(q, o) for q in range(QUEUES) for o in range(PER_QUEUE)]
    assert_at_least_once(call_log(events), sent, exactly_once=True)


async def test_workers_split_the_queues_and_a_killed_worker_is_started_again(
    broker: RedisBroker,
    config: dict[str, Any],
    tmp_path: Path,
    processes: list[RunProcess],
    anyio_backend: str,
) -> None:
    queues, per_queue = 6, 150
    lock_ttl = 2.0
    config["group_options"] = {
        "lock_ttl": lock_ttl,
        "lock_renew_interval": 0.4,
        "rebalance_interval": 0.4,
        "member_ttl": 1.2,
    }
    config["cost"] = 0.01
    await broker.create_topic("t", queues)
    run = RunProcess(
        tmp_path,
        "tests.redis.run_app:make",
        "--workers",
        "3",
        "--backend",
        anyio_backend,
        config=config,
    )
    processes.append(run)
    pids = [int(run.wait_for(rf"worker {i} started \(pid (\d+)\)").group(1)) for i in range(3)]
    group = config["group"]

    async def owners() -> dict[int, str | None]:
        return await lock_owners(broker, group, queues)

    # the three members split the six queues two by two
    deadline = time.monotonic() + 60
    while True:
        held = await owners()
        counts: dict[str | None, int] = defaultdict(int)
        for owner in held.values():
            counts[owner] += 1
        if None not in counts and sorted(counts.values()) == [2, 2, 2]:
            break
        assert time.monotonic() < deadline, held
        await anyio.sleep(0.1)
    assert {int(owner.split("@")[1]) for owner in counts if owner} == set(pids)

    for q in range(queues):
        await broker.send_many("t", [b"x"] * (per_queue // 2), queue_id=q)
    log = Path(config["log"])
    while _ends(read_events([log])) < 100:
        await anyio.sleep(0.02)
    victim = pids[1]
    os.kill(victim, signal.SIGKILL)
    run.wait_for(rf"worker 1 \(pid {victim}\) killed by SIGKILL; starting it again in")
    restarted = int(run.wait_for(r"worker 1 started \(pid (\d+)\)", count=2).group(1))
    assert restarted != victim
    for q in range(queues):
        await broker.send_many("t", [b"x"] * (per_queue - per_queue // 2), queue_id=q)
    await _wait_all_committed(config, queues, per_queue)
    # the restarted worker is a member again: it holds queues
    deadline = time.monotonic() + 60
    while restarted not in {int(o.split("@")[1]) for o in (await owners()).values() if o}:
        assert time.monotonic() < deadline
        await anyio.sleep(0.1)

    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.log()
    assert "passing SIGTERM on to 3 worker(s)" in run.log()
    assert run.log().count("exited with status 0") == 3
    events = read_events([log])
    assert {e.pid for e in events} >= {pids[0], pids[2], victim}
    check_stages_and_barrier(events, queues=queues, per_queue=per_queue)
    sent = [_message(q, o) for q in range(queues) for o in range(per_queue)]
    assert_at_least_once(call_log(events), sent)


async def test_readyz_names_a_broker_that_stopped_answering(
    config: dict[str, Any],
    redis_server: RedisServer,
    tmp_path: Path,
    processes: list[RunProcess],
    anyio_backend: str,
) -> None:
    config["redis_url"] = redis_server.url
    async with RedisBroker(redis_server.url, namespace=config["namespace"]) as broker:
        await _fill(broker, queues=2, per_queue=10)
    run = RunProcess(
        tmp_path,
        "tests.redis.run_app:make",
        "--backend",
        anyio_backend,
        "--http",
        "0",
        config=config,
    )
    processes.append(run)
    port = run.http_port()
    run.wait_for("running tests.redis.run_app:make")
    deadline = time.monotonic() + 60
    while (reply := get(port, "/readyz"))[0] != 200:  # until both queues are held
        assert time.monotonic() < deadline, reply
        await anyio.sleep(0.1)
    (consumer,) = json.loads(reply[1])["consumers"]
    assert consumer["broker"] == consumer["store"] == "ok"

    redis_server.kill()
    code, body = get(port, "/readyz")
    assert code == 503, body
    (consumer,) = json.loads(body)["consumers"]
    assert consumer["store"] == "ok"
    assert consumer["broker"] != "ok"
    assert any(problem.startswith("broker: ") for problem in consumer["problems"])
    assert get(port, "/healthz") == (200, "ok\n")  # alive: it retries on its own

    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.log()
