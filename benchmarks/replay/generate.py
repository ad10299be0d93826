"""Generation: a workload becomes a deterministic DataFrame of messages.

Every random draw is a pure function of ``(seed, salt, queue, offset)`` through
Spark's ``xxhash64``, never of the partitioning, so the same workload and seed give
the same messages on any number of cores or executors.

Columns (one row per message): ``consumer`` (consumer instance owning the queue),
``topic``, ``queue`` (queue id in its topic), ``qid`` (global queue index),
``offset``, ``key``, ``strategy`` (stage strategy id, null = no stage), ``grp``
(stage group id), ``size`` (bytes), ``cost_us`` (handler cost per attempt, in
microseconds), ``fail_attempts`` (how many first attempts fail), ``publish_us``
(publish time) and ``stage`` (the stage index the contract assigns: the stage
offset is the message's rank within its queue and stage key; ``-1`` the tail,
null for messages without a stage).
"""

from __future__ import annotations

import math
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from .workload import NO_STAGE, RecordedTrafficError, Workload

__all__ = ("MESSAGE_COLUMNS", "add_derived_columns", "generate_messages", "import_recorded")

MESSAGE_COLUMNS: tuple[str, ...] = (
    "consumer",
    "topic",
    "queue",
    "qid",
    "offset",
    "key",
    "strategy",
    "grp",
    "size",
    "cost_us",
    "fail_attempts",
    "publish_us",
    "stage",
)

_MASK53 = (1 << 53) - 1


def _uniform(seed: int, salt: int) -> Column:
    """A uniform draw in (0, 1), a pure function of (seed, salt, qid, offset)."""
    h = F.xxhash64(F.lit(seed), F.lit(salt), F.col("qid"), F.col("offset"))
    return (h.bitwiseAND(F.lit(_MASK53)).cast("double") + F.lit(0.5)) / F.lit(float(1 << 53))


def _cost_ms(w: Workload) -> Column:
    p = w.cost.params
    dist = w.cost.distribution
    if dist == "constant":
        return F.lit(p["ms"])
    u = _uniform(w.seed, 1)
    if dist == "uniform":
        return F.lit(p["minMs"]) + u * F.lit(p["maxMs"] - p["minMs"])
    if dist == "exponential":
        return -F.lit(p["meanMs"]) * F.log(u)
    # lognormal through Box-Muller
    z = F.sqrt(F.lit(-2.0) * F.log(u)) * F.cos(F.lit(2 * math.pi) * _uniform(w.seed, 2))
    return F.lit(p["medianMs"]) * F.exp(F.lit(p["sigma"]) * z)


def _fail_attempts(w: Workload) -> Column:
    f = w.failures
    if f.probability <= 0 or f.max_failures == 0:
        return F.lit(0)
    # P(fail_attempts >= k) = p ** k: attempts fail independently with probability p
    draw = F.floor(F.log(_uniform(w.seed, 3)) / F.lit(math.log(f.probability)))
    return F.least(draw, F.lit(f.max_failures)).cast("int")


def _key(w: Workload, queue_count: int) -> Column:
    if w.key_distributor == "NO_KEY":
        return F.lit(None).cast("string")
    if w.key_distributor == "KEY_ROUND_ROBIN":
        index = F.col("offset") * F.lit(queue_count) + F.col("qid")
        return F.concat(F.lit("k"), (index % F.lit(w.key_count)).cast("string"))
    h = F.xxhash64(F.lit(w.seed), F.lit(4), F.col("qid"), F.col("offset"))
    return F.concat(F.lit("k"), F.pmod(h, F.lit(w.key_count)).cast("string"))


def _strategy(w: Workload) -> Column:
    weights = w.stages.strategy_weights
    if not weights:
        return F.lit("default")
    total = sum(weights.values())
    u = _uniform(w.seed, 5)
    expr: Any = None
    acc = 0.0
    items = [(name, weight) for name, weight in weights.items() if weight > 0]
    for i, (name, weight) in enumerate(items):
        acc += weight / total
        value = F.lit(None).cast("string") if name == NO_STAGE else F.lit(name)
        if i == len(items) - 1:
            expr = value if expr is None else expr.otherwise(value)
        else:
            cond = u < F.lit(acc)
            expr = F.when(cond, value) if expr is None else expr.when(cond, value)
    assert expr is not None
    return expr  # type: ignore[no-any-return]


def _stage_index(w: Workload, stage_offset: Column) -> Column:
    """The contract's stage index from the stage offset and the strategy."""
    expr: Any = None
    for name, sizes in w.stages.all_strategies().items():
        bound = 0
        inner: Any = None
        for index, size in enumerate(sizes):
            bound += size
            cond = stage_offset < F.lit(bound)
            inner = F.when(cond, F.lit(index)) if inner is None else inner.when(cond, F.lit(index))
        stage = F.lit(-1) if inner is None else inner.otherwise(F.lit(-1))
        cond = F.col("strategy") == F.lit(name)
        expr = F.when(cond, stage) if expr is None else expr.when(cond, stage)
    assert expr is not None
    return expr.cast("int")  # type: ignore[no-any-return]


def add_derived_columns(
    df: DataFrame, w: Workload, queue_count: int, *, by_consumer: bool = False
) -> DataFrame:
    """Consumer assignment, strategy, group and the contract's stage of each message.

    ``df`` needs ``qid``, ``offset`` and ``key``. ``by_consumer``: partition the result
    as :func:`~benchmarks.replay.spark.by_consumer` does (with its ``part`` column)
    before the window that numbers the stages, so that one shuffle serves both.
    """
    consumers = min(w.consumers, queue_count)
    df = df.withColumn(
        "consumer", F.floor(F.col("qid") * F.lit(consumers) / F.lit(queue_count)).cast("int")
    )
    if by_consumer:
        from .spark import by_consumer as partition_by_consumer

        df = partition_by_consumer(df, consumers)
    if "strategy" not in df.columns:
        df = df.withColumn("strategy", _strategy(w))
    grp = F.col("key") if w.stages.group_by == "key" else F.lit(None).cast("string")
    df = df.withColumn("grp", grp)
    # with "part" first, by_consumer's hash partitioning already satisfies the window
    keys = ["part"] if by_consumer else []
    window = Window.partitionBy(*keys, "qid", "strategy", "grp").orderBy("offset")
    df = df.withColumn("stage", _stage_index(w, F.row_number().over(window) - F.lit(1)))
    df = df.withColumn(
        "stage",
        F.when(F.col("strategy").isNull(), F.lit(None).cast("int")).otherwise(F.col("stage")),
    )
    if not by_consumer:
        return df.select(*MESSAGE_COLUMNS)
    from .spark import mark_by_consumer

    return mark_by_consumer(df.select(*MESSAGE_COLUMNS, "part"))


def generate_messages(spark: SparkSession, w: Workload, *, by_consumer: bool = False) -> DataFrame:
    """The workload's messages, generated deterministically from ``w.seed``.

    ``by_consumer``: one partition per consumer instance, ready for the replay (see
    :func:`add_derived_columns`), with an extra ``part`` column.
    """
    if w.recorded is not None:
        return import_recorded(spark, w, by_consumer=by_consumer)
    queues = w.queue_count
    total = w.message_count
    partitions = max(1, min(200, total // 250_000 + 1))
    df = spark.range(0, total, numPartitions=partitions)
    df = df.select(
        (F.col("id") / F.lit(w.messages_per_queue)).cast("long").cast("int").alias("qid"),
        (F.col("id") % F.lit(w.messages_per_queue)).alias("offset"),
    )
    df = df.withColumns(
        {
            "topic": (F.col("qid") / F.lit(w.partitions_per_topic)).cast("int"),
            "queue": (F.col("qid") % F.lit(w.partitions_per_topic)).cast("int"),
            "key": _key(w, queues),
            "size": F.lit(w.message_size),
            "cost_us": F.greatest(F.round(_cost_ms(w) * F.lit(1000.0)), F.lit(0.0)).cast("long"),
            "fail_attempts": _fail_attempts(w),
        }
    )
    if w.producer_rate > 0:
        # round-robin over queues: message i of the interleaving is published at i / rate
        index = F.col("offset") * F.lit(queues) + F.col("qid")
        publish = F.round(index.cast("double") * F.lit(1e6 / w.producer_rate)).cast("long")
    else:
        publish = F.lit(0).cast("long")
    df = df.withColumn("publish_us", publish)
    return add_derived_columns(df, w, queues, by_consumer=by_consumer)


_RECORDED_NUMBERS: tuple[tuple[str, bool, float], ...] = (
    # column, whole numbers only, largest value (the type it is cast to)
    ("topic", True, 2**31 - 1),
    ("queue", True, 2**31 - 1),
    ("offset", True, 2**53),
    ("size", True, 2**31 - 1),
    ("fail_attempts", True, 2**31 - 1),
    ("cost_ms", False, 2**53 / 1000),
    ("publish_ms", False, 2**53 / 1000),
)
"""The numeric columns of recorded traffic: each value must be a number in [0, largest]."""


def _check_recorded(df: DataFrame, path: str, csv: bool) -> None:
    """Every numeric value present and in range, every offset once per queue; else a
    :class:`RecordedTrafficError` naming the first bad row (in file order) and column.

    Unchecked, an empty or negative ``cost_ms`` reached the replay, which waited
    forever on it, and a repeated offset was reported as a message lost and one
    consumed twice.
    """
    checks = [(name, whole, high) for name, whole, high in _RECORDED_NUMBERS if name in df.columns]
    firsts = []
    for name, whole, high in checks:
        value = F.col(name).try_cast("double")
        ok = value.isNotNull() & ~F.isnan(value) & (value >= 0) & (value <= F.lit(high))
        if whole:
            ok = ok & (value == F.floor(value))
        firsts.append(F.min(F.when(~ok, F.col("_row"))).alias(name))
        firsts.append(F.count(F.when(~ok, 1)).alias(f"{name}_bad"))
    found = df.agg(F.count(F.lit(1)).alias("_rows"), *firsts).first()
    assert found is not None
    if found["_rows"] == 0:
        raise RecordedTrafficError(f"{path}: recorded traffic has no rows")
    bad = [(found[name], name, whole) for name, whole, _ in checks if found[name] is not None]
    if bad:
        row_id, name, whole = min(bad)
        row = df.filter(F.col("_row") <= F.lit(row_id)).count()  # 1-based, in file order
        cell = df.filter(F.col("_row") == F.lit(row_id)).select(name).first()
        assert cell is not None
        got = repr(cell[0]) if cell[0] is not None else "an empty cell" if csv else "null"
        where = f"row {row} (line {row + 1})" if csv else f"row {row}"
        kind = "a whole number" if whole else "a finite number"
        more = found[f"{name}_bad"] - 1
        raise RecordedTrafficError(
            f"{path}: {where}, column {name}: must be {kind} >= 0, got {got}"
            + (f" ({more} more bad value(s) in this column)" if more else "")
        )
    if "offset" in df.columns:
        keys = [c for c in ("topic", "queue") if c in df.columns]
        numbers = [F.col(k).try_cast("double").cast("long").alias(k) for k in (*keys, "offset")]
        repeated = (
            df.groupBy(*numbers)
            .agg(F.count(F.lit(1)).alias("n"))
            .filter(F.col("n") > 1)
            .orderBy(*keys, "offset")
        )
        first = repeated.first()
        if first is not None:
            queue = ", ".join(f"{k} {first[k]}" for k in keys)
            raise RecordedTrafficError(
                f"{path}: offset {first['offset']} appears {first['n']} times in {queue}"
                f" ({repeated.count()} repeated offset(s) in all); each offset of a queue"
                " must appear once"
            )


def import_recorded(spark: SparkSession, w: Workload, *, by_consumer: bool = False) -> DataFrame:
    """Recorded traffic (Parquet/CSV with measured handler times) as messages.

    Raises :class:`~benchmarks.replay.workload.RecordedTrafficError` when a column is
    missing, a numeric value is not a number >= 0 (or not whole where it must be), or an
    offset appears twice in a queue.
    """
    rec = w.recorded
    assert rec is not None
    path = str(rec.path)
    if rec.format == "csv":
        raw = spark.read.csv(path, header=True, inferSchema=True)
    else:
        raw = spark.read.parquet(path)
    cols = set(raw.columns)
    missing = {"queue", "cost_ms"} - cols
    if missing:
        raise RecordedTrafficError(
            f"{path}: recorded traffic needs columns queue and cost_ms; missing"
            f" {', '.join(sorted(missing))} (has {', '.join(sorted(cols))})"
        )
    df = raw.withColumn("_row", F.monotonically_increasing_id())
    _check_recorded(df, path, rec.format == "csv")
    # checked: every value converts (through double: a CSV cell may read as a string)
    df = df.withColumns(
        {name: F.col(name).try_cast("double") for name, _, _ in _RECORDED_NUMBERS if name in cols}
    )
    if "topic" not in cols:
        df = df.withColumn("topic", F.lit(0))
    df = df.withColumn("topic", F.col("topic").cast("int")).withColumn(
        "queue", F.col("queue").cast("int")
    )
    if "offset" in cols:
        df = df.withColumn("offset", F.col("offset").cast("long"))
    else:
        df = df.withColumn(
            "offset",
            (F.row_number().over(Window.partitionBy("topic", "queue").orderBy("_row")) - 1).cast(
                "long"
            ),
        )
    df = df.withColumn(
        "qid", (F.dense_rank().over(Window.orderBy("topic", "queue")) - 1).cast("int")
    )
    df = df.withColumns(
        {
            "key": F.col("key").cast("string") if "key" in cols else F.lit(None).cast("string"),
            "size": F.col("size").cast("int") if "size" in cols else F.lit(w.message_size),
            "cost_us": F.round(F.col("cost_ms").cast("double") * 1000.0).cast("long"),
            "fail_attempts": F.col("fail_attempts").cast("int")
            if "fail_attempts" in cols
            else _fail_attempts(w),
            "publish_us": F.round(F.col("publish_ms").cast("double") * 1000.0).cast("long")
            if "publish_ms" in cols
            else F.lit(0).cast("long"),
        }
    )
    if "strategy" in cols:
        df = df.withColumn("strategy", F.col("strategy").cast("string"))
    queue_count = df.select(F.max("qid")).first()
    assert queue_count is not None
    return add_derived_columns(df, w, int(queue_count[0]) + 1, by_consumer=by_consumer)
