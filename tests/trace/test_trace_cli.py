"""``stagedconsumer trace`` through the real command: files that are not trace files,
narrow terminals, and files that several runs appended to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from stagedconsumer import ConsumerOptions, PushConsumer
from stagedconsumer._observability._trace_codec import (
    RMQ_SYS_TRACE_TOPIC,
    TraceBean,
    TraceContext,
    TraceMessage,
    TraceType,
    encode_trace_context,
    trace_keys,
)
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


@pytest.mark.slow
def test_quoted_data_is_shown_verbatim_emoji_codes_and_markup_included(tmp_path: Path) -> None:
    path = tmp_path / "notes.jsonl"
    path.write_text("hello :x: [bold]w[/bold]\n")
    result = trace("k3", "--trace-file", str(path))
    assert result.returncode == 1
    assert "'hello :x: [bold]w[/bold]'" in result.stderr
    path.write_text("")
    result = trace(":x: [red]k[/red]", "--trace-file", str(path))
    assert result.returncode == 1
    assert "no trace records for ':x: [red]k[/red]'" in result.stderr


@pytest.mark.slow
def test_errors_go_to_stderr_so_stdout_stays_json(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    for extra in ((), ("--json",)):
        result = trace("k3", "--trace-file", str(missing), *extra)
        assert result.returncode == 1
        assert result.stdout == ""
        assert f"stagedconsumer trace: no trace file {missing}" in result.stderr
    path = tmp_path / "trace.jsonl"
    write_run(path)
    result = trace("nope", "--trace-file", str(path), "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout) == []
    assert f"no trace records for 'nope' in {path}" in result.stderr
    table = trace("nope", "--trace-file", str(path))
    assert (table.returncode, table.stdout) == (1, "")
    assert "no trace records for 'nope'" in table.stderr
    found = trace("k3", "--trace-file", str(path), "--json")
    assert found.returncode == 0
    assert found.stderr == ""
    [history] = json.loads(found.stdout)
    assert history["calls"]


@pytest.mark.slow
def test_json_has_the_took_column_beside_rocketmqs_cost(tmp_path: Path) -> None:
    """``took`` is end - start of the two records' rounded timestamps (``took_ms``);
    ``cost_ms`` is RocketMQ's costTime as the SubAfter record has it (truncated)."""
    path = tmp_path / "trace.jsonl"
    t = 1_700_000_000_000
    [before, after] = handler_call("R1", attempt=1, cached=t, start=t + 2, end=t + 53)
    after.cost_time = 50
    write_contexts(path, [before, after])
    [history] = json.loads(trace("ORDER-3", "--trace-file", str(path), "--json").stdout)
    [call] = history["calls"]
    assert (call["took_ms"], call["cost_ms"]) == (51, 50)
    table = trace("ORDER-3", "--trace-file", str(path), columns=200)
    [row] = [line for line in table.stdout.splitlines() if "attempt 1" in line]
    assert "51 ms" in row
    assert "took_ms" in trace("--help").stdout


@pytest.mark.slow
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


@pytest.mark.slow
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


def handler_call(
    request_id: str,
    *,
    attempt: int,
    cached: int,
    start: int,
    end: int,
    settlement: str = "",
    topic: str = "orders",
    queue_offset: int = 3,
) -> list[TraceContext]:
    """The ``SubBefore``/``SubAfter`` pair of one handler call of message ``M3``
    (key ``ORDER-3``, stage 1) by group ``billing``, as the trace hook writes it."""
    bean = TraceBean(
        msg_id="M3",
        topic=topic,
        keys="ORDER-3",
        retry_times=attempt - 1,
        barrier_wait_ms=22,
        cached_timestamp=cached,
        queue_id=0,
        queue_offset=queue_offset,
    )
    return [
        TraceContext(
            trace_type=TraceType.SubBefore,
            timestamp=start,
            region_id="DefaultRegion",
            group_name="billing",
            request_id=request_id,
            beans=[bean],
            stage_index=1,
            attempt=attempt,
        ),
        TraceContext(
            trace_type=TraceType.SubAfter,
            group_name="billing",
            request_id=request_id,
            beans=[bean],
            timestamp=end,
            cost_time=end - start,
            success=not settlement,
            context_code=2 if settlement else 0,
            stage_index=1,
            attempt=attempt,
            settlement=settlement,
        ),
    ]


def write_contexts(path: Path, contexts: list[TraceContext]) -> None:
    """``contexts`` as FileTraceSink writes them, one trace message each."""
    lines = [
        TraceMessage(
            topic=RMQ_SYS_TRACE_TOPIC,
            keys=tuple(trace_keys([ctx])),
            body=encode_trace_context(ctx),
        ).to_json()
        for ctx in contexts
    ]
    path.write_text("".join(line + "\n" for line in lines))


def test_a_local_retry_is_one_whose_cached_time_reads_1_ms_later(tmp_path: Path) -> None:
    # Each handler call converts the loop-clock time the message was cached to
    # wall-clock milliseconds with its own clock reading, so the two attempts of a
    # local retry may disagree by 1 ms (seen on a RedisBroker): still a local retry.
    path = tmp_path / "trace.jsonl"
    t = 1_700_000_000_000
    first = handler_call("R1", attempt=1, cached=t, start=t + 22, end=t + 72, settlement="suspend")
    second = handler_call("R2", attempt=2, cached=t + 1, start=t + 1083, end=t + 1134)
    write_contexts(path, [*first, *second])
    result = trace("ORDER-3", "--trace-file", str(path), "--json")
    assert result.returncode == 0, result.stderr
    [history] = json.loads(result.stdout)
    calls = history["calls"]
    assert [c["cached_ms"] for c in calls] == [t, t + 1]
    assert [c["local_retry"] for c in calls] == [False, True]
    assert [c["broker_wait_ms"] for c in calls] == [None, None]
    assert calls[1]["cache_wait_ms"] == 1083 - 72  # from the previous attempt's end
    table = trace("ORDER-3", "--trace-file", str(path), columns=200)
    [row] = [line for line in table.stdout.splitlines() if "attempt 2" in line]
    assert "22 ms" not in row  # attempt 1's barrier is not repeated
    assert "1011 ms" in row


def test_a_redelivery_at_the_same_position_is_not_a_local_retry(tmp_path: Path) -> None:
    # A consumer died after attempt 1 was suspended; the next owner pulled the
    # message again (attempt 1 again), cached within the same millisecond.
    path = tmp_path / "trace.jsonl"
    t = 1_700_000_000_000
    first = handler_call("R1", attempt=1, cached=t, start=t + 22, end=t + 72, settlement="suspend")
    again = handler_call("R2", attempt=1, cached=t + 1, start=t + 5000, end=t + 5050)
    write_contexts(path, [*first, *again])
    result = trace("ORDER-3", "--trace-file", str(path), "--json")
    [history] = json.loads(result.stdout)
    assert [c["local_retry"] for c in history["calls"]] == [False, False]
