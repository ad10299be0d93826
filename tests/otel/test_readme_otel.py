"""The documented end-to-end OpenTelemetry example prints what the page shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "opentelemetry.md"


@pytest.mark.slow
def test_the_readme_trace_of_a_retried_message_is_what_the_example_prints(
    tmp_path: Path,
) -> None:
    text = README.read_text()
    section = text
    match = re.search(r"```python\n(.*?)```\n\n```text\n(.*?)```", section, re.S)
    assert match is not None
    code, shown = match.groups()
    assert "OpenTelemetrySendHook" in code
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == shown.splitlines()
