"""What extensions see of a consumer: the ``ConsumerView`` protocol and the
``ConsumerStatistics`` snapshot.

Hooks, trace sinks and OpenTelemetry get a :class:`ConsumerView`, never the
``PushConsumer`` class, so that they depend on four names rather than on the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import attrs

from .._core import ProcessQueueStatistics
from .._message import MessageQueue

if TYPE_CHECKING:
    from .._sources._source import MessageSource

__all__ = ("ConsumerStatistics", "ConsumerView")


@attrs.frozen(kw_only=True)
class ConsumerStatistics:
    """A snapshot of a :class:`~stagedconsumer.PushConsumer`."""

    group: str
    """The consumer group."""
    mode: str
    """The consumption mode: ``"concurrent"``, ``"orderly"``, ``"key_ordered"`` or
    ``"staged"``."""
    consumed_ok: int
    """Messages whose handler succeeded."""
    consumed_failed: int
    """Handler failures, counted per message and attempt."""
    sent_back: int
    """Messages handed to the group's retry queue (concurrent mode)."""
    dead_lettered: int
    """Messages moved to the dead-letter queue."""
    in_flight: int
    """Handler calls running now."""
    pull_errors: int
    """Failed pulls (retried with backoff)."""
    commit_errors: int
    """Failed attempts to persist progress (retried with backoff)."""
    commits: int
    """Successful persists of progress."""
    queues: Mapping[MessageQueue, ProcessQueueStatistics]
    """Per assigned queue, its own snapshot."""
    hook_errors: int = 0
    """Exceptions raised by consume hooks (logged and ignored)."""
    invalid_returns: int = 0
    """Handler calls that returned something that is not a status of their mode nor
    ``None`` (a string such as ``'SUCCESS'``, ``True``): each is treated as a failure
    (``RECONSUME_LATER`` / ``SUSPEND_CURRENT_QUEUE_A_MOMENT``), the first logged as an
    ERROR naming the value and its type."""
    trace_records_dropped: int = 0
    """Message trace records dropped because a trace dispatcher's queue was full."""
    assignment_errors: int = 0
    """Stage assignments that failed: ``compute_strategy``, ``compute_group`` or
    ``reset_current_stage_offset_if_need`` raised or returned a bad value. The queue
    holds that message (and the rest) and assigns it again a while later."""
    abandoned_calls: int = 0
    """Handler calls still running when shutdown stopped waiting for them: their
    messages stay uncommitted and are delivered again."""
    listener_errors: int = 0
    """Exceptions of message queue listeners (logged and ignored)."""
    timed_out_calls: int = 0
    """Handler calls that ran longer than ``consume_timeout`` (cancelled, or
    abandoned for a plain ``def`` handler) and were retried as failures."""
    undecodable_entries: int = 0
    """Entries of a queue that could not be decoded into a message (poison entries:
    the broker's fields, corrupt), moved to the group's dead-letter queue with their
    fields as stored; each logged once (ERROR)."""
    trimmed_offsets: int = 0
    """Times a queue's offset was no longer stored when pulled: the broker's retention
    (``StreamRetention``) removed entries this group had not consumed. Each logged
    (WARNING); the queue went on where ``consume_from_where`` says."""
    offsets_beyond_end: int = 0
    """Times a queue's committed consume offset was beyond the queue's end (its
    messages were lost or the queue recreated: a flushed Redis, an embedded broker
    refilled with less): each logged (WARNING, with the queue, the offset and the
    end) and corrected per ``consume_from_where``: ``CONSUME_FROM_FIRST_OFFSET``
    from the queue's first offset, ``CONSUME_FROM_LAST_OFFSET`` from its end,
    ``CONSUME_FROM_TIMESTAMP`` from ``consume_timestamp``."""
    skipped_finished: int = 0
    """Messages not handed to a handler because they had finished before (sparse
    progress or an exactly-once effect's mark, read when the queue was taken)."""
    sparse_progress_truncated: int = 0
    """Progress commits of a queue whose finished messages above the committed offset
    made more runs than ``sparse_progress_max_ranges``: the runs past it were left
    out (their messages come again after a restart or a hand-over)."""
    transactions: int = 0
    """Committed ``context.transact`` calls (exactly-once effects)."""

    @property
    def paused_queues(self) -> list[MessageQueue]:
        """The assigned queues that are paused."""
        return [mq for mq, q in self.queues.items() if q.paused]

    @property
    def lag(self) -> int:
        """Messages past the committed offsets of every assigned queue: the sum of
        each queue's :attr:`~stagedconsumer.ProcessQueueStatistics.lag`, paused
        queues included (a queue whose max offset is not known yet counts 0)."""
        return sum(q.lag or 0 for q in self.queues.values())

    @property
    def committed_offsets(self) -> Mapping[MessageQueue, int]:
        """The committed consume offset of every assigned queue."""
        return {mq: q.committed_offset for mq, q in self.queues.items()}

    @property
    def cached_count(self) -> int:
        """Messages pulled and not yet taken by a handler, over every assigned queue."""
        return sum(q.cached_count for q in self.queues.values())

    @property
    def pending_count(self) -> int:
        """Messages taken by a handler and not finished, over every assigned queue."""
        return sum(q.pending_count for q in self.queues.values())


class ConsumerView(Protocol):
    """The consumer as hooks and trace sinks see it (``PushConsumer`` is one)."""

    @property
    def group(self) -> str:
        """The consumer group."""
        ...

    @property
    def client_id(self) -> str:
        """This consumer's identity among the members of its group."""
        ...

    @property
    def source(self) -> MessageSource:
        """Where the consumer pulls from."""
        ...

    def statistics(self) -> ConsumerStatistics:
        """A frozen snapshot of the consumer's counters and queues."""
        ...
