"""Analysis in Spark: per mode and queue makespan, throughput, latency, bounds,
efficiency, speedup over orderly, and ordering violations recomputed from the
event log.

Times are seconds since each consumer instance started (virtual seconds in
virtual time). Latency of a message = end of its last attempt - publish time;
queueing time = start of its first attempt - publish time. Percentiles are Spark's
``percentile_approx`` (accuracy 10000: the smallest value with at least p of the
values at or below it, up to a rank error of n / 10000).

Violations (counted in messages):

- ``queue_order_violations``: a handler call of a queue started before an earlier
  call holding lower offsets of that queue ended (calls ordered by their lowest
  offset, then start). Must be 0 for orderly.
- ``stage_order_violations``: a handler call holding messages of stage ``i`` of a
  stage key (queue, strategy, group) started before every call holding earlier
  stages of that key ended; stages from the contract (the generation's ``stage``
  column, not the runtime's report), the tail last; counted in message attempts. A
  call is checked at the lowest stage among its messages, since an orderly batch
  may span a stage boundary. Must be 0 for staged (and orderly).
- ``stage_mismatches``: staged mode, the runtime reported another stage index than
  the contract assigns.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pandas as pd
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType, IntegerType, StringType, StructField, StructType

from .bounds import graham_bound, makespan_lower_bound, orderly_chain, stage_chain
from .workload import Workload

__all__ = (
    "BOUND_SCHEMA",
    "compute_bounds",
    "message_outcomes",
    "mode_summary",
    "queue_summary",
    "violations",
)

PERCENTILES = (0.5, 0.95, 0.99)
ACCURACY = 10000
_TAIL_RANK = 1 << 30
_NULL = "\u0000"

BOUND_SCHEMA = StructType(
    [
        StructField("mode", StringType(), False),
        StructField("consumer", IntegerType(), False),
        StructField("bound", DoubleType(), False),
        StructField("graham", DoubleType(), False),
        StructField("work", DoubleType(), False),
    ]
)


def planned_attempts(fail_attempts: np.ndarray, limit: int | None) -> np.ndarray:
    """Attempts a message takes: its failures + 1, or ``limit + 1`` when it goes to
    the dead-letter queue after ``limit`` reconsumes."""
    attempts = fail_attempts.astype(np.int64) + 1
    if limit is not None:
        attempts = np.minimum(attempts, limit + 1)
    return attempts


def consumer_bounds(pdf: pd.DataFrame, modes: Sequence[str], workers: int,
                    max_reconsume: int | None) -> pd.DataFrame:
    """Lower bounds of one consumer instance for each mode (see :mod:`.bounds`)."""
    pdf = pdf.sort_values(["qid", "offset"], kind="stable")
    cost = pdf["cost_us"].to_numpy(dtype=np.float64) / 1e6
    publish = pdf["publish_us"].to_numpy(dtype=np.float64) / 1e6
    fails = pdf["fail_attempts"].to_numpy()
    rows = []
    for mode in modes:
        limit = max_reconsume
        if limit is None and mode == "concurrent":
            limit = 16  # RocketMQ's default for concurrent consumers
        attempts = planned_attempts(fails, limit)
        work = cost * attempts
        jobs = np.repeat(cost, attempts)
        bound = max(makespan_lower_bound(jobs, workers),
                    float(np.max(publish + work)) if len(work) else 0.0)
        if mode == "orderly":
            qids = pdf["qid"].to_numpy()
            for q in np.unique(qids):
                sel = qids == q
                bound = max(bound, orderly_chain(publish[sel], work[sel]))
        elif mode == "staged":
            keyed = pdf.assign(_work=work, _publish=publish, _cost=cost, _attempts=attempts)
            keyed = keyed[keyed["strategy"].notna()]
            rank = keyed["stage"].where(keyed["stage"] >= 0, _TAIL_RANK)
            keyed = keyed.assign(
                _rank=rank, _grp=keyed["grp"].astype(object).where(keyed["grp"].notna(), _NULL)
            )
            for _, key_df in keyed.groupby(["qid", "strategy", "_grp"], sort=False):
                stages = []
                for _, stage_df in key_df.groupby("_rank", sort=True):
                    stages.append((
                        np.repeat(stage_df["_cost"].to_numpy(), stage_df["_attempts"].to_numpy()),
                        stage_df["_publish"].to_numpy(),
                        stage_df["_work"].to_numpy(),
                    ))
                bound = max(bound, stage_chain(stages, workers))
        rows.append({
            "mode": mode,
            "consumer": int(pdf["consumer"].iloc[0]),
            "bound": bound,
            "graham": graham_bound(jobs, workers),
            "work": float(work.sum()),
        })
    return pd.DataFrame(rows, columns=[f.name for f in BOUND_SCHEMA.fields]).astype(
        {"mode": object, "consumer": "int32"}
    )


def compute_bounds(messages: DataFrame, w: Workload, modes: Sequence[str]) -> DataFrame:
    """Per (mode, consumer) lower bound, Graham bound and total work, in Spark.

    ``messages`` is best partitioned by :func:`~benchmarks.replay.spark.by_consumer`.
    """
    chosen = tuple(modes)
    workers = w.threads
    limit = w.failures.max_reconsume_times

    def per_consumer(pdf: pd.DataFrame) -> pd.DataFrame:
        return consumer_bounds(pdf, chosen, workers, limit)

    from .spark import _is_by_consumer, by_consumer, group_keys

    if not _is_by_consumer(messages):
        messages = by_consumer(messages)
    return messages.groupBy(*group_keys(messages)).applyInPandas(
        per_consumer, schema=BOUND_SCHEMA
    )


def message_outcomes(events: DataFrame) -> DataFrame:
    """One row per mode and message: first start, finish, attempts, latency."""
    per_message = events.groupBy(
        "mode", "consumer", "qid", "offset", "topic", "queue", "publish"
    ).agg(
        F.min("start").alias("first_start"),
        F.max("end").alias("finish"),
        F.count(F.lit(1)).alias("attempts"),
        F.sum(F.col("ok").cast("int")).alias("successes"),
        F.max(F.col("dlq").cast("int")).alias("dlq"),
    )
    return per_message.withColumns(
        {
            "latency": F.col("finish") - F.col("publish"),
            "queueing": F.col("first_start") - F.col("publish"),
        }
    )


def _percentiles(column: str) -> list[Column]:
    return [
        F.percentile_approx(column, p, ACCURACY).alias(f"{column}_p{round(p * 100)}")
        for p in PERCENTILES
    ]


def queue_summary(outcomes: DataFrame) -> DataFrame:
    """Per mode and queue: makespan, throughput, latency and queueing percentiles,
    and speedup over orderly on that queue."""
    per_queue = outcomes.groupBy("mode", "consumer", "qid", "topic", "queue").agg(
        F.count(F.lit(1)).alias("messages"),
        F.max("finish").alias("makespan"),
        *_percentiles("latency"),
        *_percentiles("queueing"),
    )
    per_queue = per_queue.withColumn("throughput", F.col("messages") / F.col("makespan"))
    orderly = per_queue.where(F.col("mode") == "orderly").select(
        "qid", F.col("makespan").alias("_orderly")
    )
    return (
        per_queue.join(orderly, "qid", "left")
        .withColumn("speedup", F.col("_orderly") / F.col("makespan"))
        .drop("_orderly")
    )


def violations(events: DataFrame) -> DataFrame:
    """Per mode: queue-order and stage-order violations and stage mismatches."""
    calls = events.groupBy("mode", "consumer", "qid", "batch").agg(
        F.min("offset").alias("lo"),
        F.min("start").alias("s"),
        F.max("end").alias("e"),
        F.count(F.lit(1)).alias("n"),  # a call holds each of its messages once
    )
    before = (
        Window.partitionBy("mode", "qid").orderBy("lo", "s")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    queue_bad = (
        calls.withColumn("prev_end", F.max("e").over(before))
        .where(F.col("s") < F.col("prev_end"))
        .groupBy("mode")
        .agg(F.sum("n").alias("queue_order_violations"))
    )

    staged = events.select(
        "mode", "consumer", "qid", "offset", "batch", "start", "end", "stage",
        "expected_stage",
        F.coalesce(F.col("strategy"), F.lit(_NULL)).alias("strat"),
        F.coalesce(F.col("grp"), F.lit(_NULL)).alias("grp_key"),
    )
    keyed = staged.where(F.col("strat") != _NULL).withColumn(
        "rank",
        F.when(F.col("expected_stage") < 0, F.lit(_TAIL_RANK)).otherwise(F.col("expected_stage")),
    )
    # per handler call and stage key, at the call's lowest stage: an orderly batch may
    # span a stage boundary, and its messages start together by design
    parts = keyed.groupBy("mode", "consumer", "qid", "strat", "grp_key", "batch").agg(
        F.min("rank").alias("rank"),
        F.min("start").alias("s"),
        F.max("end").alias("e"),
        F.count(F.lit(1)).alias("n"),
    )
    stage_ends = parts.groupBy("mode", "qid", "strat", "grp_key", "rank").agg(
        F.max("e").alias("stage_end")
    )
    earlier = (
        Window.partitionBy("mode", "qid", "strat", "grp_key").orderBy("rank")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    barrier = stage_ends.withColumn("barrier", F.max("stage_end").over(earlier)).drop("stage_end")
    stage_bad = (
        parts.join(barrier, ["mode", "qid", "strat", "grp_key", "rank"], "inner")
        .where(F.col("s") < F.col("barrier"))
        .groupBy("mode")
        .agg(F.sum("n").alias("stage_order_violations"))
    )
    mismatch = (
        staged.where(F.col("mode") == "staged")
        .where(~F.col("stage").eqNullSafe(F.coalesce(F.col("expected_stage"), F.lit(-1))))
        .select("mode", "qid", "offset")
        .distinct()
        .groupBy("mode")
        .agg(F.count(F.lit(1)).alias("stage_mismatches"))
    )
    modes = events.select("mode").distinct()
    return (
        modes.join(queue_bad, "mode", "left")
        .join(stage_bad, "mode", "left")
        .join(mismatch, "mode", "left")
        .fillna(0, ["queue_order_violations", "stage_order_violations", "stage_mismatches"])
    )


def mode_summary(
    total_messages: int, events: DataFrame, outcomes: DataFrame, bounds: DataFrame
) -> pd.DataFrame:
    """Per mode: the headline numbers (see the module docstring), collected.

    ``total_messages``: how many messages the workload has (to count lost ones).
    """
    per_mode = outcomes.groupBy("mode").agg(
        F.count(F.lit(1)).alias("messages"),
        F.max("finish").alias("makespan"),
        F.sum("attempts").alias("attempts"),
        F.sum(F.when(F.col("successes") > 1, 1).otherwise(0)).alias("duplicates"),
        F.sum(F.when((F.col("successes") >= 1) | (F.col("dlq") == 1), 1).otherwise(0)).alias(
            "finished"
        ),
        F.sum("dlq").alias("dead_lettered"),
        *_percentiles("latency"),
        *_percentiles("queueing"),
    )
    bound = bounds.groupBy("mode").agg(
        F.max("bound").alias("bound"), F.max("graham").alias("graham"), F.sum("work").alias("work")
    )
    out: pd.DataFrame = (
        per_mode.join(bound, "mode", "left")
        .join(violations(events), "mode", "left")
        .withColumns(
            {
                "lost": F.lit(total_messages) - F.col("finished"),
                "throughput": F.col("messages") / F.col("makespan"),
                "efficiency": F.col("bound") / F.col("makespan"),
            }
        )
    ).toPandas()
    orderly = out.loc[out["mode"] == "orderly", "makespan"]
    out["speedup"] = float(orderly.iloc[0]) / out["makespan"] if len(orderly) else float("nan")
    return out


def latency_quantiles(outcomes: DataFrame, points: int = 100) -> DataFrame:
    """Per mode, the latency at ``points + 1`` evenly spaced quantiles (for a CDF)."""
    qs = [i / points for i in range(points + 1)]
    return outcomes.groupBy("mode").agg(
        F.percentile_approx("latency", qs, ACCURACY).alias("latency_q")
    )


def iter_rows(df: DataFrame) -> Iterator[dict[str, object]]:
    for row in df.collect():
        yield row.asDict()
