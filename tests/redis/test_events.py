"""The event-log check of the group tests (the kit's staged check on logs read back
from consumer processes) finds a broken barrier and a wrong stage, and passes a good log."""

from __future__ import annotations

import pytest

from stagedconsumer.testing import OrderingViolation

from ._events import Event, call_log, check_stages_and_barrier
from .group_worker import STAGES

FIRST = STAGES[0]


def _good_log(per_queue: int, pid: int = 1) -> list[Event]:
    """One message at a time per queue, in offset order, each ended before the next."""
    events = []
    for q in range(2):
        for o in range(per_queue):
            stage = 0 if o < FIRST else 1
            events.append(Event("S", q, o, stage, o * 1.0, pid))
            events.append(Event("E", q, o, stage, o * 1.0 + 0.5, pid))
    return events


def test_a_good_log_passes() -> None:
    check_stages_and_barrier(_good_log(FIRST + 5), queues=2, per_queue=FIRST + 5)


def test_a_stage_started_before_the_one_before_finished_is_reported() -> None:
    events = _good_log(FIRST + 5)
    # The first stage-1 message of queue 1 starts before the last stage-0 one ended.
    events = [
        Event(e.kind, e.queue, e.offset, e.stage, FIRST - 1 + 0.25, e.pid)
        if (e.kind, e.queue, e.offset) == ("S", 1, FIRST)
        else e
        for e in events
    ]
    with pytest.raises(OrderingViolation, match=r"\[barrier\].*t:1@"):
        check_stages_and_barrier(events, queues=2, per_queue=FIRST + 5)


def test_a_message_in_the_wrong_stage_is_reported() -> None:
    events = [
        Event(e.kind, e.queue, e.offset, 1, e.time, e.pid) if (e.queue, e.offset) == (0, 3) else e
        for e in _good_log(FIRST + 5)
    ]
    with pytest.raises(OrderingViolation, match=r"\[wrong-stage\] t:0@3 ran in stage 1"):
        check_stages_and_barrier(events, queues=2, per_queue=FIRST + 5)


def test_a_start_cut_by_a_kill_stays_running_and_a_later_delivery_finishes_it() -> None:
    events = _good_log(FIRST + 5, pid=2)
    killed = Event("S", 0, 0, 0, -1.0, 1)  # process 1 died in its call
    log = call_log([killed, *events])
    assert log.calls[0].run == 0
    assert not log.calls[0].ended
    assert {c.run for c in log.calls[1:]} == {1}
    check_stages_and_barrier([killed, *events], queues=2, per_queue=FIRST + 5)


def test_a_message_that_never_finished_blocks_the_next_stage() -> None:
    events = [e for e in _good_log(FIRST + 5) if (e.kind, e.queue, e.offset) != ("E", 0, 2)]
    with pytest.raises(OrderingViolation, match="never finished"):
        check_stages_and_barrier(events, queues=2, per_queue=FIRST + 5)
