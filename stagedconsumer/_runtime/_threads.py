"""ThreadRunner: runs plain ``def`` handlers in daemon worker threads.

``anyio.to_thread.run_sync`` would do, but on asyncio its worker threads are not
daemon threads: a handler stuck in blocking code keeps the process alive after the
consumer gave up waiting for it, so neither leaving ``async with`` nor a second
Ctrl-C ends the program. On asyncio the runner therefore starts daemon threads of
its own (inside a handler ``anyio.from_thread`` works as in anyio's worker threads);
on trio, whose worker threads are daemon threads, it uses ``anyio.to_thread``. On
both, a call whose caller is cancelled is abandoned at once: its thread finishes it
unobserved.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio._core._eventloop as _anyio_eventloop
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import sniffio

__all__ = ("ThreadRunner",)

# What makes anyio.from_thread work without a token in anyio's own worker threads
# (private to anyio: a future anyio without it leaves explicit tokens working).
_claim: Any = getattr(_anyio_eventloop, "claim_worker_thread", None)


@contextlib.contextmanager
def _as_anyio_worker(token: anyio.lowlevel.EventLoopToken) -> Iterator[None]:
    if _claim is None:  # pragma: no cover
        yield
        return
    with _claim(token.backend_class, token.native_token):
        yield


class _Call:
    __slots__ = ("args", "context", "done", "error", "func", "result", "token")

    def __init__(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        token: anyio.lowlevel.EventLoopToken,
    ) -> None:
        self.func = func
        self.args = args
        self.context = contextvars.copy_context()
        self.token = token
        self.done = anyio.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class _Worker(threading.Thread):
    def __init__(self, runner: ThreadRunner) -> None:
        super().__init__(name="stagedconsumer handler", daemon=True)
        self.runner = runner
        self.calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            call = self.calls.get()
            if call is None:
                return
            with _as_anyio_worker(call.token):
                try:
                    call.result = call.context.run(call.func, *call.args)
                except BaseException as exc:  # handed to the caller, as anyio does
                    call.error = exc
            try:
                keep = anyio.from_thread.run_sync(
                    self.runner._finished, self, call, token=call.token
                )
            except Exception:  # the event loop is gone: nobody waits any more
                return
            if not keep:
                return


class ThreadRunner:
    """Runs sync callables in daemon threads, at most ``limit`` at a time.

    Ordering guarantee: none between calls; each call runs in one thread from start
    to end. Threads are reused; :meth:`close` lets idle ones end and busy ones end
    after their call.
    """

    def __init__(self, limit: int) -> None:
        self._limiter = anyio.CapacityLimiter(limit)
        self._idle: list[_Worker] = []
        self._closed = False
        self._own_threads: bool | None = None
        self.abandoned = 0
        """Calls whose caller stopped waiting (cancelled) before they returned."""

    async def run_sync(self, func: Callable[..., Any], *args: Any) -> Any:
        """``func(*args)`` in a worker thread; cancelling the caller abandons the call."""
        if self._own_threads is None:
            self._own_threads = sniffio.current_async_library() == "asyncio"
        if not self._own_threads:
            try:
                return await anyio.to_thread.run_sync(
                    func, *args, abandon_on_cancel=True, limiter=self._limiter
                )
            except anyio.get_cancelled_exc_class():
                self.abandoned += 1
                raise
        async with self._limiter:
            call = _Call(func, args, anyio.lowlevel.current_token())
            worker = self._idle.pop() if self._idle else None
            if worker is None:
                worker = _Worker(self)
                worker.start()
            worker.calls.put(call)
            try:
                await call.done.wait()
            except BaseException:
                if not call.done.is_set():
                    self.abandoned += 1
                raise
        if call.error is not None:
            raise call.error
        return call.result

    def _finished(self, worker: _Worker, call: _Call) -> bool:
        """In the event loop: a call returned; whether its thread takes another."""
        call.done.set()
        if self._closed:
            return False
        self._idle.append(worker)
        return True

    def close(self) -> None:
        """Let idle threads end now and busy ones after their call."""
        self._closed = True
        idle, self._idle = self._idle, []
        for worker in idle:
            worker.calls.put(None)
