"""``stagedconsumer demo --keys``: orderly, key-ordered, staged by key and concurrent
on messages with keys, against the bound of each."""

from __future__ import annotations

import math

import anyio
import pytest
from trio.testing import MockClock

from stagedconsumer._cli._demo import _Event, check_order, run_demo, theoretical_units


@pytest.mark.parametrize(
    ("messages", "keys", "workers", "stages"),
    [(100, 10, 20, [1, 2, 3]), (100, 7, 20, [1, 2, 3]), (60, 30, 8, [2]), (50, 3, 4, [5, 5])],
)
def test_in_virtual_time_every_mode_takes_exactly_its_bound(
    messages: int, keys: int, workers: int, stages: list[int]
) -> None:
    results = anyio.run(
        lambda: run_demo(messages=messages, cost=0.01, workers=workers, stages=stages, keys=keys),
        backend="trio",
        backend_options={"clock": MockClock(autojump_threshold=0)},
    )
    assert [r.mode for r in results] == ["orderly", "key-ordered", "staged/key", "concurrent"]
    for r in results:
        assert r.ok, (r.mode, r.violations)
        assert r.elapsed == pytest.approx(r.bound, abs=1e-9), r.mode
    by_mode = {r.mode: r for r in results}
    per_key = math.ceil(messages / keys)
    # Key-ordered: at least the longest key, at least the work spread over the workers.
    assert by_mode["key-ordered"].bound_units >= max(per_key, math.ceil(messages / workers))
    assert by_mode["key-ordered"].peak_concurrency <= min(keys, workers)
    assert by_mode["orderly"].bound_units == messages
    assert by_mode["concurrent"].bound_units == math.ceil(messages / workers)


def test_key_ordered_bound_with_fewer_keys_than_workers_is_the_longest_key() -> None:
    assert theoretical_units("key-ordered", 100, 20, [], keys=10) == 10
    assert theoretical_units("key-ordered", 100, 20, [], keys=7) == 15  # 100 = 7 * 14 + 2


def test_the_key_checks_find_broken_order() -> None:
    def event(offset: int, key: str, start: float, end: float, stage: int = -1) -> _Event:
        return _Event(offset=offset, stage=stage, start=start, end=end, key=key)

    overlapping = [event(0, "a", 0, 2), event(1, "b", 0, 1), event(2, "a", 1, 2)]
    [problem] = check_order("key-ordered", overlapping, 3, [])
    assert problem.startswith("key a: offset 1 started before offset 0 ended")
    # Other keys may overlap: b's message ran beside a's.
    assert check_order("key-ordered", [event(0, "a", 0, 1), event(1, "b", 0, 1)], 2, []) == []
    # Staged per key, stages [1]: a's second message (stage -1, the tail) started
    # before a's first (stage 0) finished.
    early = [event(0, "a", 0, 2, 0), event(1, "a", 1, 2, -1)]
    [problem] = check_order("staged/key", early, 2, [1])
    assert "key a: stage -1 started before stage 0 finished" in problem
    missing = check_order("key-ordered", [event(0, "a", 0, 1)], 2, [])
    assert missing[0].startswith("consumed 1 of 2")
