"""A small replay end to end in local mode: generate, replay, analyse, report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import pytest

from benchmarks.replay.cli import main, run_bench
from benchmarks.replay.workload import load_workload, parse_workload

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.spark, pytest.mark.slow]

WORKLOADS = Path(__file__).resolve().parents[2] / "benchmarks" / "workloads"


def test_rip22_reproduces_the_table_exactly(spark: SparkSession, tmp_path: Path) -> None:
    result = run_bench(spark, load_workload(WORKLOADS / "rip22.yaml"), tmp_path)
    summary = result.summary.set_index("mode")
    assert summary.loc["orderly", "makespan"] == 100
    assert summary.loc["staged", "makespan"] == 6
    assert summary.loc["staged", "speedup"] == 100 / 6
    assert round(summary.loc["staged", "speedup"], 1) == 16.7
    assert (summary["efficiency"] == 1).all()
    assert summary.loc["orderly", "queue_order_violations"] == 0
    assert summary.loc["staged", "stage_order_violations"] == 0
    assert (summary["lost"] == 0).all()
    report = result.report_path.read_text()
    assert "| staged | 6 | 6 | 1 | 16.7x |" in report
    assert "less load-dependent than the wall times, but not immune" in report
    for name in ("throughput.png", "makespan_vs_bound.png", "latency.png"):
        assert (tmp_path / name).stat().st_size > 1000
    events = pd.read_parquet(tmp_path / "events-virtual.parquet")
    assert len(events) == 300
    assert set(events["mode"]) == {"orderly", "concurrent", "staged"}
    assert result.cross_checked == {"virtual": True}  # Spark SQL recounts the same


def test_two_consumers_with_failures_and_strategies(spark: SparkSession, tmp_path: Path) -> None:
    w = parse_workload(
        {
            "name": "small",
            "partitionsPerTopic": 4,
            "messagesPerQueue": 60,
            "consumerPerSubscription": 2,
            "keyDistributor": "KEY_ROUND_ROBIN",
            "keyCount": 6,
            "producerRate": 500,
            "seed": 3,
            "handlerCost": {"distribution": "exponential", "meanMs": 10},
            "failures": {"probability": 0.1, "maxFailures": 1, "suspendMillis": 50},
            "stages": {
                "definitions": [5, 10],
                "strategies": {"vip": [2]},
                "strategyWeights": {"default": 2, "vip": 1, "none": 1},
                "groupBy": "key",
            },
            "consumer": {"threads": 4},
            "modes": ["orderly", "staged"],
        }
    )
    result = run_bench(spark, w, tmp_path)
    assert result.cross_checked == {"virtual": True}
    summary = result.summary.set_index("mode")
    assert (summary["messages"] == 240).all()
    assert (summary["lost"] == 0).all()
    assert (summary["attempts"] > 240).all()  # failures were retried
    assert summary.loc["orderly", "queue_order_violations"] == 0
    assert (summary["stage_order_violations"] == 0).all()
    assert summary.loc["staged", "stage_mismatches"] == 0
    assert (summary["efficiency"] <= 1 + 1e-9).all()
    assert summary.loc["staged", "makespan"] < summary.loc["orderly", "makespan"]


def test_without_the_event_log_the_numbers_are_the_same(
    spark: SparkSession, tmp_path: Path
) -> None:
    w = load_workload(WORKLOADS / "rip22.yaml")
    with_log = run_bench(spark, w, tmp_path / "a", modes=["orderly", "staged"], events=True)
    without = run_bench(spark, w, tmp_path / "b", modes=["orderly", "staged"], events=False)
    assert not (tmp_path / "b" / "events-virtual.parquet").exists()
    assert without.cross_checked == {}
    # (not the counts of out-of-order starts in staged mode, allowed there: trio
    # randomises the order of runnable tasks)
    cols = ["mode", "makespan", "bound", "attempts", "lost", "stage_order_violations"]
    a = with_log.summary[cols].sort_values("mode").reset_index(drop=True)
    b = without.summary[cols].sort_values("mode").reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)
    orderly = [r.summary.set_index("mode").loc["orderly"] for r in (with_log, without)]
    for col in ("latency_p50", "latency_p99", "queueing_p95", "queue_order_violations"):
        assert orderly[0][col] == orderly[1][col]


def test_a_kept_event_log_summarises_like_the_replay_tasks(spark: SparkSession) -> None:
    from benchmarks.replay import analysis
    from benchmarks.replay.generate import generate_messages
    from benchmarks.replay.runner import ReplayConfig
    from benchmarks.replay.spark import replay_events

    w = load_workload(WORKLOADS / "rip22.yaml")
    events = replay_events(generate_messages(spark, w), ReplayConfig.from_workload(w), ["orderly"])
    assert events.count() == 100
    summary = analysis.mode_summary(analysis.summarise_event_log(events)).set_index("mode")
    assert summary.loc["orderly", "makespan"] == 100
    assert summary.loc["orderly", "latency_p50"] == 50
    assert summary.loc["orderly", "queue_order_violations"] == 0


def test_validate_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nstages: {definitions: [0]}\n")
    assert main(["validate", str(WORKLOADS / "rip22.yaml")]) == 0
    assert "rip22.yaml: ok (rip22, 100 messages" in capsys.readouterr().out
    assert main(["validate", str(bad)]) == 1
    assert "stages.definitions: stage sizes must be positive" in capsys.readouterr().err
    unstaged = tmp_path / "unstaged.yaml"
    unstaged.write_text("name: unstaged\nmodes: [orderly, staged]\n")
    assert main(["validate", str(unstaged)]) == 0
    out, err = capsys.readouterr()
    assert "unstaged.yaml: ok (unstaged, 100 messages" in out
    assert f"warning: {unstaged}: modes: staged without stages.definitions" in err


@pytest.mark.parametrize(
    ("csv", "message"),
    [
        # used to hang bench for ever
        ("queue,cost_ms\n0,5\n0,\n", "row 2 (line 3), column cost_ms: must be a finite number"),
        # used to end in a Spark CAST_INVALID_INPUT traceback, and a ValueError one
        ("queue,cost_ms\n0,abc\n", "row 1 (line 2), column cost_ms: must be a finite number"),
        ("queue,cost\n0,5\n", "recorded traffic needs columns queue and cost_ms"),
    ],
    ids=["empty-cost", "non-numeric-cost", "no-cost-column"],
)
def test_bench_reports_bad_recorded_traffic_as_an_error(
    spark: SparkSession,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    csv: str,
    message: str,
) -> None:
    import benchmarks.replay.cli

    (tmp_path / "traffic.csv").write_text(csv)
    workload = tmp_path / "rec.yaml"
    workload.write_text("name: rec\nrecorded: {path: traffic.csv}\nstages: {definitions: [1]}\n")
    # the shared session, which bench must not stop
    monkeypatch.setattr(benchmarks.replay.cli, "get_session", lambda *a, **k: spark)
    monkeypatch.setattr(spark, "stop", lambda: None)
    assert main(["bench", str(workload), "--out", str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert f"error: {tmp_path / 'traffic.csv'}: {message}" in out
    assert "Traceback" not in out


def test_bench_refuses_a_shuffle_partition_count_below_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", str(WORKLOADS / "rip22.yaml"), "--shuffle-partitions", "-3"])
    assert info.value.code == 2
    assert "--shuffle-partitions: must be a positive integer, got -3" in capsys.readouterr().err


def test_help_says_which_engine_replays() -> None:
    from benchmarks.replay.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    # the default engine is core; only --engine runtime (and --wall-clock) use PushConsumer
    assert "in virtual time: by default with the core engine" in text
    assert "with ``--engine runtime`` with the real PushConsumer on trio's MockClock" in text
