"""Entering a RedisBroker while Redis is down: a refused connection is retried with
backoff within ``connect_timeout`` (one WARNING per failed attempt), so a member
started during a Redis restart waits for it; what waiting cannot fix (refused
credentials) fails at once."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import anyio
import pytest

from stagedconsumer import SourceError
from stagedconsumer._sources._redis_broker import RedisBroker
from tests.redis._server import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


def _attempts(caplog: pytest.LogCaptureFixture) -> list[int]:
    return [
        int(match[1])
        for record in caplog.records
        if (match := re.match(r"Redis not reachable yet \(attempt (\d+):", record.getMessage()))
    ]


async def test_entering_waits_for_a_redis_that_starts_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stagedconsumer.redis")
    server = RedisServer(tmp_path)  # its port chosen, nothing listening yet
    entered = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:

            async def enter() -> None:
                async with RedisBroker(server.url, namespace="late", connect_timeout=60) as broker:
                    entered.set()
                    await broker.create_topic("t", 1)
                    message = await broker.send("t", b"x")
                    assert message.queue_offset == 0

            tg.start_soon(enter)
            with anyio.fail_after(30):  # until two attempts failed and were logged
                while len(_attempts(caplog)) < 2:
                    await anyio.sleep(0.01)
            assert not entered.is_set()
            await anyio.to_thread.run_sync(server.start)
            with anyio.fail_after(30):
                await entered.wait()
    finally:
        server.kill()
    attempts = _attempts(caplog)
    assert attempts == list(range(1, len(attempts) + 1))  # each attempt logged once
    (record,) = [r for r in caplog.records if r.getMessage().startswith("connected to Redis")]
    assert f"(attempt {len(attempts) + 1})" in record.getMessage()
    for record in caplog.records[:-1]:  # the reason: refused (asyncio's words, or the OS's)
        assert re.search("Connect call failed|Connection refused", record.getMessage())


async def test_a_redis_that_stays_down_fails_after_connect_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="stagedconsumer.redis")
    server = RedisServer(tmp_path)  # never started
    with pytest.raises(SourceError) as failed:
        async with RedisBroker(server.url, connect_timeout=0.5):
            pass
    assert failed.value.retriable
    message = str(failed.value)
    assert message.startswith(f"cannot connect to Redis at {server.url}")
    attempts = _attempts(caplog)
    assert attempts == list(range(1, len(attempts) + 1))
    assert f"(attempt {len(attempts) + 1} within connect_timeout 0.5 s)" in message


async def test_refused_credentials_fail_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="stagedconsumer.redis")
    server = RedisServer(tmp_path, password="right")
    server.start()
    try:
        for url in (
            f"redis://default:wrong@127.0.0.1:{server.port}/0",
            f"redis://127.0.0.1:{server.port}/0",  # no password where one is needed
        ):
            with pytest.raises(SourceError) as refused:
                async with RedisBroker(url, connect_timeout=60):
                    pass
            assert not refused.value.retriable
            assert "cannot connect to Redis at" in str(refused.value)
    finally:
        server.kill()
    assert _attempts(caplog) == []  # never retried
