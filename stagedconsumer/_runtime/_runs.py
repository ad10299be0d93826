"""Runs: a worker calls an ``async def`` handler on message after message of one batch.

With an ``async def`` handler, one message per call (``consume_message_batch_max_size``
1) and no consume hooks, a worker (:class:`~._workers.WorkerPool`) runs :func:`run_loop`
instead of the general loop: when a call returns without having suspended, the
worker calls the handler on the next cached message of the same stage, added to the
batch, and so on; the run's messages are finished together, so a message costs what
taking it costs instead of a batch of its own. Messages are taken ahead of the calls
(:meth:`ProcessQueue.take_more`), 1, 2, 4, ... at a time, up to
:data:`CHECKPOINT_EVERY`: the size doubles with every take and goes on from one run
to the worker's next, back to 1 after a call that waited or failed. What a call that
waits makes the run give back is so at most about what the calls since the last
such call took, while a worker whose calls never wait takes a run's messages in one
or two steps (a stage's end or the checkpoint ends many runs).

The invariants, which everything here keeps:

1. **A run is invisible to every other task.** A call that did not suspend let no
   other task run. Before a call suspends (yields to the event loop), the run's
   earlier messages are finished and what it took ahead and did not call goes back
   to the head of its queue (:func:`end_run`): the loop runs under :func:`drive`,
   which does that between the call's yield and the event loop, so the calls of a run
   are plain awaits. A handler that waits on I/O has every message finished as it
   ends, as without runs, and its next message taken by whichever worker is free.
2. **The run's state is in its** :class:`Run`: ``batch`` is the run's batch while the
   run is on and none of its calls has suspended (:func:`drive` clears it when one
   does: after a call, ``run.batch is not batch`` means it waited and the run is
   over); ``batch.messages[:done]`` are the calls that succeeded, not yet finished,
   ``batch.messages[done]`` the call in progress, the rest taken ahead, not called;
   ``context`` is the context of the call in progress (:class:`~._transact.Transactor`
   finds a call's message through it).
3. **A run ends** after a call that suspended, a failure (the calls before it are
   finished, the failed message settled alone: :func:`cut`), when the queue gives
   nothing more (paused, released, its lease ended: checked before every call; or the
   stage is all taken) or when the worker is due to yield (``CHECKPOINT_EVERY``
   calls: what a run takes ahead is capped there). The consumer's stopping needs no
   check in between: the shutdown that sets it runs in another task, which cannot run
   before the run's calls suspend or the run ends.
4. **Only a call that suspended can time out**: the consume-timeout scanner sees a
   run's call (its worker's slot) once :func:`drive` ended the run, when its batch
   holds that call's message alone.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Protocol

import anyio
import anyio.lowlevel

from .._core import NO_LEASE, READY, Batch, Dispatcher, EraseStatus, ProcessQueue
from ._hooks import loop_clock
from ._services import ConsumeService
from ._signals import Signals
from ._state import ConsumerState

__all__ = ("CHECKPOINT_EVERY", "Run", "cut", "drive", "end_run", "run_loop")

CHECKPOINT_EVERY = 64
"""Calls a worker makes back to back before it yields to other tasks."""
_SUCCESS = EraseStatus.SUCCESS
_READY = READY
_NOT_READY = ~READY


class Slot(Protocol):
    """A worker's handler call as the consume-timeout scanner sees it
    (``_workers._Slot``)."""

    call: tuple[Batch, Any, Any] | None
    timed_out: bool


class Pool(Protocol):
    """What a run needs of its worker pool (:class:`~._workers.WorkerPool`)."""

    state: ConsumerState
    service: ConsumeService
    dispatcher: Dispatcher
    signals: Signals
    consume: Callable[..., Any]
    leased: bool

    def _exit_requested(self, batch: Batch, exc: SystemExit) -> None: ...

    async def _settle(
        self, batch: Batch, context: Any, error: Exception | None, result: object, hook_ctx: Any
    ) -> None: ...


class Run:
    """A worker's run in progress (invariant 2 of the module docstring)."""

    __slots__ = ("batch", "context", "done", "slot")

    def __init__(self, slot: Slot | None) -> None:
        self.batch: Batch | None = None
        self.context: Any = None
        self.done = 0
        self.slot = slot


async def run_loop(pool: Pool, run: Run) -> None:
    """The worker loop with runs (see the module docstring), under :func:`drive`."""
    state, service, dispatcher, signals = pool.state, pool.service, pool.dispatcher, pool.signals
    take, finish, has_ready = dispatcher.take, dispatcher.finish, dispatcher.has_ready
    take_more, apply, work = ProcessQueue.take_more, signals.apply, signals.work
    context_for, ok, partial_ack = service.context_for, service.success, service.partial_ack
    consume, leased, slot, idle = pool.consume, pool.leased, run.slot, work.idle
    suspend_ms = service.options.suspend_current_queue_time_millis
    clock = loop_clock() if leased else anyio.current_time
    streak, ahead = 0, 1  # ahead: what the next take ahead takes (invariant 3)
    while not state.stopping:
        batch = take(1, clock()) if leased else take(1)
        if batch is None:
            streak = 0
            await work.wait()
            continue
        if idle and has_ready():
            idle.popleft().set()
        pq = batch.process_queue
        messages = batch.messages  # grows in place as the run takes more
        call = [messages[0]]
        context = context_for(batch, suspend_ms)
        done = 0  # the calls before the one in progress (invariant 2)
        taken = 1
        error: Exception | None = None
        result: Any = None
        state.in_flight += 1
        run.batch, run.done = batch, 0
        try:
            while True:
                run.context = context
                result = await consume(call, context)
                if run.batch is not batch:  # it waited: drive() ended the run
                    break
                streak += 1
                if (result is not None and result is not ok) or (
                    partial_ack and context.ack_index < 0
                ):
                    break
                now = clock() if leased else NO_LEASE
                if done + 1 == taken:  # take ahead, up to the checkpoint (invariant 3)
                    got = take_more(pq, batch, min(ahead, CHECKPOINT_EVERY - streak), now)
                    if not got:
                        break
                    taken, ahead = taken + got, min(ahead + ahead, CHECKPOINT_EVERY)
                elif pq.open_until <= now:  # paused, released or the lease ended
                    break
                done += 1
                run.done = done
                call = [messages[done]]
                context = context_for(batch, suspend_ms)
        except Exception as exc:  # a failing handler never stops the consumer
            error = exc
        except BaseException as exc:  # sys.exit() in a handler, or cancelled
            _interrupted(pool, run, batch, exc)  # raises all but SystemExit
            return
        finally:
            state.in_flight -= 1
            # If the last call waited, drive() ended the run and cleared run.batch.
            done, waited, run.batch = run.done, run.batch is not batch, None
        if len(messages) > done + 1:  # taken ahead, not called
            pq.untake_rest(batch, done + 1)
        if slot is not None and waited:
            if slot.timed_out:  # timed out as it returned: the result is ignored
                return
            slot.call = None
        if error is not None or not _succeeded(result, ok, partial_ack, context):
            ahead = 1
            await _failed(pool, batch, done, context, error, result)
        else:
            if waited:  # a run counts its calls as they return
                streak, ahead = streak + 1, 1
            state.consumed_ok += len(messages)
            effects = finish(batch, _SUCCESS)  # this worker takes what it freed
            if effects > _READY:  # READY alone: this worker takes the next batch itself
                apply(pq, effects & _NOT_READY)
        if streak >= CHECKPOINT_EVERY:
            streak = 0
            await anyio.lowlevel.checkpoint()


def _succeeded(result: Any, ok: Any, partial_ack: bool, context: Any) -> bool:
    """Whether a run's last call succeeded (it returned)."""
    return (result is None or result is ok) and not (partial_ack and context.ack_index < 0)


async def _failed(
    pool: Pool,
    batch: Batch,
    done: int,
    context: Any,
    error: Exception | None,
    result: object,
) -> None:
    """A run's call in progress (``batch.messages[done]``) failed: the calls before
    are finished, the failed one is settled alone."""
    if done:
        cut(pool, batch, done)
    await pool._settle(batch, context, error, result, None)


def _interrupted(pool: Pool, run: Run, batch: Batch, exc: BaseException) -> None:
    """A run's call raised ``exc``, not an ``Exception``: the run ends at that call
    (unless drive() ended it, the call having waited) and ``exc`` goes on, except a
    ``SystemExit`` (``sys.exit()`` in the handler), which stops the consumer."""
    if run.batch is not None:  # no call waited: end the run here
        end_run(pool, batch, run.done)
    if not isinstance(exc, SystemExit):
        raise exc
    pool._exit_requested(batch, exc)


def end_run(pool: Pool, batch: Batch, done: int) -> None:
    """A run stops at its call in progress (``batch.messages[done]``): what it took
    ahead goes back, the calls before are finished."""
    if len(batch.messages) > done + 1:
        batch.process_queue.untake_rest(batch, done + 1)
    if done:
        cut(pool, batch, done)


def cut(pool: Pool, batch: Batch, done: int) -> None:
    """Finish the first ``done`` messages of a run's batch (their calls succeeded),
    leaving the batch holding the message of the call in progress alone."""
    pool.state.consumed_ok += done
    effects = pool.dispatcher.finish_some(batch, batch.messages[:done], _SUCCESS)
    pool.signals.apply(batch.process_queue, effects)


@types.coroutine
def drive(pool: Pool, work: Coroutine[Any, Any, None], run: Run) -> Generator[Any, Any, None]:
    """Run the worker loop ``work`` as ``await work`` would (PEP 380's ``yield from``:
    values and exceptions the event loop sends in go to ``work``), and each time it
    yields to the event loop in the middle of a run (one of the run's calls waits),
    end the run first: what the run took ahead and did not call goes back to the
    queue, the calls before are finished (:func:`end_run`), and the consume-timeout
    scanner sees the call. Nothing else runs in between, so the run was invisible to
    every other task. Costs nothing per call that does not wait."""
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
                end_run(pool, batch, run.done)
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
