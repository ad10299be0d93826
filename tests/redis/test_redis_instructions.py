"""benchmarks/redis_instructions.py counts what redis_e2e's drain phase times, per
system (a smoke run: it checks the program, not the numbers)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_service
from tests.redis.conftest import REDIS_URL, require_redis

ROOT = Path(__file__).resolve().parents[2]


def run(*options: str, path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.redis_instructions", *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200", "PATH": path},
        check=False,
    )


@pytest.mark.slow
def test_instructions_per_message_of_the_consumer_and_the_loop() -> None:
    # Four valgrind runs (two systems, two sizes) at a smoke size.
    require_service("valgrind", shutil.which("valgrind") is not None, "not on PATH")
    url = require_redis()
    result = run(
        "--url",
        url,
        "--messages",
        "80",
        "--systems",
        "stagedconsumer concurrent",
        "redis-py XREADGROUP + XACK loop",
        path=os.environ.get("PATH", "/usr/bin:/bin"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        cells[0]: cells[1:]
        for line in result.stdout.splitlines()
        if line.startswith("│")
        for cells in [[cell.strip() for cell in line.split("│")[1:-1]]]
    }
    consumer, loop = rows["stagedconsumer concurrent"], rows["redis-py XREADGROUP + XACK loop"]
    assert float(loop[0].rstrip("k").replace(",", "")) > 0
    assert float(consumer[0].rstrip("k").replace(",", "")) > 0
    assert loop[1] == "1.00x"
    ratio = float(consumer[0].rstrip("k")) / float(loop[0].rstrip("k"))
    assert float(consumer[1].rstrip("x")) == pytest.approx(ratio, abs=0.02)
    assert "reproduce: python -m benchmarks.redis_instructions" in result.stdout


@pytest.mark.slow
def test_the_instruction_count_needs_valgrind(tmp_path: Path) -> None:
    result = run("--url", REDIS_URL, path=str(tmp_path))  # nothing there
    assert result.returncode == 2
    assert "needs valgrind and callgrind_control on PATH" in result.stderr
