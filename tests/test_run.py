"""``stagedconsumer run`` on the embedded broker, as real processes: the probes, the
second signal, what a bad ``MODULE:ATTR`` says, the JSON log lines.

Over Redis and PostgreSQL (a SIGTERM mid-run, workers): tests/redis/test_run.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagedconsumer._cli._run_logging import JsonFormatter
from stagedconsumer._cli._serve_http import parse_address
from tests._run_process import ROOT, RunProcess, get


@pytest.fixture
def processes() -> Iterator[list[RunProcess]]:
    started: list[RunProcess] = []
    yield started
    for process in started:
        process.kill()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_readyz_flips_as_the_consumer_starts_and_stops(
    tmp_path: Path, processes: list[RunProcess], backend: str
) -> None:
    start_gate, handler_gate = tmp_path / "start", tmp_path / "handler"
    run = RunProcess(
        tmp_path,
        "tests.run_apps:gated",
        "--backend",
        backend,
        "--http",
        "0",
        config={"start_gate": str(start_gate), "handler_gate": str(handler_gate)},
    )
    processes.append(run)
    port = run.http_port()
    assert get(port, "/healthz") == (200, "ok\n")
    # the factory waits for its gate: starting, not ready
    code, body = get(port, "/readyz")
    assert code == 503
    assert json.loads(body)["phase"] == "starting"

    start_gate.touch()
    run.wait_for("handler started")
    code, body = get(port, "/readyz")
    assert code == 200, body
    detail = json.loads(body)
    assert detail["phase"] == "running"
    (consumer,) = detail["consumers"]
    assert consumer["group"] == "g"
    assert consumer["store"] == consumer["broker"] == "ok"
    assert "t#0" in consumer["queues"]
    code, metrics = get(port, "/metrics")
    assert code == 200
    assert "process_cpu_seconds_total" in metrics
    assert "stagedconsumer_consumer_" in metrics  # the OpenTelemetryHook's instruments

    # leaving waits for the handler, which waits for its gate: stopping, not ready
    run.signal(signal.SIGTERM)
    run.wait_for("leaving gracefully")
    code, body = get(port, "/readyz")
    assert code == 503
    assert json.loads(body)["phase"] == "stopping"
    assert get(port, "/healthz") == (200, "ok\n")  # the loop still answers
    handler_gate.touch()
    assert run.wait() == 0, run.log()
    assert "consumer g (" in run.log()
    assert "left in" in run.log()


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once_naming_what_it_abandons(
    tmp_path: Path, processes: list[RunProcess]
) -> None:
    # The handler blocks for ten minutes and shutdown_timeout is ten minutes: only the
    # second signal can end the process within the test.
    run = RunProcess(tmp_path, "tests.run_apps:stuck")
    processes.append(run)
    run.wait_for("handler started")
    run.signal(signal.SIGTERM)
    run.wait_for("leaving gracefully")
    run.signal(signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM, run.log()
    log = run.log()
    assert "received SIGTERM again: exiting at once with status 143; abandoned:" in log
    assert "1 handler call(s) in flight" in log
    assert "delivered again" in log


@pytest.mark.slow
def test_sigint_leaves_gracefully_and_json_lines_carry_the_fields(
    tmp_path: Path, processes: list[RunProcess]
) -> None:
    run = RunProcess(
        tmp_path, "tests.run_apps:several", "--log-format", "json", "--backend", "trio"
    )
    processes.append(run)
    run.wait_for("running tests.run_apps:several")
    run.signal(signal.SIGINT)
    assert run.wait() == 0, run.log()
    records = [json.loads(line) for line in run.log().splitlines()]
    assert all({"time", "level", "logger", "message", "process"} <= r.keys() for r in records)
    started = next(r for r in records if r["message"].startswith("running "))
    assert started["target"] == "tests.run_apps:several"
    assert "producer p" in started["message"]
    assert started["message"].index("producer p") < started["message"].index("consumer g")
    signalled = next(r for r in records if r.get("signal") == "SIGINT")
    assert signalled["level"] == "WARNING"
    left = next(r for r in records if "left in" in r["message"])
    assert left["group"] == "g"
    assert left["abandoned_calls"] == 0


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stagedconsumer", "run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("tests.no_such_module:app", "module 'tests.no_such_module' not found"),
        ("tests.run_apps:no_such_app", "module 'tests.run_apps' has no attribute 'no_such_app'"),
        ("tests.run_apps:stuck.nested", "'tests.run_apps:stuck' has no attribute 'nested'"),
        ("tests.run_apps", "'tests.run_apps' is not MODULE:ATTR"),
        ("tests.run_apps:NOT_RUNNABLE", "tests.run_apps:NOT_RUNNABLE is a builtins.int; expected"),
        (
            "tests.run_apps:needs_arguments",
            "tests.run_apps:needs_arguments takes arguments (name); a factory must take none",
        ),
        (
            "tests.run_apps:returns_nothing",
            "tests.run_apps:returns_nothing returned None; a factory must return",
        ),
        (
            "tests.run_apps:with_a_stray_item",
            "what tests.run_apps:with_a_stray_item() returned[1] is a builtins.str; expected",
        ),
        (
            "tests.run_apps:nothing_to_run",
            "what tests.run_apps:nothing_to_run() returned is empty: nothing to run",
        ),
    ],
)
def test_a_bad_target_exits_2_naming_what_was_not_found(target: str, message: str) -> None:
    result = _run(target)
    assert result.returncode == 2, result.stderr
    assert f"stagedconsumer run: error: {message}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_workers_that_cannot_load_the_target_are_not_restarted() -> None:
    result = _run("tests.run_apps:no_such_app", "--workers", "2")
    assert result.returncode == 2, result.stderr
    # the first to fail stops the other (perhaps before it got as far)
    assert "has no attribute 'no_such_app'" in result.stderr
    assert "could not load its target" in result.stderr
    assert "starting it again" not in result.stderr


def test_an_asynccontextmanager_app_is_set_up_before_and_torn_down_after_its_consumers(
    tmp_path: Path, processes: list[RunProcess]
) -> None:
    run = RunProcess(tmp_path, "tests.run_apps:lifespan")
    processes.append(run)
    run.wait_for("running tests.run_apps:lifespan")
    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.log()
    log = run.log()
    order = ["set up", "running tests.run_apps:lifespan", "leaving gracefully", "torn down"]
    assert [log.index(text) for text in order] == sorted(log.index(text) for text in order)
    assert "running tests.run_apps:lifespan (started in" in log
    assert "tests.run_apps.lifespan(), producer p, consumer g" in log
    assert "torn down (consumer closed: True)" in log  # the consumer left first


@pytest.mark.slow
def test_a_main_that_runs_its_consumers_itself_is_cancelled_and_they_leave_gracefully(
    tmp_path: Path, processes: list[RunProcess]
) -> None:
    run = RunProcess(tmp_path, "tests.run_apps:main", "--backend", "trio")
    processes.append(run)
    run.wait_for("main running")
    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.log()
    assert "tests.run_apps:main had not finished entering): cancelling that" in run.log()


@pytest.mark.slow
def test_workers_leave_gracefully_when_their_supervisor_is_killed(
    tmp_path: Path, processes: list[RunProcess]
) -> None:
    run = RunProcess(tmp_path, "tests.run_apps:several", "--workers", "2")
    processes.append(run)
    pids = [int(run.wait_for(rf"worker {i} started \(pid (\d+)\)").group(1)) for i in range(2)]
    try:
        run.wait_for(r"running tests.run_apps:several", count=2)
        run.kill()  # SIGKILL: nothing is passed on
        went = r"the supervisor \(pid \d+\) went away: leaving gracefully"
        run.wait_for(went, count=2, exited=True)
        run.wait_for(r"everything left; exiting", count=2, exited=True)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_run_help_and_a_bad_http_address() -> None:
    assert "--workers N" in _run("--help").stdout
    result = _run("tests.run_apps:several", "--http", "localhost:http")
    assert result.returncode == 2
    assert "--http 'localhost:http': expected HOST:PORT or PORT" in result.stderr


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("8080", ("127.0.0.1", 8080)),
        (":8080", ("127.0.0.1", 8080)),
        ("0.0.0.0:9000", ("0.0.0.0", 9000)),
        ("[::1]:9000", ("::1", 9000)),
    ],
)
def test_http_addresses(text: str, address: tuple[str, int]) -> None:
    assert parse_address(text) == address


def test_http_port_out_of_range() -> None:
    with pytest.raises(ValueError, match="port 70000 is out of range"):
        parse_address("70000")


def test_json_lines_carry_extra_fields_and_the_traceback() -> None:
    formatter = JsonFormatter(worker="3")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord(
            "stagedconsumer",
            logging.ERROR,
            __file__,
            1,
            "group %s:\nfailed",
            ("g",),
            sys.exc_info(),
        )
    record.group = "g"
    line = formatter.format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "group g:\nfailed"
    assert entry["level"] == "ERROR"
    assert entry["logger"] == "stagedconsumer"
    assert entry["worker"] == 3
    assert entry["group"] == "g"
    assert "RuntimeError: boom" in entry["exception"]
    assert {"args", "msg", "exc_info", "levelno"}.isdisjoint(entry)


@pytest.mark.slow
def test_a_second_signal_to_the_supervisor_makes_the_workers_exit_at_once(
    tmp_path: Path, processes: list[RunProcess]
) -> None:
    run = RunProcess(tmp_path, "tests.run_apps:stuck", "--workers", "2")
    processes.append(run)
    run.wait_for("handler started", count=2)
    run.signal(signal.SIGTERM)
    run.wait_for("passing SIGTERM on to 2 worker")
    run.wait_for("leaving gracefully", count=2)
    run.signal(signal.SIGINT)
    assert run.wait() == 128 + signal.SIGTERM, run.log()
    log = run.log()
    assert "received SIGINT again: passing it on; the workers exit at once" in log
    assert log.count("received SIGTERM again: exiting at once with status 143") == 2
    assert log.count("exited with status 143") == 2


def test_an_http_port_in_use_is_an_error_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("tests.run_apps:several", "--http", str(port))
    assert result.returncode == 2
    assert f"--http: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
