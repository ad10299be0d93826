"""Value objects: :class:`Message` and :class:`MessageQueue`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from offsetstore._types import MessageQueue

__all__ = ("EMPTY_PROPERTIES", "Message", "MessageQueue")

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


@attrs.frozen(kw_only=True, eq=False)
class Message:
    """A message as delivered to a listener.

    ``queue_offset`` is the message's position in the queue it was pulled from;
    ``reconsume_times`` counts how often it was handed to a listener before and
    failed. Messages compare by identity of their position
    (``topic``, ``queue_id``, ``queue_offset``, ``reconsume_times``), never by body.
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


def _slot_setters(*names: str) -> tuple[Callable[[Message, Any], None], ...]:
    """The ``__set__`` of ``Message``'s slots ``names``, for decoders on a hot path.

    Private. Building a ``Message`` through them skips attrs' ``__init__`` and its
    converters: the caller must pass values already in their stored form (``keys`` a
    tuple, ``properties`` a read-only mapping such as :data:`EMPTY_PROPERTIES` or a
    ``MappingProxyType``) and set every field. About twice as fast as
    ``object.__setattr__`` per field, which is what attrs' frozen ``__init__`` uses.
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
