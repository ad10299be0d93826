"""Report: a rich table on the terminal, Markdown and PNG charts on disk."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.patches import Patch
from rich.table import Table

from .workload import Workload

__all__ = ("MODE_COLOURS", "SUMMARY_COLUMNS", "rich_table", "write_charts", "write_markdown")

SUMMARY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("mode", "mode"),
    ("makespan", "makespan s"),
    ("bound", "bound s"),
    ("efficiency", "efficiency"),
    ("speedup", "speedup"),
    ("throughput", "msg/s"),
    ("latency_p50", "lat p50"),
    ("latency_p95", "lat p95"),
    ("latency_p99", "lat p99"),
    ("queueing_p50", "queue p50"),
    ("queueing_p99", "queue p99"),
    ("attempts", "attempts"),
    ("queue_order_violations", "queue-order viol."),
    ("stage_order_violations", "stage-order viol."),
    ("lost", "lost"),
)

_ORDER = {"orderly": 0, "concurrent": 1, "staged": 2}

MODE_COLOURS: Mapping[str, str] = {
    "orderly": "#7f7f7f",
    "concurrent": "#d62728",
    "staged": "#1f77b4",
}
"""One colour per mode, the same in every chart whichever modes are replayed."""


def _fmt(value: Any, name: str = "") -> str:
    if name == "speedup" and isinstance(value, float) and not math.isnan(value):
        return f"{value:.1f}x"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        if value == int(value) and abs(value) < 1e9:
            return f"{value:.0f}" if abs(value) >= 100 else f"{value:g}"
        if abs(value) >= 100:
            return f"{value:,.1f}"
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _sorted(summary: pd.DataFrame) -> pd.DataFrame:
    keys = [c for c in ("clock",) if c in summary.columns]
    return (
        summary.assign(_o=summary["mode"].map(_ORDER)).sort_values([*keys, "_o"]).drop(columns="_o")
    )


TABLE_COLUMNS = (
    "mode",
    "makespan",
    "bound",
    "efficiency",
    "speedup",
    "throughput",
    "latency_p50",
    "latency_p99",
    "attempts",
    "queue_order_violations",
    "stage_order_violations",
    "lost",
)


def rich_table(summary: pd.DataFrame, title: str) -> Table:
    """The headline columns (the Markdown report has all of them)."""
    table = Table(title=title)
    cols = [("clock", "clock")] if "clock" in summary.columns else []
    cols += [(name, label) for name, label in SUMMARY_COLUMNS if name in TABLE_COLUMNS]
    for _, label in cols:
        table.add_column(label, justify="left" if label in ("mode", "clock") else "right")
    for row in _sorted(summary).to_dict("records"):
        table.add_row(*(_fmt(row.get(name), name) for name, _ in cols))
    return table


def _markdown_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(label for _, label in cols) + " |"]
    lines.append("| " + " | ".join("---" for _ in cols) + " |")
    lines.extend(
        "| " + " | ".join(_fmt(row.get(name), name) for name, _ in cols) + " |" for row in rows
    )
    return "\n".join(lines)


def write_charts(summary: pd.DataFrame, quantiles: pd.DataFrame, out: Path) -> list[Path]:
    """throughput.png, makespan_vs_bound.png, latency.png (virtual-time results)."""
    paths = []
    s = _sorted(summary)
    if "clock" in s.columns:
        s = s[s["clock"] == "virtual"] if (s["clock"] == "virtual").any() else s
    modes = list(s["mode"])
    colours = [MODE_COLOURS[m] for m in modes]

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(modes, s["throughput"], color=colours)
    ax.set_ylabel("messages / s")
    ax.set_title("Throughput per mode")
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    x = range(len(modes))
    ax.bar([i - 0.2 for i in x], s["makespan"], width=0.4, color=colours)
    ax.bar(
        [i + 0.2 for i in x], s["bound"], width=0.4, color="white", edgecolor=colours, hatch="//"
    )
    ax.set_xticks(list(x), modes)
    ax.set_ylabel("seconds")
    ax.set_title("Makespan vs theoretical bound")
    # the bars have their mode's colour: the legend says which is which in grey
    ax.legend(
        handles=[
            Patch(facecolor="#999999", label="makespan"),
            Patch(facecolor="white", edgecolor="#999999", hatch="//", label="lower bound"),
        ]
    )
    fig.tight_layout()
    paths.append(out / "makespan_vs_bound.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    q = quantiles
    if "clock" in q.columns and (q["clock"] == "virtual").any():
        q = q[q["clock"] == "virtual"]
    for row in q.to_dict("records"):
        values = list(row["latency_q"])
        ax.plot(
            values,
            [i / (len(values) - 1) for i in range(len(values))],
            color=MODE_COLOURS[row["mode"]],
            label=row["mode"],
        )
    ax.set_xlabel("latency (s)")
    ax.set_ylabel("fraction of messages")
    ax.set_title("Latency distribution (CDF)")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def _workload_lines(w: Workload) -> list[str]:
    cost = ", ".join(f"{k}={v:g}" for k, v in w.cost.params.items())
    stages = w.stages
    lines = [
        f"- queues: {w.topics} topic(s) x {w.partitions_per_topic} partitions,"
        f" {w.consumers} consumer instance(s), {w.threads} workers each,"
        f" batch size {w.batch_size}",
        f"- handler cost: {w.cost.distribution} ({cost} ms)",
        f"- stage definitions: {list(stages.definitions)}"
        + (f", strategies {dict(stages.strategies)}" if stages.strategies else "")
        + (f", weights {dict(stages.strategy_weights)}" if stages.strategy_weights else "")
        + (f", grouped by {stages.group_by}" if stages.group_by != "none" else ""),
        f"- failures: probability {w.failures.probability:g} per attempt, at most"
        f" {w.failures.max_failures} in a row, suspend {w.failures.suspend_millis} ms,"
        f" max reconsume {w.failures.max_reconsume_times}",
        f"- producer rate: {w.producer_rate:g} msg/s"
        + (" (backlog at t=0)" if not w.producer_rate else ""),
        f"- seed: {w.seed}",
    ]
    if w.recorded is not None:
        lines.insert(0, f"- recorded traffic: {w.recorded.path} ({w.recorded.format})")
    else:
        lines.insert(0, f"- messages: {w.message_count:,} ({w.messages_per_queue:,} per queue)")
    return lines


ENGINE_TEXT = {
    "core": "the discrete-event engine over the sans-I/O core (benchmarks/replay/engine.py),"
    " which reproduces the runtime engine's schedule exactly.",
    "runtime": "the real PushConsumer on trio's MockClock (deterministic scheduling).",
}


def write_markdown(
    out: Path,
    w: Workload,
    summary: pd.DataFrame,
    queues: pd.DataFrame,
    timings: Mapping[str, float],
    command: str,
    master: str,
    charts: Sequence[Path],
    *,
    replay_cpu: Mapping[str, float] | None = None,
    replays: int = 0,
    cross_checked: Mapping[str, bool] | None = None,
    engine: str = "runtime",
    environment: Mapping[str, str] | None = None,
) -> Path:
    cols = ([("clock", "clock")] if "clock" in summary.columns else []) + list(SUMMARY_COLUMNS)
    parts = [
        f"# Replay: {w.name}",
        "",
        f"Command: `{command}` (Spark master `{master}`).",
        "",
        f"Engine (virtual time): `{engine}` — " + (ENGINE_TEXT.get(engine, engine)),
        "",
        *(
            [
                f"Environment: Python {environment.get('python')}, PySpark"
                f" {environment.get('pyspark')}, Java {environment.get('java')},"
                f" {environment.get('cores')} cores, load average (1/5/15 min) at the end"
                f" {environment.get('load')}.",
                "",
            ]
            if environment
            else []
        ),
        *_workload_lines(w),
        "",
        "## Per mode",
        "",
        "Times in seconds since each consumer instance started (virtual seconds in"
        " virtual time). Bound: a lower bound on the makespan (see"
        " `benchmarks/replay/bounds.py`: max(sum/W, max, pigeonhole sums) per stage,"
        " exact for equal costs; every planned attempt counted, retry delays not);"
        " efficiency = bound / makespan; speedup = orderly makespan / makespan."
        " Violations count messages; they must be 0 for orderly (queue order) and"
        " staged (stage order).",
        "",
        _markdown_table(_sorted(summary).to_dict("records"), cols),
        "",
    ]
    extra = [
        c
        for c in ("graham", "work", "duplicates", "dead_lettered", "stage_mismatches")
        if c in summary.columns
    ]
    if extra:
        parts += [
            _markdown_table(
                _sorted(summary).to_dict("records"),
                [
                    *([("clock", "clock")] if "clock" in summary.columns else []),
                    ("mode", "mode"),
                    *((c, c) for c in extra),
                ],
            ),
            "",
        ]
    qcols = [
        ("mode", "mode"),
        ("qid", "queue"),
        ("consumer", "consumer"),
        ("messages", "messages"),
        ("makespan", "makespan s"),
        ("throughput", "msg/s"),
        ("speedup", "speedup"),
        ("latency_p50", "lat p50"),
        ("latency_p99", "lat p99"),
        ("queueing_p99", "queue p99"),
    ]
    qv = queues
    if "clock" in qv.columns and (qv["clock"] == "virtual").any():
        qv = qv[qv["clock"] == "virtual"]
    nq = qv["qid"].nunique()
    parts += ["## Per queue", ""]
    if nq <= 16:
        rows = qv.assign(_o=qv["mode"].map(_ORDER)).sort_values(["qid", "_o"])
        parts.append(_markdown_table(rows.to_dict("records"), qcols))
    else:
        rows = qv.sort_values("makespan", ascending=False).groupby("mode").head(5)
        rows = rows.assign(_o=rows["mode"].map(_ORDER)).sort_values(
            ["_o", "makespan"], ascending=[True, False]
        )
        parts.append(
            f"{nq} queues; the 5 slowest per mode (all queues in `queues.parquet`):\n\n"
            + _markdown_table(rows.to_dict("records"), qcols)
        )
    parts += ["", "## Wall time of this run", ""]
    parts += [f"- {phase}: {seconds:.1f} s" for phase, seconds in timings.items()]
    for clock, cpu in (replay_cpu or {}).items():
        parts.append(
            f"- replay CPU ({clock} time): {cpu:.1f} s in the Python workers for {replays:,}"
            f" message-replays = {cpu / max(1, replays) * 1e6:.1f} us per message and mode"
            " (process CPU time: less load-dependent than the wall times, but not immune:"
            " caches and hyperthreads are shared)"
        )
    for clock, same in (cross_checked or {}).items():
        parts.append(
            f"- violations ({clock} time) recounted in Spark SQL over the written event log:"
            + (
                " same counts as the replay tasks"
                if same
                else " **DIFFERENT from the replay tasks' counts**"
            )
        )
    parts += ["", "## Charts", ""]
    parts += [f"![{p.stem}]({p.name})" for p in charts]
    parts += [
        "",
        "Files: `messages.parquet` (generated messages), `consumers-<clock>.parquet` (per"
        " mode and consumer instance: counts, violations, per-queue numbers, latency"
        " histograms), `events-<clock>.parquet` (event log, when written: mode, consumer,"
        " queue, offset, stage, attempt, batch, start, end, ok, dlq), `summary.parquet`,"
        " `queues.parquet`, `bounds.parquet`.",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
