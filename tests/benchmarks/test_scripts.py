"""Every benchmark runs both as ``python -m benchmarks.NAME`` and as a script,
``python benchmarks/NAME.py``, from any directory (the README says so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(
    path.stem
    for path in (ROOT / "benchmarks").glob("*.py")
    if not path.stem.startswith("_")  # __init__, __main__ and helper modules
)


def test_no_benchmark_module_is_named_like_a_package() -> None:
    # run as a script, benchmarks/ is first on sys.path: a module there named like a
    # package (offsetstore, stagedconsumer) shadows it
    for package in ("offsetstore", "stagedconsumer", "benchmarks", "anyio", "redis", "trio"):
        assert package not in BENCHMARKS


@pytest.mark.slow
@pytest.mark.parametrize("name", BENCHMARKS)
@pytest.mark.parametrize("how", ["script", "module"])
def test_benchmark_starts(name: str, how: str, tmp_path: Path) -> None:
    if how == "script":
        command, cwd = [sys.executable, str(ROOT / "benchmarks" / f"{name}.py")], tmp_path
    else:
        command, cwd = [sys.executable, "-m", f"benchmarks.{name}"], ROOT
    result = subprocess.run(
        [*command, "--help"], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    assert result.stderr == ""


RUNS = {
    # every case of each, small: a benchmark that reuses its backlog across cases and
    # repeats must consume all of it every time (it raises otherwise)
    "overhead": ["--messages", "1600", "--repeat", "2"],
    "overhead --handler checkpoint": [
        "--messages",
        "1600",
        "--repeat",
        "1",
        "--handler",
        "checkpoint",
    ],
    "memory": ["--messages", "1600"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_benchmark_runs_every_case(name: str) -> None:
    module = name.split()[0]
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *RUNS[name]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"reproduce: python -m benchmarks.{module}" in result.stdout.replace("\n", " ")


def test_overhead_sets_every_row_against_the_plain_await_floor() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.overhead", "--messages", "800", "--repeat", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        line.split("│")[1].strip(): line
        for line in result.stdout.splitlines()
        if line.startswith("│")
    }
    assert {
        "plain-await floor",
        "concurrent",
        "concurrent, sync handler",
        "concurrent + no-op hook",
        "orderly, 8 queues + no-op hook",
    } <= set(rows)
    assert "vs floor (CPU)" in result.stdout
    assert "│ 1.0x │" in rows["plain-await floor"].replace("  ", "")


@pytest.mark.slow
def test_trace_sink_runs_a_baseline_tree_beside_this_one(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    command = [sys.executable, "-m", "benchmarks.trace_sink", "--seconds", "0.3", "--rounds", "1"]
    result = subprocess.run(
        [*command, "--baseline", str(ROOT), "--baseline-label", "same", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reproduce: python -m benchmarks.trace_sink" in result.stdout.replace("\n", " ")
    runs = {run["case"]: run for run in json.loads(out.read_text())}
    assert set(runs) == {
        "no trace",
        "topic trace",
        "file trace, same",
        "file trace",
        "file sink alone, same",
        "file sink alone",
    }
    assert "The file sink alone" in result.stdout
    for case in ("file sink alone, same", "file sink alone"):
        assert runs[case]["contexts"] == 200_000  # 20,000 messages of 10 contexts
        assert runs[case]["cpu_seconds"] > 0
    for case in ("topic trace", "file trace, same", "file trace"):
        # Every context is accounted for: written (two records per message) or counted
        # as dropped (a fast machine can outrun the file's writer thread within its
        # buffer in so short a run), none lost to a failed write.
        run = runs[case]
        assert run["consumed"] > 0
        assert run["records"] > 0
        assert (run["records"] + run["dropped"], run["lost"]) == (2 * run["consumed"], 0)
