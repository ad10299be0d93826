"""RedisBroker on a Redis Cluster of the test's own: three masters with one replica
each on free ports of 127.0.0.1 (``redis-server --cluster-enabled yes``,
``redis-cli --cluster create``).

- every Lua script the broker and the coordinator run touches one hash slot
  (``CLUSTER KEYSLOT`` of each key), and the queues spread over the masters;
- sending and consuming staged through the cluster, on asyncio (redis-py's
  cluster client) and trio (coredis's);
- three consumer processes of a group while the master that serves queue 0 and the
  group's locks is SIGKILLed mid-run: its replica takes over, every message is
  consumed, each in its stage, and the stage barrier holds.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from offsetstore import MemoryOffsetStore, SqlOffsetStore
from stagedconsumer import ConsumerOptions, MessageQueue, PushConsumer
from stagedconsumer._sources._redis_broker import RedisBroker
from stagedconsumer._sources._redis_scripts import (
    DELAY_LUA,
    HEARTBEAT_LUA,
    LOCK_LUA,
    MIN_OFFSET_LUA,
    OFFSET_FOR_TIME_LUA,
    RELEASE_LUA,
    SEND_LUA,
    UNLOCK_LUA,
)
from tests.conftest import require_service
from tests.redis._server import RedisClusterServers

from ._events import Event, check_stages_and_barrier, read_events
from ._workers import Workers
from .test_groups import Recorder

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.slow]

OPTIONS = ConsumerOptions(
    persist_consumer_offset_interval=0.3, pull_long_polling_timeout=0.5, shutdown_timeout=5
)


def _start_cluster(directory: Path) -> RedisClusterServers:
    for binary in ("redis-server", "redis-cli"):
        require_service(f"{binary} binary", shutil.which(binary) is not None, "not on PATH")
    cluster = RedisClusterServers(directory)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """One cluster for the tests that leave it as it was."""
    cluster = _start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    """A cluster for a test that kills a node."""
    cluster = _start_cluster(tmp_path / "cluster")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def cluster_broker(
    redis_cluster: RedisClusterServers, namespace: str
) -> AsyncIterator[RedisBroker]:
    async with RedisBroker(redis_cluster.url, namespace=namespace, cluster=True) as broker:
        try:
            yield broker
        finally:
            await broker.delete_namespace()


SCRIPTS = {
    "SEND": SEND_LUA,
    "MIN_OFFSET": MIN_OFFSET_LUA,
    "OFFSET_FOR_TIME": OFFSET_FOR_TIME_LUA,
    "RELEASE": RELEASE_LUA,
    "DELAY": DELAY_LUA,
    "HEARTBEAT": HEARTBEAT_LUA,
    "LOCK": LOCK_LUA,
    "UNLOCK": UNLOCK_LUA,
}


async def test_every_script_touches_one_slot_and_queues_spread_over_the_masters(
    cluster_broker: RedisBroker, redis_cluster: RedisClusterServers, anyio_backend: str
) -> None:
    import hashlib

    broker = cluster_broker
    assert broker.client_library == ("redis-py" if anyio_backend == "asyncio" else "coredis")
    by_sha = {hashlib.sha1(lua.encode()).hexdigest(): name for name, lua in SCRIPTS.items()}
    calls: list[tuple[str, tuple[str, ...]]] = []
    connection = broker._connection
    execute = connection.execute

    async def recording(*args: Any, keys: Any = (0,)) -> Any:
        if args[0] in ("EVALSHA", "EVAL"):
            name = by_sha[args[1] if args[0] == "EVALSHA" else hashlib.sha1(
                args[1].encode()).hexdigest()]  # fmt: skip
            script_keys = tuple(str(k) for k in args[3 : 3 + int(args[2])])
            calls.append((name, script_keys))
        return await execute(*args, keys=keys)

    connection.execute = recording
    await broker.create_topic("t", 6)
    await broker.create_topic("u", 3)
    sent = [await broker.send("t", b"m%d" % i) for i in range(12)]
    await broker.send_many("u", [b"x"] * 9)
    mq = MessageQueue("t", 0)
    assert await broker.min_offset(mq) == 0
    assert await broker.offset_for_timestamp(mq, 0) == 0
    await broker.send_back("grp", sent[0], delay_level=1)
    await broker.pull(MessageQueue("%RETRY%grp", 0), 0, 10)
    coordinator = broker.group_coordinator()
    assert await coordinator.heartbeat("grp", "me") == ["me"]
    queues = [MessageQueue("t", q) for q in range(6)] + [MessageQueue("u", q) for q in range(3)]
    locked = await coordinator.lock("grp", "me", queues)
    assert len(locked) == 9
    await coordinator.unlock("grp", "me", queues)
    connection.execute = execute

    assert {name for name, _ in calls} == set(SCRIPTS)
    for name, script_keys in calls:
        slots = {redis_cluster.keyslot(key) for key in script_keys}
        assert len(slots) == 1, (name, script_keys, slots)
    # A group's coordination keys share the group's slot, whatever the topic.
    lock_keys = next(k for name, k in calls if name == "LOCK")
    assert len(lock_keys) == 18
    # The queues of a topic are on more than one master.
    masters = {redis_cluster.master_of(broker._stream_key("t", q)).port for q in range(6)}
    assert len(masters) > 1
    stored = [len(await broker.messages("t", q)) for q in range(6)]
    assert sum(stored) == 12


async def test_send_and_consume_staged_through_the_cluster(
    cluster_broker: RedisBroker, anyio_backend: str
) -> None:
    broker = cluster_broker
    await broker.create_topic("t", 4)
    events: list[Event] = []
    consumer = PushConsumer(
        "grp", broker, Recorder(0, events), offset_store=MemoryOffsetStore(), options=OPTIONS
    )
    consumer.subscribe("t")
    per_queue = 150  # through the stages of 40, 80 and 120 into the last one
    async with consumer:
        for q in range(4):
            await broker.send_many("t", [b"x"] * per_queue, queue_id=q, chunk=50)
        await consumer.wait_caught_up(timeout=60)
    finished = {(e.queue, e.offset) for e in events if e.kind == "E"}
    assert finished == {(q, o) for q in range(4) for o in range(per_queue)}
    starts = [(e.queue, e.offset) for e in events if e.kind == "S"]
    assert len(starts) == len(set(starts))  # one process, no failures: each once
    check_stages_and_barrier(events, queues=4, per_queue=per_queue)


async def test_a_script_across_slots_is_a_request_error_not_a_connection_loss(
    cluster_broker: RedisBroker,
) -> None:
    from stagedconsumer import SourceError
    from stagedconsumer._sources._redis_connection import RedisScript

    connection = cluster_broker._connection
    script = RedisScript(connection, "return 1")
    assert await connection.call("one slot", lambda: script(keys=["a{x}", "b{x}"])) == 1
    errors = connection.connection_errors
    with pytest.raises(SourceError) as caught:
        await connection.call("two slots", lambda: script(keys=["a{x}", "a{y}"]))
    assert not caught.value.retriable
    assert connection.connection_errors == errors


def test_a_cluster_broker_refuses_a_server_without_cluster_mode(redis_url: str) -> None:
    async def enter() -> None:
        async with RedisBroker(redis_url, cluster=True, connect_timeout=2):
            pass

    from stagedconsumer import SourceError

    with pytest.raises(SourceError, match="cannot connect"):
        anyio.run(enter)


# -- several processes, a master killed ----------------------------------------------------

QUEUES = 8
PER_QUEUE = 160
GROUP_OPTIONS = {
    "lock_ttl": 3.0,
    "lock_renew_interval": 0.5,
    "rebalance_interval": 0.5,
    "member_ttl": 1.5,
}


def _group_on(cluster: RedisClusterServers, namespace: str, node_port: int) -> str:
    """A group name whose coordination keys live on the master at ``node_port``."""
    for i in range(200):
        group = f"grp{i}"
        if cluster.master_of(f"{namespace}:members:{{{group}}}").port == node_port:
            return group
    raise AssertionError("no group name hashes to that master")


@pytest.mark.postgres
async def test_processes_consume_through_a_master_killed_mid_run(
    own_cluster: RedisClusterServers,
    namespace: str,
    store_url: tuple[str, str],
    workers: Workers,
) -> None:
    cluster = own_cluster
    url, prefix = store_url
    async with RedisBroker(cluster.url, namespace=namespace, cluster=True) as broker:
        await broker.create_topic("t", QUEUES)
        # Kill the master of queue 0, which serves the group's members and locks too.
        victim = cluster.master_of(broker._stream_key("t", 0))
        group = _group_on(cluster, namespace, victim.port)
        entry = cluster.nodes[0] if cluster.nodes[-1] is victim else cluster.nodes[-1]
        workers.config.update(
            redis_url=entry.url,
            cluster=True,
            group=group,
            cost=0.005,
            persist_interval=0.3,
            group_options=GROUP_OPTIONS,
        )
        store = SqlOffsetStore(url, table_prefix=prefix)
        names = ("a", "b", "c")
        try:
            for name in names:
                workers.start(name)
            for name in names:
                workers.wait_ready(name)
            coordinator = broker.group_coordinator()
            with anyio.fail_after(20):
                while len(await coordinator.members(group)) < 3:
                    await anyio.sleep(0.1)

            killed = anyio.Event()

            async def produce() -> None:
                chunk = 10
                for round_ in range(PER_QUEUE // chunk):
                    for q in range(QUEUES):
                        await broker.send_many("t", [b"x"] * chunk, queue_id=q)
                    if round_ == PER_QUEUE // chunk // 3:
                        assert victim.proc is not None
                        victim.proc.kill()  # SIGKILL, mid-run
                        killed.set()
                    await anyio.sleep(0.05)

            await produce()
            assert killed.is_set()
            victim.proc.wait()  # type: ignore[union-attr]
            victim.proc = None
            cluster.wait_ok(timeout=30)
            new_master = cluster.master_of(broker._stream_key("t", 0))
            assert new_master is not victim
            assert victim.port not in cluster.masters_seen_by(new_master.port)

            ends = {q: await broker.max_offset(MessageQueue("t", q)) for q in range(QUEUES)}
            # Sends are at least once: one retried after its reply was lost in the
            # fail-over is stored twice; every send returned is stored.
            assert all(end >= PER_QUEUE for end in ends.values()), ends
            deadline = time.monotonic() + 60
            while True:
                progress = await store.list_progress(group, "t")
                done = {mq.queue_id: p.consume_offset for mq, p in progress.items()}
                if done == ends:
                    break
                assert time.monotonic() < deadline, f"not everything committed: {done} {ends}"
                await anyio.sleep(0.2)
            for name in names:
                assert workers.stop(name) == 0, workers.stderr(name)
        finally:
            workers.kill_all()
            await store.aclose()
            await broker.delete_namespace()

    events = read_events(workers.log(n) for n in names)
    finished = {(e.queue, e.offset) for e in events if e.kind == "E"}
    expected = {(q, o) for q, end in ends.items() for o in range(end)}
    assert finished == expected, f"lost: {sorted(expected - finished)[:20]}"
    check_stages_and_barrier(events, ends=ends)
    assert len({e.pid for e in events}) >= 2  # shared by the processes


# -- the documented cluster example and the operator commands ----------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _readme_cluster_block() -> str:
    section = (ROOT / "docs" / "how-to" / "redis-cluster.md").read_text()
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_readme_cluster_example_consumes_every_message_in_its_stage(
    redis_cluster: RedisClusterServers, tmp_path: Path, backend: str
) -> None:
    import re
    import subprocess
    import sys

    code = _readme_cluster_block()
    namespace = f"shop-{uuid.uuid4().hex[:8]}"
    assert 'RedisBroker("redis://127.0.0.1:7000", cluster=True, namespace="shop")' in code
    code = code.replace("redis://127.0.0.1:7000", redis_cluster.url).replace(
        'namespace="shop"', f'namespace="{namespace}"'
    )
    if backend == "trio":
        code = code.replace("anyio.run(main)", 'anyio.run(main, backend="trio")')
    script = tmp_path / "example.py"
    script.write_text(code)
    try:
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        seen: dict[tuple[int, int], int] = {}
        for line in done.stdout.splitlines():
            match = re.fullmatch(r"orders#(\d+) (-?\d+) (\d+) b'order \d+'", line)
            assert match, line
            queue, stage, offset = map(int, match.groups())
            seen[queue, offset] = stage
        assert len(seen) == 200  # each message once
        for (_queue, offset), stage in seen.items():
            bounds = [10, 30, 100]
            expected = next((i for i, b in enumerate(bounds) if offset < b), -1)
            assert stage == expected, (offset, stage)
        shown = subprocess.run(
            [
                sys.executable, "-m", "stagedconsumer", "group", "show", "--group", "rewards",
                "--topic", "orders", "--redis", redis_cluster.url, "--redis-cluster",
                "--redis-namespace", namespace,
            ],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert shown.stdout.splitlines()[0] == "group rewards: 0 live member(s)"
        assert "orders#7: -" in shown.stdout  # the queues' locks were released
    finally:

        async def delete() -> None:
            async with RedisBroker(redis_cluster.url, namespace=namespace, cluster=True) as b:
                await b.delete_namespace()

        anyio.run(delete)
