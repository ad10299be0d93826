"""``stagedconsumer run`` with a SimpleWorker on the embedded broker, as real processes:
a SIGTERM mid-run lets the handler calls in flight finish and ack (or, after
``shutdown_timeout``, hands their messages back), ``/readyz`` follows, and a second
signal names the messages it abandons. Over Redis with ``--workers``:
tests/redis/test_run_simple.py.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._run_process import RunProcess, get


@pytest.fixture
def processes() -> Iterator[list[RunProcess]]:
    started: list[RunProcess] = []
    yield started
    for process in started:
        process.kill()


def _counts(log: str) -> tuple[int, int, int]:
    match = re.search(r"received=(\d+) acked=(\d+) handed_back=(\d+)", log)
    assert match, log
    received, acked, handed_back = (int(g) for g in match.groups())
    return received, acked, handed_back


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigterm_lets_handlers_in_flight_finish_and_ack(
    tmp_path: Path, processes: list[RunProcess], backend: str
) -> None:
    gate = tmp_path / "gate"
    run = RunProcess(
        tmp_path,
        "tests.run_simple_apps:gated",
        "--backend",
        backend,
        "--http",
        "0",
        config={"gate": str(gate), "free": 2},
    )
    processes.append(run)
    port = run.http_port()
    # bodies 0 and 1 are handled and acked (their slots are needed for the 5th and 6th
    # call); with concurrency 4, four calls then wait for the gate
    run.wait_for("handling", count=6)
    code, body = get(port, "/readyz")
    assert code == 200, body
    (worker,) = json.loads(body)["consumers"]
    assert (worker["kind"], worker["group"], worker["broker"]) == ("simple", "g", "ok")
    assert worker["in_flight"] == 4
    code, metrics = get(port, "/metrics")
    assert code == 200
    assert "messaging_client_consumed_messages" in metrics  # the OpenTelemetryHook
    assert 'messaging_operation_name="receive"' in metrics  # counted at receive

    run.signal(signal.SIGTERM)
    run.wait_for("leaving gracefully")
    code, body = get(port, "/readyz")
    assert code == 503
    assert json.loads(body)["consumers"][0]["problems"] == ["stopping"]
    gate.touch()
    assert run.wait() == 0, run.log()
    log = run.log()
    assert "SimpleWorker g: stop receiving, let handler calls in flight finish" in log
    assert re.search(
        r"4 handler call\(s\) were in flight, 0 cancelled and handed back; 6 acked", log
    )
    # nothing was received after the signal, and every received message was acked
    assert _counts(log) == (6, 6, 0)
    assert log.count("handling") == 6


@pytest.mark.slow
@pytest.mark.parametrize("app", ["gated", "sync_gated"])
def test_calls_still_running_after_shutdown_timeout_are_handed_back(
    tmp_path: Path, processes: list[RunProcess], app: str
) -> None:
    # the gate is never written: only shutdown_timeout ends the calls
    run = RunProcess(
        tmp_path,
        f"tests.run_simple_apps:{app}",
        config={"gate": str(tmp_path / "gate"), "shutdown_timeout": 0.3},
    )
    processes.append(run)
    run.wait_for("handling", count=4)
    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.log()
    log = run.log()
    assert "4 handler call(s) still running after shutdown_timeout=0.3 s" in log
    assert re.search(r"were in flight, 4 cancelled and handed back; 0 acked", log), log
    assert _counts(log) == (4, 0, 4)


def test_a_second_sigterm_names_the_messages_received_and_not_acked(
    tmp_path: Path, processes: list[RunProcess]
) -> None:
    run = RunProcess(tmp_path, "tests.run_simple_apps:gated", config={"gate": str(tmp_path / "g")})
    processes.append(run)
    run.wait_for("handling", count=4)
    run.signal(signal.SIGTERM)
    run.wait_for("leaving gracefully")
    run.signal(signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM, run.log()
    log = run.log()
    assert "exiting at once with status 143; abandoned: SimpleWorker g (" in log
    assert "4 message(s) received and not acked (" in log
    assert "delivered again once their invisible duration (600 s from their receive)" in log


def test_a_simple_consumer_without_a_worker_is_named_in_a_warning(
    tmp_path: Path, processes: list[RunProcess]
) -> None:
    run = RunProcess(tmp_path, "tests.run_simple_apps:bare")
    processes.append(run)
    run.wait_for("running tests.run_simple_apps:bare")
    assert "SimpleConsumer g: nothing receives from it; run a SimpleWorker" in run.log()
    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.log()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_worker_built_on_import_runs(
    tmp_path: Path, processes: list[RunProcess], backend: str
) -> None:
    run = RunProcess(tmp_path, "tests.run_simple_apps:worker", "--backend", backend)
    processes.append(run)
    run.wait_for("handled", count=3)
    run.signal(signal.SIGTERM)
    assert run.wait() == 0, run.log()
    assert re.search(r"0 cancelled and handed back; 3 acked, 0 failed in all", run.log())
