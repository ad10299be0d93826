"""End-to-end over Redis Streams: messages/s and send-to-handler latency, no-op handlers.

Every system runs in this process against the same Redis, one after the other, with
the same data layout (8 streams, one per queue), each in its own key namespace:

- stagedconsumer's ``PushConsumer`` on ``RedisBroker``, in each mode (one group
  member, holding the locks of all 8 queues);
- baseline 1: a hand-written redis-py loop, ``XREADGROUP COUNT n BLOCK`` over the 8
  streams, handler per message, one ``XACK`` per stream per batch;
- baseline 2: FastStream's Redis stream subscribers (one ``StreamSub`` per stream,
  consumer group, default acknowledgement), a peer Python users pick today.

Two phases per system:

1. **drain**: a backlog of ``--messages`` is written first; messages/s is the
   backlog over the time from start to the last handler call.
2. **latency**: a separate producer process sends ``--latency-messages`` at
   ``--rate`` messages/s (the send time is in the message); the handler records
   ``now - send time`` at its start; p50/p99 are reported.

    python -m benchmarks.redis_e2e                     # 100,000 messages
    python -m benchmarks.redis_e2e --messages 20000 --latency-messages 5000 --json out.json

Run it as a module (``-m``): ``benchmarks/offsetstore.py`` would shadow the package
when the script's folder is first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    GroupOptions,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    PushConsumer,
)
from stagedconsumer._redis_broker import RedisBroker

QUEUES = 8
TOPIC = "bench"
_TS = struct.Struct("<d")


class Recorder:
    """Counts handler starts and, when asked, their latency; sets ``done`` at ``expected``."""

    def __init__(self, expected: int, *, latency: bool) -> None:
        self.expected = expected
        self.count = 0
        self.latency = latency
        self.latencies: list[float] = []
        self.done = asyncio.Event()
        self.last = 0.0

    def hit(self, sent_at: float | None) -> None:
        now = time.time()
        if self.latency and sent_at is not None:
            self.latencies.append(now - sent_at)
        self.count += 1
        if self.count >= self.expected:
            self.last = time.perf_counter()
            self.done.set()


class _Listener:
    recorder: Recorder

    def _record(self, msgs: Sequence[Message]) -> None:
        hit = self.recorder.hit
        timed = self.recorder.latency
        for m in msgs:
            hit(_TS.unpack_from(m.body)[0] if timed else None)


class NoopConcurrently(_Listener, MessageListenerConcurrently):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self._record(msgs)


class NoopOrderly(_Listener, MessageListenerOrderly):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        self._record(msgs)


class NoopStaged(_Listener, MessageListenerStagedConcurrently):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def get_stage_definitions(self) -> Sequence[int]:
        return [100] * 1000

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        self._record(msgs)


LISTENERS: dict[str, Callable[[Recorder], Any]] = {
    "stagedconsumer concurrent": NoopConcurrently,
    "stagedconsumer staged [100]*k": NoopStaged,
    "stagedconsumer orderly": NoopOrderly,
}

# -- producing --------------------------------------------------------------------------------


async def fill_stagedconsumer(url: str, ns: str, n: int) -> None:
    async with RedisBroker(url, namespace=ns) as broker:
        await broker.create_topic(TOPIC, QUEUES)
        body = _TS.pack(0.0)
        for q in range(QUEUES):
            await broker.send_many(TOPIC, [body] * (n // QUEUES), queue_id=q, chunk=1000)


def stream_keys(ns: str) -> list[str]:
    return [f"{ns}:s{q}" for q in range(QUEUES)]


async def fill_raw(url: str, ns: str, n: int, field: bytes) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        keys = stream_keys(ns)
        for key in keys:
            await client.xgroup_create(key, "g", id="0", mkstream=True)
        per = n // QUEUES
        for key in keys:
            for start in range(0, per, 1000):
                async with client.pipeline(transaction=False) as pipe:
                    for _ in range(min(1000, per - start)):
                        pipe.xadd(key, {field: _value(field, 0.0)})
                    await pipe.execute()
    finally:
        await client.aclose()


def _value(field: bytes, at: float) -> bytes:
    return _TS.pack(at) if field == b"b" else repr(at).encode()


async def produce(url: str, ns: str, kind: str, n: int, rate: float) -> None:
    """Send ``n`` messages at ``rate``/s, round-robin over the queues (in a child process)."""
    chunk = 10
    interval = chunk * QUEUES / rate
    start = time.perf_counter()
    if kind == "stagedconsumer":
        async with RedisBroker(url, namespace=ns) as broker:
            for i in range(n // (chunk * QUEUES)):
                for q in range(QUEUES):
                    await broker.send_many(
                        TOPIC, [_TS.pack(time.time()) for _ in range(chunk)], queue_id=q
                    )
                await asyncio.sleep(max(0.0, start + (i + 1) * interval - time.perf_counter()))
        return
    field = b"ts"
    client = aioredis.Redis.from_url(url)
    try:
        keys = stream_keys(ns)
        for i in range(n // (chunk * QUEUES)):
            async with client.pipeline(transaction=False) as pipe:
                for key in keys:
                    for _ in range(chunk):
                        pipe.xadd(key, {field: _value(field, time.time())})
                await pipe.execute()
            await asyncio.sleep(max(0.0, start + (i + 1) * interval - time.perf_counter()))
    finally:
        await client.aclose()


def spawn_producer(url: str, ns: str, kind: str, n: int, rate: float) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "benchmarks.redis_e2e", "--produce", kind, "--url", url]
    args += ["--namespace", ns, "--latency-messages", str(n), "--rate", str(rate)]
    return subprocess.Popen(args, cwd=Path(__file__).resolve().parents[1])


# -- consuming ----------------------------------------------------------------------------------


async def run_stagedconsumer(
    url: str, ns: str, mode: str, recorder: Recorder, options: ConsumerOptions
) -> float:
    group_options = GroupOptions(lock_ttl=60, lock_renew_interval=20, rebalance_interval=20)
    async with RedisBroker(url, namespace=ns, group_options=group_options) as broker:
        await broker.create_topic(TOPIC, QUEUES)
        consumer = PushConsumer("bench", broker, LISTENERS[mode](recorder), options=options)
        consumer.subscribe(TOPIC)
        start = time.perf_counter()
        async with consumer:
            await recorder.done.wait()
        return recorder.last - start


async def run_xreadgroup(url: str, ns: str, recorder: Recorder, batch: int) -> float:
    """The hand-written baseline: XREADGROUP over all streams, XACK per stream per batch."""
    client = aioredis.Redis.from_url(url)
    keys = stream_keys(ns)
    for key in keys:
        with contextlib.suppress(aioredis.ResponseError):  # BUSYGROUP: made by the fill
            await client.xgroup_create(key, "g", id="0", mkstream=True)
    timed = recorder.latency
    start = time.perf_counter()
    try:
        streams = dict.fromkeys(keys, ">")
        while not recorder.done.is_set():
            reply = await client.xreadgroup("g", "c1", streams, count=batch, block=100)
            for key, entries in reply or ():
                ids = []
                for entry_id, fields in entries:
                    recorder.hit(float(fields[b"ts"]) if timed else None)
                    ids.append(entry_id)
                await client.xack(key, "g", *ids)
    finally:
        await client.aclose()
    return recorder.last - start


async def run_faststream(url: str, ns: str, recorder: Recorder, batch: int) -> float:
    from faststream.redis import RedisBroker as FastStreamBroker
    from faststream.redis import StreamSub

    broker = FastStreamBroker(url, logger=None)
    timed = recorder.latency
    for key in stream_keys(ns):

        async def handle(body: Any) -> None:
            recorder.hit(float(body["ts"]) if timed else None)

        broker.subscriber(
            # The group exists already (created at id 0 before the messages were sent).
            stream=StreamSub(key, group="g", consumer="c1", max_records=batch)
        )(handle)
    start = time.perf_counter()
    await broker.start()
    try:
        await recorder.done.wait()
    finally:
        await broker.stop()
    return recorder.last - start


# -- measuring ------------------------------------------------------------------------------------


async def measure_system(name: str, args: argparse.Namespace) -> dict[str, Any]:
    url = args.url
    options = ConsumerOptions(pull_batch_size=args.pull_batch, pull_long_polling_timeout=1.0)
    row: dict[str, Any] = {"system": name}
    for phase in ("drain", "latency"):
        ns = f"bench-{uuid.uuid4().hex[:8]}"
        latency = phase == "latency"
        n = args.latency_messages if latency else args.messages
        n -= n % (QUEUES * 10)
        kind = "stagedconsumer" if name.startswith("stagedconsumer") else "raw"
        if kind == "stagedconsumer":
            await fill_stagedconsumer(url, ns, 0 if latency else n)
        else:
            await fill_raw(url, ns, 0 if latency else n, b"ts")
        recorder = Recorder(n, latency=latency)
        producer = spawn_producer(url, ns, kind, n, args.rate) if latency else None
        try:
            if kind == "stagedconsumer":
                elapsed = await run_stagedconsumer(url, ns, name, recorder, options)
            elif name.startswith("redis-py"):
                elapsed = await run_xreadgroup(url, ns, recorder, args.pull_batch)
            else:
                elapsed = await run_faststream(url, ns, recorder, args.pull_batch)
        finally:
            if producer is not None:
                producer.wait(60)
            await _delete_namespace(url, ns)
        if latency:
            ordered = sorted(recorder.latencies)
            row["p50_ms"] = 1000 * statistics.median(ordered)
            row["p99_ms"] = 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
            row["latency_messages"] = n
        else:
            row["messages"] = n
            row["seconds"] = elapsed
            row["rate"] = n / elapsed
    return row


async def _delete_namespace(url: str, ns: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        async for key in client.scan_iter(match=f"{ns}:*", count=1000):
            await client.delete(key)
    finally:
        await client.aclose()


SYSTEMS = [
    "stagedconsumer concurrent",
    "stagedconsumer staged [100]*k",
    "stagedconsumer orderly",
    "redis-py XREADGROUP + XACK loop",
    "FastStream StreamSub",
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--latency-messages", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=5_000, help="latency phase, messages/s")
    parser.add_argument("--pull-batch", type=int, default=32, help="pull / XREADGROUP COUNT")
    parser.add_argument("--systems", nargs="*", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--json", type=Path, help="also write results as JSON here")
    parser.add_argument("--produce", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.produce:
        asyncio.run(
            produce(args.url, args.namespace, args.produce, args.latency_messages, args.rate)
        )
        return 0

    rows = []
    for name in args.systems:
        rows.append(asyncio.run(measure_system(name, args)))
        print(f"{name}: {rows[-1]}", file=sys.stderr)
    base = {r["system"]: r for r in rows}
    reference = base.get("redis-py XREADGROUP + XACK loop")
    table = Table(
        title=f"Redis end to end, no-op handler: drain {args.messages:,} messages, latency at"
        f" {args.rate:,.0f} msg/s ({args.latency_messages:,} messages), {QUEUES} streams"
    )
    for column in ("system", "messages/s", "vs redis-py loop", "p50 ms", "p99 ms"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for row in rows:
        ratio = f"{row['rate'] / reference['rate']:.2f}x" if reference else ""
        table.add_row(
            row["system"],
            f"{row['rate']:,.0f}",
            ratio,
            f"{row['p50_ms']:.2f}",
            f"{row['p99_ms']:.2f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs (shared), one consumer"
        f" process per system, pull batch {args.pull_batch}"
    )
    console.print("reproduce: python -m benchmarks.redis_e2e " + " ".join(argv or sys.argv[1:]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
