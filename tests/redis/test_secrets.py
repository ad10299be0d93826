"""A Redis password in the URL is never printed: every failure path (a refused
connection, a wrong password, a malformed URL, Redis restarting under a running
consumer and producer, the CLI's errors) and every description of the broker
(``repr``, ``url``, statistics) shows it as ``***``; the captured logs, stderr and
the exceptions' text (tracebacks included) are searched for it."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio
import pytest

from benchmarks._ports import free_ports
from offsetstore import MemoryOffsetStore, QueueProgress, SqlOffsetStore
from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    GroupOptions,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
    SourceError,
)
from stagedconsumer._cli import main
from stagedconsumer._sources._redis_broker import RedisBroker
from stagedconsumer._sources._redis_url import redact_url
from tests.redis._server import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

SECRET = "Sup3r-s3cret-Passw0rd"
"""The password of the test's Redis server (and, spelled differently, wrong ones)."""
WRONG = "Wr0ng-s3cret-Passw0rd"


@pytest.fixture
def secured_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, password=SECRET)
    server.start()
    try:
        yield server
    finally:
        server.kill()


def _url(port: int, password: str, user: str = "default") -> str:
    return f"redis://{user}:{password}@127.0.0.1:{port}/0"


def _shown(exc: BaseException) -> str:
    """Everything a traceback of ``exc`` prints (its chain included)."""
    return "".join(traceback.format_exception(exc))


def _assert_hidden(text: str) -> None:
    assert SECRET not in text
    assert WRONG not in text


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://default:pw@h/0", "redis://default:***@h/0"),
        ("rediss://u:p%40ss@h:6380", "rediss://u:***@h:6380"),
        ("redis://u:p@ss@h:1", "redis://u:***@h:1"),
        ("redis://h:1/0?password=pw&db=1", "redis://h:1/0?password=***&db=1"),
        ("redis://h:1/0", "redis://h:1/0"),
        ("redis://u@h:1/0", "redis://u@h:1/0"),
        ("unix:///tmp/r.sock", "unix:///tmp/r.sock"),
        ("redis://u:pw@[::1:1/0", "redis://u:***@[::1:1/0"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


async def test_no_password_in_exceptions_repr_or_statistics(
    secured_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    (closed,) = free_ports(1)
    port = secured_server.port
    failures: list[BaseException] = []
    for url in (
        _url(closed, SECRET),  # refused
        _url(port, WRONG),  # wrong password
        f"redis://:{WRONG}@127.0.0.1:{port}/0",  # wrong password, no user name
        f"redis://127.0.0.1:{port}/0?password={WRONG}",  # the password as a query parameter
    ):
        with pytest.raises(SourceError) as refused:
            async with RedisBroker(url, connect_timeout=0.5):
                pass
        failures.append(refused.value)
    with pytest.raises(ConfigurationError) as malformed:
        RedisBroker(f"redis://default:{SECRET}@127.0.0.1:notaport/0")
    failures.append(malformed.value)
    with pytest.raises(ConfigurationError) as not_a_string:
        RedisBroker(_url(port, SECRET).encode())  # type: ignore[arg-type]
    failures.append(not_a_string.value)
    for failure in failures:
        _assert_hidden(_shown(failure))
    assert "cannot connect to Redis at redis://default:***@127.0.0.1" in str(failures[0])

    async with RedisBroker(_url(port, SECRET), namespace="s") as broker:
        await broker.create_topic("t", 1)
        assert broker.url == f"redis://default:***@127.0.0.1:{port}/0"
        shown = f"redis://default:***@127.0.0.1:{port}/0"
        assert repr(broker) == f"RedisBroker({shown!r}, namespace='s')"
        _assert_hidden(f"{broker!r} {broker.statistics()!r} {broker.store_host()}")
    _assert_hidden(caplog.text)


class Collect(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.seen: list[int] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.seen.extend(m.queue_offset for m in msgs)


@pytest.mark.slow
async def test_no_password_in_the_logs_of_a_redis_restart(
    secured_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A consumer (pulls, rebalances, lock renewals, commits) and a producer (sends
    retried) keep running through a restart of Redis: each failure they log names
    the server with its password masked."""
    caplog.set_level(logging.DEBUG)
    group_options = GroupOptions(lock_ttl=4, lock_renew_interval=0.3, rebalance_interval=0.3)
    url = _url(secured_server.port, SECRET)
    listener = Collect()
    async with RedisBroker(url, namespace="r", group_options=group_options) as broker:
        await broker.create_topic("t", 1)
        consumer = PushConsumer(
            "grp",
            broker,
            listener,
            offset_store=MemoryOffsetStore(),
            options=ConsumerOptions(
                pull_long_polling_timeout=0.3, pull_time_delay_when_exception=0.1
            ),
        )
        consumer.subscribe("t")
        async with consumer:
            await broker.send("t", b"before")
            await consumer.wait_caught_up(timeout=10)
            await anyio.to_thread.run_sync(secured_server.stop)
            with anyio.fail_after(10):  # until the consumer has logged a failed pull
                while "pull of" not in caplog.text:
                    await anyio.sleep(0.05)
            async with anyio.create_task_group() as tg:
                # a send retried through the outage (its failures logged)
                tg.start_soon(broker.send, "t", b"during")
                with anyio.fail_after(10):
                    while "sending to t#0 failed" not in caplog.text:
                        await anyio.sleep(0.05)
                await anyio.to_thread.run_sync(secured_server.start)
            await consumer.wait_caught_up(timeout=20)
        assert len(listener.seen) == 2
        assert broker.connection_errors > 0
    assert "Redis at redis://default:***@127.0.0.1" in caplog.text
    _assert_hidden(caplog.text)
    out, err = capfd.readouterr()
    _assert_hidden(out + err)


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the CLI runs on asyncio
async def test_no_password_in_cli_errors(
    secured_server: RedisServer, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Each command that reads Redis, against a closed port (retried for the
    operator commands' 2 s) and with a wrong password."""
    store_url = f"sqlite:///{tmp_path / 'progress.db'}"
    store = SqlOffsetStore(store_url)
    try:
        store.update_progress("g", MessageQueue("t", 0), QueueProgress(consume_offset=1))
        await store.persist_all("g", [MessageQueue("t", 0)])
    finally:
        await store.aclose()
    (closed,) = free_ports(1)
    commands = []
    for url in (_url(closed, SECRET), _url(secured_server.port, WRONG)):
        redis = ["--redis", url]
        commands += [
            ["group", "show", "--group", "g", "--topic", "t", *redis],
            ["offsets", "show", "--store", store_url, "--group", "g", *redis],
            [
                "offsets",
                "reset",
                "--store",
                store_url,
                "--group",
                "g",
                "--topic",
                "t",
                "--to-offset",
                "0",
                "--yes",
                *redis,
            ],
            ["trace", "some-id", *redis],
        ]
    for args in commands:
        code = await anyio.to_thread.run_sync(main, args)
        out, err = capfd.readouterr()
        assert code == 1, (args, out, err)
        assert "redis://default:***@127.0.0.1" in err, (args, err)
        _assert_hidden(out + err)
