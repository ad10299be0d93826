"""Redis ACLs: a producer, a two-member consumer group (with retries) and the
operator commands run under exactly the documented minimal ACL of one namespace on a
redis-server of the test's own; a user missing a command or outside the key pattern
fails entering the broker, naming the commands and the pattern; a command refused
later (also from inside a Lua script) is not retriable and is named."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import anyio
import pytest

from offsetstore import MemoryOffsetStore, SqlOffsetStore
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumerOptions,
    GroupOptions,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
    SourceError,
    SourcePermissionError,
)
from stagedconsumer._cli import main
from stagedconsumer._sources._redis_acl import (
    CONDITIONAL_COMMANDS,
    acl_rules,
    required_commands,
)
from stagedconsumer._sources._redis_broker import RedisBroker
from tests.conftest import require_service
from tests.redis._server import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

NS = "app"
ADMIN = "admin-pw"
APP = "app-pw"
FAST_GROUP = GroupOptions(
    lock_ttl=3.0, lock_renew_interval=0.3, rebalance_interval=0.3, member_ttl=1.0
)


class ACLServer:
    def __init__(self, directory: Path) -> None:
        acl = directory / "users.acl"
        acl.write_text(
            f"user default on >{ADMIN} ~* &* +@all\n"
            f"user app on >{APP} {acl_rules(NS)}\n"
            f"user nokeys on >{APP} resetkeys ~other:* -@all"
            f" {' '.join('+' + c.lower() for c in required_commands())}\n"
            f"user notime on >{APP} {acl_rules(NS)} -time\n"
        )
        self.server = RedisServer(directory, "--aclfile", str(acl), password=ADMIN)

    def url(self, user: str) -> str:
        return f"redis://{user}:{APP}@127.0.0.1:{self.server.port}/0"

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            ["redis-cli", "-p", str(self.server.port), "--no-auth-warning", "-a", ADMIN, *args],
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout


@pytest.fixture
def acl_server(tmp_path: Path) -> Iterator[ACLServer]:
    require_service("redis-server binary", shutil.which("redis-server") is not None, "not on PATH")
    server = ACLServer(tmp_path)
    server.server.start()
    try:
        yield server
    finally:
        server.server.kill()


def _commands_run(server: ACLServer) -> set[str]:
    """The commands the server ran since its start (``INFO commandstats``), less the
    connection handshake and the test's own."""
    names = set()
    for line in server.cli("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_"):
            names.add(line.split(":", 1)[0].removeprefix("cmdstat_").split("|", 1)[0].upper())
    return names - {"HELLO", "AUTH", "CLIENT", "INFO", "ACL", "CONFIG", "COMMAND", "SELECT"}


class Flaky(MessageListenerConcurrently):
    """Asks for a retry of every message with an even body at its first delivery."""

    def __init__(self) -> None:
        self.seen: list[tuple[bytes, int]] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        self.seen.extend((m.body, m.reconsume_times) for m in msgs)
        if any(int(m.body) % 2 == 0 and m.reconsume_times == 0 for m in msgs):
            return ConsumeConcurrentlyStatus.RECONSUME_LATER
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


@pytest.mark.slow
async def test_producer_group_and_cli_under_the_minimal_acl(
    acl_server: ACLServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = acl_server.url("app")
    store_url = f"sqlite:///{tmp_path / 'progress.db'}"
    options = ConsumerOptions(persist_consumer_offset_interval=0.2, pull_long_polling_timeout=0.3)
    async with (
        RedisBroker(url, namespace=NS, group_options=FAST_GROUP) as producer,
        RedisBroker(url, namespace=NS, group_options=FAST_GROUP) as broker_a,
        RedisBroker(url, namespace=NS, group_options=FAST_GROUP) as broker_b,
    ):
        await producer.create_topic("t", 2)
        listeners = [Flaky(), Flaky()]
        stores = [SqlOffsetStore(store_url), SqlOffsetStore(store_url)]
        consumers = [
            PushConsumer("g", b, listener, offset_store=store, options=options)
            for b, listener, store in zip((broker_a, broker_b), listeners, stores, strict=True)
        ]
        for consumer in consumers:
            consumer.subscribe("t")
        async with consumers[0], consumers[1]:
            with anyio.fail_after(20):  # both members hold queues
                while not all(c.assigned_queues for c in consumers):
                    await anyio.sleep(0.05)
            await producer.send_many("t", [b"%d" % i for i in range(20)])
            with anyio.fail_after(30):  # each message, and each even one retried once
                while len({s for listener in listeners for s in listener.seen}) < 30:
                    await anyio.sleep(0.05)
            for consumer in consumers:
                await consumer.wait_caught_up(timeout=20)
            cli = [["group", "show", "--group", "g", "--topic", "t", "--redis", url,
                    "--namespace", NS],
                   ["offsets", "show", "--store", store_url, "--group", "g", "--redis", url,
                    "--namespace", NS]]  # fmt: skip
            for args in cli:
                assert await anyio.to_thread.run_sync(main, args) == 0, capsys.readouterr()
            shown = capsys.readouterr().out
            assert "group g: 2 live member(s)" in shown
        for store in stores:
            await store.aclose()
        reset = ["offsets", "reset", "--store", store_url, "--group", "g", "--topic", "t",
                 "--to-offset", "0", "--yes", "--redis", url, "--namespace", NS]  # fmt: skip
        assert await anyio.to_thread.run_sync(main, reset) == 0, capsys.readouterr()
    run = _commands_run(acl_server)
    # what ran is what the ACL grants, no more and no less: the list is minimal (but for
    # the commands of the scripts' rarer paths, each listed with the path that needs it)
    required = set(required_commands())
    assert run <= required, sorted(run - required)
    assert required - run == set(CONDITIONAL_COMMANDS), (sorted(run), sorted(required))


async def test_a_user_outside_the_key_pattern_fails_entering(acl_server: ACLServer) -> None:
    with pytest.raises(SourceError) as refused:
        async with RedisBroker(acl_server.url("nokeys"), namespace=NS, connect_timeout=60):
            pass
    assert not refused.value.retriable
    message = str(refused.value)
    assert "the Redis user 'nokeys' may not run" in message
    assert "XADD" in message
    assert "on the keys app:*" in message
    assert "PING" not in message.split(" on the keys")[0]  # no key: allowed


async def test_a_user_without_a_command_fails_entering_naming_it(acl_server: ACLServer) -> None:
    with pytest.raises(SourceError) as refused:
        async with RedisBroker(acl_server.url("notime"), namespace=NS):
            pass
    assert isinstance(refused.value, SourcePermissionError)
    assert not refused.value.retriable
    assert "the Redis user 'notime' may not run TIME on the keys app:*" in str(refused.value)
    # without the check, the script that needs TIME names it when it is refused
    async with RedisBroker(acl_server.url("notime"), namespace=NS, check_acl=False) as broker:
        with pytest.raises(SourceError) as in_script:
            await broker.group_coordinator().heartbeat("g", "me")
        assert not in_script.value.retriable
        assert "refused: TIME" in str(in_script.value)
        acl_server.cli("ACL", "SETUSER", "notime", "-xrange")
        with pytest.raises(SourceError) as direct:
            await broker.pull(MessageQueue("t", 0), 0, 1)
        assert not direct.value.retriable
        assert "'xrange'" in str(direct.value)


async def test_a_consumer_refused_a_command_later_stops_after_draining(
    acl_server: ACLServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The user's ACL loses XRANGE and XREAD while a consumer runs: its pulls are
    refused for good, so it stops (as for a permanent offset store failure) and
    raises the refusal from ``async with``, instead of retrying forever."""
    listener = Flaky()
    options = ConsumerOptions(persist_consumer_offset_interval=0.2, pull_long_polling_timeout=0.3)
    async with RedisBroker(acl_server.url("app"), namespace=NS, group_options=FAST_GROUP) as broker:
        await broker.create_topic("t", 1)
        await broker.send("t", b"1")
        consumer = PushConsumer(
            "g", broker, listener, offset_store=MemoryOffsetStore(), options=options
        )
        consumer.subscribe("t")

        async def run() -> None:
            async with consumer:
                await consumer.wait_caught_up(timeout=20)
                acl_server.cli("ACL", "SETUSER", "app", "-xrange", "-xread")
                await broker.send("t", b"3")
                with anyio.fail_after(30):  # until the consumer stops (cancels this)
                    await anyio.sleep_forever()

        with pytest.raises(SourcePermissionError) as stopped:
            await run()
    assert "'xrange'" in str(stopped.value) or "'xread'" in str(stopped.value)
    assert "stopping the consumer" in caplog.text
    # (a long poll already waiting when the ACL changed may still deliver "3")
    assert listener.seen[0] == (b"1", 0)
