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


@attrs.frozen(kw_only=True, eq=False)
class Message(_MessageFields):
    """A message as delivered to a listener.

    ``topic``, ``queue_id`` and ``queue_offset`` say where the message was pulled
    from (the context's ``message_queue``): ``queue_offset`` is its position in that
    queue. ``reconsume_times`` counts how often it was handed to a listener before
    and failed.

    A retried message of a concurrent consumer is the one exception, as in
    RocketMQ: after a failure it is sent to the group's retry topic
    ``%RETRY%<group>`` as a *new* message (a new ``msg_id``, ``reconsume_times``
    one higher) and pulled from there. Its ``topic`` is restored to the topic it was
    first sent to, but ``queue_id`` and ``queue_offset`` are those of the retry
    queue, which is also the context's ``message_queue`` (``%RETRY%<group>#<id>``).
    Where it was first stored (queue and offset) is not kept. Its properties tell
    it apart: ``RETRY_TOPIC`` holds the original topic and ``ORIGIN_MESSAGE_ID`` the
    ``msg_id`` of its first delivery; a message never retried has neither (or test
    ``context.message_queue.topic.startswith("%RETRY%")``). Orderly and staged
    consumers retry in place: the same message, position and ``msg_id``, with
    ``reconsume_times`` one higher (so does a concurrent consumer when the broker
    cannot take the message back).

    Messages compare by identity of their position (``topic``, ``queue_id``,
    ``queue_offset``, ``msg_id``, ``reconsume_times``), never by body.
    """

    topic: str
    queue_id: int
    queue_offset: int
    body: bytes
    keys: tuple[str, ...] = attrs.field(default=(), converter=_freeze_keys)
    tags: str | None = None
    properties: Mapping[str, str] = attrs.field(
        default=EMPTY_PROPERTIES, converter=_freeze_properties
    )
    msg_id: str = ""
    born_timestamp: float = 0.0
    reconsume_times: int = 0

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
    keys: tuple[str, ...] = ()
    tags: str | None = None
    properties: dict[str, str] = attrs.Factory(dict)

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
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"
    FLUSH_SLAVE_TIMEOUT = "FLUSH_SLAVE_TIMEOUT"
    SLAVE_NOT_AVAILABLE = "SLAVE_NOT_AVAILABLE"


@attrs.frozen(kw_only=True)
class SendResult:
    """Where a sent message was stored."""

    msg_id: str
    message_queue: MessageQueue
    queue_offset: int
    status: SendStatus = SendStatus.SEND_OK
    message: Message | None = attrs.field(default=None, repr=False, eq=False)
    """The message as stored (what a consumer of the queue will get)."""

    @classmethod
    def of(cls, message: Message) -> SendResult:
        return cls(
            msg_id=message.msg_id,
            message_queue=MessageQueue(message.topic, message.queue_id),
            queue_offset=message.queue_offset,
            message=message,
        )
