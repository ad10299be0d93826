"""Runtime overhead: no-op handler throughput per mode, next to a hand-written baseline
and the floor of a plain ``await``.

Every mode consumes the same backlog from the embedded broker with a no-op ``async``
handler. The baseline, measured in the same process, is what a user would write by
hand: an asyncio loop that spawns one task per message under a semaphore of 20. It
always runs: the ratios are against it. So does the floor (``plain-await floor``): a
loop that awaits the no-op handler once per message, ``await
listener.consume_message((message,), context)``, over the same message objects, on
the same backend, with nothing else (timed inside the event loop: its start is not
counted); the ``vs floor`` column is each row's CPU time per message as a multiple
of the floor's.

Beside the ``async`` handlers (variant ``async``), ``--variants`` adds the same modes
with a plain ``def`` handler (``sync``: each call runs on a worker thread) and with
a consume hook that does nothing registered (``hooked``: one hook call before and
after each handler call); all three by default.

Two measures per run: wall-clock messages/s (from start to the last message finished)
and CPU time per message, ``time.process_time()`` around the whole run (event loop,
consumer start, drain and shutdown) over the messages. On a shared machine the CPU
time is the steadier of the two. With ``--repeat``, each is the best of the runs
(highest rate; lowest CPU time, separately); the JSON keeps every run under ``runs``.

    python -m benchmarks.overhead                    # 200,000 messages, 8 queues
    python -m benchmarks.overhead --messages 1000000 --memory
    python -m benchmarks.overhead --modes concurrent,staged --repeat 1
    python -m benchmarks.overhead --handler checkpoint   # every call waits once

``--handler checkpoint`` makes every handler call (and the baseline's) wait once on
the event loop (``anyio.lowlevel.checkpoint()``; ``asyncio.sleep(0)`` in the baseline):
the cost of the runtime for handlers that do I/O on every message, where no call
joins a run.
    python benchmarks/overhead.py                    # the same, as a script
    python -m benchmarks.overhead --variants async   # the async handlers alone
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import resource
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script, benchmarks/ comes first on sys.path: put the repository root
    # there instead, so that imports resolve as under ``python -m benchmarks.X``.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import anyio
import anyio.lowlevel
from rich.console import Console
from rich.table import Table

from benchmarks._reproduce import print_reproduce
from offsetstore import MemoryOffsetStore
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeMessageContext,
    ConsumeMessageHook,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PushConsumer,
)

TOPIC = "bench"
MODES = ("concurrent", "staged", "orderly")
"""What ``--modes`` chooses from (the baseline always runs)."""
VARIANTS = ("async", "sync", "hooked")
"""What ``--variants`` chooses from: ``async`` handlers, plain ``def`` handlers, and
``async`` handlers with a no-op consume hook."""
FLOOR = "plain-await floor"


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


class CheckpointConcurrently(MessageListenerConcurrently):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        await anyio.lowlevel.checkpoint()


class CheckpointOrderly(MessageListenerOrderly):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        await anyio.lowlevel.checkpoint()


class CheckpointStaged(NoopStaged):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        await anyio.lowlevel.checkpoint()


class SyncNoopConcurrently(MessageListenerConcurrently):
    def consume_message(  # a plain def: each call runs on a worker thread
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        return None


class SyncNoopOrderly(MessageListenerOrderly):
    def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> None:
        return None


class SyncNoopStaged(MessageListenerStagedConcurrently):
    def __init__(self, stage_size: int, stages: int) -> None:
        self._definitions = [stage_size] * stages

    def get_stage_definitions(self) -> Sequence[int]:
        return self._definitions

    def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        return None


class NoopHook(ConsumeMessageHook):
    """A consume hook that does nothing: the cost of the hook machinery."""

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        return None

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        return None


HANDLERS = {
    "noop": (NoopConcurrently, NoopStaged, NoopOrderly),
    "checkpoint": (CheckpointConcurrently, CheckpointStaged, CheckpointOrderly),
}
"""What ``--handler`` chooses: the listener classes per mode (the ``sync`` variant
always has no-op handlers, which cannot wait on the event loop)."""
SYNC_HANDLERS = (SyncNoopConcurrently, SyncNoopStaged, SyncNoopOrderly)


def fill(messages: int, queues: int) -> MemoryBroker:
    broker = MemoryBroker()
    broker.create_topic(TOPIC, queues)
    body = b"x" * 16
    for i in range(messages):
        broker.send(TOPIC, body, queue_id=i % queues)
    return broker


async def baseline(messages: list[Message], wait: bool = False) -> float:
    """One task per message under a semaphore of 20, as written by hand (``wait``: the
    handler waits once on the event loop)."""
    semaphore = asyncio.Semaphore(20)

    async def handle(message: Message) -> None:
        async with semaphore:
            if wait:
                await asyncio.sleep(0)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for message in messages:
            await semaphore.acquire()
            semaphore.release()
            tg.create_task(handle(message))
    return time.perf_counter() - start


async def plain_await_floor(listener: Any, messages: list[Message]) -> tuple[float, float]:
    """The floor: ``listener``'s handler awaited once per message, one message per
    call as the consumer calls it, nothing else; returns the seconds it took, by wall
    clock and CPU time (the loop alone: starting an event loop would be a good part
    of it)."""
    context = ConsumeConcurrentlyContext(message_queue=MessageQueue(TOPIC, 0))
    consume = listener.consume_message
    cpu = time.process_time()
    start = time.perf_counter()
    for message in messages:
        await consume((message,), context)
    return time.perf_counter() - start, time.process_time() - cpu


async def run_consumer(
    broker: MemoryBroker,
    listener: Any,
    options: ConsumerOptions,
    expected: int,
    hooks: Sequence[Any] = (),
) -> float:
    """Consume the backlog once; returns the seconds until every message finished.

    Every run has an offset store of its own, so it consumes the whole backlog again
    (given none, consumers of one broker share their group's progress)."""
    store = MemoryOffsetStore()
    consumer = PushConsumer("bench", broker, listener, offset_store=store, options=options)
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


def parse_modes(text: str) -> tuple[str, ...]:
    """``--modes concurrent,staged``: a comma-separated subset of :data:`MODES`, in
    :data:`MODES` order."""
    chosen = {part.strip() for part in text.split(",") if part.strip()}
    unknown = chosen - set(MODES)
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(MODES)}, got {text!r}"
        )
    return tuple(mode for mode in MODES if mode in chosen)


def parse_variants(text: str) -> tuple[str, ...]:
    """``--variants async,hooked``: a comma-separated subset of :data:`VARIANTS`."""
    chosen = {part.strip() for part in text.split(",") if part.strip()}
    unknown = chosen - set(VARIANTS)
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(VARIANTS)}, got {text!r}"
        )
    return tuple(variant for variant in VARIANTS if variant in chosen)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    n, queues = args.messages, args.queues
    per_queue = -(-n // queues)
    broker = fill(n, queues)
    all_messages = [m for q in range(queues) for m in broker.messages(TOPIC, q)]

    def record(name: str, elapsed: float, cpu: float, peak: int | None = None) -> None:
        rows.append(
            {
                "mode": name,
                "messages": n,
                "seconds": elapsed,
                "rate": n / elapsed,
                "cpu_us": 1e6 * cpu / n,
                "peak_mib": None if peak is None else peak / 2**20,
                "load": os.getloadavg()[0],
            }
        )

    for _ in range(args.repeat):
        gc.collect()
        cpu = time.process_time()
        elapsed = asyncio.run(baseline(all_messages, wait=args.handler == "checkpoint"))
        record("baseline: task per message + Semaphore(20)", elapsed, time.process_time() - cpu)
        gc.collect()
        elapsed, cpu = anyio.run(
            plain_await_floor, HANDLERS[args.handler][0](), all_messages, backend=args.backend
        )
        record(FLOOR, elapsed, cpu)
        stages = -(-per_queue // args.stage_size)
        for variant in args.variants:
            concurrent, staged, orderly = (
                SYNC_HANDLERS if variant == "sync" else HANDLERS[args.handler]
            )
            suffix = {"async": "", "sync": ", sync handler", "hooked": " + no-op hook"}[variant]
            cases: list[tuple[str, str, Any]] = [
                ("concurrent", f"concurrent{suffix}", concurrent()),
                (
                    "staged",
                    f"staged [{args.stage_size}]*k{suffix}",
                    staged(args.stage_size, stages),
                ),
                ("orderly", f"orderly, {queues} queues{suffix}", orderly()),
            ]
            hooks = [NoopHook()] if variant == "hooked" else []
            for mode, name, listener in cases:
                if mode not in args.modes:
                    continue
                options = ConsumerOptions(consume_thread_max=20)
                gc.collect()
                if args.memory:
                    tracemalloc.start()
                cpu = time.process_time()
                elapsed = anyio.run(
                    run_consumer, broker, listener, options, n, hooks, backend=args.backend
                )
                cpu = time.process_time() - cpu
                peak = None
                if args.memory:
                    peak = tracemalloc.get_traced_memory()[1]
                    tracemalloc.stop()
                record(name, elapsed, cpu, peak)
    return rows


def best(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode: the run with the highest rate, with the lowest CPU time of all its runs
    (each measure's own best, as in ``benchmarks.tracing_overhead``) and every run under
    ``runs``."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        run = {key: row[key] for key in ("seconds", "rate", "cpu_us", "load")}
        kept = out.get(row["mode"])
        if kept is None:
            out[row["mode"]] = {**row, "runs": [run]}
            continue
        runs = [*kept["runs"], run]
        cpu_us = min(row["cpu_us"], kept["cpu_us"])
        if row["rate"] > kept["rate"]:
            kept = {**row}
        out[row["mode"]] = {**kept, "cpu_us": cpu_us, "runs": runs}
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
    parser.add_argument(
        "--memory",
        action="store_true",
        help="trace peak Python memory (slower; tracemalloc's cost is in the CPU time too)",
    )
    parser.add_argument(
        "--modes",
        type=parse_modes,
        default=MODES,
        metavar="MODE[,MODE...]",
        help=f"modes to run, of {','.join(MODES)} (default: all; the baseline always runs)",
    )
    parser.add_argument(
        "--variants",
        type=parse_variants,
        default=VARIANTS,
        metavar="VARIANT[,VARIANT...]",
        help=f"handler variants to run, of {','.join(VARIANTS)} (default: all; the baseline"
        " and the plain-await floor always run)",
    )
    parser.add_argument(
        "--handler",
        choices=sorted(HANDLERS),
        default="noop",
        help="noop (default), or checkpoint: every call waits once on the event loop",
    )
    parser.add_argument("--json", type=Path, help="also write results as JSON here")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    rows = best(measure(args))
    load_after = os.getloadavg()[0]
    base = next(r for name, r in rows.items() if name.startswith("baseline"))
    floor = rows[FLOOR]
    concurrent = rows.get("concurrent")
    table = Table(
        title=f"{'No-op' if args.handler == 'noop' else 'Checkpoint-per-call'} handler"
        f" throughput, {args.messages:,} messages,"
        f" {args.queues} queues, {args.backend}"
    )
    table.add_column("mode")
    table.add_column("seconds", justify="right")
    table.add_column("messages/s", justify="right")
    table.add_column("CPU µs/msg", justify="right")
    table.add_column("vs floor (CPU)", justify="right")
    table.add_column("vs baseline", justify="right")
    table.add_column("vs concurrent", justify="right")
    if args.memory:
        table.add_column("peak MiB", justify="right")
    for name, row in rows.items():
        cells = [
            name,
            f"{row['seconds']:.3f}",
            f"{row['rate']:,.0f}",
            f"{row['cpu_us']:.2f}",
            f"{row['cpu_us'] / floor['cpu_us']:.1f}x",
            f"{row['rate'] / base['rate']:.2f}x",
            f"{row['rate'] / concurrent['rate']:.2f}x" if concurrent else "",
        ]
        if args.memory:
            cells.append(f"{row['peak_mib']:.1f}" if row["peak_mib"] is not None else "")
        table.add_row(*cells)
    console = Console()
    console.print(table)
    console.print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs (shared), best of"
        f" {args.repeat} (rate and CPU each); vs floor: CPU per message over the"
        f" {FLOOR}'s; the other ratios are of messages/s; max RSS"
        f" {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB;"
        f" 1-minute load average {load_before:.2f} before, {load_after:.2f} after"
    )
    print_reproduce(console, "overhead", argv)
    if args.json:
        args.json.write_text(json.dumps(list(rows.values()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
