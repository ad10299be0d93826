"""CPU per message of the two replay engines, on the same consumer instance.

    python -m benchmarks.replay_engines [--queues 16] [--per-queue 2000]
        [--threads 20] [--batch-size 1] [--fail 0.0] [--runtime-share 0.25]

One consumer instance shaped like one of ``many-queue``'s (16 queues x 2,000
messages, 20 workers, uniform 5-15 ms handlers, stages ``[50, 100, 200, 400]``),
replayed in each mode by the core engine (discrete events over the sans-I/O core)
and by the runtime engine (the PushConsumer on trio's MockClock), which is the
baseline measured in the same run. Prints the process CPU time per message and mode
of each (the core engine's includes its share of building the stored messages,
which the modes share), the makespans, and whether both engines made the same calls
with the same start and end times. The runtime engine replays the first
``--runtime-share`` of every queue only (it costs ~15 times more), and the core
engine replays that cut too for the equality check. No Spark needed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script, benchmarks/ comes first on sys.path: put the repository root
    # there instead, so that imports resolve as under ``python -m benchmarks.X``.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from benchmarks._reproduce import print_reproduce
from benchmarks.replay.engine import Prepared
from benchmarks.replay.runner import ReplayConfig, replay_consumer
from benchmarks.replay.workload import MODES

COLUMNS = ("engine", "mode", "messages", "CPU s", "us/message", "makespan s", "same calls")


def consumer_messages(queues: int, per_queue: int, fail: float, seed: int = 64) -> pd.DataFrame:
    """One consumer instance's messages, as the generation makes them."""
    rng = np.random.default_rng(seed)
    n = queues * per_queue
    return pd.DataFrame(
        {
            "consumer": np.zeros(n, np.int32),
            "topic": np.zeros(n, np.int32),
            "queue": np.repeat(np.arange(queues, dtype=np.int32), per_queue),
            "qid": np.repeat(np.arange(queues, dtype=np.int32), per_queue),
            "offset": np.tile(np.arange(per_queue, dtype=np.int64), queues),
            "key": [f"k{i % 1000}" for i in range(n)],
            "strategy": "default",
            "grp": [None] * n,
            "size": 1024,
            "cost_us": rng.integers(5000, 15001, n),
            "fail_attempts": (rng.random(n) < fail).astype(int),
            "publish_us": np.zeros(n, np.int64),
            "stage": pd.array(np.zeros(n, int), dtype="Int32"),
        }
    )


def _cut(messages: pd.DataFrame, per_queue: int) -> pd.DataFrame:
    return messages[messages["offset"] < per_queue].reset_index(drop=True)


def _replay(
    messages: pd.DataFrame, config: ReplayConfig, engine: str
) -> dict[str, tuple[float, pd.DataFrame]]:
    out: dict[str, tuple[float, pd.DataFrame]] = {}
    start = time.process_time()
    prepared = Prepared(messages) if engine == "core" else None
    shared = (time.process_time() - start) / len(MODES)
    for mode in MODES:
        start = time.process_time()
        events = replay_consumer(messages, mode, config, engine=engine, prepared=prepared)
        out[mode] = (time.process_time() - start + shared, events)
    return out


def _same(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    key = ["qid", "offset", "attempt"]
    a = a.sort_values(key).reset_index(drop=True)
    b = b.sort_values(key).reset_index(drop=True)
    return len(a) == len(b) and bool(a.equals(b))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.replay_engines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--queues", type=int, default=16)
    parser.add_argument("--per-queue", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument(
        "--fail", type=float, default=0.0, help="probability that a message's first attempt fails"
    )
    parser.add_argument(
        "--runtime-share",
        type=float,
        default=0.25,
        help="share of each queue the runtime engine replays",
    )
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    config = ReplayConfig(
        threads=args.threads,
        batch_size=args.batch_size,
        pull_batch_size=32,
        suspend_millis=1000,
        max_reconsume_times=None,
        strategies={"default": (50, 100, 200, 400)},
        group_by_key=False,
    )
    messages = consumer_messages(args.queues, args.per_queue, args.fail)
    cut = _cut(messages, max(1, int(args.per_queue * args.runtime_share)))
    core_full = _replay(messages, config, "core")
    core_cut = _replay(cut, config, "core")
    runtime_cut = _replay(cut, config, "runtime")
    table = Table(title="replay engines: process CPU per message and mode")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("engine", "mode") else "right")
    rows = [
        ("core", messages, core_full, None),
        ("core", cut, core_cut, runtime_cut),
        ("runtime (baseline)", cut, runtime_cut, core_cut),
    ]
    for engine, frame, results, other in rows:
        for mode in MODES:
            cpu, events = results[mode]
            same = "" if other is None else ("yes" if _same(events, other[mode][1]) else "NO")
            table.add_row(
                engine,
                mode,
                f"{len(frame):,}",
                f"{cpu:.2f}",
                f"{cpu / max(1, len(frame)) * 1e6:.1f}",
                f"{events['end'].max():.4f}",
                same,
            )
    console = Console(width=max(Console().width, 100))
    console.print(table)
    load_after = os.getloadavg()
    console.print(
        f"batch size {args.batch_size}, {args.threads} workers; load average (1/5/15 min)"
        f" {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} before,"
        f" {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} after, on"
        f" {os.cpu_count()} cores (process CPU time, not wall time)"
    )
    print_reproduce(console, "replay_engines", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
