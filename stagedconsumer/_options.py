"""ConsumerOptions: RocketMQ's push-consumer tunables, with its defaults and ranges."""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ._exceptions import InvalidOptionError

__all__ = ("MiB", "ConsumeFromWhere", "ConsumerOptions", "ProducerOptions")

MiB = 1024 * 1024


def _int_range(low: int, high: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidOptionError(
                f"{attribute.name} must be an int in [{low}, {high}], got {value!r}"
            )
        if not low <= value <= high:
            raise InvalidOptionError(f"{attribute.name} = {value} is out of range [{low}, {high}]")

    return check


def _positive_number(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidOptionError(f"{attribute.name} must be a positive number, got {value!r}")


def _finite_positive(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _positive_number(_instance, attribute, value)
    if not math.isfinite(value):
        raise InvalidOptionError(f"{attribute.name} must be finite, got {value!r}")


def _optional_finite_positive(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _finite_positive(_instance, attribute, value)


def _optional_reconsume(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    _int_range(0, 2**31 - 1)(_instance, attribute, value)


_DEFAULT_GRAY_RATIO = 0.1
"""``ConsumerOptions.gray_queue_ratio`` by default."""


class ConsumeFromWhere(enum.Enum):
    """Where a group with no committed progress on a queue starts (RocketMQ's
    ``ConsumeFromWhere``). Queues with committed progress always resume there."""

    CONSUME_FROM_FIRST_OFFSET = "first"
    """The oldest message the queue still holds (the default)."""
    CONSUME_FROM_LAST_OFFSET = "last"
    """The queue's end: only messages sent from now on."""
    CONSUME_FROM_TIMESTAMP = "timestamp"
    """The first message born at or after ``consume_timestamp``."""


def _consume_from(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, ConsumeFromWhere):
        raise InvalidOptionError(f"{attribute.name} must be a ConsumeFromWhere, got {value!r}")


def _timestamp(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidOptionError(f"{attribute.name} must be seconds since the epoch, got {value!r}")


def _bool(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{attribute.name} must be a bool, got {value!r}")


def _ratio(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _positive_number(_instance, attribute, value)
    if not value <= 1:
        raise InvalidOptionError(f"{attribute.name} must be in (0, 1], got {value!r}")


def check_gray_options(switch: bool, tag: bool, ratio: float) -> None:
    """The gray options of a consumer (push or simple) agree with each other."""
    if tag and not switch:
        raise InvalidOptionError("gray_tag=True needs enable_gray_switch=True")
    if ratio != _DEFAULT_GRAY_RATIO and not switch:
        raise InvalidOptionError(
            f"gray_queue_ratio={ratio!r} is used only with"
            " enable_gray_switch=True (on every member of the group); with the switch"
            " off it would be ignored"
        )


@attrs.frozen(kw_only=True)
class ConsumerOptions:
    """Tunables of a :class:`~stagedconsumer.PushConsumer` (RocketMQ names and defaults).

    Ranges follow RocketMQ's ``checkConfig``: threads 1..1000, batch sizes 1..1024,
    queue thresholds 1..65535 messages and 1 B..1024 MiB. Durations are seconds,
    positive and finite: an infinite interval, timeout or backoff would turn a
    stuck store, handler or pull into a consumer that never commits, never stops or
    never starts (wait forever explicitly with ``wait_caught_up(timeout=None)``). An
    unknown option name, a positional argument or a value out of range raises
    :class:`~stagedconsumer.InvalidOptionError`.
    """

    consume_thread_max: int = attrs.field(default=20, validator=_int_range(1, 1000))
    """Handler calls that may run at once, shared by all queues of the consumer."""
    consume_message_batch_max_size: int = attrs.field(default=1, validator=_int_range(1, 1024))
    """Messages per handler call at most (all of one queue, stage key and stage)."""
    pull_batch_size: int = attrs.field(default=32, validator=_int_range(1, 1024))
    """Messages asked of the source per pull."""
    pull_threshold_for_queue: int = attrs.field(default=1000, validator=_int_range(1, 65535))
    """Stop pulling a queue while it holds this many unfinished messages."""
    pull_threshold_size_for_queue: int = attrs.field(
        default=100 * MiB, validator=_int_range(1, 1024 * MiB)
    )
    """Stop pulling a queue while its unfinished message bodies take this many bytes."""
    consume_concurrently_max_span: int = attrs.field(default=2000, validator=_int_range(1, 65535))
    """Concurrent mode: stop pulling while unfinished offsets span this far."""
    max_reconsume_times: int | None = attrs.field(default=None, validator=_optional_reconsume)
    """Attempts before the dead-letter queue; ``None``: 16 for concurrent, unlimited
    for orderly and staged."""
    suspend_current_queue_time_millis: int = attrs.field(
        default=1000, validator=_int_range(10, 30000)
    )
    """Orderly and staged (and concurrent with ``retry_in_place``): wait before a
    failed batch is retried."""
    retry_in_place: bool = attrs.field(default=False, validator=_bool)
    """Concurrent mode: retry a failed message in its own queue, after
    ``suspend_current_queue_time_millis`` (as orderly and staged mode do; the
    dead-letter queue after ``max_reconsume_times`` attempts), instead of handing it
    to the group's retry queue ``%RETRY%<group>``. Exactly-once effects
    (``context.transact``) need it: a copy in the retry queue is a second message, and
    after a crash both it and the original can commit an effect. The failed message
    holds its queue's committed offset while it waits. Ignored in the other modes."""
    persist_consumer_offset_interval: float = attrs.field(default=5.0, validator=_finite_positive)
    """Seconds between commits of progress to the offset store; also how often the
    max offset (for lag) of a queue that is not pulled, paused or held by flow
    control, is asked of the source."""
    sparse_progress_max_ranges: int = attrs.field(default=128, validator=_int_range(0, 65535))
    """Sparse progress: each progress commit records, beside a queue's committed
    offset, the runs of messages above it that already finished (so that they are not
    handed to a handler again after a restart or a hand-over), at most this many runs
    per queue: past that, the lowest ones (the rest come again; counted in
    :attr:`~stagedconsumer.ConsumerStatistics.sparse_progress_truncated`). ``0``
    records the committed offset alone."""
    shutdown_timeout: float = attrs.field(default=30.0, validator=_finite_positive)
    """Seconds that leaving ``async with`` waits for in-flight handlers; calls still
    running then are abandoned (their messages are not committed and come again)."""
    start_timeout: float = attrs.field(default=30.0, validator=_finite_positive)
    """Seconds that starting waits for an offset store that cannot be reached (retried
    with backoff, each failed attempt logged) before it raises."""
    pull_long_polling_timeout: float = attrs.field(default=15.0, validator=_finite_positive)
    """Seconds a pull waits at the head of a queue for new messages."""
    pull_time_delay_when_exception: float = attrs.field(default=1.0, validator=_finite_positive)
    """Seconds before a failed pull is tried again (doubling up to 30 s)."""
    consume_from_where: ConsumeFromWhere = attrs.field(
        default=ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET, validator=_consume_from
    )
    """Where a queue with no committed progress starts (retry queues: always first)."""
    consume_timestamp: float | None = attrs.field(default=None, validator=_timestamp)
    """Where ``CONSUME_FROM_TIMESTAMP`` starts: seconds since the epoch
    (``time.time()``). Needed with it and refused without it: RocketMQ's
    ``consumeTimestamp`` has a default (half an hour ago) and is ignored under
    another ``consume_from_where``, so there giving one by mistake goes unnoticed;
    here there is no default, so a timestamp given is meant to be used."""
    consume_timeout: float | None = attrs.field(default=900.0, validator=_optional_finite_positive)
    """Seconds a handler call may run (RocketMQ's ``consumeTimeout``, 15 minutes);
    a call still running then is timed out, between this and 1.1 times it: an
    ``async def`` handler is cancelled, a plain ``def`` handler's call is abandoned
    (its thread finishes it unobserved, the result is ignored). The call counts as
    failed and is retried as the mode retries failures. ``None`` turns it off."""
    event_loop_block_threshold: float | None = attrs.field(
        default=1.0, validator=_optional_finite_positive
    )
    """Seconds the event loop may be blocked before a warning names what blocked it
    (an ``async def`` handler calling ``time.sleep`` or blocking I/O stops every
    queue), once per handler; ``None`` turns the check off. It costs nothing per
    message: a task beats ten times per threshold and a thread checks the beat."""

    enable_gray_switch: bool = attrs.field(default=False, validator=_bool)
    """Gray release (RocketMQ's RIP-72): allocate the group's queues with
    :class:`~stagedconsumer.AllocateMessageQueueByGray` and keep gray retries apart.
    Turn it on on every member of the group. (With it off, the default allocation is
    gray-aware anyway, the plain average split while no member is gray, so a member
    that missed it leaves no queue without an owner; another ``allocate_strategy``
    warns when a gray member joins.)"""
    gray_tag: bool = attrs.field(default=False, validator=_bool)
    """With ``enable_gray_switch``: this member is gray (it consumes the gray queues).
    Fixed for the member's lifetime: changing it needs a restart."""
    gray_queue_ratio: float = attrs.field(default=0.1, validator=_ratio)
    """Share of each topic's queues that are gray, in (0, 1]: the last
    ``ceil(n * ratio)`` of the sorted queues (8 queues, 0.1: the last one). Only with
    ``enable_gray_switch`` (another value with the switch off is refused)."""

    def __attrs_post_init__(self) -> None:
        check_gray_options(self.enable_gray_switch, self.gray_tag, self.gray_queue_ratio)
        from_timestamp = self.consume_from_where is ConsumeFromWhere.CONSUME_FROM_TIMESTAMP
        if from_timestamp and self.consume_timestamp is None:
            raise InvalidOptionError("CONSUME_FROM_TIMESTAMP needs consume_timestamp")
        if not from_timestamp and self.consume_timestamp is not None:
            raise InvalidOptionError(
                f"consume_timestamp={self.consume_timestamp!r} is used only by"
                " CONSUME_FROM_TIMESTAMP, but consume_from_where is"
                f" {self.consume_from_where.name}: set"
                " consume_from_where=ConsumeFromWhere.CONSUME_FROM_TIMESTAMP to start"
                " from that time, or leave consume_timestamp out"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ConsumerOptions:
        """Build options from a mapping (for example parsed configuration)."""
        return cls(**dict(values))

    def effective_max_reconsume_times(self, *, concurrent: bool) -> int | None:
        """Attempts before the DLQ for a mode; ``None`` means unlimited."""
        if self.max_reconsume_times is not None:
            return self.max_reconsume_times
        return 16 if concurrent else None


@attrs.frozen(kw_only=True)
class ProducerOptions:
    """Tunables of a :class:`~stagedconsumer.Producer` (RocketMQ's names and defaults).

    An unknown option name or a value out of range raises
    :class:`~stagedconsumer.InvalidOptionError`.
    """

    send_msg_timeout: float = attrs.field(default=3.0, validator=_finite_positive)
    """Seconds one ``send`` / ``send_batch`` call may take, retries included: a hard
    deadline, after which :class:`~stagedconsumer.SendTimeoutError` is raised."""
    retry_times_when_send_failed: int = attrs.field(default=2, validator=_int_range(0, 1000))
    """Further attempts after a retriable failure: on the next queue of the topic, or
    on the same queue when a selector or ``queue_id`` chose it."""
    max_message_size: int = attrs.field(default=4 * MiB, validator=_int_range(1, 1024 * MiB))
    """Largest body accepted, in bytes (a batch: the sum of its bodies)."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ProducerOptions:
        """Build options from a mapping (for example parsed configuration)."""
        return cls(**dict(values))


def _reject_unknown_names(cls: type[Any]) -> None:
    """Make ``cls(**values)`` name the unknown option instead of attrs' ``TypeError``."""
    fields = frozenset(field.name for field in attrs.fields(cls))
    attrs_init = cls.__init__

    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            first = attrs.fields(cls)[0].name
            raise InvalidOptionError(
                f"{cls.__name__} takes keyword arguments only, e.g."
                f" {cls.__name__}({first}={args[0]!r}); got {len(args)} positional"
                f" argument(s) {', '.join(repr(a) for a in args)}"
            )
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise InvalidOptionError(
                f"unknown option(s) {', '.join(unknown)}; known options:"
                f" {', '.join(sorted(fields))}"
            )
        attrs_init(self, **kwargs)

    checked_init.__doc__ = attrs_init.__doc__
    checked_init.__name__ = "__init__"
    checked_init.__qualname__ = f"{cls.__name__}.__init__"
    checked_init.__signature__ = inspect.signature(attrs_init)  # type: ignore[attr-defined]
    setattr(cls, "__init__", checked_init)  # noqa: B010 - keep attrs' signature for type checkers


_reject_unknown_names(ConsumerOptions)
_reject_unknown_names(ProducerOptions)
