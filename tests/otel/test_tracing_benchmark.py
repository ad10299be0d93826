"""benchmarks/tracing_overhead.py's producer table runs and reports every case (a
smoke run: it checks the program, not the numbers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_producer_table_lists_every_case() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.tracing_overhead",
            "--part",
            "producer",
            "--sends",
            "300",
            "--repeat",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
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
