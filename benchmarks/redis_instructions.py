"""End to end over Redis by instruction count: each system's instructions per message
in ``benchmarks.redis_e2e``'s drain phase, counted by valgrind's callgrind instead of
timed.

``python -m benchmarks.redis_e2e`` measures CPU time per message. On a shared machine
that moves by a third from one process to the next for the same code, more than the
difference between the concurrent mode and the hand-written loop it is compared with.
Instructions executed do not depend on the machine's load. For each system this
program runs the drain phase of ``redis_e2e`` (the same fill, consumer, loop and
options) in its own ``valgrind --tool=callgrind`` process, for ``--messages`` and twice
as many, with counting on only over what ``redis_e2e`` times (from after the fill to
the last handler call; ``callgrind_control -i on/off``): per message is the
difference divided by ``--messages``, so start-up, connecting and the consumer's
start and stop cancel out.

What instructions count and CPU time would also count: the cyclic garbage collector's
work (a part of the loop's cost) is in; the kernel's (socket reads and writes, about a
round trip per 128 entries per stream for everyone) and Redis's own work are out, and
so are cache misses: a proxy for CPU time, not the same thing.

Needs ``valgrind`` (with ``callgrind_control``) on ``PATH`` and Redis at ``--url``.
Each valgrind run takes 10 to 60 s at the default size.

    python -m benchmarks.redis_instructions
    python -m benchmarks.redis_instructions --messages 4000 \
        --systems 'stagedconsumer concurrent' 'redis-py XREADGROUP + XACK loop'
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script, benchmarks/ comes first on sys.path: put the repository root
    # there instead, so that imports resolve as under ``python -m benchmarks.X``.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import anyio
from rich.console import Console
from rich.table import Table

from benchmarks import _callgrind

LOOP = "redis-py XREADGROUP + XACK loop"
SYSTEMS = (
    "stagedconsumer concurrent",
    "stagedconsumer concurrent, batches of 32",
    "stagedconsumer staged [100]*k",
    "stagedconsumer orderly",
    LOOP,
    "floor: XRANGE + decode, no consumer",
    "floor: XRANGE only",
    "runtime only: concurrent on MemoryBroker",
)


def child(system: str, n: int, url: str) -> None:
    """The drain phase of ``system`` under callgrind, counting what ``redis_e2e`` times."""
    from benchmarks import redis_e2e

    clock = _callgrind.CountingClock()
    setattr(redis_e2e, "time", clock)  # noqa: B010 - the module's clock, replaced
    args = redis_e2e.drain_args(url, n)
    anyio.run(redis_e2e.measure_phase, system, args, False, backend="asyncio")
    if clock.calls < 2:
        raise RuntimeError(f"{system}: the drain phase did not read the clock twice")


def instructions(system: str, n: int, url: str) -> int:
    """Instructions the drain phase of ``system`` executes for ``n`` messages."""
    return _callgrind.instructions(
        "benchmarks.redis_instructions", [system, str(n), url], f"{system} ({n} messages)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        system, size, url = argv[1:4]
        child(system, int(size), url)
        return 0
    from benchmarks.redis_e2e import drain_messages, drain_parser

    parser = drain_parser(__doc__, 8000)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    args = parser.parse_args(argv)
    missing = _callgrind.missing_tools()
    if missing:
        parser.error(f"needs {' and '.join(missing)} on PATH (the valgrind package)")
    n = drain_messages(parser, args)
    counts: dict[str, float] = {}
    console = Console(width=max(Console().width, 120))
    with console.status("counting") as status:
        for system in args.systems:
            status.update(f"{system} (valgrind, {n:,} and {2 * n:,} messages)")
            counts[system] = (
                instructions(system, 2 * n, args.url) - instructions(system, n, args.url)
            ) / n
    table = Table(
        title=f"Redis end to end, drain, instructions per message ({n:,} against"
        f" {2 * n:,} messages, 8 streams, asyncio)"
    )
    for column in ("system", "instructions per message", "vs loop"):
        table.add_column(column, justify="left" if column == "system" else "right")
    loop = counts.get(LOOP)
    for system, count in counts.items():
        table.add_row(system, f"{count / 1000:,.1f}k", f"{count / loop:.2f}x" if loop else "")
    console.print(table)
    console.print(
        f"python {platform.python_version()}, valgrind callgrind; 'vs loop': the"
        " system's instructions per message over the loop's (below 1: fewer)"
    )
    from benchmarks._reproduce import print_reproduce

    print_reproduce(console, "redis_instructions", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
