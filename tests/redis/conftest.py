"""Redis fixtures: every test gets its own key namespace and deletes only that.

The URL comes from ``STAGEDCONSUMER_TEST_REDIS_URL`` (default: this machine's
service). In CI an unreachable Redis fails the test instead of skipping it. The async
tests run on asyncio (the broker uses redis-py there) and on trio (coredis).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlparse

import anyio
import anyio.abc
import pytest
import redis

from stagedconsumer._sources._redis_broker import RedisBroker
from tests.conftest import require_service
from tests.offsetstore.conftest import POSTGRES_URL, drop_tables, require_url
from tests.redis._server import HangingProxy, RedisServer
from tests.redis._workers import Workers

REDIS_URL = os.environ.get("STAGEDCONSUMER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

pytestmark = pytest.mark.redis


@functools.cache
def redis_error(url: str) -> str | None:
    parsed = urlparse(url)
    try:
        with socket.create_connection(
            (parsed.hostname or "127.0.0.1", parsed.port or 6379), 3
        ) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError as exc:
        return str(exc)
    return None if reply.startswith(b"+PONG") else f"unexpected reply {reply!r}"


def require_redis(url: str = REDIS_URL) -> str:
    error = redis_error(url)
    require_service("Redis", error is None, f"{url}: {error}")
    return url


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own (``appendonly yes``), killed after the test."""
    require_service("redis-server binary", shutil.which("redis-server") is not None, "not on PATH")
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
async def hanging_proxy(redis_url: str) -> AsyncIterator[HangingProxy]:
    """A proxy to the test Redis that stops answering when told (``hang()``)."""
    parsed = urlparse(redis_url)
    proxy = HangingProxy(parsed.hostname or "127.0.0.1", parsed.port or 6379)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    proxy.port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, proxy.handle)
        yield proxy
        tg.cancel_scope.cancel()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every Redis test runs on both: redis-py serves asyncio, coredis trio."""
    return str(request.param)


@pytest.fixture
def inspect(redis_url: str) -> Iterator[redis.Redis]:
    """A synchronous redis-py client for looking at (or tampering with) what the
    broker stored, on either backend."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


def entry_id(reply: bytes | str) -> bytes:
    """The id an ``inspect.xadd`` returned: bytes, as ``inspect`` does not decode its
    replies (redis-py's annotations allow either)."""
    assert isinstance(reply, bytes)
    return reply


@pytest.fixture
def redis_url() -> str:
    return require_redis()


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def broker(redis_url: str, namespace: str) -> AsyncIterator[RedisBroker]:
    async with RedisBroker(redis_url, namespace=namespace) as broker:
        try:
            yield broker
        finally:
            await broker.delete_namespace()


@pytest.fixture
def workers(
    tmp_path: Path,
    redis_url: str,
    namespace: str,
    store_url: tuple[str, str],
    anyio_backend: str,
) -> Iterator[Workers]:
    """Consumer processes of a group (``tests.redis.group_worker``), killed after the
    test. Each gets the test's Redis, namespace, backend and offset store, topic
    ``t`` and 4 handler threads; the test adds the rest to ``workers.config`` (group,
    handler cost, persist interval, group options) before it starts them."""
    url, prefix = store_url
    config = {
        "redis_url": redis_url,
        "backend": anyio_backend,
        "namespace": namespace,
        "store_url": url,
        "table_prefix": prefix,
        "topic": "t",
        "threads": 4,
    }
    started = Workers(tmp_path, config)
    try:
        yield started
    finally:
        started.kill_all()


@pytest.fixture
def store_url() -> Iterator[tuple[str, str]]:
    """A PostgreSQL offset store for consumer processes: its URL and a table prefix of
    this test's own (the tables are dropped afterwards)."""
    url = require_url("PostgreSQL", POSTGRES_URL)
    prefix = f"r{uuid.uuid4().hex[:10]}_"
    yield url, prefix
    drop_tables(url, prefix)
