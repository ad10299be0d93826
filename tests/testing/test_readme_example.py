"""The worked example of docs/how-to/property-testing.md: the rewards property passes
on the correct listener and finds the planted bug, within hypothesis's default budget,
with the output the page shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "property-testing.md"


def section() -> str:
    return PAGE.read_text()


@pytest.mark.slow
def test_the_rewards_example_finds_the_planted_bug(tmp_path: Path) -> None:
    body = section()
    (code,) = re.findall(r"```python\n(.*?)```", body, re.S)
    (shown,) = re.findall(r"```text\n(.*?)```", body, re.S)
    # the default budget: nothing in the example raises max_examples
    assert "max_examples" not in code
    assert "class ShardedRewards" in code
    assert "crash_at=[crash]" in code
    script = tmp_path / "rewards.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    # the script exits non-zero when the correct listener fails or the bug is missed
    assert result.returncode == 0, result.stdout + result.stderr
    # with CI set, hypothesis adds how to reproduce the failure (print_blob)
    printed = re.sub(r"\n\nYou can reproduce this test case by .*?\n", "\n", result.stdout)
    assert printed == shown
    assert "[wrong-key]" in result.stdout
    assert "Failing test case: rewards_keep_their_order(" in result.stdout
