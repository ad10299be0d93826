"""Counting instructions with valgrind's callgrind, for the ``*_instructions``
benchmarks: a child process runs under callgrind with counting off, switches it on
around the part that is timed elsewhere, and the parent reads the total.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TOOLS = ("valgrind", "callgrind_control")
_COLLECTED = re.compile(r"Collected : (\d+)")


def missing_tools() -> list[str]:
    """The tools of :data:`TOOLS` not on ``PATH``."""
    return [tool for tool in TOOLS if not shutil.which(tool)]


def counting(on: bool) -> None:
    """Switch callgrind's instruction counting for this process on or off (it takes
    effect before ``callgrind_control`` returns)."""
    subprocess.run(
        ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
        capture_output=True,
        check=True,
    )


class SwitchingClock:
    """A ``time`` module for a benchmark that times a part with two
    ``process_time()`` calls: the first calls ``switch(True)``, the second
    ``switch(False)`` (what they switch on and off is the caller's)."""

    def __init__(self, switch: Callable[[bool], None]) -> None:
        self.calls = 0
        self.switch = switch
        # The module's other functions as plain attributes: found without the failed
        # lookup (an ``AttributeError`` made and dropped) that ``__getattr__`` follows,
        # which would count about 2,000 instructions per call.
        for name in dir(time):
            if not name.startswith("_") and name != "process_time":
                setattr(self, name, getattr(time, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def process_time(self) -> float:
        self.calls += 1
        if self.calls <= 2:
            self.switch(self.calls == 1)
        return time.process_time()


class CountingClock(SwitchingClock):
    """A :class:`SwitchingClock` that switches callgrind's counting on and off."""

    def __init__(self) -> None:
        super().__init__(counting)


def instructions(module: str, child_args: Sequence[str], what: str) -> int:
    """Instructions counted in ``python -m MODULE --child CHILD_ARGS`` under callgrind
    (counting off at start: the child switches it on); ``what`` names the run in
    errors."""
    with tempfile.TemporaryDirectory() as directory:
        result = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={Path(directory) / 'callgrind.out'}",
                sys.executable,
                "-m",
                module,
                "--child",
                *child_args,
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
            check=False,
        )
    found = _COLLECTED.search(result.stderr)
    if result.returncode != 0 or found is None:
        raise RuntimeError(f"{what} failed:\n{result.stderr[-3000:]}")
    return int(found.group(1))
