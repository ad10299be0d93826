"""Consumer processes (``tests.redis.group_worker``) of a group, started, stopped and
killed by the multi-process Redis tests (the ``workers`` fixture)."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from stagedconsumer import MessageQueue, RedisBroker

__all__ = ("FAST_GROUP_OPTIONS", "Workers", "lock_owners", "produce")

ROOT = Path(__file__).resolve().parents[2]

FAST_GROUP_OPTIONS = {
    "lock_ttl": 3.0,
    "lock_renew_interval": 0.5,
    "rebalance_interval": 0.5,
    "member_ttl": 1.5,
}
"""Group options of the fault tests: a dead or frozen member's queues move in seconds."""


async def produce(broker: RedisBroker, queues: int, per_queue: int, seconds: float) -> None:
    """Send ``per_queue`` messages to every queue of topic ``t``, spread over
    ``seconds``."""
    chunk = 10
    rounds = per_queue // chunk
    for _ in range(rounds):
        for q in range(queues):
            await broker.send_many("t", [b"x"] * chunk, queue_id=q)
        await anyio.sleep(seconds / rounds)


async def lock_owners(broker: RedisBroker, group: str, queues: int) -> dict[int, str | None]:
    """The client holding the group lock of each queue of topic ``t`` (``None``: free)."""
    coordinator = broker.group_coordinator()
    return {q: await coordinator.lock_owner(group, MessageQueue("t", q)) for q in range(queues)}


class Workers:
    def __init__(self, tmp_path: Path, config: dict[str, Any]) -> None:
        self.tmp_path = tmp_path
        self.config = config
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.client_ids: dict[str, str] = {}

    def log(self, name: str) -> Path:
        return self.tmp_path / f"events-{name}.log"

    def start(self, name: str) -> None:
        config = dict(self.config, log=str(self.log(name)))
        with open(self.tmp_path / f"stderr-{name}.log", "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.redis.group_worker", json.dumps(config)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.procs[name] = proc

    def wait_ready(self, name: str, timeout: float = 30) -> None:
        proc = self.procs[name]
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            # readline() alone would wait past the deadline for a worker that prints
            # nothing (one whose start waits on a queue's claim, say)
            if not select.select([proc.stdout], [], [], left)[0]:
                break
            line = proc.stdout.readline()
            if line.startswith("READY "):
                self.client_ids[name] = line.split()[1]
                return
            if not line and proc.poll() is not None:
                break
        raise AssertionError(
            f"worker {name} did not start:\n" + (self.tmp_path / f"stderr-{name}.log").read_text()
        )

    def stderr(self, name: str) -> str:
        """The end of worker ``name``'s standard error (its log), for failure messages."""
        path = self.tmp_path / f"stderr-{name}.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def stop(self, name: str) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(30)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
