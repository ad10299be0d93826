"""What the consume-side and send-side OpenTelemetry hooks share: the schema, the
duration buckets, attribute names, provider checks, ``error.type``, asynchronous
counts, and the creation context a message carries in its properties.

This module imports OpenTelemetry; the rest of the package does not.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from opentelemetry import metrics as otel_metrics
from opentelemetry import propagate, trace
from opentelemetry.metrics import CallbackOptions, Histogram, Meter, MeterProvider, Observation
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import Link, SpanContext, TraceFlags, Tracer, TracerProvider, TraceState
from opentelemetry.util.types import AttributeValue

from .._message import Message
from ._traceparent import TRACEPARENT, TRACESTATE, parse_traceparent

__all__ = (
    "BATCH_COUNT",
    "DURATION_BUCKETS",
    "MESSAGE_ID",
    "SCHEMA_URL",
    "Counts",
    "creation_context",
    "creation_link",
    "add_kafka_attributes",
    "error_type_of",
    "instruments",
    "ns",
    "seconds_histogram",
)

SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"
DURATION_BUCKETS: Sequence[float] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10,
)  # fmt: skip
"""Semconv's advisory bucket boundaries of ``messaging.process.duration`` and
``messaging.client.operation.duration`` (seconds)."""

MESSAGE_ID = "messaging.message.id"
BATCH_COUNT = "messaging.batch.message_count"
KAFKA_MESSAGE_KEY = "messaging.kafka.message.key"
KAFKA_OFFSET = "messaging.kafka.offset"
KAFKA_TOMBSTONE = "messaging.kafka.message.tombstone"
ERROR_TYPE = "error.type"

_W3C_FIELDS = frozenset({TRACEPARENT, TRACESTATE, "baggage"})


def add_kafka_attributes(attributes: dict[str, AttributeValue], message: Message) -> None:
    """The semantic conventions' Kafka attributes of a span about one record: its key
    (the message's first key; not set for a record without key), its offset, and
    ``messaging.kafka.message.tombstone=true`` for a tombstone (a record with a null
    value: the ``TOMBSTONE`` property; not set otherwise)."""
    if message.keys:
        attributes[KAFKA_MESSAGE_KEY] = message.keys[0]
    attributes[KAFKA_OFFSET] = message.queue_offset
    if message.properties.get("TOMBSTONE") == "true":
        attributes[KAFKA_TOMBSTONE] = True


def instruments(
    owner: str, tracer_provider: object, meter_provider: object, messaging_system: object
) -> tuple[Tracer, Meter]:
    """The project's tracer and meter from the given providers (the global ones for
    ``None``); a provider of another type, or a ``messaging_system`` that is not a
    name, raises :class:`TypeError` naming it, here rather than at the first message."""
    if not isinstance(messaging_system, str) or not messaging_system:
        raise TypeError(
            f"{owner}: messaging_system must be a non-empty string, got {messaging_system!r}"
        )
    if tracer_provider is not None and not isinstance(tracer_provider, TracerProvider):
        raise TypeError(
            f"{owner}: tracer_provider must be an opentelemetry.trace.TracerProvider (such as"
            f" opentelemetry.sdk.trace.TracerProvider()) or None for the global one, got"
            f" {type(tracer_provider).__name__}"
        )
    if meter_provider is not None and not isinstance(meter_provider, MeterProvider):
        raise TypeError(
            f"{owner}: meter_provider must be an opentelemetry.metrics.MeterProvider (such as"
            f" opentelemetry.sdk.metrics.MeterProvider() or serve_prometheus().meter_provider)"
            f" or None for the global one, got {type(meter_provider).__name__}"
        )
    from .._version import __version__

    tracer = trace.get_tracer("stagedconsumer", __version__, tracer_provider, schema_url=SCHEMA_URL)
    meter = otel_metrics.get_meter("stagedconsumer", __version__, meter_provider, SCHEMA_URL)
    return tracer, meter


def seconds_histogram(meter: Meter, name: str, description: str) -> Histogram:
    """A histogram in seconds with semconv's advisory buckets (:data:`DURATION_BUCKETS`)."""
    return meter.create_histogram(
        name,
        unit="s",
        description=description,
        explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
    )


def ns(wall_seconds: float) -> int:
    """Seconds since the epoch as OpenTelemetry's nanoseconds."""
    return int(wall_seconds * 1e9)


def error_type_of(exc: BaseException) -> str:
    """``error.type`` of an exception: its qualified class name (builtins bare)."""
    cls = type(exc)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


class Counts:
    """Monotonic counts per attribute set, observed by an asynchronous counter (which
    exports exactly as a counter): one dict update per call instead of an SDK
    measurement.

    A dict of attributes built once and reused is counted by identity:
    :meth:`key_of` registers it, and ``counts.by_key[key] += amount`` then counts
    (the cheapest update, for a hot path). :meth:`add` takes any attributes."""

    __slots__ = ("_attributes", "by_key")

    def __init__(self) -> None:
        # Keyed by the identity of a cached attribute dict, or its items when fresh:
        # the count, and the attributes it is observed with (registered before the
        # count appears, so that a collection that sees a count sees them too).
        self.by_key: defaultdict[object, int] = defaultdict(int)
        self._attributes: dict[object, dict[str, AttributeValue]] = {}

    def key_of(self, attributes: dict[str, AttributeValue]) -> object:
        """The key of ``attributes``, a dict built once and never changed (it is kept
        alive here, so its identity stays its own), for ``by_key[key] += amount``."""
        key = id(attributes)
        self._attributes[key] = attributes
        return key

    def add(self, amount: int, attributes: dict[str, AttributeValue]) -> None:
        """Add ``amount`` for ``attributes``: a dict built once and reused (counted by
        identity), or one holding ``error.type`` (counted by value)."""
        key: object = (
            id(attributes) if ERROR_TYPE not in attributes else tuple(sorted(attributes.items()))
        )
        if key not in self._attributes:
            self._attributes[key] = attributes
        self.by_key[key] += amount

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        del options
        attributes = self._attributes
        return [Observation(count, attributes[key]) for key, count in list(self.by_key.items())]


_checked_propagator: tuple[TextMapPropagator | None, bool] = (None, True)


def _w3c_only() -> bool:
    """Whether the global propagator reads nothing but W3C trace context and baggage
    (the default, ``tracecontext,baggage``): a message without ``traceparent`` then
    has no creation context, and one with it is read without the propagation API."""
    global _checked_propagator
    propagator = propagate.get_global_textmap()
    known, w3c_only = _checked_propagator
    if propagator is not known:
        w3c_only = set(propagator.fields) <= _W3C_FIELDS
        _checked_propagator = (propagator, w3c_only)
    return w3c_only


def creation_context(properties: Mapping[str, str]) -> SpanContext | None:
    """The creation context a producer put in a message's properties, or ``None``.

    The W3C ``traceparent`` (what the send hook writes with the default propagator)
    is parsed directly; with other propagators configured (B3, Jaeger, ...), the
    properties go through ``opentelemetry.propagate.extract`` as well, so that
    what a producer injected with them is read back with them."""
    value = properties.get(TRACEPARENT)
    if value:
        parsed = parse_traceparent(value)
        if parsed is not None:
            trace_id, span_id, flags = parsed
            state = properties.get(TRACESTATE)
            return SpanContext(
                trace_id,
                span_id,
                True,  # is_remote
                TraceFlags(flags & 0xFF),
                TraceState.from_header([state]) if state else None,
            )
    if not properties or _w3c_only():
        return None
    span_context = trace.get_current_span(propagate.extract(properties)).get_span_context()
    return span_context if span_context.is_valid else None


def creation_link(properties: Mapping[str, str], message_id: str) -> Link | None:
    """A link to the creation context in ``properties`` (see :func:`creation_context`)
    carrying the message's id as ``messaging.message.id``, or ``None``."""
    span_context = creation_context(properties)
    if span_context is None:
        return None
    return Link(span_context, {MESSAGE_ID: message_id})
