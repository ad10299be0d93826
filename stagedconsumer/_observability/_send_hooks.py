"""Send hooks: code that runs before and after every send of a producer.

After RocketMQ's ``SendMessageHook`` (``sendMessageBefore`` / ``sendMessageAfter``),
which its message trace (``Pub`` records) and OpenTracing integrations are built on.
A hook sees every ``send`` / ``send_batch`` call of one producer: the messages (it
may add properties before they are sent, e.g. a trace context), the queue they went
to, the attempts, the results or the exception, and the times.

Hooks run inline in the task that sends, so they must be cheap and must not block;
one that needs I/O hands its data to a background task (see
:class:`~stagedconsumer.AsyncTraceDispatcher`). A hook that raises is logged
(rate-limited) and counted in :attr:`ProducerStatistics.hook_errors`; the send goes
on.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
import attrs

from .._message import MessageQueue, OutgoingMessage, SendResult

if TYPE_CHECKING:
    from .._sources._source import MessageSource

__all__ = (
    "ProducerStatistics",
    "ProducerView",
    "SendMessageContext",
    "SendMessageHook",
)


@attrs.define(eq=False, kw_only=True, slots=True)
class SendMessageContext:
    """One ``send`` / ``send_batch`` call, as seen by :class:`SendMessageHook`.

    Times are on the event loop's clock; :meth:`wall` turns one into seconds since the
    epoch. ``props`` is scratch space a hook may use to carry its own state from
    ``send_message_before`` to ``send_message_after``; use your own key.
    """

    producer_group: str
    """The producer's group."""
    topic: str
    """The topic sent to."""
    messages: Sequence[OutgoingMessage]
    """The messages of the call, in order (one for ``send``). Their ``properties``
    may be changed in ``send_message_before``: they are sent as they are then."""
    start_time: float
    """When the call started."""
    wall_offset: float
    """Add to a loop-clock time to get seconds since the epoch."""
    message_queue: MessageQueue | None = None
    """The queue of the last attempt (``None`` if none was made)."""
    attempts: int = 0
    """Attempts made: 1, plus one per retry after a retriable failure."""
    end_time: float = 0.0
    """When the call returned or raised (set before ``send_message_after``)."""
    results: Sequence[SendResult] = ()
    """Where each message was stored, in the order of ``messages`` (empty on failure)."""
    exception: BaseException | None = None
    """What the call raised (``None``: it succeeded)."""
    props: dict[str, Any] = attrs.Factory(dict)
    """Scratch space for a hook, from ``send_message_before`` to
    ``send_message_after``; use your own key."""

    @property
    def success(self) -> bool:
        """Whether the call stored its messages: it raised nothing and has ``results``."""
        return self.exception is None and bool(self.results)

    @property
    def duration(self) -> float:
        """Seconds the call took, retries included."""
        return max(0.0, self.end_time - self.start_time)

    def wall(self, loop_time: float) -> float:
        """``loop_time`` as seconds since the epoch."""
        return loop_time + self.wall_offset


@attrs.frozen(kw_only=True)
class ProducerStatistics:
    """A snapshot of a :class:`~stagedconsumer.Producer`."""

    group: str
    """The producer group."""
    sent: int
    """Messages stored."""
    send_calls: int
    """``send`` / ``send_batch`` calls that succeeded."""
    send_errors: int
    """Calls that failed (raised), timeouts included."""
    retries: int
    """Attempts after a retriable failure."""
    timeouts: int
    """Calls that ran out of ``send_msg_timeout``."""
    hook_errors: int = 0
    """Exceptions raised by send hooks (logged and ignored)."""
    trace_records_dropped: int = 0
    """Message trace records dropped because a trace dispatcher's queue was full."""


class ProducerView(Protocol):
    """The producer as send hooks and trace sinks see it (``Producer`` is one)."""

    @property
    def group(self) -> str:
        """The producer group."""
        ...

    @property
    def source(self) -> MessageSource:
        """Where the producer sends to."""
        ...

    def statistics(self) -> ProducerStatistics:
        """A frozen snapshot of the producer's counters."""
        ...


class SendMessageHook(abc.ABC):
    """Code run around every send of a producer.

    Register with :meth:`Producer.register_send_message_hook` before the producer
    starts. Hooks run in registration order, inline in the sending task: keep them
    short and never block. Ordering: for one call, ``send_message_before`` happens
    before the first attempt and ``send_message_after`` after the last one; calls of
    concurrent senders interleave freely.
    """

    @property
    def hook_name(self) -> str:
        """A name for logs (RocketMQ's ``hookName()``); the class name by default."""
        return type(self).__name__

    @abc.abstractmethod
    def send_message_before(self, context: SendMessageContext) -> None:
        """Called before the first attempt; may change ``context.messages``'
        properties."""

    @abc.abstractmethod
    def send_message_after(self, context: SendMessageContext) -> None:
        """Called once the call succeeded or failed for good."""

    async def run(
        self,
        producer: ProducerView,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Background work of the hook (e.g. a trace dispatcher), started in the
        producer's task group when it starts and cancelled when it stops (after
        :meth:`aclose`). The default starts nothing."""
        del producer
        task_status.started()

    async def aclose(self) -> None:  # noqa: B027 - optional
        """Called once when the producer stops (flush buffered data here). The default
        does nothing."""

    @property
    def records_dropped(self) -> int:
        """Records this hook dropped (a full trace buffer, say); the producer adds them
        up in :attr:`ProducerStatistics.trace_records_dropped`. 0 by default."""
        return 0
