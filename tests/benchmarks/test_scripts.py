"""Every benchmark runs both as ``python -m benchmarks.NAME`` and as a script,
``python benchmarks/NAME.py``, from any directory (the README says so)."""

from __future__ import annotations

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
