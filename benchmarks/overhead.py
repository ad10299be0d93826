"""Runtime overhead: no-op handler throughput per mode, next to a hand-written baseline.

Every mode consumes the same backlog from the embedded broker with a no-op ``async``
handler. The baseline, measured in the same process, is what a user would write by
hand: an asyncio loop that spawns one task per message under a semaphore of 20.

    python -m benchmarks.overhead                    # 200,000 messages, 8 queues
    python -m benchmarks.overhead --messages 1000000 --memory
    python benchmarks/overhead.py                    # the same, as a script
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import resource
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script, benchmarks/ comes first on sys.path, where benchmarks/offsetstore.py
    # would shadow the offsetstore package: put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import anyio
from rich.console import Console
from rich.table import Table

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    PushConsumer,
)

TOPIC = "bench"


class NoopConcurrently(MessageListenerConcurrently):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        return None


class NoopOrderly(MessageListenerOrderly):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        return None


class NoopStaged(MessageListenerStagedConcurrently):
    def __init__(self, stage_size: int, stages: int) -> None:
        self._definitions = [stage_size] * stages

    def get_stage_definitions(self) -> Sequence[int]:
        return self._definitions

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        return None


def fill(messages: int, queues: int) -> MemoryBroker:
    broker = MemoryBroker()
    broker.create_topic(TOPIC, queues)
    body = b"x" * 16
    for i in range(messages):
        broker.send(TOPIC, body, queue_id=i % queues)
    return broker


async def baseline(messages: list[Message]) -> float:
    """One task per message under a semaphore of 20, as written by hand."""
    semaphore = asyncio.Semaphore(20)

    async def handle(message: Message) -> None:
        async with semaphore:
            return None

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for message in messages:
            await semaphore.acquire()
            semaphore.release()
            tg.create_task(handle(message))
    return time.perf_counter() - start


async def run_consumer(
    broker: MemoryBroker,
    listener: Any,
    options: ConsumerOptions,
    expected: int,
    hooks: Sequence[Any] = (),
) -> float:
    """Consume the backlog once; returns the seconds until every message finished."""
    consumer = PushConsumer("bench", broker, listener, options=options)
    consumer.subscribe(TOPIC)
    for hook in hooks:
        consumer.register_consume_message_hook(hook)
    start = time.perf_counter()
    async with consumer:
        await consumer.wait_caught_up()
        elapsed = time.perf_counter() - start
        stats = consumer.statistics()
    if stats.consumed_ok != expected:
        raise RuntimeError(f"consumed {stats.consumed_ok} messages, expected {expected}")
    return elapsed


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    n, queues = args.messages, args.queues
    per_queue = -(-n // queues)
    broker = fill(n, queues)
    all_messages = [m for q in range(queues) for m in broker.messages(TOPIC, q)]

    def record(name: str, elapsed: float, peak: int | None = None) -> None:
        rows.append(
            {
                "mode": name,
                "messages": n,
                "seconds": elapsed,
                "rate": n / elapsed,
                "peak_mib": None if peak is None else peak / 2**20,
            }
        )

    for _ in range(args.repeat):
        record("baseline: task per message + Semaphore(20)", asyncio.run(baseline(all_messages)))
        cases: list[tuple[str, Any]] = [
            ("concurrent", NoopConcurrently()),
            (
                f"staged [{args.stage_size}]*k",
                NoopStaged(args.stage_size, -(-per_queue // args.stage_size)),
            ),
            (f"orderly, {queues} queues", NoopOrderly()),
        ]
        for name, listener in cases:
            options = ConsumerOptions(consume_thread_max=20)
            gc.collect()
            if args.memory:
                tracemalloc.start()
            elapsed = anyio.run(run_consumer, broker, listener, options, n, backend=args.backend)
            peak = None
            if args.memory:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            record(name, elapsed, peak)
    return rows


def best(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["mode"] not in out or row["rate"] > out[row["mode"]]["rate"]:
            out[row["mode"]] = row
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument("--stage-size", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode; the best is reported")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--memory", action="store_true", help="trace peak Python memory (slower)")
    parser.add_argument("--json", type=Path, help="also write results as JSON here")
    args = parser.parse_args(argv)

    rows = best(measure(args))
    base = next(r for name, r in rows.items() if name.startswith("baseline"))
    concurrent = rows["concurrent"]
    table = Table(
        title=f"No-op handler throughput, {args.messages:,} messages,"
        f" {args.queues} queues, {args.backend}"
    )
    table.add_column("mode")
    table.add_column("seconds", justify="right")
    table.add_column("messages/s", justify="right")
    table.add_column("vs baseline", justify="right")
    table.add_column("vs concurrent", justify="right")
    if args.memory:
        table.add_column("peak MiB", justify="right")
    for name, row in rows.items():
        cells = [
            name,
            f"{row['seconds']:.3f}",
            f"{row['rate']:,.0f}",
            f"{row['rate'] / base['rate']:.2f}x",
            f"{row['rate'] / concurrent['rate']:.2f}x",
        ]
        if args.memory:
            cells.append(f"{row['peak_mib']:.1f}" if row["peak_mib"] is not None else "")
        table.add_row(*cells)
    console = Console()
    console.print(table)
    console.print(
        f"python {platform.python_version()}, best of {args.repeat}; "
        f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )
    console.print(
        "reproduce: python -m benchmarks.overhead "
        + " ".join(argv if argv is not None else sys.argv[1:])
    )
    if args.json:
        args.json.write_text(json.dumps(list(rows.values()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
