"""run_virtual: the real consumer in virtual time, with failures, costs and crashes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from stagedconsumer import (
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    Message,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    Ordering,
)
from stagedconsumer.testing import (
    FailureKind,
    FailureSchedule,
    MessageSpec,
    OrderingViolation,
    Outcome,
    StagePlan,
    assert_at_least_once,
    assert_key_order,
    assert_orderly,
    assert_staged,
    check_staged,
    failure_schedules,
    handler_costs,
    messages,
    run_virtual,
    stage_definitions,
)


class Staged(MessageListenerStagedConcurrently):
    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = list(sizes)

    def get_stage_definitions(self) -> Sequence[int]:
        return self.sizes

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> ConsumeOrderlyStatus | None:  # a subclass below returns a status
        return None


class ByCampaign(Staged):
    def compute_group(self, msg: Message) -> str | None:
        return msg.keys[0] if msg.keys else None


class Orderly(MessageListenerOrderly):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        return None


class ByKey(Orderly):
    ordering = Ordering.BY_KEY


def one_queue(n: int) -> list[MessageSpec]:
    return [MessageSpec(topic="t", queue_id=0) for _ in range(n)]


def test_the_rip22_example_takes_six_units_staged_and_100_orderly() -> None:
    staged = run_virtual(Staged([10, 20, 70]), one_queue(100), costs=[1.0])
    assert staged.makespan == 6.0
    assert staged.completed
    assert staged.wall_ms_per_1000_messages == pytest.approx(staged.wall_seconds * 10_000)
    orderly = run_virtual(Orderly(), one_queue(100), costs=[1.0])
    assert orderly.makespan == 100.0


def test_scheduled_failures_fail_those_attempts_only() -> None:
    failures = FailureSchedule.of(
        {(1, 1): FailureKind.RAISE, (1, 2): FailureKind.RETURN, (2, 1): FailureKind.RETURN}
    )
    run = run_virtual(Staged([3]), one_queue(4), failures=failures, costs=[1.0])
    tries = {(c.messages[0].queue_offset, c.attempt): c.outcome for c in run.log.calls}
    assert tries == {
        (0, 1): Outcome.SUCCESS,
        (1, 1): Outcome.RAISED,
        (1, 2): Outcome.RETURNED_FAILURE,
        (1, 3): Outcome.SUCCESS,
        (2, 1): Outcome.RETURNED_FAILURE,
        (2, 2): Outcome.SUCCESS,
        (3, 1): Outcome.SUCCESS,
    }
    assert "InjectedFailure('scheduled failure of t:0@1 attempt 1')" in {
        c.error for c in run.log.calls
    }
    # the tail waits for stage 0: two retries of offset 1 after 1 s suspends, 1 s each
    tail = next(c for c in run.log.calls if c.messages[0].queue_offset == 3)
    assert tail.start == 5.0
    assert_staged(run.log, StagePlan.of(Staged([3]), run.sent))


def test_max_reconsume_times_sends_to_the_dlq_and_that_finishes_the_message() -> None:
    failures = FailureSchedule.of({(0, a): FailureKind.RAISE for a in (1, 2, 3)})
    options = ConsumerOptions(max_reconsume_times=1)
    run = run_virtual(Staged([1]), one_queue(2), failures=failures, options=options)
    assert run.completed
    assert [d.message.queue_offset for d in run.log.dead_letters] == [0]
    assert [c.attempt for c in run.log.calls if c.messages[0].queue_offset == 0] == [1, 2]
    assert_at_least_once(run.log, run.sent, exactly_once=True)
    assert_staged(run.log, StagePlan.of(Staged([1]), run.sent))


def test_a_crash_loses_unpersisted_progress_and_the_restart_redelivers() -> None:
    options = ConsumerOptions(persist_consumer_offset_interval=1000.0)
    run = run_virtual(Staged([2, 3]), one_queue(10), costs=[1.0], crash_at=[4], options=options)
    assert run.crashes == 1
    assert run.completed
    runs = {c.run for c in run.log.calls}
    assert runs == {0, 1}
    first = [c for c in run.log.calls if c.run == 0]
    # the crash comes right after the 4th call ended (t=2); the 5th ends at that
    # instant too, before any checkpoint
    assert [c.end for c in first if c.outcome is Outcome.SUCCESS] == [1, 1, 2, 2, 2]
    assert not any(c.outcome is Outcome.RUNNING for c in run.log.calls)
    # nothing was persisted before the crash (the interval is long): run 1 starts over
    second = sorted(c.messages[0].queue_offset for c in run.log.calls if c.run == 1)
    assert second == list(range(10))
    assert_at_least_once(run.log, run.sent)
    assert_staged(run.log, StagePlan.of(Staged([2, 3]), run.sent))
    with pytest.raises(AssertionError, match="duplicate"):
        assert_at_least_once(run.log, run.sent, exactly_once=True)


def test_after_a_crash_the_restart_resumes_from_persisted_progress() -> None:
    # commits at t = 0.7, 1.4, 2.1, ...: none at the instant of the crash (t = 2), where
    # the order of the calls ending and of a commit would be up to the scheduler
    options = ConsumerOptions(persist_consumer_offset_interval=0.7)
    run = run_virtual(Staged([2, 3]), one_queue(10), costs=[1.0], crash_at=[5], options=options)
    assert run.crashes == 1
    # offsets 0 and 1 finished at t=1 and were persisted at t=1.4; the crash at t=2
    # lost the rest: the restart begins at offset 2, still in stage 1
    second = [c for c in run.log.calls if c.run == 1]
    assert sorted(c.messages[0].queue_offset for c in second) == list(range(2, 10))
    assert {c.stage_index for c in second if c.messages[0].queue_offset < 5} == {1}
    assert_at_least_once(run.log, run.sent)
    assert_staged(run.log, StagePlan.of(Staged([2, 3]), run.sent))


def test_several_crash_points_and_one_past_the_end() -> None:
    run = run_virtual(Staged([1, 1]), one_queue(5), costs=[1.0], crash_at=[1, 2, 1000])
    assert run.crashes == 2
    assert run.completed
    assert max(c.run for c in run.log.calls) == 2


def test_a_message_failing_forever_stops_at_the_timeout() -> None:
    class Never(Staged):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
        ) -> ConsumeOrderlyStatus:
            return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT

    run = run_virtual(Never([1]), one_queue(2), timeout=30.0)
    assert not run.completed
    assert 25 <= len(run.log.calls) <= 32  # one attempt per second
    with pytest.raises(AssertionError, match="never finished"):
        assert_at_least_once(run.log, run.sent)


def test_topics_and_queues_come_from_the_messages() -> None:
    specs = [
        MessageSpec(topic="a", queue_id=2),
        MessageSpec(topic="b", queue_id=None, keys=("k",)),
    ]
    run = run_virtual(Orderly(), specs)
    assert run.broker.statistics().topics["a"] == 3
    assert {(m.topic, m.queue_id) for m in run.sent} == {("a", 2), ("b", 0)}
    run = run_virtual(Orderly(), specs, queues=4)
    assert run.broker.statistics().topics["b"] == 4
    with pytest.raises(ValueError, match="needs 3 queues"):
        run_virtual(Orderly(), specs, queues=2)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        run_virtual(Orderly(), specs, costs=[-1.0])


def race_listener(order: list[int]) -> Staged:
    class Racing(Staged):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
        ) -> None:
            await anyio.lowlevel.checkpoint()
            order.append(msgs[0].queue_offset)

    return Racing([])


def test_a_seed_fixes_the_interleaving() -> None:
    def order_for(seed: int) -> list[int]:
        order: list[int] = []
        run_virtual(race_listener(order), one_queue(12), seed=seed)
        return order

    assert order_for(1) == order_for(1)
    assert len({tuple(order_for(seed)) for seed in range(8)}) > 1


# -- properties of the real consumer, checked with the kit -----------------------------


@pytest.mark.slow
@given(
    messages(topic="t", queues=st.integers(1, 3), keys=st.sampled_from([("a",), ("b",), ()])),
    stage_definitions(),
    failure_schedules(),
    handler_costs(),
    st.lists(st.integers(1, 40), max_size=2),
    st.integers(1, 8),
    st.integers(1, 3),
)
def test_staged_order_holds_under_failures_and_crashes(
    specs: list[MessageSpec],
    sizes: list[int],
    failures: FailureSchedule,
    costs: tuple[float, ...],
    crash_at: list[int],
    workers: int,
    batch: int,
) -> None:
    listener = ByCampaign(sizes)
    options = ConsumerOptions(
        consume_thread_max=workers,
        consume_message_batch_max_size=batch,
        persist_consumer_offset_interval=2.0,
    )
    run = run_virtual(
        listener, specs, options=options, failures=failures, costs=costs, crash_at=crash_at
    )
    assert run.completed
    # the barrier across runs and, after each crash, among what the restart redelivers
    assert_staged(run.log, StagePlan.of(listener, run.sent), within_runs=True)
    assert_at_least_once(run.log, run.sent, exactly_once=not run.crashes)
    if sizes and set(sizes) == {1}:
        assert_orderly(run.log, upto=len(sizes)) if not any(m.keys for m in run.sent) else None


@pytest.mark.slow
@given(
    messages(topic="t", queues=st.integers(1, 3), keys=st.sampled_from([("a",), ("b",), ()])),
    failure_schedules(),
    handler_costs(),
    st.lists(st.integers(1, 40), max_size=1),
    st.booleans(),
)
def test_orderly_and_key_order_hold_under_failures_and_crashes(
    specs: list[MessageSpec],
    failures: FailureSchedule,
    costs: tuple[float, ...],
    crash_at: list[int],
    by_key: bool,
) -> None:
    listener = ByKey() if by_key else Orderly()
    options = ConsumerOptions(consume_thread_max=4, consume_message_batch_max_size=2)
    run = run_virtual(
        listener, specs, options=options, failures=failures, costs=costs, crash_at=crash_at
    )
    assert run.completed
    assert_at_least_once(run.log, run.sent, exactly_once=not run.crashes)
    if by_key:
        assert_key_order(run.log)
    else:
        assert_orderly(run.log)


@settings(max_examples=20)
@given(stage_definitions(max_size=4), st.integers(0, 30), st.integers(1, 6))
def test_the_kit_sees_a_consumer_that_ignored_the_barrier(
    sizes: list[int], count: int, workers: int
) -> None:
    """Checked against the plan of other stage definitions than the consumer used
    (``[]``: everything concurrent), the log shows wrong stages and, once two
    workers run a later stage's message beside a first-stage one, a broken barrier."""
    options = ConsumerOptions(consume_thread_max=workers)
    run = run_virtual(Staged([]), one_queue(count), costs=[1.0], options=options)
    rules = {v.rule for v in check_staged(run.log, StagePlan.of(Staged(sizes), run.sent))}
    if sizes and count:
        assert "wrong-stage" in rules
    if sizes and workers > 1 and count > sizes[0]:
        assert "barrier" in rules
    if not sizes:
        assert rules == set()


class ByKeyWithACounter(ByKey):
    """A planted bug: the ordering key of a message depends on a counter, so one
    business key is spread over two keys that the consumer runs side by side."""

    def __init__(self) -> None:
        self.counter = 0

    def compute_key(self, msg: Message) -> str | None:
        self.counter += 1
        return f"{msg.keys[0]}/{self.counter % 2}" if msg.keys else None


def key_order_property(make_listener: Callable[[], MessageListenerOrderly]) -> Callable[[], None]:
    """The property a user would write for a key-ordered listener, with hypothesis's
    default budget of 100 examples (no database: nothing replayed from an earlier run;
    generation only: finding the bug is the point here, not shrinking it)."""

    @settings(max_examples=100, deadline=None, database=None, phases=[Phase.generate])
    @given(
        messages(topic="t", queues=st.integers(1, 2), keys=st.sampled_from([("a",), ("b",)])),
        failure_schedules(),
        handler_costs(),
    )
    def key_order_holds(
        specs: list[MessageSpec], failures: FailureSchedule, costs: tuple[float, ...]
    ) -> None:
        run = run_virtual(make_listener(), specs, failures=failures, costs=costs)
        assert run.completed
        assert_key_order(run.log, key=lambda m: m.keys[0])

    return key_order_holds


def test_the_kit_finds_a_planted_key_order_bug_within_the_default_budget() -> None:
    # (the listener without the bug keeps key order: see the property above)
    with pytest.raises(OrderingViolation, match=r"violation\(s\) of key order") as info:
        key_order_property(ByKeyWithACounter)()
    assert {v.rule for v in info.value.violations} & {"overlap", "offset-order"}


class ChangingDefinitions(MessageListenerStagedConcurrently):
    """A planted bug: get_stage_definitions() gives [1, 1], then [3], then [1, 1]..."""

    def __init__(self) -> None:
        self.reads = 0

    def get_stage_definitions(self) -> Sequence[int]:
        self.reads += 1
        return [1, 1] if self.reads % 2 else [3]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        return None


def test_definitions_that_change_between_calls_are_named_in_the_violation() -> None:
    listener = ChangingDefinitions()
    run = run_virtual(listener, one_queue(2))  # the consumer reads [1, 1]
    assert run.log.stage_definitions == [(0, {"default": (1, 1)})]
    plan = StagePlan.of(listener, run.sent)  # the plan reads [3]
    assert plan.definitions == {"default": (3,)}
    (violation,) = check_staged(run.log, plan)
    assert violation.rule == "wrong-stage"
    assert violation.explanation == (
        "t:0@1 ran in stage 1 (call #1), but the stage definitions put it in stage 0:"
        " the stage definitions changed between calls (strategy 'default': [1, 1] when"
        " the consumer of run 0 read them, [3] when the plan did); they must be constant"
    )


def test_a_wrong_stage_without_recorded_definitions_says_they_must_be_constant() -> None:
    listener = ChangingDefinitions()
    run = run_virtual(listener, one_queue(2))
    run.log.stage_definitions.clear()  # a log replayed from elsewhere records none
    (violation,) = check_staged(run.log, StagePlan.of(listener, run.sent))
    assert violation.explanation.endswith(
        "put it in stage 0 (stage definitions must be constant: the consumer reads them"
        " when it is built, StagePlan.of reads them again)"
    )
