"""Focused QueueOwnership cases: one per rule of its docstring, with exact values.

The state machine in ``test_ownership_state_machine.py`` checks the rules against a
model under any interleaving; these pin each rule in a readable scenario, including
the boundaries (a deadline equal to ``now``, a re-grant of the same epoch).
"""

from __future__ import annotations

import attrs
import pytest

from stagedconsumer import MessageQueue
from stagedconsumer._core import (
    LockOutcome,
    LockPlan,
    Lost,
    OwnershipState,
    QueueOwnership,
    QueueOwnershipStatistics,
)

Q0, Q1, Q2, Q3 = (MessageQueue("t", i) for i in range(4))
LEASE = 30.0


def hold(own: QueueOwnership, mq: MessageQueue, epoch: int, sent: float = 0.0) -> None:
    """Take ``mq`` through ALLOCATED -> ACQUIRING -> HELD (``mine`` = what is held + ``mq``)."""
    own.plan([*own.held(), mq])
    outcome = own.locked({**own.fences(), mq: epoch}, sent, LEASE)
    assert (mq, epoch) in outcome.take
    assert own.taken(mq, epoch)


def test_acquisition_allocated_acquiring_held() -> None:
    own = QueueOwnership()
    plan = own.plan([Q1, Q0])
    assert plan == LockPlan(lock=(Q0, Q1), release=())
    assert own.state(Q0) is OwnershipState.ALLOCATED
    assert own.epoch(Q0) is None
    assert own.deadline(Q0) is None
    assert own.get_timer() is None

    outcome = own.locked({Q0: 3, Q1: 5}, 10.0, LEASE)
    assert outcome == LockOutcome(take=((Q0, 3), (Q1, 5)), lost=Lost(), pending=False)
    assert own.state(Q0) is OwnershipState.ACQUIRING
    assert own.epoch(Q0) == 3
    assert own.deadline(Q0) == 40.0
    assert own.fences() == {}, "nothing may be committed before the claim"
    assert not own.may_consume(Q0, 11.0)

    assert own.taken(Q0, 3) is True
    assert own.state(Q0) is OwnershipState.HELD
    assert own.fences() == {Q0: 3}
    assert own.fence(Q0) == 3
    assert own.fence(Q1) is None
    assert own.held() == [Q0]
    assert own.get_timer() == 40.0
    assert own.may_consume(Q0, 39.9)
    assert not own.may_consume(Q0, 40.0), "the lease has passed at its deadline"


def test_not_granted_stays_allocated_and_is_pending() -> None:
    own = QueueOwnership()
    own.plan([Q0, Q1])
    outcome = own.locked({Q0: 1}, 0.0, LEASE)
    assert outcome.take == ((Q0, 1),)
    assert outcome.pending is True
    assert own.state(Q1) is OwnershipState.ALLOCATED
    assert own.plan([Q0, Q1]).lock == (Q0, Q1), "asked for again next round"
    assert own.locked({Q0: 1, Q1: 2}, 1.0, LEASE).pending is False


def test_renewal_extends_the_deadline_and_never_shortens_it() -> None:
    own = QueueOwnership()
    hold(own, Q0, 1, sent=0.0)
    own.plan([Q0])
    assert own.locked({Q0: 1}, 20.0, LEASE) == LockOutcome(take=(), lost=Lost(), pending=False)
    assert own.deadline(Q0) == 50.0
    own.plan([Q0])
    own.locked({Q0: 1}, 5.0, LEASE)  # an older request's reply
    assert own.deadline(Q0) == 50.0


def test_renewal_refused_or_with_another_epoch_loses_the_queue() -> None:
    own = QueueOwnership()
    hold(own, Q0, 1)
    hold(own, Q1, 1)
    own.plan([Q0, Q1])
    outcome = own.locked({Q1: 2}, 1.0, LEASE)  # Q0 missing, Q1 re-locked under a new epoch
    assert outcome.lost == Lost(release=(Q0, Q1), abandoned=())
    assert outcome.take == ()
    assert own.state(Q0) is OwnershipState.LOST
    assert own.epoch(Q1) == 1, "a lost queue keeps the epoch it was held with"
    assert own.deadline(Q0) is None
    assert own.fences() == {}
    assert own.releasing() == [Q0, Q1]
    assert own.get_timer() is None


def test_lost_queue_is_not_acquired_again_until_released() -> None:
    own = QueueOwnership()
    hold(own, Q0, 1)
    own.plan([Q0])
    own.locked({}, 1.0, LEASE)
    assert own.state(Q0) is OwnershipState.LOST
    plan = own.plan([Q0])
    assert plan == LockPlan(lock=(), release=())
    assert own.locked({Q0: 2}, 2.0, LEASE).take == ()
    assert own.state(Q0) is OwnershipState.LOST

    assert own.released(Q0) is True
    assert own.state(Q0) is None
    assert own.plan([Q0]).lock == (Q0,)
    assert own.locked({Q0: 2}, 3.0, LEASE).take == ((Q0, 2),)


def test_graceful_release_drains_with_its_lock_renewed() -> None:
    own = QueueOwnership()
    hold(own, Q0, 4)
    plan = own.plan([])
    assert plan == LockPlan(lock=(Q0,), release=(Q0,))
    assert own.state(Q0) is OwnershipState.DRAINING
    assert own.fences() == {Q0: 4}, "a draining queue still commits"
    assert not own.may_consume(Q0, 1.0), "no new batches while draining"
    assert own.plan([]) == LockPlan(lock=(Q0,), release=()), "announced once"
    own.locked({Q0: 4}, 10.0, LEASE)
    assert own.deadline(Q0) == 40.0
    assert own.released(Q0) is True
    assert own.statistics().queues == {}


def test_draining_queue_whose_renewal_fails_is_abandoned() -> None:
    own = QueueOwnership()
    hold(own, Q0, 4)
    own.plan([])
    outcome = own.locked({}, 1.0, LEASE)
    assert outcome.lost == Lost(release=(), abandoned=(Q0,))
    assert own.state(Q0) is OwnershipState.LOST
    assert own.fence(Q0) is None, "its commit would be refused anyway"


def test_draining_queue_allocated_again_finishes_its_release_first() -> None:
    own = QueueOwnership()
    hold(own, Q0, 1)
    own.plan([])
    assert own.plan([Q0]) == LockPlan(lock=(Q0,), release=())
    assert own.state(Q0) is OwnershipState.DRAINING
    own.locked({Q0: 1}, 1.0, LEASE)
    assert own.state(Q0) is OwnershipState.DRAINING
    own.released(Q0)
    own.plan([Q0])
    assert own.state(Q0) is OwnershipState.ALLOCATED


def test_allocated_queue_no_longer_mine_is_forgotten() -> None:
    own = QueueOwnership()
    own.plan([Q0, Q1])
    own.locked({}, 0.0, LEASE)
    assert own.plan([Q1]) == LockPlan(lock=(Q1,), release=())
    assert own.state(Q0) is None


def test_acquiring_queue_no_longer_mine_is_drained_once_held() -> None:
    own = QueueOwnership()
    own.plan([Q0])
    own.locked({Q0: 1}, 0.0, LEASE)
    assert own.plan([]) == LockPlan(lock=(Q0,), release=()), "its lease is renewed meanwhile"
    assert own.state(Q0) is OwnershipState.ACQUIRING
    own.locked({Q0: 1}, 5.0, LEASE)
    assert own.deadline(Q0) == 35.0
    assert own.taken(Q0, 1)
    assert own.plan([]).release == (Q0,)


def test_expired_loses_every_lease_at_or_before_now() -> None:
    own = QueueOwnership()
    hold(own, Q0, 1, sent=0.0)  # deadline 30
    hold(own, Q1, 1, sent=10.0)  # deadline 40; Q0 renewed to 40 too
    own.plan([Q0, Q1, Q2])
    own.locked({Q0: 1, Q1: 1, Q2: 7}, 0.0, 5.0)  # Q2 ACQUIRING, deadline 5
    own.plan([Q0])  # Q1 DRAINING
    assert own.get_timer() == 5.0
    assert own.expired(4.9) == Lost()
    assert own.expired(5.0) == Lost(release=(Q2,)), "a deadline equal to now has passed"
    assert own.taken(Q2, 7) is False, "the takeover finished too late"
    assert own.get_timer() == 40.0
    assert own.expired(40.0) == Lost(release=(Q0,), abandoned=(Q1,))
    assert own.get_timer() is None
    assert own.held() == []
    assert own.releasing() == [Q0, Q1, Q2]


def test_lost_reports_every_queue_sorted() -> None:
    lost = Lost(release=(Q2,), abandoned=(Q0, Q3))
    assert lost.queues == (Q0, Q2, Q3)
    assert lost
    assert not Lost()


def test_take_failed_forgets_only_the_current_takeover() -> None:
    own = QueueOwnership()
    own.plan([Q0])
    own.locked({Q0: 2}, 0.0, LEASE)
    assert own.take_failed(Q0, 1) is False, "another epoch: stale"
    assert own.state(Q0) is OwnershipState.ACQUIRING
    assert own.take_failed(Q0, 2) is True, "unlock it"
    assert own.state(Q0) is None
    assert own.take_failed(Q0, 2) is False


def test_stale_takeover_does_not_touch_a_newer_acquisition() -> None:
    own = QueueOwnership()
    own.plan([Q0])
    own.locked({Q0: 1}, 0.0, 5.0)
    own.expired(5.0)  # the takeover with epoch 1 is still loading
    own.released(Q0)
    own.plan([Q0])
    own.locked({Q0: 2}, 6.0, LEASE)
    assert own.taken(Q0, 1) is False
    assert own.take_failed(Q0, 1) is False
    assert own.state(Q0) is OwnershipState.ACQUIRING
    assert own.taken(Q0, 2) is True


def test_fenced_loses_held_and_draining_with_that_epoch_only() -> None:
    own = QueueOwnership()
    hold(own, Q0, 1)
    hold(own, Q1, 1)
    hold(own, Q2, 1)
    own.plan([Q0, Q2])  # Q1 drains
    fences = own.fences()
    assert fences == {Q0: 1, Q1: 1, Q2: 1}
    lost = own.fenced({Q0: 1, Q1: 1, Q2: 0, Q3: 9})
    assert lost == Lost(release=(Q0,), abandoned=(Q1,))
    assert own.state(Q2) is OwnershipState.HELD, "a refusal of an older epoch"
    assert own.fences() == {Q2: 1}
    assert own.fenced({Q0: 1}) == Lost(), "already lost"


def test_old_refusal_does_not_lose_the_queue_taken_again() -> None:
    own = QueueOwnership()
    hold(own, Q0, 1)
    committed = own.fences()  # a commit with these is in flight ...
    own.expired(100.0)
    own.released(Q0)
    hold(own, Q0, 2, sent=100.0)
    assert own.fenced(committed) == Lost()  # ... and refused late
    assert own.state(Q0) is OwnershipState.HELD


def test_stale_grant_is_refused_and_counted() -> None:
    own = QueueOwnership()
    hold(own, Q0, 5)
    own.fenced({Q0: 5})
    own.released(Q0)
    own.plan([Q0])
    outcome = own.locked({Q0: 4}, 1.0, LEASE)
    assert outcome.take == ()
    assert outcome.pending is True
    assert own.state(Q0) is OwnershipState.ALLOCATED
    assert own.statistics().stale_grants == 1
    own.plan([Q0])
    assert own.locked({Q0: 6}, 2.0, LEASE).take == ((Q0, 6),)


def test_same_epoch_may_be_granted_again_after_a_local_loss() -> None:
    # The local lease ran out, but the server-side lock did not: nobody else held it.
    own = QueueOwnership()
    hold(own, Q0, 5)
    own.expired(LEASE)
    own.released(Q0)
    own.plan([Q0])
    assert own.locked({Q0: 5}, 31.0, LEASE).take == ((Q0, 5),)
    assert own.statistics().stale_grants == 0


def test_lock_reply_applies_once_and_only_to_the_planned_request() -> None:
    own = QueueOwnership()
    assert own.locked({Q0: 1}, 0.0, LEASE) == LockOutcome(take=(), lost=Lost(), pending=False)
    assert own.state(Q0) is None, "a grant nobody asked for is ignored"
    hold(own, Q1, 1)
    own.plan([Q1])
    own.locked({Q1: 1}, 1.0, LEASE)
    assert own.locked({}, 2.0, LEASE).lost == Lost(), "a second reply to one plan changes nothing"
    assert own.state(Q1) is OwnershipState.HELD


def test_leave_hands_back_acquiring_held_and_draining() -> None:
    own = QueueOwnership()
    hold(own, Q0, 1)  # will drain
    hold(own, Q1, 1)
    hold(own, Q2, 1)  # will be lost
    own.plan([Q1, Q2, Q3])
    own.locked({Q1: 1, Q2: 1, Q3: 1, Q0: 1}, 0.0, LEASE)  # Q3 ACQUIRING
    own.fenced({Q2: 1})
    stats = own.statistics()
    assert (stats.acquiring, stats.held, stats.draining, stats.lost) == (1, 1, 1, 1)
    assert own.leave() == [Q0, Q1, Q3]
    assert own.statistics().queues == {}
    assert own.fences() == {}
    assert own.get_timer() is None
    assert own.taken(Q3, 1) is False, "the takeover still loading is abandoned"
    assert own.released(Q0) is False, "a release ending after leave() is a no-op"


def test_released_of_a_queue_not_being_released_is_an_error() -> None:
    own = QueueOwnership()
    hold(own, Q0, 1)
    with pytest.raises(ValueError, match="held, not being released"):
        own.released(Q0)
    assert own.state(Q0) is OwnershipState.HELD


def test_lease_must_be_positive() -> None:
    own = QueueOwnership()
    own.plan([Q0])
    with pytest.raises(ValueError, match="lease must be positive"):
        own.locked({Q0: 1}, 0.0, 0.0)


def test_statistics_is_a_read_only_snapshot() -> None:
    own = QueueOwnership()
    own.plan([Q0, Q1])
    own.locked({Q0: 1}, 0.0, LEASE)
    stats = own.statistics()
    assert stats == QueueOwnershipStatistics(
        allocated=1,
        acquiring=1,
        held=0,
        draining=0,
        lost=0,
        stale_grants=0,
        queues={Q0: OwnershipState.ACQUIRING, Q1: OwnershipState.ALLOCATED},
    )
    own.taken(Q0, 1)
    assert stats.queues[Q0] is OwnershipState.ACQUIRING, "a snapshot, not a view"
    with pytest.raises(TypeError):
        stats.queues[Q0] = OwnershipState.LOST  # type: ignore[index]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.held = 2  # type: ignore[misc]
