"""MemoryCoordinator: group membership and queue locks inside one process.

The embedded :class:`~stagedconsumer.MemoryBroker`'s answer to
:meth:`~stagedconsumer.MessageSource.group_coordinator`: several consumers of one
group on one broker share its queues (each queue consumed by one of them at a
time) instead of each consuming everything, with the same protocol as over Redis
(members with an expiry, queue locks with an expiry and an epoch as fencing token,
allocation by the group's strategy).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import anyio
import attrs
from anyio.lowlevel import RunVar

from .._message import MessageQueue
from ._group import GroupCoordinator, GroupOptions

__all__ = ("MemoryCoordinator", "MemoryCoordinatorStatistics")


@attrs.frozen(kw_only=True)
class MemoryCoordinatorStatistics:
    """A snapshot of a :class:`MemoryCoordinator` (on the calling event loop)."""

    members: Mapping[str, tuple[str, ...]]
    """Live members per group, sorted (gray members end with ``@gray[ratio]``)."""
    locks: Mapping[str, Mapping[MessageQueue, str]]
    """Per group, the owner of each live queue lock."""
    last_epoch: int
    """The last epoch handed out (epochs only grow)."""


@attrs.define(eq=False)
class _Lock:
    owner: str
    epoch: int
    expires: float


@attrs.define(eq=False)
class _LoopState:
    """Members and locks, kept per event loop: a loop that ended took its members
    with it, so a later loop (another ``anyio.run``) starts with none."""

    members: dict[str, dict[str, float]] = attrs.Factory(dict)
    locks: dict[tuple[str, MessageQueue], _Lock] = attrs.Factory(dict)
    changed: dict[str, anyio.Event] = attrs.Factory(dict)
    versions: dict[str, int] = attrs.Factory(dict)
    """Per group, a counter of changes (joins, leaves, unlocks)."""
    seen: dict[tuple[str, str], int] = attrs.Factory(dict)
    """Per (group, member), the change counter at its last heartbeat."""


class MemoryCoordinator(GroupCoordinator):
    """Group membership and queue locks in memory (see :class:`GroupCoordinator`).

    Ordering guarantee: at most one member holds a queue's lock at any moment; the
    epochs of a queue's successive holders strictly increase, across event loops and
    across broker instances in one process too (an epoch is at least the wall clock
    in ms, as over Redis), so an offset store kept from an earlier run never refuses
    a new holder's claim. Expiries run on the broker's clock (the event loop's, by
    default), so virtual-time tests see virtual expiries.

    Members that stop cleanly leave and hand their locks back at once, and the
    others are woken to rebalance (:meth:`wait_changed`); a member that stops
    without leaving (its task cancelled, its loop stuck) keeps its queues until its
    lock expires (``lock_ttl``) and is dropped after ``member_ttl``.
    """

    def __init__(self, options: GroupOptions, *, clock: Callable[[], float]) -> None:
        self._options = options
        self._clock = clock
        self._state_var: RunVar[_LoopState] = RunVar(f"stagedconsumer-groups-{id(self)}")
        self._last_epoch = 0

    @property
    def options(self) -> GroupOptions:
        return self._options

    def _state(self) -> _LoopState:
        try:
            return self._state_var.get()
        except LookupError:
            state = _LoopState()
            self._state_var.set(state)
            return state

    def _notify(self, state: _LoopState, group: str) -> None:
        state.versions[group] = state.versions.get(group, 0) + 1
        event = state.changed.pop(group, None)
        if event is not None:
            event.set()

    def _live(self, state: _LoopState, group: str, now: float) -> dict[str, float]:
        members = state.members.setdefault(group, {})
        expired = [m for m, until in members.items() if until <= now]
        for member in expired:
            del members[member]
        return members

    def _next_epoch(self) -> int:
        self._last_epoch = max(self._last_epoch + 1, time.time_ns() // 1_000_000)
        return self._last_epoch

    async def heartbeat(self, group: str, client_id: str) -> list[str]:
        state = self._state()
        now = self._clock()
        members = self._live(state, group, now)
        joined = client_id not in members
        members[client_id] = now + self._options.effective_member_ttl
        if joined:
            self._notify(state, group)
        state.seen[group, client_id] = state.versions.get(group, 0)
        await anyio.lowlevel.checkpoint()
        return sorted(members)

    async def members(self, group: str) -> list[str]:
        """The live members of ``group`` (without registering anyone)."""
        await anyio.lowlevel.checkpoint()
        return sorted(self._live(self._state(), group, self._clock()))

    async def leave(self, group: str, client_id: str) -> None:
        """Release every lock ``client_id`` still holds in ``group``, then leave it."""
        state = self._state()
        for key in [k for k, lock in state.locks.items() if k[0] == group]:
            if state.locks[key].owner == client_id:
                del state.locks[key]
        state.members.get(group, {}).pop(client_id, None)
        state.seen.pop((group, client_id), None)
        self._notify(state, group)
        await anyio.lowlevel.checkpoint()

    async def lock(
        self, group: str, client_id: str, queues: Sequence[MessageQueue]
    ) -> Mapping[MessageQueue, int]:
        state = self._state()
        now = self._clock()
        until = now + self._options.lock_ttl
        granted: dict[MessageQueue, int] = {}
        for mq in dict.fromkeys(queues):
            lock = state.locks.get((group, mq))
            if lock is not None and lock.expires > now:
                if lock.owner != client_id:
                    continue
                lock.expires = until  # renewed: same epoch
            else:
                lock = state.locks[group, mq] = _Lock(client_id, self._next_epoch(), until)
            granted[mq] = lock.epoch
        await anyio.lowlevel.checkpoint()
        return granted

    async def unlock(self, group: str, client_id: str, queues: Sequence[MessageQueue]) -> None:
        state = self._state()
        released = False
        for mq in queues:
            lock = state.locks.get((group, mq))
            if lock is not None and lock.owner == client_id:
                del state.locks[group, mq]
                released = True
        if released:
            self._notify(state, group)
        await anyio.lowlevel.checkpoint()

    async def wait_changed(self, group: str, client_id: str, timeout: float) -> None:
        """Sleep up to ``timeout``; a join, a leave or an unlock in ``group`` since
        ``client_id``'s last heartbeat ends it."""
        state = self._state()
        if state.versions.get(group, 0) != state.seen.get((group, client_id), 0):
            await anyio.lowlevel.checkpoint()
            return
        event = state.changed.get(group)
        if event is None:
            event = state.changed[group] = anyio.Event()
        with anyio.move_on_after(timeout):
            await event.wait()

    async def lock_owner(self, group: str, mq: MessageQueue) -> str | None:
        """Who holds the lock of ``mq`` now (for tools and tests)."""
        await anyio.lowlevel.checkpoint()
        lock = self._state().locks.get((group, mq))
        return lock.owner if lock is not None and lock.expires > self._clock() else None

    def statistics(self) -> MemoryCoordinatorStatistics:
        """Members and lock owners as of now (call it on the broker's event loop)."""
        state = self._state()
        now = self._clock()
        locks: dict[str, dict[MessageQueue, str]] = {}
        for (group, mq), lock in sorted(state.locks.items()):
            if lock.expires > now:
                locks.setdefault(group, {})[mq] = lock.owner
        return MemoryCoordinatorStatistics(
            members={
                group: tuple(sorted(m for m, until in members.items() if until > now))
                for group, members in state.members.items()
            },
            locks=locks,
            last_epoch=self._last_epoch,
        )
