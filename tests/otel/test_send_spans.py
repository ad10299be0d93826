"""OpenTelemetry on the send side: send and create spans, W3C context injected through
the propagation API, metrics, error.type, and the consumer's spans linking back."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import (
    CarrierT,
    Getter,
    Setter,
    TextMapPropagator,
    default_getter,
    default_setter,
)
from opentelemetry.sdk.metrics.export import HistogramDataPoint, NumberDataPoint
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    OutgoingMessage,
    Producer,
    ProducerOptions,
    PushConsumer,
    SourceError,
    UnknownTopicError,
)
from stagedconsumer.otel import (
    DURATION_BUCKETS,
    OpenTelemetryHook,
    OpenTelemetrySendHook,
    format_traceparent,
)

from .conftest import Otel

pytestmark = pytest.mark.anyio


class FlakyBroker(MemoryBroker):
    """The embedded broker whose first ``failures`` appends fail (retriable unless
    ``fatal``)."""

    def __init__(self, failures: int, *, fatal: bool = False) -> None:
        super().__init__()
        self.failures = failures
        self.fatal = fatal

    async def append(self, mq: MessageQueue, messages: Sequence[OutgoingMessage]) -> list[Message]:
        if self.failures > 0:
            self.failures -= 1
            raise SourceError(f"injected failure on {mq}", retriable=not self.fatal)
        return await super().append(mq, messages)


def new_broker(broker: MemoryBroker | None = None, queues: int = 2) -> MemoryBroker:
    broker = broker if broker is not None else MemoryBroker()
    broker.create_topic("t", queues)
    return broker


def producer(otel: Otel, broker: MemoryBroker, **options: Any) -> Producer:
    p = Producer(broker, group="pg", options=ProducerOptions(**options))
    p.register_send_message_hook(
        OpenTelemetrySendHook(
            tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider
        )
    )
    return p


def traceparent_of(context: SpanContext) -> str:
    return format_traceparent(context.trace_id, context.span_id, int(context.trace_flags))


async def test_send_makes_a_producer_span_and_injects_its_context(otel: Otel) -> None:
    broker = new_broker()
    app = otel.tracer_provider.get_tracer("app")
    async with producer(otel, broker) as p:
        with app.start_as_current_span("request") as request:
            result = await p.send("t", b"x", keys=["k"], properties={"a": "b"})
    [send] = otel.spans("send")
    assert send.name == "send t"
    assert send.kind is SpanKind.PRODUCER
    assert send.parent is not None
    assert send.parent.span_id == request.get_span_context().span_id
    assert dict(send.attributes or {}) == {
        "messaging.system": "stagedconsumer",
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
        "messaging.destination.name": "t",
        "messaging.destination.partition.id": str(result.message_queue.queue_id),
        "messaging.message.id": result.msg_id,
        "stagedconsumer.send.attempts": 1,
    }
    assert send.status.status_code is StatusCode.UNSET
    assert send.start_time is not None
    assert send.end_time is not None
    assert send.start_time <= send.end_time
    # The stored message carries the send span as its creation context.
    assert result.message is not None
    assert result.message.properties["traceparent"] == traceparent_of(send.context)
    assert result.message.properties["a"] == "b"
    # The caller's context is back once the call returned.
    assert trace.get_current_span() is trace.INVALID_SPAN

    metrics = otel.metrics()
    [sent] = metrics["messaging.client.sent.messages"]
    assert isinstance(sent, NumberDataPoint)
    assert sent.value == 1
    assert dict(sent.attributes or {}) == {
        "messaging.system": "stagedconsumer",
        "messaging.operation.name": "send",
        "messaging.destination.name": "t",
        "messaging.destination.partition.id": str(result.message_queue.queue_id),
    }
    [duration] = metrics["messaging.client.operation.duration"]
    assert isinstance(duration, HistogramDataPoint)
    assert duration.count == 1
    assert tuple(duration.explicit_bounds) == tuple(DURATION_BUCKETS)
    assert dict(duration.attributes or {})["messaging.operation.type"] == "send"
    # The recorded send span is the measurement's exemplar.
    assert [e.span_id for e in duration.exemplars] == [send.context.span_id]


async def test_batch_makes_a_create_span_per_message_linked_from_the_send_span(
    otel: Otel,
) -> None:
    broker = new_broker()
    async with producer(otel, broker) as p:
        results = await p.send_batch("t", [b"1", b"2", b"3"])
    creates = otel.spans("create")
    [send] = otel.spans("send")
    assert [c.name for c in creates] == ["create t"] * 3
    assert {c.kind for c in creates} == {SpanKind.PRODUCER}
    assert dict(creates[0].attributes or {})["messaging.operation.type"] == "create"
    assert send.kind is SpanKind.CLIENT
    attributes = dict(send.attributes or {})
    assert attributes["messaging.batch.message_count"] == 3
    assert "messaging.message.id" not in attributes
    assert [link.context.span_id for link in send.links] == [c.context.span_id for c in creates]
    # Each message carries its own create span.
    stored = [r.message for r in results]
    assert [m.properties["traceparent"] for m in stored if m is not None] == [
        traceparent_of(c.context) for c in creates
    ]
    [sent] = otel.metrics()["messaging.client.sent.messages"]
    assert sent.value == 3  # type: ignore[attr-defined]


async def test_a_message_keeps_the_creation_context_it_already_has(otel: Otel) -> None:
    broker = new_broker()
    origin = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with producer(otel, broker) as p:
        result = await p.send("t", b"x", properties={"traceparent": origin})
    [send] = otel.spans("send")
    assert send.kind is SpanKind.CLIENT  # not the creation context
    assert [traceparent_of(link.context) for link in send.links] == [origin]
    assert result.message is not None
    assert result.message.properties["traceparent"] == origin


async def test_a_failed_send_has_error_type_on_span_and_metrics(otel: Otel) -> None:
    broker = new_broker(FlakyBroker(1, fatal=True))
    async with producer(otel, broker) as p:
        with pytest.raises(SourceError, match="injected"):
            await p.send("t", b"x")
        with pytest.raises(UnknownTopicError):
            await p.send("missing", b"x")
    failed, unknown = otel.spans("send")
    error = "stagedconsumer._exceptions.SourceError"
    assert dict(failed.attributes or {})["error.type"] == error
    assert failed.status.status_code is StatusCode.ERROR
    assert [e.name for e in failed.events] == ["exception"]
    assert "messaging.message.id" not in dict(failed.attributes or {})
    assert unknown.name == "send missing"
    unknown_attrs = dict(unknown.attributes or {})
    assert unknown_attrs["error.type"] == "stagedconsumer._exceptions.UnknownTopicError"
    assert "messaging.destination.partition.id" not in unknown_attrs  # no queue chosen
    metrics = otel.metrics()
    sent = {}
    for point in metrics["messaging.client.sent.messages"]:
        attributes = dict(point.attributes or {})  # type: ignore[attr-defined]
        key = (attributes["messaging.destination.name"], attributes.get("error.type"))
        sent[key] = point.value  # type: ignore[attr-defined]
    assert sent == {
        ("t", error): 1,
        ("missing", "stagedconsumer._exceptions.UnknownTopicError"): 1,
    }
    durations = metrics["messaging.client.operation.duration"]
    assert sorted(dict(d.attributes or {})["error.type"] for d in durations) == sorted(  # type: ignore[attr-defined]
        [error, "stagedconsumer._exceptions.UnknownTopicError"]
    )


async def test_a_retried_send_is_one_span_with_its_attempts(otel: Otel) -> None:
    broker = new_broker(FlakyBroker(1))
    async with producer(otel, broker) as p:
        result = await p.send("t", b"x")
    [send] = otel.spans("send")
    attributes = dict(send.attributes or {})
    assert attributes["stagedconsumer.send.attempts"] == 2
    assert "error.type" not in attributes
    assert attributes["messaging.destination.partition.id"] == str(result.message_queue.queue_id)
    [sent] = otel.metrics()["messaging.client.sent.messages"]
    assert "error.type" not in dict(sent.attributes or {})  # type: ignore[attr-defined]


class Collect(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.messages.extend(msgs)


async def consume(otel: Otel, broker: MemoryBroker) -> Collect:
    listener = Collect()
    consumer = PushConsumer("g", broker, listener)
    consumer.subscribe("t")
    consumer.register_consume_message_hook(
        OpenTelemetryHook(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    )
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    return listener


async def test_the_consumer_links_to_the_send_and_create_spans(otel: Otel) -> None:
    broker = new_broker(queues=1)
    async with producer(otel, broker) as p:
        single = await p.send("t", b"single")
        batch = await p.send_batch("t", [b"b1", b"b2"])
    listener = await consume(otel, broker)
    assert len(listener.messages) == 3
    send_single, _ = otel.spans("send")
    creates = otel.spans("create")
    creation = {
        single.msg_id: ids(send_single.context),
        batch[0].msg_id: ids(creates[0].context),
        batch[1].msg_id: ids(creates[1].context),
    }
    process_links = {
        link.attributes["messaging.message.id"]: ids(link.context)  # type: ignore[index]
        for span in otel.spans("process")
        for link in span.links
    }
    assert process_links == creation
    receive_links = {
        link.attributes["messaging.message.id"]: ids(link.context)  # type: ignore[index]
        for span in otel.spans("receive")
        for link in span.links
    }
    assert receive_links == creation


def ids(context: SpanContext | None) -> tuple[int, int]:
    assert context is not None
    return context.trace_id, context.span_id


class KeyValuePropagator(TextMapPropagator):
    """A propagator of another format than W3C: ``x-ctx: <trace id>:<span id>``."""

    def inject(
        self,
        carrier: CarrierT,
        context: otel_context.Context | None = None,
        setter: Setter[CarrierT] = default_setter,
    ) -> None:
        span_context = trace.get_current_span(context).get_span_context()
        if span_context.is_valid:
            setter.set(carrier, "x-ctx", f"{span_context.trace_id:x}:{span_context.span_id:x}")

    def extract(
        self,
        carrier: CarrierT,
        context: otel_context.Context | None = None,
        getter: Getter[CarrierT] = default_getter,
    ) -> otel_context.Context:
        values = getter.get(carrier, "x-ctx")
        if not values:
            return context or otel_context.Context()
        trace_hex, span_hex = values[0].split(":")
        remote = SpanContext(
            int(trace_hex, 16), int(span_hex, 16), True, TraceFlags(TraceFlags.SAMPLED)
        )
        return trace.set_span_in_context(NonRecordingSpan(remote), context)

    @property
    def fields(self) -> set[str]:
        return {"x-ctx"}


@pytest.fixture
def key_value_propagator() -> Iterator[None]:
    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(KeyValuePropagator())
    yield
    propagate.set_global_textmap(previous)


@pytest.mark.usefixtures("key_value_propagator")
async def test_the_configured_propagator_is_used_on_both_sides(otel: Otel) -> None:
    broker = new_broker(queues=1)
    async with producer(otel, broker) as p:
        result = await p.send("t", b"x")
    [send] = otel.spans("send")
    assert result.message is not None
    properties: Mapping[str, str] = result.message.properties
    assert "traceparent" not in properties
    assert properties["x-ctx"] == f"{send.context.trace_id:x}:{send.context.span_id:x}"
    await consume(otel, broker)
    [process] = otel.spans("process")
    assert [link.context.span_id for link in process.links] == [send.context.span_id]


async def test_spans_off_still_injects_the_callers_context(otel: Otel) -> None:
    broker = new_broker()
    p = Producer(broker)
    p.register_send_message_hook(
        OpenTelemetrySendHook(
            tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider, spans=False
        )
    )
    app = otel.tracer_provider.get_tracer("app")
    async with p:
        with app.start_as_current_span("request") as request:
            result = await p.send("t", b"x")
        bare = await p.send("t", b"y")
    assert otel.spans("send") == []
    assert result.message is not None
    assert bare.message is not None
    assert result.message.properties["traceparent"] == traceparent_of(request.get_span_context())
    assert "traceparent" not in bare.message.properties
    sent = otel.metrics()["messaging.client.sent.messages"]
    assert sum(point.value for point in sent) == 2  # type: ignore[attr-defined]


async def test_without_the_hook_the_producer_injects_nothing(otel: Otel) -> None:
    broker = new_broker()
    app = otel.tracer_provider.get_tracer("app")
    async with Producer(broker) as p:
        with app.start_as_current_span("request"):
            result = await p.send("t", b"x")
    assert result.message is not None
    assert dict(result.message.properties) == {}


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("meter_provider", "x", "meter_provider must be an opentelemetry.metrics.MeterProvider"),
        ("tracer_provider", 5, "tracer_provider must be an opentelemetry.trace.TracerProvider"),
        ("messaging_system", "", "messaging_system must be a non-empty string"),
    ],
)
@pytest.mark.parametrize("hook", [OpenTelemetryHook, OpenTelemetrySendHook])
def test_wrong_types_are_refused_at_construction(
    hook: type[Any], argument: str, value: object, message: str
) -> None:
    with pytest.raises(TypeError, match=message) as caught:
        hook(**{argument: value})
    assert hook.__name__ in str(caught.value)
    assert type(value).__name__ in str(caught.value) or argument == "messaging_system"
