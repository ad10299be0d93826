"""QueueOwnership: which queues a consumer-group member owns, and how far (sans-I/O).

A member of a consumer group consumes a queue only while it holds the queue's lock
(see :mod:`stagedconsumer._rebalance`). Every lock acquisition has an *epoch*; the
member claims the queue's offset-store row with it and commits progress with it as
a fencing token, so a member that lost its lock cannot overwrite the next owner's
progress. :class:`QueueOwnership` keeps, per queue, where that life cycle stands,
and turns every event (an allocation, a lock reply, a finished takeover, a refused
commit, the clock passing a lease, a finished release) into a decision for the
shell. Nothing here awaits, reads a clock or logs: times are passed in.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Final

import attrs

from .._message import MessageQueue

__all__ = (
    "LockOutcome",
    "LockPlan",
    "Lost",
    "OwnershipState",
    "QueueOwnership",
    "QueueOwnershipStatistics",
)


class OwnershipState(enum.Enum):
    """Where one queue stands in its owner's life cycle (see :class:`QueueOwnership`)."""

    ALLOCATED = "allocated"
    """Allocated to this member; its lock is not granted yet."""
    ACQUIRING = "acquiring"
    """Lock granted (epoch, lease deadline); the shell is claiming and loading it."""
    HELD = "held"
    """Consumed here under the lock (epoch, lease deadline)."""
    DRAINING = "draining"
    """Released gracefully: in-flight handlers finish, then a fenced commit, then
    unlock. Its lock is renewed until then."""
    LOST = "lost"
    """The lease ran out or a commit was fenced: released without commit."""


_ALLOCATED: Final = OwnershipState.ALLOCATED
_ACQUIRING: Final = OwnershipState.ACQUIRING
_HELD: Final = OwnershipState.HELD
_DRAINING: Final = OwnershipState.DRAINING
_LOST: Final = OwnershipState.LOST

_LEASED: Final = frozenset({_ACQUIRING, _HELD, _DRAINING})
"""States whose lock this member trusts: each has an epoch and a lease deadline."""
_FENCED: Final = frozenset({_HELD, _DRAINING})
"""States whose progress may be committed (with their epoch as the fence)."""
_RELEASING: Final = frozenset({_DRAINING, _LOST})
"""States whose release is under way in the shell, ended by ``released()``."""


def _sorted(queues: Collection[MessageQueue]) -> tuple[MessageQueue, ...]:
    return tuple(sorted(queues))


@attrs.frozen(kw_only=True)
class LockPlan:
    """What to do after an allocation round (:meth:`QueueOwnership.plan`)."""

    lock: tuple[MessageQueue, ...]
    """Request (or renew) these locks now, in one ``GroupCoordinator.lock`` call:
    every queue owned or wanted except the lost ones. Sorted."""
    release: tuple[MessageQueue, ...]
    """Start a graceful release of each (now DRAINING): no longer allocated here.
    Sorted."""


@attrs.frozen(kw_only=True)
class Lost:
    """Queues whose lock was just lost (they are LOST now)."""

    release: tuple[MessageQueue, ...] = ()
    """They were ACQUIRING or HELD: start releasing each now, without a commit
    (the release ends with :meth:`QueueOwnership.released`). Sorted."""
    abandoned: tuple[MessageQueue, ...] = ()
    """They were DRAINING: their release is already under way and must not commit
    any more (:meth:`QueueOwnership.fence` now returns ``None``); start nothing. Sorted."""

    def __bool__(self) -> bool:
        return bool(self.release or self.abandoned)

    @property
    def queues(self) -> tuple[MessageQueue, ...]:
        """Every queue just lost, sorted."""
        return _sorted((*self.release, *self.abandoned))


@attrs.frozen(kw_only=True)
class LockOutcome:
    """What to do after a lock reply (:meth:`QueueOwnership.locked`)."""

    take: tuple[tuple[MessageQueue, int], ...]
    """``(queue, epoch)`` of each newly granted queue (now ACQUIRING): claim the
    store row with the epoch, load progress, then call ``taken`` or
    ``take_failed``. Sorted."""
    lost: Lost
    """Locks that were not renewed (missing from the reply, or another epoch)."""
    pending: bool
    """A queue allocated here was not granted (another member still holds it, or
    the grant was refused as stale): try again sooner than the next round."""


@attrs.frozen(kw_only=True)
class QueueOwnershipStatistics:
    """A snapshot of one :class:`QueueOwnership`."""

    allocated: int
    acquiring: int
    held: int
    draining: int
    lost: int
    stale_grants: int
    """Grants refused so far because their epoch was below one already taken for
    the queue (a coordinator breaking its promise that epochs grow)."""
    queues: Mapping[MessageQueue, OwnershipState]
    """The state of every queue that has one (read-only)."""


@attrs.define(eq=False, slots=True)
class _Entry:
    state: OwnershipState
    epoch: int | None = None
    deadline: float | None = None


class QueueOwnership:
    """The ownership state machine of one consumer-group member's queues.

    **States.** A queue has exactly one state, or no entry at all (not owned):

    ============  =====================================  =======  ==========
    state         meaning                                epoch    deadline
    ============  =====================================  =======  ==========
    ALLOCATED     allocated here, lock not granted yet   --       --
    ACQUIRING     lock granted; claim + load under way   yes      yes
    HELD          consumed here under the lock           yes      yes
    DRAINING      graceful release; lock still renewed   yes      yes
    LOST          lease over or fenced; release, no      yes      --
                  commit
    ============  =====================================  =======  ==========

    The *deadline* is the end of the lease this member trusts its lock for: the
    time the last successful (re)lock request was **sent**, plus ``lease``
    (``GroupOptions.local_lock_ttl``, half the server's lock expiry). Replies
    with an older ``sent`` never shorten it.

    **Events** (one method each; each returns what the shell must do):

    - :meth:`plan` (each rebalance round, with the allocation): HELD queues no
      longer allocated here go DRAINING (``release``); newly allocated queues go
      ALLOCATED; ALLOCATED queues no longer allocated are forgotten. ACQUIRING
      queues stay as they are even when no longer allocated (the takeover is under
      way; once HELD, the next round drains them). DRAINING and LOST queues stay
      in their release even when allocated again: they become ALLOCATED only in
      the first round after :meth:`released`. ``lock`` lists every queue except
      LOST ones, so HELD, ACQUIRING and DRAINING leases are renewed.
    - :meth:`locked` (the reply to that plan's lock request): only the queues of
      the last plan's ``lock`` are judged, once. ALLOCATED + granted: ACQUIRING
      (``take``), unless the epoch is below one already taken for the queue (a
      stale grant: refused and counted); ALLOCATED not granted: stays, ``pending``.
      ACQUIRING/HELD/DRAINING with the same epoch: the deadline is extended;
      missing or another epoch: LOST (``lost.release`` for ACQUIRING and HELD,
      ``lost.abandoned`` for DRAINING, whose commit would be refused anyway).
    - :meth:`taken` (claim + load succeeded): ACQUIRING with that epoch -> HELD,
      ``True``: start consuming. ``False`` (nothing changes): the takeover is
      stale; abandon it *without* unlocking: the queue was reported lost (its
      release is under way or done) or handed back by :meth:`leave`.
    - :meth:`take_failed` (claim or load failed): ACQUIRING with that epoch is
      forgotten, ``True``: unlock it. ``False``: stale, do nothing.
    - :meth:`fenced` (a commit with these fences was refused): HELD/DRAINING
      with that very epoch -> LOST. A refusal of an older epoch is ignored.
    - :meth:`expired` (the timer): ACQUIRING/HELD/DRAINING whose deadline is at
      or before ``now`` -> LOST.
    - :meth:`released` (the shell's release finished): a DRAINING or LOST queue
      is forgotten.
    - :meth:`leave` (shutting down): returns the locks to hand back (ACQUIRING,
      HELD, DRAINING) and forgets everything.

    **How the shell drives it**::

        round:    p = own.plan(mine); start a release of each p.release
                  sent = now; granted = await coordinator.lock(p.lock)
                  o = own.locked(granted, sent, local_lock_ttl)
                  on_lost(o.lost); start a takeover of each o.take
                  sleep until min(next round (sooner if o.pending), own.get_timer())
        timer:    on_lost(own.expired(now))
        takeover: claim(epoch), load -> failed: if own.take_failed(mq, epoch): unlock
                  -> own.taken(mq, epoch): register and start pulling (no await
                  in between), else drop what was loaded
        release:  stop pulling, drain; fence = own.fence(mq); if fence is not None:
                  commit with it (refused: on_lost(own.fenced({mq: fence})));
                  if own.fence(mq) is not None: unlock; own.released(mq)
        commit:   f = own.fences(); persist_fenced(f) (refused: on_lost(
                  own.fenced({mq: f[mq] for mq in refused})))
        on_lost:  start a release (no commit) of each lost.release
        shutdown: ... final commit; unlock(own.leave()); coordinator.leave()

    Each queue's release is announced exactly once (in ``LockPlan.release`` or
    ``Lost.release``) and ends with exactly one :meth:`released`.

    **Invariants** (``tests/core/test_ownership_state_machine.py`` checks them
    after every step):

    1. Each queue has exactly one state; ALLOCATED has neither epoch nor deadline,
       LOST an epoch and no deadline, the others both.
    2. The epochs a queue is acquired with never decrease (a re-grant of the same
       epoch is allowed: the server-side lock outlived the local lease); a lower
       one is refused.
    3. After ``expired(now)`` no queue has a deadline at or before ``now``.
    4. Only ALLOCATED queues are returned in ``take``: never one already HELD, and
       never one whose release (DRAINING/LOST) is under way until ``released``.
    5. ``fences()`` is exactly the HELD and DRAINING queues with their epochs:
       never a LOST, ALLOCATED or ACQUIRING one.
    6. ``LockPlan.lock`` never includes a LOST queue.
    7. ``get_timer()`` is the earliest deadline (``None`` when there is none).
    """

    __slots__ = ("_entries", "_last_epoch", "_requested", "_stale_grants")

    def __init__(self) -> None:
        self._entries: dict[MessageQueue, _Entry] = {}
        self._last_epoch: dict[MessageQueue, int] = {}
        """The highest epoch each queue was ever acquired with (kept after release)."""
        self._requested: frozenset[MessageQueue] = frozenset()
        """The ``lock`` of the last plan, until its reply is applied."""
        self._stale_grants = 0

    # -- events ----------------------------------------------------------------------

    def plan(self, mine: Collection[MessageQueue]) -> LockPlan:
        """Apply an allocation round: ``mine`` are the queues allocated here."""
        wanted = set(mine)
        release: list[MessageQueue] = []
        for mq, entry in list(self._entries.items()):
            if mq in wanted:
                continue
            if entry.state is _HELD:
                entry.state = _DRAINING
                release.append(mq)
            elif entry.state is _ALLOCATED:
                del self._entries[mq]
        for mq in wanted:
            if mq not in self._entries:
                self._entries[mq] = _Entry(_ALLOCATED)
        lock = _sorted([mq for mq, entry in self._entries.items() if entry.state is not _LOST])
        self._requested = frozenset(lock)
        return LockPlan(lock=lock, release=_sorted(release))

    def locked(self, granted: Mapping[MessageQueue, int], sent: float, lease: float) -> LockOutcome:
        """Apply the reply to the last :meth:`plan`'s lock request.

        ``granted`` maps each queue whose lock this member holds after the call to
        its epoch; ``sent`` is when the request was sent; a renewed or new lock is
        trusted until ``sent + lease``. A second reply to the same plan, or a reply
        without a plan, changes nothing.
        """
        if not lease > 0:
            raise ValueError(f"lease must be positive, got {lease!r}")
        requested, self._requested = self._requested, frozenset()
        deadline = sent + lease
        take: list[tuple[MessageQueue, int]] = []
        release: list[MessageQueue] = []
        abandoned: list[MessageQueue] = []
        pending = False
        for mq in requested:
            entry = self._entries.get(mq)
            if entry is None or entry.state is _LOST:
                continue  # released, fenced or expired since the plan
            epoch = granted.get(mq)
            if entry.state is _ALLOCATED:
                if epoch is None:
                    pending = True
                elif epoch < self._last_epoch.get(mq, epoch):
                    self._stale_grants += 1
                    pending = True
                else:
                    entry.state, entry.epoch, entry.deadline = _ACQUIRING, epoch, deadline
                    self._last_epoch[mq] = epoch
                    take.append((mq, epoch))
            elif epoch is not None and epoch == entry.epoch:
                assert entry.deadline is not None
                entry.deadline = max(entry.deadline, deadline)
            else:
                (abandoned if entry.state is _DRAINING else release).append(mq)
                self._lose(entry)
        return LockOutcome(
            take=tuple(sorted(take)),
            lost=Lost(release=_sorted(release), abandoned=_sorted(abandoned)),
            pending=pending,
        )

    def taken(self, mq: MessageQueue, epoch: int) -> bool:
        """The takeover of ``mq`` with ``epoch`` claimed and loaded it.

        ``True``: it is HELD now; start consuming it. ``False`` (nothing changed):
        the takeover is stale; drop what was loaded and do not unlock.
        """
        entry = self._entries.get(mq)
        if entry is None or entry.state is not _ACQUIRING or entry.epoch != epoch:
            return False
        entry.state = _HELD
        return True

    def take_failed(self, mq: MessageQueue, epoch: int) -> bool:
        """The takeover of ``mq`` with ``epoch`` could not claim or load it.

        ``True``: it is forgotten; unlock it. ``False``: the takeover was stale
        (nothing changed); do not unlock.
        """
        entry = self._entries.get(mq)
        if entry is None or entry.state is not _ACQUIRING or entry.epoch != epoch:
            return False
        del self._entries[mq]
        return True

    def fenced(self, queues: Mapping[MessageQueue, int]) -> Lost:
        """Commits of these queues with these fences (epochs) were refused: a newer
        owner claimed them. Only a HELD or DRAINING queue still at that epoch is
        lost; anything else is an old refusal and changes nothing."""
        release: list[MessageQueue] = []
        abandoned: list[MessageQueue] = []
        for mq, epoch in queues.items():
            entry = self._entries.get(mq)
            if entry is None or entry.state not in _FENCED or entry.epoch != epoch:
                continue
            (abandoned if entry.state is _DRAINING else release).append(mq)
            self._lose(entry)
        return Lost(release=_sorted(release), abandoned=_sorted(abandoned))

    def expired(self, now: float) -> Lost:
        """Every lease whose deadline is at or before ``now`` is over: LOST."""
        release: list[MessageQueue] = []
        abandoned: list[MessageQueue] = []
        for mq, entry in self._entries.items():
            if entry.deadline is not None and entry.deadline <= now:
                (abandoned if entry.state is _DRAINING else release).append(mq)
                self._lose(entry)
        return Lost(release=_sorted(release), abandoned=_sorted(abandoned))

    def released(self, mq: MessageQueue) -> bool:
        """The shell finished releasing ``mq`` (drained, committed or not, unlocked
        or not): forget it. Returns ``False`` when ``mq`` has no entry (forgotten
        by :meth:`leave`); raises :exc:`ValueError` when it is not being released."""
        entry = self._entries.get(mq)
        if entry is None:
            return False
        if entry.state not in _RELEASING:
            raise ValueError(f"{mq} is {entry.state.value}, not being released")
        del self._entries[mq]
        return True

    def leave(self) -> list[MessageQueue]:
        """Leaving the group (after the final commit): forget every queue; returns
        the locks to hand back (ACQUIRING, HELD and DRAINING), sorted."""
        handed_back = sorted(mq for mq, entry in self._entries.items() if entry.state in _LEASED)
        self._entries.clear()
        self._requested = frozenset()
        return handed_back

    def _lose(self, entry: _Entry) -> None:
        entry.state = _LOST
        entry.deadline = None

    # -- queries ---------------------------------------------------------------------

    def get_timer(self) -> float | None:
        """The earliest lease deadline: call :meth:`expired` then (``None``: none)."""
        return min(
            (entry.deadline for entry in self._entries.values() if entry.deadline is not None),
            default=None,
        )

    def state(self, mq: MessageQueue) -> OwnershipState | None:
        entry = self._entries.get(mq)
        return None if entry is None else entry.state

    def epoch(self, mq: MessageQueue) -> int | None:
        """The epoch of ``mq``'s lock (ACQUIRING, HELD, DRAINING and LOST)."""
        entry = self._entries.get(mq)
        return None if entry is None else entry.epoch

    def deadline(self, mq: MessageQueue) -> float | None:
        """The end of ``mq``'s lease (ACQUIRING, HELD and DRAINING), else ``None``."""
        entry = self._entries.get(mq)
        return None if entry is None else entry.deadline

    def fence(self, mq: MessageQueue) -> int | None:
        """The token to commit ``mq`` with (HELD and DRAINING), else ``None``: no
        commit (and, at the end of a release, no unlock)."""
        entry = self._entries.get(mq)
        if entry is None or entry.state not in _FENCED:
            return None
        return entry.epoch

    def fences(self) -> dict[MessageQueue, int]:
        """The fence of every HELD and DRAINING queue: what a commit may write."""
        fences: dict[MessageQueue, int] = {}
        for mq, entry in self._entries.items():
            if entry.state in _FENCED:
                assert entry.epoch is not None
                fences[mq] = entry.epoch
        return fences

    def may_consume(self, mq: MessageQueue, now: float) -> bool:
        """Whether a batch of ``mq`` may be handed to a handler at ``now``: it is
        HELD and its lease has not passed (even if :meth:`expired` has not run)."""
        entry = self._entries.get(mq)
        return (
            entry is not None
            and entry.state is _HELD
            and entry.deadline is not None
            and now < entry.deadline
        )

    def held(self) -> list[MessageQueue]:
        """The HELD queues, sorted."""
        return sorted(mq for mq, entry in self._entries.items() if entry.state is _HELD)

    def releasing(self) -> list[MessageQueue]:
        """The queues whose release is under way (DRAINING and LOST), sorted."""
        return sorted(mq for mq, entry in self._entries.items() if entry.state in _RELEASING)

    def statistics(self) -> QueueOwnershipStatistics:
        counts = dict.fromkeys(OwnershipState, 0)
        for entry in self._entries.values():
            counts[entry.state] += 1
        return QueueOwnershipStatistics(
            allocated=counts[_ALLOCATED],
            acquiring=counts[_ACQUIRING],
            held=counts[_HELD],
            draining=counts[_DRAINING],
            lost=counts[_LOST],
            stale_grants=self._stale_grants,
            queues=MappingProxyType({mq: entry.state for mq, entry in self._entries.items()}),
        )
