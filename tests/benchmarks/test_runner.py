"""The replay runner alone (no Spark): the real PushConsumer in virtual time."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from benchmarks.replay.runner import EVENT_COLUMNS, ReplayConfig, replay_consumer


def one_queue(
    n: int, cost_us: int, fails: list[int] | None = None, stage: list[int] | None = None
) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "consumer": 0,
            "topic": 0,
            "queue": 0,
            "qid": 0,
            "offset": np.arange(n),
            "key": [None] * n,
            "strategy": "default",
            "grp": [None] * n,
            "size": 1,
            "cost_us": cost_us,
            "fail_attempts": fails or [0] * n,
            "publish_us": 0,
            "stage": stage or [0] * n,
        }
    )


def config(definitions: tuple[int, ...], threads: int = 20, suspend: int = 1000) -> ReplayConfig:
    return ReplayConfig(
        threads=threads,
        batch_size=1,
        pull_batch_size=32,
        suspend_millis=suspend,
        max_reconsume_times=None,
        strategies={"default": definitions},
        group_by_key=False,
    )


@pytest.mark.parametrize(("mode", "makespan"), [("orderly", 100), ("concurrent", 5), ("staged", 6)])
def test_rip22_in_virtual_time(mode: str, makespan: float) -> None:
    stages = [0] * 10 + [1] * 20 + [2] * 70
    events = replay_consumer(one_queue(100, 1_000_000, stage=stages), mode, config((10, 20, 70)))
    assert list(events.columns) == list(EVENT_COLUMNS)
    assert events["end"].max() == makespan
    assert sorted(events["offset"]) == list(range(100))
    assert events["ok"].all()
    if mode == "staged":
        assert list(events.sort_values("offset")["stage"]) == stages


def test_failures_are_retried_after_the_suspend_time() -> None:
    # 10 one-second messages, the fourth fails twice: orderly pays 2 extra attempts
    # and 2 suspends of 0.5 s
    fails = [0, 0, 0, 2, 0, 0, 0, 0, 0, 0]
    events = replay_consumer(one_queue(10, 1_000_000, fails), "orderly", config((), suspend=500))
    assert events["end"].max() == 10 + 2 + 2 * 0.5
    third = events[events["offset"] == 3].sort_values("attempt")
    assert list(third["attempt"]) == [0, 1, 2]
    assert list(third["ok"]) == [False, False, True]
    assert (third["start"].diff().dropna() == 1.5).all()


def test_wall_clock_replay_really_waits() -> None:
    events = replay_consumer(one_queue(10, 5_000), "orderly", config(()), wall_clock=True)
    ordered = events.sort_values("offset")
    assert ordered["end"].max() >= 10 * 0.005  # ten 5 ms handlers one after the other
    assert (ordered["start"].to_numpy()[1:] >= ordered["end"].to_numpy()[:-1]).all()


@pytest.mark.parametrize("engine", ["core", "runtime"])
@pytest.mark.parametrize(("bad", "shown"), [(-20_000, "-20000"), (np.nan, "nan"), (pd.NA, "nan")])
def test_a_negative_or_missing_cost_is_refused(engine: str, bad: object, shown: str) -> None:
    # the runtime engine used to wait forever on these; the core engine took a
    # negative cost for 0 and a missing one for 15 s
    messages = one_queue(4, 1_000).astype({"cost_us": "Float64" if bad is pd.NA else "float64"})
    messages.loc[2, "cost_us"] = bad
    with pytest.raises(ValueError, match=f"got {shown} for the message at qid 0, offset 2"):
        replay_consumer(messages, "staged", config((2,)), engine=engine)
