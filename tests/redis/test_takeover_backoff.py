"""TakeoverBackoff: the pure bookkeeping behind RedisCoordinator's held-back takeovers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stagedconsumer import MessageQueue
from stagedconsumer._core import TakeoverBackoff

MQ = MessageQueue("t", 0)
OTHER = MessageQueue("t", 1)


def test_delays_double_up_to_the_cap_and_a_takeover_that_held_resets_them() -> None:
    backoff = TakeoverBackoff(base=1.0, cap=5.0)
    assert backoff.may_try(MQ, 0.0)
    reports = [backoff.aborted(MQ, now) for now in (0.0, 1.0, 3.0, 7.0, 12.0)]
    assert reports == [False, False, True, False, False]  # reported once, the third
    assert backoff.retry_delay(MQ) == 5.0
    assert not backoff.may_try(MQ, 16.9)
    assert backoff.may_try(MQ, 17.0)
    assert backoff.may_try(OTHER, 0.0)  # per queue
    stats = backoff.statistics()
    assert stats.aborted == 5
    assert stats.backing_off == {MQ: 17.0}
    backoff.held(MQ)
    assert backoff.may_try(MQ, 0.0)
    assert backoff.retry_delay(MQ) == 0.0
    assert backoff.statistics().backing_off == {}
    assert not backoff.aborted(MQ, 20.0)  # counting starts over
    assert backoff.retry_delay(MQ) == 1.0


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=30))
def test_the_next_try_is_never_sooner_than_base_nor_later_than_cap(gaps: list[float]) -> None:
    backoff = TakeoverBackoff(base=0.5, cap=8.0)
    now = 0.0
    reports = 0
    for gap in gaps:
        now += gap
        reports += backoff.aborted(MQ, now)
        delay = backoff.retry_delay(MQ)
        assert 0.5 <= delay <= 8.0
        assert not backoff.may_try(MQ, now + delay * 0.999)
        assert backoff.may_try(MQ, now + delay)
    assert reports == (1 if len(gaps) >= 3 else 0)
