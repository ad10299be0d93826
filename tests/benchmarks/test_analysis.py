"""Analysis of hand-built event logs: known numbers and planted violations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pytest

from benchmarks.replay import analysis
from benchmarks.replay.runner import EVENT_COLUMNS
from benchmarks.replay.workload import parse_workload

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

pytestmark = [pytest.mark.spark, pytest.mark.slow]

COSTS = [1.0, 2.0, 3.0, 4.0]
STAGES = [0, 0, 1, 1]


def event(
    mode: str,
    offset: int,
    start: float,
    end: float,
    *,
    batch: int,
    qid: int = 0,
    attempt: int = 0,
    ok: bool = True,
    stage: int | None = None,
) -> dict[str, Any]:
    return {
        "mode": mode,
        "consumer": 0,
        "topic": 0,
        "queue": qid,
        "qid": qid,
        "offset": offset,
        "stage": stage,
        "attempt": attempt,
        "batch": batch,
        "start": start,
        "end": end,
        "ok": ok,
        "dlq": False,
        "publish": 0.0,
        "strategy": "default",
        "grp": None,
        "expected_stage": STAGES[offset],
    }


def events_df(spark: SparkSession, rows: list[dict[str, Any]]) -> DataFrame:
    from benchmarks.replay.spark import EVENT_SCHEMA

    pdf = pd.DataFrame(rows, columns=list(EVENT_COLUMNS)).astype(
        {
            "mode": object,
            "strategy": object,
            "grp": object,
            "stage": "Int32",
            "expected_stage": "Int32",
        }
    )
    return spark.createDataFrame(pdf, schema=EVENT_SCHEMA)


def clean_log() -> list[dict[str, Any]]:
    # orderly: 1, 2, 3, 4 seconds one after the other -> ends 1, 3, 6, 10
    rows, t = [], 0.0
    for i, c in enumerate(COSTS):
        rows.append(event("orderly", i, t, t + c, batch=i))
        t += c
    # staged on 2 workers: stage 0 = {1, 2} ends at 2; stage 1 = {3, 4} ends at 5 and 6
    rows += [
        event("staged", 0, 0, 1, batch=0, stage=0),
        event("staged", 1, 0, 2, batch=1, stage=0),
        event("staged", 2, 2, 5, batch=2, stage=1),
        event("staged", 3, 2, 6, batch=3, stage=1),
    ]
    return rows


def messages_df(spark: SparkSession) -> DataFrame:
    pdf = pd.DataFrame(
        {
            "consumer": 0,
            "topic": 0,
            "queue": 0,
            "qid": 0,
            "offset": range(4),
            "key": [None] * 4,
            "strategy": "default",
            "grp": [None] * 4,
            "size": 1,
            "cost_us": [int(c * 1e6) for c in COSTS],
            "fail_attempts": 0,
            "publish_us": 0,
            "stage": STAGES,
        }
    ).astype({"strategy": object, "key": object, "grp": object})
    schema = (
        "consumer int, topic int, queue int, qid int, offset long, key string,"
        " strategy string, grp string, size int, cost_us long, fail_attempts int,"
        " publish_us long, stage int"
    )
    return spark.createDataFrame(pdf, schema=schema)


def test_analysis_of_a_hand_built_log(spark: SparkSession) -> None:
    w = parse_workload(
        {
            "name": "hand",
            "messagesPerQueue": 4,
            "consumer": {"threads": 2},
            "stages": {"definitions": [2, 2]},
            "modes": ["orderly", "staged"],
        }
    )
    bounds = analysis.compute_bounds(messages_df(spark), w, w.modes)
    per_consumer = analysis.summarise_event_log(events_df(spark, clean_log()), bounds)
    summary = analysis.mode_summary(per_consumer).set_index("mode")
    orderly, staged = summary.loc["orderly"], summary.loc["staged"]
    assert (orderly["makespan"], staged["makespan"]) == (10, 6)
    assert (orderly["bound"], staged["bound"]) == (10, 6)  # sum of costs; 2 + 4 on 2 workers
    assert (orderly["efficiency"], staged["efficiency"]) == (1, 1)
    assert staged["speedup"] == pytest.approx(10 / 6)
    assert orderly["throughput"] == pytest.approx(0.4)
    # latencies 1, 3, 6, 10: p50 = 3 (smallest value with half at or below it)
    assert (orderly["latency_p50"], orderly["latency_p95"], orderly["latency_p99"]) == (3, 10, 10)
    assert (staged["queueing_p50"], staged["queueing_p99"]) == (0, 2)
    assert (orderly["attempts"], orderly["lost"], orderly["duplicates"]) == (4, 0, 0)
    for mode in ("orderly", "staged"):
        assert summary.loc[mode, "stage_order_violations"] == 0
    assert summary.loc["orderly", "queue_order_violations"] == 0
    assert summary.loc["staged", "stage_mismatches"] == 0
    # pd.DataFrame: pyspark's annotation of toPandas() needs pandas-stubs
    queues_pdf: pd.DataFrame = analysis.queue_summary(per_consumer).toPandas()
    queues = queues_pdf.set_index("mode")
    assert queues.loc["staged", "speedup"] == pytest.approx(10 / 6)
    assert queues.loc["orderly", "messages"] == 4
    assert queues.loc["orderly", "latency_p50"] == 3
    cdf = analysis.latency_quantiles(analysis.merged_histograms(per_consumer), points=4)
    assert list(cdf.set_index("mode").loc["orderly", "latency_q"]) == [1, 1, 3, 6, 10]


def count_violations(spark: SparkSession, rows: list[dict[str, Any]], how: str) -> pd.DataFrame:
    """Per mode, by Spark SQL over the log or as the replay tasks count (pandas)."""
    events = events_df(spark, rows)
    if how == "sql":
        violations: pd.DataFrame = analysis.violations(events).toPandas()
        return violations.set_index("mode")
    pdf: pd.DataFrame = events.toPandas()
    return pd.DataFrame(
        [{"mode": m, **analysis.event_violations(g)} for m, g in pdf.groupby("mode")]
    ).set_index("mode")


@pytest.mark.parametrize("how", ["sql", "tasks"])
def test_violation_counter_finds_planted_violations(spark: SparkSession, how: str) -> None:
    rows = clean_log()
    # orderly: offset 2 starts at 2.5, before offset 1 (ends at 3) finished
    rows[2] = event("orderly", 2, 2.5, 5.5, batch=2)
    # staged: offset 3 (stage 1) starts at 1.5, before stage 0 finished at 2
    rows[7] = event("staged", 3, 1.5, 5.5, batch=3, stage=1)
    # staged: offset 2 reported as stage 0 although the contract says stage 1
    rows[6] = event("staged", 2, 2, 5, batch=2, stage=0)
    found = count_violations(spark, rows, how)
    assert found.loc["orderly", "queue_order_violations"] == 1
    assert found.loc["orderly", "stage_order_violations"] == 1  # 2.5 < 3: stage 1 too early
    assert found.loc["staged", "stage_order_violations"] == 1
    assert found.loc["staged", "stage_mismatches"] == 1
    clean = count_violations(spark, clean_log(), how)
    assert clean.loc["orderly", "queue_order_violations"] == 0
    assert (clean[["stage_order_violations", "stage_mismatches"]] == 0).all().all()
    assert clean.loc["staged", "queue_order_violations"] == 2  # concurrent starts, allowed


@pytest.mark.parametrize("how", ["sql", "tasks"])
def test_a_failed_attempt_and_its_retry_are_not_violations(spark: SparkSession, how: str) -> None:
    rows = [
        event("orderly", 0, 0, 1, batch=0),
        event("orderly", 1, 1, 3, batch=1, ok=False),
        event("orderly", 1, 4, 6, batch=2, attempt=1),  # retried after a 1 s suspend
        event("orderly", 2, 6, 9, batch=3),
        event("orderly", 3, 9, 13, batch=4),
    ]
    found = count_violations(spark, rows, how)
    assert found.loc["orderly", "queue_order_violations"] == 0
    row = analysis.summarise_events(events_df(spark, rows).toPandas())
    assert (row["messages"], row["attempts"], row["finished"], row["duplicates"]) == (4, 5, 4, 0)
    assert row["makespan"] == 13
    # offset 1: first start 1, finish 6; queueing 0, 1, 6, 9 and latency 1, 6, 9, 13
    assert row["queues"][0]["queueing_p50"] == 1
    assert row["queues"][0]["latency_p99"] == 13


@pytest.mark.parametrize("how", ["sql", "tasks"])
def test_an_orderly_batch_spanning_a_stage_boundary_is_not_a_violation(
    spark: SparkSession, how: str
) -> None:
    rows = [
        event("orderly", 0, 0, 1, batch=0),
        event("orderly", 1, 1, 6, batch=1),  # offsets 1 (stage 0) and 2 (stage 1):
        event("orderly", 2, 1, 6, batch=1),  # one handler call
        event("orderly", 3, 6, 10, batch=2),
        event("staged", 0, 0, 1, batch=0, stage=0),
        event("staged", 1, 0, 2, batch=0, stage=0),
        event("staged", 2, 1, 5, batch=1, stage=1),  # starts before stage 0 ended at 2
        event("staged", 3, 1, 5, batch=1, stage=1),
    ]
    found = count_violations(spark, rows, how)
    assert found.loc["orderly", "stage_order_violations"] == 0
    assert found.loc["orderly", "queue_order_violations"] == 0
    assert found.loc["staged", "stage_order_violations"] == 2


def test_histogram_quantiles_are_values_that_occurred_within_a_bucket() -> None:
    rng = np.random.default_rng(5)
    values = np.concatenate([np.zeros(50), rng.lognormal(0, 2, 20_000)])
    halves = [analysis.histogram(values[:7_000]), analysis.histogram(values[7_000:])]
    merged = (
        pd.concat([pd.DataFrame({"key": k, "n": n, "max": m}) for k, n, m in halves])
        .groupby("key")
        .agg(n=("n", "sum"), max=("max", "max"))
        .sort_index()
    )
    qs = [0.0, 0.001, 0.5, 0.95, 0.99, 1.0]
    got = analysis.histogram_quantiles(merged["n"].to_numpy(), merged["max"].to_numpy(), qs)
    ordered = np.sort(values)
    for q, value in zip(qs, got, strict=True):
        exact = ordered[max(1, int(np.ceil(q * len(values) - 1e-9))) - 1]
        assert exact <= value <= exact * analysis.HIST_GAMMA
        assert value in set(values)
