"""One process of ``stagedconsumer run``: enter the target's units in order, run until
SIGTERM or SIGINT, leave them in the reverse order.

The first signal leaves gracefully: each consumer stops pulling, lets the handler calls
in flight finish within its ``shutdown_timeout``, commits its progress and hands its
queue locks back; then the process exits 0. A signal while the units are still being
entered stops that and leaves what was entered. A second signal exits at once (status
128 + the signal's number, as a shell reports a process killed by it), after logging
what was abandoned: the handler calls in flight and the progress since the last commit
(their messages are delivered again: delivery is at-least-once), and, in a group, the
queue locks, which expire after the group's ``lock_ttl``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from contextlib import AsyncExitStack

import anyio
import anyio.abc
import attrs

from offsetstore import ReadOffsetType

from .._message import MessageQueue
from ._run_simple import idle_consumers
from ._run_target import TargetError, Unit, enter_target
from ._serve_http import HealthApp, Metrics, RunStatus, serve_http

__all__ = ("RunSettings", "run_target")

logger = logging.getLogger("stagedconsumer.run")

PARENT_ENV = "STAGEDCONSUMER_RUN_PARENT"
"""The supervisor's pid, in a worker process: a worker whose parent went away (killed
without passing a signal on) leaves as on SIGTERM."""

EXIT_TARGET = 2
"""Exit status when ``MODULE:ATTR`` cannot be run (what a usage error exits with)."""


@attrs.define
class RunSettings:
    backend: str = "asyncio"
    http: socket.socket | None = None
    """A listening socket for the endpoints (bound before the event loop starts)."""


def _leaving_what(units: list[Unit]) -> str:
    parts = []
    for unit in units:
        consumer = unit.consumer
        if consumer is not None:
            parts.append(
                f"{unit.name}: stop pulling, let handler calls in flight finish (up to"
                f" shutdown_timeout={consumer.options.shutdown_timeout:g} s), commit,"
                " release its queues"
            )
        elif unit.probe is not None:
            parts.append(unit.probe.leaving())
    return "; ".join(parts) or "leaving " + ", ".join(u.name for u in reversed(units))


def abandoned_report(units: list[Unit]) -> str:
    """What exiting now abandons, consumer by consumer."""
    parts = []
    for unit in units:
        consumer = unit.consumer
        if unit.probe is not None and (what := unit.probe.abandoned()) is not None:
            parts.append(what)
        if consumer is None or consumer._state.closed or not consumer._state.started:
            continue
        stats = consumer.statistics()
        busy = sorted(
            f"{mq.topic}#{mq.queue_id}"
            for mq, q in stats.queues.items()
            if q.cached_count or q.pending_count
        )
        where = f" on {', '.join(busy)}" if busy else ""
        parts.append(
            f"{unit.name}: {stats.in_flight} handler call(s) in flight and"
            f" {stats.cached_count} message(s) pulled and not finished{where};"
            " progress since its last commit is not saved (those messages are"
            " delivered again)"
            + (
                "; its queue locks are not handed back (they expire after the group's lock_ttl)"
                if consumer._coordinator is not None and stats.queues
                else ""
            )
        )
    return "; ".join(parts) or "nothing in flight"


class _Runner:
    def __init__(self, target: object, where: str, settings: RunSettings) -> None:
        self.target = target
        self.where = where
        self.settings = settings
        self.status = RunStatus()
        self.stop: anyio.Event
        self.run_scope: anyio.CancelScope
        self.signals = 0
        self.metrics: Metrics | None = None
        self.target_error: TargetError | None = None

    def begin_leaving(self, why: str, extra: dict[str, object]) -> None:
        status = self.status
        if status.phase == "stopping":
            return
        if status.phase == "starting":
            logger.warning(
                "%s while starting (%s had not finished entering): cancelling that; what"
                " it entered leaves gracefully",
                why,
                self.where,
                extra=extra,
            )
            self.run_scope.cancel()
        else:
            logger.warning(
                "%s: leaving gracefully (%s); a second signal exits at once",
                why,
                _leaving_what(status.units),
                extra=extra,
            )
        status.phase = "stopping"
        self.stop.set()

    async def watch_signals(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            task_status.started()
            async for signum in received:
                name = signal.Signals(signum).name
                self.signals += 1
                if self.signals == 1:
                    self.begin_leaving(f"received {name}", {"signal": name})
                    continue
                code = 128 + signum
                logger.error(
                    "received %s again: exiting at once with status %d; abandoned: %s",
                    name,
                    code,
                    abandoned_report(self.status.units),
                    extra={"signal": name, "exit_status": code},
                )
                logging.shutdown()
                sys.stdout.flush()
                os._exit(code)

    async def _watch(
        self,
        scope: anyio.CancelScope,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        with scope:
            async with anyio.create_task_group() as tg:
                await tg.start(self.watch_signals)  # before the target's code runs
                parent = os.environ.get(PARENT_ENV)
                if parent is not None:
                    tg.start_soon(self.watch_parent, int(parent))
                task_status.started()

    async def watch_parent(self, parent: int) -> None:
        # nothing signals a parent's death to a child portably: look once a second
        while os.getppid() == parent:  # noqa: ASYNC110
            await anyio.sleep(1.0)
        self.begin_leaving(f"the supervisor (pid {parent}) went away", {"parent": parent})

    async def run_units(self) -> None:
        status = self.status
        metrics = self.metrics
        before: dict[int, tuple[list[MessageQueue], int, int]] = {}
        with self.run_scope:
            async with AsyncExitStack() as stack:
                started = time.monotonic()
                await enter_target(
                    self.target,
                    self.where,
                    stack,
                    status.units,
                    metrics.prepare if metrics is not None else lambda unit: None,
                )
                for idle in idle_consumers(status.units):
                    logger.warning(
                        "SimpleConsumer %s: nothing receives from it; run a"
                        " SimpleWorker(consumer, handler) with it",
                        idle.group,
                        extra={"group": idle.group},
                    )
                if status.phase == "starting":
                    status.phase = "running"
                    logger.info(
                        "running %s (started in %.2f s): %s",
                        self.where,
                        time.monotonic() - started,
                        ", ".join(unit.name for unit in status.units),
                        extra={"target": self.where},
                    )
                    await self.stop.wait()
                status.phase = "stopping"
                for index, unit in enumerate(status.units):
                    if unit.consumer is not None and not unit.consumer._state.closed:
                        stats = unit.consumer.statistics()
                        before[index] = (
                            unit.consumer.assigned_queues,
                            stats.in_flight,
                            stats.commit_errors,
                        )
                leaving = time.monotonic()
        status.phase = "stopping"
        for index, (queues, in_flight, commit_errors) in before.items():
            await self._left(
                status.units[index], queues, in_flight, commit_errors, time.monotonic() - leaving
            )

    async def _left(
        self,
        unit: Unit,
        queues: list[MessageQueue],
        in_flight: int,
        commit_errors: int,
        seconds: float,
    ) -> None:
        consumer = unit.consumer
        assert consumer is not None
        stats = consumer.statistics()
        committed = []
        for mq in queues:
            offset = await consumer.offset_store.read_offset(
                consumer.group, mq, ReadOffsetType.READ_FROM_MEMORY
            )
            if offset is not None:
                committed.append(f"{mq.topic}#{mq.queue_id} at {offset}")
        if stats.commit_errors > commit_errors:
            progress = (
                "the last commit failed (logged above): the group resumes from the progress"
                " committed before it"
            )
        else:
            progress = "progress committed: " + (", ".join(committed) or "none")
        logger.info(
            "%s left in %.2f s: %d handler call(s) were in flight, %d abandoned at"
            " shutdown_timeout; %s",
            unit.name,
            seconds,
            in_flight,
            stats.abandoned_calls,
            progress,
            extra={
                "group": consumer.group,
                "client_id": consumer.client_id,
                "abandoned_calls": stats.abandoned_calls,
            },
        )

    async def main(self) -> int:
        self.stop = anyio.Event()
        self.run_scope = anyio.CancelScope()
        shutdown_http = anyio.Event()
        watching = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            await tg.start(self._watch, watching)
            sock = self.settings.http
            if sock is not None:
                try:
                    self.metrics = Metrics()
                except ImportError as exc:
                    logger.warning(
                        "/metrics is off: %s is not installed (pip install 'stagedconsumer[run]')",
                        exc.name,
                    )
                host, port = sock.getsockname()[:2]
                app = HealthApp(self.status, self.metrics)
                await tg.start(serve_http, app, sock, shutdown_http)
                logger.info(
                    "serving /healthz, /readyz and /metrics on http://%s:%d",
                    host if ":" not in host else f"[{host}]",
                    port,
                    extra={"http_port": port},
                )
            try:
                await self.run_units()
            except TargetError as exc:
                self.target_error = exc
                return EXIT_TARGET
            except Exception:
                logger.exception("%s stopped by a failure", self.where)
                return 1
            except SystemExit as exc:  # a handler's sys.exit(), after the graceful exit
                logger.warning("%s: sys.exit(%r) in the application", self.where, exc.code)
                return exc.code if isinstance(exc.code, int) else 1
            finally:
                if self.metrics is not None:
                    self.metrics.close()
                shutdown_http.set()  # Hypercorn finishes the requests it serves, then returns
                watching.cancel()
        logger.info("%s: everything left; exiting", self.where)
        return 0


def run_target(target: object, where: str, settings: RunSettings) -> int:
    """Run ``target`` (see :mod:`._run_target`) until a signal; the exit status."""
    runner = _Runner(target, where, settings)
    code = anyio.run(runner.main, backend=settings.backend)
    if runner.target_error is not None:
        raise runner.target_error
    return code
