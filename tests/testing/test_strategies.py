"""The workload strategies draw what they promise and compose with users' own."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagedconsumer import StageDefinition
from stagedconsumer.testing import (
    FailureKind,
    FailureSchedule,
    MessageSpec,
    failure_schedules,
    handler_costs,
    messages,
    stage_definitions,
)


@given(messages(topic="orders", queues=3, max_size=10))
def test_messages_land_on_the_topic_s_queues(specs: list[MessageSpec]) -> None:
    assert len(specs) <= 10
    for spec in specs:
        assert spec.topic == "orders"
        assert spec.queue_id is not None
        assert 0 <= spec.queue_id < 3
        assert spec.keys == ()
        assert spec.tags is None
        assert isinstance(spec.body, bytes)


@given(
    messages(
        queues=st.integers(1, 4),
        keys=st.sampled_from(["a", "b"]).map(lambda k: (k,)),
        bodies=st.just(b"x"),
        tags=st.sampled_from(["t1", None]),
        min_size=1,
    )
)
def test_messages_take_the_user_s_strategies(specs: list[MessageSpec]) -> None:
    assert specs
    assert {s.keys for s in specs} <= {("a",), ("b",)}
    assert {s.body for s in specs} == {b"x"}
    assert {s.tags for s in specs} <= {"t1", None}
    assert max(s.queue_id or 0 for s in specs) < 4


def test_messages_need_a_queue() -> None:
    with pytest.raises(ValueError, match="queues must be >= 1"):
        messages(queues=0)


@given(stage_definitions(max_stages=3, max_size=4))
def test_stage_definitions_are_valid(sizes: list[int]) -> None:
    StageDefinition.of(sizes)  # raises on a bad definition
    assert all(isinstance(s, int) and s >= 1 for s in sizes)
    if sizes and set(sizes) != {1}:
        assert len(sizes) <= 3
        assert max(sizes) <= 4


@given(failure_schedules(5, max_attempt=2, max_failures=3, kinds=[FailureKind.RETURN]))
def test_failure_schedules_stay_in_their_bounds(schedule: FailureSchedule) -> None:
    assert len(schedule) <= 3
    for (index, attempt), kind in schedule.failures.items():
        assert 0 <= index < 5
        assert 1 <= attempt <= 2
        assert kind is FailureKind.RETURN
        assert schedule.kind(index, attempt) is kind
    assert schedule.kind(99, 1) is None


@given(failure_schedules(0))
def test_no_messages_no_failures(schedule: FailureSchedule) -> None:
    assert schedule == FailureSchedule()


@given(handler_costs(max_cost=3), handler_costs(max_cost=0.5, integers=False))
def test_handler_costs(whole: tuple[float, ...], fractional: tuple[float, ...]) -> None:
    assert whole
    assert all(c in (0.0, 1.0, 2.0, 3.0) for c in whole)
    assert all(0.0 <= c <= 0.5 for c in fractional)
