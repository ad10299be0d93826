"""The README's Python examples run as written."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[tuple[str, str]]:
    text = README.read_text()
    blocks: list[tuple[str, str]] = []
    for match in re.finditer(r"^## (.+?)$|```python\n(.*?)```", text, re.M | re.S):
        if match.group(1):
            section = match.group(1)
        elif "# readme: skip" not in match.group(2):
            blocks.append((section, match.group(2)))
    return blocks


@pytest.mark.parametrize(("section", "code"), python_blocks(), ids=lambda v: v[:30])
def test_readme_example_runs(section: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, f"{section}: {result.stderr}"


def test_readme_has_the_two_setup_commands() -> None:
    text = README.read_text()
    assert "pip install -e . && .venv/bin/stagedconsumer demo" in text
    ci = (README.parent / ".ci" / "run").read_text()
    test_command = re.search(r"^python3 -m venv .*pytest$", ci, re.M)
    assert test_command is not None
    assert test_command.group(0) in text


def _wall_time_free(text: str) -> list[str]:
    """Lines without trailing spaces, the wall time (the one varying number) masked."""
    return [
        re.sub(r"\d+\.\d\d s of wall time", "N s of wall time", line.rstrip())
        for line in text.strip().splitlines()
    ]


@pytest.mark.parametrize("command", ["demo --virtual", "demo --keys 10 --virtual"])
def test_readme_demo_output_is_what_the_command_prints(command: str) -> None:
    pytest.importorskip("trio")
    text = README.read_text()
    block = re.search(rf"```text\n\$ stagedconsumer {command}\n(.*?)```", text, re.S)
    assert block is not None
    result = subprocess.run(
        [sys.executable, "-m", "stagedconsumer", *command.split()],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert _wall_time_free(block.group(1)) == _wall_time_free(result.stdout)


@pytest.mark.redis
@pytest.mark.postgres
def test_readme_consumer_group_members_keep_running_and_split_the_queues(
    tmp_path: Path,
) -> None:
    """Two members started with --keep-running share the 8 queues 4/4, print their
    queues when they change, and end quietly on Ctrl-C."""
    import signal
    import time

    code = next(code for section, code in python_blocks() if "--keep-running" in code)
    # A namespace and group of this run's own: another run of the suite on this
    # machine would otherwise join the group and take a share of the queues.
    unique = f"readme-{uuid.uuid4().hex[:8]}"
    for fixed in ('namespace="shop"', 'PushConsumer("rewards"'):
        assert fixed in code, fixed
    code = code.replace('namespace="shop"', f'namespace="{unique}"')
    code = code.replace('PushConsumer("rewards"', f'PushConsumer("{unique}"')
    script = tmp_path / "rewards.py"
    script.write_text(code)

    files = []

    def start(name: str) -> tuple[subprocess.Popen[str], Path]:
        log = tmp_path / f"{name}.log"
        files.append(log.open("w"))
        process = subprocess.Popen(
            [sys.executable, "-u", str(script), "--keep-running"],
            stdout=files[-1],
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        return process, log

    def queues(log: Path) -> set[str] | None:
        lines = [line for line in log.read_text().splitlines() if line.startswith("this member's")]
        if not lines:
            return None
        listed = lines[-1].partition(": ")[2]
        return set() if listed == "none" else set(listed.split(", "))

    members = [start("a"), start("b")]
    try:
        deadline = time.monotonic() + 90
        while True:
            seen = [queues(log) for _, log in members]
            if all(s is not None and len(s) == 4 for s in seen):
                break
            assert time.monotonic() < deadline, f"no 4/4 split: {seen}"
            assert all(p.poll() is None for p, _ in members), "a member exited"
            time.sleep(0.5)
        a, b = seen
        assert a is not None
        assert b is not None
        assert a | b == {f"orders#{q}" for q in range(8)}
        for process, _ in members:
            process.send_signal(signal.SIGINT)
        for process, log in members:
            assert process.wait(timeout=60) == 0, log.read_text()[-2000:]
            out = log.read_text()
            assert "stopped: progress committed" in out
            assert "Traceback" not in out
    finally:
        for process, _ in members:
            if process.poll() is None:
                process.kill()
                process.wait()
        for file in files:
            file.close()
        client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
        for key in client.scan_iter(f"{unique}:*"):
            client.delete(key)
        client.close()


def test_every_table_ends_before_the_next_block() -> None:
    lines = README.read_text().splitlines()
    for number, (line, following) in enumerate(itertools.pairwise(lines), start=1):
        if line.startswith("|"):
            assert following.startswith("|") or not following.strip(), (
                f"README.md:{number + 1}: a table runs into {following!r}"
            )


def test_the_memory_table_has_the_columns_the_command_prints() -> None:
    from benchmarks.memory import COLUMNS

    header = next(
        line
        for line in README.read_text().splitlines()
        if line.startswith("| `python -m benchmarks.memory`")
    )
    cells = [cell.strip() for cell in header.strip("|").split("|")]
    assert cells[1:] == list(COLUMNS[1:])
