from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from benchmarks.replay.generate import MESSAGE_COLUMNS, generate_messages
from benchmarks.replay.workload import RecordedTrafficError, parse_workload

if TYPE_CHECKING:
    # pyspark annotates toPandas() with pandas-stubs' DataFrame, which is not installed,
    # so the result has a type mypy cannot resolve: the frames are annotated pd.DataFrame,
    # as in benchmarks/replay (pandas.* imports are untyped here)
    import pandas as pd
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def workload(**extra: Any) -> Any:
    doc = {
        "name": "gen",
        "partitionsPerTopic": 4,
        "topics": 2,
        "messagesPerQueue": 250,
        "consumerPerSubscription": 3,
        "keyDistributor": "KEY_ROUND_ROBIN",
        "keyCount": 7,
        "seed": 11,
        "handlerCost": {"distribution": "lognormal", "medianMs": 5, "sigma": 1},
        "failures": {"probability": 0.3, "maxFailures": 2},
        "stages": {
            "definitions": [10, 40],
            "strategies": {"vip": [3]},
            "strategyWeights": {"default": 2, "vip": 1, "none": 1},
            "groupBy": "key",
        },
        **extra,
    }
    return parse_workload(doc)


def rows(spark: SparkSession, w: Any) -> list[tuple[Any, ...]]:
    df = generate_messages(spark, w)
    assert tuple(df.columns) == MESSAGE_COLUMNS
    return [tuple(r) for r in df.orderBy("qid", "offset").collect()]


def test_generation_is_deterministic_for_a_seed(spark: SparkSession) -> None:
    first = rows(spark, workload())
    spark.conf.set("spark.sql.shuffle.partitions", "5")  # other partitioning, same rows
    try:
        second = rows(spark, workload())
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", "2")
    assert first == second
    other = rows(spark, workload(seed=12))
    cost = MESSAGE_COLUMNS.index("cost_us")
    assert [r[cost] for r in first] != [r[cost] for r in other]


def test_generated_columns_follow_the_workload(spark: SparkSession) -> None:
    df: pd.DataFrame = generate_messages(spark, workload()).toPandas()
    assert len(df) == 2 * 4 * 250
    assert sorted(df["consumer"].unique()) == [0, 1, 2]
    assert df.groupby("qid")["offset"].apply(lambda s: sorted(s) == list(range(250))).all()
    assert set(df["fail_attempts"]) == {0, 1, 2}  # capped by maxFailures
    share_failing = (df["fail_attempts"] > 0).mean()
    assert 0.25 < share_failing < 0.35  # P(first attempt fails) = 0.3
    assert set(df["strategy"].dropna()) == {"default", "vip"}
    assert df["strategy"].isna().any()
    assert df.loc[df["strategy"].isna(), "stage"].isna().all()
    # the contract's stage: rank within (queue, strategy, group) against the definitions
    for (_, strategy, _), g in df.dropna(subset=["strategy"]).groupby(["qid", "strategy", "grp"]):
        bounds = [10, 50] if strategy == "default" else [3]
        expected = [
            next((i for i, b in enumerate(bounds) if rank < b), -1) for rank in range(len(g))
        ]
        assert list(g.sort_values("offset")["stage"]) == expected
    median_ms = df["cost_us"].median() / 1000
    assert 4 < median_ms < 6


def test_recorded_traffic_becomes_messages(spark: SparkSession, tmp_path: Path) -> None:
    csv = tmp_path / "traffic.csv"
    csv.write_text("queue,cost_ms,key\n1,2.5,a\n0,1,b\n1,4,c\n0,3,d\n1,1,e\n")
    w = parse_workload(
        {"name": "rec", "recorded": {"path": "traffic.csv"}, "stages": {"definitions": [1, 1]}},
        base=tmp_path,
    )
    df: pd.DataFrame = generate_messages(spark, w).orderBy("qid", "offset").toPandas()
    assert list(df["qid"]) == [0, 0, 1, 1, 1]
    assert list(df["offset"]) == [0, 1, 0, 1, 2]  # file order within a queue
    assert list(df["cost_us"]) == [1000, 3000, 2500, 4000, 1000]
    assert list(df["key"]) == ["b", "d", "a", "c", "e"]
    assert list(df["stage"]) == [0, 1, 0, 1, -1]
    bad = tmp_path / "bad.csv"
    bad.write_text("queue,millis\n0,1\n")
    w_bad = parse_workload({"name": "bad", "recorded": {"path": str(bad)}})
    with pytest.raises(
        RecordedTrafficError, match="needs columns queue and cost_ms; missing cost_ms"
    ):
        generate_messages(spark, w_bad)


@pytest.mark.parametrize(
    ("csv", "message"),
    [
        # an empty cost used to hang bench, a negative one was replayed as 0
        (
            "queue,cost_ms\n0,5\n0,\n",
            "row 2 (line 3), column cost_ms: must be a finite number >= 0, got an empty cell",
        ),
        (
            "queue,cost_ms\n0,5\n0,-20\n1,-1\n",
            "row 2 (line 3), column cost_ms: must be a finite number >= 0, got -20 (1 more",
        ),
        (
            "queue,cost_ms\n0,abc\n",
            "row 1 (line 2), column cost_ms: must be a finite number >= 0, got 'abc'",
        ),
        (
            "queue,cost_ms\n0,5\n0,NaN\n",
            "row 2 (line 3), column cost_ms: must be a finite number >= 0, got nan",
        ),
        (
            "queue,cost_ms\n0,5\n-1,5\n",
            "row 2 (line 3), column queue: must be a whole number >= 0, got -1",
        ),
        (
            "queue,cost_ms,fail_attempts\n0,5,1.5\n",
            "column fail_attempts: must be a whole number >= 0, got 1.5",
        ),
        (
            "queue,cost_ms,publish_ms\n0,5,x\n",
            "column publish_ms: must be a finite number >= 0, got 'x'",
        ),
        # a repeated offset used to be reported as one message lost and one duplicated
        (
            "queue,offset,cost_ms\n0,0,5\n0,0,5\n0,5,5\n1,0,1\n",
            "offset 0 appears 2 times in queue 0",
        ),
        ("queue,cost_ms\n", "recorded traffic has no rows"),
    ],
    ids=[
        "empty-cost",
        "negative-cost",
        "non-numeric-cost",
        "nan-cost",
        "negative-queue",
        "fractional-attempts",
        "non-numeric-publish",
        "repeated-offset",
        "no-rows",
    ],
)
def test_bad_recorded_traffic_is_refused(
    spark: SparkSession, tmp_path: Path, csv: str, message: str
) -> None:
    (tmp_path / "traffic.csv").write_text(csv)
    w = parse_workload({"name": "rec", "recorded": {"path": "traffic.csv"}}, base=tmp_path)
    with pytest.raises(RecordedTrafficError, match=r"traffic\.csv: ") as info:
        generate_messages(spark, w)
    assert message in str(info.value)


def test_recorded_parquet_with_a_nan_or_null_cost_is_refused(
    spark: SparkSession, tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, cost, got in [("nan", float("nan"), "nan"), ("null", None, "null")]:
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"queue": [0, 0, 1], "cost_ms": [1.0, cost, 2.0]}), path)
        w = parse_workload({"name": "rec", "recorded": {"path": str(path)}})
        with pytest.raises(RecordedTrafficError, match=f"row 2, column cost_ms: .* got {got}$"):
            generate_messages(spark, w)
