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
