"""Pop consumption (RocketMQ 5's ``SimpleConsumer``): what a broker provides for it.

A consumer *receives* messages, which become invisible to the group for an
*invisible duration*; it *acks* each one it finished, or lets the duration pass, and
the message becomes visible again with one more *delivery attempt* counted. After
``max_delivery_attempts`` the message goes to the group's dead-letter queue. The
broker keeps all of this (no offsets, queue locks or rebalance on the client):
:class:`PopBackend` is its interface, one per broker and consumer group, made by
:func:`._pop_backends.pop_backend` (:mod:`._memory_pop` on the embedded broker, :mod:`._redis_pop`
on Redis; :func:`._pop_backends.pop_backend` picks one).

FIFO groups: messages of one *message group* are received one at a time in queue
order; the next is not received by anyone before the previous was acked or
dead-lettered. Different message groups are received concurrently.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, cast

import attrs

from .._exceptions import ConsumerStateError
from .._filter import TagFilter
from .._message import Message, _MessageFields, _rebuild
from ._gray import PROPERTY_GRAY, is_gray_queue

__all__ = (
    "InvalidReceiptHandleError",
    "PopBackend",
    "PopSettings",
    "ReceivedMessage",
    "message_group_of",
)


class InvalidReceiptHandleError(ConsumerStateError):
    """An ack or ``change_invisible_duration`` of a received message that no longer
    holds it: its invisible duration passed (the message is visible again and may
    have been received by another consumer, RocketMQ's ``INVALID_RECEIPT_HANDLE``
    "receipt handle is expired"), it was received again since, it was acked
    already, or it went to the dead-letter queue."""

    refused: list[ReceivedMessage]
    """:meth:`SimpleConsumer.ack_batch <stagedconsumer.SimpleConsumer.ack_batch>`: the
    messages refused (empty otherwise)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.refused = []


class _ReceivedFields(_MessageFields):
    """The slots :class:`ReceivedMessage` adds to a message's, on a plain class, so
    that :func:`received` builds one with plain stores (see ``_MessageFields``)."""

    __slots__ = ("consumer_group", "message_group", "receipt_handle")

    receipt_handle: str
    message_group: str | None
    consumer_group: str


@attrs.frozen(kw_only=True, eq=False)
class ReceivedMessage(Message, _ReceivedFields):
    """A message as :meth:`SimpleConsumer.receive <stagedconsumer.SimpleConsumer.receive>`
    returns it (RocketMQ 5's ``MessageView``): the message, plus what its ack needs.

    ``reconsume_times`` counts the earlier deliveries to the group that were not
    acked in time (``delivery_attempt - 1``).
    """

    receipt_handle: str = ""
    """Opaque: which delivery of the message this is (an ack names it)."""
    message_group: str | None = None
    """The message group of a FIFO consumer group (``None`` otherwise, or for a
    message without one)."""
    consumer_group: str = ""
    """The group that received it."""

    @property
    def delivery_attempt(self) -> int:
        """1 for the first delivery to the group, 2 for the next one, ..."""
        return self.reconsume_times + 1

    def __reduce__(self) -> tuple[Callable[..., Message], tuple[Any, ...]]:
        return (
            _rebuild_received,
            (
                *Message.__reduce__(self)[1],
                self.receipt_handle,
                self.message_group,
                self.consumer_group,
            ),
        )


def _rebuild_received(*args: Any) -> ReceivedMessage:
    plain = _rebuild(*args[:11])
    return ReceivedMessage(
        **{f.name: getattr(plain, f.name) for f in attrs.fields(Message)},
        receipt_handle=args[11],
        message_group=args[12],
        consumer_group=args[13],
    )


def received(
    message: Message,
    *,
    attempt: int,
    receipt_handle: str,
    message_group: str | None,
    group: str,
) -> ReceivedMessage:
    """``message`` as delivery ``attempt`` of ``group`` (built with plain stores:
    ``message``'s fields are in their stored form already)."""
    r = _ReceivedFields()
    r.topic = message.topic
    r.queue_id = message.queue_id
    r.queue_offset = message.queue_offset
    r.body = message.body
    r.keys = message.keys
    r.tags = message.tags
    r.properties = message.properties
    r.msg_id = message.msg_id
    r.born_timestamp = message.born_timestamp
    r.reconsume_times = attempt - 1
    r.offset_msg_id = message.offset_msg_id
    r.receipt_handle = receipt_handle
    r.message_group = message_group
    r.consumer_group = group
    r.__class__ = ReceivedMessage
    return cast(ReceivedMessage, r)


def received_first(
    messages: Sequence[Message], handles: Sequence[bytes], group: str
) -> list[ReceivedMessage]:
    """:func:`received` for first deliveries without a message group, in bulk (the hot
    path of a receive): ``handles`` are the receipt handles, as bytes."""
    out: list[ReceivedMessage] = []
    append = out.append
    new = _ReceivedFields
    cls = ReceivedMessage
    for message, handle in zip(messages, handles, strict=True):
        r = new()
        r.topic = message.topic
        r.queue_id = message.queue_id
        r.queue_offset = message.queue_offset
        r.body = message.body
        r.keys = message.keys
        r.tags = message.tags
        r.properties = message.properties
        r.msg_id = message.msg_id
        r.born_timestamp = message.born_timestamp
        r.reconsume_times = 0
        r.offset_msg_id = message.offset_msg_id
        r.receipt_handle = handle.decode()
        r.message_group = None
        r.consumer_group = group
        r.__class__ = cls
        append(cast(ReceivedMessage, r))
    return out


def message_group_of(message: Message, group_property: str | None) -> str | None:
    """The message group of ``message``: the property ``group_property`` when named,
    else its first key; ``None`` (no group: not ordered) when it has neither."""
    if group_property is not None:
        return message.properties.get(group_property)
    return message.keys[0] if message.keys else None


@attrs.frozen(kw_only=True)
class PopSettings:
    """What a :class:`PopBackend` is made with (from the consumer's options)."""

    group: str
    max_delivery_attempts: int = 16
    fifo: bool = False
    message_group_property: str | None = None
    gray_queue_ratio: float | None = attrs.field(default=None, eq=False)
    """Gray release (``enable_gray_switch``): the ratio of gray queues, ``None``
    without. A message dead-lettered from a gray queue gets the ``GRAY=true``
    property, as the push consumer's do. Not one of the group's settings (gray members
    may disagree on it; not compared)."""

    def dead_letter(self, message: Message, queue_count: int) -> Message:
        """``message`` as it goes to the dead-letter queue: marked gray when it came
        from a gray queue of its topic (``queue_count`` queues)."""
        ratio = self.gray_queue_ratio
        if (
            ratio is None
            or message.properties.get(PROPERTY_GRAY) == "true"
            or not is_gray_queue(message.topic, message.queue_id, queue_count, ratio)
        ):
            return message
        return attrs.evolve(message, properties={**message.properties, PROPERTY_GRAY: "true"})


class PopBackend(abc.ABC):
    """Receive, ack and invisibility for one consumer group on one broker."""

    settings: PopSettings

    async def start(self, topics: Mapping[str, TagFilter]) -> None:  # noqa: B027 - optional
        """Prepare the subscribed topics (Redis: create the consumer groups)."""

    async def join(self, member: str, ttl: float) -> list[str]:
        """Register ``member`` as live for ``ttl`` seconds (refresh it before) and
        return the group's live members. The first call of a consumer also checks
        that the group's live members use these settings (raises
        :class:`~stagedconsumer.ConfigurationError` otherwise). The default: no
        membership (only ``member``)."""
        return [member]

    async def heartbeat(self, member: str, ttl: float) -> list[str]:
        """Refresh ``member``'s presence; the group's live members."""
        return await self.join(member, ttl)

    async def leave(self, member: str) -> None:  # noqa: B027 - optional
        """``member`` stopped."""

    def live_members(self) -> list[str] | None:
        """The live members, when known without I/O (in process), else ``None``."""
        return None

    @abc.abstractmethod
    async def receive(
        self,
        consumer: str,
        subscriptions: Mapping[str, TagFilter],
        max_num: int,
        invisible_duration: float,
        timeout: float,
        queues: Collection[tuple[str, int]] | None = None,
    ) -> list[ReceivedMessage]:
        """Up to ``max_num`` visible messages of the subscribed topics (of the
        ``(topic, queue id)``s in ``queues`` when given: gray release), made
        invisible for ``invisible_duration`` seconds; waits up to ``timeout`` seconds
        for at least one. Messages whose attempts are used up go to the group's
        dead-letter queue on the way (never returned)."""

    @abc.abstractmethod
    async def ack(self, message: ReceivedMessage) -> None:
        """Finish ``message``; raises :class:`InvalidReceiptHandleError` when this
        delivery no longer holds it."""

    @property
    def merges_acks(self) -> bool:
        """Whether :meth:`ack_and_receive` sends the acks with the receive (one round
        trip); ``False`` by default."""
        return False

    async def ack_and_receive(
        self,
        acks: Sequence[ReceivedMessage],
        consumer: str,
        subscriptions: Mapping[str, TagFilter],
        max_num: int,
        invisible_duration: float,
        timeout: float,
        queues: Collection[tuple[str, int]] | None = None,
    ) -> tuple[list[ReceivedMessage], list[ReceivedMessage]]:
        """:meth:`ack_many` then :meth:`receive`: the acks refused and the messages."""
        refused = await self.ack_many(acks) if acks else []
        received = await self.receive(
            consumer, subscriptions, max_num, invisible_duration, timeout, queues
        )
        return refused, received

    async def ack_many(self, messages: Sequence[ReceivedMessage]) -> list[ReceivedMessage]:
        """Ack every message still held; returns those refused (in the order given)."""
        refused: list[ReceivedMessage] = []
        for message in messages:
            try:
                await self.ack(message)
            except InvalidReceiptHandleError:
                refused.append(message)
        return refused

    @abc.abstractmethod
    async def change_invisible_duration(self, message: ReceivedMessage, duration: float) -> None:
        """Make ``message`` invisible for ``duration`` seconds from now (same errors
        as :meth:`ack`)."""
