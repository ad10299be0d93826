"""Spark plumbing: the session, shipping this code to executors, the replay stage.

The replay stage groups the messages by consumer instance (``groupBy("consumer")
.applyInPandas``): each Spark task runs the real :class:`~stagedconsumer.PushConsumer`
over one consumer instance's queues, once per mode, and summarises the events it
made (:func:`replay_summaries`; :func:`replay_events` returns the raw event log
instead, for a log to keep in Spark). The grouping comes from the
workload (``consumerPerSubscription``), not from Spark's partitioning, so results
do not depend on the number of cores or executors.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import weakref
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyspark import Accumulator, StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DataType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from .runner import ReplayConfig, collector_paused, replay_consumer

__all__ = (
    "EVENT_ARROW_SCHEMA",
    "EVENT_SCHEMA",
    "by_consumer",
    "clear_events",
    "get_session",
    "group_keys",
    "mark_by_consumer",
    "replay_events",
    "replay_summaries",
    "ship_code",
    "write_event_part",
)

EVENT_SCHEMA = StructType(
    [
        StructField("mode", StringType(), False),
        StructField("consumer", IntegerType(), False),
        StructField("topic", IntegerType(), False),
        StructField("queue", IntegerType(), False),
        StructField("qid", IntegerType(), False),
        StructField("offset", LongType(), False),
        StructField("stage", IntegerType(), True),
        StructField("attempt", IntegerType(), False),
        StructField("batch", LongType(), False),
        StructField("start", DoubleType(), False),
        StructField("end", DoubleType(), False),
        StructField("ok", BooleanType(), False),
        StructField("dlq", BooleanType(), False),
        StructField("publish", DoubleType(), False),
        StructField("strategy", StringType(), True),
        StructField("grp", StringType(), True),
        StructField("expected_stage", IntegerType(), True),
    ]
)

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = ("benchmarks", "stagedconsumer", "offsetstore")
_SHIPPED: set[str] = set()


def get_session(
    master: str = "local[*]",
    *,
    app_name: str = "stagedconsumer-replay",
    shuffle_partitions: int | None = None,
    driver_memory: str = "4g",
) -> SparkSession:
    """A SparkSession on ``master`` (any Spark master URL)."""
    # Executors must run the same interpreter as the driver (pandas, trio, ...).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Spark binds to this machine's loopback address (and says nothing about the
    # hostname resolving to it) unless told otherwise.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.driver.memory", driver_memory)
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
    )
    if shuffle_partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def ship_code(spark: SparkSession) -> None:
    """Send ``benchmarks.replay``, ``stagedconsumer`` and ``offsetstore`` to the
    executors as a zip (their third-party dependencies must be installed there)."""
    app_id = spark.sparkContext.applicationId
    if app_id in _SHIPPED:
        return
    target = Path(tempfile.mkdtemp(prefix="replay-code-")) / "stagedconsumer_replay.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
        paths = [
            _ROOT / "benchmarks" / "__init__.py",
            *sorted((_ROOT / "benchmarks" / "replay").rglob("*.py")),
        ]
        for package in _PACKAGES[1:]:
            paths += sorted((_ROOT / package).rglob("*.py"))
        for path in paths:
            zf.write(path, path.relative_to(_ROOT).as_posix())
    spark.sparkContext.addPyFile(str(target))
    _SHIPPED.add(app_id)


def replay_events(
    messages: DataFrame,
    config: ReplayConfig,
    modes: Sequence[str],
    *,
    wall_clock: bool = False,
    cpu_seconds: Accumulator[float] | None = None,
    engine: str = "runtime",
) -> DataFrame:
    """The event log of replaying every consumer instance in every mode.

    ``messages`` should come from :func:`by_consumer` (one partition per consumer
    instance); otherwise it is partitioned here. ``cpu_seconds``, when given, adds up
    the CPU time the Python workers spent replaying (a measure of the work that does
    not depend on what else the machine runs).
    """
    chosen = tuple(modes)

    def replay_group(pdf: pd.DataFrame) -> Iterator[pd.DataFrame]:
        pdf = pdf.sort_values(["qid", "offset"], kind="stable").reset_index(drop=True)
        start = time.process_time()
        prepared = _prepare(pdf, engine)
        if cpu_seconds is not None:
            cpu_seconds.add(time.process_time() - start)
        for mode in chosen:
            start = time.process_time()
            events = replay_consumer(
                pdf, mode, config, wall_clock=wall_clock, engine=engine, prepared=prepared
            )
            if cpu_seconds is not None:
                cpu_seconds.add(time.process_time() - start)
            yield events

    def replay_all(pdf: pd.DataFrame) -> pd.DataFrame:
        return pd.concat(list(replay_group(pdf)), ignore_index=True)

    if not _is_by_consumer(messages):
        messages = by_consumer(messages)
    return messages.groupBy(*group_keys(messages)).applyInPandas(replay_all, schema=EVENT_SCHEMA)


def _arrow_type(t: DataType) -> pa.DataType:
    simple: dict[type[DataType], pa.DataType] = {
        StringType: pa.string(),
        IntegerType: pa.int32(),
        LongType: pa.int64(),
        DoubleType: pa.float64(),
        BooleanType: pa.bool_(),
    }
    return simple[type(t)]


EVENT_ARROW_SCHEMA = pa.schema(
    [pa.field(f.name, _arrow_type(f.dataType), f.nullable) for f in EVENT_SCHEMA.fields]
)
""":data:`EVENT_SCHEMA` for pyarrow: every part file of a log gets the same types
(an all-null ``grp`` column would otherwise become Arrow's null type)."""


def events_location(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and path of an event-log directory (a local path or any URI
    pyarrow knows: ``hdfs://``, ``s3://``, ...; executors must all reach it)."""
    if "://" in path:
        fs, where = pafs.FileSystem.from_uri(path)
        return fs, str(where)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def clear_events(path: str) -> None:
    """Empty (or create) an event-log directory before a replay writes into it."""
    fs, where = events_location(path)
    fs.create_dir(where, recursive=True)
    fs.delete_dir_contents(where)


def write_event_part(path: str, events: pd.DataFrame) -> None:
    """Write one consumer instance's events of one mode as a part file of ``path``."""
    if len(events) == 0:
        return
    fs, where = events_location(path)
    name = f"part-c{int(events['consumer'].iloc[0]):06d}-{events['mode'].iloc[0]}.parquet"
    table = pa.Table.from_pandas(events, schema=EVENT_ARROW_SCHEMA, preserve_index=False)
    pq.write_table(table, f"{where}/{name}", filesystem=fs)


def replay_summaries(
    messages: DataFrame,
    config: ReplayConfig,
    modes: Sequence[str],
    *,
    workers: int,
    max_reconsume: int | None,
    wall_clock: bool = False,
    events_path: str | None = None,
    engine: str = "runtime",
) -> DataFrame:
    """Replay every consumer instance in every mode and summarise, in one Spark stage.

    Each task takes one consumer instance's messages, computes its bounds
    (:func:`~benchmarks.replay.analysis.consumer_bounds`), replays each mode and
    summarises that mode's event log where it was made
    (:func:`~benchmarks.replay.analysis.summarise_events`: the events of a queue never
    span tasks), so the 3 x N events need no shuffle: the result is one
    :data:`~benchmarks.replay.analysis.CONSUMER_SCHEMA` row per mode and consumer.
    ``events_path``: also write the event log there as Parquet, one part file per
    consumer instance and mode (a directory every executor can write). ``engine``:
    see :data:`~benchmarks.replay.runner.ENGINES`; a mode's ``cpu_seconds`` includes
    its share of building the core engine's stored messages (built once for all modes).
    """
    from .analysis import CONSUMER_SCHEMA, consumer_bounds, consumer_frame, summarise_events

    chosen = tuple(modes)

    def replay_group(pdf: pd.DataFrame) -> pd.DataFrame:
        with collector_paused():  # see collector_paused: the task holds every message
            return replay_consumer_group(pdf)

    def replay_consumer_group(pdf: pd.DataFrame) -> pd.DataFrame:
        pdf = pdf.sort_values(["qid", "offset"], kind="stable").reset_index(drop=True)
        bounds = consumer_bounds(pdf, chosen, workers, max_reconsume).set_index("mode")
        rows = []
        start = time.process_time()
        prepared = _prepare(pdf, engine)
        shared = (time.process_time() - start) / len(chosen)
        for mode in chosen:
            start = time.process_time()
            events = replay_consumer(
                pdf, mode, config, wall_clock=wall_clock, engine=engine, prepared=prepared
            )
            cpu = time.process_time() - start + shared
            if events_path is not None:
                write_event_part(events_path, events)
            row = summarise_events(events, inputs=len(pdf))
            row.update(
                mode=mode,
                consumer=int(pdf["consumer"].iloc[0]),
                cpu_seconds=cpu,
                bound=float(bounds.loc[mode, "bound"]),
                graham=float(bounds.loc[mode, "graham"]),
                work=float(bounds.loc[mode, "work"]),
            )
            rows.append(row)
        return consumer_frame(rows)

    if not _is_by_consumer(messages):
        messages = by_consumer(messages)
    return messages.groupBy(*group_keys(messages)).applyInPandas(
        replay_group, schema=CONSUMER_SCHEMA
    )


def _prepare(pdf: pd.DataFrame, engine: str) -> object:
    """The core engine's stored messages of ``pdf``, shared by its modes."""
    if engine != "core":
        return None
    from .engine import Prepared

    return Prepared(pdf)


_BY_CONSUMER: weakref.WeakSet[DataFrame] = weakref.WeakSet()


def _is_by_consumer(df: DataFrame) -> bool:
    return df in _BY_CONSUMER


def mark_by_consumer(df: DataFrame) -> DataFrame:
    """Note that ``df`` keeps :func:`by_consumer`'s partitioning (and ``part``)."""
    _BY_CONSUMER.add(df)
    return df


def by_consumer(
    messages: DataFrame, consumers: int | None = None, *, persist: bool = False
) -> DataFrame:
    """One partition per consumer instance (so one Spark task each).

    Adds a ``part`` column whose Spark hash lands consumer ``c`` in partition ``c``
    exactly, and hash-partitions on it into as many partitions as consumers: grouping
    by ``("part", "consumer")`` then needs no other shuffle, no two consumers share a
    task (range partitioning's sampled bounds can put two in one), and the explicit
    partition count keeps adaptive query execution from coalescing the (small in
    bytes, long to replay) partitions into one task.
    """
    spark = messages.sparkSession
    if consumers is None:
        first = messages.agg(F.max("consumer")).first()
        consumers = 1 if first is None or first[0] is None else int(first[0]) + 1
    residues = (
        spark.range(0, 64 * consumers + 4096)
        .select("id", F.pmod(F.hash("id"), F.lit(consumers)).alias("p"))
        .groupBy("p")
        .agg(F.min("id").alias("id"))
        .collect()
    )
    key_of = {int(r["p"]): int(r["id"]) for r in residues}
    if len(key_of) < consumers:  # pragma: no cover - 64 draws per residue suffice
        raise RuntimeError(f"no partition key found for some of {consumers} consumers")
    mapping = F.create_map(
        *(x for c in range(consumers) for x in (F.lit(c), F.lit(key_of[c]).cast("long")))
    )
    out = messages.withColumn("part", mapping[F.col("consumer")]).repartition(consumers, "part")
    if persist:
        # bounds and replay (and a wall-clock replay) all read it: shuffle once
        out = out.persist(StorageLevel.MEMORY_AND_DISK)
    _BY_CONSUMER.add(out)
    return out


def group_keys(messages: DataFrame) -> list[str]:
    """The grouping that matches :func:`by_consumer`'s partitioning."""
    return ["part", "consumer"] if "part" in messages.columns else ["consumer"]
