"""Memory of a large backlog: flow control keeps the consumer's memory flat.

A source that generates its messages on demand (so the backlog itself takes no
memory) offers 1,000,000 messages. Each mode consumes them with a no-op handler,
key-ordered consumption once with 10 keys and once with a distinct key per message,
while Python's allocations are traced; the table shows the traced memory at 10%,
50% and 100% of the backlog and the peak. The baseline, measured in the same run, is
the hand-written way: one task per message under a semaphore of 20, fed from the
same backlog, which holds every not-yet-run task in memory.

    python -m benchmarks.memory                      # 1,000,000 messages, 8 queues
    python -m benchmarks.memory --messages 200000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from benchmarks._reproduce import print_reproduce
from benchmarks.overhead import NoopConcurrently, NoopOrderly, NoopStaged
from stagedconsumer import (
    ConsumeOrderlyContext,
    ConsumerOptions,
    Message,
    MessageQueue,
    MessageSource,
    Ordering,
    PullResult,
    PushConsumer,
    SendBackResult,
    UnknownTopicError,
)

TOPIC = "backlog"

COLUMNS = ("mode", "at 10%", "at 50%", "at 100%", "peak", "seconds")
"""The table's columns (the table of docs/performance.md has the same)."""


class NoopKeyOrdered(NoopOrderly):
    """Key-ordered: one batch at a time per message key, keys concurrently."""

    ordering = Ordering.BY_KEY

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        return None


class GeneratedSource(MessageSource):
    """A read-only source whose queues hold ``per_queue`` generated messages each."""

    def __init__(
        self, queues: int, per_queue: int, body_size: int = 100, keys: int | None = None
    ) -> None:
        self.queues = queues
        self.per_queue = per_queue
        self.body = b"x" * body_size
        self.keys = keys
        """Messages carry one of ``keys`` keys (``0``: a distinct key each; ``None``: none)."""

    async def get_queues(self, topic: str) -> Sequence[MessageQueue]:
        if topic == TOPIC:
            return [MessageQueue(TOPIC, i) for i in range(self.queues)]
        if topic.startswith("%RETRY%"):
            return []
        raise UnknownTopicError(topic)

    def message(self, queue_id: int, offset: int) -> Message:
        keys: tuple[str, ...] = ()
        if self.keys is not None:
            n = offset * self.queues + queue_id
            keys = (f"key-{n if self.keys == 0 else n % self.keys}",)
        return Message(
            topic=TOPIC,
            queue_id=queue_id,
            queue_offset=offset,
            body=self.body,
            keys=keys,
            msg_id=f"{queue_id}-{offset}",
        )

    async def pull(
        self, mq: MessageQueue, offset: int, max_count: int, *, timeout: float = 0.0
    ) -> PullResult:
        end = min(self.per_queue, offset + max_count)
        messages = [self.message(mq.queue_id, o) for o in range(offset, end)]
        if not messages and timeout > 0:
            await anyio.sleep(timeout)
        return PullResult(
            messages=messages, next_offset=max(offset, end), max_offset=self.per_queue
        )

    async def max_offset(self, mq: MessageQueue) -> int:
        return self.per_queue

    async def send_back(
        self, group: str, message: Message, *, delay_level: int = 0, max_reconsume_times: int = 16
    ) -> SendBackResult:
        raise NotImplementedError("no failures in this benchmark")

    async def send_to_dlq(self, group: str, message: Message) -> None:
        raise NotImplementedError("no failures in this benchmark")


async def consume(
    source: GeneratedSource, listener: Any, progress: Any, task: Any
) -> dict[str, float]:
    total = source.queues * source.per_queue
    marks = {0.1: 0.0, 0.5: 0.0, 1.0: 0.0}
    # Tracing every allocation slows the loop's own work several times over: the
    # event-loop watchdog would report it as blocking (no handler here blocks).
    options = ConsumerOptions(event_loop_block_threshold=None)
    consumer = PushConsumer("memory", source, listener, options=options)
    consumer.subscribe(TOPIC)
    start = time.perf_counter()
    async with consumer, anyio.create_task_group() as tg:

        async def sample() -> None:
            while True:
                done = consumer.statistics().consumed_ok
                progress.update(task, completed=done)
                current = tracemalloc.get_traced_memory()[0]
                for fraction in marks:
                    if done >= fraction * total and not marks[fraction]:
                        marks[fraction] = current
                await anyio.sleep(0.05)

        tg.start_soon(sample)
        await consumer.wait_caught_up()
        tg.cancel_scope.cancel()
    elapsed = time.perf_counter() - start
    marks[1.0] = marks[1.0] or tracemalloc.get_traced_memory()[0]
    return {
        "10%": marks[0.1],
        "50%": marks[0.5],
        "100%": marks[1.0],
        "peak": tracemalloc.get_traced_memory()[1],
        "seconds": elapsed,
    }


async def baseline(source: GeneratedSource, progress: Any, task: Any) -> dict[str, float]:
    semaphore = asyncio.Semaphore(20)
    done = 0
    total = source.queues * source.per_queue
    marks = {0.1: 0.0, 0.5: 0.0, 1.0: 0.0}

    async def handle(message: Message) -> None:
        nonlocal done
        async with semaphore:
            done += 1
            if done % 10_000 == 0:
                progress.update(task, completed=done)
                current = tracemalloc.get_traced_memory()[0]
                for fraction in marks:
                    if done >= fraction * total and not marks[fraction]:
                        marks[fraction] = current

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for offset in range(source.per_queue):
            for queue_id in range(source.queues):
                tg.create_task(handle(source.message(queue_id, offset)))
    return {
        "10%": marks[0.1],
        "50%": marks[0.5],
        "100%": marks[1.0],
        "peak": tracemalloc.get_traced_memory()[1],
        "seconds": time.perf_counter() - start,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the task-per-message baseline"
    )
    args = parser.parse_args(argv)
    per_queue = args.messages // args.queues
    total = per_queue * args.queues
    results: dict[str, dict[str, float]] = {}
    cases: list[tuple[str, Any, int | None]] = []
    if not args.no_baseline:
        cases.append(("baseline: task per message + Semaphore(20)", None, None))
    cases += [
        ("concurrent", NoopConcurrently(), None),
        ("staged [100]*k", NoopStaged(100, -(-per_queue // 100)), None),
        ("orderly", NoopOrderly(), None),
        ("key-ordered, 10 keys", NoopKeyOrdered(), 10),
        (f"key-ordered, {total:,} keys (all distinct)", NoopKeyOrdered(), 0),
    ]
    with Progress() as progress:
        for name, listener, keys in cases:
            source = GeneratedSource(args.queues, per_queue, keys=keys)
            task = progress.add_task(name, total=total)
            gc.collect()
            tracemalloc.start()
            if listener is None:
                results[name] = asyncio.run(baseline(source, progress, task))
            else:
                results[name] = anyio.run(consume, source, listener, progress, task)
            tracemalloc.stop()
            progress.update(task, completed=total)
    table = Table(title=f"Traced Python memory while consuming a {total:,}-message backlog")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "mode" else "right")
    for name, r in results.items():
        table.add_row(
            name,
            *(f"{r[k] / 2**20:.1f} MiB" for k in ("10%", "50%", "100%", "peak")),
            f"{r['seconds']:.1f}",
        )
    console = Console()
    console.print(table)
    console.print(
        "The consumer's flow control (pull_threshold_for_queue=1000 per queue) bounds what it"
        " holds; memory at 10% and 100% of the backlog should be alike."
    )
    print_reproduce(console, "memory", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
