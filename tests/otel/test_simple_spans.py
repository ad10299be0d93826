"""OpenTelemetry of a SimpleConsumer (pop consumption): a receive span per receive
call, process spans where the application asks (``hook.process``), a settle span per
ack / ack_batch / change_invisible_duration, and semconv's metrics."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics.export import HistogramDataPoint, NumberDataPoint
from opentelemetry.trace import SpanKind, StatusCode

from stagedconsumer import InvalidReceiptHandleError, MemoryBroker, SimpleConsumer
from stagedconsumer.otel import OpenTelemetryHook, parse_traceparent
from tests.test_simple_consumer import Clock

from .conftest import Otel

pytestmark = pytest.mark.anyio


def make(otel: Otel, broker: MemoryBroker, **hook_options: Any) -> tuple[SimpleConsumer, Any]:
    consumer = SimpleConsumer("g", broker, subscriptions={"t": "*"}, await_duration=0)
    hook = OpenTelemetryHook(
        tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider, **hook_options
    )
    consumer.register_consume_message_hook(hook)
    return consumer, hook


def send_traced(otel: Otel, broker: MemoryBroker, body: bytes, queue_id: int) -> int:
    """Send under a producer span (the broker puts its traceparent in the message);
    returns the span id."""
    tracer = otel.tracer_provider.get_tracer("producer")
    with tracer.start_as_current_span("send") as span:
        message = broker.send("t", body, queue_id=queue_id)
    parsed = parse_traceparent(message.properties["traceparent"])
    assert parsed is not None
    assert parsed[1] == span.get_span_context().span_id
    return span.get_span_context().span_id


async def test_receive_process_and_ack_spans(otel: Otel) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 2)
    created = [send_traced(otel, broker, b"%d" % i, i % 2) for i in range(3)]
    consumer, hook = make(otel, broker)
    app = otel.tracer_provider.get_tracer("app")
    async with consumer:
        messages = await consumer.receive(10, 30)
        assert len(messages) == 3
        (receive,) = otel.spans("receive ")
        assert receive.kind is SpanKind.CLIENT
        assert receive.attributes is not None
        assert receive.attributes["messaging.operation.type"] == "receive"
        assert receive.attributes["messaging.batch.message_count"] == 3
        assert receive.attributes["messaging.consumer.group.name"] == "g"
        # two queues in one receive: no single partition
        assert "messaging.destination.partition.id" not in receive.attributes
        assert sorted(link.context.span_id for link in receive.links) == sorted(created)
        with hook.process(messages[0]) as span:
            with app.start_as_current_span("work") as work:
                pass
            await consumer.ack(messages[0])
        assert span.is_recording() is False  # ended
        await consumer.ack_batch(messages[1:])
    (process,) = otel.spans("process ")
    assert process.kind is SpanKind.CONSUMER
    assert process.parent is not None
    assert process.parent.span_id == receive.context.span_id
    assert [link.context.span_id for link in process.links] == [created[0]]
    assert process.attributes is not None
    assert process.attributes["messaging.message.id"] == messages[0].msg_id
    assert process.attributes["stagedconsumer.attempt"] == 1
    (work_span,) = otel.spans("work")
    assert work_span.parent is not None
    assert work_span.parent.span_id == process.context.span_id
    assert work.get_span_context().span_id == work_span.context.span_id
    acks = otel.spans("ack ")
    assert len(acks) == 2  # one per ack call, one per ack_batch call
    single, batch = sorted(acks, key=lambda s: s.start_time or 0)
    assert single.kind is SpanKind.CLIENT
    assert single.attributes is not None
    assert batch.attributes is not None
    assert single.attributes["messaging.operation.type"] == "settle"
    assert single.attributes["messaging.operation.name"] == "ack"
    assert single.parent is not None
    assert single.parent.span_id == process.context.span_id
    assert batch.parent is None
    assert batch.attributes["messaging.batch.message_count"] == 2
    assert sorted(link.context.span_id for link in batch.links) == sorted(created[1:])
    assert all(s.status.status_code is StatusCode.UNSET for s in acks)


async def test_nack_change_and_refused_ack_spans(otel: Otel) -> None:
    clock = Clock()
    broker = MemoryBroker(clock=clock)
    broker.create_topic("t", 1)
    broker.send("t", b"a")
    broker.send("t", b"b")
    consumer, _hook = make(otel, broker)
    async with consumer:
        a, b = await consumer.receive(2, 10)
        await consumer.change_invisible_duration(a, 5)
        await consumer.change_invisible_duration(a, 0)
        clock.now += 10
        with pytest.raises(InvalidReceiptHandleError):
            await consumer.ack(b)
    (change,) = otel.spans("change_invisible_duration ")
    (nack,) = otel.spans("nack ")
    (refused,) = otel.spans("ack ")
    for span in (change, nack, refused):
        assert span.attributes is not None
        assert span.attributes["messaging.operation.type"] == "settle"
        assert span.attributes["messaging.destination.partition.id"] == "0"
    assert change.status.status_code is StatusCode.UNSET
    assert refused.status.status_code is StatusCode.ERROR
    assert refused.attributes is not None
    assert refused.attributes["error.type"].endswith("InvalidReceiptHandleError")
    assert refused.attributes["messaging.message.id"] == b.msg_id


async def test_process_records_an_exception_and_reraises(otel: Otel) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    broker.send("t", b"x")
    consumer, hook = make(otel, broker)
    async with consumer:
        (m,) = await consumer.receive(1, 10)
        with pytest.raises(KeyError), hook.process(m):
            raise KeyError("bug")
        assert trace.get_current_span() is trace.INVALID_SPAN  # detached
    (process,) = otel.spans("process ")
    assert process.status.status_code is StatusCode.ERROR
    assert process.attributes is not None
    assert process.attributes["error.type"] == "KeyError"
    points = otel.metrics()["messaging.process.duration"]
    assert isinstance(points[0], HistogramDataPoint)
    assert points[0].attributes is not None
    assert points[0].attributes["error.type"] == "KeyError"


async def test_metrics_of_receive_settle_and_process(otel: Otel) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for i in range(4):
        broker.send("t", b"%d" % i)
    consumer, hook = make(otel, broker, spans=False)
    async with consumer:
        messages = await consumer.receive(3, 10)
        messages += await consumer.receive(3, 10)
        for m in messages:
            with hook.process(m):
                pass
        await consumer.ack_batch(messages)
    assert otel.spans() == []
    metrics = otel.metrics()
    (consumed,) = metrics["messaging.client.consumed.messages"]
    assert isinstance(consumed, NumberDataPoint)
    assert consumed.value == 4
    assert consumed.attributes is not None
    assert consumed.attributes["messaging.operation.name"] == "receive"
    operations = {
        str((p.attributes or {})["messaging.operation.name"]): p
        for p in metrics["messaging.client.operation.duration"]
    }
    assert isinstance(operations["receive"], HistogramDataPoint)
    assert operations["receive"].count == 2
    assert isinstance(operations["ack"], HistogramDataPoint)
    assert operations["ack"].count == 1
    (process,) = metrics["messaging.process.duration"]
    assert isinstance(process, HistogramDataPoint)
    assert process.count == 4


async def test_no_receive_span_for_an_empty_receive(otel: Otel) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    consumer, _ = make(otel, broker)
    async with consumer:
        assert await consumer.receive(1, 10) == []
    assert otel.spans() == []
