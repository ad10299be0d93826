"""ConsumerOptions: RocketMQ's push-consumer tunables, with its defaults and ranges."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ._exceptions import InvalidOptionError

__all__ = ("MiB", "ConsumerOptions")

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


def _optional_reconsume(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    _int_range(0, 2**31 - 1)(_instance, attribute, value)


@attrs.frozen(kw_only=True)
class ConsumerOptions:
    """Tunables of a :class:`~stagedconsumer.PushConsumer` (RocketMQ names and defaults).

    Ranges follow RocketMQ's ``checkConfig``: threads 1..1000, batch sizes 1..1024,
    queue thresholds 1..65535 messages and 1 B..1024 MiB. An unknown option name or
    a value out of range raises :class:`~stagedconsumer.InvalidOptionError`.
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
    """Orderly and staged: wait before a failed batch is retried."""
    persist_consumer_offset_interval: float = attrs.field(default=5.0, validator=_positive_number)
    """Seconds between commits of progress to the offset store."""
    shutdown_timeout: float = attrs.field(default=30.0, validator=_positive_number)
    """Seconds that leaving ``async with`` waits for in-flight handlers; calls still
    running then are abandoned (their messages are not committed and come again)."""
    start_timeout: float = attrs.field(default=30.0, validator=_positive_number)
    """Seconds that starting waits for an offset store that cannot be reached (retried
    with backoff, each failed attempt logged) before it raises."""
    pull_long_polling_timeout: float = attrs.field(default=15.0, validator=_positive_number)
    """Seconds a pull waits at the head of a queue for new messages."""
    pull_time_delay_when_exception: float = attrs.field(default=1.0, validator=_positive_number)
    """Seconds before a failed pull is tried again (doubling up to 30 s)."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ConsumerOptions:
        """Build options from a mapping (for example parsed configuration)."""
        return cls(**dict(values))

    def effective_max_reconsume_times(self, *, concurrent: bool) -> int | None:
        """Attempts before the DLQ for a mode; ``None`` means unlimited."""
        if self.max_reconsume_times is not None:
            return self.max_reconsume_times
        return 16 if concurrent else None


_FIELDS = frozenset(field.name for field in attrs.fields(ConsumerOptions))
_attrs_init = ConsumerOptions.__init__


def _checked_init(self: ConsumerOptions, **kwargs: Any) -> None:
    unknown = sorted(set(kwargs) - _FIELDS)
    if unknown:
        raise InvalidOptionError(
            f"unknown option(s) {', '.join(unknown)}; known options: {', '.join(sorted(_FIELDS))}"
        )
    _attrs_init(self, **kwargs)


_checked_init.__doc__ = _attrs_init.__doc__
setattr(ConsumerOptions, "__init__", _checked_init)  # noqa: B010 - keep attrs' signature for type checkers
