"""The call log and :class:`RecordingListener`, which fills it.

A :class:`CallLog` holds one :class:`HandlerCall` per call of a listener's
``consume_message``: its queue, messages, stage, stage key, attempt, start and end
(clock time and a global event number), and outcome. Dead-lettered messages are
recorded beside the calls (:meth:`CallLog.record_dead_letter`; ``run_virtual`` does
it), since a message moved to the DLQ counts as finished.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar, overload

import anyio
import anyio.from_thread
import attrs

from offsetstore import AlreadyFinishedError

from .._core import DEFAULT_STRATEGY
from .._listeners import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumeOrderlyStatus,
    MessageListener,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    is_async_callable,
)
from .._message import Message, MessageQueue
from .._runtime._shapes import check_listener
from .._sources._source import PROPERTY_ORIGIN_MESSAGE_ID

_K = TypeVar("_K")

__all__ = ("CallLog", "DeadLetter", "HandlerCall", "Outcome", "RecordingListener", "origin_id")


def origin_id(message: Message) -> str:
    """The id of the message as first sent: its ``msg_id``, which a retry from
    ``%RETRY%<group>`` (concurrent mode) keeps; ``ORIGIN_MESSAGE_ID`` first, for retries
    stored while they got a new ``msg_id``."""
    return message.properties.get(PROPERTY_ORIGIN_MESSAGE_ID, message.msg_id)


class Outcome(enum.Enum):
    """How a handler call ended."""

    RUNNING = "running"
    """Not ended yet (or the process running it crashed and nothing recorded its end)."""
    SUCCESS = "success"
    """Returned ``None`` or a success status."""
    RAISED = "raised"
    """Raised an exception: a failure."""
    RETURNED_FAILURE = "returned failure"
    """Returned ``SUSPEND_CURRENT_QUEUE_A_MOMENT`` or ``RECONSUME_LATER``: a failure."""
    CANCELLED = "cancelled"
    """Cancelled (a consume timeout, a crash, a shutdown that stopped waiting): it
    finished nothing."""


_FAILURE_STATUSES: tuple[object, ...] = (
    ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT,
    ConsumeConcurrentlyStatus.RECONSUME_LATER,
)


@attrs.define(eq=False)
class HandlerCall:
    """One call of ``consume_message``, as the consumer made it.

    ``start_seq`` / ``end_seq`` number the start and end events of every call (and the
    dead letters) of one :class:`CallLog` in the order they happened, so two events
    at the same virtual instant are still ordered. ``start`` / ``end`` are the event
    loop's clock (virtual seconds under ``run_virtual``).
    """

    number: int
    """Position of the call in the log (0-based)."""
    run: int
    """Which incarnation of the consumer made the call: 0, then 1 after the first
    crash and restart, and so on."""
    queue: MessageQueue
    """The queue of the call's messages."""
    messages: tuple[Message, ...]
    """The messages of the call, in offset order."""
    stage_index: int | None
    """``context.stage_index`` (staged listeners; ``-1`` is the tail), else ``None``."""
    strategy_id: str | None
    """``context.strategy_id`` (staged listeners), else ``None``."""
    group_id: str | None
    """``context.group_id`` (staged listeners), else ``None``."""
    attempt: int
    """1 for a first delivery, ``n + 1`` for the ``n``-th retry (``reconsume_times + 1``)."""
    start: float
    """When the call started, on the event loop's clock."""
    start_seq: int
    """The number of the call's start event in its log."""
    end: float = math.nan
    """When the call ended, on the event loop's clock (``nan`` while it runs)."""
    end_seq: int = -1
    """The number of the call's end event in its log (``-1`` while it runs)."""
    outcome: Outcome = Outcome.RUNNING
    """How the call ended (``RUNNING`` until it does)."""
    error: str | None = None
    """``repr`` of the exception a failed call raised."""
    acked: int = 0
    """How many of ``messages`` (from the first) the call finished: all of them on
    success, fewer when a concurrent listener set ``context.ack_index``, none on failure."""

    @property
    def offsets(self) -> tuple[int, ...]:
        """The queue offsets of ``messages``."""
        return tuple(m.queue_offset for m in self.messages)

    @property
    def ended(self) -> bool:
        """Whether the call has ended."""
        return self.end_seq >= 0

    @property
    def succeeded(self) -> bool:
        """Whether the call ended in success."""
        return self.outcome is Outcome.SUCCESS

    @property
    def failed(self) -> bool:
        """Ended without success (raised, returned a failure status, or cancelled)."""
        return self.ended and self.outcome is not Outcome.SUCCESS

    @property
    def cancelled(self) -> bool:
        """Whether the call was cancelled (a consume timeout, a crash, a shutdown that
        stopped waiting)."""
        return self.outcome is Outcome.CANCELLED

    @property
    def finished_messages(self) -> tuple[Message, ...]:
        """The messages this call finished (consumed successfully)."""
        return self.messages[: self.acked] if self.outcome is Outcome.SUCCESS else ()

    def describe(self) -> str:
        """One line: ``call #3 (run 0) q0 [4, 5] stage 1 default/- attempt 2, t=3..4: success``."""
        stage = ""
        if self.stage_index is not None:
            stage = (
                f" stage {self.stage_index} key"
                f" {self.strategy_id or '-'}/{self.group_id if self.group_id is not None else '-'}"
            )
        end = "running" if not self.ended else f"{self.end:g}"
        outcome = self.outcome.value + (f" ({self.error})" if self.error else "")
        return (
            f"call #{self.number} (run {self.run}) {self.queue.topic}:{self.queue.queue_id}"
            f" {list(self.offsets)}{stage} attempt {self.attempt},"
            f" t={self.start:g}..{end} (events {self.start_seq}..{self.end_seq}): {outcome}"
        )


@attrs.frozen
class DeadLetter:
    """A message moved to the dead-letter queue: it counts as finished at ``seq``."""

    seq: int
    """Its place among the log's events (see :attr:`HandlerCall.start_seq`)."""
    time: float
    """When it happened, on the consumer's clock (``nan`` when not given)."""
    run: int
    """The incarnation it happened in (see :attr:`CallLog.run`)."""
    message: Message
    """The message as it was dead-lettered."""


@attrs.define(eq=False)
class CallLog:
    """Every handler call a :class:`RecordingListener` saw, in start order.

    Thread-safe: plain ``def`` handlers run in worker threads.
    """

    calls: list[HandlerCall] = attrs.Factory(list)
    """Every call, in the order they started."""
    dead_letters: list[DeadLetter] = attrs.Factory(list)
    """Every message moved to the dead-letter queue, in order."""
    run: int = 0
    """The incarnation new calls belong to (``run_virtual`` bumps it on each restart)."""
    stage_definitions: list[tuple[int, dict[str, tuple[int, ...]]]] = attrs.Factory(list)
    """``(run, definitions by strategy id)`` each time the consumer read a staged
    :class:`RecordingListener`'s stage definitions (``get_stage_definitions()`` is
    recorded as strategy ``"default"``); :func:`check_staged` compares them with the
    plan's to explain a message run in the wrong stage."""
    on_start: list[Callable[[HandlerCall], None]] = attrs.Factory(list)
    """Called (in the handler's task or thread) after each call was recorded as started."""
    on_end: list[Callable[[HandlerCall], None]] = attrs.Factory(list)
    """Called (in the handler's task or thread) after each call was recorded as ended;
    ``run_virtual`` uses it to crash at a given point."""
    _events: Iterator[int] = attrs.field(factory=itertools.count, init=False, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def next_seq(self) -> int:
        """The next event number (they only grow; shared by calls and dead letters)."""
        return next(self._events)

    def start_call(self, msgs: Sequence[Message], context: object, now: float) -> HandlerCall:
        """Record that a handler call on ``msgs`` started at ``now`` (queue, stage index,
        strategy and group are read from ``context``, the attempt from the first
        message's ``reconsume_times``), in the current :attr:`run`; end it with
        :meth:`end_call`. :class:`RecordingListener` calls both; to check a log another
        process wrote, replay its start and end events in the order they happened
        (setting :attr:`run` per process or incarnation), then run the checkers."""
        queue: MessageQueue = getattr(context, "message_queue", None) or MessageQueue(
            msgs[0].topic, msgs[0].queue_id
        )
        with self._lock:
            call = HandlerCall(
                number=len(self.calls),
                run=self.run,
                queue=queue,
                messages=tuple(msgs),
                stage_index=getattr(context, "stage_index", None),
                strategy_id=getattr(context, "strategy_id", None),
                group_id=getattr(context, "group_id", None),
                attempt=(msgs[0].reconsume_times + 1) if msgs else 1,
                start=now,
                start_seq=self.next_seq(),
            )
            self.calls.append(call)
        for callback in self.on_start:
            callback(call)
        return call

    def end_call(
        self,
        call: HandlerCall,
        now: float,
        outcome: Outcome,
        *,
        error: BaseException | None = None,
        acked: int | None = None,
    ) -> None:
        """Record that ``call`` ended at ``now`` with ``outcome``.

        ``acked``: how many of its messages (from the first) a success finished. The
        default, ``None``, is all of them, what a success means for every listener
        kind; pass fewer for a concurrent listener that set ``context.ack_index``
        (``ack_index + 1``, so ``0`` when it finished none). A call that did not
        succeed finishes nothing, whatever ``acked`` says."""
        if acked is not None and not 0 <= acked <= len(call.messages):
            raise ValueError(
                f"acked={acked}: a call of {len(call.messages)} message(s) finishes"
                f" 0 to {len(call.messages)} of them"
            )
        with self._lock:
            call.end = now
            call.end_seq = self.next_seq()
            call.outcome = outcome
            call.error = repr(error) if error is not None else None
            if outcome is not Outcome.SUCCESS:
                call.acked = 0
            else:
                call.acked = len(call.messages) if acked is None else acked
        for callback in self.on_end:
            callback(call)

    def record_stage_definitions(self, definitions: Mapping[str, Sequence[int]]) -> None:
        """Record that the consumer of the current :attr:`run` read ``definitions``
        (by strategy id); :class:`RecordingListener` does this for you."""
        snapshot = {str(name): tuple(sizes) for name, sizes in definitions.items()}
        with self._lock:
            self.stage_definitions.append((self.run, snapshot))

    def record_dead_letter(self, message: Message, now: float = math.nan) -> None:
        """Record that ``message`` went to the dead-letter queue (it counts as
        finished). ``run_virtual`` does this for you; with your own broker, call it
        from its ``send_to_dlq``."""
        with self._lock:
            self.dead_letters.append(DeadLetter(self.next_seq(), now, self.run, message))

    def ended_calls(self) -> int:
        """How many calls have ended (returned, raised or were cancelled)."""
        return sum(1 for call in self.calls if call.ended)

    @overload
    def finish_seqs(self) -> dict[str, int]: ...
    @overload
    def finish_seqs(self, key: Callable[[Message], _K]) -> dict[_K, int]: ...
    def finish_seqs(self, key: Callable[[Message], Any] = origin_id) -> dict[Any, int]:
        """The first event that finished each message: the end of a call that consumed
        it successfully, or its move to the DLQ; by :func:`origin_id`, or by ``key``
        (e.g. ``lambda m: (m.queue_id, m.queue_offset)``)."""
        done: dict[Any, int] = {}
        for call in self.calls:
            for message in call.finished_messages:
                k = key(message)
                done[k] = min(done.get(k, call.end_seq), call.end_seq)
        for dead in self.dead_letters:
            k = key(dead.message)
            done[k] = min(done.get(k, dead.seq), dead.seq)
        return done

    def format(self, calls: Sequence[HandlerCall] | None = None) -> str:
        """The calls (default: all), one line each."""
        return "\n".join(call.describe() for call in (self.calls if calls is None else calls))


# -- wrapping a listener of any kind ------------------------------------------------------

_KINDS: tuple[type[MessageListener], ...] = (
    MessageListenerStagedConcurrently,
    MessageListenerOrderly,
    MessageListenerConcurrently,
)
_FORWARDED: Mapping[type[MessageListener], tuple[str, ...]] = {
    MessageListenerStagedConcurrently: (
        "get_stage_definitions",
        "get_stage_definition_strategies",
        "compute_strategy",
        "compute_group",
        "reset_current_stage_offset_if_need",
    ),
    MessageListenerOrderly: ("compute_key",),
    MessageListenerConcurrently: (),
}
_wrapper_types: dict[tuple[type, type, bool], type] = {}


def _kind_of(listener: object) -> type[MessageListener]:
    for kind in _KINDS:
        if isinstance(listener, kind):
            return kind
    raise TypeError(
        "expected a listener instance (MessageListenerStagedConcurrently,"
        f" MessageListenerOrderly or MessageListenerConcurrently), got {type(listener).__name__}"
    )


def _forwarder(name: str) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    forward.__name__ = name
    return forward


def wrapper_type(mixin: type, inner: MessageListener) -> type:
    """A subclass of ``mixin`` and of ``inner``'s listener kind that forwards the stage
    callbacks ``inner``'s class overrides, and only those: the consumer takes its fast
    paths for callbacks left to the defaults, so the wrapper must not override more.
    ``consume_message`` is ``mixin._consume_async`` or ``mixin._consume_sync``, as
    ``inner``'s is a coroutine function or not (sync handlers keep running in threads).
    ``mixin._forwarders`` (optional) maps a callback name to the forwarder to use.
    """
    kind = _kind_of(inner)
    is_async = is_async_callable(getattr(inner, "consume_message", None))
    cache_key = (mixin, type(inner), is_async)
    cached = _wrapper_types.get(cache_key)
    if cached is not None:
        return cached
    namespace: dict[str, Any] = {
        "consume_message": mixin._consume_async if is_async else mixin._consume_sync,  # type: ignore[attr-defined]
        "__module__": mixin.__module__,
        "__qualname__": f"{mixin.__name__}[{type(inner).__name__}]",
    }
    own: Mapping[str, Callable[..., Any]] = getattr(mixin, "_forwarders", {})
    for name in _FORWARDED[kind]:
        if getattr(type(inner), name) is not getattr(kind, name):
            namespace[name] = own.get(name) or _forwarder(name)
    created = type(namespace["__qualname__"], (mixin, kind), namespace)
    _wrapper_types[cache_key] = created
    return created


def _now_in_thread() -> float:
    """The event loop's clock, from a handler's worker thread."""
    try:
        return anyio.from_thread.run_sync(anyio.current_time)
    except Exception:  # the loop is gone (an abandoned call ending late)
        return math.nan


def _committed(context: object, error: BaseException | None = None) -> bool:
    """Whether the call's ``context.transact`` committed: its messages finished then,
    whatever the call did next (raised, was cancelled, returned a failure); or it
    found them finished before (``AlreadyFinishedError``): the consumer finishes them."""
    if isinstance(error, AlreadyFinishedError):
        return True
    return bool(getattr(context, "transaction_committed", False))


def judge(result: object, context: object, count: int) -> tuple[Outcome, int]:
    """The outcome of a call that returned ``result`` and how many messages it acked."""
    if _committed(context):
        return Outcome.SUCCESS, count
    if result in _FAILURE_STATUSES:
        return Outcome.RETURNED_FAILURE, 0
    acked = count
    if isinstance(context, ConsumeConcurrentlyContext):
        acked = max(0, min(count, context.ack_index + 1))
    return Outcome.SUCCESS, acked


class RecordingListener(MessageListener):
    """Wraps a listener of any kind and records every handler call in a :class:`CallLog`.

    ``RecordingListener(listener)`` is a listener of ``listener``'s kind (staged,
    orderly or concurrent): pass it to :class:`~stagedconsumer.PushConsumer` instead
    of ``listener``. Behaviour is unchanged: the same context object reaches your
    handler (a suspend time you set is kept), the result and exceptions pass
    through, an ``async def`` handler stays one and a plain ``def`` handler still runs
    in a worker thread, and only the stage callbacks your class overrides are
    forwarded (the consumer takes the same paths). ``recorder.log`` holds the calls,
    and the stage definitions the consumer read (:attr:`CallLog.stage_definitions`);
    give several listeners one ``log`` to record them together.
    """

    inner: MessageListener
    """The listener it wraps."""
    log: CallLog
    """Where the calls are recorded."""

    def __new__(cls, listener: MessageListener, log: CallLog | None = None) -> RecordingListener:
        del log
        if cls is not RecordingListener:  # a wrapper type made below
            return super().__new__(cls)
        created: type[RecordingListener] = wrapper_type(RecordingListener, listener)
        return created.__new__(created, listener)

    def __init__(self, listener: MessageListener, log: CallLog | None = None) -> None:
        check_listener(listener)  # the consumer sees the wrapper's (*args) shapes only
        self.inner = listener
        self.log = log if log is not None else CallLog()
        if isinstance(listener, MessageListenerOrderly):
            self.ordering = listener.ordering
            """An orderly listener's ``ordering``, copied so that the consumer keeps
            the same order for the wrapper."""

    def __repr__(self) -> str:
        return f"RecordingListener({self.inner!r})"

    # The consumer reads the stage definitions once when it is built: recorded for
    # check_staged. A value of the wrong shape is not recorded; the consumer reports it
    # as without the recorder.
    _WRONG_SHAPE = (TypeError, ValueError, AttributeError)

    def _get_stage_definitions(self) -> Any:
        sizes = self.inner.get_stage_definitions()  # type: ignore[attr-defined]
        with contextlib.suppress(*self._WRONG_SHAPE):
            self.log.record_stage_definitions({DEFAULT_STRATEGY: sizes})
        return sizes

    def _get_stage_definition_strategies(self) -> Any:
        strategies = self.inner.get_stage_definition_strategies()  # type: ignore[attr-defined]
        with contextlib.suppress(*self._WRONG_SHAPE):
            self.log.record_stage_definitions(strategies)
        return strategies

    _forwarders: ClassVar[Mapping[str, Callable[..., Any]]] = {
        "get_stage_definitions": _get_stage_definitions,
        "get_stage_definition_strategies": _get_stage_definition_strategies,
    }

    async def _consume_async(self, msgs: Sequence[Message], context: Any) -> Any:
        log = self.log
        call = log.start_call(msgs, context, anyio.current_time())
        try:
            result = await self.inner.consume_message(msgs, context)  # type: ignore[attr-defined]
        except anyio.get_cancelled_exc_class():
            if _committed(context):  # its transaction finished its messages
                log.end_call(call, anyio.current_time(), Outcome.SUCCESS, acked=len(msgs))
            else:
                log.end_call(call, anyio.current_time(), Outcome.CANCELLED)
            raise
        except BaseException as error:
            outcome = Outcome.SUCCESS if _committed(context, error) else Outcome.RAISED
            log.end_call(call, anyio.current_time(), outcome, error=error, acked=len(msgs))
            raise
        outcome, acked = judge(result, context, len(msgs))
        log.end_call(call, anyio.current_time(), outcome, acked=acked)
        return result

    def _consume_sync(self, msgs: Sequence[Message], context: Any) -> Any:
        log = self.log
        call = log.start_call(msgs, context, _now_in_thread())
        try:
            result = self.inner.consume_message(msgs, context)  # type: ignore[attr-defined]
        except BaseException as error:
            outcome = Outcome.SUCCESS if _committed(context, error) else Outcome.RAISED
            log.end_call(call, _now_in_thread(), outcome, error=error, acked=len(msgs))
            raise
        outcome, acked = judge(result, context, len(msgs))
        log.end_call(call, _now_in_thread(), outcome, acked=acked)
        return result
