"""``stagedconsumer run`` as a real process, for the tests of the command: started with
its standard error in a file, waited on for log lines, signalled, killed afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ("ROOT", "RunProcess", "get")


class RunProcess:
    """``python -m stagedconsumer run ARGS`` in the repository's root, with
    ``STAGEDCONSUMER_TEST_RUN`` set to ``config`` as JSON."""

    def __init__(
        self, tmp_path: Path, *args: str, config: dict[str, Any] | None = None, name: str = "run"
    ) -> None:
        self.stderr_path = tmp_path / f"{name}.stderr"
        env = dict(os.environ, STAGEDCONSUMER_TEST_RUN=json.dumps(config or {}))
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stagedconsumer", "run", *args],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=env,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.stderr_path.read_text()

    def wait_for(
        self, pattern: str, *, count: int = 1, timeout: float = 60, exited: bool = False
    ) -> re.Match[str]:
        """The ``count``-th match of the regular expression ``pattern`` in the log,
        once it is there (a bound for a hung process only: the log decides). Fails
        early when the process exits first, unless ``exited`` (the log is written by
        its children too)."""
        deadline = time.monotonic() + timeout
        while True:
            matches = list(re.finditer(pattern, self.log()))
            if len(matches) >= count:
                return matches[count - 1]
            if (
                not exited
                and self.proc.poll() is not None
                and len(list(re.finditer(pattern, self.log()))) < count
            ):
                raise AssertionError(
                    f"exited ({self.proc.returncode}) before logging {pattern!r}:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} in the log after {timeout} s:\n{self.log()}")
            time.sleep(0.05)

    def http_port(self) -> int:
        return int(self.wait_for(r"/metrics on http://127\.0\.0\.1:(\d+)").group(1))

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.log()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def get(port: int, path: str) -> tuple[int, str]:
    """``GET http://127.0.0.1:port/path``: the status and the body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as reply:
            return int(reply.status), reply.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()
