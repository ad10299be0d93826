"""End to end over Redis by Python bytecodes: where each system's drain spends its
interpreted work, per function and per message.

``python -m benchmarks.redis_instructions`` counts machine instructions per message;
this counts the bytecodes the interpreter executes per message in each Python
function (``sys.settrace`` with opcode events), over exactly what
``benchmarks.redis_e2e`` times in its drain phase (the same fill, consumer, loop and
options; the tracer goes on and off at the phase's two ``process_time()`` calls), for
``--messages`` and twice as many: per message is the difference divided by
``--messages``, so start-up and the consumer's start and stop cancel out. What runs
in C (hiredis, dict and list operations, the SDK's C parts) is not counted, only
where the Python code goes: a profile that does not move with the machine's load.

Tracing slows the run by about a hundred times, so keep ``--messages`` small.

    python -m benchmarks.redis_bytecodes
    python -m benchmarks.redis_bytecodes --messages 2000 --top 15 \
        --systems 'stagedconsumer concurrent' 'redis-py XREADGROUP + XACK loop'
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

if __package__ in (None, ""):
    # Run as a script, benchmarks/ comes first on sys.path: put the repository root
    # there instead, so that imports resolve as under ``python -m benchmarks.X``.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import anyio
from rich.console import Console
from rich.table import Table

from benchmarks._callgrind import SwitchingClock

SYSTEMS = (
    "stagedconsumer concurrent",
    "stagedconsumer concurrent, batches of 32",
    "stagedconsumer staged [100]*k",
    "stagedconsumer orderly",
    "redis-py XREADGROUP + XACK loop",
    "floor: XRANGE + decode, no consumer",
    "runtime only: concurrent on MemoryBroker",
)

Key = tuple[str, str]
"""A function: its qualified name and its file's name."""


class _OpcodeCounter:
    """Counts bytecodes per function while on."""

    def __init__(self) -> None:
        self.counts: Counter[Key] = Counter()
        self.names: dict[Any, Key] = {}

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            key = self.names.get(code)
            if key is None:
                key = self.names[code] = (code.co_qualname, Path(code.co_filename).name)
            self.counts[key] += 1
        return self.trace


def count(system: str, n: int, url: str) -> Counter[Key]:
    """Bytecodes per function in the drain phase of ``system`` for ``n`` messages."""
    from benchmarks import redis_e2e

    counter = _OpcodeCounter()
    # The tracer already installed (coverage's, under ``pytest --cov``) is put back
    # whenever counting is off and at the end: clearing it would stop coverage for
    # everything this process runs afterwards.
    previous = sys.gettrace()
    clock = SwitchingClock(lambda on: sys.settrace(counter.trace if on else previous))
    saved = vars(redis_e2e)["time"]
    setattr(redis_e2e, "time", clock)  # noqa: B010 - the module's clock, replaced
    try:
        args = redis_e2e.drain_args(url, n)
        anyio.run(redis_e2e.measure_phase, system, args, False, backend="asyncio")
    finally:
        sys.settrace(previous)
        setattr(redis_e2e, "time", saved)  # noqa: B010
    if clock.calls < 2:
        raise RuntimeError(f"{system}: the drain phase did not read the clock twice")
    return counter.counts


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from benchmarks.redis_e2e import drain_messages, drain_parser

    parser = drain_parser(__doc__, 4000)
    parser.add_argument("--top", type=int, default=12, help="functions shown per system")
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        default=["stagedconsumer concurrent", "redis-py XREADGROUP + XACK loop"],
    )
    args = parser.parse_args(argv)
    n = drain_messages(parser, args)
    console = Console(width=max(Console().width, 100))
    for system in args.systems:
        with console.status(f"{system}: tracing {n:,} and {2 * n:,} messages"):
            small = count(system, n, args.url)
            large = count(system, 2 * n, args.url)
        per_message = {key: (large[key] - small[key]) / n for key in large.keys() | small}
        total = sum(per_message.values())
        table = Table(
            title=f"{system}: Python bytecodes per message, {total:,.0f} in all"
            f" ({n:,} against {2 * n:,} messages)"
        )
        for column in ("function", "file", "bytecodes per message", "share"):
            table.add_column(column, justify="right" if column[0] in "bs" else "left")
        ranked = sorted(per_message.items(), key=lambda item: -item[1])[: args.top]
        for (name, filename), value in ranked:
            table.add_row(name, filename, f"{value:,.1f}", f"{value / total:.0%}")
        console.print(table)
    from benchmarks._reproduce import print_reproduce

    print_reproduce(console, "redis_bytecodes", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
