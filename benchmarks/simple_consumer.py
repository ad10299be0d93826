"""SimpleConsumer over Redis against the hand-written ``XREADGROUP`` + ``XACK`` loop:
CPU per message of receiving and acking no-op messages, in one run.

One backlog of ``--messages`` no-op messages is written to a topic of 8 queues (8
streams) with ``RedisBroker``; every system then drains it as a consumer group of its
own (``XGROUP CREATE ... 0``), in this process, one after the other, interleaved over
``--repeat`` rounds (medians reported):

- **loop**: the baseline of ``benchmarks/redis_e2e.py``: redis-py, ``XREADGROUP COUNT
  --batch BLOCK`` over the 8 streams, an async no-op handler awaited per entry, one
  ``XACK`` per stream per batch. It decodes nothing (the handler gets raw fields);
- **SimpleConsumer, ack**: ``receive(--batch, 60)``, the handler awaited per message,
  ``ack(message)`` per message (RocketMQ 5's loop: one round trip per ack);
- **SimpleConsumer, ack_async**: the same, ``ack_async(message)`` per message (RocketMQ
  5's ``ackAsync``: queued, and sent together with the next receive, one round trip);
- **SimpleConsumer, ack_batch**: the same, then one ``ack_batch`` per receive (one
  round trip);
- **receive 8x**: ``receive(8 * --batch)`` with ``ack_async`` or ``ack_batch``, as
  many messages per round trip as the loop's ``XREADGROUP``;
- **FastStream**: FastStream's Redis stream subscriber (``StreamSub`` with the group,
  ``max_records=--batch``, one per stream, as in ``benchmarks/redis_e2e.py``), its
  default acknowledgement (an ``XACK`` per message after the handler); skipped when
  ``faststream`` is not installed (the ``bench`` extra).

CPU per message is the process's CPU time (``time.process_time``) over the drain
divided by the messages. Each system runs twice per round: as is, and with the
cyclic garbage collector frozen (``gc.freeze()`` before the drain). The Redis server's
CPU (the Lua scripts) is not in it: it is reported separately, from ``INFO
cpu`` before and after each drain. By default the benchmark starts a redis-server of
its own on a free port (no persistence), so that no other client's work is counted
there; ``--url`` uses a running server instead.

    python -m benchmarks.simple_consumer                     # 40,000 messages, 3 rounds
    python -m benchmarks.simple_consumer --messages 100000 --repeat 5
    python -m benchmarks.simple_consumer --url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import redis
import redis.asyncio as aioredis

from benchmarks._ports import free_port
from stagedconsumer import RedisBroker, SimpleConsumer

QUEUES = 8
TOPIC = "bench"


async def fill(url: str, ns: str, n: int) -> list[str]:
    async with RedisBroker(url, namespace=ns) as broker:
        await broker.create_topic(TOPIC, QUEUES)
        for q in range(QUEUES):
            await broker.send_many(TOPIC, [b"x" * 16] * (n // QUEUES), queue_id=q, chunk=1000)
        return [broker._stream_key(TOPIC, q) for q in range(QUEUES)]


async def handle(body: Any) -> None:
    """The no-op handler everyone awaits per message."""


async def run_loop(url: str, ns: str, group: str, n: int, batch: int) -> None:
    client = aioredis.Redis.from_url(url)
    keys = [f"{ns}:q:{{{TOPIC}:{q}}}" for q in range(QUEUES)]
    try:
        for key in keys:
            await client.xgroup_create(key, group, id="0")
        done = 0
        streams: Any = dict.fromkeys(keys, ">")
        while done < n:
            reply: Any = await client.xreadgroup(group, "c1", streams, count=batch, block=100)
            for stream, entries in reply or ():
                ids = []
                for entry_id, fields in entries:
                    await handle(fields)
                    ids.append(entry_id)
                await client.xack(stream, group, *ids)
                done += len(ids)
    finally:
        await client.aclose()


async def run_simple(url: str, ns: str, group: str, n: int, batch: int, *, ack: str) -> None:
    """``ack``: ``"ack"`` (awaited per message), ``"ack_async"`` (queued per message,
    sent with the next receive) or ``"ack_batch"`` (one call per receive)."""
    async with RedisBroker(url, namespace=ns) as broker:
        consumer = SimpleConsumer(group, broker, subscriptions={TOPIC: "*"}, await_duration=1)
        async with consumer:
            done = 0
            while done < n:
                messages = await consumer.receive(batch, 60)
                for message in messages:
                    await handle(message.body)
                    if ack == "ack":
                        await consumer.ack(message)
                    elif ack == "ack_async":
                        consumer.ack_async(message)
                if ack == "ack_batch" and messages:
                    await consumer.ack_batch(messages)
                done += len(messages)


async def run_faststream(url: str, ns: str, group: str, n: int, batch: int) -> None:
    from faststream.redis import RedisBroker as FastStreamBroker
    from faststream.redis import StreamSub

    keys = [f"{ns}:q:{{{TOPIC}:{q}}}" for q in range(QUEUES)]
    client = aioredis.Redis.from_url(url)
    try:
        for key in keys:  # from the oldest entry, as the others
            await client.xgroup_create(key, group, id="0")
    finally:
        await client.aclose()
    # faststream types ``logger`` as a logger only; None (no logging) is what it documents
    broker = FastStreamBroker(url, logger=None)  # type: ignore[arg-type]
    done = asyncio.Event()
    count = 0

    async def on_message(body: Any) -> None:
        nonlocal count
        await handle(body)
        count += 1
        if count >= n:
            done.set()

    for key in keys:
        broker.subscriber(stream=StreamSub(key, group=group, consumer="c1", max_records=batch))(
            on_message
        )
    await broker.start()
    try:
        await done.wait()
    finally:
        await broker.stop()


async def server_cpu(url: str) -> float:
    client = aioredis.Redis.from_url(url)
    try:
        info = await client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    finally:
        await client.aclose()


Runner = Callable[[str], Awaitable[None]]


async def measure(url: str, run: Runner, n: int, frozen: bool) -> dict[str, float]:
    group = f"g-{uuid.uuid4().hex[:8]}"
    gc.collect()
    if frozen:
        gc.freeze()
    server = await server_cpu(url)
    cpu = time.process_time()
    wall = time.perf_counter()
    try:
        await run(group)
    finally:
        cpu = time.process_time() - cpu
        wall = time.perf_counter() - wall
        if frozen:
            gc.unfreeze()
    server = await server_cpu(url) - server
    return {"cpu_us": 1e6 * cpu / n, "rate": n / wall, "server_us": 1e6 * server / n}


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    ns = f"bench-simple-{uuid.uuid4().hex[:8]}"
    n = args.messages - args.messages % QUEUES
    url, batch = args.url, args.batch
    systems: dict[str, Runner] = {
        "redis-py XREADGROUP + XACK loop": lambda g: run_loop(url, ns, g, n, batch),
        f"SimpleConsumer receive({batch}) + ack": lambda g: run_simple(
            url, ns, g, n, batch, ack="ack"
        ),
        f"SimpleConsumer receive({batch}) + ack_async": lambda g: run_simple(
            url, ns, g, n, batch, ack="ack_async"
        ),
        f"SimpleConsumer receive({batch}) + ack_batch": lambda g: run_simple(
            url, ns, g, n, batch, ack="ack_batch"
        ),
        f"SimpleConsumer receive({QUEUES * batch}) + ack_async": lambda g: run_simple(
            url, ns, g, n, QUEUES * batch, ack="ack_async"
        ),
        f"SimpleConsumer receive({QUEUES * batch}) + ack_batch": lambda g: run_simple(
            url, ns, g, n, QUEUES * batch, ack="ack_batch"
        ),
    }
    try:
        import faststream  # noqa: F401
    except ImportError:
        print("faststream is not installed (pip install 'stagedconsumer[bench]'): skipped")
    else:
        systems["FastStream StreamSub"] = lambda g: run_faststream(url, ns, g, n, batch)
    if args.no_single_acks:
        del systems[f"SimpleConsumer receive({batch}) + ack"]
    await fill(url, ns, n)
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    try:
        for _ in range(args.repeat):
            for frozen in (False, True):
                for name, run in systems.items():
                    results.setdefault((name, frozen), []).append(
                        await measure(url, run, n, frozen)
                    )
    finally:
        async with RedisBroker(url, namespace=ns) as broker:
            await broker.delete_namespace()
    rows = []
    for (name, frozen), runs in results.items():
        rows.append(
            {
                "system": name,
                "gc": "frozen" if frozen else "on",
                "cpu_us": statistics.median(r["cpu_us"] for r in runs),
                "rate": statistics.median(r["rate"] for r in runs),
                "server_us": statistics.median(r["server_us"] for r in runs),
            }
        )
    return rows


@contextlib.contextmanager
def own_redis() -> Iterator[str]:
    """A private redis-server on a free port of 127.0.0.1, stopped at the end."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH: pass --url of a running server")
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", directory],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            client = redis.Redis(port=port)
            for _ in range(200):
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        break
                time.sleep(0.05)
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", default=None, help="a running Redis (default: start a private redis-server)"
    )
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--batch", type=int, default=32, help="XREADGROUP COUNT per stream"
                        " and max_message_num of receive (default 32, RocketMQ's)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--no-single-acks",
        action="store_true",
        help="leave out receive + one ack per message (a round trip per message: slow)",
    )
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.url is None:
            args.url = stack.enter_context(own_redis())
        rows = asyncio.run(main_async(args))
    print(
        f"{args.messages:,} no-op messages, 8 streams, median of {args.repeat} rounds;"
        f" python {platform.python_version()}; Redis {args.url}; load {os.getloadavg()[0]:.1f}"
    )
    print("command: python -m benchmarks.simple_consumer " + " ".join(argv or sys.argv[1:]))
    header = ("system", "GC", "msg/s", "CPU µs/msg", "vs loop", "Redis CPU µs/msg")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        loop = next(r for r in rows if r["gc"] == row["gc"] and r["system"].startswith("redis-py"))
        print(
            f"| {row['system']} | {row['gc']} | {row['rate']:,.0f} | {row['cpu_us']:.2f}"
            f" | {row['cpu_us'] / loop['cpu_us']:.2f}x | {row['server_us']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
