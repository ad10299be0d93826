"""``python -m benchmarks``: replay workloads in PySpark and report.

    python -m benchmarks bench WORKLOAD.yaml [--master URL] [--out DIR]
                                             [--modes orderly staged ...] [--wall-clock]
                                             [--engine core|runtime]
                                             [--events | --no-events]
    python -m benchmarks validate WORKLOAD.yaml ...

``bench`` generates the workload's messages (or imports recorded traffic) and
replays every consumer instance in every mode in virtual time: by default with the
core engine, a discrete-event replay over the consumer's sans-I/O core; with
``--engine runtime`` with the real PushConsumer on trio's MockClock (the same
schedule, at ~15x the CPU). With ``--wall-clock`` it replays again on the real clock,
with the PushConsumer. It analyses the event log (each replay task summarises its
own; Spark aggregates the summaries; with ``--events``, the default for small
workloads, the log is written and its violations recounted in Spark SQL) and writes
Parquet, Markdown and PNG charts to ``--out`` (default ``bench-results/<workload
name>``), printing one table (a row per mode) at the end and a progress bar while
Spark works.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

import pandas as pd
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from . import analysis, report
from .generate import generate_messages
from .runner import ENGINES, ReplayConfig
from .spark import clear_events, get_session, mark_by_consumer, replay_summaries, ship_code
from .workload import MODES, Workload, WorkloadError, load_workload

__all__ = ("BenchResult", "build_parser", "main", "run_bench")

T = TypeVar("T")


class _SparkProgress:
    """Shows the tasks of the Spark jobs of the current phase as a progress bar."""

    def __init__(self, spark: SparkSession, progress: Progress | None) -> None:
        self.spark = spark
        self.progress = progress

    def run(self, phase: str, action: Callable[[], T]) -> T:
        sc = self.spark.sparkContext
        sc.setJobGroup(phase, phase)
        if self.progress is None:
            try:
                return action()
            finally:
                sc.setJobGroup("", "")
        task: TaskID = self.progress.add_task(phase, total=None)
        stop = threading.Event()
        progress = self.progress

        def poll() -> None:
            tracker = sc.statusTracker()
            while not stop.wait(0.25):
                done = total = 0
                for job_id in tracker.getJobIdsForGroup(phase):
                    job = tracker.getJobInfo(job_id)
                    if job is None:
                        continue
                    for stage_id in job.stageIds:
                        stage = tracker.getStageInfo(stage_id)
                        if stage is not None:
                            done += stage.numCompletedTasks
                            total += stage.numTasks
                if total:
                    progress.update(task, completed=done, total=total)

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            result = action()
        finally:
            stop.set()
            thread.join()
            sc.setJobGroup("", "")
        current = progress.tasks[task].total or 1
        progress.update(task, completed=current, total=current)
        return result


class BenchResult:
    """What :func:`run_bench` produced (pandas frames are small: per mode/queue)."""

    def __init__(
        self,
        out: Path,
        summary: pd.DataFrame,
        queues: pd.DataFrame,
        timings: dict[str, float],
        report_path: Path,
        replay_cpu: dict[str, float],
        replays: int,
    ) -> None:
        self.replay_cpu = replay_cpu
        """CPU seconds the Python workers spent replaying, per clock."""
        self.replays = replays
        """Messages times modes replayed (per clock)."""
        self.out = out
        self.summary = summary
        self.queues = queues
        self.timings = timings
        self.report_path = report_path
        self.engine = "core"
        """The engine of the virtual-time replay."""
        self.environment: dict[str, str] = {}
        """Versions (Python, PySpark, Java) and load averages of the run."""
        self.cross_checked: dict[str, bool] = {}
        """Per clock, when the event log was written: whether Spark SQL's recount of
        the violations over it agreed with the replay tasks' counts."""


def _timed(timings: dict[str, float], name: str, fn: Callable[[], T]) -> T:
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0


EVENT_LOG_LIMIT = 3_000_000
"""Message-replays (messages x modes) up to which ``bench`` writes the event log by
default (and cross-checks the violations over it in Spark SQL)."""


def run_bench(
    spark: SparkSession,
    w: Workload,
    out: Path,
    *,
    modes: Sequence[str] | None = None,
    wall_clock: bool = False,
    progress: Progress | None = None,
    command: str = "",
    master: str = "",
    events: bool | None = None,
    engine: str = "core",
) -> BenchResult:
    """Generate, replay, analyse and report one workload into ``out``.

    ``events``: write the event log (``events-<clock>.parquet``) and recount the
    violations over it in Spark SQL; by default for up to :data:`EVENT_LOG_LIMIT`
    message-replays. Without it the replay tasks summarise their own events and
    nothing of size N leaves them. ``engine``: how virtual time is replayed (see
    :data:`~benchmarks.replay.runner.ENGINES`); the wall-clock replay always runs the
    PushConsumer.
    """
    modes = tuple(modes) if modes else w.modes
    out.mkdir(parents=True, exist_ok=True)
    ship_code(spark)
    tracker = _SparkProgress(spark, progress)
    timings: dict[str, float] = {}
    messages_path = str(out / "messages.parquet")

    def generate() -> DataFrame:
        # partitioned by consumer instance while generating (one shuffle, not two)
        # and kept: the replay reads it from memory, not back from the Parquet
        df = generate_messages(spark, w, by_consumer=True).persist(StorageLevel.MEMORY_AND_DISK)
        df.drop("part").write.mode("overwrite").parquet(messages_path)
        return mark_by_consumer(df)

    messages = _timed(timings, "generate", partial(tracker.run, "generate", generate))
    if events is None:
        count = w.message_count if w.recorded is None else messages.count()
        events = count * len(modes) <= EVENT_LOG_LIMIT
    config = ReplayConfig.from_workload(w)
    clocks = ["virtual", *(["wall"] if wall_clock else [])]
    cpu_info: dict[str, float] = {}
    summaries: list[pd.DataFrame] = []
    queue_frames: list[pd.DataFrame] = []
    quantile_frames: list[pd.DataFrame] = []
    bounds: DataFrame | None = None
    cross_checked: dict[str, bool] = {}
    replays = 0
    for clock in clocks:
        consumers_path = str(out / f"consumers-{clock}.parquet")
        events_path = str(out / f"events-{clock}.parquet") if events else None

        def replay(
            clock: str = clock,
            consumers_path: str = consumers_path,
            events_path: str | None = events_path,
        ) -> DataFrame:
            if events_path is not None:
                clear_events(events_path)
            replay_summaries(
                messages,
                config,
                modes,
                workers=w.threads,
                max_reconsume=w.failures.max_reconsume_times,
                wall_clock=clock == "wall",
                events_path=events_path,
                engine="runtime" if clock == "wall" else engine,
            ).write.mode("overwrite").parquet(consumers_path)
            return spark.read.parquet(consumers_path)

        per_consumer = _timed(
            timings, f"replay ({clock} time)", partial(tracker.run, f"replay {clock}", replay)
        )

        def analyse(
            per_consumer: DataFrame = per_consumer, events_path: str | None = events_path
        ) -> tuple[pd.DataFrame, ...]:
            hists = analysis.merged_histograms(per_consumer)
            summary = analysis.mode_summary(per_consumer, hists)
            queues = analysis.queue_summary(per_consumer).toPandas()
            quantiles = analysis.latency_quantiles(hists)
            cpu = per_consumer.agg(F.sum("cpu_seconds")).first()
            summary.attrs["cpu"] = float(cpu[0] or 0.0) if cpu is not None else 0.0
            if events_path is not None:
                recount = analysis.violations(spark.read.parquet(events_path)).toPandas()
                summary.attrs["cross_check"] = _same_violations(summary, recount)
            return summary, queues, quantiles

        summary, queues, quantiles = _timed(
            timings, f"analyse ({clock} time)", partial(tracker.run, f"analyse {clock}", analyse)
        )
        cpu_info[clock] = summary.attrs["cpu"]
        if "cross_check" in summary.attrs:
            cross_checked[clock] = summary.attrs["cross_check"]
        replays = int(summary["messages"].sum())
        if bounds is None:
            bounds = per_consumer.select(*(f.name for f in analysis.BOUND_SCHEMA.fields))
        summaries.append(summary.assign(clock=clock))
        queue_frames.append(queues.assign(clock=clock))
        quantile_frames.append(quantiles.assign(clock=clock))

    summary = pd.concat(summaries, ignore_index=True)
    queues = pd.concat(queue_frames, ignore_index=True)
    quantiles = pd.concat(quantile_frames, ignore_index=True)
    if not wall_clock:
        summary = summary.drop(columns="clock")
        queues = queues.drop(columns="clock")
    t0 = time.perf_counter()
    summary.attrs.clear()
    spark.createDataFrame(summary.astype({"mode": object})).write.mode("overwrite").parquet(
        str(out / "summary.parquet")
    )
    assert bounds is not None
    bounds.write.mode("overwrite").parquet(str(out / "bounds.parquet"))
    queues.to_parquet(out / "queues.parquet", index=False)
    charts = report.write_charts(summary, quantiles, out)
    timings["report"] = time.perf_counter() - t0
    env = environment(spark)
    path = report.write_markdown(
        out,
        w,
        summary,
        queues,
        timings,
        command,
        master,
        charts,
        replay_cpu=cpu_info,
        replays=replays,
        cross_checked=cross_checked,
        engine=engine,
        environment=env,
    )
    messages.unpersist()
    result = BenchResult(out, summary, queues, timings, path, cpu_info, replays)
    result.engine = engine
    result.environment = env
    result.cross_checked = cross_checked
    return result


def environment(spark: SparkSession) -> dict[str, str]:
    """Python, PySpark and Java versions (Java as the driver's JVM reports it), cores
    and the load average (1, 5, 15 min) now."""
    import os
    import platform

    import pyspark

    jvm = spark.sparkContext._jvm  # the driver's JVM, through py4j
    java = "unknown"
    if jvm is not None:
        system = jvm.java.lang.System
        java = f"{system.getProperty('java.version')} ({system.getProperty('java.vm.name')})"
    load = os.getloadavg()
    return {
        "python": platform.python_version(),
        "pyspark": pyspark.__version__,
        "java": java,
        "cores": str(os.cpu_count()),
        "load": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
    }


def _same_violations(summary: pd.DataFrame, recount: pd.DataFrame) -> bool:
    """The violations the replay tasks counted equal those Spark SQL recounts."""
    cols = ["queue_order_violations", "stage_order_violations", "stage_mismatches"]
    a = summary.set_index("mode")[cols].astype("int64").sort_index()
    b = recount.set_index("mode")[cols].astype("int64").sort_index()
    return bool(a.equals(b))


def _bench(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 150))
    try:
        w = load_workload(args.workload)
    except WorkloadError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        return 2
    for warning in w.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", soft_wrap=True)
    out = Path(args.out) if args.out else Path("bench-results") / w.name
    command = "python -m benchmarks " + " ".join(shlex.quote(a) for a in args.argv)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    # Spark's default of 200 is far too many here: the one large shuffle (messages to
    # consumer instances) has an explicit partition count, and the analysis shuffles
    # only per-consumer summaries.
    partitions = args.shuffle_partitions or 8
    spark = get_session(args.master, shuffle_partitions=partitions)
    try:
        with Progress(
            TextColumn("{task.description:<18}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} tasks"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            result = run_bench(
                spark,
                w,
                out,
                modes=args.modes,
                wall_clock=args.wall_clock,
                progress=progress,
                command=command,
                master=args.master,
                events=args.events,
                engine=args.engine,
            )
    except WorkloadError as exc:  # recorded traffic that cannot be replayed
        console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        return 2
    finally:
        spark.stop()
    console.print(report.rich_table(result.summary, f"{w.name}: replay results"))
    total = time.perf_counter() - t0
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items())
    console.print(f"wall time {total:.1f} s ({phases})")
    for clock, cpu in result.replay_cpu.items():
        console.print(
            f"replay ({clock} time): {result.replays:,} message-replays, {cpu:.1f} CPU s in the"
            f" Python workers = {cpu / max(1, result.replays) * 1e6:.1f} us per message and mode"
        )
    for clock, same in result.cross_checked.items():
        console.print(
            f"violations ({clock} time) recounted in Spark SQL over the event log: "
            + ("same as the replay tasks" if same else "[red]DIFFERENT[/red] from the replay tasks")
        )
    env = result.environment
    console.print(
        f"engine {result.engine}; Python {env.get('python')}, PySpark {env.get('pyspark')},"
        f" Java {env.get('java')}; {env.get('cores')} cores, load average"
        f" {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} before,"
        f" {env.get('load')} after"
    )
    console.print(f"report: {result.report_path}")
    console.print(f"reproduce: {command}", soft_wrap=True)
    return 0


def _validate(args: argparse.Namespace) -> int:
    status = 0
    for path in args.workloads:
        try:
            w = load_workload(path)
        except WorkloadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
        else:
            for warning in w.warnings:
                print(f"warning: {warning}", file=sys.stderr)
            count = "recorded" if w.recorded else f"{w.message_count:,} messages"
            print(f"{path}: ok ({w.name}, {count}, modes {', '.join(w.modes)})")
    return status


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser("bench", help="replay a workload and report")
    bench.add_argument("workload", help="workload YAML file")
    bench.add_argument("--master", default="local[*]", help="Spark master URL (default local[*])")
    bench.add_argument("--out", help="output directory (default bench-results/<name>)")
    bench.add_argument("--modes", nargs="+", choices=MODES, help="modes to replay")
    bench.add_argument(
        "--engine",
        choices=ENGINES,
        default="core",
        help="virtual-time replay engine: core (discrete events over the"
        " sans-I/O core, the default) or runtime (the PushConsumer on trio's"
        " MockClock, the reference; same schedule, ~15x the CPU)",
    )
    bench.add_argument(
        "--wall-clock",
        action="store_true",
        help="also replay on the real clock (handler costs really waited)",
    )
    events = bench.add_mutually_exclusive_group()
    events.add_argument(
        "--events",
        dest="events",
        action="store_true",
        default=None,
        help="write the event log and recount violations over it in Spark"
        f" SQL (default: up to {EVENT_LOG_LIMIT:,} message-replays)",
    )
    events.add_argument(
        "--no-events", dest="events", action="store_false", help="do not write the event log"
    )
    bench.add_argument(
        "--shuffle-partitions",
        type=_positive_int,
        default=None,
        help="spark.sql.shuffle.partitions (default 8)",
    )
    bench.set_defaults(handler=_bench)
    validate = sub.add_parser("validate", help="check workload files")
    validate.add_argument("workloads", nargs="+")
    validate.set_defaults(handler=_validate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return int(handler(args))
