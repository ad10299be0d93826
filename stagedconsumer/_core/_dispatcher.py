"""Dispatcher: picks the next batch across all process queues (sans-I/O).

Workers of the shell ask :meth:`Dispatcher.take` for a batch; when it returns
``None`` they wait until the shell is told (by a ``True`` return of
:meth:`put_messages`, :meth:`finish` or :meth:`handle_timer`) that new work is ready.
Suspended batches come back through :meth:`handle_timer`, driven by
:meth:`get_timer`. Queues take turns round-robin, so one busy queue cannot starve
the others.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence

from .._message import Message
from ._process_queue import Batch, EraseStatus, ProcessQueue

__all__ = ("Dispatcher",)


class Dispatcher:
    """Round-robin over process queues that have a batch ready."""

    __slots__ = ("_ready", "_seq", "_timers")

    def __init__(self) -> None:
        # The dispatcher is the process queues' friend: it reads their ready lists.
        self._ready: deque[ProcessQueue] = deque()
        self._timers: list[tuple[float, int, Batch]] = []
        self._seq = itertools.count()

    def _mark_ready(self, pq: ProcessQueue) -> None:
        if not pq.in_ready and not pq.dropped:
            pq.in_ready = True
            self._ready.append(pq)

    def put_messages(
        self,
        pq: ProcessQueue,
        messages: Sequence[Message],
        *,
        highest_offset: int | None = None,
        now: float | None = None,
    ) -> bool:
        """Cache messages in ``pq``; returns whether a batch became ready.

        ``now`` (optional) is recorded for message trace and metrics (see
        :meth:`ProcessQueue.put_messages`)."""
        if pq.put_messages(messages, highest_offset=highest_offset, now=now):
            self._mark_ready(pq)
            return True
        return False

    def take(self, max_count: int) -> Batch | None:
        """The next batch of up to ``max_count`` messages that may run now, or ``None``."""
        ready = self._ready
        while ready:
            pq = ready.popleft()
            batch = pq.try_take_messages(max_count) if not pq.dropped else None
            if batch is None:
                pq.in_ready = False
                continue
            if pq._ready or pq._retry_ready:
                ready.append(pq)
            else:
                pq.in_ready = False
            return batch
        return None

    def has_ready(self) -> bool:
        return bool(self._ready)

    def finish(self, batch: Batch, status: EraseStatus, now: float | None = None) -> bool:
        """Finish every message of ``batch``; returns whether a batch became ready."""
        pq = batch.process_queue
        if pq.erase_messages(batch, status, now):
            self._mark_ready(pq)
            return True
        return False

    def finish_some(
        self,
        batch: Batch,
        messages: Sequence[Message],
        status: EraseStatus,
        now: float | None = None,
    ) -> bool:
        """Finish ``messages`` of ``batch``, keeping the rest pending."""
        pq = batch.process_queue
        if pq.erase_some(batch, messages, status, now):
            self._mark_ready(pq)
            return True
        return False

    def suspend(self, batch: Batch, retry_at: float) -> None:
        """Retry ``batch`` at ``retry_at`` (see :meth:`ProcessQueue.suspend_messages`)."""
        batch.process_queue.suspend_messages(batch, retry_at)
        heapq.heappush(self._timers, (retry_at, next(self._seq), batch))

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` must next be called, or ``None``."""
        return self._timers[0][0] if self._timers else None

    def handle_timer(self, now: float) -> bool:
        """Resume suspended batches due at ``now``; returns whether any became ready."""
        timers = self._timers
        resumed = False
        while timers and timers[0][0] <= now:
            _, _, batch = heapq.heappop(timers)
            pq = batch.process_queue
            if pq.resume(batch):
                self._mark_ready(pq)
                resumed = True
        return resumed

    def suspended_count(self) -> int:
        return len(self._timers)
