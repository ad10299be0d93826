"""Message trace to a Kafka trace topic, and OpenTelemetry's Kafka attributes."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from benchmarks._tansu import TansuServer
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeMessageTraceHook,
    ConsumerOptions,
    KafkaBroker,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    Producer,
    PushConsumer,
    SendMessageTraceHook,
    query_message_trace,
    read_trace_topic,
)
from stagedconsumer._cli._trace import message_history
from stagedconsumer._observability._trace_codec import RMQ_SYS_TRACE_TOPIC
from stagedconsumer.otel import OpenTelemetryHook, OpenTelemetrySendHook

pytestmark = [pytest.mark.anyio, pytest.mark.kafka]

OPTIONS = ConsumerOptions(
    persist_consumer_offset_interval=0.2,
    pull_long_polling_timeout=0.5,
    shutdown_timeout=5,
    consume_message_batch_max_size=1,
)


class Seen(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.seen: list[Message] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.seen.extend(msgs)


@pytest.mark.slow
async def test_trace_goes_to_a_kafka_trace_topic_and_spans_carry_kafka_attributes(
    broker: KafkaBroker, name: str
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    await broker.create_topic(name, 2)
    producer = Producer(broker, group="shop")
    producer.register_send_message_hook(SendMessageTraceHook())
    producer.register_send_message_hook(
        OpenTelemetrySendHook(tracer_provider=provider, messaging_system="kafka")
    )
    async with producer:
        sent = [await producer.send(name, b"%d" % i, keys=f"order-{i}") for i in range(4)]
    listener = Seen()
    consumer = PushConsumer(name, broker, listener, options=OPTIONS)
    consumer.subscribe(name)
    consumer.register_consume_message_hook(ConsumeMessageTraceHook(flush_interval=0.1))
    consumer.register_consume_message_hook(
        OpenTelemetryHook(tracer_provider=provider, messaging_system="kafka")
    )
    async with consumer:
        with anyio.fail_after(30):
            while len(listener.seen) < 4:
                await anyio.sleep(0.05)
    # the trace topic was made in Kafka, one partition, and holds every record
    assert await broker.get_queues(RMQ_SYS_TRACE_TOPIC) == [MessageQueue(RMQ_SYS_TRACE_TOPIC, 0)]
    stored = await read_trace_topic(broker)
    for result in sent:
        [history] = message_history(query_message_trace(stored, result.msg_id))
        assert [s.group for s in history.sends] == ["shop"]
        assert [(c.success, c.topic, c.queue_offset) for c in history.calls] == [
            (True, name, result.queue_offset)
        ]
    # spans: messaging.system kafka, the record's key, partition, offset, group
    by_offset = {(r.message_queue.queue_id, r.queue_offset): r for r in sent}
    process = [s for s in exporter.get_finished_spans() if s.name == f"process {name}"]
    assert len(process) == 4
    for span in process:
        a = dict(span.attributes or {})
        partition = int(str(a["messaging.destination.partition.id"]))
        result = by_offset[(partition, int(str(a["messaging.kafka.offset"])))]
        assert result.message is not None
        assert a["messaging.system"] == "kafka"
        assert a["messaging.kafka.message.key"] == result.message.keys[0]
        assert a["messaging.consumer.group.name"] == name
        assert a["messaging.destination.name"] == name
    sends = [dict(s.attributes or {}) for s in exporter.get_finished_spans()]
    sends = [a for a in sends if a.get("messaging.operation.name") == "send"]
    assert sorted(
        (str(a["messaging.kafka.message.key"]), int(str(a["messaging.kafka.offset"])))
        for a in sends
    ) == sorted((r.message.keys[0], r.queue_offset) for r in sent if r.message is not None)
    provider.shutdown()


async def test_other_systems_get_no_kafka_attributes() -> None:
    from stagedconsumer import MemoryBroker

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    producer = Producer(broker)
    producer.register_send_message_hook(OpenTelemetrySendHook(tracer_provider=provider))
    async with producer:
        await producer.send("t", b"x", keys="k")
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert "messaging.kafka.message.key" not in span.attributes
    assert "messaging.kafka.offset" not in span.attributes
    provider.shutdown()


@pytest.mark.slow
async def test_a_tombstone_is_marked_and_its_spans_say_so(
    broker: KafkaBroker, tansu: TansuServer, name: str
) -> None:
    """A record with a null value (written by a plain Kafka producer) is a message
    with an empty body and ``TOMBSTONE=true``, and its spans carry
    ``messaging.kafka.message.tombstone``; a record with an empty value is neither."""
    from aiokafka import AIOKafkaProducer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    await broker.create_topic(name, 1)
    plain = AIOKafkaProducer(bootstrap_servers=tansu.bootstrap)
    await plain.start()
    try:
        await plain.send_and_wait(name, None, key=b"deleted")
        await plain.send_and_wait(name, b"", key=b"empty", headers=[("p", b"v")])
    finally:
        await plain.stop()
    listener = Seen()
    consumer = PushConsumer(name, broker, listener, options=OPTIONS)
    consumer.subscribe(name)
    consumer.register_consume_message_hook(
        OpenTelemetryHook(tracer_provider=provider, messaging_system="kafka")
    )
    async with consumer:
        with anyio.fail_after(30):
            while len(listener.seen) < 2:
                await anyio.sleep(0.05)
    assert {m.keys[0]: (m.body, dict(m.properties)) for m in listener.seen} == {
        "deleted": (b"", {"TOMBSTONE": "true"}),
        "empty": (b"", {"p": "v"}),
    }
    process = [dict(s.attributes or {}) for s in exporter.get_finished_spans()]
    process = [a for a in process if a.get("messaging.operation.name") == "process"]
    assert {
        str(a["messaging.kafka.message.key"]): a.get("messaging.kafka.message.tombstone")
        for a in process
    } == {"deleted": True, "empty": None}
    provider.shutdown()
