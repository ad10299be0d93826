"""The README's Python examples run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_readme_demo_output_is_what_the_command_prints() -> None:
    pytest.importorskip("trio")
    text = README.read_text()
    block = re.search(r"```text\n\$ stagedconsumer demo --virtual\n(.*?)```", text, re.S)
    assert block is not None
    result = subprocess.run(
        [sys.executable, "-m", "stagedconsumer", "demo", "--virtual"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert _wall_time_free(block.group(1)) == _wall_time_free(result.stdout)
