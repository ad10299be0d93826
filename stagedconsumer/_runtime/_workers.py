"""WorkerPool: ``consume_thread_max`` workers that take batches and run the listener.

The worker loops are the same for every mode; the consume service supplies the
handler's context, the result that means success and the settlement of a failure.
Workers whose handler is an ``async def`` called on one message at a time with no
consume hooks run runs (:mod:`._runs`); the others run :meth:`WorkerPool._work`. In
both the success path is inlined in the loop (no extra coroutine per batch).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from offsetstore import AlreadyFinishedError

from .._core import READY, Batch, Dispatcher, EraseStatus, ProcessQueue
from .._exceptions import LeaseEndedError
from .._listeners import is_async_callable
from .._message import Message
from .._observability._hooks import ConsumeMessageContext, ConsumeReturnType
from ._hooks import HookRunner, loop_clock, thread_clock
from ._runs import CHECKPOINT_EVERY, Run, drive, run_loop
from ._services import ConsumeService
from ._signals import Signals
from ._state import ConsumerState, QueueState
from ._threads import ThreadRunner
from ._transact import Transactor

__all__ = ("WorkerPool",)

logger = logging.getLogger("stagedconsumer")

_NEVER_AGAIN = 365 * 24 * 3600.0
"""Seconds a batch whose handler called ``sys.exit()`` waits: the consumer stops first."""
_SUCCESS = EraseStatus.SUCCESS
_GIVEN_BACK: Any = object()
"""What a handler thread returns instead of calling the handler: the queue's lease
ended before the call (see :func:`_call_while_leased`)."""
_READY = READY
_NOT_READY = ~READY


class _Slot:
    """One worker's handler call in progress, seen by the consume-timeout scanner."""

    __slots__ = ("call", "scans", "scope", "seen", "timed_out")

    def __init__(self) -> None:
        self.call: tuple[Batch, Any, ConsumeMessageContext | None] | None = None
        """The batch, its context and hook context while the handler runs."""
        self.scope: anyio.CancelScope | None = None
        self.seen: object = None
        """The call the scanner saw last, and how many scans since it first did."""
        self.scans = 0
        self.timed_out = False


class WorkerPool:
    """Runs the listener on batches from the dispatcher, ``workers`` at a time.

    ``async def`` handlers run in the worker task; plain ``def`` handlers in a daemon
    worker thread, at most ``workers`` at once (see :class:`ThreadRunner`). With
    ``leased`` set (queues owned through group locks), a batch is handed out only
    while its queue's lease lasts, and a plain ``def`` handler's thread checks it once
    more right before the call: a batch whose lease ended in between (the process
    was paused, say) goes back to its queue uncalled (:meth:`Dispatcher.untake`).
    An ``async def`` handler starts in the same step of the event loop as its take,
    with nothing awaited in between, so its take's check is as late as that one.
    """

    def __init__(
        self,
        *,
        state: ConsumerState,
        dispatcher: Dispatcher,
        service: ConsumeService,
        signals: Signals,
        consume: Callable[..., Any],
        workers: int,
        batch_size: int,
        hooks: HookRunner | None,
        leased: bool,
    ) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.service = service
        self.signals = signals
        self.consume = consume
        self.is_async = is_async_callable(consume)
        self.workers = workers
        self.batch_size = batch_size
        self.hooks = hooks
        self.leased = leased
        self.runs = self.is_async and batch_size == 1 and hooks is None
        """Whether workers run runs (see :meth:`_work`)."""
        self._threads = ThreadRunner(workers)
        self._scope: anyio.CancelScope | None = None
        self.consume_timeout = service.options.consume_timeout
        self._slots: list[_Slot] = []
        self._done = anyio.Event()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the workers until the consumer stops (see :meth:`drain`)."""
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                async with anyio.create_task_group() as watcher:
                    if self.consume_timeout is not None:
                        watcher.start_soon(self._watch_timeouts, self.consume_timeout)
                    async with anyio.create_task_group() as workers:
                        for _ in range(self.workers):
                            workers.start_soon(self._worker)
                        task_status.started()
                    watcher.cancel_scope.cancel()  # the workers are done
        finally:
            self._done.set()

    async def drain(self, timeout: float, queues: Iterable[QueueState] = ()) -> int:
        """Let handler calls in flight finish (the consumer is stopping: no new batch is
        taken), for at most ``timeout`` seconds; then abandon the rest: their messages
        stay pending, so they are not committed and are delivered again (logged, with
        the queues of ``queues`` concerned). Returns how many calls were abandoned."""
        self.signals.work.wake_all()
        try:
            with anyio.move_on_after(timeout):
                await self._done.wait()
            running = self.state.in_flight
            if running:
                self.state.abandoned_calls += running
                logger.warning(
                    "group %s: %d handler call(s) still running after shutdown_timeout"
                    " (%.1f s) are abandoned: their messages are not committed and will be"
                    " delivered again (%s)",
                    self.state.group,
                    running,
                    timeout,
                    ", ".join(
                        f"{queue.mq} from offset {queue.pq.committed_offset}"
                        for queue in queues
                        if queue.pq.in_handlers
                    ),
                )
            if self._scope is not None:
                self._scope.cancel()
            await self._done.wait()
        finally:
            self._threads.close()
        return running

    async def _call_sync(
        self, messages: Sequence[Message], context: Any, pq: ProcessQueue, clock: Any
    ) -> Any:
        """A plain ``def`` handler's call, in a handler thread (``pq`` and ``clock`` as
        for :meth:`_call_leased`, unused)."""
        result = await self._threads.run_sync(self.consume, messages, context)
        if inspect.isawaitable(result):  # a plain def that returned an awaitable
            result = await result
        return result

    async def _call_leased(
        self,
        messages: Sequence[Message],
        context: Any,
        pq: ProcessQueue,
        clock: Callable[[], float],
    ) -> Any:
        """:meth:`_call_sync` on a leased queue: :data:`_GIVEN_BACK`, without calling
        the handler, when the thread finds the lease ended (see
        :func:`_call_while_leased`)."""
        result = await self._threads.run_sync(
            _call_while_leased, self.consume, pq, clock, messages, context
        )
        if inspect.isawaitable(result):  # a plain def that returned an awaitable
            result = await result
        return result

    async def _worker(self) -> None:
        """Take batches and run the listener on them until the consumer stops.

        With a consume timeout, the loop runs in a cancel scope that the scanner
        (:meth:`_watch_timeouts`) cancels when a handler call runs too long; the
        call is then settled as a failure and the loop starts again."""
        slot = None if self.consume_timeout is None else _Slot()
        if slot is None:
            await self._loop(slot)
            return
        self._slots.append(slot)
        while True:
            slot.timed_out = False
            with anyio.CancelScope() as scope:
                slot.scope = scope
                await self._loop(slot)
            if not slot.timed_out:  # the consumer stops
                return
            call, slot.call = slot.call, None
            assert call is not None
            await self._timed_out(*call)

    async def _loop(self, slot: _Slot | None) -> None:
        """The worker loop: with runs, :func:`~._runs.run_loop` under
        :func:`~._runs.drive`."""
        if self.runs:
            run = Run(slot)
            self.service.active_runs.append(run)  # transact() finds its call's message
            try:
                await drive(self, run_loop(self, run), run)
            finally:
                self.service.active_runs.remove(run)
        else:
            await self._work(slot)

    async def _watch_timeouts(self, timeout: float) -> None:
        """Every tenth of ``timeout``: time out the handler calls that the previous
        scans saw running for ``timeout`` seconds (so a call ends between ``timeout``
        and 1.1 times it). Costs the workers one tuple per call, nothing else."""
        interval = timeout / 10
        slots = self._slots
        while True:
            await anyio.sleep(interval)
            for slot in slots:
                call = slot.call
                if call is None:
                    slot.seen = None
                elif call is not slot.seen:  # started since the last scan
                    slot.seen, slot.scans = call, 0
                else:
                    # Seen first at most one interval after it started: ten more scans
                    # (at least ``timeout`` later, each sleep lasting at least its
                    # interval) put the call past ``timeout`` and, on a loop that keeps
                    # time, within 1.1 times it.
                    slot.scans += 1
                    if slot.scans >= 10 and not slot.timed_out:
                        slot.timed_out = True
                        if slot.scope is not None:
                            slot.scope.cancel()

    async def _timed_out(
        self, batch: Batch, context: Any, hook_ctx: ConsumeMessageContext | None
    ) -> None:
        """A handler call ran longer than ``consume_timeout``: a failure like any other.
        (A run's call times out only after it suspended: its batch holds it alone.)"""
        timeout = self.consume_timeout
        messages = batch.messages
        self.state.timed_out_calls += 1
        logger.warning(
            "group %s: a handler call on %s (offsets %d..%d) ran longer than"
            " consume_timeout (%.6g s): %s, and the call is retried as a failure",
            self.state.group,
            batch.process_queue.message_queue,
            messages[0].queue_offset,
            messages[-1].queue_offset,
            timeout,
            "cancelled" if self.is_async else "abandoned (its thread finishes it unobserved)",
        )
        error = TimeoutError(f"handler call ran longer than consume_timeout ({timeout:.6g} s)")
        if hook_ctx is not None:
            hook_ctx.end_time = anyio.current_time()
        await self._settle(batch, context, error, None, hook_ctx)
        if hook_ctx is not None:
            self._hooks_after(hook_ctx, error, None, timed_out=True)

    async def _work(self, slot: _Slot | None) -> None:
        """The worker loop without runs (see :meth:`_worker`): take a batch, call the
        handler on it (on the event loop, or in a handler thread for a plain ``def``),
        finish it or settle its failure, with the consume hooks around the call."""
        state, service = self.state, self.service
        dispatcher, signals = self.dispatcher, self.signals
        take, finish, has_ready = dispatcher.take, dispatcher.finish, dispatcher.has_ready
        apply, work, idle = signals.apply, signals.work, signals.work.idle
        context_for, ok, partial_ack = service.context_for, service.success, service.partial_ack
        batch_max, consume, is_async = self.batch_size, self.consume, self.is_async
        hooks, leased = self.hooks, self.leased
        lease_clock = thread_clock() if leased and not is_async else None
        call_sync: Callable[..., Any] = self._call_leased if lease_clock else self._call_sync
        suspend_ms = service.options.suspend_current_queue_time_millis
        hook_ctx: ConsumeMessageContext | None = None
        clock = loop_clock() if hooks is not None or leased else anyio.current_time
        streak = 0
        while not state.stopping:
            batch = take(batch_max, clock()) if leased else take(batch_max)
            if batch is None:
                streak = 0
                await work.wait()
                continue
            if idle and has_ready():
                idle.popleft().set()
            pq = batch.process_queue
            call = batch.messages
            context = context_for(batch, suspend_ms)
            error: Exception | None = None
            result: Any = None
            if hooks is not None:
                hook_ctx = self._hook_context(batch, clock)
                hooks.before(hook_ctx)
            state.in_flight += 1
            if slot is not None:
                slot.call = (batch, context, hook_ctx)
            try:
                if is_async:
                    result = await consume(call, context)
                else:  # in a handler thread
                    result = await call_sync(call, context, pq, lease_clock)
            except Exception as exc:  # a failing handler never stops the consumer
                error = exc
            except SystemExit as exc:  # sys.exit() in a handler: stop the consumer
                self._exit_requested(batch, exc)
                return
            finally:
                state.in_flight -= 1
            if slot is not None:
                if slot.timed_out:  # timed out as it returned: the result is ignored
                    return
                slot.call = None
            if hook_ctx is not None:
                hook_ctx.end_time = clock()
            if (
                error is not None
                or (result is not None and result is not ok)
                or (partial_ack and context.ack_index < len(call) - 1)
            ):
                if result is _GIVEN_BACK:  # not called: the lease ended before
                    error, result = self._give_back(batch), None
                else:
                    await self._settle(batch, context, error, result, hook_ctx)
            else:
                streak += 1
                state.consumed_ok += len(call)
                if hook_ctx is None:
                    effects = finish(batch, _SUCCESS)  # this worker takes what it freed
                else:
                    hook_ctx.success = True
                    effects = finish(batch, _SUCCESS, hook_ctx.end_time)
                if effects > _READY:  # READY alone: this worker takes the next batch itself
                    apply(pq, effects & _NOT_READY)
            if hook_ctx is not None:
                self._hooks_after(hook_ctx, error, result)
                hook_ctx = None
            if streak >= CHECKPOINT_EVERY:
                streak = 0
                await anyio.lowlevel.checkpoint()

    def _give_back(self, batch: Batch) -> LeaseEndedError:
        """The queue's lease ended (or the queue was released) before the handler's
        thread started the call, which it did not make: the batch goes back to its
        queue as if it had never been taken (:meth:`Dispatcher.untake`): not finished,
        not settled, no attempt counted; whoever consumes the queue next gets it.
        Returns what the hooks, which saw the call begin, see as its exception."""
        pq = batch.process_queue
        messages = batch.messages
        mq = pq.message_queue
        ended = f"{mq} was released" if pq.dropped else f"the lease of {mq} ended"
        what = (
            f"{ended} before the handler started on offsets {messages[0].queue_offset}.."
            f"{messages[-1].queue_offset}: not called, the batch went back to the queue"
        )
        self.signals.apply(pq, self.dispatcher.untake(batch))
        logger.info("group %s: %s", self.state.group, what)
        return LeaseEndedError(what)

    def _exit_requested(self, batch: Batch, exc: SystemExit) -> None:
        """A handler raised ``SystemExit`` (called ``sys.exit()``): a request to stop.

        The batch is not finished: it stays pending (suspended, out of the handlers),
        so nothing from it on is committed and it is delivered again. The consumer
        stops as on any failure that stops it (drains the other calls, commits,
        leaves) and ``SystemExit`` comes out of ``async with``."""
        logger.warning(
            "group %s: a handler called sys.exit(%r) on %s at offset %d: stopping the"
            " consumer (the batch is not committed and will be delivered again)",
            self.state.group,
            exc.code,
            batch.process_queue.message_queue,
            batch.messages[0].queue_offset,
        )
        effects = self.dispatcher.suspend(batch, anyio.current_time() + _NEVER_AGAIN)
        self.signals.apply(batch.process_queue, effects)
        self.state.fail(exc)

    async def _settle(
        self,
        batch: Batch,
        context: Any,
        error: Exception | None,
        result: object,
        hook_ctx: ConsumeMessageContext | None,
    ) -> None:
        """A failed handler call: the service judges it, the dispatcher applies the
        settlement in one call, the signals act on its effects. A call whose messages'
        finished marks were committed (``context.transact``) is a success: its
        effects are in, and its messages are not handed to a handler again."""
        if batch.process_queue.transacted and Transactor.settled_as_finished(batch):
            if error is not None and not isinstance(error, AlreadyFinishedError):
                logger.warning(
                    "group %s: a handler call on %s offsets %d..%d failed (%r) after its"
                    " transaction committed: its messages count as finished",
                    self.state.group,
                    batch.message_queue,
                    batch.messages[0].queue_offset,
                    batch.messages[-1].queue_offset,
                    error,
                )
            self.state.consumed_ok += len(batch.messages)
            if hook_ctx is not None:
                hook_ctx.success = True
            effects = self.dispatcher.finish(batch, _SUCCESS)
            self.signals.apply(batch.process_queue, effects)
            return
        settlement = await self.service.settle_failure(batch, context, error, result)
        if hook_ctx is None:
            effects = self.dispatcher.settle(batch, settlement)
        else:
            hook_ctx.settled = dict(settlement.outcomes)
            effects = self.dispatcher.settle(batch, settlement, anyio.current_time())
        self.signals.apply(batch.process_queue, effects)

    def _hook_context(self, batch: Batch, clock: Callable[[], float]) -> ConsumeMessageContext:
        start = clock()
        messages = batch.messages
        return ConsumeMessageContext._of_call(  # positional: once per handler call
            self.state.group,
            batch.process_queue.message_queue,
            messages,
            self.state.mode,
            batch.stage_index,
            batch.strategy_id,
            batch.group_id,
            messages[0].reconsume_times + 1,
            batch.cached_times,
            batch.runnable_at,
            start,
            time.time() - start,
        )

    def _hooks_after(
        self,
        hook_ctx: ConsumeMessageContext,
        error: Exception | None,
        result: object,
        *,
        timed_out: bool = False,
    ) -> None:
        assert self.hooks is not None
        hook_ctx.exception = error
        hook_ctx.result = result
        if timed_out:
            hook_ctx.status = ConsumeReturnType.TIME_OUT
        elif hook_ctx.success:
            hook_ctx.status = ConsumeReturnType.SUCCESS
        elif error is not None:
            hook_ctx.status = ConsumeReturnType.EXCEPTION
        else:
            hook_ctx.status = ConsumeReturnType.FAILED
        self.hooks.after(hook_ctx)


def _call_while_leased(
    consume: Callable[..., Any],
    pq: ProcessQueue,
    clock: Callable[[], float],
    messages: Sequence[Message],
    context: Any,
) -> Any:
    """In a handler thread: ``consume(messages, context)`` if ``pq`` is still consumed
    here, else :data:`_GIVEN_BACK` without calling it.

    The batch was taken on the event loop, its lease checked there; the thread starts
    the call a moment later, and a pause of the whole process in between (SIGSTOP, a
    long GC pause) would start it after the lease ended, when another member may own
    the queue. So the lease is checked again here, on the clock the take used
    (:func:`thread_clock`), as late as it can be. Only two attributes are read; the
    queue is changed in the event loop's thread alone."""
    if pq.dropped or pq.lease_deadline <= clock():
        return _GIVEN_BACK
    return consume(messages, context)


WORKER_CODES = frozenset({WorkerPool._work.__code__, run_loop.__code__})
"""The code of the worker loops, and the names of their locals holding the batch they
run and the messages of the call in progress: the watchdog finds them on a blocked
loop's stack."""
WORKER_BATCH_LOCAL = "batch"
WORKER_CALL_LOCAL = "call"
