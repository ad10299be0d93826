"""End-to-end over Redis Streams: messages/s and send-to-handler latency, no-op handlers.

Every system runs in this process against the same Redis, one after the other, with
the same data layout (8 streams, one per queue), each in its own key namespace:

- stagedconsumer's ``PushConsumer`` on ``RedisBroker``, in each mode (one group
  member, holding the locks of all 8 queues), and the concurrent mode once more with
  ``read_ahead=0`` (every pull one ``XRANGE`` of ``--pull-batch`` entries) and once
  with RocketMQ's batch consumption (``consume_message_batch_max_size=32``: a handler
  call gets up to 32 messages, and records each);
- baseline 1: a hand-written redis-py loop, ``XREADGROUP COUNT n BLOCK`` over the 8
  streams, an async no-op handler awaited per message, one ``XACK`` per stream per
  batch;
- baseline 2: FastStream's Redis stream subscribers (one ``StreamSub`` per stream,
  consumer group, default acknowledgement), a peer Python users pick today;
- floors, no consumer and no handler: a loop of ``XRANGE`` over the 8 streams
  with redis-py + hiredis, once with the entries decoded into ``Message`` objects as
  ``RedisBroker`` does and once without decoding. Nothing that reads these streams
  through redis-py in one process can be cheaper per message. The same with coredis
  (raw replies, RESP3, no decoding of strings: its fastest settings), on trio and on
  asyncio: the cost of the client ``RedisBroker`` uses on trio;
- the concurrent and staged modes on trio, where ``RedisBroker`` uses coredis;
- the concurrent mode on a Redis Cluster (``RedisBroker(url, cluster=True)``), on
  asyncio (redis-py's ``RedisCluster``) and trio (coredis's): the 8 queues spread
  over the masters. The cluster is ``--cluster-url`` (any node of a running cluster)
  or, without it, one the benchmark starts for the run: three masters without
  replicas (``redis-server --cluster-enabled yes`` on free ports of 127.0.0.1,
  ``redis-cli --cluster create``), stopped at the end;
- the consumer's own cost, without Redis: the concurrent mode on the embedded
  ``MemoryBroker`` holding the same backlog (drain only). Roughly, the concurrent
  mode over Redis costs this plus the first floor.

Same batch sizes: ``--read-batch`` entries per stream per Redis read for everyone
(``RedisBroker(read_ahead=...)``, ``XREADGROUP COUNT``, ``StreamSub(max_records=...)``,
the floors' ``XRANGE COUNT``); ``--pull-batch`` is the consumer's ``pull_batch_size``
(RocketMQ's default 32: the pulls after the first of every read are served from what
it read).

Two phases per system:

1. **drain**: a backlog of ``--messages`` is written first; messages/s is the
   backlog over the time from start to the last handler call, and CPU per message the
   process's CPU time (``time.process_time``) over that time: on a shared machine the
   wall-clock rate says as much about the neighbours as about the system; "of it GC"
   is the part spent in the cyclic garbage collector (``gc.callbacks``). Repeated
   ``--repeat`` times, the systems interleaved; the medians are reported.
   ``--gc-freeze`` moves everything alive before each phase out of the cyclic
   collector's reach: the consumer keeps up to ``pull_threshold_for_queue`` messages
   per queue alive, long enough for them to reach the oldest generation, whose full
   collections then walk every object the imports made.
2. **latency**: a separate producer process sends ``--latency-messages`` at
   ``--rate`` messages/s (the send time is in the message); the handler records
   ``now - send time`` at its start; p50/p99 are reported.

    python -m benchmarks.redis_e2e                     # 100,000 messages
    python -m benchmarks.redis_e2e --cluster-url redis://127.0.0.1:7000  # a cluster of yours
    python -m benchmarks.redis_e2e --messages 20000 --latency-messages 5000 --json out.json

``python benchmarks/redis_e2e.py`` (as a script) runs the same.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
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
from typing import Any, cast

import anyio
import redis
import redis.asyncio as aioredis
from redis.typing import KeyT, StreamIdT
from rich.console import Console
from rich.table import Table

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    GroupOptions,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    PushConsumer,
    RedisBroker,
)

try:
    from stagedconsumer._sources._redis_codec import _decode_entries
except ImportError:  # before 56c4e94: ``benchmarks.compare`` runs this driver on old trees
    from stagedconsumer._redis_broker import (  # type: ignore[import-not-found,no-redef]
        _decode_entries,
    )

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
        self.done = anyio.Event()
        self.last = 0.0

    def hit(self, sent_at: float | None) -> None:
        now = time.time()
        if self.latency and sent_at is not None:
            self.latencies.append(now - sent_at)
        self.count += 1
        if self.count >= self.expected:
            self.last = time.perf_counter()
            self.done.set()


# The listeners' handlers do per message what the hand-written loop's ``handle`` does
# per entry: one ``Recorder.hit``, reading the send time only when timed.


class NoopConcurrently(MessageListenerConcurrently):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        recorder = self.recorder
        for m in msgs:
            recorder.hit(_TS.unpack_from(m.body)[0] if recorder.latency else None)


class NoopOrderly(MessageListenerOrderly):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        recorder = self.recorder
        for m in msgs:
            recorder.hit(_TS.unpack_from(m.body)[0] if recorder.latency else None)


class NoopStaged(MessageListenerStagedConcurrently):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def get_stage_definitions(self) -> Sequence[int]:
        return [100] * 1000

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        recorder = self.recorder
        for m in msgs:
            recorder.hit(_TS.unpack_from(m.body)[0] if recorder.latency else None)


LISTENERS: dict[str, Callable[[Recorder], Any]] = {
    "stagedconsumer concurrent": NoopConcurrently,
    "stagedconsumer concurrent, batches of 32": NoopConcurrently,
    "stagedconsumer concurrent, cluster": NoopConcurrently,
    "stagedconsumer concurrent, cluster, trio (coredis)": NoopConcurrently,
    "stagedconsumer concurrent, trio (coredis)": NoopConcurrently,
    "stagedconsumer staged [100]*k, trio (coredis)": NoopStaged,
    "stagedconsumer concurrent, read_ahead=0": NoopConcurrently,
    "runtime only: concurrent on MemoryBroker": NoopConcurrently,
    "stagedconsumer staged [100]*k": NoopStaged,
    "stagedconsumer orderly": NoopOrderly,
}

# -- producing --------------------------------------------------------------------------------


def _cluster_options(cluster: bool) -> dict[str, Any]:
    """``RedisBroker`` options for a cluster (none for a single server, so that the
    driver runs against packages from before ``cluster=``)."""
    return {"cluster": True} if cluster else {}


def queue_keys(ns: str) -> list[str]:
    """The stream keys of the benchmark topic's queues, as the package under test names
    them (the layout changed over time; nothing connects here)."""
    broker = RedisBroker("redis://127.0.0.1:6379/0", namespace=ns)
    return [broker._stream_key(TOPIC, q) for q in range(QUEUES)]


def trio_supported() -> bool:
    """Whether the package under test's ``RedisBroker`` runs on trio (it did not before
    de7178a: ``benchmarks.compare`` runs this driver against old trees too)."""
    return hasattr(RedisBroker, "client_library")


def cluster_supported() -> bool:
    """Whether the package under test has ``RedisBroker(cluster=...)`` (``benchmarks.compare``
    runs this driver against old trees too)."""
    import inspect

    return "cluster" in inspect.signature(RedisBroker).parameters


async def fill_stagedconsumer(url: str, ns: str, n: int, cluster: bool = False) -> None:
    async with RedisBroker(url, namespace=ns, **_cluster_options(cluster)) as broker:
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


async def produce(url: str, ns: str, kind: str, n: int, rate: float, cluster: bool = False) -> None:
    """Send ``n`` messages at ``rate``/s, round-robin over the queues (in a child process)."""
    chunk = 10
    interval = chunk * QUEUES / rate
    start = time.perf_counter()
    if kind == "stagedconsumer":
        async with RedisBroker(url, namespace=ns, **_cluster_options(cluster)) as broker:
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


def spawn_producer(
    url: str, ns: str, kind: str, n: int, rate: float, cluster: bool = False
) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "benchmarks.redis_e2e", "--produce", kind, "--url", url]
    args += ["--namespace", ns, "--latency-messages", str(n), "--rate", str(rate)]
    if cluster:
        args.append("--produce-to-cluster")
    return subprocess.Popen(args, cwd=Path(__file__).resolve().parents[1])


# -- consuming ----------------------------------------------------------------------------------


async def run_stagedconsumer(
    url: str,
    ns: str,
    mode: str,
    recorder: Recorder,
    options: ConsumerOptions,
    read_batch: int,
    cluster: bool = False,
) -> float:
    group_options = GroupOptions(lock_ttl=60, lock_renew_interval=20, rebalance_interval=20)
    async with RedisBroker(
        url,
        namespace=ns,
        group_options=group_options,
        read_ahead=read_batch,
        **_cluster_options(cluster),
    ) as broker:
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

    async def handle(fields: Any) -> None:  # the same no-op as everyone's
        recorder.hit(float(fields[b"ts"]) if timed else None)

    start = time.perf_counter()
    try:
        streams: dict[KeyT, StreamIdT] = dict.fromkeys(keys, ">")
        while not recorder.done.is_set():
            # RESP2, the client's default protocol: a list of [stream, entries]
            reply = cast(
                "list[list[Any]]",
                await client.xreadgroup("g", "c1", streams, count=batch, block=100),
            )
            for stream, entries in reply or ():
                ids = []
                for entry_id, fields in entries:
                    await handle(fields)
                    ids.append(entry_id)
                await client.xack(stream, "g", *ids)
    finally:
        await client.aclose()
    return recorder.last - start


async def run_faststream(url: str, ns: str, recorder: Recorder, batch: int) -> float:
    from faststream.redis import RedisBroker as FastStreamBroker
    from faststream.redis import StreamSub

    # faststream types ``logger`` as a logger only; None (no logging) is what it documents
    broker = FastStreamBroker(url, logger=None)  # type: ignore[arg-type]
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


def fill_memory(n: int) -> MemoryBroker:
    broker = MemoryBroker()
    broker.create_topic(TOPIC, QUEUES)
    body = _TS.pack(0.0)
    for q in range(QUEUES):
        broker.send_many(TOPIC, [body] * (n // QUEUES), queue_id=q)
    return broker


async def run_memory(broker: MemoryBroker, recorder: Recorder, options: ConsumerOptions) -> float:
    """The concurrent mode on the embedded broker: the consumer's cost without Redis."""
    consumer = PushConsumer("bench", broker, NoopConcurrently(recorder), options=options)
    consumer.subscribe(TOPIC)
    start = time.perf_counter()
    async with consumer:
        await recorder.done.wait()
    return recorder.last - start


async def run_floor(
    url: str, ns: str, recorder: Recorder, batch: int, *, decode: bool, coredis_client: bool
) -> float:
    """``XRANGE COUNT batch`` over the 8 streams in turn, decoding as RedisBroker does
    (or not): the cost of reading alone, no consumer, no handler. With redis-py (raw
    replies, hiredis) or coredis (raw replies: ``NoopCallback``, RESP3, bytes, its
    mypyc-compiled parser), each at its fastest."""
    async with contextlib.AsyncExitStack() as stack:
        if coredis_client:
            import coredis
            from coredis.response._callbacks import NoopCallback

            core_client = await stack.enter_async_context(
                coredis.Redis.from_url(url, decode_responses=False, verify_version=False)
            )
            create, noop = core_client.create_request, NoopCallback()  # type: ignore[var-annotated]

            def xrange(key: str, start: bytes) -> Any:
                return create(b"XRANGE", key, start, b"+", b"COUNT", batch, callback=noop)
        else:
            client = aioredis.Redis.from_url(url)
            client.response_callbacks.clear()
            stack.push_async_callback(client.aclose)

            def xrange(key: str, start: bytes) -> Any:
                # redis-py leaves ``execute_command`` unannotated
                return client.execute_command(  # type: ignore[no-untyped-call]
                    "XRANGE", key, start, "+", "COUNT", batch
                )

        keys = queue_keys(ns)
        offsets = [0] * QUEUES
        start = time.perf_counter()
        got = 0
        while got < recorder.expected:
            for q, key in enumerate(keys):
                entries = await xrange(key, b"%d-0" % (offsets[q] + 1))
                if decode:
                    _decode_entries(TOPIC, q, entries)
                offsets[q] += len(entries)
                got += len(entries)
        return time.perf_counter() - start


# -- measuring ------------------------------------------------------------------------------------


_GC_TIME = [0.0, 0.0]
"""CPU seconds in the cyclic garbage collector since the phase started; when the
running collection started."""


def _time_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _GC_TIME[1] = time.process_time()
    else:
        _GC_TIME[0] += time.process_time() - _GC_TIME[1]


def _kind(name: str) -> str:
    if name.startswith("stagedconsumer"):
        return "stagedconsumer"
    if name.startswith("floor"):
        return "floor"
    if name.startswith("runtime"):
        return "memory"
    return "raw"


def drain_parser(description: str | None, default_messages: int) -> argparse.ArgumentParser:
    """The command line of a program that counts drain phases (``redis_instructions``,
    ``redis_bytecodes``): ``--url`` and ``--messages``, the smaller run's size (see
    :func:`drain_messages`)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--messages",
        type=int,
        default=default_messages,
        help=f"the smaller run's size, a multiple of 80 (default {default_messages})",
    )
    return parser


def drain_messages(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--messages`` of a :func:`drain_parser` command line, checked: a positive
    multiple of 80, so that every one of the 8 streams gets 10 or more."""
    n: int = args.messages
    if n < 80 or n % 80:
        parser.error("--messages must be a positive multiple of 80 (8 streams, 10 each)")
    return n


def drain_args(url: str, messages: int) -> argparse.Namespace:
    """The options of a drain phase of ``messages`` against Redis at ``url``, as the
    command line's defaults give them (for programs that run :func:`measure_phase`
    themselves: ``redis_instructions``, ``redis_bytecodes``)."""
    return argparse.Namespace(
        url=url,
        cluster_url=None,
        messages=messages,
        latency_messages=0,
        rate=5000.0,
        pull_batch=32,
        read_batch=128,
        gc_freeze=False,
    )


async def measure_phase(name: str, args: argparse.Namespace, latency: bool) -> dict[str, Any]:
    """One drain or latency phase of one system, in a fresh namespace."""
    cluster = "cluster" in name
    url = args.cluster_url if cluster else args.url
    options = ConsumerOptions(
        pull_batch_size=args.pull_batch,
        pull_long_polling_timeout=1.0,
        # RocketMQ's batch consumption: a handler call gets up to 32 messages
        consume_message_batch_max_size=BATCHED if name.endswith(f"batches of {BATCHED}") else 1,
    )
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    n = args.latency_messages if latency else args.messages
    n -= n % (QUEUES * 10)
    kind = _kind(name)
    if kind == "raw":
        await fill_raw(url, ns, 0 if latency else n, b"ts")
    elif kind == "memory":
        memory = fill_memory(n)
    else:
        await fill_stagedconsumer(url, ns, 0 if latency else n, cluster)
    recorder = Recorder(n, latency=latency)
    producer = spawn_producer(url, ns, kind, n, args.rate, cluster) if latency else None
    _GC_TIME[0] = 0.0
    cpu = time.process_time()
    try:
        if kind == "stagedconsumer":
            read_ahead = 0 if name.endswith("read_ahead=0") else args.read_batch
            elapsed = await run_stagedconsumer(
                url, ns, name, recorder, options, read_ahead, cluster
            )
        elif kind == "memory":
            elapsed = await run_memory(memory, recorder, options)
        elif kind == "floor":
            elapsed = await run_floor(
                url,
                ns,
                recorder,
                args.read_batch,
                decode="decode" in name,
                coredis_client="coredis" in name,
            )
        elif name.startswith("redis-py"):
            elapsed = await run_xreadgroup(url, ns, recorder, args.read_batch)
        else:
            elapsed = await run_faststream(url, ns, recorder, args.read_batch)
        cpu = time.process_time() - cpu
    finally:
        if producer is not None:
            producer.wait(60)
        await _delete_namespace(url, ns, cluster)
    if latency:
        ordered = sorted(recorder.latencies)
        return {
            "p50_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
            "latency_messages": n,
        }
    return {
        "messages": n,
        "seconds": elapsed,
        "rate": n / elapsed,
        "cpu_us": 1e6 * cpu / n,
        "gc_us": 1e6 * _GC_TIME[0] / n,
        "load": os.getloadavg()[0],
    }


async def _delete_namespace(url: str, ns: str, cluster: bool = False) -> None:
    def delete() -> None:
        if cluster:  # scan_iter goes over every master
            with redis.RedisCluster.from_url(url) as cluster_client:
                for key in cluster_client.scan_iter(match=f"{ns}:*", count=1000):
                    cluster_client.delete(key)
            return
        with redis.Redis.from_url(url) as client:
            for key in client.scan_iter(match=f"{ns}:*", count=1000):
                client.delete(key)

    await anyio.to_thread.run_sync(delete)  # on either event loop


BATCHED = 32
"""consume_message_batch_max_size of the batched system."""

SYSTEMS = [
    "stagedconsumer concurrent",
    "stagedconsumer concurrent, batches of 32",
    "stagedconsumer concurrent, trio (coredis)",
    "stagedconsumer concurrent, read_ahead=0",
    "stagedconsumer staged [100]*k",
    "stagedconsumer staged [100]*k, trio (coredis)",
    "stagedconsumer orderly",
    "redis-py XREADGROUP + XACK loop",
    "FastStream StreamSub",
    "floor: XRANGE + decode, no consumer",
    "floor: XRANGE only",
    "floor: XRANGE + decode, coredis on trio",
    "floor: XRANGE only, coredis on trio",
    "floor: XRANGE only, coredis on asyncio",
    "runtime only: concurrent on MemoryBroker",
    "stagedconsumer concurrent, cluster",
    "stagedconsumer concurrent, cluster, trio (coredis)",
]
CLUSTER_SYSTEMS = [name for name in SYSTEMS if "cluster" in name]


def backend_of(name: str) -> str:
    """The event loop a system runs on: trio where its name says so."""
    return "trio" if "trio" in name else "asyncio"


LATENCY_SYSTEMS = [name for name in SYSTEMS if not name.startswith(("floor", "runtime"))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--cluster-url",
        help="any node of a running Redis Cluster for the cluster rows; without it the"
        " benchmark starts a cluster of three masters on free ports of 127.0.0.1",
    )
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--latency-messages", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=5_000, help="latency phase, messages/s")
    parser.add_argument("--pull-batch", type=int, default=32, help="consumer pull_batch_size")
    parser.add_argument(
        "--read-batch",
        type=int,
        default=128,
        help="entries per stream per Redis read, for every system (read_ahead, XREADGROUP"
        " COUNT, StreamSub max_records, floors' XRANGE COUNT)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="drain runs per system")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.collect() + gc.freeze() before every phase of every system, so full"
        " collections skip the imported modules' objects (a common tuning of services)",
    )
    parser.add_argument("--systems", nargs="*", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--json", type=Path, help="also write results as JSON here")
    parser.add_argument("--produce", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    parser.add_argument("--produce-to-cluster", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.produce:
        asyncio.run(
            produce(
                args.url,
                args.namespace,
                args.produce,
                args.latency_messages,
                args.rate,
                args.produce_to_cluster,
            )
        )
        return 0

    with contextlib.ExitStack() as stack:
        if not trio_supported():
            skipped = [name for name in args.systems if backend_of(name) == "trio"]
            if skipped:
                print(f"RedisBroker runs on asyncio only here: no {skipped}", file=sys.stderr)
                args.systems = [name for name in args.systems if name not in skipped]
        if any(name in CLUSTER_SYSTEMS for name in args.systems):
            if not cluster_supported():
                print("this package has no RedisBroker(cluster=): no cluster rows", file=sys.stderr)
                args.systems = [name for name in args.systems if name not in CLUSTER_SYSTEMS]
            elif args.cluster_url is None:
                args.cluster_url = stack.enter_context(_own_cluster())
        return _run(args, argv)


@contextlib.contextmanager
def _own_cluster() -> Any:
    """A Redis Cluster for this run (three masters, no replicas): its URL."""
    import tempfile

    from benchmarks._redis_cluster import RedisClusterServers

    with tempfile.TemporaryDirectory(prefix="redis-e2e-cluster-") as directory:
        cluster = RedisClusterServers(Path(directory), masters=3, replicas=0)
        try:
            cluster.start()
            print(f"started a Redis Cluster at {cluster.url}", file=sys.stderr)
            yield cluster.url
        finally:
            cluster.stop()


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    gc.callbacks.append(_time_gc)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.systems}
    for repeat in range(args.repeat):  # interleaved, so a busy spell hits every system
        for name in args.systems:
            run = anyio.run(measure_phase, name, args, False, backend=backend_of(name))
            runs[name].append(run)
            print(f"drain {repeat + 1}/{args.repeat} {name}: {run}", file=sys.stderr)
    rows = []
    for name in args.systems:
        drains = runs[name]
        row: dict[str, Any] = {
            "system": name,
            "messages": drains[0]["messages"],
            "rate": statistics.median(d["rate"] for d in drains),
            "cpu_us": statistics.median(d["cpu_us"] for d in drains),
            "gc_us": statistics.median(d["gc_us"] for d in drains),
            "load": statistics.mean(d["load"] for d in drains),
            "drains": drains,
        }
        if name in LATENCY_SYSTEMS and args.latency_messages:
            row |= anyio.run(measure_phase, name, args, True, backend=backend_of(name))
            print(f"latency {name}: {row['p50_ms']:.2f} / {row['p99_ms']:.2f} ms", file=sys.stderr)
        rows.append(row)
    base = {r["system"]: r for r in rows}
    reference = base.get("redis-py XREADGROUP + XACK loop")
    table = Table(
        title=f"Redis end to end, no-op handler: drain {args.messages:,} messages (median of"
        f" {args.repeat}), latency at {args.rate:,.0f} msg/s ({args.latency_messages:,}"
        f" messages), {QUEUES} streams"
    )
    columns = ("system", "messages/s", "CPU µs/msg", "of it GC", "msg per CPU-s", "vs loop (CPU)")
    for column in (*columns, "p50 ms", "p99 ms", "load"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for row in rows:
        ratio = f"{reference['cpu_us'] / row['cpu_us']:.2f}x" if reference else ""
        table.add_row(
            row["system"],
            f"{row['rate']:,.0f}",
            f"{row['cpu_us']:.2f}",
            f"{row['gc_us']:.2f}",
            f"{1e6 / row['cpu_us']:,.0f}",
            ratio,
            f"{row['p50_ms']:.2f}" if "p50_ms" in row else "",
            f"{row['p99_ms']:.2f}" if "p99_ms" in row else "",
            f"{row['load']:.1f}",
        )
    console = Console(width=max(Console().width, 150))
    console.print(table)
    console.print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs (shared), one consumer"
        f" process per system, pull batch {args.pull_batch}, read batch {args.read_batch},"
        f" gc.freeze() {'on' if args.gc_freeze else 'off'}; load: 1-minute load average"
        " after the drains"
        + (f"; cluster rows: Redis Cluster at {args.cluster_url}" if args.cluster_url else "")
    )
    from benchmarks._reproduce import print_reproduce

    print_reproduce(console, "redis_e2e", argv)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
