"""A RuleBasedStateMachine drives QueueOwnership against a reference model.

The rules play every party of the protocol in any order: the allocation (``plan``
with any subset of four queues), a coordinator that may grant, refuse, renew with
the same epoch or answer with any other epoch (stale ones included) and may grant
queues nobody asked for, takeovers that finish (or fail) late, after their queue
was lost, released or re-acquired, a committer whose refusals arrive with old
fences, a clock that only moves forward, releases that finish, and leaving the
group. The model is a dict of ``(state, epoch, deadline)`` per queue; every
decision returned is compared with the model's, and after every step the machine
checks the invariants of :class:`~stagedconsumer._core.QueueOwnership`:

1. each queue is in exactly one state, with the epoch/deadline that state has;
2. the epochs a queue is acquired with never decrease (stale grants are refused);
3. after ``expired(now)`` no queue has a deadline at or before ``now``;
4. ``take`` only returns queues that were ALLOCATED: never one HELD, ACQUIRING,
   DRAINING or LOST (a queue in release comes back only after ``released``);
5. ``fences()`` is exactly HELD + DRAINING with their epochs;
6. ``plan().lock`` never includes a LOST queue;
7. ``get_timer()`` is the minimum deadline;
8. every release is announced exactly once (``LockPlan.release`` /
   ``Lost.release``) and the announced queues are exactly the DRAINING and LOST ones.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from stagedconsumer import MessageQueue
from stagedconsumer._core import Lost, OwnershipState, QueueOwnership

ALLOCATED = OwnershipState.ALLOCATED
ACQUIRING = OwnershipState.ACQUIRING
HELD = OwnershipState.HELD
DRAINING = OwnershipState.DRAINING
LOST = OwnershipState.LOST

QUEUES = [MessageQueue("t", i) for i in range(4)]
queues = st.sampled_from(QUEUES)
epochs = st.integers(1, 8)
# A coordinator's answer for one queue: mostly "the epoch it has" (a renewal, or the
# first grant), else not granted or any epoch at all (new, or stale).
answers: st.SearchStrategy[int | str | None] = st.one_of(*[st.just("same")] * 8, st.none(), epochs)


@attrs.define
class M:
    """The model of one queue's entry."""

    state: OwnershipState
    epoch: int | None = None
    deadline: float | None = None


Takeover = tuple[MessageQueue, int]


class OwnershipMachine(RuleBasedStateMachine):
    takeovers = Bundle[Takeover]("takeovers")
    """``(queue, epoch)`` of each takeover reported in ``LockOutcome.take``, unfinished."""
    snapshots = Bundle[dict[MessageQueue, int]]("snapshots")
    """``fences()`` as read by commits (which may come back refused much later)."""

    def __init__(self) -> None:
        super().__init__()
        self.own = QueueOwnership()
        self.now = 0.0
        self.model: dict[MessageQueue, M] = {}
        self.last_epoch: dict[MessageQueue, int] = {}
        self.stale_grants = 0
        self.requested: set[MessageQueue] | None = None
        self.announced: set[MessageQueue] = set()
        self.acquired: dict[MessageQueue, int] = {}  # highest epoch seen in `take`

    # -- model helpers ---------------------------------------------------------------

    def lose(
        self, mq: MessageQueue, release: list[MessageQueue], abandoned: list[MessageQueue]
    ) -> None:
        m = self.model[mq]
        (abandoned if m.state is DRAINING else release).append(mq)
        m.state, m.deadline = LOST, None

    def announce(self, released: tuple[MessageQueue, ...]) -> None:
        for mq in released:
            assert mq not in self.announced, f"the release of {mq} was announced twice"
            self.announced.add(mq)

    def check_lost(
        self, lost: Lost, release: list[MessageQueue], abandoned: list[MessageQueue]
    ) -> None:
        assert lost.release == tuple(sorted(release))
        assert lost.abandoned == tuple(sorted(abandoned))
        assert bool(lost) == bool(release or abandoned)
        assert lost.queues == tuple(sorted(release + abandoned))
        self.announce(lost.release)

    def do_plan(self, mine: set[MessageQueue]) -> None:
        release = []
        for mq, m in list(self.model.items()):
            if m.state is HELD and mq not in mine:
                m.state = DRAINING
                release.append(mq)
            elif m.state is ALLOCATED and mq not in mine:
                del self.model[mq]
        for mq in mine:
            self.model.setdefault(mq, M(ALLOCATED))
        lock = sorted(mq for mq, m in self.model.items() if m.state is not LOST)

        p = self.own.plan(mine)
        assert p.release == tuple(sorted(release))
        assert p.lock == tuple(lock)
        # invariant 6: a lost queue's lock is not asked for again before it is released
        assert all(self.own.state(mq) is not LOST for mq in p.lock)
        self.announce(p.release)
        self.requested = set(p.lock)

    def do_locked(self, answers: list[int | str | None], age: int, lease: int) -> list[Takeover]:
        granted: dict[MessageQueue, int] = {}
        for mq, answer in zip(QUEUES, answers, strict=True):
            if answer == "same":
                m = self.model.get(mq)
                epoch = m.epoch if m is not None and m.epoch is not None else None
                answer = epoch if epoch is not None else self.last_epoch.get(mq, 1)
            if isinstance(answer, int):
                granted[mq] = answer
        sent = self.now - age
        deadline = sent + lease

        take: list[Takeover] = []
        release: list[MessageQueue] = []
        abandoned: list[MessageQueue] = []
        pending = False
        for mq in sorted(self.requested or ()):
            m = self.model.get(mq)
            if m is None or m.state is LOST:
                continue
            epoch = granted.get(mq)
            if m.state is ALLOCATED:
                if epoch is None:
                    pending = True
                elif epoch < self.last_epoch.get(mq, 0):
                    self.stale_grants += 1
                    pending = True
                else:
                    m.state, m.epoch, m.deadline = ACQUIRING, epoch, deadline
                    self.last_epoch[mq] = epoch
                    take.append((mq, epoch))
            elif epoch == m.epoch:
                assert m.deadline is not None
                m.deadline = max(m.deadline, deadline)
            else:
                event(f"{m.state.value} lost on renewal")
                self.lose(mq, release, abandoned)
        self.requested = None

        before = dict(self.own.statistics().queues)
        outcome = self.own.locked(granted, sent, lease)
        assert outcome.take == tuple(take)
        assert outcome.pending == pending
        self.check_lost(outcome.lost, release, abandoned)
        for mq, epoch in outcome.take:
            # invariant 4: only ALLOCATED queues are taken (never HELD, never in release)
            assert before[mq] is ALLOCATED, f"{mq} taken while {before[mq]}"
            # invariant 2: acquisition epochs never decrease
            assert epoch >= self.acquired.get(mq, 0)
            self.acquired[mq] = epoch
        return take

    def finish(self, mq: MessageQueue, epoch: int, succeeded: bool) -> None:
        m = self.model.get(mq)
        current = m is not None and m.state is ACQUIRING and m.epoch == epoch
        if succeeded:
            assert self.own.taken(mq, epoch) == current
            if current:
                event("taken")
                self.model[mq].state = HELD
        else:
            assert self.own.take_failed(mq, epoch) == current
            if current:
                del self.model[mq]

    # -- rules -----------------------------------------------------------------------

    @rule(mine=st.sets(queues))
    def plan(self, mine: set[MessageQueue]) -> None:
        self.do_plan(mine)

    @rule(
        target=takeovers,
        answers=st.lists(answers, min_size=4, max_size=4),
        age=st.integers(0, 3),
        lease=st.integers(1, 10),
    )
    def locked(
        self, answers: list[int | str | None], age: int, lease: int
    ) -> MultipleResults[Takeover]:
        """A lock reply on its own: to the last plan, to one already applied, or to none."""
        return multiple(*self.do_locked(answers, age, lease))

    @rule(
        target=takeovers,
        mine=st.sets(queues),
        answers=st.lists(answers, min_size=4, max_size=4),
        age=st.integers(0, 3),
        lease=st.integers(1, 10),
        outcomes=st.lists(st.sampled_from(["taken", "taken", "later", "failed"]), max_size=4),
    )
    def rebalance_round(
        self,
        mine: set[MessageQueue],
        answers: list[int | str | None],
        age: int,
        lease: int,
        outcomes: list[str],
    ) -> MultipleResults[Takeover]:
        """What the shell does each round: plan, apply the lock reply, then run the
        takeovers (each succeeds or fails at once, or finishes in a later step)."""
        self.do_plan(mine)
        later = []
        for i, takeover in enumerate(self.do_locked(answers, age, lease)):
            outcome = outcomes[i] if i < len(outcomes) else "taken"
            if outcome == "later":
                later.append(takeover)
            else:
                self.finish(*takeover, outcome == "taken")
        return multiple(*later)

    @rule(takeover=consumes(takeovers), succeeded=st.booleans())
    def finish_takeover(self, takeover: Takeover, succeeded: bool) -> None:
        """A reported takeover ends (its queue may have been lost or left meanwhile)."""
        self.finish(*takeover, succeeded)

    @rule(mq=queues, epoch=epochs, succeeded=st.booleans())
    def stray_takeover(self, mq: MessageQueue, epoch: int, succeeded: bool) -> None:
        """``taken`` / ``take_failed`` for a takeover that was never reported."""
        self.finish(mq, epoch, succeeded)

    @rule(target=snapshots)
    def commit_snapshot(self) -> dict[MessageQueue, int]:
        """A commit reads the fences it will commit with."""
        return self.own.fences()

    @rule(snapshot=snapshots, data=st.data())
    def fenced(self, snapshot: dict[MessageQueue, int], data: st.DataObject) -> None:
        """Some of a commit's fences, read now or long ago, come back refused."""
        chosen = data.draw(st.sets(st.sampled_from(sorted(snapshot)))) if snapshot else set()
        self.do_fenced({mq: snapshot[mq] for mq in chosen})

    @rule(refused=st.dictionaries(queues, epochs, max_size=2))
    def stray_fenced(self, refused: dict[MessageQueue, int]) -> None:
        """Refusals with any fences at all (old epochs, queues never held)."""
        self.do_fenced(refused)

    def do_fenced(self, refused: dict[MessageQueue, int]) -> None:
        release: list[MessageQueue] = []
        abandoned: list[MessageQueue] = []
        for mq, epoch in refused.items():
            m = self.model.get(mq)
            if m is not None and m.state in (HELD, DRAINING) and m.epoch == epoch:
                event(f"{m.state.value} fenced")
                self.lose(mq, release, abandoned)
        self.check_lost(self.own.fenced(refused), release, abandoned)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def expire(self) -> None:
        release: list[MessageQueue] = []
        abandoned: list[MessageQueue] = []
        for mq, m in self.model.items():
            if m.deadline is not None and m.deadline <= self.now:
                event(f"{m.state.value} expired")
                self.lose(mq, release, abandoned)
        self.check_lost(self.own.expired(self.now), release, abandoned)
        # invariant 3: nothing is left with a lease that has passed
        for mq in QUEUES:
            deadline = self.own.deadline(mq)
            assert deadline is None or deadline > self.now
        timer = self.own.get_timer()
        assert timer is None or timer > self.now

    @rule(data=st.data(), stray=queues)
    def released(self, data: st.DataObject, stray: MessageQueue) -> None:
        """A release ends: one announced, or ``released`` called out of turn."""
        if self.announced and data.draw(st.integers(0, 3)) > 0:
            mq = data.draw(st.sampled_from(sorted(self.announced)))
        else:
            mq = stray
        m = self.model.get(mq)
        if m is None:
            assert self.own.released(mq) is False
        elif m.state in (DRAINING, LOST):
            assert self.own.released(mq) is True
            self.announced.remove(mq)
            del self.model[mq]
        else:
            with pytest.raises(ValueError, match="not being released"):
                self.own.released(mq)

    @rule(now=st.sampled_from([False, False, False, True]))
    def leave(self, now: bool) -> None:
        """Leaving the group (mostly skipped: it resets everything)."""
        if not now:
            return
        leased = (ACQUIRING, HELD, DRAINING)
        expected = sorted(mq for mq, m in self.model.items() if m.state in leased)
        assert self.own.leave() == expected
        self.model.clear()
        self.announced.clear()
        self.requested = None
        assert self.own.statistics().queues == {}
        assert self.own.get_timer() is None

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        own = self.own
        for mq in QUEUES:
            m = self.model.get(mq)
            assert own.state(mq) == (m.state if m else None)
            assert own.epoch(mq) == (m.epoch if m else None)
            assert own.deadline(mq) == (m.deadline if m else None)
        assert own.held() == sorted(mq for mq, m in self.model.items() if m.state is HELD)
        assert own.releasing() == sorted(
            mq for mq, m in self.model.items() if m.state in (DRAINING, LOST)
        )

    @invariant()
    def each_queue_has_exactly_one_state_with_its_fields(self) -> None:
        stats = self.own.statistics()
        assert dict(stats.queues) == {mq: m.state for mq, m in self.model.items()}
        counts = [stats.allocated, stats.acquiring, stats.held, stats.draining, stats.lost]
        assert sum(counts) == len(stats.queues)
        for state, count in zip(OwnershipState, counts, strict=True):
            assert count == sum(1 for s in stats.queues.values() if s is state)
        assert stats.stale_grants == self.stale_grants
        for mq, state in stats.queues.items():
            epoch, deadline = self.own.epoch(mq), self.own.deadline(mq)
            if state is ALLOCATED:
                assert (epoch, deadline) == (None, None)
            elif state is LOST:
                assert epoch is not None
                assert deadline is None
            else:
                assert epoch is not None
                assert deadline is not None

    @invariant()
    def fences_are_exactly_held_and_draining(self) -> None:
        fences = self.own.fences()
        assert fences == {
            mq: m.epoch for mq, m in self.model.items() if m.state in (HELD, DRAINING)
        }
        for mq in QUEUES:
            assert self.own.fence(mq) == fences.get(mq)
            if mq in fences:
                assert self.own.state(mq) in (HELD, DRAINING)

    @invariant()
    def timer_is_the_earliest_deadline(self) -> None:
        deadlines = [m.deadline for m in self.model.values() if m.deadline is not None]
        assert self.own.get_timer() == (min(deadlines) if deadlines else None)

    @invariant()
    def announced_releases_are_the_releasing_queues(self) -> None:
        assert self.announced == set(self.own.releasing())

    @invariant()
    def may_consume_only_held_within_the_lease(self) -> None:
        for mq in QUEUES:
            m = self.model.get(mq)
            expected = (
                m is not None
                and m.state is HELD
                and m.deadline is not None
                and self.now < m.deadline
            )
            assert self.own.may_consume(mq, self.now) == expected


OwnershipMachine.TestCase.settings = settings(
    max_examples=3 * settings().max_examples,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestOwnership = pytest.mark.slow(OwnershipMachine.TestCase)
