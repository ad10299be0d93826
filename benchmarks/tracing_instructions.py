"""The consume-side OpenTelemetry target by instruction count: what the hook adds per
message against the SDK floor, counted by valgrind's callgrind instead of timed.

``python -m benchmarks.tracing_overhead`` times the same cases by CPU time, which on
a shared machine moves by a few percent from run to run: the target (the hook, with
everything on and 1% of spans sampled, at most 1.3 times the sampled SDK floor) sits
within that noise. Instructions executed do not depend on the machine's load. For
each mode this program runs, each in its own ``valgrind --tool=callgrind`` process:

- ``message trace``: the consumer with ``ConsumeMessageTraceHook``;
- ``everything, spans sampled 1%``: the same with ``OpenTelemetryHook`` too (the
  sampler's random trace ids seeded, so that runs sample the same spans);
- ``SDK floor, spans sampled 1%``: the OpenTelemetry SDK calls alone
  (:func:`benchmarks.tracing_overhead.sdk_floor`),

each for ``--messages`` and twice as many messages, with instruction counting on only
around the part ``tracing_overhead`` times (``callgrind_control -i on/off``): per
message is the difference divided by ``--messages``, so set-up and start-up cancel
out. The hook adds ``everything`` minus ``message trace``.

Needs ``valgrind`` (with ``callgrind_control``) on ``PATH``. Every valgrind run takes
5 to 15 s at the default size.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script, benchmarks/ comes first on sys.path: put the repository root
    # there instead, so that imports resolve as under ``python -m benchmarks.X``.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import anyio
from rich.console import Console
from rich.table import Table

from benchmarks import _callgrind
from benchmarks.tracing_overhead import SAMPLED_CASE as HOOK_CASE
from benchmarks.tracing_overhead import SAMPLED_FLOOR as FLOOR_CASE
from benchmarks.tracing_overhead import TARGET, TRACE_CASE

CASES = (TRACE_CASE, HOOK_CASE, FLOOR_CASE)
MODES = ("concurrent", "staged", "orderly")


def child(case: str, mode: str, n: int, queues: int, stage_size: int) -> None:
    """One case under callgrind, counting only what ``tracing_overhead`` times."""
    from benchmarks import tracing_overhead as bench
    from benchmarks.overhead import NoopConcurrently, NoopOrderly, NoopStaged, run_consumer

    random.seed(7)  # the SDK's random trace ids, hence what the 1% sampler keeps
    broker = bench.traced_fill(n, queues)
    if case == FLOOR_CASE:
        setattr(bench, "time", _callgrind.CountingClock())  # noqa: B010 - the module's clock, replaced
        bench.sdk_floor(broker, n, staged=mode == "staged", sampled=0.01)
        return
    per_queue = -(-n // queues)
    listeners: dict[str, Callable[[], Any]] = {
        "concurrent": NoopConcurrently,
        "staged": lambda: NoopStaged(stage_size, -(-per_queue // stage_size)),
        "orderly": NoopOrderly,
    }
    hooks, _ = bench.CASES[case]()
    listener = listeners[mode]()
    gc.collect()
    _callgrind.counting(True)
    anyio.run(run_consumer, broker, listener, bench.OPTIONS, n, hooks, backend="asyncio")
    _callgrind.counting(False)


def instructions(case: str, mode: str, n: int, args: argparse.Namespace) -> int:
    """Instructions the counted part of ``case`` executes for ``n`` messages."""
    return _callgrind.instructions(
        "benchmarks.tracing_instructions",
        [case, mode, str(n), str(args.queues), str(args.stage_size)],
        f"{case} ({mode}, {n} messages)",
    )


def per_message(case: str, mode: str, args: argparse.Namespace) -> float:
    n: int = args.messages
    return (instructions(case, mode, 2 * n, args) - instructions(case, mode, n, args)) / n


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        case, mode, n, queues, stage_size = argv[1:6]
        child(case, mode, int(n), int(queues), int(stage_size))
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--messages", type=int, default=2000, help="the smaller run's size (default 2000)"
    )
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument("--stage-size", type=int, default=100)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args(argv)
    missing = _callgrind.missing_tools()
    if missing:
        parser.error(f"needs {' and '.join(missing)} on PATH (the valgrind package)")
    if args.messages < 1:
        parser.error("--messages must be at least 1")

    console = Console(width=max(Console().width, 120))
    table = Table(
        title=f"Instructions per message, {args.messages:,} against {2 * args.messages:,}"
        f" messages, {args.queues} queues, asyncio"
    )
    table.add_column("mode")
    for case in CASES:
        table.add_column(case, justify="right")
    table.add_column("hook adds", justify="right")
    table.add_column("vs floor", justify="right")
    ratios: dict[str, float] = {}
    with console.status("counting") as status:
        for mode in args.modes:
            counts = {}
            for case in CASES:
                status.update(f"{mode}: {case} (valgrind)")
                counts[case] = per_message(case, mode, args)
            added = counts[HOOK_CASE] - counts[TRACE_CASE]
            ratio = ratios[mode] = added / counts[FLOOR_CASE]
            table.add_row(
                mode,
                *(f"{counts[case] / 1000:,.1f}k" for case in CASES),
                f"{added / 1000:,.1f}k",
                f"{ratio:.2f}x",
            )
    console.print(table)
    met = all(ratio <= TARGET for ratio in ratios.values())
    shown = ", ".join(f"{mode} {ratio:.2f}x" for mode, ratio in ratios.items())
    console.print(
        f"target OpenTelemetry hook, everything on, 1% sampled <= {TARGET} x SDK floor,"
        f" by instructions: {'met' if met else 'NOT met'} ({shown})"
    )
    console.print(f"python {platform.python_version()}, valgrind callgrind")
    from benchmarks._reproduce import print_reproduce

    print_reproduce(console, "tracing_instructions", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
