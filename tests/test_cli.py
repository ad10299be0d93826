"""The ``stagedconsumer`` command itself: help, version, usage errors, help texts."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from stagedconsumer._cli import main
from stagedconsumer._version import __version__

COMMANDS = ("demo", "offsets", "trace")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-m", "stagedconsumer", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def test_no_command_prints_the_help_with_the_commands_and_exits_2() -> None:
    result = run()
    assert result.returncode == 2
    assert "commands:" in result.stdout
    for command in COMMANDS:
        assert f"    {command} " in result.stdout
    assert "stagedconsumer COMMAND --help" in result.stdout


def test_help_exits_0() -> None:
    result = run("--help")
    assert result.returncode == 0
    assert "commands:" in result.stdout
    assert "--version" in result.stdout


def test_an_unknown_command_exits_2_naming_the_commands() -> None:
    result = run("nope")
    assert result.returncode == 2
    assert "invalid choice: 'nope'" in result.stderr
    for command in COMMANDS:
        assert repr(command) in result.stderr
    assert "Run 'stagedconsumer --help' for help." in result.stderr


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str) -> None:
    result = run(flag)
    assert result.returncode == 0
    assert result.stdout.strip() == f"stagedconsumer {__version__}"


def test_offsets_without_an_action_prints_its_help_and_exits_2() -> None:
    result = run("offsets")
    assert result.returncode == 2
    assert "actions:" in result.stdout
    assert "show" in result.stdout
    assert "reset" in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("demo",),
        ("offsets",),
        ("offsets", "show"),
        ("offsets", "reset"),
        ("trace",),
        ("group", "show"),
    ],
)
def test_help_texts_show_no_rest_markup(args: tuple[str, ...]) -> None:
    result = run(*args, "--help")
    assert result.returncode == 0
    for markup in ("``", ":class:", ":func:", ":meth:", "`~"):
        assert markup not in result.stdout, f"{markup!r} in {' '.join(args)} --help"


def test_every_demo_option_has_a_help_text() -> None:
    result = run("demo", "--help")
    assert "event loop of the wall-clock run" in result.stdout
    lines = result.stdout.splitlines()
    options = [i for i, line in enumerate(lines) if line.lstrip().startswith("--")]
    assert len(options) == 7
    for i in options:  # a help text on the option's line, or indented on the next one
        name, _, rest = lines[i].strip().partition("  ")
        assert rest.strip() or lines[i + 1].startswith(" " * 20), f"{name} has no help"


@pytest.mark.parametrize(
    ("text", "plain"),
    [
        ("``offsets show``", "offsets show"),
        ("a :class:`~stagedconsumer.RedisBroker` b", "a RedisBroker b"),
        (":func:`anyio.run`", "anyio.run"),
        (":ref:`the table <options>`", "the table"),
        (":py:class:`x.Y`", "x.Y"),
    ],
)
def test_plain_text(text: str, plain: str) -> None:
    from stagedconsumer._cli import plain_text

    assert plain_text(text) == plain


@pytest.mark.parametrize(
    "command",
    [
        ("trace", "KEY"),
        ("offsets", "show", "--store", "sqlite://", "--group", "g"),
        ("offsets", "reset", "--store", "sqlite://", "--group", "g", "--topic", "t"),
        ("group", "show", "--group", "g"),
    ],
    ids=lambda c: " ".join(c[:2]),
)
@pytest.mark.parametrize("flag", ["--redis-namespace", "--namespace"])
def test_every_redis_command_takes_the_same_redis_options(
    command: tuple[str, ...], flag: str
) -> None:
    from stagedconsumer._cli import build_parser

    url = "redis://127.0.0.1:6379/0"
    args = build_parser().parse_args([*command, "--redis", url, flag, "ns", "--redis-cluster"])
    assert (args.redis, args.redis_namespace, args.redis_cluster) == (url, "ns", True)
    defaults = build_parser().parse_args([*command, "--redis", url])
    assert (defaults.redis_namespace, defaults.redis_cluster) == ("sc", False)


def test_main_returns_2_without_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "commands:" in capsys.readouterr().out


@pytest.mark.parametrize("keys", [0, 10])
@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("virtual", [True, False], ids=["virtual", "wall-clock"])
def test_demo_table_fits_the_terminal_and_never_cuts_a_mode(
    columns: int, virtual: bool, keys: int
) -> None:
    pytest.importorskip("trio")
    args = ["demo", "--messages", "40", "--cost-ms", "2", "--keys", str(keys)]
    env = {**os.environ, "COLUMNS": str(columns)}
    result = subprocess.run(
        [sys.executable, "-m", "stagedconsumer", *args, *(["--virtual"] if virtual else [])],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= columns
    assert "…" not in result.stdout
    assert any(line.startswith("concurrent ") for line in lines)
    if keys:
        assert any(line.startswith("key-ordered ") for line in lines)
        assert any(line.startswith("staged/key ") for line in lines)
        assert "speedup" in lines[1]  # a header not folded
    assert ("bare" in lines[1]) is not virtual  # the bare schedule: wall clock only


@pytest.mark.parametrize(
    "args", [("--stages", "0,5"), ("--stages", "10,-1"), ("--stages", "10,abc"), ("--workers", "0")]
)
def test_demo_with_a_bad_size_is_a_usage_error(
    args: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: stagedconsumer demo")
    assert f"error: argument {args[0]}: " in err


def test_demo_lists_order_violations_below_the_table() -> None:
    from io import StringIO

    from rich.console import Console

    from stagedconsumer._cli._demo import DemoResult, render

    def result(mode: str, violations: tuple[str, ...] = ()) -> DemoResult:
        return DemoResult(
            mode=mode, messages=10, elapsed=0.1, bound_units=10, unit=0.01,
            peak_concurrency=1, violations=violations, bare=0.1,
        )  # fmt: skip

    console = Console(file=StringIO(), width=80)
    broken = ("offset 3 ran as stage 1, expected 0",)
    render([result("orderly"), result("staged", broken)], console, virtual=True)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "FAILED" in out
    assert "staged: offset 3 ran as stage 1, expected 0" in out


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--backend=trio", "--backend trio needs trio: pip install 'stagedconsumer[trio]'"),
        ("--virtual", "--virtual runs on trio: pip install 'stagedconsumer[trio]'"),
    ],
)
def test_demo_on_trio_without_trio_names_the_extra(flag: str, message: str) -> None:
    # a base install: importing trio fails
    code = (
        "import sys; sys.modules['trio'] = None; from stagedconsumer._cli import main;"
        f" sys.exit(main(['demo', '--messages', '5', {flag!r}]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "LookupError" not in result.stderr


@pytest.mark.slow
def test_offsets_reset_help_documents_the_broker_checks_and_force() -> None:
    result = run("offsets", "reset", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--force" in text
    assert "a group with live members is refused (unless --force)" in text
    assert "Without --redis none of this is checked" in text
    assert "--table-prefix PREFIX" in text
    assert "--table-prefix PREFIX" in run("offsets", "show", "--help").stdout


@pytest.fixture
def big_topic() -> Iterator[tuple[str, str]]:
    """A RedisBroker namespace with topic ``big`` of 600 queues (``group show
    --topic big`` prints more than a pipe's buffer); its URL and namespace."""
    from stagedconsumer._sources._redis_broker import RedisBroker
    from tests.redis.conftest import require_redis

    url = require_redis()
    namespace = f"test-{uuid.uuid4().hex[:12]}"

    async def create() -> None:
        async with RedisBroker(url, namespace=namespace) as broker:
            await broker.create_topic("big", 600)

    async def clean() -> None:
        async with RedisBroker(url, namespace=namespace) as broker:
            await broker.delete_namespace()

    anyio.run(create)
    try:
        yield url, namespace
    finally:
        anyio.run(clean)


@pytest.fixture
def progress_db(tmp_path: Path) -> str:
    from offsetstore import QueueProgress, SqlOffsetStore
    from stagedconsumer import MessageQueue

    """Progress of group ``g``: one queue of topic ``small``, 400 of ``big`` (more
    than a pipe's buffer to print)."""
    url = f"sqlite:///{tmp_path / 'progress.db'}"
    queues = [MessageQueue("small", 0)] + [MessageQueue("big", q) for q in range(400)]

    async def fill() -> None:
        store = SqlOffsetStore(url)
        try:
            for mq in queues:
                store.update_progress("g", mq, QueueProgress(consume_offset=mq.queue_id))
            await store.persist_all("g", queues)
        finally:
            await store.aclose()

    anyio.run(fill)
    return url


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the command with stdout a pipe whose reader has already gone (as
    ``... | head -1`` once head has its line)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "stagedconsumer", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)


@pytest.mark.slow
@pytest.mark.parametrize("json_output", [True, False], ids=["json", "table"])
@pytest.mark.parametrize("topic", ["small", "big"], ids=["buffered", "large"])
def test_offsets_show_into_a_closed_pipe_exits_quietly(
    progress_db: str, topic: str, json_output: bool
) -> None:
    args = ["offsets", "show", "--store", progress_db, "--group", "g", "--topic", topic]
    result = run_into_closed_pipe(*args, *(["--json"] if json_output else []))
    assert (result.returncode, result.stderr) == (1, "")


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("topic", [False, True], ids=["buffered", "large"])
def test_group_show_into_a_closed_pipe_exits_quietly(
    big_topic: tuple[str, str], topic: bool
) -> None:
    url, namespace = big_topic
    args = ["group", "show", "--group", "g", "--redis", url, "--redis-namespace", namespace]
    result = run_into_closed_pipe(*args, *(["--topic", "big"] if topic else []))
    assert (result.returncode, result.stderr) == (1, "")


@pytest.mark.parametrize("args", [(), ("--help",), ("offsets",)], ids=repr)
def test_help_into_a_closed_pipe_exits_quietly(args: tuple[str, ...]) -> None:
    result = run_into_closed_pipe(*args)
    assert result.stderr == ""
    assert result.returncode in (0, 1, 2)  # --help 0, usage 2; or 1: stdout closed
