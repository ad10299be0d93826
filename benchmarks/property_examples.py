"""How many property-test examples per second ``stagedconsumer.testing`` runs.

One example = ``run_virtual`` on a staged listener (stage definitions ``[3, 5, 8]``,
keys of two campaigns as groups, costs cycled over ``(1, 0, 2)`` virtual seconds) plus
the checks a property test makes (``StagePlan.of``, ``check_staged``,
``check_at_least_once``). Variants: ``kit``, without failures; ``kit+crash``,
with failures of 1 in 5 first attempts and a crash halfway through the handler calls.

The baseline, measured in the same run on the same messages, is the bare consumer in
virtual time without the kit: a fresh ``MemoryBroker``, ``PushConsumer`` with the same
listener (its handler sleeping the same costs) on trio's ``MockClock``, until
``wait_caught_up()``; no recording, no failure injection, no checks. The ratio is the
kit's price per example.

CPU time per example is ``time.process_time()`` over all repeats divided by their
count (steadier than wall time on a shared machine); examples/s is its inverse.

    python -m benchmarks.property_examples                 # 10, 30, 100 messages
    python -m benchmarks.property_examples --messages 20 --examples 200
    python benchmarks/property_examples.py                 # the same, as a script
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script, benchmarks/ comes first on sys.path: put the repository root
    # there instead, so that imports resolve as under ``python -m benchmarks.X``.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import anyio
from rich.console import Console
from rich.table import Table

from stagedconsumer import (
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerStagedConcurrently,
    PushConsumer,
)

COSTS = (1.0, 0.0, 2.0)


class Campaigns(MessageListenerStagedConcurrently):
    def __init__(self, cost: bool) -> None:
        self.cost = cost

    def get_stage_definitions(self) -> Sequence[int]:
        return [3, 5, 8]

    def compute_group(self, msg: Message) -> str | None:
        return msg.keys[0]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        if self.cost:  # the baseline sleeps its cost itself; the kit adds it
            await anyio.sleep(max(COSTS[m.queue_offset % len(COSTS)] for m in msgs))


def keys(i: int) -> tuple[str]:
    return ("spring" if i % 3 else "summer",)


def baseline(count: int) -> None:
    import trio
    import trio.testing

    async def main() -> None:
        broker = MemoryBroker()
        broker.create_topic("t", 2)
        for i in range(count):
            broker.send("t", b"", keys=keys(i), queue_id=i % 2)
        consumer = PushConsumer(
            "group",
            broker,
            Campaigns(cost=True),
            options=ConsumerOptions(event_loop_block_threshold=None),
        )
        consumer.subscribe("t")
        async with consumer:
            await consumer.wait_caught_up()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def kit(count: int, *, failures: bool) -> None:
    from stagedconsumer.testing import (
        FailureKind,
        FailureSchedule,
        MessageSpec,
        StagePlan,
        assert_at_least_once,
        assert_staged,
        run_virtual,
    )

    specs = [MessageSpec(topic="t", queue_id=i % 2, keys=keys(i)) for i in range(count)]
    schedule = None
    crash: list[int] = []
    if failures:
        schedule = FailureSchedule.of({(i, 1): FailureKind.RAISE for i in range(0, count, 5)})
        crash = [max(1, count // 2)]
    listener = Campaigns(cost=False)
    run = run_virtual(listener, specs, costs=COSTS, failures=schedule, crash_at=crash)
    assert run.completed
    assert_staged(run.log, StagePlan.of(listener, run.sent))
    assert_at_least_once(run.log, run.sent, exactly_once=not run.crashes)


def per_example(fn: Callable[[], None], examples: int) -> tuple[float, float]:
    """CPU and wall seconds per example (after one warm-up call)."""
    fn()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(examples):
        fn()
    return (time.process_time() - cpu) / examples, (time.perf_counter() - wall) / examples


def measure(sizes: Sequence[int], examples: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for count in sizes:
        base_cpu, base_wall = per_example(partial(baseline, count), examples)
        variants: list[tuple[str, Callable[[], None]]] = [
            ("baseline", partial(baseline, count)),
            ("kit", partial(kit, count, failures=False)),
            ("kit+crash", partial(kit, count, failures=True)),
        ]
        for name, fn in variants:
            cpu, wall = (
                (base_cpu, base_wall) if name.startswith("baseline") else per_example(fn, examples)
            )
            rows.append(
                {
                    "messages": count,
                    "variant": name,
                    "cpu_ms": cpu * 1000,
                    "examples_per_cpu_s": 1 / cpu,
                    "wall_ms": wall * 1000,
                    "ratio": cpu / base_cpu,
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--messages",
        type=int,
        action="append",
        help="messages per example (repeatable; default 10, 30 and 100)",
    )
    parser.add_argument("--examples", type=int, default=100, help="examples per variant")
    args = parser.parse_args(argv)
    sizes = args.messages or [10, 30, 100]
    load_before = os.getloadavg()[0]
    rows = measure(sizes, args.examples)
    load_after = os.getloadavg()[0]
    table = Table(title="stagedconsumer.testing: property-test examples per CPU second")
    for column in ("messages", "variant", "CPU ms/example", "ex/CPU s", "wall ms", "x base"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for row in rows:
        table.add_row(
            str(row["messages"]),
            row["variant"],
            f"{row['cpu_ms']:.2f}",
            f"{row['examples_per_cpu_s']:.0f}",
            f"{row['wall_ms']:.2f}",
            f"{row['ratio']:.2f}",
        )
    console = Console()
    console.print(table)
    command = " ".join(["python -m benchmarks.property_examples", *(argv or sys.argv[1:])])
    console.print(
        f"{args.examples} examples per row; load average {load_before:.2f} before,"
        f" {load_after:.2f} after ({os.cpu_count()} CPUs); command: {command}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
