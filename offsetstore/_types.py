"""Value types of the offset store: progress of a queue, how to read it."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

import attrs

__all__ = ("MessageQueue", "QueueProgress", "ReadOffsetType", "StageKey")


@attrs.frozen(order=True, cache_hash=True)
class MessageQueue:
    """One partition of a topic: an ordered log addressed by integer queue offsets."""

    topic: str
    queue_id: int

    def __str__(self) -> str:
        return f"{self.topic}#{self.queue_id}"


@attrs.frozen(order=True, cache_hash=True)
class StageKey:
    """What stage progress is tracked by, within one message queue."""

    strategy_id: str
    group_id: str | None = None

    def __str__(self) -> str:
        return self.strategy_id if self.group_id is None else f"{self.strategy_id}/{self.group_id}"


class ReadOffsetType(enum.Enum):
    """Where a read looks (RocketMQ's names)."""

    READ_FROM_MEMORY = "memory"
    """Only the in-memory table (what this process last updated)."""
    READ_FROM_STORE = "store"
    """Only the durable store (what was last persisted, by anyone)."""
    MEMORY_FIRST_THEN_STORE = "memory_first_then_store"
    """The in-memory table, falling back to the store when the queue is unknown there."""


def _freeze(value: Mapping[StageKey, int] | None) -> Mapping[StageKey, int]:
    return MappingProxyType(dict(value or {}))


@attrs.frozen(kw_only=True)
class QueueProgress:
    """The progress of one queue of one consumer group, committed as one unit.

    ``consume_offset`` is where consumption resumes (every message below it
    finished; ``None`` when only stage offsets were recorded); ``stage_offsets``
    holds, per stage key, the stage offset at ``consume_offset``.
    """

    consume_offset: int | None = attrs.field(
        validator=attrs.validators.optional(attrs.validators.ge(0))
    )
    stage_offsets: Mapping[StageKey, int] = attrs.field(factory=dict, converter=_freeze)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QueueProgress):
            return NotImplemented
        return self.consume_offset == other.consume_offset and dict(self.stage_offsets) == dict(
            other.stage_offsets
        )

    def __hash__(self) -> int:
        return hash((self.consume_offset, frozenset(self.stage_offsets.items())))
