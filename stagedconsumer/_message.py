"""Value objects: :class:`Message` and :class:`MessageQueue`; what a producer sends
(:class:`OutgoingMessage`) and gets back (:class:`SendResult`)."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from offsetstore._types import MessageQueue

from ._exceptions import InvalidMessageError

__all__ = (
    "EMPTY_PROPERTIES",
    "Message",
    "MessageQueue",
    "OutgoingMessage",
    "SendResult",
    "SendStatus",
)

EMPTY_PROPERTIES: Mapping[str, str] = MappingProxyType({})


def _freeze_properties(value: Mapping[str, str] | None) -> Mapping[str, str]:
    if not value:
        return EMPTY_PROPERTIES
    if isinstance(value, MappingProxyType):
        return value
    return MappingProxyType(dict(value))


def _freeze_keys(value: tuple[str, ...] | list[str] | str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


class _MessageFields:
    """Where a :class:`Message` keeps its fields: its slots, declared on this plain
    (mutable) base class, which ``Message`` adds nothing to (attrs reuses slots a base
    class declares).

    Private, for decoders on a hot path: build a ``_MessageFields``, set every slot
    with plain attribute stores (which the interpreter specialises for slots; a frozen
    class's stores go through its ``__setattr__``), then make it a ``Message`` with
    ``fields.__class__ = Message`` (allowed: the two share one layout). The caller must
    pass values already in their stored form (``keys`` a tuple, ``properties`` a
    read-only mapping such as :data:`EMPTY_PROPERTIES` or a ``MappingProxyType``) and
    set every slot: attrs' ``__init__`` and its converters do not run. About a quarter
    of the instructions of setting the slots one ``__set__`` call at a time (the
    setters below): 2.0k against 7.9k per message under callgrind.
    """

    __slots__ = (
        "__weakref__",
        "body",
        "born_timestamp",
        "keys",
        "msg_id",
        "offset_msg_id",
        "properties",
        "queue_id",
        "queue_offset",
        "reconsume_times",
        "tags",
        "topic",
    )

    topic: str
    queue_id: int
    queue_offset: int
    body: bytes
    keys: tuple[str, ...]
    tags: str | None
    properties: Mapping[str, str]
    msg_id: str
    born_timestamp: float
    reconsume_times: int
    offset_msg_id: str


def _same_as_msg_id(message: Message) -> str:
    return message.msg_id


@attrs.frozen(kw_only=True, eq=False)
class Message(_MessageFields):
    """A message as delivered to a listener.

    ``topic``, ``queue_id`` and ``queue_offset`` say where the message was pulled
    from (the context's ``message_queue``): ``queue_offset`` is its position in that
    queue. ``reconsume_times`` counts how often it was handed to a listener before
    and failed.

    ``msg_id`` is the message's id from its producer on, as RocketMQ's
    ``getMsgId()`` (the ``UNIQ_KEY`` the producer sets): the same for every
    delivery of the message, retries through the retry queue and its dead-letter
    copy included, so it is what to deduplicate by and what a trace query finds
    every attempt by. ``offset_msg_id`` is the id of this stored copy (RocketMQ's
    ``offsetMsgId``): the same as ``msg_id`` where the message was first stored,
    a new one for each copy the broker stores in the retry queue or the dead-letter
    queue.

    A retried message of a concurrent consumer is the one exception to
    "``queue_offset`` is its position", as in RocketMQ: after a failure it is
    stored in the group's retry topic ``%RETRY%<group>`` as a new copy (a new
    ``offset_msg_id``, the same ``msg_id``, ``reconsume_times`` one higher) and
    pulled from there. Its ``topic`` is restored to the topic it was first sent
    to, but ``queue_id`` and ``queue_offset`` are those of the retry queue, which
    is also the context's ``message_queue`` (``%RETRY%<group>#<id>``). Where it
    was first stored (queue and offset) is not kept. Its properties tell it apart:
    ``RETRY_TOPIC`` holds the original topic and ``ORIGIN_MESSAGE_ID`` its
    ``msg_id`` (kept for code written when a retry got a new ``msg_id``); a
    message never retried has neither (or test
    ``context.message_queue.topic.startswith("%RETRY%")``). Orderly and staged
    consumers retry in place: the same message, position and ids, with
    ``reconsume_times`` one higher (so does a concurrent consumer when the broker
    cannot take the message back).

    Messages compare by identity of their position (``topic``, ``queue_id``,
    ``queue_offset``, ``msg_id``, ``reconsume_times``), never by body.
    """

    topic: str
    """The topic the message was sent to (for a retried message too)."""
    queue_id: int
    """The queue it was pulled from (for a message retried through the retry queue,
    the retry queue's)."""
    queue_offset: int
    """Its position in that queue."""
    body: bytes
    """The payload, as sent."""
    keys: tuple[str, ...] = attrs.field(default=(), converter=_freeze_keys)
    """Business keys (``keys=`` of the send); the first picks the queue and, in
    key-ordered consumption, the key."""
    tags: str | None = None
    """The tag a subscription's filter (``"TagA || TagB"``) matches, or ``None``."""
    properties: Mapping[str, str] = attrs.field(
        default=EMPTY_PROPERTIES, converter=_freeze_properties
    )
    """User and system properties, a read-only mapping of str to str."""
    msg_id: str = ""
    """The message's id (RocketMQ's ``getMsgId()``): given when it is first stored and
    kept across retries and dead-lettering, so it serves as an idempotency key."""
    born_timestamp: float = 0.0
    """When it was sent, in seconds since the epoch."""
    reconsume_times: int = 0
    """How often it was handed to a listener before and failed."""
    offset_msg_id: str = attrs.field(default=attrs.Factory(_same_as_msg_id, takes_self=True))
    """The id of this stored copy (RocketMQ's ``offsetMsgId``); by default
    ``msg_id``."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return (
            self.topic == other.topic
            and self.queue_id == other.queue_id
            and self.queue_offset == other.queue_offset
            and self.msg_id == other.msg_id
            and self.reconsume_times == other.reconsume_times
        )

    def __hash__(self) -> int:
        return hash((self.topic, self.queue_id, self.queue_offset, self.msg_id))

    def __reduce__(self) -> tuple[Callable[..., Message], tuple[Any, ...]]:
        """Pickling (and ``copy``): every field, the properties as a plain dict (a
        read-only mapping does not pickle), frozen again when the copy is built."""
        return (
            _rebuild,
            (
                self.topic,
                self.queue_id,
                self.queue_offset,
                self.body,
                self.keys,
                self.tags,
                dict(self.properties),
                self.msg_id,
                self.born_timestamp,
                self.reconsume_times,
                self.offset_msg_id,
            ),
        )


def _rebuild(
    topic: str,
    queue_id: int,
    queue_offset: int,
    body: bytes,
    keys: tuple[str, ...],
    tags: str | None,
    properties: dict[str, str],
    msg_id: str,
    born_timestamp: float,
    reconsume_times: int,
    offset_msg_id: str | None = None,
) -> Message:
    """A :class:`Message` from what its ``__reduce__`` gave (for ``pickle``)."""
    return Message(
        topic=topic,
        queue_id=queue_id,
        queue_offset=queue_offset,
        body=body,
        keys=keys,
        tags=tags,
        properties=properties,
        msg_id=msg_id,
        born_timestamp=born_timestamp,
        reconsume_times=reconsume_times,
        offset_msg_id=msg_id if offset_msg_id is None else offset_msg_id,
    )


def _slot_setters(*names: str) -> tuple[Callable[[Message, Any], None], ...]:
    """The ``__set__`` of ``Message``'s slots ``names``, for decoders on a hot path.

    Private. Building a ``Message`` through them skips attrs' ``__init__`` and its
    converters: the caller must pass values already in their stored form (``keys`` a
    tuple, ``properties`` a read-only mapping such as :data:`EMPTY_PROPERTIES` or a
    ``MappingProxyType``) and set every field. About twice as fast as
    ``object.__setattr__`` per field, which is what attrs' frozen ``__init__`` uses;
    for one message at a time, :class:`_MessageFields` is faster still. Setters suit
    setting one field over many messages at once (``map`` over a list).
    """
    slots = vars(Message)
    return tuple(slots[name].__set__ for name in names)


_new_message = object.__new__
"""Allocate a ``Message`` without ``__init__`` (then set every slot with the setters below)."""
(
    _set_topic,
    _set_queue_id,
    _set_queue_offset,
    _set_body,
    _set_keys,
    _set_tags,
    _set_properties,
    _set_msg_id,
    _set_born_timestamp,
    _set_reconsume_times,
    _set_offset_msg_id,
) = _slot_setters(
    "topic",
    "queue_id",
    "queue_offset",
    "body",
    "keys",
    "tags",
    "properties",
    "msg_id",
    "born_timestamp",
    "reconsume_times",
    "offset_msg_id",
)


def _checked_keys(keys: object) -> tuple[str, ...]:
    if isinstance(keys, str):
        return (keys,) if keys else ()
    if keys is None or isinstance(keys, (bytes, bytearray)) or not isinstance(keys, Iterable):
        raise InvalidMessageError(
            f"keys must be a string or a sequence of strings, got {type(keys).__name__}"
        )
    out = tuple(keys)
    for key in out:
        if not isinstance(key, str):
            raise InvalidMessageError(f"keys must be strings, got {type(key).__name__} {key!r}")
    return out


TAG = re.compile(r"[^\s|&*]+")
"""One tag: what a message may carry and a subscription expression may name (no
whitespace, no ``|``, ``&`` or ``*``)."""

RESERVED_PROPERTIES = frozenset({"RETRY_TOPIC", "ORIGIN_MESSAGE_ID", "GRAY"})
"""Properties the brokers set and read themselves (``PROPERTY_RETRY_TOPIC``,
``PROPERTY_ORIGIN_MESSAGE_ID``, ``PROPERTY_GRAY``): a message sent with one of them
would be taken for a retry, a copy of another message, or gray traffic."""


def _checked_tags(tags: object) -> str | None:
    if tags is None:
        return None
    if not isinstance(tags, str):
        raise InvalidMessageError(f"tags must be a string or None, got {type(tags).__name__}")
    if not TAG.fullmatch(tags):
        raise InvalidMessageError(
            f"tags={tags!r} is not one tag: a message has one tag, without whitespace, '|',"
            " '&' or '*' (a subscription 'TagA || TagB' selects messages of either tag),"
            " so no consumer could select it"
        )
    return tags


def _checked_properties(properties: object) -> dict[str, str]:
    if properties is None:
        return {}
    if not isinstance(properties, Mapping):
        raise InvalidMessageError(
            f"properties must be a mapping of str to str, got {type(properties).__name__}"
        )
    out: dict[str, str] = {}
    for name, value in properties.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidMessageError(
                "properties must map str to str, got"
                f" {type(name).__name__} {name!r}: {type(value).__name__} {value!r}"
            )
        if name in RESERVED_PROPERTIES:
            raise InvalidMessageError(
                f"property {name!r} is set by the broker itself (reserved:"
                f" {', '.join(sorted(RESERVED_PROPERTIES))}): a message sent with it would be"
                " treated as a retry, a copy or gray traffic; use another name"
            )
        out[name] = value
    return out


@attrs.define(kw_only=True, eq=False)
class OutgoingMessage:
    """A message to send: what :meth:`~stagedconsumer.Producer.send_batch` takes and
    what send hooks see (they may add ``properties``, e.g. a trace context).

    Build it with :meth:`of`, which checks every field: ``body`` bytes, ``keys`` a
    string or strings, ``tags`` a string or ``None``, ``properties`` str to str.
    """

    body: bytes
    """The payload."""
    keys: tuple[str, ...] = ()
    """Business keys (RocketMQ's ``KEYS``): the key-ordered mode orders by the first."""
    tags: str | None = None
    """The tag consumers filter on (``None``: no tag)."""
    properties: dict[str, str] = attrs.Factory(dict)
    """User properties (names the library reserves are refused by :meth:`of`)."""

    @classmethod
    def of(
        cls,
        body: object,
        *,
        keys: object = (),
        tags: object = None,
        properties: object = None,
    ) -> OutgoingMessage:
        """A checked message; raises :class:`~stagedconsumer.InvalidMessageError`
        naming the bad field."""
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise InvalidMessageError(f"body must be bytes, got {type(body).__name__}")
        return cls(
            body=bytes(body),
            keys=_checked_keys(keys),
            tags=_checked_tags(tags),
            properties=_checked_properties(properties),
        )

    def copy(self) -> OutgoingMessage:
        """A copy whose properties can be changed without touching this one."""
        return OutgoingMessage(
            body=self.body, keys=self.keys, tags=self.tags, properties=dict(self.properties)
        )


class SendStatus(enum.Enum):
    """How a send ended (RocketMQ's ``SendStatus``; the brokers here either store a
    message or raise, so a result is always ``SEND_OK``)."""

    SEND_OK = "SEND_OK"
    """Stored."""
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"
    """RocketMQ's: stored, but not flushed to disk in time (never returned here)."""
    FLUSH_SLAVE_TIMEOUT = "FLUSH_SLAVE_TIMEOUT"
    """RocketMQ's: stored, but not replicated in time (never returned here)."""
    SLAVE_NOT_AVAILABLE = "SLAVE_NOT_AVAILABLE"
    """RocketMQ's: stored, no replica available (never returned here)."""


@attrs.frozen(kw_only=True)
class SendResult:
    """Where a sent message was stored."""

    msg_id: str
    """The stored message's id."""
    message_queue: MessageQueue
    """The queue it was stored in."""
    queue_offset: int
    """Its offset in that queue."""
    status: SendStatus = SendStatus.SEND_OK
    """Always ``SEND_OK``: the brokers here store a message or raise."""
    message: Message | None = attrs.field(default=None, repr=False, eq=False)
    """The message as stored (what a consumer of the queue will get)."""

    @classmethod
    def of(cls, message: Message) -> SendResult:
        """The result of storing ``message``."""
        return cls(
            msg_id=message.msg_id,
            message_queue=MessageQueue(message.topic, message.queue_id),
            queue_offset=message.queue_offset,
            message=message,
        )
