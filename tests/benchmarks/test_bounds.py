from __future__ import annotations

import heapq
import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.replay.bounds import graham_bound, makespan_lower_bound, orderly_chain, stage_chain


def lpt(costs: list[float], workers: int) -> float:
    loads = [0.0] * workers
    for c in sorted(costs, reverse=True):
        heapq.heapreplace(loads, loads[0] + c)
    return max(loads)


def test_exact_for_equal_costs() -> None:
    # RIP-22: stages of 10, 20 and 70 one-unit messages on 20 workers
    assert [makespan_lower_bound([1.0] * n, 20) for n in (10, 20, 70, 100)] == [1, 1, 4, 5]
    for n in range(1, 60):
        assert makespan_lower_bound([2.5] * n, 7) == math.ceil(n / 7) * 2.5


def test_small_cases() -> None:
    assert makespan_lower_bound([], 3) == 0
    assert makespan_lower_bound([3, 3, 2, 2, 2], 2) == 6  # sum / W
    assert makespan_lower_bound([5, 1, 1], 2) == 5  # longest job
    assert makespan_lower_bound([3, 3, 3], 2) == 6  # two of three jobs share a worker
    assert graham_bound([4, 3, 2, 1], 2) == 5 + 0.5 * 4


@given(
    st.lists(st.floats(min_value=0.001, max_value=100), min_size=1, max_size=40),
    st.integers(min_value=1, max_value=8),
)
def test_bound_never_exceeds_a_real_schedule(costs: list[float], workers: int) -> None:
    bound = makespan_lower_bound(costs, workers)
    assert bound <= lpt(costs, workers) + 1e-9
    assert bound >= max(costs) - 1e-9
    assert bound >= sum(costs) / workers - 1e-9


def test_chains() -> None:
    work = np.array([1.0, 2.0, 3.0])
    assert orderly_chain(np.zeros(3), work) == 6
    # the last message is published late: it alone bounds the chain
    assert orderly_chain(np.array([0.0, 0.0, 10.0]), work) == 13
    stages = [
        (np.array([1.0, 1.0]), np.zeros(2), np.array([1.0, 1.0])),
        (np.array([1.0, 1.0, 1.0]), np.zeros(3), np.array([1.0, 1.0, 1.0])),
    ]
    assert stage_chain(stages, 2) == 1 + 2
