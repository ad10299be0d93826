"""OpenTelemetry spans and metrics for a producer (extra ``stagedconsumer[otel]``).

Follows the messaging semantic conventions v1.44 (status: development), as the
consume side (:class:`OpenTelemetryHook`) does:

- ``send <topic>`` per ``send`` / ``send_batch`` call, from the call's start to its
  return (retries included), a child of the span current where the call was made
  and current itself while the call runs. For ``send`` it is a PRODUCER span and
  the message's creation context: its W3C context is written into the message's
  properties through ``opentelemetry.propagate.inject``, so the configured
  propagators apply (``tracecontext,baggage`` by default);
- for ``send_batch``, a ``create <topic>`` PRODUCER span per message (the message's
  creation context, injected into it), and the ``send <topic>`` span is a CLIENT
  span linking to them (semconv's batch-sending shape);
- a message whose properties already carry a creation context (sent again, or
  injected by the caller) keeps it: the send span links to it, nothing is injected.

On failure the send span gets ``error.type`` (the exception's qualified class
name) and an ERROR status. Metrics: ``messaging.client.operation.duration``
(histogram, semconv buckets) per call and ``messaging.client.sent.messages``
(counter) per message, both with ``error.type`` on failure.

The consumer's :class:`OpenTelemetryHook` reads the creation context back from the
properties: its receive and process spans link to these spans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.util.types import AttributeValue

from ._otel_common import (
    BATCH_COUNT,
    MESSAGE_ID,
    Counts,
    add_kafka_attributes,
    creation_context,
    error_type_of,
    instruments,
    ns,
    seconds_histogram,
)
from ._send_hooks import SendMessageContext, SendMessageHook

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ("OpenTelemetrySendHook",)

ATTEMPTS = "stagedconsumer.send.attempts"
_PROPS_KEY = "stagedconsumer.otel.send"


class OpenTelemetrySendHook(SendMessageHook):
    """Spans and metrics of one producer's sends, after the messaging semantic
    conventions, and the W3C trace context put into each message.

    ``tracer_provider`` / ``meter_provider`` default to the global ones;
    ``messaging_system`` is the ``messaging.system`` attribute (default
    ``"stagedconsumer"``, as on the consume side; with ``"kafka"`` the send span of
    one record carries ``messaging.kafka.message.key`` and ``messaging.kafka.offset``).
    ``spans=False`` drops the spans
    (the context current at the call is still injected, so consumers can link to
    it); ``metrics=False`` drops the metrics. Register it on the producer::

        producer.register_send_message_hook(OpenTelemetrySendHook())
    """

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        messaging_system: str = "stagedconsumer",
        spans: bool = True,
        metrics: bool = True,
    ) -> None:
        self._tracer, meter = instruments(
            "OpenTelemetrySendHook", tracer_provider, meter_provider, messaging_system
        )
        self.messaging_system = messaging_system
        """The ``messaging.system`` attribute of the spans and metrics."""
        self._kafka = messaging_system == "kafka"
        self.spans = spans
        """Whether a ``send`` span is started per call."""
        self.metrics = metrics
        """Whether the semantic conventions' producer metrics are recorded."""
        self._duration = seconds_histogram(
            meter,
            "messaging.client.operation.duration",
            "Duration of messaging operation initiated by a producer or consumer client.",
        )
        self._sent_counts = Counts()
        meter.create_observable_counter(
            "messaging.client.sent.messages",
            [self._sent_counts.observe],
            unit="{message}",
            description="Number of messages producer attempted to send to the broker.",
        )
        # Attribute sets per topic (spans) and per queue (metrics), built once.
        self._span_attrs: dict[str, dict[str, AttributeValue]] = {}
        self._create_attrs: dict[str, dict[str, AttributeValue]] = {}
        self._metric_attrs: dict[tuple[str, int | None], tuple[dict[str, AttributeValue], ...]] = {}

    # -- attributes ---------------------------------------------------------------------

    def _attrs(self, operation: str, topic: str) -> dict[str, AttributeValue]:
        return {
            "messaging.system": self.messaging_system,
            "messaging.operation.name": operation,
            "messaging.operation.type": operation,
            "messaging.destination.name": topic,
        }

    def _queue_metric_attrs(
        self, topic: str, queue_id: int | None
    ) -> tuple[dict[str, AttributeValue], ...]:
        """(sent.messages attributes, operation.duration attributes) of a queue."""
        key = (topic, queue_id)
        cached = self._metric_attrs.get(key)
        if cached is None:
            if len(self._metric_attrs) >= 4096:  # topics may be many: stay bounded
                self._metric_attrs.clear()
            sent: dict[str, AttributeValue] = {
                "messaging.system": self.messaging_system,
                "messaging.operation.name": "send",
                "messaging.destination.name": topic,
            }
            if queue_id is not None:
                sent["messaging.destination.partition.id"] = str(queue_id)
            duration = {**sent, "messaging.operation.type": "send"}
            cached = self._metric_attrs[key] = (sent, duration)
        return cached

    # -- hook ---------------------------------------------------------------------------

    def send_message_before(self, context: SendMessageContext) -> None:
        messages = context.messages
        if not self.spans:
            # No spans of ours: the caller's context is the messages' creation context.
            for message in messages:
                if creation_context(message.properties) is None:
                    propagate.inject(message.properties)
            return
        topic = context.topic
        tracer = self._tracer
        start_time = ns(context.wall(context.start_time))
        attributes = self._span_attrs.get(topic)
        if attributes is None:
            attributes = self._span_attrs[topic] = self._attrs("send", topic)
        if len(messages) == 1:
            message = messages[0]
            existing = creation_context(message.properties)
            # The send span is the creation context, unless the message has one.
            span = tracer.start_span(
                f"send {topic}",
                kind=SpanKind.PRODUCER if existing is None else SpanKind.CLIENT,
                attributes=attributes,
                links=None if existing is None else [Link(existing)],
                start_time=start_time,
            )
            if existing is None:
                propagate.inject(message.properties, trace.set_span_in_context(span))
        else:
            create_attrs = self._create_attrs.get(topic)
            if create_attrs is None:
                create_attrs = self._create_attrs[topic] = self._attrs("create", topic)
            links: list[Link] = []
            for message in messages:
                existing = creation_context(message.properties)
                if existing is None:
                    create = tracer.start_span(
                        f"create {topic}",
                        kind=SpanKind.PRODUCER,
                        attributes=create_attrs,
                        start_time=start_time,
                    )
                    propagate.inject(message.properties, trace.set_span_in_context(create))
                    create.end()
                    existing = create.get_span_context()
                links.append(Link(existing))
            span = tracer.start_span(
                f"send {topic}",
                kind=SpanKind.CLIENT,
                attributes={**attributes, BATCH_COUNT: len(messages)},
                links=links,
                start_time=start_time,
            )
        # Current while the call runs: spans made below the producer (an instrumented
        # Redis client, say) are its children.
        current = trace.set_span_in_context(span)
        token = otel_context.attach(current)
        context.props[_PROPS_KEY] = (span, token, current)

    def send_message_after(self, context: SendMessageContext) -> None:
        state: tuple[Span, object, otel_context.Context] | None = context.props.pop(
            _PROPS_KEY, None
        )
        exception = context.exception
        error_type = error_type_of(exception) if exception is not None else None
        mq = context.message_queue
        measured_in: otel_context.Context | None = None
        if state is not None:
            span, token, measured_in = state
            try:
                if span.is_recording():
                    if mq is not None:
                        span.set_attribute("messaging.destination.partition.id", str(mq.queue_id))
                    if len(context.results) == 1:
                        result = context.results[0]
                        span.set_attribute(MESSAGE_ID, result.msg_id)
                        if self._kafka and result.message is not None:
                            kafka: dict[str, AttributeValue] = {}
                            add_kafka_attributes(kafka, result.message)
                            span.set_attributes(kafka)
                    span.set_attribute(ATTEMPTS, context.attempts)
                    if error_type is not None:
                        span.set_attribute("error.type", error_type)
                        span.set_status(Status(StatusCode.ERROR, error_type))
                        assert exception is not None
                        span.record_exception(exception)
                span.end(end_time=ns(context.wall(context.end_time)))
            finally:
                otel_context.detach(token)  # type: ignore[arg-type]
        if not self.metrics:
            return
        sent_attrs, duration_attrs = self._queue_metric_attrs(
            context.topic, mq.queue_id if mq is not None else None
        )
        if error_type is not None:
            sent_attrs = {**sent_attrs, "error.type": error_type}
            duration_attrs = {**duration_attrs, "error.type": error_type}
        # In the send span's context: a recorded span becomes the exemplar.
        self._duration.record(context.duration, duration_attrs, measured_in)
        self._sent_counts.add(len(context.messages), sent_attrs)
