"""Analysis in Spark: per mode and queue makespan, throughput, latency, bounds,
efficiency, speedup over orderly, and ordering violations recomputed from the
event log.

Two steps, so that the event log never has to be shuffled. The events of a queue
never span consumer instances, so each replay task summarises its own events
(:func:`summarise_events`, pandas inside the Spark task: counts, violations, exact
per-queue percentiles, latency histograms) into one :data:`CONSUMER_SCHEMA` row per
mode; Spark then aggregates those rows per mode (:func:`mode_summary`,
:func:`queue_summary`, :func:`merged_histograms`). A written event log is summarised
the same way by :func:`summarise_event_log`, and :func:`violations` recounts the
violations over it in Spark SQL (the CLI cross-checks the two when it writes the log).

Times are seconds since each consumer instance started (virtual seconds in
virtual time). Latency of a message = end of its last attempt - publish time;
queueing time = start of its first attempt - publish time. A percentile is the
smallest value with at least p of the values at or below it: exact per queue; per
mode read from histograms merged across consumer instances, whose buckets are
0.2 % wide (:data:`HIST_GAMMA`), so it is a latency that occurred, at most 0.2 %
above the exact percentile (exact when no bucket holds two distinct values).

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

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from .bounds import FloatArray, graham_bound, makespan_lower_bound, orderly_chain, stage_chain
from .workload import Workload

__all__ = (
    "BOUND_SCHEMA",
    "CONSUMER_SCHEMA",
    "compute_bounds",
    "event_violations",
    "latency_quantiles",
    "merged_histograms",
    "mode_summary",
    "queue_summary",
    "summarise_event_log",
    "summarise_events",
    "violations",
)

PERCENTILES = (0.5, 0.95, 0.99)
IntArray = npt.NDArray[np.int64]
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


def consumer_bounds(
    pdf: pd.DataFrame, modes: Sequence[str], workers: int, max_reconsume: int | None
) -> pd.DataFrame:
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
        bound = max(
            makespan_lower_bound(jobs, workers), float(np.max(publish + work)) if len(work) else 0.0
        )
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
                    stages.append(
                        (
                            np.repeat(
                                stage_df["_cost"].to_numpy(), stage_df["_attempts"].to_numpy()
                            ),
                            stage_df["_publish"].to_numpy(),
                            stage_df["_work"].to_numpy(),
                        )
                    )
                bound = max(bound, stage_chain(stages, workers))
        rows.append(
            {
                "mode": mode,
                "consumer": int(pdf["consumer"].iloc[0]),
                "bound": bound,
                "graham": graham_bound(jobs, workers),
                "work": float(work.sum()),
            }
        )
    return pd.DataFrame(rows, columns=[f.name for f in BOUND_SCHEMA.fields]).astype(
        {"mode": object, "consumer": "int32"}
    )


HIST_GAMMA = 1.002
"""Bucket ratio of the latency histograms: bucket ``k`` holds the values in
``[HIST_GAMMA**k, HIST_GAMMA**(k + 1))`` (values <= 0 share bucket ``ZERO_BUCKET``)."""
ZERO_BUCKET = -(1 << 31)
_LOG_GAMMA = math.log(HIST_GAMMA)

_QUEUE_FIELDS: tuple[tuple[str, Any], ...] = (
    ("qid", IntegerType()),
    ("topic", IntegerType()),
    ("queue", IntegerType()),
    ("messages", LongType()),
    ("makespan", DoubleType()),
    *((f"latency_p{round(p * 100)}", DoubleType()) for p in PERCENTILES),
    *((f"queueing_p{round(p * 100)}", DoubleType()) for p in PERCENTILES),
)
_COUNTS = (
    "inputs",
    "messages",
    "attempts",
    "duplicates",
    "finished",
    "dead_lettered",
    "queue_order_violations",
    "stage_order_violations",
    "stage_mismatches",
)
_HISTS = ("latency", "queueing")

CONSUMER_SCHEMA = StructType(
    [
        StructField("mode", StringType(), False),
        StructField("consumer", IntegerType(), False),
        *(StructField(name, LongType(), False) for name in _COUNTS),
        StructField("makespan", DoubleType(), True),
        StructField("bound", DoubleType(), True),
        StructField("graham", DoubleType(), True),
        StructField("work", DoubleType(), True),
        StructField("cpu_seconds", DoubleType(), False),
        StructField(
            "queues",
            ArrayType(StructType([StructField(n, t, True) for n, t in _QUEUE_FIELDS]), False),
            False,
        ),
        *(
            StructField(f"{h}_{part}", ArrayType(t, False), False)
            for h in _HISTS
            for part, t in (("keys", IntegerType()), ("counts", LongType()), ("max", DoubleType()))
        ),
    ]
)
"""One row per mode and consumer instance: what :func:`summarise_events` computes
inside the replay task (counts, violations, per-queue numbers, latency histograms)
plus that consumer's bounds. ``inputs``: messages the consumer was given."""


def histogram(values: FloatArray) -> tuple[IntArray, IntArray, FloatArray]:
    """Log buckets of ``values``: (bucket keys ascending, counts, largest value of each).

    Mergeable across tasks (add counts, take the max per key); a quantile read from
    it is a value that occurred, within a factor ``HIST_GAMMA`` of the exact one, and
    exact when no bucket holds two distinct values.
    """
    keys = np.full(len(values), ZERO_BUCKET, dtype=np.int64)
    positive = values > 0
    keys[positive] = np.floor(np.log(values[positive]) / _LOG_GAMMA)
    order = np.lexsort((values, keys))
    k, v = keys[order], values[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if len(k) else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], len(k)].astype(np.int64)
    return k[starts].astype(np.int32), (ends - starts).astype(np.int64), v[ends - 1]


def histogram_quantiles(counts: IntArray, maxima: FloatArray, qs: Sequence[float]) -> list[float]:
    """The smallest bucket maximum with at least ``q`` of the values at or below it
    (buckets in ascending order)."""
    total = int(counts.sum())
    if total == 0:
        return [math.nan] * len(qs)
    cum = np.cumsum(counts)
    ranks = np.maximum(1, np.ceil(np.asarray(qs) * total - 1e-9)).astype(np.int64)
    return [float(maxima[i]) for i in np.searchsorted(cum, ranks, side="left")]


def _group_quantiles(groups: IntArray, values: FloatArray, qs: Sequence[float]) -> FloatArray:
    """Exact per-group quantiles (groups 0..g-1): the smallest value with at least
    ``q`` of the group's values at or below it. Shape (g, len(qs))."""
    order = np.lexsort((values, groups))
    g, v = groups[order], values[order]
    sizes = np.bincount(g)
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    ranks = np.maximum(1, np.ceil(np.outer(sizes, qs) - 1e-9)).astype(np.int64)
    return v[starts[:, None] + ranks - 1]  # type: ignore[no-any-return]


def _ordered_violations(
    key: IntArray, order: IntArray, start: FloatArray, end: FloatArray, weight: IntArray
) -> int:
    """Sum of ``weight`` over items that start before some earlier item of their
    ``key`` (earlier by ``order``, then by start) ended."""
    if len(key) == 0:
        return 0
    idx = np.lexsort((start, order, key))
    k, s, n = key[idx], start[idx], weight[idx]
    ends = pd.Series(end[idx])
    prev = ends.groupby(k).cummax().groupby(k).shift(1).to_numpy(dtype=np.float64)
    return int(n[s < prev].sum())  # NaN (first of its key) compares False


def _segments(*keys: Any) -> tuple[IntArray, IntArray]:
    """Sort by ``keys`` (the last one first, as :func:`numpy.lexsort`): the order and
    the start of each run of equal keys in it (``keys`` non-empty)."""
    order = np.lexsort(keys)
    change = np.zeros(len(order), dtype=bool)
    change[0] = True
    for key in keys:
        k = key[order]
        change[1:] |= k[1:] != k[:-1]
    return order, np.flatnonzero(change)


def _calls(
    key: IntArray, batch: IntArray, rank: Any, start: FloatArray, end: FloatArray
) -> tuple[IntArray, Any, FloatArray, FloatArray, IntArray]:
    """Per handler call and ``key``: the key, min ``rank``, first start, last end and
    the number of messages (event rows)."""
    order, starts = _segments(batch, key)
    counts = np.diff(np.r_[starts, len(order)])
    # fmin: a missing rank (NaN) is skipped, like SQL's min
    return (
        key[order][starts],
        np.fmin.reduceat(rank[order], starts),
        np.minimum.reduceat(start[order], starts),
        np.maximum.reduceat(end[order], starts),
        counts,
    )


def _codes(values: pd.Series) -> IntArray:
    """Integer codes of ``values`` (missing values get one code of their own)."""
    codes, _ = pd.factorize(values, use_na_sentinel=False)
    return np.asarray(codes, dtype=np.int64)


def event_violations(events: pd.DataFrame) -> dict[str, int]:
    """The violations (module docstring) of one mode's events, in pandas and numpy.

    The same rules as :func:`violations`, for the events of one consumer instance
    and mode (queues never span consumer instances); run inside the replay tasks.
    """
    out = {"queue_order_violations": 0, "stage_order_violations": 0, "stage_mismatches": 0}
    if len(events) == 0:
        return out
    qid = events["qid"].to_numpy(dtype=np.int64)
    batch = events["batch"].to_numpy(dtype=np.int64)
    offset = events["offset"].to_numpy(dtype=np.int64)
    start = events["start"].to_numpy(dtype=np.float64)
    end = events["end"].to_numpy(dtype=np.float64)
    cq, lo, s, e, n = _calls(qid, batch, offset, start, end)
    out["queue_order_violations"] = _ordered_violations(cq, lo, s, e, n)

    has = events["strategy"].notna().to_numpy()
    if has.any():
        expected = (
            events["expected_stage"]
            .astype("Float64")
            .to_numpy(dtype=np.float64, na_value=np.nan)[has]
        )
        rank = np.where(expected < 0, float(_TAIL_RANK), expected)
        strategy = _codes(events["strategy"][has])
        grp = _codes(events["grp"][has])
        key = (qid[has] * (strategy.max() + 1) + strategy) * (grp.max() + 1) + grp
        k, r, s, e, n = _calls(key, batch[has], rank, start[has], end[has])
        parts = pd.DataFrame({"key": k, "rank": r, "s": s, "e": e, "n": n})
        parts = parts[parts["rank"].notna()]
        ends = parts.groupby(["key", "rank"], sort=True)["e"].max().reset_index()
        running = ends.groupby("key")["e"].cummax()
        ends["barrier"] = running.groupby(ends["key"]).shift(1)
        merged = parts.merge(ends[["key", "rank", "barrier"]], on=["key", "rank"], how="inner")
        out["stage_order_violations"] = int(merged.loc[merged["s"] < merged["barrier"], "n"].sum())

    staged = (events["mode"] == "staged").to_numpy()
    if staged.any():
        reported = events["stage"].astype("Float64")
        contract = events["expected_stage"].astype("Float64").fillna(-1.0)
        bad = (reported.isna() | (reported != contract)).to_numpy(dtype=bool, na_value=True)
        bad &= staged
        if bad.any():
            out["stage_mismatches"] = int(
                events.loc[bad, ["qid", "offset"]].drop_duplicates().shape[0]
            )
    return out


def summarise_events(events: pd.DataFrame, *, inputs: int | None = None) -> dict[str, Any]:
    """One :data:`CONSUMER_SCHEMA` row (without bounds and CPU) from the events of
    one consumer instance in one mode.

    Latency of a message = end of its last attempt - publish; queueing = start of
    its first attempt - publish. Per-queue percentiles are exact; the per-mode ones
    are read later from the merged histograms.
    """
    if len(events) == 0:
        raise ValueError("summarise_events needs at least one event")
    mode = str(events["mode"].iloc[0])
    consumer = int(events["consumer"].iloc[0])
    order, starts = _segments(events["offset"].to_numpy(), events["qid"].to_numpy())
    attempts_of = np.diff(np.r_[starts, len(order)])

    def first(column: str) -> Any:
        return events[column].to_numpy()[order][starts]

    qid = first("qid")
    finish = np.maximum.reduceat(events["end"].to_numpy(dtype=np.float64)[order], starts)
    first_start = np.minimum.reduceat(events["start"].to_numpy(dtype=np.float64)[order], starts)
    publish = first("publish").astype(np.float64)
    latency = finish - publish
    queueing = first_start - publish
    successes = np.add.reduceat(events["ok"].to_numpy(dtype=np.int64)[order], starts)
    dlq = np.maximum.reduceat(events["dlq"].to_numpy(dtype=np.int64)[order], starts) > 0
    messages = len(starts)

    queue_ids, group = np.unique(qid, return_inverse=True)
    first_of_queue = np.r_[0, np.flatnonzero(np.diff(group)) + 1]
    lat_q = _group_quantiles(group, latency, PERCENTILES)
    que_q = _group_quantiles(group, queueing, PERCENTILES)
    makespans = np.full(len(queue_ids), -np.inf)
    np.maximum.at(makespans, group, finish)
    topics = first("topic")[first_of_queue]
    queue_nums = first("queue")[first_of_queue]
    sizes = np.bincount(group, minlength=len(queue_ids))
    queues = [
        {
            "qid": int(queue_ids[i]),
            "topic": int(topics[i]),
            "queue": int(queue_nums[i]),
            "messages": int(sizes[i]),
            "makespan": float(makespans[i]),
            **{f"latency_p{round(p * 100)}": float(lat_q[i, j]) for j, p in enumerate(PERCENTILES)},
            **{
                f"queueing_p{round(p * 100)}": float(que_q[i, j]) for j, p in enumerate(PERCENTILES)
            },
        }
        for i in range(len(queue_ids))
    ]
    row: dict[str, Any] = {
        "mode": mode,
        "consumer": consumer,
        "inputs": messages if inputs is None else inputs,
        "messages": messages,
        "attempts": int(attempts_of.sum()),
        "duplicates": int((successes > 1).sum()),
        "finished": int(((successes >= 1) | dlq).sum()),
        "dead_lettered": int(dlq.sum()),
        **event_violations(events),
        "makespan": float(finish.max()) if len(finish) else None,
        "queues": queues,
    }
    for name, values in (("latency", latency), ("queueing", queueing)):
        keys, counts, maxima = histogram(values)
        row[f"{name}_keys"] = keys
        row[f"{name}_counts"] = counts
        row[f"{name}_max"] = maxima
    return row


def consumer_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Rows of :data:`CONSUMER_SCHEMA` as a pandas frame Spark's Arrow writer takes."""
    frame = pd.DataFrame(list(rows), columns=[f.name for f in CONSUMER_SCHEMA.fields])
    return frame.astype(
        {
            "mode": object,
            "consumer": "int32",
            "cpu_seconds": "float64",
            **dict.fromkeys(_COUNTS, "int64"),
        }
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
    return messages.groupBy(*group_keys(messages)).applyInPandas(per_consumer, schema=BOUND_SCHEMA)


def violations(events: DataFrame) -> DataFrame:
    """Per mode: queue-order and stage-order violations and stage mismatches."""
    calls = events.groupBy("mode", "consumer", "qid", "batch").agg(
        F.min("offset").alias("lo"),
        F.min("start").alias("s"),
        F.max("end").alias("e"),
        F.count(F.lit(1)).alias("n"),  # a call holds each of its messages once
    )
    before = (
        Window.partitionBy("mode", "qid")
        .orderBy("lo", "s")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    queue_bad = (
        calls.withColumn("prev_end", F.max("e").over(before))
        .where(F.col("s") < F.col("prev_end"))
        .groupBy("mode")
        .agg(F.sum("n").alias("queue_order_violations"))
    )

    staged = events.select(
        "mode",
        "consumer",
        "qid",
        "offset",
        "batch",
        "start",
        "end",
        "stage",
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
        Window.partitionBy("mode", "qid", "strat", "grp_key")
        .orderBy("rank")
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


def summarise_event_log(events: DataFrame, bounds: DataFrame | None = None) -> DataFrame:
    """:data:`CONSUMER_SCHEMA` rows from an event log (e.g. a written one), in Spark.

    The replay computes these rows inside its tasks without materialising the log
    (:func:`~benchmarks.replay.spark.replay_summaries`); this is the same
    computation for a log that exists, grouped by mode and consumer instance.
    ``bounds``: :data:`BOUND_SCHEMA` rows to fill in the bound columns.
    """

    def per_group(pdf: pd.DataFrame) -> pd.DataFrame:
        row = summarise_events(pdf)
        row.update(bound=None, graham=None, work=None, cpu_seconds=0.0)
        return consumer_frame([row])

    rows = events.groupBy("mode", "consumer").applyInPandas(per_group, schema=CONSUMER_SCHEMA)
    if bounds is None:
        return rows
    names = [f.name for f in CONSUMER_SCHEMA.fields]
    return (
        rows.drop("bound", "graham", "work")
        .join(bounds, ["mode", "consumer"], "left")
        .select(*names)
    )


def merged_histograms(per_consumer: DataFrame) -> pd.DataFrame:
    """Per mode, metric (latency, queueing) and bucket: count and largest value,
    merged across consumer instances in Spark (a few thousand rows per mode)."""
    parts = [
        per_consumer.select(
            "mode",
            F.lit(name).alias("metric"),
            F.explode(
                F.arrays_zip(
                    F.col(f"{name}_keys").alias("key"),
                    F.col(f"{name}_counts").alias("n"),
                    F.col(f"{name}_max").alias("max"),
                )
            ).alias("b"),
        ).select("mode", "metric", "b.key", "b.n", "b.max")
        for name in _HISTS
    ]
    union = parts[0].unionByName(parts[1])
    merged: pd.DataFrame = (
        union.groupBy("mode", "metric", "key")
        .agg(F.sum("n").alias("n"), F.max("max").alias("max"))
        .toPandas()
    )
    return merged.sort_values(["mode", "metric", "key"], kind="stable").reset_index(drop=True)


def _hist_quantiles(
    hists: pd.DataFrame, mode: str, metric: str, qs: Sequence[float]
) -> list[float]:
    sel = hists[(hists["mode"] == mode) & (hists["metric"] == metric)]
    return histogram_quantiles(
        sel["n"].to_numpy(dtype=np.int64), sel["max"].to_numpy(dtype=np.float64), qs
    )


def mode_summary(per_consumer: DataFrame, hists: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per mode: the headline numbers (see the module docstring), collected.

    ``per_consumer``: :data:`CONSUMER_SCHEMA` rows; ``hists``: their
    :func:`merged_histograms` (computed when not given).
    """
    if hists is None:
        hists = merged_histograms(per_consumer)
    out: pd.DataFrame = (
        per_consumer.groupBy("mode")
        .agg(
            *(F.sum(c).alias(c) for c in _COUNTS),
            F.max("makespan").alias("makespan"),
            F.max("bound").alias("bound"),
            F.max("graham").alias("graham"),
            F.sum("work").alias("work"),
        )
        .withColumns(
            {
                "lost": F.col("inputs") - F.col("finished"),
                "throughput": F.col("messages") / F.col("makespan"),
                "efficiency": F.col("bound") / F.col("makespan"),
            }
        )
        .drop("inputs")
    ).toPandas()
    for metric in _HISTS:
        values = [_hist_quantiles(hists, m, metric, PERCENTILES) for m in out["mode"]]
        for j, p in enumerate(PERCENTILES):
            out[f"{metric}_p{round(p * 100)}"] = [v[j] for v in values]
    orderly = out.loc[out["mode"] == "orderly", "makespan"]
    out["speedup"] = float(orderly.iloc[0]) / out["makespan"] if len(orderly) else float("nan")
    return out


def queue_summary(per_consumer: DataFrame) -> DataFrame:
    """Per mode and queue: makespan, throughput, latency and queueing percentiles
    (exact, computed in the replay tasks), and speedup over orderly on that queue."""
    per_queue = per_consumer.select("mode", "consumer", F.inline("queues"))
    per_queue = per_queue.withColumn("throughput", F.col("messages") / F.col("makespan"))
    orderly = per_queue.where(F.col("mode") == "orderly").select(
        "qid", F.col("makespan").alias("_orderly")
    )
    return (
        per_queue.join(orderly, "qid", "left")
        .withColumn("speedup", F.col("_orderly") / F.col("makespan"))
        .drop("_orderly")
    )


def latency_quantiles(hists: pd.DataFrame, points: int = 100) -> pd.DataFrame:
    """Per mode, the latency at ``points + 1`` evenly spaced quantiles (for a CDF)."""
    qs = [i / points for i in range(points + 1)]
    modes = sorted(set(hists["mode"]))
    return pd.DataFrame(
        {
            "mode": modes,
            "latency_q": [_hist_quantiles(hists, m, "latency", qs) for m in modes],
        }
    )
