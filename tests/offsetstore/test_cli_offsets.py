"""``stagedconsumer offsets show`` / ``reset`` against a real SQLite store."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import sqlalchemy as sa

from offsetstore import QueueProgress, SqlOffsetStore, StageKey
from stagedconsumer import MessageQueue
from stagedconsumer._cli import main
from stagedconsumer._cli._offsets import format_stage_key, parse_stage_key

GROUP = "orders-app"


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'progress.db'}"

    async def fill() -> None:
        store = SqlOffsetStore(url)
        try:
            for q in range(3):
                store.update_progress(
                    GROUP,
                    MessageQueue("orders", q),
                    QueueProgress(
                        consume_offset=10 + q,
                        stage_offsets={StageKey("default", None): 4 + q, StageKey("vip", ""): q},
                    ),
                )
            store.update_progress(GROUP, MessageQueue("audit", 0), QueueProgress(consume_offset=99))
            await store.persist_all(
                GROUP, [MessageQueue("orders", q) for q in range(3)] + [MessageQueue("audit", 0)]
            )
        finally:
            await store.aclose()

    anyio.run(fill)
    return url


@pytest.fixture
def orders_on_redis() -> Iterator[tuple[str, str]]:
    """Topic ``orders`` with 3 queues on a RedisBroker of a namespace of its own:
    50 messages in queue 0, 20 in queues 1 and 2. Its URL and namespace."""
    from stagedconsumer._sources._redis_broker import RedisBroker
    from tests.redis.conftest import require_redis

    redis_url = require_redis()
    namespace = f"test-{uuid.uuid4().hex[:12]}"

    async def fill() -> None:
        async with RedisBroker(redis_url, namespace=namespace) as broker:
            await broker.create_topic("orders", 3)
            for q, count in enumerate([50, 20, 20]):
                for _ in range(count):
                    await broker.send("orders", b"x", queue_id=q)

    async def clean() -> None:
        async with RedisBroker(redis_url, namespace=namespace) as broker:
            await broker.delete_namespace()

    anyio.run(fill)
    try:
        yield redis_url, namespace
    finally:
        anyio.run(clean)


def _members(redis_url: str, namespace: str, action: str, *members: str) -> None:
    """``action`` ("heartbeat", as a running consumer does, or "leave") for ``members``
    of GROUP through the broker's coordinator."""
    from stagedconsumer._sources._redis_broker import RedisBroker

    async def run() -> None:
        async with RedisBroker(redis_url, namespace=namespace) as broker:
            coordinator = broker.group_coordinator()
            for member in members:
                await getattr(coordinator, action)(GROUP, member)

    anyio.run(run)


def _stored(url: str) -> dict[MessageQueue, QueueProgress]:
    async def read() -> dict[MessageQueue, QueueProgress]:
        store = SqlOffsetStore(url)
        try:
            return await store.list_progress(GROUP)
        finally:
            await store.aclose()

    return anyio.run(read)


def test_show_prints_every_queue_with_offsets(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["offsets", "show", "--store", store_url, "--group", GROUP]) == 0
    out = capsys.readouterr().out
    assert "orders#2" in out
    assert "audit#0" in out
    assert "default=6" in out
    assert "vip/=2" in out
    assert "99" in out


def test_show_json_of_one_topic(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["offsets", "show", "--store", store_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [q["queue_id"] for q in data["queues"]] == [0, 1, 2]
    assert data["queues"][1] == {
        "source": "",
        "topic": "orders",
        "queue_id": 1,
        "consume_offset": 11,
        "stage_offsets": [
            {"strategy_id": "default", "group_id": None, "stage_offset": 5},
            {"strategy_id": "vip", "group_id": "", "stage_offset": 1},
        ],
        "fence": 0,
        "corrupt": [],
        "finished": [],
    }


def test_show_of_an_unknown_group_says_so(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["offsets", "show", "--store", store_url, "--group", "nobody"]) == 0
    assert "No stored progress" in capsys.readouterr().out


def test_names_are_shown_verbatim_emoji_codes_and_markup_included(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'progress.db'}"
    group, mq, key = ":x: [b]g[/b]", MessageQueue("t:x:", 0), StageKey("s", "[red]a")

    async def fill() -> None:
        store = SqlOffsetStore(url)
        try:
            store.update_progress(
                group, mq, QueueProgress(consume_offset=3, stage_offsets={key: 1})
            )
            await store.persist_all(group, [mq])
        finally:
            await store.aclose()

    anyio.run(fill)
    assert main(["offsets", "show", "--store", url, "--group", group]) == 0
    out = capsys.readouterr().out
    assert "group :x: [b]g[/b]" in out
    assert "t:x:#0" in out
    assert "s/[red]a=1" in out
    assert main(["offsets", "show", "--store", url, "--group", ":x:", "--topic", "[i]t"]) == 0
    assert "No stored progress for group :x:, topic [i]t in" in capsys.readouterr().out
    reset = ["offsets", "reset", "--store", url, "--group", group, "--topic", "t:x:"]
    assert main([*reset, "--to-offset", "1", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "Reset of group :x: [b]g[/b], topic t:x:" in out
    assert "s/[red]a=1" in out


def test_show_never_creates_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.db"
    path.touch()  # an empty SQLite database
    url = f"sqlite:///{path}"
    assert main(["offsets", "show", "--store", url, "--group", GROUP]) == 1
    assert "no offset store tables" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["show", "reset"])
def test_a_missing_sqlite_file_is_an_error_and_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # the message on one line
    path = tmp_path / "typo.db"
    args = ["offsets", action, "--store", f"sqlite:///{path}", "--group", GROUP]
    if action == "reset":
        args += ["--topic", "orders", "--queue", "0", "--to-offset", "0", "--yes"]
    assert main(args) == 1
    assert f"the SQLite file {path} does not exist" in capsys.readouterr().err
    assert not path.exists()


def test_show_with_a_malformed_url_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["offsets", "show", "--store", "nonsense", "--group", GROUP]) == 1
    assert "malformed offset store URL" in capsys.readouterr().err


def test_reset_with_yes_moves_offsets_back(store_url: str) -> None:
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--queue", "1", "--to-offset", "3", "--clear-stage-offsets",
                 "--stage-offset", "default=2", "--yes"]) == 0  # fmt: skip
    stored = _stored(store_url)
    assert stored[MessageQueue("orders", 1)] == QueueProgress(
        consume_offset=3, stage_offsets={StageKey("default", None): 2}
    )
    # Other queues untouched.
    assert stored[MessageQueue("orders", 0)].consume_offset == 10
    assert stored[MessageQueue("audit", 0)].consume_offset == 99


def test_reset_of_every_queue_of_a_topic_keeps_other_stage_keys(store_url: str) -> None:
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--stage-offset", "vip/=0", "-y"]) == 0
    stored = _stored(store_url)
    for q in range(3):
        assert stored[MessageQueue("orders", q)] == QueueProgress(
            consume_offset=10 + q,
            stage_offsets={StageKey("default", None): 4 + q, StageKey("vip", ""): 0},
        )


@pytest.mark.parametrize("answer", ["n\n", "\n", ""])
def test_reset_asks_and_does_nothing_unless_confirmed(
    store_url: str, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(answer))
    before = _stored(store_url)
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--to-offset", "0"]) == 1
    assert _stored(store_url) == before


@pytest.mark.slow
def test_a_piped_yes_does_not_confirm(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The README: --yes is needed where stdin is not a terminal; a 'y' piped into
    the command (yes | stagedconsumer offsets reset ...) confirmed the reset."""
    before = _stored(store_url)
    command = [sys.executable, "-m", "stagedconsumer", "offsets", "reset", "--store", store_url,
               "--group", GROUP, "--topic", "audit", "--to-offset", "0"]  # fmt: skip
    result = subprocess.run(command, input="y\n", capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "stdin is not a terminal" in result.stderr
    assert "Pass --yes (-y)" in result.stderr
    assert _stored(store_url) == before


@pytest.mark.slow
@pytest.mark.parametrize(("answer", "status"), [("y", 0), ("n", 1)])
def test_reset_confirmed_at_the_prompt_of_a_terminal(
    store_url: str, answer: str, status: int
) -> None:
    """stdin a terminal (a pseudo-terminal here): the answer typed there decides."""
    command = [sys.executable, "-m", "stagedconsumer", "offsets", "reset", "--store", store_url,
               "--group", GROUP, "--topic", "audit", "--to-offset", "0"]  # fmt: skip
    controller, terminal = os.openpty()
    try:
        process = subprocess.Popen(
            command, stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        os.write(controller, f"{answer}\n".encode())  # typed ahead: the terminal keeps it
        out, err = process.communicate(timeout=60)
    finally:
        os.close(controller)
        os.close(terminal)
    assert process.returncode == status, err
    assert "[y/N]" in out
    expected = 0 if answer == "y" else 99
    assert _stored(store_url)[MessageQueue("audit", 0)].consume_offset == expected


def test_reset_needs_something_to_reset(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--yes"]) == 1
    assert "nothing to reset" in capsys.readouterr().err


def test_reset_of_a_topic_without_progress_needs_queues(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "new"]
    assert main([*args, "--to-offset", "5", "--yes"]) == 1
    assert "--queue" in capsys.readouterr().err
    assert main([*args, "--to-offset", "5", "--queue", "0", "--yes"]) == 0
    assert _stored(store_url)[MessageQueue("new", 0)] == QueueProgress(consume_offset=5)


@pytest.mark.parametrize("bad", ["default", "=3", "default=-1", "default=x"])
def test_reset_rejects_bad_stage_assignments(bad: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["offsets", "reset", "--store", "sqlite://", "--group", "g", "--topic", "t",
              "--stage-offset", bad])  # fmt: skip
    assert info.value.code == 2


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("default", StageKey("default", None)),
        ("default/", StageKey("default", "")),
        ("default/k1", StageKey("default", "k1")),
        ("s/a/b", StageKey("s", "a/b")),
    ],
)
def test_stage_key_syntax_round_trips(text: str, key: StageKey) -> None:
    assert parse_stage_key(text) == key
    assert format_stage_key(key) == text


@pytest.mark.redis
def test_show_with_a_redis_broker_adds_lag(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from stagedconsumer._sources._redis_broker import RedisBroker
    from tests.redis.conftest import require_redis

    redis_url = require_redis()
    namespace = f"test-{uuid.uuid4().hex[:12]}"

    async def fill() -> None:
        async with RedisBroker(redis_url, namespace=namespace) as broker:
            await broker.create_topic("orders", 3)
            for q in range(3):
                for _ in range(20):
                    await broker.send("orders", b"x", queue_id=q)

    async def clean() -> None:
        async with RedisBroker(redis_url, namespace=namespace) as broker:
            await broker.delete_namespace()

    anyio.run(fill)
    try:
        args = ["offsets", "show", "--store", store_url, "--group", GROUP, "--topic", "orders"]
        assert main([*args, "--redis", redis_url, "--redis-namespace", namespace, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert [q["lag"] for q in data["queues"]] == [10, 9, 8]  # 20 - (10 + q)
        assert main([*args, "--redis", redis_url, "--redis-namespace", namespace]) == 0
        assert "Lag" in capsys.readouterr().out
    finally:
        anyio.run(clean)


@pytest.mark.slow
@pytest.mark.parametrize("json_output", [True, False], ids=["json", "table"])
def test_show_with_an_unreachable_redis_shows_progress_warns_and_fails(
    store_url: str, capsys: pytest.CaptureFixture[str], json_output: bool
) -> None:
    pytest.importorskip("redis")
    args = ["offsets", "show", "--store", store_url, "--group", GROUP]
    if json_output:
        args.append("--json")
    assert main([*args, "--redis", "redis://127.0.0.1:1/0"]) == 1
    captured = capsys.readouterr()
    assert "warning: no lag: redis://127.0.0.1:1/0" in captured.err
    if json_output:
        assert len(json.loads(captured.out)["queues"]) == 4
    else:
        assert "orders#2" in captured.out


@pytest.mark.redis
def test_reset_checks_queue_ids_against_the_topic_on_the_broker(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from stagedconsumer._sources._redis_broker import RedisBroker
    from tests.redis.conftest import require_redis

    redis_url = require_redis()
    namespace = f"test-{uuid.uuid4().hex[:12]}"

    async def create() -> None:
        async with RedisBroker(redis_url, namespace=namespace) as broker:
            await broker.create_topic("orders", 4)

    async def clean() -> None:
        async with RedisBroker(redis_url, namespace=namespace) as broker:
            await broker.delete_namespace()

    anyio.run(create)
    try:
        before = _stored(store_url)
        common = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--to-offset",
                  "0", "--yes", "--redis", redis_url, "--redis-namespace", namespace]  # fmt: skip
        args = [*common, "--topic", "orders"]
        assert main([*args, "--queue", "99"]) == 1
        err = capsys.readouterr().err
        assert "topic 'orders' has 4 queue(s), 0 to 3: no queue 99" in err
        assert _stored(store_url) == before  # no phantom row
        assert main([*args, "--queue", "3"]) == 0  # a queue without progress yet: fine
        assert _stored(store_url)[MessageQueue("orders", 3)].consume_offset == 0
        assert main([*common, "--topic", "nope", "--queue", "0"]) == 1
        assert "does not exist" in capsys.readouterr().err
    finally:
        anyio.run(clean)


def test_reset_without_a_broker_says_the_queue_ids_are_not_checked(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--queue", "1", "--to-offset", "0", "--yes"]) == 0
    err = capsys.readouterr().err
    assert "not checked against the topic's queues" in err
    assert "--redis URL" in err


@pytest.mark.slow
def test_reset_with_an_unreachable_broker_changes_nothing(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("redis")
    before = _stored(store_url)
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--queue", "1", "--to-offset", "0", "--yes",
                 "--redis", "redis://127.0.0.1:1/0"]) == 1  # fmt: skip
    assert "cannot check the queues of topic 'orders'" in capsys.readouterr().err
    assert _stored(store_url) == before


@pytest.mark.slow
def test_reset_without_a_terminal_says_to_pass_yes(store_url: str) -> None:
    before = _stored(store_url)
    command = [sys.executable, "-m", "stagedconsumer", "offsets", "reset", "--store", store_url,
               "--group", GROUP, "--topic", "orders", "--to-offset", "0"]  # fmt: skip
    result = subprocess.run(
        command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "stdin is not a terminal" in result.stderr
    assert "Pass --yes (-y) to reset without asking" in result.stderr
    assert _stored(store_url) == before
    result = subprocess.run(
        [*command, "--yes"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert all(
        p.consume_offset == 0 for mq, p in _stored(store_url).items() if mq.topic == "orders"
    )


@pytest.mark.redis
def test_reset_refuses_a_running_group_unless_forced(
    store_url: str,
    orders_on_redis: tuple[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # each message on one line
    redis_url, namespace = orders_on_redis
    _members(redis_url, namespace, "heartbeat", "host@1@aa", "host@2@bb")
    before = _stored(store_url)
    common = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders",
              "--yes", "--redis", redis_url, "--redis-namespace", namespace]  # fmt: skip
    args = [*common, "--to-offset", "0"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"group '{GROUP}' is running: 2 live member(s): host@1@aa, host@2@bb" in err
    assert "--force" in err
    assert _stored(store_url) == before
    # --force resets anyway, saying so
    assert main([*args, "--force"]) == 0
    captured = capsys.readouterr()
    assert "warning: group 'orders-app' has 2 live member(s) (host@1@aa, host@2@bb)" in (
        captured.err
    )
    assert "Reset 3 queue(s)." in captured.out
    assert all(_stored(store_url)[MessageQueue("orders", q)].consume_offset == 0 for q in range(3))
    # once the members have left, no --force is needed
    _members(redis_url, namespace, "leave", "host@1@aa", "host@2@bb")
    assert main([*common, "--to-offset", "2"]) == 0
    assert all(_stored(store_url)[MessageQueue("orders", q)].consume_offset == 2 for q in range(3))


def test_reset_without_a_broker_does_not_check_for_live_members(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--to-offset", "0", "--yes"]) == 0
    assert "Reset 3 queue(s)." in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.redis
def test_reset_refuses_an_offset_outside_the_queues_on_the_broker(
    store_url: str,
    orders_on_redis: tuple[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # each message on one line
    redis_url, namespace = orders_on_redis
    before = _stored(store_url)
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders",
            "--yes", "--redis", redis_url, "--redis-namespace", namespace]  # fmt: skip
    assert main([*args, "--queue", "0", "--to-offset", "9999"]) == 1
    err = capsys.readouterr().err
    assert "--to-offset 9999 is outside the offsets of orders#0 [0, 50]" in err
    assert "nothing changed" in err
    assert _stored(store_url) == before
    # every queue of the plan is checked, each named with its range
    assert main([*args, "--to-offset", "30"]) == 1
    err = capsys.readouterr().err
    assert "outside the offsets of orders#1 [0, 20], orders#2 [0, 20]" in err
    assert "orders#0" not in err
    assert _stored(store_url) == before
    # the max offset itself (consume from the end) is in range
    assert main([*args, "--queue", "0", "--to-offset", "50"]) == 0
    assert _stored(store_url)[MessageQueue("orders", 0)].consume_offset == 50
    assert main([*args, "--to-offset", "20"]) == 0
    assert all(_stored(store_url)[MessageQueue("orders", q)].consume_offset == 20 for q in range(3))


def test_reset_without_a_broker_takes_any_offset(store_url: str) -> None:
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--queue", "0", "--to-offset", "9999", "--yes"]) == 0
    assert _stored(store_url)[MessageQueue("orders", 0)].consume_offset == 9999


def test_a_store_with_a_table_prefix_needs_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the message on one line
    url = f"sqlite:///{tmp_path / 'prefixed.db'}"
    mq = MessageQueue("orders", 0)

    async def fill() -> None:
        store = SqlOffsetStore(url, table_prefix="x_")
        try:
            store.update_progress(GROUP, mq, QueueProgress(consume_offset=7))
            await store.persist_all(GROUP, [mq])
        finally:
            await store.aclose()

    anyio.run(fill)
    show = ["offsets", "show", "--store", url, "--group", GROUP]
    assert main(show) == 1
    err = capsys.readouterr().err
    assert "no offset store tables (stagedconsumer_progress, stagedconsumer_schema)" in err
    assert "give its prefix with --table-prefix" in err
    assert main([*show, "--table-prefix", "x_", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["queues"][0]["consume_offset"] == 7
    reset = ["offsets", "reset", "--store", url, "--group", GROUP, "--topic", "orders"]
    assert main([*reset, "--to-offset", "1", "--yes"]) == 1
    assert "--table-prefix" in capsys.readouterr().err
    assert main([*reset, "--table-prefix", "x_", "--to-offset", "1", "--yes"]) == 0

    async def read() -> QueueProgress | None:
        store = SqlOffsetStore(url, table_prefix="x_")
        try:
            return (await store.list_progress(GROUP)).get(mq)
        finally:
            await store.aclose()

    assert anyio.run(read) == QueueProgress(consume_offset=1)
    assert main([*show, "--table-prefix", "bad-prefix"]) == 1
    assert "table_prefix must be" in capsys.readouterr().err


def test_clear_stage_offsets_repairs_a_row_whose_stage_offsets_cannot_be_read(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A row stored before offsets were checked (a negative stage offset, written by
    seek()) made show, reset and every consumer start fail on "corrupt progress row"."""
    engine = sa.create_engine(store_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE stagedconsumer_progress SET stage_offsets = :bad"
                    " WHERE topic = 'orders' AND queue_id = 1"
                ),
                {"bad": '[["default",null,-1]]'},
            )
    finally:
        engine.dispose()
    show = ["offsets", "show", "--store", store_url, "--group", GROUP]
    assert main(show) == 1
    captured = capsys.readouterr()
    assert "orders#2" in captured.out  # the table, the corrupt row marked in it
    assert "unreadable" in captured.out
    err = " ".join(captured.err.split())
    assert "1 corrupt progress row(s)" in err
    assert "orders#1: stage offsets cannot be read" in err
    repair = f"--group {GROUP} --topic orders --queue 1 --clear-stage-offsets"
    assert repair in err  # the command that repairs it
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--queue", "1", "--stage-offset", "default=0", "--yes"]) == 1
    assert "corrupt progress row(s): orders#1" in capsys.readouterr().err
    assert main([*args, "--queue", "1", "--clear-stage-offsets", "--yes"]) == 0
    assert "unreadable" in capsys.readouterr().out
    stored = _stored(store_url)
    assert stored[MessageQueue("orders", 1)] == QueueProgress(consume_offset=11)  # kept
    assert stored[MessageQueue("orders", 0)].stage_offsets == {  # untouched
        StageKey("default", None): 4,
        StageKey("vip", ""): 0,
    }
    assert main(show) == 0


def test_show_gives_the_finished_messages_above_the_consume_offset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'progress.db'}"
    mq = MessageQueue("orders", 0)

    async def fill() -> None:
        store = SqlOffsetStore(url)
        try:
            store.update_progress(GROUP, mq, QueueProgress(consume_offset=10, finished=[(12, 15)]))
            await store.persist_all(GROUP, [mq])
            await store.transact(GROUP, mq, [18], lambda connection: None)  # a mark
        finally:
            await store.aclose()

    anyio.run(fill)
    base = ["offsets", "show", "--store", url, "--group", GROUP]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "Finished above" in out
    assert "12-15, 18 (5 messages)" in out
    assert main([*base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["queues"][0]["finished"] == [[12, 15], [18, 18]]
    # A reset that keeps the consume offset keeps them finished; one that moves it
    # (consume them again) drops them.
    reset = ["offsets", "reset", "--store", url, "--group", GROUP, "--topic", "orders", "--yes"]
    assert main([*reset, "--stage-offset", "default=3"]) == 0
    assert _stored(url)[mq].finished == ((12, 15), (18, 18))
    assert main([*reset, "--to-offset", "5"]) == 0
    # (--to-offset drops the stage offsets too, as seek() does)
    assert _stored(url)[mq] == QueueProgress(consume_offset=5)
