"""Listeners (what users implement), consume statuses and contexts.

A listener's ``consume_message(msgs, context)`` may be ``async def`` (run on the
event loop) or a plain ``def`` (run in a worker thread). Returning ``None`` means
success and raising means failure: a deliberate difference from RocketMQ, where a
``null`` return means failure.

The consumer checks the shape of a listener's methods once, when it is built, rather
than failing on every call: see :class:`MessageListener`.
"""

from __future__ import annotations

import abc
import enum
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs

from ._core import DEFAULT_STRATEGY
from ._message import Message, MessageQueue

__all__ = (
    "ConsumeConcurrentlyContext",
    "ConsumeConcurrentlyStatus",
    "ConsumeOrderlyContext",
    "ConsumeOrderlyStatus",
    "ConsumeStagedConcurrentlyContext",
    "MessageListener",
    "MessageListenerConcurrently",
    "MessageListenerOrderly",
    "MessageListenerStagedConcurrently",
    "MessageQueueListener",
    "Ordering",
)


class ConsumeConcurrentlyStatus(enum.Enum):
    """What a concurrent listener may return (``None`` means success)."""

    CONSUME_SUCCESS = "CONSUME_SUCCESS"
    """The batch succeeded (as returning ``None`` does)."""
    RECONSUME_LATER = "RECONSUME_LATER"
    """The batch failed: retry it through the retry queue (as raising does)."""


class ConsumeOrderlyStatus(enum.Enum):
    """What an orderly or staged listener may return (``None`` means success)."""

    SUCCESS = "SUCCESS"
    """The batch succeeded (as returning ``None`` does)."""
    SUSPEND_CURRENT_QUEUE_A_MOMENT = "SUSPEND_CURRENT_QUEUE_A_MOMENT"
    """The batch failed: retry it in place after
    ``suspend_current_queue_time_millis`` (as raising does)."""


_T = TypeVar("_T")


class _Transactional:
    """What the three contexts share: :meth:`transact`."""

    __slots__ = ("_batch", "_committed")
    _batch: Any
    _committed: bool

    async def transact(self, fn: Callable[[Any], _T]) -> _T:
        """Run ``fn(connection)`` in one transaction of the offset store's database that
        also marks this call's messages finished, and return what ``fn`` returned:
        the handler's database writes are committed together with its messages'
        completion, so exactly once (exactly-once effects).

        With :class:`~offsetstore.SqlOffsetStore`, ``fn`` runs in a worker thread with
        a :class:`sqlalchemy.Connection` inside the transaction (do not commit it);
        with :class:`~offsetstore.MemoryOffsetStore`, on the event loop with ``None``.
        In a consumer group the transaction first checks that this member still
        owns the queue (its lock's epoch is the queue's fence): if another member
        took it over, :class:`~offsetstore.StoreFencedError` is raised and nothing
        is committed; the new owner handles the messages. Once it committed, the
        messages count as finished whatever the handler does next (a handler that
        raises afterwards is not called on them again), and no message whose mark
        exists is handed to a handler again, after a restart or a hand-over too.
        If ``fn`` raises, nothing is committed and the exception propagates. Call it
        at most once per handler call. A plain ``def`` handler, running in a worker
        thread, calls :meth:`transact_blocking` instead.
        """
        batch = getattr(self, "_batch", None)
        if batch is None:
            raise RuntimeError(
                "transact() works on the context a consumer passes to a handler call"
            )
        pq = batch.process_queue
        transactor = pq.transactor
        if transactor is None:
            raise RuntimeError("transact(): this consumer has no offset store transactions")
        result: _T = await transactor.transact(pq, transactor.messages_of(self, batch), fn)
        self._committed = True
        return result

    @property
    def transaction_committed(self) -> bool:
        """Whether :meth:`transact` committed during this call: its messages are
        finished, whatever the call does next."""
        return getattr(self, "_committed", False)

    def transact_blocking(self, fn: Callable[[Any], _T]) -> _T:
        """:meth:`transact` from a plain ``def`` handler (a worker thread)."""
        import anyio.from_thread

        return anyio.from_thread.run(self.transact, fn)


@attrs.define(kw_only=True, eq=False)
class ConsumeConcurrentlyContext(_Transactional):
    """Passed to :meth:`MessageListenerConcurrently.consume_message`.

    ``delay_level_when_next_consume``: 0 (default) lets the retry delay grow with
    ``reconsume_times`` (RocketMQ's level ``3 + reconsume_times``); a positive value
    picks a level; a negative value sends a failed message straight to the DLQ.
    ``ack_index``: on success, messages ``0..ack_index`` count as consumed and the
    rest as failed (default: all consumed).
    """

    message_queue: MessageQueue
    """The queue the messages were pulled from (a queue of ``%RETRY%<group>`` for
    a retried message)."""
    delay_level_when_next_consume: int = 0
    """The retry delay level of a failed message: 0 grows with
    ``reconsume_times``, a positive value picks a level, a negative one sends it to the
    dead-letter queue."""
    ack_index: int = 2**31 - 1
    """On success, messages ``0..ack_index`` count as consumed and the rest as
    failed."""


@attrs.define(kw_only=True, eq=False)
class ConsumeOrderlyContext(_Transactional):
    """Passed to :meth:`MessageListenerOrderly.consume_message`.

    ``suspend_current_queue_time_millis`` is how long the queue waits before a
    failed batch is retried (default from the options, 1000; clamped to [10, 30000]).
    """

    message_queue: MessageQueue
    """The queue the batch was pulled from."""
    suspend_current_queue_time_millis: int = 1000
    """How long the queue waits before a failed batch is
    retried."""


@attrs.define(kw_only=True, eq=False)
class ConsumeStagedConcurrentlyContext(_Transactional):
    """Passed to :meth:`MessageListenerStagedConcurrently.consume_message`.

    ``stage_index`` is the stage of every message of the batch (``-1``: the tail,
    past the last defined stage, or no stage at all when ``strategy_id`` is ``None``).
    ``suspend_current_queue_time_millis`` is settable, as in the orderly context.
    """

    message_queue: MessageQueue
    """The queue the batch was pulled from."""
    stage_index: int
    """The batch's stage: 0, 1, ... for the stage definitions, -1 (``TAIL_STAGE``)
    past the last one."""
    strategy_id: str | None
    """The stage strategy of the batch's stage key (``None``: no stage)."""
    group_id: str | None
    """The group of the batch's stage key (what ``compute_group`` returned)."""
    suspend_current_queue_time_millis: int = 1000
    """How long the queue waits before a failed batch is
    retried (its stage waits too)."""


_new = object.__new__


class _QueueLike(Protocol):
    @property
    def message_queue(self) -> MessageQueue: ...


class _BatchLike(Protocol):
    """What a context is built from: a batch of ``stagedconsumer._core``."""

    @property
    def process_queue(self) -> _QueueLike: ...
    @property
    def stage_index(self) -> int: ...
    @property
    def strategy_id(self) -> str | None: ...
    @property
    def group_id(self) -> str | None: ...


# The consumer's constructors, one per handler call: positional, and without the
# attrs ``__init__`` (whose keyword matching costs about twice as much). Each sets
# every field; a test holds them to the attrs ``__init__``. One signature for the three
# (the batch, the suspend time), so the worker calls whichever its mode uses directly.


def _concurrently_context(batch: _BatchLike, suspend_millis: int) -> ConsumeConcurrentlyContext:
    del suspend_millis  # no local retry in concurrent mode
    context: ConsumeConcurrentlyContext = _new(ConsumeConcurrentlyContext)
    context._batch = batch
    context.message_queue = batch.process_queue.message_queue
    context.delay_level_when_next_consume = 0
    context.ack_index = 2**31 - 1
    return context


def _orderly_context(batch: _BatchLike, suspend_millis: int) -> ConsumeOrderlyContext:
    context: ConsumeOrderlyContext = _new(ConsumeOrderlyContext)
    context._batch = batch
    context.message_queue = batch.process_queue.message_queue
    context.suspend_current_queue_time_millis = suspend_millis
    return context


def _staged_context(batch: _BatchLike, suspend_millis: int) -> ConsumeStagedConcurrentlyContext:
    context: ConsumeStagedConcurrentlyContext = _new(ConsumeStagedConcurrentlyContext)
    context._batch = batch
    context.message_queue = batch.process_queue.message_queue
    context.stage_index = batch.stage_index
    context.strategy_id = batch.strategy_id
    context.group_id = batch.group_id
    context.suspend_current_queue_time_millis = suspend_millis
    return context


def is_async_callable(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine to await: an ``async def`` function or
    method, a ``functools.partial`` of one, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or (
        callable(fn)
        and not inspect.isroutine(fn)
        and inspect.iscoroutinefunction(type(fn).__call__)
    )


class MessageListener(abc.ABC):  # noqa: B024 - a marker base; subclasses add the abstract methods
    """Base class of the three listener kinds.

    ``PushConsumer(...)`` raises :class:`~stagedconsumer.ListenerTypeError` when
    ``consume_message`` cannot be called with two positional arguments
    ``(msgs, context)`` (parameters beyond those need defaults; ``*args``,
    ``functools.partial``, callable objects and static methods are fine), or is a
    generator function (``yield`` in its body, ``async def`` or not). The same goes for
    the callbacks the consumer will call, with their arguments, which must also be
    plain ``def`` (they are called synchronously): ``get_stage_definitions()``,
    ``get_stage_definition_strategies()``, ``compute_strategy(msg)``,
    ``compute_group(msg)``, ``reset_current_stage_offset_if_need(topic, current)`` and
    (``Ordering.BY_KEY``) ``compute_key(msg)``. A callable whose signature Python
    cannot read (some builtins) is accepted unchecked.
    """


class MessageListenerConcurrently(MessageListener):
    """Consumes messages concurrently: no order, within a queue or across queues.

    Up to ``consume_thread_max`` calls run at once. A failure (raising, or returning
    ``RECONSUME_LATER``) sends the messages to the group's retry queue, from where
    they come back after a growing delay; after ``max_reconsume_times`` (16 by
    default) they go to the dead-letter queue.
    """

    @abc.abstractmethod
    def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus | Awaitable[ConsumeConcurrentlyStatus | None] | None:
        """Handle a batch; return ``None`` (or ``CONSUME_SUCCESS``) on success."""


class Ordering(enum.Enum):
    """What an orderly listener keeps in order (``MessageListenerOrderly.ordering``)."""

    BY_QUEUE = "by_queue"
    """One batch at a time per queue, in offset order (RocketMQ's orderly consumption)."""
    BY_KEY = "by_key"
    """One batch at a time per message key, in offset order; different keys of one
    queue run concurrently (Confluent Parallel Consumer's KEY ordering)."""


class MessageListenerOrderly(MessageListener):
    """Consumes each queue strictly in order, one batch at a time.

    Ordered: the batches of one queue, in offset order; a batch starts only after the
    previous one finished. Not ordered: different queues run concurrently. A failure
    suspends the queue and retries the same batch locally after
    ``suspend_current_queue_time_millis`` (unlimited times by default).

    With ``ordering = Ordering.BY_KEY`` the order is per message key instead: the
    messages of one key (:meth:`compute_key`, the first of ``msg.keys`` by default)
    run one batch at a time in offset order, different keys of a queue concurrently
    (up to ``consume_thread_max``); a failure holds back only its key. Messages
    without a key are not ordered. Only keys with messages cached or in a handler are
    kept in memory, and nothing per key is committed.
    """

    ordering: Ordering = Ordering.BY_QUEUE
    """What is kept in order: the whole queue (the default) or each message key."""

    @abc.abstractmethod
    def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> ConsumeOrderlyStatus | Awaitable[ConsumeOrderlyStatus | None] | None:
        """Handle a batch; return ``None`` (or ``SUCCESS``) on success."""

    def compute_key(self, msg: Message) -> str | None:
        """The ordering key of ``msg`` with ``Ordering.BY_KEY`` (``None``: unordered).
        The first of ``msg.keys`` by default."""
        return msg.keys[0] if msg.keys else None


class MessageListenerStagedConcurrently(MessageListener):
    """Consumes stage by stage: concurrent inside a stage, ordered between stages.

    With stage definitions ``[n1, ..., nk]``, the first ``n1`` messages of a stage key
    form stage 0, the next ``n2`` stage 1, and so on; messages past the last stage
    form the unbounded tail stage ``-1``. Ordered: no message of stage ``i + 1`` (or
    the tail) of a stage key starts before every message of stage ``i`` of that key
    has finished. Not ordered: messages inside one stage, and different stage keys
    or queues. A stage key is ``(strategy_id, group_id)`` within one queue; by
    default there is one per queue. ``[]`` behaves as concurrent consumption and
    ``[1] * n`` as orderly for the first ``n`` messages.

    A failure suspends the batch and retries it locally (its stage does not complete
    meanwhile); after ``max_reconsume_times`` (unlimited by default) the message goes
    to the dead-letter queue and counts as finished.
    """

    @abc.abstractmethod
    def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> ConsumeOrderlyStatus | Awaitable[ConsumeOrderlyStatus | None] | None:
        """Handle a batch of one stage; return ``None`` (or ``SUCCESS``) on success."""

    @abc.abstractmethod
    def get_stage_definitions(self) -> Sequence[int]:
        """Stage sizes, each a positive int (e.g. ``[10, 20, 70]``)."""

    def get_stage_definition_strategies(self) -> Mapping[str, Sequence[int]]:
        """Named definition lists for :meth:`compute_strategy` to pick from.

        Default: one strategy, ``"default"``, holding :meth:`get_stage_definitions`.
        Called once, when the consumer is built. Without an override of
        :meth:`compute_strategy` (which picks ``"default"``) the mapping must have
        ``"default"``.
        """
        return {DEFAULT_STRATEGY: self.get_stage_definitions()}

    def compute_strategy(self, msg: Message) -> str | None:
        """The strategy of ``msg``: a key of :meth:`get_stage_definition_strategies`,
        or ``None`` to consume it directly, concurrently, with no stage. Default:
        ``"default"``.

        Any other id (a typo) is an error, not "no stage": the queue stops at ``msg``
        (nothing after it is run or committed), the error is logged with the message
        id and counted in ``statistics().assignment_errors``, and the assignment is
        tried again after ``suspend_current_queue_time_millis``, as when this method
        raises."""
        return DEFAULT_STRATEGY

    def compute_group(self, msg: Message) -> str | None:
        """Splits a queue into independent stage sequences (e.g. per campaign).

        Default: ``None``, one sequence per queue and strategy.
        """
        return None

    def reset_current_stage_offset_if_need(self, topic: str, current: int) -> int:
        """Return a new stage offset (e.g. 0 when a new campaign starts).

        Consulted when a message is assigned at a stage boundary (and for every tail
        message); the returned offset applies from that message on, never in the
        middle of a stage. A reset starts a new stage: its messages wait for all
        earlier messages of the stage key. Default: ``current`` (no reset).
        """
        return current


class MessageQueueListener(abc.ABC):  # noqa: B024 - both methods are optional
    """Told when queues are assigned to a consumer or taken away (RocketMQ's
    ``MessageQueueListener``, Kafka's ``ConsumerRebalanceListener``): flush or load
    your own per-queue state there.

    Ordering: ``on_queues_assigned`` runs after the queues' progress is loaded and
    before their first handler call; ``on_queues_revoked`` after their handler calls
    in flight finished and their progress was committed, and (in a group) before
    their locks are released. An exception is logged and counted
    (``statistics().listener_errors``); it does not stop the hand-over.
    """

    async def on_queues_assigned(self, queues: Sequence[MessageQueue]) -> None:  # noqa: B027
        """``queues`` (sorted) are now consumed here. The default does nothing."""

    async def on_queues_revoked(self, queues: Sequence[MessageQueue]) -> None:  # noqa: B027
        """``queues`` (sorted) are no longer consumed here. The default does nothing."""
