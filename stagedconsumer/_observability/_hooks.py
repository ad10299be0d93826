"""Consume hooks: code that runs before and after every handler call.

After RocketMQ's ``ConsumeMessageHook`` (``consumeMessageBefore`` /
``consumeMessageAfter``), which its message trace and OpenTracing integrations are
built on. A hook sees every handler call of one consumer: the batch, its stage, its
attempt, when its messages were cached, when their stage's barrier opened, when the
handler ran, and how the batch was settled (succeeded, handed to the retry queue,
suspended for a local retry, or moved to the dead-letter queue).

Hooks run inline in the worker task that runs the handler, so they must be cheap and
must not block: a hook that needs I/O hands its data to a background task (see
:class:`~stagedconsumer.AsyncTraceDispatcher`). A hook that raises is logged
(at most once per hook and method every 10 seconds) and counted in
:attr:`~stagedconsumer.ConsumerStatistics.hook_errors`; it never stops consumption.
With no hook registered the consumer's hot path pays one ``if`` per batch.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs

from .._core import SettleOutcome
from .._message import Message, MessageQueue

if TYPE_CHECKING:
    from ._view import ConsumerView

__all__ = (
    "ConsumeMessageContext",
    "ConsumeMessageHook",
    "ConsumeReturnType",
    "PullContext",
    "SettleContext",
    "SettleOutcome",
)

_new = object.__new__


class ConsumeReturnType(enum.Enum):
    """How a handler call ended (RocketMQ's ``ConsumeReturnType``; the value is the
    ``contextCode`` of a ``SubAfter`` trace record)."""

    SUCCESS = 0
    """The handler returned success (``None`` or its mode's success status)."""
    TIME_OUT = 1
    """The call ran longer than ``consume_timeout`` (cancelled or abandoned)."""
    EXCEPTION = 2
    """The handler raised."""
    RETURNNULL = 3
    """Not produced here: ``None`` means success in this library."""
    FAILED = 4
    """The handler returned ``RECONSUME_LATER`` / ``SUSPEND_CURRENT_QUEUE_A_MOMENT``
    (or acknowledged only part of a concurrent batch)."""


@attrs.define(eq=False, kw_only=True, slots=True)
class ConsumeMessageContext:
    """One handler call, as seen by :class:`ConsumeMessageHook`.

    Times (``*_time``, ``*_at``, ``cached_times``) are on the event loop's clock
    (``anyio.current_time()``; virtual under a mock clock); :meth:`wall` turns one
    into seconds since the epoch. ``props`` is scratch space a hook may use to carry
    its own state from :meth:`ConsumeMessageHook.consume_message_before` to
    :meth:`ConsumeMessageHook.consume_message_after` (RocketMQ's ``mqTraceContext``);
    use your own key.
    """

    consumer_group: str
    """The consumer's group."""
    message_queue: MessageQueue
    """The queue the batch was pulled from."""
    messages: Sequence[Message]
    """The batch handed to the handler."""
    mode: str
    """``"concurrent"``, ``"orderly"`` or ``"staged"``."""
    stage_index: int
    """Stage of the batch (``-1``: tail stage, or no stage in concurrent/orderly mode)."""
    strategy_id: str | None
    """The stage strategy of the batch's stage key (staged mode), else ``None``."""
    group_id: str | None
    """The group of the batch's stage key (staged mode), else ``None``."""
    attempt: int
    """Delivery attempt: ``reconsume_times + 1`` of the first message (1 on the first
    call; counts local retries and retries through the retry queue alike)."""
    cached_times: Sequence[float]
    """When each message was pulled and cached, in the order of ``messages``."""
    runnable_at: float
    """When the batch's stage last became runnable: its barrier opened."""
    start_time: float
    """When the handler call started."""
    wall_offset: float
    """Add to a loop-clock time to get seconds since the epoch."""
    end_time: float = 0.0
    """When the handler call returned or raised (set before ``consume_message_after``)."""
    success: bool = False
    """Whether the call succeeded (set before ``consume_message_after``)."""
    status: ConsumeReturnType | None = None
    """How the call ended, RocketMQ's ``ConsumeReturnType`` (``SUCCESS``, ``FAILED``,
    ``EXCEPTION``, ``TIME_OUT``, ...), set before ``consume_message_after``."""
    exception: BaseException | None = None
    """The exception the handler raised, if it raised."""
    result: object = None
    """What the handler returned."""
    settled: dict[SettleOutcome, list[Message]] = attrs.Factory(dict)
    """After a failure: which messages were handed to the retry queue, suspended for
    a local retry, or dead-lettered."""
    props: dict[str, Any] = attrs.Factory(dict)
    """Scratch space for a hook, from ``consume_message_before`` to
    ``consume_message_after``; use your own key."""

    @classmethod
    def _of_call(
        cls,
        consumer_group: str,
        message_queue: MessageQueue,
        messages: Sequence[Message],
        mode: str,
        stage_index: int,
        strategy_id: str | None,
        group_id: str | None,
        attempt: int,
        cached_times: Sequence[float],
        runnable_at: float,
        start_time: float,
        wall_offset: float,
    ) -> ConsumeMessageContext:
        """The consumer's constructor, one per handler call: positional, and without
        the attrs ``__init__`` (whose keyword matching costs about three times as
        much). Sets every field; a test holds it to the attrs ``__init__``."""
        self = _new(cls)
        self.consumer_group = consumer_group
        self.message_queue = message_queue
        self.messages = messages
        self.mode = mode
        self.stage_index = stage_index
        self.strategy_id = strategy_id
        self.group_id = group_id
        self.attempt = attempt
        self.cached_times = cached_times
        self.runnable_at = runnable_at
        self.start_time = start_time
        self.wall_offset = wall_offset
        self.end_time = 0.0
        self.success = False
        self.status = None
        self.exception = None
        self.result = None
        self.settled = {}
        self.props = {}
        return self

    def wall(self, loop_time: float) -> float:
        """``loop_time`` as seconds since the epoch."""
        return loop_time + self.wall_offset

    @property
    def handler_duration(self) -> float:
        """Seconds the handler ran."""
        return max(0.0, self.end_time - self.start_time)

    def await_times(self) -> list[float]:
        """Per message: seconds from cached to this handler call's start."""
        start = self.start_time
        return [max(0.0, start - cached) for cached in self.cached_times]

    def barrier_waits(self) -> list[float]:
        """Per message: seconds it was cached while its stage's barrier was closed
        (0 when the stage was already runnable on arrival)."""
        opened = self.runnable_at
        return [max(0.0, opened - cached) for cached in self.cached_times]


@attrs.define(eq=False, kw_only=True, slots=True)
class PullContext:
    """One pull that returned messages (for :meth:`ConsumeMessageHook.messages_pulled`)."""

    consumer_group: str
    """The consumer's group."""
    message_queue: MessageQueue
    """The queue pulled from."""
    messages: Sequence[Message]
    """The messages cached by this pull (after tag filtering)."""
    start_time: float
    """When the pull started, on the event loop's clock (``anyio.current_time()``)."""
    end_time: float
    """When the pull returned, on the event loop's clock."""
    wall_offset: float
    """Wall-clock seconds minus loop time, for :meth:`wall`."""
    max_offset: int
    """The queue's next offset to be written, as reported by the source."""

    def wall(self, loop_time: float) -> float:
        """``loop_time`` as seconds since the epoch."""
        return loop_time + self.wall_offset


@attrs.define(eq=False, kw_only=True, slots=True)
class SettleContext:
    """One settle call of a :class:`~stagedconsumer.SimpleConsumer` (``ack``,
    ``ack_batch`` or ``change_invisible_duration``), for
    :meth:`ConsumeMessageHook.messages_settled`."""

    consumer_group: str
    """The consumer's group."""
    operation: str
    """``"ack"`` (``ack`` and ``ack_batch``), ``"nack"`` (``change_invisible_duration``
    to 0: handed back at once) or ``"change_invisible_duration"``."""
    messages: Sequence[Message]
    """The messages of the call, in the order given."""
    refused: Sequence[Message]
    """Those the broker refused (their invisible duration passed, ...)."""
    exception: BaseException | None
    """What the call raised (``InvalidReceiptHandleError``, a broker error), or ``None``."""
    invisible_duration: float | None
    """``change_invisible_duration``'s seconds; ``None`` for an ack."""
    start_time: float
    """When the call started, on the event loop's clock."""
    end_time: float
    """When the call returned or raised, on the event loop's clock."""
    wall_offset: float
    """Wall-clock seconds minus loop time, for :meth:`wall`."""

    def wall(self, loop_time: float) -> float:
        """``loop_time`` as seconds since the epoch."""
        return loop_time + self.wall_offset


class ConsumeMessageHook(abc.ABC):
    """Code run around every handler call of a consumer.

    Register with :meth:`PushConsumer.register_consume_message_hook` before the
    consumer starts. Hooks run in registration order before the call and in the
    same order after it, inline in the worker task: keep them short and never
    block. Ordering: for one batch, ``consume_message_before`` happens before the
    handler starts and ``consume_message_after`` after the batch was settled
    (finished, sent back, suspended or dead-lettered); calls for different batches
    interleave freely. A plain ``def`` handler whose queue's lease ended after the
    hooks' ``before`` and before its thread started is not called: ``after`` still
    comes, with :class:`~stagedconsumer.LeaseEndedError` as ``context.exception`` and
    nothing settled (the batch went back to its queue).
    """

    @property
    def hook_name(self) -> str:
        """A name for logs (RocketMQ's ``hookName()``); the class name by default."""
        return type(self).__name__

    @abc.abstractmethod
    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        """Called right before the handler runs on ``context.messages``."""

    @abc.abstractmethod
    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        """Called after the handler returned or raised and the batch was settled (or
        was not called and its batch went back: see the class docstring)."""

    def messages_pulled(self, context: PullContext) -> None:  # noqa: B027 - optional
        """Called after a pull that cached messages. The default does nothing (and a
        consumer whose hooks all keep the default does not build the context). A
        :class:`~stagedconsumer.SimpleConsumer` calls it once per ``receive`` that
        returned messages (``message_queue``: the queue of the first; ``max_offset``
        -1)."""

    def messages_settled(self, context: SettleContext) -> None:  # noqa: B027 - optional
        """Called after each settle call of a :class:`~stagedconsumer.SimpleConsumer`
        (``ack``, ``ack_batch``, ``change_invisible_duration``), whether the broker
        took it or not. The default does nothing (and a consumer whose hooks all keep
        it does not build the context)."""

    async def run(
        self,
        consumer: ConsumerView,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Background work of the hook (e.g. a trace dispatcher).

        Started in the consumer's task group when the consumer starts, before the
        first pull, and cancelled when it stops (after :meth:`aclose`). The default
        starts nothing.
        """
        del consumer
        task_status.started()

    async def aclose(self) -> None:  # noqa: B027 - optional
        """Called once when the consumer stops, after the last handler call returned
        (flush buffered data here). The default does nothing."""

    @property
    def records_dropped(self) -> int:
        """Records this hook dropped (a full trace buffer, say); the consumer adds them
        up in :attr:`~stagedconsumer.ConsumerStatistics.trace_records_dropped`. 0 by
        default."""
        return 0
