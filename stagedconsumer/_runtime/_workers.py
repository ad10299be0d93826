"""WorkerPool: ``consume_thread_max`` workers that take batches and run the listener.

The worker loop is the same for every mode; the consume service supplies the
handler's context, the result that means success and the settlement of a failure.
The success path is inlined in the loop (no extra coroutine per batch).
"""

from __future__ import annotations

import inspect
import logging
import time
import types
from collections.abc import Callable, Coroutine, Generator, Iterable, Sequence
from typing import Any

import anyio
import anyio.abc

from offsetstore import AlreadyFinishedError

from .._core import NO_LEASE, READY, Batch, Dispatcher, EraseStatus, ProcessQueue
from .._exceptions import LeaseEndedError
from .._listeners import is_async_callable
from .._message import Message
from .._observability._hooks import ConsumeMessageContext, ConsumeReturnType
from ._hooks import HookRunner, loop_clock, thread_clock
from ._services import ConsumeService
from ._signals import Signals
from ._state import ConsumerState, QueueState
from ._threads import ThreadRunner
from ._transact import Transactor

__all__ = ("WorkerPool",)

logger = logging.getLogger("stagedconsumer")

_CHECKPOINT_EVERY = 64
"""Batches a worker runs back to back before it yields to other tasks."""
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


class _Run:
    """A worker's run in progress (see :meth:`WorkerPool._work`), seen by
    :func:`_drive`, which ends it when one of its calls suspends."""

    __slots__ = ("batch", "context", "done", "slot")

    def __init__(self, slot: _Slot | None) -> None:
        self.batch: Batch | None = None
        """The run's batch while a run is on, else None."""
        self.context: Any = None
        """The context of the call in progress."""
        self.done = 0
        """Messages of the run's earlier calls, not finished yet."""
        self.slot = slot


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

    async def _call_sync(self, messages: Sequence[Message], context: Any) -> Any:
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
        """The worker loop; with runs, driven by :func:`_drive`."""
        if self.runs:
            run = _Run(slot)
            self.service.active_runs.append(run)  # transact() finds its call's message
            try:
                await _drive(self, self._work(slot, run), run)
            finally:
                self.service.active_runs.remove(run)
        else:
            await self._work(slot, None)

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

    async def _work(self, slot: _Slot | None, cur: _Run | None) -> None:
        """The worker loop (see :meth:`_worker`).

        With an ``async def`` handler, one message per call
        (``consume_message_batch_max_size`` 1) and no hooks, a worker runs a *run*:
        when a call returns without having suspended, the worker calls the handler on
        the next cached message of the same stage, added to the batch, and so on; the
        run's messages are finished together, so a message costs what taking it costs
        instead of a batch of its own. Messages are taken ahead of the calls, 1, 2, 4,
        ... at a time as the run goes on (:meth:`ProcessQueue.take_more`; a queue that
        was paused, released or whose lease ended is checked before every call).

        A run is invisible to everything else: a call that did not suspend let no
        other task run, and before a call suspends (yields to the event loop) the
        run's earlier messages are finished and what it took ahead and did not call
        goes back to the head of the queue (:meth:`_end_run`): the loop runs under
        :func:`_drive`, which does that between the call's yield and the event loop,
        so the calls of a run are plain awaits. ``cur`` holds the run for it (None
        when the worker runs no runs). So a handler that waits on I/O has every
        message finished as it ends, as without runs, and its next message taken by
        whichever worker is free. A run ends after a call that suspended, a failure
        (the calls before it are finished, the failed message settled alone, see
        :meth:`_cut`), when the queue gives nothing more (paused, lease ended, stage
        all taken) or when the worker is due to yield (``_CHECKPOINT_EVERY`` calls:
        what a run takes is capped there). The consumer's stopping needs no check in
        between: the shutdown that sets it runs in another task, which cannot run
        before the run's calls suspend or the run ends.
        """
        state, dispatcher, signals, service = (
            self.state,
            self.dispatcher,
            self.signals,
            self.service,
        )
        take, finish, has_ready = dispatcher.take, dispatcher.finish, dispatcher.has_ready
        take_more = ProcessQueue.take_more
        apply, work = signals.apply, signals.work
        idle = work.idle
        context_for, ok, partial_ack = service.context_for, service.success, service.partial_ack
        batch_max, consume, is_async = self.batch_size, self.consume, self.is_async
        call_sync, hooks, leased = self._call_sync, self.hooks, self.leased
        call_leased = self._call_leased
        lease_clock = thread_clock() if leased and not is_async else None
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
            run = cur is not None and batch.attempt == 1
            call = [batch.messages[0]] if run else batch.messages  # a run's batch grows
            done = 0  # messages of the run's earlier calls, not finished yet
            context = context_for(batch, suspend_ms)
            error: Exception | None = None
            result: Any = None
            suspended = True
            if hooks is not None:
                hook_ctx = self._hook_context(batch, clock)
                hooks.before(hook_ctx)
            state.in_flight += 1
            if slot is not None and not run:
                slot.call = (batch, context, hook_ctx)
            try:
                if run:
                    # The run: one call per message, the next one made as long as a
                    # call returns success without having suspended. Messages are
                    # taken ahead (1, 2, 4, ... at a time); if a call suspends,
                    # _drive ends the run (_end_run) before anything else runs.
                    assert cur is not None
                    messages = batch.messages  # grows in place as the run takes more
                    taken = 1
                    ahead = 1
                    now = NO_LEASE
                    cur.batch, cur.done = batch, 0
                    while True:
                        cur.context = context
                        result = await consume(call, context)
                        if cur.batch is not batch:  # it waited: _drive ended the run
                            break
                        streak += 1
                        # (Nothing else ran since the run began, so the consumer is not
                        # stopping: the shutdown sets that flag in a task of its own.)
                        if (result is not None and result is not ok) or (
                            partial_ack and context.ack_index < 0
                        ):
                            suspended = False
                            break
                        if leased:
                            now = clock()
                        if done + 1 == taken:
                            # At most up to the checkpoint (none once there), so the
                            # run ends at it.
                            got = take_more(pq, batch, min(ahead, _CHECKPOINT_EVERY - streak), now)
                            if not got:
                                suspended = False
                                break
                            taken += got
                            ahead += ahead
                        elif pq.open_until <= now:  # paused, released or the lease ended
                            suspended = False
                            break
                        done += 1
                        cur.done = done
                        call = [messages[done]]
                        context = context_for(batch, suspend_ms)
                elif is_async:
                    result = await consume(call, context)
                elif lease_clock is None:
                    result = await call_sync(call, context)
                else:
                    result = await call_leased(call, context, pq, lease_clock)
            except Exception as exc:  # a failing handler never stops the consumer
                error = exc
            except SystemExit as exc:  # sys.exit() in a handler: stop the consumer
                if cur is not None and cur.batch is not None:
                    self._end_run(batch, cur.done)
                self._exit_requested(batch, exc)
                return
            except BaseException:  # cancelled, say: keep what ran
                if cur is not None and cur.batch is not None:  # (a call waited: run ended)
                    self._end_run(batch, cur.done)
                raise
            finally:
                state.in_flight -= 1
                if run:  # over (if a call waited, _drive ended it: nothing left to do)
                    assert cur is not None
                    done = cur.done
                    cur.batch = None
            if run and len(batch.messages) > done + 1:  # taken ahead, not called
                pq.untake_rest(batch, done + 1)
            if slot is not None and suspended:
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
                    if done:
                        self._cut(batch, done)
                    await self._settle(batch, context, error, result, hook_ctx)
            else:
                if suspended:  # a run counts its calls as they return
                    streak += 1
                state.consumed_ok += len(batch.messages)
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
            if streak >= _CHECKPOINT_EVERY:
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

    def _end_run(self, batch: Batch, done: int) -> None:
        """A run stops at its call in progress (``batch.messages[done]``): what it took
        ahead goes back, the calls before are finished."""
        if len(batch.messages) > done + 1:
            batch.process_queue.untake_rest(batch, done + 1)
        if done:
            self._cut(batch, done)

    def _cut(self, batch: Batch, done: int) -> None:
        """Finish the first ``done`` messages of a run's batch (their calls succeeded),
        leaving the batch holding the message of the call in progress alone."""
        self.state.consumed_ok += done
        effects = self.dispatcher.finish_some(batch, batch.messages[:done], _SUCCESS)
        self.signals.apply(batch.process_queue, effects)

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


@types.coroutine
def _drive(
    pool: WorkerPool, work: Coroutine[Any, Any, None], run: _Run
) -> Generator[Any, Any, None]:
    """Run the worker loop ``work`` as ``await work`` would (PEP 380's ``yield from``:
    values and exceptions the event loop sends in go to ``work``), and each time it
    yields to the event loop in the middle of a run (one of the run's calls waits),
    end the run first: what the run took ahead and did not call goes back to the
    queue, the calls before are finished (:meth:`WorkerPool._end_run`), and the
    consume-timeout scanner sees the call. Nothing else runs in between, so the run
    was invisible to every other task. Costs nothing per call that does not wait."""
    send, throw = work.send, work.throw
    sent: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = send(sent) if error is None else throw(error)
        except StopIteration:
            return
        batch = run.batch
        if batch is not None:  # a run's call waits
            run.batch = None
            try:
                pool._end_run(batch, run.done)
            except BaseException:
                work.close()
                raise
            run.done = 0
            if run.slot is not None:  # only a call that waits can time out
                run.slot.call = (batch, run.context, None)
        try:
            sent = yield step
            error = None
        except GeneratorExit:
            work.close()
            raise
        except BaseException as exc:  # a cancellation, or what the event loop throws in
            error = exc


WORKER_CODE = WorkerPool._work.__code__
"""The code of the worker loop, and the names of its locals holding the batch it runs
and the messages of the call in progress: the watchdog finds them on a blocked loop's
stack."""
WORKER_BATCH_LOCAL = "batch"
WORKER_CALL_LOCAL = "call"
