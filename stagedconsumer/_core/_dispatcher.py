"""Dispatcher: picks the next batch across all process queues (sans-I/O).

Workers of the shell ask :meth:`Dispatcher.take` for a batch; when it returns
``None`` they wait until the shell is told (by ``READY`` in the
:data:`~._effects.Effects` of :meth:`put_messages`, :meth:`finish`,
:meth:`settle`, :meth:`untake` or :meth:`handle_timer`) that new work is ready. A
batch whose handler must not run after all (its queue's lease ended before the
handler started) goes back with :meth:`untake`. Suspended batches
and held stage assignments come back through :meth:`handle_timer`, driven by
:meth:`get_timer` (the aioquic pattern: the shell sleeps until the timer and calls
``handle_timer(now)``). Queues take turns round-robin, so one busy queue cannot
starve the others.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence

from .._message import Message
from ._effects import DRAINED, HELD, NOTHING, READY, TIMER, Effects
from ._process_queue import Batch, EraseStatus, ProcessQueue
from ._settlement import Settlement

__all__ = ("Dispatcher",)

_NEVER = float("-inf")


class Dispatcher:
    """Round-robin over process queues that have a batch ready.

    ``assignment_retry_delay`` (seconds) is how long a queue holds a message its
    stage callbacks failed on before assigning it again. ``record_times``: whether
    the ``now`` given to :meth:`put_messages` is also recorded as the messages'
    cached time (message trace and metrics need it; it costs a little per message).
    """

    __slots__ = ("_held", "_ready", "_seq", "_timers", "assignment_retry_delay", "record_times")

    def __init__(self, *, assignment_retry_delay: float = 1.0, record_times: bool = True) -> None:
        self._ready: deque[ProcessQueue] = deque()
        self._timers: list[tuple[float, int, Batch | ProcessQueue]] = []
        self._seq = itertools.count()
        self._held: list[ProcessQueue] = []
        self.assignment_retry_delay = assignment_retry_delay
        self.record_times = record_times

    def _mark_ready(self, pq: ProcessQueue) -> None:
        if not pq.in_ready and not pq.dropped:
            pq.in_ready = True
            self._ready.append(pq)

    def _schedule(self, at: float, item: Batch | ProcessQueue) -> Effects:
        timers = self._timers
        earlier = not timers or at < timers[0][0]
        heapq.heappush(timers, (at, next(self._seq), item))
        return TIMER if earlier else NOTHING

    def put_messages(
        self,
        pq: ProcessQueue,
        messages: Sequence[Message],
        *,
        highest_offset: int | None = None,
        now: float | None = None,
    ) -> Effects:
        """Cache messages in ``pq`` (see :meth:`ProcessQueue.put_messages`).

        ``now`` is recorded as the cached time when :attr:`record_times` is set. When
        a stage callback fails on a message (``HELD``), the queue holds it and the
        rest, :meth:`held_queues` reports the queue, and the assignment is retried
        ``assignment_retry_delay`` after ``now`` (``now`` is needed for that; without
        it the retry waits for the next timer)."""
        effects = pq.put_messages(
            messages, highest_offset=highest_offset, now=now if self.record_times else None
        )
        if effects & READY:
            self._mark_ready(pq)
        if effects & HELD:
            self._held.append(pq)
            if now is not None:
                effects |= self._schedule(now + self.assignment_retry_delay, pq)
        return effects

    def held_queues(self) -> list[ProcessQueue]:
        """The queues whose stage assignment failed (``HELD``) since the last call,
        once per failure; each has its :attr:`ProcessQueue.assignment_error`."""
        held, self._held = self._held, []
        return held

    def take(self, max_count: int, now: float = _NEVER) -> Batch | None:
        """The next batch of up to ``max_count`` messages that may run now, or ``None``.

        A queue that is paused, dropped, or whose lease ended
        (:attr:`ProcessQueue.open_until` at or before ``now``) gives no batch; pass
        ``now`` when queues have leases.
        """
        ready = self._ready
        while ready:
            pq = ready.popleft()
            if pq.open_until <= now:
                pq.in_ready = False
                continue
            batch = pq.try_take_messages(max_count)
            if batch is None:
                pq.in_ready = False
                continue
            if pq.ready_lanes or pq.ready_retries:
                ready.append(pq)
            else:
                pq.in_ready = False
            return batch
        return None

    def has_ready(self) -> bool:
        return bool(self._ready)

    def untake(self, batch: Batch) -> Effects:
        """Give back a taken ``batch`` whose handler was not called, as if it had never
        been taken (see :meth:`ProcessQueue.untake_messages`); its queue is first in
        line again."""
        pq = batch.process_queue
        effects = pq.untake_messages(batch)
        if effects & READY:
            ready = self._ready
            if pq.in_ready:
                ready.remove(pq)
            pq.in_ready = True
            ready.appendleft(pq)
        return effects

    def finish(self, batch: Batch, status: EraseStatus, now: float | None = None) -> Effects:
        """Finish every message of ``batch``."""
        pq = batch.process_queue
        effects = pq.erase_messages(batch, status, now)
        if effects & READY:
            self._mark_ready(pq)
        return effects

    def finish_some(
        self,
        batch: Batch,
        messages: Sequence[Message],
        status: EraseStatus,
        now: float | None = None,
    ) -> Effects:
        """Finish ``messages`` of ``batch``, keeping the rest pending."""
        pq = batch.process_queue
        effects = pq.erase_some(batch, messages, status, now)
        if effects & READY:
            self._mark_ready(pq)
        return effects

    def suspend(self, batch: Batch, retry_at: float) -> Effects:
        """Retry ``batch`` at ``retry_at`` (see :meth:`ProcessQueue.suspend_messages`)."""
        pq = batch.process_queue
        pq.suspend_messages(batch, retry_at)
        effects = self._schedule(retry_at, batch)
        if pq.dropped and not pq.in_handlers:
            effects |= DRAINED
        return effects

    def settle(self, batch: Batch, settlement: Settlement, now: float | None = None) -> Effects:
        """Apply the settlement of a failed ``batch`` in one call: finish its
        succeeded, retried and dead messages, suspend the rest until
        ``settlement.retry_at``."""
        if not settlement.suspended:
            return self.finish(batch, EraseStatus.SENT_BACK, now)
        effects = NOTHING
        finished = settlement.finished
        if finished:
            effects = self.finish_some(batch, finished, EraseStatus.SENT_BACK, now)
        return effects | self.suspend(batch, settlement.retry_at)

    def set_lease(self, pq: ProcessQueue, deadline: float) -> Effects:
        """Set when the lease under which ``pq`` is consumed ends (``READY`` when
        work of a queue whose lease had lapsed can be taken again)."""
        pq.set_lease(deadline)
        return self._reopened(pq)

    def pause(self, pq: ProcessQueue) -> None:
        """Hand out no more batches of ``pq`` until :meth:`unpause` (calls in handlers
        finish; suspended batches wait)."""
        pq.pause()

    def unpause(self, pq: ProcessQueue) -> Effects:
        """Undo :meth:`pause` (``READY`` when ``pq`` has a batch ready)."""
        pq.unpause()
        return self._reopened(pq)

    def _reopened(self, pq: ProcessQueue) -> Effects:
        if pq.in_ready or pq.open_until == float("-inf") or not pq.has_ready():
            return NOTHING
        self._mark_ready(pq)
        return READY

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` must next be called, or ``None``."""
        return self._timers[0][0] if self._timers else None

    def handle_timer(self, now: float) -> Effects:
        """Resume suspended batches and retry held assignments due at ``now``."""
        timers = self._timers
        effects = NOTHING
        while timers and timers[0][0] <= now:
            _, _, item = heapq.heappop(timers)
            if isinstance(item, Batch):
                pq = item.process_queue
                resumed = pq.resume(item)
            else:
                pq = item
                if pq.dropped:
                    continue
                resumed = pq.retry_assignment(now if self.record_times else None)
                if resumed & HELD:
                    self._held.append(pq)
                    resumed |= self._schedule(now + self.assignment_retry_delay, pq)
            if resumed & READY:
                self._mark_ready(pq)
            effects |= resumed
        return effects

    def suspended_count(self) -> int:
        return sum(1 for _, _, item in self._timers if isinstance(item, Batch))
