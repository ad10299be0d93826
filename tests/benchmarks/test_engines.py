"""The core engine reproduces the runtime engine's schedule exactly.

The runtime engine (the real PushConsumer on trio's MockClock, scheduled
deterministically: see ``deterministic_trio``) is the reference. For every shipped
workload (shrunk to a few queues) and for hypothesis-generated ones, both engines
must make the same handler calls: every attempt of every message with equal start
and end times (float equality, not closeness), hence equal makespans, and equal
violation counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.replay.analysis import event_violations
from benchmarks.replay.engine import Prepared, simulate
from benchmarks.replay.runner import ReplayConfig, deterministic_trio, replay_consumer
from benchmarks.replay.workload import MODES, Workload, load_workload

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

WORKLOADS = sorted((Path(__file__).parents[2] / "benchmarks" / "workloads").glob("*.yaml"))
KEY = ["qid", "offset", "attempt"]


def assert_same_schedule(messages: pd.DataFrame, mode: str, config: ReplayConfig) -> None:
    runtime = replay_consumer(messages, mode, config, engine="runtime")
    core = replay_consumer(messages, mode, config, engine="core")
    a = runtime.sort_values(KEY, kind="stable").reset_index(drop=True)
    b = core.sort_values(KEY, kind="stable").reset_index(drop=True)
    assert len(a) == len(b), f"{mode}: {len(a)} attempts in the runtime, {len(b)} in the core"
    # every column, the times compared as floats for equality
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert a["end"].to_numpy().max(initial=0.0) == b["end"].to_numpy().max(initial=0.0)
    assert event_violations(runtime) == event_violations(core)
    # the same calls in the same order: batch numbers are given in start order
    assert runtime["batch"].tolist() == core["batch"].tolist()


def small(w: Workload) -> Workload:
    """The workload with few queues and messages (same kinds of costs, failures,
    stages, keys and producer rate)."""
    topics = min(w.topics, 2)
    partitions = min(w.partitions_per_topic, 4)
    return attrs.evolve(
        w,
        topics=topics,
        partitions_per_topic=partitions,
        consumers=min(w.consumers, 2, topics * partitions),
        messages_per_queue=min(w.messages_per_queue, 60),
        threads=min(w.threads, 6),
    )


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("path", WORKLOADS, ids=[p.stem for p in WORKLOADS])
def test_engines_agree_on_every_shipped_workload(spark: SparkSession, path: Path) -> None:
    from benchmarks.replay.generate import generate_messages

    w = small(load_workload(path))
    # pd.DataFrame: pyspark's annotation of toPandas() needs pandas-stubs
    messages: pd.DataFrame = generate_messages(spark, w).toPandas()
    assert len(messages) == w.message_count
    config = ReplayConfig.from_workload(w)
    for _consumer, pdf in messages.groupby("consumer"):
        pdf = pdf.sort_values(["qid", "offset"]).reset_index(drop=True)
        for mode in w.modes:
            assert_same_schedule(pdf, mode, config)


def frame(
    rows: list[tuple[int, int, int, int, str | None, str | None]],
) -> pd.DataFrame:
    """Messages from ``(queue, cost_us, fail_attempts, publish_us, key, strategy)``,
    offsets in row order within each queue."""
    queues = [r[0] for r in rows]
    offsets: dict[int, int] = {}
    offset = []
    for q in queues:
        offset.append(offsets.get(q, 0))
        offsets[q] = offset[-1] + 1
    n = len(rows)
    return (
        pd.DataFrame(
            {
                "consumer": np.zeros(n, np.int32),
                "topic": np.zeros(n, np.int32),
                "queue": queues,
                "qid": queues,
                "offset": offset,
                "key": [r[4] for r in rows],
                "strategy": [r[5] for r in rows],
                "grp": [r[4] for r in rows],
                "size": 1,
                "cost_us": [r[1] for r in rows],
                "fail_attempts": [r[2] for r in rows],
                "publish_us": [r[3] for r in rows],
                "stage": pd.array([0] * n, dtype="Int32"),
            }
        )
        .sort_values(["qid", "offset"])
        .reset_index(drop=True)
    )


def config_of(*, threads: int, pull_batch_size: int, stages: tuple[int, ...]) -> ReplayConfig:
    """One handler call per message, one stage sequence per queue, no retry limit."""
    return ReplayConfig(
        threads=threads,
        batch_size=1,
        pull_batch_size=pull_batch_size,
        suspend_millis=100,
        max_reconsume_times=None,
        strategies={"default": stages},
        group_by_key=False,
    )


# Whole milliseconds make many events tie at the same instant: the order in which
# the engines handle simultaneous events is what most needs checking.
COSTS = st.one_of(st.sampled_from([0, 1000, 2000, 3000]), st.integers(1, 20_000))
ROWS = st.lists(
    st.tuples(
        st.integers(0, 3),
        COSTS,
        st.integers(0, 2),
        st.sampled_from([0, 0, 0, 1000, 2500, 40_000]),
        st.sampled_from([None, "a", "b", "c"]),
        st.sampled_from([None, "default", "default", "vip"]),
    ),
    min_size=0,
    max_size=48,
)
CONFIGS = st.builds(
    ReplayConfig,
    threads=st.integers(1, 5),
    batch_size=st.integers(1, 3),
    pull_batch_size=st.integers(1, 8),
    suspend_millis=st.sampled_from([10, 100, 1000]),
    max_reconsume_times=st.sampled_from([None, 0, 1, 2]),
    strategies=st.just({"default": (3, 5), "vip": (2,)}),
    group_by_key=st.booleans(),
)


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=ROWS, config=CONFIGS, backlog=st.booleans())
def test_engines_agree_on_generated_workloads(
    rows: list[tuple[int, int, int, int, str | None, str | None]],
    config: ReplayConfig,
    backlog: bool,
) -> None:
    if backlog:
        rows = [(q, c, f, 0, k, s) for q, c, f, _, k, s in rows]
    messages = frame(rows)
    for mode in MODES:
        assert_same_schedule(messages, mode, config)


def test_prepared_messages_are_shared_between_modes() -> None:
    messages = frame([(0, 1000, 0, 0, "a", "default"), (1, 2000, 1, 0, None, None)] * 3)
    config = config_of(threads=2, pull_batch_size=4, stages=(2,))
    prepared = Prepared(messages)
    for mode in MODES:
        shared = simulate(messages, mode, config, prepared)
        alone = simulate(messages, mode, config)
        assert shared.call_start == alone.call_start
        assert shared.index == alone.index
        assert shared.remaining == alone.remaining == 0


def test_trio_is_fifo_inside_the_replay_only() -> None:
    from trio._core import _run

    before = (_run._r, _run.Deadlines.add)
    with deterministic_trio():
        assert _run._r.random() == 0.0
        assert not _run._ALLOW_DETERMINISTIC_SCHEDULING
    assert (_run._r, _run.Deadlines.add) == before


def test_the_core_engine_refuses_the_wall_clock() -> None:
    messages = frame([(0, 1000, 0, 0, None, None)])
    config = config_of(threads=1, pull_batch_size=1, stages=(1,))
    with pytest.raises(ValueError, match="virtual time only"):
        replay_consumer(messages, "orderly", config, engine="core", wall_clock=True)
    with pytest.raises(ValueError, match="engine must be one of"):
        replay_consumer(messages, "orderly", config, engine="other")


@pytest.mark.slow
def test_engines_agree_when_flow_control_pauses_pulling() -> None:
    # queue 0: a 10 s message first, then 2,599 of 1 ms (concurrent mode stops pulling
    # at a span of 2,000, the others at 1,000 unfinished messages); queue 1: 1,500
    # messages, 2 % failing once
    rng = np.random.default_rng(1)
    rows: list[tuple[int, int, int, int, str | None, str | None]] = [
        (0, 10_000_000 if i == 0 else 1000, 0, 0, None, "default") for i in range(2600)
    ]
    rows += [
        (1, int(rng.integers(500, 3000)), int(rng.random() < 0.02), 0, None, "default")
        for _ in range(1500)
    ]
    messages = frame(rows)
    config = config_of(threads=4, pull_batch_size=32, stages=(500, 1000))
    for mode in MODES:
        assert_same_schedule(messages, mode, config)
    events = replay_consumer(messages, "concurrent", config, engine="core")
    late = events[(events["qid"] == 0) & (events["offset"] >= 2100)]
    assert late["start"].min() >= 10.0  # pulled only once the slow message finished


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=ROWS, config=CONFIGS, backlog=st.booleans())
def test_engines_agree_on_key_ordered_consumption(
    rows: list[tuple[int, int, int, int, str | None, str | None]],
    config: ReplayConfig,
    backlog: bool,
) -> None:
    # orderly mode with Ordering.BY_KEY: keys of a queue run concurrently, messages
    # without a key unordered, a failure holds back only its key
    if backlog:
        rows = [(q, c, f, 0, k, s) for q, c, f, _, k, s in rows]
    assert_same_schedule(frame(rows), "orderly", attrs.evolve(config, key_ordered=True))


def test_key_ordered_replay_runs_keys_of_a_queue_concurrently() -> None:
    # one queue, keys a, b, a, b of 1 s each on two workers: by queue 4 s, by key 2 s,
    # and each key's messages still one after the other
    messages = frame([(0, 1_000_000, 0, 0, key, None) for key in ("a", "b", "a", "b")])
    config = config_of(threads=2, pull_batch_size=4, stages=(1,))
    by_queue = replay_consumer(messages, "orderly", config, engine="core")
    by_key = replay_consumer(
        messages, "orderly", attrs.evolve(config, key_ordered=True), engine="core"
    )
    assert by_queue["end"].max() == 4.0
    assert by_key["end"].max() == 2.0
    starts = by_key.sort_values("offset")["start"].tolist()
    assert starts == [0.0, 0.0, 1.0, 1.0]
    assert_same_schedule(messages, "orderly", attrs.evolve(config, key_ordered=True))
