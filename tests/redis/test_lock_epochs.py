"""Queue lock epochs keep growing when Redis restarts empty (no persistence).

An epoch is the fencing token a member claims a queue's stored progress with: the
store refuses a claim whose token is below the stored fence. A Redis that comes back
without its data has lost every epoch counter; the lock script floors each new epoch
at the server's clock in milliseconds, so the next holder's epoch is still above the
last one's, and its claim is not refused as stale.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from benchmarks._redis_cluster import wait_for_pong
from offsetstore import QueueProgress, SqlOffsetStore
from stagedconsumer import MessageQueue
from stagedconsumer._sources._redis_broker import RedisBroker
from tests.conftest import require_service
from tests.redis._server import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

MQ = MessageQueue("orders", 0)


class EphemeralRedisServer(RedisServer):
    """A private ``redis-server`` that keeps nothing on disk: a restart empties it."""

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.dir),
                "--appendonly", "no",
                "--save", "",
                "--logfile", str(self.dir / "redis.log"),
            ],
        )  # fmt: skip
        wait_for_pong(self.port, self.dir / "redis.log")


@pytest.fixture
def ephemeral_redis(tmp_path: Path) -> Iterator[EphemeralRedisServer]:
    require_service("redis-server binary", shutil.which("redis-server") is not None, "not on PATH")
    server = EphemeralRedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


async def _lock(url: str, namespace: str, client_id: str) -> int:
    async with RedisBroker(url, namespace=namespace) as broker:
        coordinator = broker.group_coordinator()
        assert await coordinator.lock_owner("g", MQ) is None  # nobody holds it
        return (await coordinator.lock("g", client_id, [MQ]))[MQ]


async def test_epochs_grow_across_a_restart_that_lost_every_key(
    ephemeral_redis: EphemeralRedisServer, tmp_path: Path
) -> None:
    namespace = f"t{uuid.uuid4().hex[:8]}"
    store = SqlOffsetStore(f"sqlite:///{tmp_path / 'progress.db'}")
    try:
        first = await _lock(ephemeral_redis.url, namespace, "member-a")
        assert await store.claim("g", MQ, first) is None
        store.update_progress("g", MQ, QueueProgress(consume_offset=7))
        await store.persist_fenced("g", {MQ: first})
        await anyio.to_thread.run_sync(ephemeral_redis.stop)
        await anyio.to_thread.run_sync(ephemeral_redis.start)  # back, empty
        dbsize = await anyio.run_process(["redis-cli", "-p", str(ephemeral_redis.port), "dbsize"])
        assert dbsize.stdout.strip() == b"0"  # the epoch counter is gone too
        second = await _lock(ephemeral_redis.url, namespace, "member-b")
        assert second > first, (first, second)
        # not fenced off as stale: the new holder resumes where the last one stopped
        assert await store.claim("g", MQ, second) == QueueProgress(consume_offset=7)
    finally:
        await store.aclose()
