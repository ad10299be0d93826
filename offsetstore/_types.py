"""Value types of the offset store: progress of a queue, how to read it."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import attrs

__all__ = (
    "MessageQueue",
    "QueueProgress",
    "ReadOffsetType",
    "StageKey",
    "check_finished",
    "merge_marks",
    "check_offset",
    "check_stage_offset",
    "check_stage_offsets",
    "decode_finished",
    "encode_finished",
)


@attrs.frozen(order=True, cache_hash=True)
class MessageQueue:
    """One partition of a topic: an ordered log addressed by integer queue offsets."""

    topic: str
    """The topic the queue belongs to."""
    queue_id: int
    """Its number within the topic, from 0."""

    def __str__(self) -> str:
        return f"{self.topic}#{self.queue_id}"


@attrs.frozen(order=True, cache_hash=True)
class StageKey:
    """What stage progress is tracked by, within one message queue.

    ``strategy_id`` is a str and ``group_id`` a str or ``None`` (checked: a store
    keeps them as text and could not read anything else back).
    """

    strategy_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    """The stage strategy: ``"default"`` for a listener with only
    ``get_stage_definitions()``, else what ``compute_strategy`` returned."""
    group_id: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )
    """What ``compute_group`` returned (an independent stage sequence within the
    queue), or ``None``."""

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


def check_offset(what: str, value: object) -> None:
    """Check that ``value`` is an int >= 0 (a bool is not): ``TypeError`` saying
    ``"<what> must be an int"`` or ``ValueError`` saying ``"<what> must be >= 0"``
    otherwise (the wording of ``stagedconsumer offsets reset``)."""
    if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")


def check_stage_offset(key: object, offset: object) -> None:
    """Check one stage offset entry: ``key`` a :class:`StageKey`, ``offset`` an int
    >= 0 (not a bool); ``TypeError`` / ``ValueError`` naming the entry otherwise."""
    if type(key) is not StageKey and not isinstance(key, StageKey):
        hint = f" (write StageKey({key!r}) for a strategy id)" if isinstance(key, str) else ""
        raise TypeError(
            f"stage offsets map StageKey to int: key {key!r} is a {type(key).__name__},"
            f" not a StageKey{hint}"
        )
    if type(offset) is not int or offset < 0:
        try:
            check_offset("stage offset", offset)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{exc} for stage key {str(key)!r}") from None


def check_stage_offsets(value: object) -> dict[StageKey, int]:
    """``value`` (a mapping of :class:`StageKey` to int >= 0, or ``None``) as a new dict;
    ``TypeError`` / ``ValueError`` naming the first bad entry otherwise.

    Every :class:`QueueProgress` is built through here, and the store's
    ``update_stage_offset`` and ``reset_progress`` check the same way, so a store
    is never given a row it cannot read back.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"stage offsets must be a mapping of StageKey to int, got {value!r}")
    result = dict(value)
    for key, offset in result.items():
        if type(key) is not StageKey or type(offset) is not int or offset < 0:
            check_stage_offset(key, offset)
    return result


def _freeze(value: Mapping[StageKey, int] | None) -> Mapping[StageKey, int]:
    return MappingProxyType(check_stage_offsets(value))


def _check_consume_offset(
    _instance: object, _attribute: attrs.Attribute[int | None], value: int | None
) -> None:
    if value is not None:
        check_offset("consume offset", value)


def check_finished(value: object) -> tuple[tuple[int, int], ...]:
    """``value`` (ranges ``(first, last)`` of finished offsets) as a tuple of int pairs
    in ascending order, neither overlapping nor touching; ``TypeError`` or
    ``ValueError`` naming the first bad entry otherwise."""
    if not value:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise TypeError(f"finished ranges must be a sequence of (first, last), got {value!r}")
    result: list[tuple[int, int]] = []
    previous = -2
    for entry in value:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise TypeError(f"finished range {entry!r} is not a (first, last) pair")
        first, last = entry
        check_offset("finished range start", first)
        check_offset("finished range end", last)
        if last < first or first <= previous + 1:
            raise ValueError(
                f"finished ranges must ascend without overlapping or touching, got {value!r}"
            )
        result.append((first, last))
        previous = last
    return tuple(result)


def _check_progress_finished(
    instance: QueueProgress,
    _attribute: attrs.Attribute[tuple[tuple[int, int], ...]],
    value: tuple[tuple[int, int], ...],
) -> None:
    if value and instance.consume_offset is not None and value[0][0] < instance.consume_offset:
        raise ValueError(
            f"finished ranges {value!r} must not start below the consume offset"
            f" {instance.consume_offset!r}"
        )


@attrs.frozen(kw_only=True)
class QueueProgress:
    """The progress of one queue of one consumer group, committed as one unit.

    ``consume_offset`` is where consumption resumes (every message below it
    finished; ``None`` when only stage offsets were recorded); ``stage_offsets``
    holds, per stage key, the stage offset at ``consume_offset``; ``finished``
    (sparse progress) the ranges ``(first, last)`` of offsets from
    ``consume_offset`` on whose messages finished too, in ascending order: no message
    of a range is handed to a handler again (they are assigned their stages, in
    staged mode, when consumption passes them). Without a consume offset, ``finished``
    holds finished marks of transactions made before any progress was committed.

    Checked when built: ``consume_offset`` an int >= 0 or ``None``, ``stage_offsets``
    a mapping of :class:`StageKey` to int >= 0 (a bool is not an offset);
    ``TypeError`` or ``ValueError`` naming the bad entry otherwise. So any progress
    a store is given can be stored and read back.
    """

    consume_offset: int | None = attrs.field(validator=_check_consume_offset)
    """Where consumption resumes: every message below it finished."""
    stage_offsets: Mapping[StageKey, int] = attrs.field(factory=dict, converter=_freeze)
    """Per stage key, the stage offset at ``consume_offset``."""
    finished: tuple[tuple[int, int], ...] = attrs.field(
        default=(), converter=check_finished, validator=_check_progress_finished
    )
    """Sparse progress: the runs of offsets above ``consume_offset`` whose messages
    already finished, as ``(first, last)`` pairs, ascending and apart; a queue resumed
    from this progress does not hand them to a handler again."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QueueProgress):
            return NotImplemented
        return (
            self.consume_offset == other.consume_offset
            and self.finished == other.finished
            and dict(self.stage_offsets) == dict(other.stage_offsets)
        )

    def __hash__(self) -> int:
        return hash((self.consume_offset, self.finished, frozenset(self.stage_offsets.items())))

    @property
    def finished_count(self) -> int:
        """How many offsets the ``finished`` ranges span."""
        return sum(last - first + 1 for first, last in self.finished)


def merge_marks(progress: QueueProgress | None, marks: Iterable[int]) -> QueueProgress | None:
    """``progress`` with the finished marks ``marks`` (offsets, exactly-once effects)
    from its consume offset on joined to its ``finished`` ranges (a mark next to a
    range, or to the next mark, extends it). Without a consume offset (none committed
    yet, or no progress at all) every mark counts."""
    if progress is None:
        progress = QueueProgress(consume_offset=None)
    base = progress.consume_offset if progress.consume_offset is not None else 0
    above = sorted({offset for offset in marks if offset >= base})
    if not above:
        return progress
    points: list[tuple[int, int]] = sorted([*progress.finished, *((o, o) for o in above)])
    merged: list[list[int]] = []
    for first, last in points:
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return attrs.evolve(progress, finished=tuple((f, last) for f, last in merged))


def encode_finished(consume_offset: int | None, finished: Sequence[tuple[int, int]]) -> str | None:
    """Compact text of finished ranges: ``gap+length`` per range, comma separated,
    each gap counted from the previous range's last offset (the first from the
    consume offset) and the length less one; ``None`` for no range."""
    if not finished or consume_offset is None:
        return None
    parts = []
    previous = consume_offset
    for first, last in finished:
        parts.append(f"{first - previous}+{last - first}")
        previous = last
    return ",".join(parts)


def decode_finished(consume_offset: int | None, text: str | None) -> tuple[tuple[int, int], ...]:
    """Inverse of :func:`encode_finished`; ``ValueError`` on anything else."""
    if not text:
        return ()
    if consume_offset is None:
        raise ValueError(f"finished ranges {text[:80]!r} without a consume offset")
    result = []
    previous = consume_offset
    for part in text.split(","):
        gap_text, _, length_text = part.partition("+")
        if not (gap_text.isdigit() and length_text.isdigit()):
            raise ValueError(f"bad finished range {part!r}")
        first = previous + int(gap_text)
        last = first + int(length_text)
        result.append((first, last))
        previous = last
    return check_finished(result)
