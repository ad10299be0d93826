"""The checkers on hand-written logs: each rule found, explained, and silent on a good log."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from stagedconsumer import (
    ConsumeOrderlyContext,
    ConsumeStagedConcurrentlyContext,
    Message,
    MessageListenerStagedConcurrently,
    MessageQueue,
)
from stagedconsumer.testing import (
    CallLog,
    HandlerCall,
    OrderingViolation,
    Outcome,
    StagePlan,
    assert_at_least_once,
    assert_key_order,
    assert_orderly,
    assert_staged,
    check_at_least_once,
    check_key_order,
    check_orderly,
    check_staged,
)

MQ = MessageQueue("t", 0)


def msg(offset: int, *, key: str | None = None, attempt: int = 1) -> Message:
    return Message(
        topic="t",
        queue_id=0,
        queue_offset=offset,
        body=b"",
        keys=(key,) if key else (),
        msg_id=f"id{offset}",
        reconsume_times=attempt - 1,
    )


class Log:
    """Writes calls into a CallLog by hand: ``start`` then ``end``, in event order."""

    def __init__(self) -> None:
        self.log = CallLog()

    def start(
        self, offsets: Sequence[int], stage: int | None = None, attempt: int = 1, **kw: str
    ) -> HandlerCall:
        context: object
        if stage is None:
            context = ConsumeOrderlyContext(message_queue=MQ)
        else:
            context = ConsumeStagedConcurrentlyContext(
                message_queue=MQ, stage_index=stage, strategy_id="default", group_id=None
            )
        key = kw.get("key")
        return self.log.start_call(
            [msg(o, key=key, attempt=attempt) for o in offsets], context, 0.0
        )

    def end(self, call: HandlerCall, outcome: Outcome = Outcome.SUCCESS) -> None:
        self.log.end_call(call, 1.0, outcome, acked=len(call.messages))

    def run(
        self,
        offsets: Sequence[int],
        stage: int | None = None,
        *,
        outcome: Outcome = Outcome.SUCCESS,
        attempt: int = 1,
        **kw: str,
    ) -> None:
        call = self.start(offsets, stage, attempt, **kw)
        self.end(call, outcome)


class TwoStages(MessageListenerStagedConcurrently):
    def get_stage_definitions(self) -> Sequence[int]:
        return [2, 1]

    def consume_message(self, msgs: Sequence[Message], context: object) -> None:
        return None


SENT = [msg(o) for o in range(4)]
PLAN = StagePlan.of(TwoStages(), SENT)


def test_the_plan_follows_the_definitions() -> None:
    assert [PLAN.stage_of(m) for m in SENT] == [0, 0, 1, -1]
    epochs = [PLAN.assignments[m.msg_id].epoch for m in SENT]
    assert epochs[0] == epochs[1] < epochs[2] < epochs[3]


def test_the_plan_refuses_a_strategy_id_the_definitions_lack() -> None:
    """The consumer stops a queue at such a message, so no plan of a run exists."""
    plan = StagePlan.from_definitions(
        {"a": [1]}, SENT, lambda m: None if m.queue_offset == 0 else "a"
    )
    assert [plan.assignments[m.msg_id].key is None for m in SENT] == [True] + [False] * 3
    with pytest.raises(
        ValueError,
        match=r"gives 'b' for t:0@2, which is not a strategy of"
        r" the definitions \('a'\) nor None",
    ):
        StagePlan.from_definitions({"a": [1]}, SENT, lambda m: "b" if m.queue_offset == 2 else "a")


def test_a_staged_log_that_keeps_the_barrier_passes() -> None:
    w = Log()
    a, b = w.start([0], 0), w.start([1], 0)
    w.end(b)
    w.end(a)
    w.run([2], 1)
    w.run([3], -1)
    assert check_staged(w.log, PLAN) == []
    assert_staged(w.log, PLAN)
    assert check_at_least_once(w.log, SENT, exactly_once=True) == []


def test_a_replayed_success_finishes_every_message_of_its_call_by_default() -> None:
    """Replaying a log through start_call / end_call as the README says: a success
    without ``acked`` finished all its messages, so nothing is lost and the barrier
    holds."""
    log = CallLog()

    def context(stage: int) -> ConsumeStagedConcurrentlyContext:
        return ConsumeStagedConcurrentlyContext(
            message_queue=MQ, stage_index=stage, strategy_id="default", group_id=None
        )

    first = log.start_call(SENT[:2], context(0), 0.0)  # a batch of two
    log.end_call(first, 1.0, Outcome.SUCCESS)
    assert first.finished_messages == tuple(SENT[:2])
    for offset, stage in ((2, 1), (3, -1)):
        call = log.start_call([SENT[offset]], context(stage), float(offset))
        log.end_call(call, offset + 0.5, Outcome.SUCCESS)
    assert check_at_least_once(log, SENT, exactly_once=True) == []
    assert check_staged(log, PLAN) == []


def test_end_call_keeps_partial_acks_and_refuses_impossible_ones() -> None:
    log = CallLog()
    context = ConsumeOrderlyContext(message_queue=MQ)
    partial = log.start_call(SENT[:3], context, 0.0)
    log.end_call(partial, 1.0, Outcome.SUCCESS, acked=1)  # a concurrent ack_index of 0
    assert partial.finished_messages == (SENT[0],)
    none = log.start_call(SENT[:1], context, 1.0)
    log.end_call(none, 2.0, Outcome.SUCCESS, acked=0)
    assert none.finished_messages == ()
    failed = log.start_call(SENT[:1], context, 2.0)
    log.end_call(failed, 3.0, Outcome.RAISED)
    assert failed.acked == 0
    too_many = log.start_call(SENT[:1], context, 3.0)
    with pytest.raises(ValueError, match=r"acked=2: a call of 1 message\(s\) finishes 0 to 1"):
        log.end_call(too_many, 4.0, Outcome.SUCCESS, acked=2)


def test_a_stage_starting_before_the_previous_finished_is_a_barrier_violation() -> None:
    w = Log()
    a = w.start([0], 0)
    w.run([1], 0)
    later = w.start([2], 1)  # offset 0 still running
    w.end(a)
    w.end(later)
    w.run([3], -1)
    (violation,) = check_staged(w.log, PLAN)
    assert violation.rule == "barrier"
    assert "stage 1 of queue t:0" in violation.explanation
    assert "before t:0@0 of stage 0 finished" in violation.explanation
    assert violation.calls[0] is later
    with pytest.raises(OrderingViolation, match=r"1 violation\(s\) of staged order") as info:
        assert_staged(w.log, PLAN)
    assert info.value.violations == (violation,)
    assert "call #2" in str(info.value)


def test_a_failed_call_does_not_finish_its_message() -> None:
    w = Log()
    w.run([0], 0, outcome=Outcome.RAISED)
    w.run([1], 0)
    w.run([2], 1)  # offset 0 failed and was not retried yet
    w.run([0], 0, attempt=2)
    w.run([3], -1)
    rules = [v.rule for v in check_staged(w.log, PLAN)]
    assert rules == ["barrier"]


def test_a_message_in_the_wrong_stage_and_a_mixed_batch() -> None:
    w = Log()
    w.run([0, 1], 0)
    w.run([2, 3], 1)  # 3 belongs to the tail
    rules = sorted(v.rule for v in check_staged(w.log, PLAN))
    assert rules == ["mixed-batch", "wrong-stage"]


def test_a_dead_letter_counts_as_finished() -> None:
    w = Log()
    w.run([0], 0, outcome=Outcome.RAISED)
    w.log.record_dead_letter(SENT[0])
    w.run([1], 0)
    w.run([2], 1)
    w.run([3], -1)
    assert check_staged(w.log, PLAN) == []
    assert check_at_least_once(w.log, SENT, exactly_once=True) == []


def test_orderly_overlap_and_going_back() -> None:
    good = Log()
    good.run([0, 1])
    good.run([2], outcome=Outcome.RETURNED_FAILURE)
    good.run([2], attempt=2)
    good.run([3])
    assert check_orderly(good.log) == []
    assert_orderly(good.log)

    overlap = Log()
    a = overlap.start([0])
    b = overlap.start([1])
    overlap.end(a)
    overlap.end(b)
    (violation,) = check_orderly(overlap.log)
    assert violation.rule == "overlap"
    assert "call #1 on [1] started" in violation.explanation
    assert "call #0 on [0] was still running" in violation.explanation

    back = Log()
    back.run([1])
    back.run([0])
    assert [v.rule for v in check_orderly(back.log)] == ["offset-order"]
    with pytest.raises(OrderingViolation, match="orderly consumption"):
        assert_orderly(back.log)

    unsorted = Log()
    unsorted.run([1, 0])
    assert [v.rule for v in check_orderly(unsorted.log)] == ["batch-order"]
    # only calls starting below ``upto`` are held to it
    assert check_orderly(back.log, upto=1) == []

    wider = Log()
    wider.run([0], outcome=Outcome.RAISED)
    wider.run([0, 1], attempt=2)
    assert [v.rule for v in check_orderly(wider.log)] == ["retry-batch"]


def test_key_order_holds_per_key() -> None:
    w = Log()
    a = w.start([0], key="x")
    w.run([1], key="y")  # another key may run meanwhile
    w.end(a)
    w.run([2], key="x")
    assert check_key_order(w.log) == []
    assert_key_order(w.log)

    bad = Log()
    a = bad.start([0], key="x")
    bad.run([2], key="x")
    bad.end(a)
    (violation,) = check_key_order(bad.log)
    assert violation.rule == "overlap"
    assert "key 'x' of queue t:0" in violation.explanation
    with pytest.raises(OrderingViolation, match="key order"):
        assert_key_order(bad.log)
    # a key function that puts everything under one key sees the same overlap
    assert [v.rule for v in check_key_order(bad.log, key=lambda m: "all")] == ["overlap"]


def test_lost_unknown_and_duplicate_messages() -> None:
    w = Log()
    w.run([0])
    w.run([1], outcome=Outcome.RAISED)
    w.run([0], attempt=2)
    w.run([9])
    violations = check_at_least_once(w.log, SENT[:3])
    assert sorted(v.rule for v in violations) == ["lost", "lost", "unknown-message"]
    lost = sorted(v.explanation for v in violations if v.rule == "lost")
    assert lost == [
        "t:0@1 never finished: its 1 call(s) all failed or were cancelled",
        "t:0@2 never finished: it was never delivered",
    ]
    strict = {v.rule for v in check_at_least_once(w.log, SENT[:1], exactly_once=True)}
    assert strict == {"duplicate", "after-finish", "unknown-message"}
    with pytest.raises(OrderingViolation, match="exactly-once"):
        assert_at_least_once(w.log, SENT[:1], exactly_once=True)
    with pytest.raises(OrderingViolation, match="at-least-once"):
        assert_at_least_once(w.log, SENT[:3])


def test_attempt_numbers_must_count_up() -> None:
    w = Log()
    w.run([0], attempt=2)
    (violation,) = check_at_least_once(w.log, SENT[:1], exactly_once=True)
    assert violation.rule == "attempts"
    assert "attempts numbered [2]" in violation.explanation


def test_assert_lists_at_most_ten_violations() -> None:
    w = Log()
    for o in range(12):
        w.run([o])
    with pytest.raises(OrderingViolation) as info:
        assert_at_least_once(w.log, [])
    assert len(info.value.violations) == 12
    assert str(info.value).endswith("... and 2 more")


def test_a_stage_key_the_callbacks_do_not_give_again_is_reported() -> None:
    log = CallLog()
    context = ConsumeStagedConcurrentlyContext(
        message_queue=MQ, stage_index=0, strategy_id="default", group_id="other"
    )
    call = log.start_call([SENT[0]], context, 0.0)
    log.end_call(call, 1.0, Outcome.SUCCESS, acked=1)
    (violation,) = check_staged(log, PLAN)
    assert violation.rule == "wrong-key"
    assert violation.explanation.startswith(
        "call #0 ran t:0@0 as strategy 'default', group 'other', but compute_strategy and"
        " compute_group now give strategy 'default', group None"
    )


def test_within_runs_a_restarted_run_must_keep_the_barrier_among_what_it_redelivers() -> None:
    """Run 0 finishes stage 0 and dies before committing; run 1 gets offsets 0 and 1
    again. Starting stage 1 in run 1 before its own redelivery of offset 1 finished
    keeps the barrier across runs (the first finish was in run 0) but not within run 1."""
    w = Log()
    w.run([0], 0)
    w.run([1], 0)
    w.log.run = 1  # the restart
    w.run([0], 0)
    again = w.start([1], 0)
    early = w.start([2], 1)  # run 1's offset 1 is still running
    w.end(again)
    w.end(early)
    w.run([3], -1)
    assert check_staged(w.log, PLAN) == []
    (violation,) = check_staged(w.log, PLAN, within_runs=True)
    assert violation.rule == "run-barrier"
    assert violation.calls == (early,)
    assert "run 1: stage 1 of queue t:0" in violation.explanation
    assert "before t:0@1 of stage 0, which that run consumed again" in violation.explanation
    with pytest.raises(OrderingViolation, match=r"\[run-barrier\]"):
        assert_staged(w.log, PLAN, within_runs=True)


def test_within_runs_a_message_the_run_did_not_consume_again_does_not_hold_it_up() -> None:
    w = Log()
    w.run([0], 0)
    w.run([1], 0)
    w.log.run = 1  # restarted from a commit past offset 1: only 2 and 3 come again
    w.run([2], 1)
    w.run([3], -1)
    assert check_staged(w.log, PLAN, within_runs=True) == []
