"""``stagedconsumer trace`` through the real command: files that are not trace files,
narrow terminals, and files that several runs appended to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from stagedconsumer import ConsumerOptions, PushConsumer
from stagedconsumer._observability._trace_hook import ConsumeMessageTraceHook
from stagedconsumer._observability._trace_sinks import FileTraceSink

from .test_hooks import Staged, broker_with


def trace(*args: str, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run(
        [sys.executable, "-m", "stagedconsumer", "trace", *args],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )


def write_run(path: Path) -> list[str]:
    """One run of a staged consumer tracing to ``path`` (appending); message ``k3``
    fails once. Returns the message ids of the run."""

    async def run() -> list[str]:
        broker = broker_with(5)
        consumer = PushConsumer(
            "g",
            broker,
            Staged([2, 2], fail_once=b"3"),
            options=ConsumerOptions(suspend_current_queue_time_millis=10),
        )
        consumer.subscribe("t")
        consumer.register_consume_message_hook(ConsumeMessageTraceHook(FileTraceSink(path)))
        async with consumer:
            await consumer.wait_caught_up(timeout=10)
        return [m.msg_id for m in broker.messages("t")]

    return anyio.run(run)


@pytest.mark.parametrize(
    ("content", "line"),
    [
        ("not json at all\n", 1),
        ('\n{"topic": "t"}\n', 2),  # JSON, but not what FileTraceSink writes
        ("[1, 2]\n", 1),
    ],
)
def test_a_file_that_is_not_a_trace_file_is_one_line_naming_file_and_line(
    tmp_path: Path, content: str, line: int
) -> None:
    path = tmp_path / "notes.txt"
    path.write_text(content)
    result = trace("k3", "--trace-file", str(path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    [message] = result.stderr.strip().splitlines()
    assert str(path) in message
    assert f"line {line}:" in message
    assert "not a trace record" in message


def test_quoted_data_is_shown_verbatim_emoji_codes_and_markup_included(tmp_path: Path) -> None:
    path = tmp_path / "notes.jsonl"
    path.write_text("hello :x: [bold]w[/bold]\n")
    result = trace("k3", "--trace-file", str(path))
    assert result.returncode == 1
    assert "'hello :x: [bold]w[/bold]'" in result.stderr
    path.write_text("")
    result = trace(":x: [red]k[/red]", "--trace-file", str(path))
    assert result.returncode == 1
    assert "no trace records for ':x: [red]k[/red]'" in result.stdout


def test_a_narrow_terminal_gets_lines_not_a_cut_table(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    [*_, msg3, _msg4] = write_run(path)
    narrow = trace("k3", "--trace-file", str(path), columns=80)
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert "…" not in narrow.stdout  # nothing truncated
    assert f"message {msg3}" in narrow.stdout
    assert "failed (EXCEPTION) -> suspend" in narrow.stdout
    assert any(line.startswith("attempt 2 ") for line in lines)
    assert "waited:" in narrow.stdout
    wide = trace("k3", "--trace-file", str(path), columns=200)
    assert "┃ step" in wide.stdout  # wide enough: the table
    assert "failed (EXCEPTION) -> suspend" in wide.stdout
    piped = trace("k3", "--trace-file", str(path))  # no terminal, no COLUMNS: the table
    assert "┃ step" in piped.stdout


def test_several_runs_in_one_file_are_announced_oldest_first(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    first = write_run(path)[3]
    second = write_run(path)[3]
    assert first != second
    result = trace("k3", "--trace-file", str(path))
    assert result.returncode == 0, result.stderr
    assert "2 messages match 'k3', oldest first" in result.stdout
    assert result.stdout.index(first) < result.stdout.index(second)
    single = trace(first, "--trace-file", str(path))  # by message id: one message
    assert "messages match" not in single.stdout
