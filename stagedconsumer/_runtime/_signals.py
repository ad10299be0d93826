"""Wake-ups: idle workers, progress waiters, the dispatcher's timer, and the one place
where the :data:`~stagedconsumer._core.Effects` of core calls are applied."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import anyio

from .._core import (
    COMMITTED,
    DRAINED,
    HELD,
    READY,
    ROOM,
    TIMER,
    Dispatcher,
    Effects,
    ProcessQueue,
)
from ._state import ConsumerState

__all__ = ("ProgressWaiters", "Signals", "WorkSignal")

logger = logging.getLogger("stagedconsumer")

_NOBODY = 1 << 62
"""``ProcessQueue.notify_offset`` when nobody waits: an offset never reached."""


class WorkSignal:
    """Idle workers wait on their own event; work wakes one of them, and a worker that
    takes a batch while more is ready wakes the next (a cascade, not a herd)."""

    __slots__ = ("idle",)

    def __init__(self) -> None:
        self.idle: deque[anyio.Event] = deque()

    def wake_one(self) -> None:
        if self.idle:
            self.idle.popleft().set()

    def wake_all(self) -> None:
        idle, self.idle = self.idle, deque()
        for event in idle:
            event.set()

    async def wait(self) -> None:
        """Wait until woken (one wake-up; the caller looks for work again)."""
        event = anyio.Event()
        self.idle.append(event)
        try:
            await event.wait()
        finally:
            if not event.is_set():
                self.idle.remove(event)


class ProgressWaiters:
    """Tasks waiting for queues to commit up to an offset (``wait_caught_up``) or for
    a released queue to drain.

    Each waiter watches some process queues with a target offset (``-1``: any
    progress of that queue). The lowest target of a queue becomes its
    ``notify_offset``, so the core reports ``COMMITTED`` only when a waiter may be
    satisfied; that wakes every waiter once, and each re-checks its own condition.
    """

    __slots__ = ("_event", "_waiters", "_watched")

    def __init__(self) -> None:
        self._waiters: list[dict[ProcessQueue, int]] = []
        self._watched: dict[ProcessQueue, int] = {}
        self._event: anyio.Event | None = None

    def wake(self) -> None:
        event = self._event
        if event is not None:
            self._event = None
            event.set()

    def _rewatch(self) -> None:
        watched: dict[ProcessQueue, int] = {}
        for waiter in self._waiters:
            for pq, target in waiter.items():
                current = watched.get(pq)
                if current is None or target < current:
                    watched[pq] = target
        for pq in self._watched.keys() - watched.keys():
            pq.notify_offset = _NOBODY
        for pq, target in watched.items():
            pq.notify_offset = target
        self._watched = watched

    async def wait_for(self, targets: dict[ProcessQueue, int]) -> None:
        """Wait for one wake-up concerning ``targets`` (the caller re-checks)."""
        self._waiters.append(targets)
        self._rewatch()
        try:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        finally:
            self._waiters.remove(targets)
            self._rewatch()


class Signals:
    """Applies the effects of core calls: the one place where a batch that became
    ready wakes a worker, room in a queue resumes its pull, committed progress wakes
    waiters, an earlier timer re-arms the timer task, and a held stage assignment is
    logged and counted."""

    __slots__ = ("_timer_event", "dispatcher", "on_room", "state", "waiters", "work")

    def __init__(
        self,
        state: ConsumerState,
        dispatcher: Dispatcher,
        on_room: Callable[[ProcessQueue], None],
    ) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.work = WorkSignal()
        self.waiters = ProgressWaiters()
        self.on_room = on_room
        self._timer_event: anyio.Event | None = None

    def apply(self, pq: ProcessQueue | None, effects: Effects) -> None:
        """Act on ``effects`` of a core call about ``pq`` (``None``: several queues)."""
        if effects & READY:
            self.work.wake_one()
        if effects & (COMMITTED | DRAINED):
            self.waiters.wake()
        if effects & TIMER:
            event = self._timer_event
            if event is not None:
                self._timer_event = None
                event.set()
        if effects & ROOM and pq is not None:
            self.on_room(pq)
        if effects & HELD:
            self._report_held()

    def _report_held(self) -> None:
        delay = self.dispatcher.assignment_retry_delay
        for pq in self.dispatcher.held_queues():
            failure = pq.assignment_error
            if failure is None:
                continue
            self.state.assignment_errors += 1
            message = failure.message
            logger.error(
                "group %s: %s on message %s (%s offset %d); %s stops at it and tries"
                " again in %.1f s",
                self.state.group,
                failure.detail,
                message.msg_id,
                pq.message_queue,
                message.queue_offset,
                pq.message_queue,
                delay,
                exc_info=failure.exception,
            )

    async def wait_for(self, targets: dict[ProcessQueue, int]) -> None:
        """See :meth:`ProgressWaiters.wait_for`."""
        await self.waiters.wait_for(targets)

    async def run_timer(self) -> None:
        """Resume suspended batches and retry held assignments when they are due."""
        dispatcher = self.dispatcher
        while True:
            deadline = dispatcher.get_timer()
            event = self._timer_event = anyio.Event()
            if deadline is None:
                await event.wait()
            else:
                delay = deadline - anyio.current_time()
                if delay > 0:
                    with anyio.move_on_after(delay):
                        await event.wait()
            effects = dispatcher.handle_timer(anyio.current_time())
            if effects:
                self.apply(None, effects & ~TIMER)  # this loop reads the timer anyway
