"""``stagedconsumer run --workers N``: N worker processes of the same group, supervised.

Each worker is ``python -m stagedconsumer run`` with the same target and options, in a
session of its own (a Ctrl-C in the terminal reaches the supervisor alone, which passes
it on once). The workers join the group as any members do and split its queues. A
worker that dies is started again after a backoff (0.5 s, doubling up to 30 s; back to
0.5 s once a worker has run for a minute), and the log says which worker, how it ended
and when it comes back. SIGTERM or SIGINT to the supervisor is passed on to every worker
as SIGTERM, and the supervisor waits for them all to leave; a second signal is passed on
too (the workers then exit at once). A worker that cannot load ``MODULE:ATTR`` is not
restarted: the supervisor stops the others and exits with its status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import anyio
import anyio.abc

from ._run_logging import WORKER_ENV
from ._run_service import EXIT_TARGET, PARENT_ENV

__all__ = ("describe_exit", "supervise")

logger = logging.getLogger("stagedconsumer.run")

FIRST_DELAY = 0.5
MAX_DELAY = 30.0
HEALTHY_AFTER = 60.0
"""A worker that ran this long before dying is restarted after the first delay again."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class _Supervisor:
    def __init__(self, worker_args: Sequence[Sequence[str]], backend: str) -> None:
        self.worker_args = worker_args
        self.backend = backend
        self.procs: dict[int, anyio.abc.Process] = {}
        self.stopping = anyio.Event()
        self.signals = 0
        self.failed = False
        self.fatal: int | None = None

    async def watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                name = signal.Signals(signum).name
                self.signals += 1
                if self.signals == 1:
                    logger.warning(
                        "received %s: passing SIGTERM on to %d worker(s) and waiting for"
                        " them to leave; a second signal makes them exit at once",
                        name,
                        len(self.procs),
                        extra={"signal": name},
                    )
                else:
                    logger.error(
                        "received %s again: passing it on; the workers exit at once",
                        name,
                        extra={"signal": name},
                    )
                    self.failed = True
                self.stopping.set()
                self._pass_on()

    def _pass_on(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):  # exited just now
                    proc.send_signal(signal.SIGTERM)

    async def keep(self, index: int) -> None:
        """Run worker ``index`` until the supervisor stops, starting it again when it dies."""
        delay = FIRST_DELAY
        env = dict(os.environ, **{WORKER_ENV: str(index), PARENT_ENV: str(os.getpid())})
        command = [sys.executable, "-m", "stagedconsumer", *self.worker_args[index]]
        while not self.stopping.is_set():
            proc = await anyio.open_process(
                command,
                stdin=subprocess.DEVNULL,
                stdout=None,
                stderr=None,
                env=env,
                start_new_session=True,
            )
            self.procs[index] = proc
            started = time.monotonic()
            logger.info(
                "worker %d started (pid %d)",
                index,
                proc.pid,
                extra={"worker_index": index, "pid": proc.pid},
            )
            if self.stopping.is_set():  # a signal came while it was being started
                proc.send_signal(signal.SIGTERM)
            with anyio.CancelScope(shield=True):
                code = await proc.wait()
            how = describe_exit(code)
            if self.stopping.is_set():
                log = logger.info if code == 0 else logger.warning
                log("worker %d (pid %d) %s", index, proc.pid, how, extra={"worker_index": index})
                if code != 0:
                    self.failed = True
                return
            if code == EXIT_TARGET:
                logger.error(
                    "worker %d (pid %d) could not load its target (%s): stopping the others",
                    index,
                    proc.pid,
                    how,
                    extra={"worker_index": index},
                )
                self.fatal = code
                self.stopping.set()
                self._pass_on()
                return
            if time.monotonic() - started >= HEALTHY_AFTER:
                delay = FIRST_DELAY
            logger.error(
                "worker %d (pid %d) %s; starting it again in %.1f s",
                index,
                proc.pid,
                how,
                delay,
                extra={"worker_index": index, "exit_status": code, "restart_in": delay},
            )
            with anyio.move_on_after(delay):
                await self.stopping.wait()
            delay = min(delay * 2, MAX_DELAY)

    async def main(self) -> int:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.watch_signals)
            async with anyio.create_task_group() as workers:
                for index in range(len(self.worker_args)):
                    workers.start_soon(self.keep, index)
            tg.cancel_scope.cancel()
        if self.fatal is not None:
            return self.fatal
        if self.failed:
            return 128 + signal.SIGTERM if self.signals > 1 else 1
        logger.info("all %d workers left; exiting", len(self.worker_args))
        return 0


def supervise(worker_args: Sequence[Sequence[str]], backend: str) -> int:
    """Run one worker per entry of ``worker_args`` (each the arguments of
    ``stagedconsumer``) until a signal; the exit status."""
    return anyio.run(_Supervisor(worker_args, backend).main, backend=backend)
