"""Stage arithmetic against the kit's naive model (``stagedconsumer.testing.stage_of``):
boundaries, stage index, leftover, validation."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagedconsumer import InvalidStageDefinitionError
from stagedconsumer._core import TAIL_STAGE, StageDefinition
from stagedconsumer.testing import stage_of

from ..strategies import invalid_stage_sizes, stage_sizes


def naive_leftover(sizes: list[int], offset: int) -> int:
    """How many messages of ``offset``'s stage are left from it on, counted by walking
    the offsets with the kit's naive stage model (``-1`` in the tail)."""
    index = stage_of(sizes, offset)
    if index == TAIL_STAGE:
        return -1
    return next(o for o in itertools.count(offset) if stage_of(sizes, o) != index) - offset


@given(stage_sizes(max_size=30))
def test_boundaries_are_cumulative_sums(sizes: list[int]) -> None:
    definition = StageDefinition.of(sizes)
    assert definition.sizes == tuple(sizes)
    assert len(definition.boundaries) == len(sizes)
    running = 0
    for size, boundary in zip(sizes, definition.boundaries, strict=True):
        running += size
        assert boundary == running
    assert definition.total == sum(sizes)


@given(stage_sizes(max_size=30), st.integers(0, 200))
def test_stage_index_and_leftover_match_naive_model(sizes: list[int], offset: int) -> None:
    definition = StageDefinition.of(sizes)
    index = stage_of(sizes, offset)
    assert definition.stage_index(offset) == index
    assert definition.leftover(offset) == naive_leftover(sizes, offset)
    leftover = definition.leftover(offset)
    if index != TAIL_STAGE:
        # the leftover messages are exactly the rest of this stage
        assert definition.stage_index(offset + leftover - 1) == index
        assert definition.stage_index(offset + leftover) != index
        assert definition.is_boundary(offset + leftover)


@given(stage_sizes(max_size=30), st.integers(0, 200))
def test_is_boundary_means_first_offset_of_a_stage(sizes: list[int], offset: int) -> None:
    definition = StageDefinition.of(sizes)
    starts = {0, *definition.boundaries}
    assert definition.is_boundary(offset) == (offset in starts)
    if offset > 0:
        changed = stage_of(sizes, offset - 1) != stage_of(sizes, offset)
        if changed:
            assert definition.is_boundary(offset)


@given(stage_sizes(max_size=30), st.integers(0, 200))
def test_stage_index_is_monotone_and_tail_last(sizes: list[int], offset: int) -> None:
    definition = StageDefinition.of(sizes)
    a, b = definition.stage_index(offset), definition.stage_index(offset + 1)
    if a == TAIL_STAGE:
        assert b == TAIL_STAGE
    elif b != TAIL_STAGE:
        assert a <= b <= a + 1
    assert (definition.stage_index(offset) == TAIL_STAGE) == (offset >= sum(sizes))


def test_empty_definition_is_all_tail() -> None:
    definition = StageDefinition.of([])
    assert definition.boundaries == ()
    assert definition.total == 0
    assert [definition.stage_index(o) for o in range(5)] == [TAIL_STAGE] * 5
    assert definition.leftover(0) == -1


@given(st.integers(1, 20), st.integers(0, 40))
def test_all_ones_gives_one_message_per_stage(n: int, offset: int) -> None:
    definition = StageDefinition.of([1] * n)
    if offset < n:
        assert definition.stage_index(offset) == offset
        assert definition.leftover(offset) == 1
    else:
        assert definition.stage_index(offset) == TAIL_STAGE


@given(stage_sizes(), st.integers(max_value=-1))
def test_negative_stage_offset_is_rejected(sizes: list[int], offset: int) -> None:
    with pytest.raises(ValueError, match="stage offset"):
        StageDefinition.of(sizes).stage_index(offset)


@pytest.mark.slow
@given(invalid_stage_sizes())
def test_invalid_sizes_are_rejected_with_the_position(sizes: list[object]) -> None:
    position = next(
        i for i, s in enumerate(sizes) if isinstance(s, bool) or not isinstance(s, int) or s <= 0
    )
    with pytest.raises(InvalidStageDefinitionError, match=rf"\[{position}\]"):
        StageDefinition.of(sizes)  # type: ignore[arg-type]


@pytest.mark.parametrize("sizes", ["123", b"12", 5, None, {1: 2}, 1.5])
def test_non_sequences_are_rejected(sizes: object) -> None:
    with pytest.raises(InvalidStageDefinitionError, match="sequence"):
        StageDefinition.of(sizes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sizes", "message"),
    [([0], "positive"), ([3, -1], "positive"), ([True], "int"), ([2, 1.0], "int"), (["3"], "int")],
)
def test_invalid_sizes_messages_say_what_is_wrong(sizes: list[object], message: str) -> None:
    with pytest.raises(InvalidStageDefinitionError, match=message):
        StageDefinition.of(sizes)  # type: ignore[arg-type]
