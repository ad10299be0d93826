"""State shared by the services of one consumer: its counters and lifecycle
(:class:`ConsumerState`) and each assigned queue (:class:`QueueState`)."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import attrs

from offsetstore import QueueProgress

from .._core import ProcessQueue
from .._filter import TagFilter
from .._message import MessageQueue

__all__ = ("ConsumerState", "QueueState")


@attrs.define(eq=False, slots=True)
class ConsumerState:
    """What the services of one consumer count and what they must all know.

    The services change the counters directly (one attribute store on the hot path);
    :meth:`~stagedconsumer.PushConsumer.statistics` copies them into a frozen
    :class:`~stagedconsumer.ConsumerStatistics`.
    """

    group: str
    mode: str
    consumed_ok: int = 0
    consumed_failed: int = 0
    sent_back: int = 0
    dead_lettered: int = 0
    in_flight: int = 0
    pull_errors: int = 0
    commit_errors: int = 0
    commits: int = 0
    invalid_returns: int = 0
    """Handler calls that returned neither None nor a status of their mode."""
    assignment_errors: int = 0
    """Failed stage assignments (a stage callback raised or returned a bad value)."""
    abandoned_calls: int = 0
    """Handler calls still running when shutdown gave up waiting for them."""
    listener_errors: int = 0
    """Exceptions of message queue listeners (logged and ignored)."""
    timed_out_calls: int = 0
    """Handler calls that ran longer than ``consume_timeout``."""
    undecodable_entries: int = 0
    """Poison entries moved to the group's dead-letter queue."""
    trimmed_offsets: int = 0
    """Pulls that found their offset no longer stored (retention trimmed it)."""
    offsets_beyond_end: int = 0
    """Committed offsets found beyond their queue's end, and corrected."""
    skipped_released: int = 0
    """Messages skipped as already finished by queues since released."""
    sparse_progress_truncated: int = 0
    """Queue progress commits whose finished ranges were cut at the bound."""
    transactions: int = 0
    """Committed ``context.transact`` calls."""
    started: bool = False
    stopping: bool = False
    """Shutdown began: workers take no new batch, loops wind down."""
    closed: bool = False
    failure: BaseException | None = None
    """A failure that stops the consumer (a permanent offset store error, say); raised
    from ``async with`` after the shutdown."""
    on_failure: Callable[[], None] | None = None
    """Called once, on the first :meth:`fail` (the consumer cancels its body)."""

    def fail(self, exc: BaseException) -> None:
        """Stop the consumer because of ``exc`` (the first failure wins)."""
        if self.failure is not None:
            return
        self.failure = exc
        if self.on_failure is not None:
            self.on_failure()


@attrs.define(eq=False)
class QueueState:
    """One assigned queue: its process queue, tag filter and what was last persisted."""

    mq: MessageQueue
    pq: ProcessQueue
    filter: TagFilter
    is_retry: bool
    pull_scope: anyio.CancelScope | None = None
    room: anyio.Event | None = None
    """Set when the pull loop may go on after pausing for flow control."""
    unpaused: anyio.Event | None = None
    """Set when the pull loop may go on after the queue was paused."""
    persisted: QueueProgress | None = None
    finished_count: int = 0
    """How many finished messages above the committed offset the last commit saw."""
