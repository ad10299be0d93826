"""benchmarks/redis_bytecodes.py counts the Python bytecodes of redis_e2e's drain
phase per function: only the timed part, and in proportion to the messages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import redis_bytecodes
from tests.redis.conftest import require_redis

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_each_message_adds_the_same_bytecodes_to_its_handler_and_decoding() -> None:
    url = require_redis()
    previous = sys.gettrace()  # coverage's tracer under pytest --cov, else None
    runs = [redis_bytecodes.count("stagedconsumer concurrent", n, url) for n in (80, 160, 240)]
    hit = ("Recorder.hit", "redis_e2e.py")
    decode = ("_decode_entries", "_redis_codec.py")
    # The handler's recorder runs once per message, the same code each time: every
    # 80 more messages add the same count, so nothing before or after the timed
    # drain (the fill, the consumer's start) was counted.
    assert runs[0][hit] > 0
    assert runs[1][hit] - runs[0][hit] == runs[2][hit] - runs[1][hit]
    # Every message is decoded once, in the timed part: more messages, more bytecodes.
    assert runs[0][decode] < runs[1][decode] < runs[2][decode]
    # The fill (the broker's sends, a Lua script per batch) was not traced.
    assert not any(name.startswith("fill_") for name, _ in runs[0])
    # the tracer that was there before is back (coverage's goes on measuring)
    assert sys.gettrace() is previous


@pytest.mark.slow
def test_the_program_prints_a_table_per_system() -> None:
    url = require_redis()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.redis_bytecodes",
            "--url",
            url,
            "--messages",
            "80",
            "--top",
            "5",
            "--systems",
            "redis-py XREADGROUP + XACK loop",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "redis-py XREADGROUP + XACK loop: Python bytecodes per message" in result.stdout
    assert "run_xreadgroup" in result.stdout  # the loop's own function is counted
    assert "reproduce: python -m benchmarks.redis_bytecodes" in result.stdout
