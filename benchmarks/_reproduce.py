"""The line every benchmark ends with: the command that reproduces its table."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence

from rich.console import Console

__all__ = ("print_reproduce",)


def print_reproduce(console: Console, module: str, argv: Sequence[str] | None) -> None:
    """Print ``reproduce: python -m benchmarks.<module> ARGS`` as one line that can be
    pasted into a shell: arguments quoted where they need it (``--systems "a b"``),
    never wrapped, no rich markup read into them. ``argv`` ``None``: the process's."""
    args = list(argv) if argv is not None else sys.argv[1:]
    command = shlex.join(["python", "-m", f"benchmarks.{module}", *args])
    console.print(f"reproduce: {command}", soft_wrap=True, markup=False, highlight=False)
