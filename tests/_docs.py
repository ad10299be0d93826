"""Where the documentation lives, for the tests that run or compare what it shows."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def page(name: str) -> str:
    """The text of ``docs/<name>`` (e.g. ``how-to/redis-cluster.md``)."""
    return (DOCS / name).read_text(encoding="utf-8")


def markdown_files() -> list[Path]:
    """README.md and every page of the site."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def python_blocks(path: Path) -> list[tuple[str, str]]:
    """``(heading, code)`` of every ```python block of ``path``, in order; the heading
    is the last one above the block."""
    blocks: list[tuple[str, str]] = []
    heading = path.name
    for match in re.finditer(
        r"^#{1,6} (.+?)$|^```python\n(.*?)^```", path.read_text(), re.M | re.S
    ):
        if match.group(1):
            heading = match.group(1)
        else:
            blocks.append((heading, match.group(2)))
    return blocks
