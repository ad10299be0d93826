"""benchmarks/tracing_overhead.py's tables and benchmarks/tracing_instructions.py's
run and report every case (smoke runs: they check the programs, not the numbers)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_service

ROOT = Path(__file__).resolve().parents[2]


def run_module(
    module: str, *options: str, path: str = "/usr/bin:/bin", timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE OPTIONS`` from the repository root, with ``PATH`` set to
    ``path``."""
    return subprocess.run(
        [sys.executable, "-m", module, *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"COLUMNS": "200", "PATH": path},
        check=False,
    )


def run_benchmark(*options: str) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.tracing_overhead OPTIONS``; it must exit 0."""
    result = run_module("benchmarks.tracing_overhead", *options)
    assert result.returncode == 0, result.stderr
    return result


def test_the_producer_table_lists_every_case() -> None:
    result = run_benchmark("--part", "producer", "--sends", "300", "--repeat", "1")
    out = result.stdout
    assert "Producer overhead, 300 sends" in out
    rows = {
        line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
        for line in out.splitlines()
        if line.startswith("│")
    }
    assert list(rows) == [
        "MemoryBroker.send (bare)",
        "Producer",
        "Producer + message trace",
        "Producer + OpenTelemetry",
        "Producer + OpenTelemetry, spans sampled 1%",
        "Producer + everything",
    ]
    assert rows["MemoryBroker.send (bare)"][1] == "100%"
    for cells in rows.values():
        assert float(cells[0].replace(",", "")) > 0  # sends/s
        assert float(cells[2]) > 0  # CPU µs per send
    assert "reproduce: python -m benchmarks.tracing_overhead --part producer" in out


@pytest.mark.slow
def test_the_consumer_table_has_every_case_and_floor_of_every_mode(tmp_path: Path) -> None:
    # Every case and floor runs in a child forked for it: each must come back with
    # its row, and the target's verdict is printed.
    out_json = tmp_path / "rows.json"
    # The target's three cases run a second round of their own (--target-repeat 2).
    result = run_benchmark(
        "--part",
        "consumer",
        "--messages",
        "400",
        "--repeat",
        "1",
        "--target-repeat",
        "2",
        "--json",
        str(out_json),
    )
    from benchmarks.tracing_overhead import CASES, FLOORS

    rows = json.loads(out_json.read_text())
    modes = {row["mode"] for row in rows}
    assert len(modes) == 3
    for mode in modes:
        cases = [row["case"] for row in rows if row["mode"] == mode]
        assert sorted(cases) == sorted([*CASES, *FLOORS]), mode
    assert all(row["cpu"] > 0 for row in rows)
    [target] = [line for line in result.stdout.splitlines() if "x SDK floor" in line]
    assert "1% sampled <= 1.3 x SDK floor" in target
    assert "medians of 2 rounds (" in target
    # Per mode, the ratio from the medians, then from the best runs and its range
    # over the two rounds.
    assert target.count(" µs = ") == 3
    assert target.count("(best runs ") == 3
    assert target.count(", rounds ") == 3


@pytest.mark.slow
def test_the_instruction_count_table_has_every_case_and_a_verdict() -> None:
    # Six valgrind runs (three cases, two sizes) of one mode, at a smoke size.
    require_service("valgrind", shutil.which("valgrind") is not None, "not on PATH")
    result = run_module(
        "benchmarks.tracing_instructions",
        "--modes",
        "concurrent",
        "--messages",
        "200",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    [row] = [line for line in result.stdout.splitlines() if line.startswith("│ concurrent")]
    cells = [cell.strip() for cell in row.split("│")[2:-1]]
    trace, everything, floor, added = (float(c.rstrip("k").replace(",", "")) for c in cells[:4])
    assert 0 < trace < everything
    assert floor > 0
    assert added == pytest.approx(everything - trace, abs=0.15)
    # the ratio of the unrounded counts; the cells show them to 0.1k
    assert float(cells[4].rstrip("x")) == pytest.approx(added / floor, abs=0.011)
    assert "by instructions: " in result.stdout
    assert "reproduce: python -m benchmarks.tracing_instructions --modes concurrent" in (
        result.stdout
    )


def test_the_instruction_count_needs_valgrind(tmp_path: Path) -> None:
    result = run_module("benchmarks.tracing_instructions", path=str(tmp_path))  # nothing there
    assert result.returncode == 2
    assert "needs valgrind and callgrind_control on PATH" in result.stderr


def test_the_target_verdict_takes_medians_and_shows_the_best_runs_beside_them() -> None:
    from benchmarks.tracing_overhead import (
        SAMPLED_CASE,
        SAMPLED_FLOOR,
        TRACE_CASE,
        best,
        sampled_target,
    )

    # CPU seconds per round for a million messages (so seconds read as µs per
    # message): one short message-trace run missed the load the others met.
    cpu = {TRACE_CASE: [10.0, 10.0, 6.0], SAMPLED_CASE: [22.0, 22.0, 22.0]}
    cpu[SAMPLED_FLOOR] = [10.0, 10.0, 10.0]
    raw = [
        {"mode": "m", "case": case, "cpu": seconds, "round": round_index}
        for case, runs in cpu.items()
        for round_index, seconds in enumerate(runs)
    ]
    line = sampled_target(best(raw), raw, 1_000_000)
    # Medians: (22 - 10) / 10; the best runs: (22 - 6) / 10, which alone would miss.
    assert ": met, medians of 3 rounds (" in line
    assert "m: +12.0 µs vs floor 10.0 µs = 1.20x (best runs 1.60x, rounds 1.20-1.60x)" in line
    # Everything at 30 in every round: (30 - 10) / 10, over the threshold.
    raw = [{**row, "cpu": 30.0} if row["case"] == SAMPLED_CASE else row for row in raw]
    assert ": NOT met, medians of 3 rounds (" in sampled_target(best(raw), raw, 1_000_000)
