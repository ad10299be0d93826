"""OpenTelemetry spans and metrics for a consumer (extra ``stagedconsumer[otel]``).

Follows the messaging semantic conventions v1.44 (status: development):

- ``receive <topic>`` (CLIENT) per pull that cached messages, timed from the pull's
  start to its return, with a link per message to its creation context;
- ``process <topic>`` (CONSUMER) per handler call, the current span while the
  handler runs (spans the handler starts are its children), child of the receive
  span that brought its first message, with a link per message to the creation
  context found in its W3C ``traceparent`` property (per-link
  ``messaging.message.id``; a single-message call also carries it on the span);
- ``retry|suspend|dead_letter <topic>`` (CLIENT, ``messaging.operation.type=settle``),
  children of the process span, for the messages of a failed call handed to the
  retry queue, suspended for a local retry, or moved to the dead-letter queue.

Metrics (names as OpenTelemetry instruments; docs/how-to/opentelemetry.md has the Prometheus
names): ``messaging.process.duration`` and ``messaging.client.consumed.messages``
(semconv; duration buckets ``0.005 .. 10`` s), plus
``stagedconsumer.consumer.await.duration`` (cached to handler start, per message),
``stagedconsumer.consumer.barrier_wait.duration`` (cached while the stage's barrier
was closed, per message), ``stagedconsumer.consumer.cached.messages`` /
``.cached.bytes`` / ``.lag`` (gauges per queue), and
``stagedconsumer.consumer.dlq.messages`` / ``.retried.messages`` (counters).

This module imports OpenTelemetry; the rest of the package does not.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import repeat, starmap
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanKind,
    Status,
    StatusCode,
    TracerProvider,
)
from opentelemetry.util.types import AttributeValue

from .._message import Message, MessageQueue
from .._sources._source import PROPERTY_ORIGIN_MESSAGE_ID
from ._hooks import (
    ConsumeMessageContext,
    ConsumeMessageHook,
    PullContext,
    SettleContext,
    SettleOutcome,
)
from ._otel_common import (
    BATCH_COUNT,
    DURATION_BUCKETS,
    MESSAGE_ID,
    SCHEMA_URL,
    Counts,
    add_kafka_attributes,
    creation_link,
    error_type_of,
    instruments,
    ns,
    seconds_histogram,
)
from ._otel_pop import pop_process, pop_received, pop_settled

if TYPE_CHECKING:
    from ._view import ConsumerView

__all__ = (
    "DURATION_BUCKETS",
    "SCHEMA_URL",
    "OpenTelemetryHook",
    "PrometheusEndpoint",
    "serve_prometheus",
)

STAGE_INDEX = "stagedconsumer.stage.index"
STAGE_STRATEGY = "stagedconsumer.stage.strategy_id"
STAGE_GROUP = "stagedconsumer.stage.group_id"
ATTEMPT = "stagedconsumer.attempt"

_PROPS_KEY = "stagedconsumer.otel"
_EMPTY = otel_context.Context()
_SETTLE_NAMES = {
    SettleOutcome.RETRY: "retry",
    SettleOutcome.SUSPEND: "suspend",
    SettleOutcome.DLQ: "dead_letter",
}


def _creation_link(message: Message) -> Link | None:
    """A link to the creation context in the message's properties (W3C
    ``traceparent``, or what the configured propagators read), with the message's
    id as the link's ``messaging.message.id``, or ``None``."""
    return creation_link(message.properties, _message_id(message))


def _message_id(message: Message) -> str:
    # msg_id is kept across retries; ORIGIN_MESSAGE_ID for retries stored while it was not
    return message.properties.get(PROPERTY_ORIGIN_MESSAGE_ID) or message.msg_id


def _error_type(context: ConsumeMessageContext) -> str:
    exc = context.exception
    if exc is not None:
        return error_type_of(exc)
    result = context.result
    name = getattr(result, "name", None)
    if isinstance(name, str):
        return name  # RECONSUME_LATER, SUSPEND_CURRENT_QUEUE_A_MOMENT
    if result is None:
        return "PARTIAL_ACK"  # a concurrent batch acknowledged only in part
    return "_OTHER"


class _Pending:
    """A creation link not made yet: its receive span was not recorded."""


_PENDING = _Pending()
_Received = tuple[otel_context.Context | None, Link | _Pending | None, bool, Span]
"""A received message: its process span's parent context, its creation link (or
``_PENDING``), whether the parent (its receive span) is recorded, and the parent as
a non-recording span."""


class _Queue:
    """What the hook keeps per queue: its cached messages (by queue offset) as
    received, and the metric attributes of the queue's own topic, built once, with
    their key in the consumed-messages counts."""

    __slots__ = ("attributes", "consumed", "received", "topic")

    def __init__(self, topic: str, attributes: dict[str, AttributeValue], consumed: object) -> None:
        self.topic = topic
        self.attributes = attributes
        self.consumed = consumed
        self.received: dict[int, _Received] = {}


_QUEUE_OFFSET = attrgetter("queue_offset")

_Measurement = tuple[float, dict[str, AttributeValue], otel_context.Context]
"""A histogram measurement not recorded yet: the value, its attributes and the
context to measure in, the arguments of ``Histogram.record`` in order."""

_RECORD_EVERY = 256
"""Handler calls whose histogram measurements are buffered before they go to the
SDK in one go: the SDK's per-measurement work (attribute checks, hashing, the
aggregation's lock) runs in a tight loop instead of between the consumer's own
work, which costs less CPU per measurement."""


def _ignores_links(sampler: object) -> bool:
    """Whether ``sampler`` is one of the SDK's samplers that decide without looking
    at links (always on/off, trace id ratio, parent based on those): spans can then
    get their links after creation, and only when they are recorded."""
    try:
        from opentelemetry.sdk.trace import sampling
    except ImportError:  # pragma: no cover - the API without the SDK
        return False
    kind = type(sampler)
    if kind in (sampling.StaticSampler, sampling.TraceIdRatioBased):
        return True
    if kind is sampling.ParentBased:
        delegates = (
            getattr(sampler, name, None)
            for name in (
                "_root",
                "_remote_parent_sampled",
                "_remote_parent_not_sampled",
                "_local_parent_sampled",
                "_local_parent_not_sampled",
            )
        )
        return all(_ignores_links(delegate) for delegate in delegates)
    return False


def _drops_children_of_unsampled(sampler: object) -> bool:
    """Whether ``sampler`` is the SDK's ``ParentBased`` with its default for a local
    parent that is not sampled (always off): a child of such a parent is then never
    recorded, whatever its name, attributes or links."""
    try:
        from opentelemetry.sdk.trace import sampling
    except ImportError:  # pragma: no cover - the API without the SDK
        return False
    if type(sampler) is not sampling.ParentBased:
        return False
    delegate = getattr(sampler, "_local_parent_not_sampled", None)
    return (
        type(delegate) is sampling.StaticSampler
        and getattr(delegate, "_decision", None) is sampling.Decision.DROP
    )


def _records_every_root(sampler: object) -> bool:
    """Whether ``sampler`` is one of the SDK's samplers that record every root span
    (always on, a trace id ratio of 1, or parent based on one of those at the root,
    as the SDK's default ``ParentBased(ALWAYS_ON)``)."""
    try:
        from opentelemetry.sdk.trace import sampling
    except ImportError:  # pragma: no cover - the API without the SDK
        return False
    kind = type(sampler)
    if kind is sampling.StaticSampler:
        return getattr(sampler, "_decision", None) is sampling.Decision.RECORD_AND_SAMPLE
    if kind is sampling.TraceIdRatioBased:
        return getattr(sampler, "rate", 0.0) >= 1.0
    if kind is sampling.ParentBased:
        return _records_every_root(getattr(sampler, "_root", None))
    return False


class OpenTelemetryHook(ConsumeMessageHook):
    """Spans and metrics of one consumer, after the messaging semantic conventions.

    ``tracer_provider`` / ``meter_provider`` default to the global ones.
    ``messaging_system`` is the ``messaging.system`` attribute (default
    ``"stagedconsumer"``; set e.g. ``"redis"`` for the Redis broker). With
    ``"kafka"`` (for :class:`~stagedconsumer.KafkaBroker`), the spans about one
    record also carry the conventions' Kafka attributes ``messaging.kafka.message.key``
    (the record key) and ``messaging.kafka.offset``.
    ``spans=False`` / ``metrics=False`` turn either half off.
    ``wait_metrics=False`` keeps the metrics but drops the two per-message
    histograms (await time and barrier wait), each of which costs an SDK
    measurement per message (about 7 µs with their attributes on the 1.45 SDK).

    Cost: the hook makes, per handler call, one span and two histogram
    measurements (three in staged mode: duration, await time per message, barrier
    wait per message), plus one receive span per pull; counters are asynchronous
    (kept here, observed at collection). Each message's ``traceparent`` is parsed
    at most once and its link reused by the receive, process and settle spans;
    with the SDK's samplers, which ignore links, spans that are not recorded do
    no link work (links are added once a span records; other samplers see them
    at creation; when every root span is recorded, as with the SDK's default
    sampler, receive spans get theirs at creation). With the SDK's parent-based
    sampler (the default kind), a process span whose receive span was sampled out
    is not made at all: the sampler would drop it. Histograms are measured in the
    process span's context, so recorded spans are their exemplars. Histogram
    measurements are buffered and handed to the SDK in bulk, every 256 handler calls,
    at the start of every metric collection and when the consumer stops: collected
    data is always complete, and the SDK's per-measurement work runs in a tight loop,
    which costs less CPU than between the consumer's own work (an exemplar's time is
    when its measurement was handed over). Attribute sets that repeat are built
    once. What remains is the Python
    SDK's own cost, tens of microseconds per span and several per histogram
    measurement (it validates and hashes the attributes every time): more than
    the consumer spends on a message. ``benchmarks/tracing_overhead.py`` measures
    it as its "SDK floor". For very fast handlers, sample spans (the tracer
    provider's sampler) or turn metrics off.
    Register one hook per consumer::

        consumer.register_consume_message_hook(OpenTelemetryHook())
    """

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        messaging_system: str = "stagedconsumer",
        spans: bool = True,
        metrics: bool = True,
        wait_metrics: bool = True,
    ) -> None:
        self._tracer, meter = instruments(
            "OpenTelemetryHook", tracer_provider, meter_provider, messaging_system
        )
        self.messaging_system = messaging_system
        """The ``messaging.system`` attribute of the spans and metrics."""
        self._kafka = messaging_system == "kafka"
        self.spans = spans
        """Whether spans are made."""
        self.metrics = metrics
        """Whether the semantic conventions' consumer metrics are recorded."""
        self.wait_metrics = wait_metrics
        """Whether the stage-barrier and queue wait histograms are recorded."""
        self._process_duration = seconds_histogram(
            meter, "messaging.process.duration", "Duration of processing operation."
        )
        # Counters are kept here and observed at collection time (asynchronous
        # counters export exactly like counters): one dict update per handler call
        # instead of an SDK measurement.
        self._consumed_counts = Counts()
        self._receive_consumed: dict[tuple[str, int], object] = {}
        self._operation_duration = seconds_histogram(
            meter,
            "messaging.client.operation.duration",
            "Duration of messaging operation initiated by a producer or consumer client.",
        )
        self._dlq_counts = Counts()
        self._retried_counts = Counts()
        # Histogram measurements waiting to be recorded in bulk (see _record_pending),
        # per histogram: process duration (one per call), await time and barrier wait
        # (one per message).
        self._pending: deque[_Measurement] = deque()
        self._pending_await: deque[_Measurement] = deque()
        self._pending_barrier: deque[_Measurement] = deque()
        meter.create_observable_counter(
            "messaging.client.consumed.messages",
            [self._observe_consumed],
            unit="{message}",
            description="Number of messages that were delivered to the application.",
        )
        self._await = seconds_histogram(
            meter,
            "stagedconsumer.consumer.await.duration",
            "Time from caching a message to the start of its handler call.",
        )
        self._barrier = seconds_histogram(
            meter,
            "stagedconsumer.consumer.barrier_wait.duration",
            "Time a cached message waited for its stage's barrier to open.",
        )
        meter.create_observable_counter(
            "stagedconsumer.consumer.dlq.messages",
            [self._dlq_counts.observe],
            unit="{message}",
            description="Messages moved to the dead-letter queue.",
        )
        meter.create_observable_counter(
            "stagedconsumer.consumer.retried.messages",
            [self._retried_counts.observe],
            unit="{message}",
            description="Messages of failed handler calls, retried (retry queue or locally).",
        )
        self._meter = meter
        self._props_key = f"{_PROPS_KEY}.{id(self):x}"
        # Attribute sets that repeat from call to call, built once (see _process_attrs).
        self._metric_attrs_cache: dict[
            tuple[str, int], tuple[dict[str, AttributeValue], object]
        ] = {}
        self._process_static: dict[tuple[object, ...], tuple[str, dict[str, AttributeValue]]] = {}
        self._receive_static: dict[tuple[str, str, int], dict[str, AttributeValue]] = {}
        self._consumer: ConsumerView | None = None
        self._gauges_created = False
        self._max_offsets: dict[MessageQueue, int] = {}
        # Per queue (see _Queue), and in it per cached message (by queue offset):
        # the context that parents its process span (its receive span's) and the
        # link to its creation context, both made once when the message is received.
        self._queues: dict[MessageQueue, _Queue] = {}
        # With a sampler that ignores links, a span that is not recorded costs no
        # link work: it is created without links, and they are added only if it
        # records. Any other sampler sees every link at creation (the API's
        # preference, so that head sampling can consider them).
        # A receive span is a root span: when every root is recorded (the SDK's
        # default sampler), its links go in at creation, which costs the SDK about
        # half as much as adding them one by one afterwards.
        sampler = getattr(self._tracer, "sampler", None)
        self._links_after_creation = _ignores_links(sampler)
        self._receive_links_after_creation = self._links_after_creation and not (
            _records_every_root(sampler)
        )
        # When the sampler drops every child of a local parent that is not sampled
        # (the SDK's ParentBased, as configured by default), a process span whose
        # receive span was not sampled would be dropped: it is not made at all (no
        # sampler call, ids, attributes or end), and the handler runs with the
        # receive span's context current, so that its own spans are dropped too.
        self._skip_unsampled = _drops_children_of_unsampled(sampler)

    @property
    def hook_name(self) -> str:
        return "OpenTelemetryHook"

    # -- attributes ---------------------------------------------------------------------

    def _base(
        self, operation: str, op_type: str, topic: str, group: str, queue_id: int
    ) -> dict[str, AttributeValue]:
        return {
            "messaging.system": self.messaging_system,
            "messaging.operation.name": operation,
            "messaging.operation.type": op_type,
            "messaging.destination.name": topic,
            "messaging.consumer.group.name": group,
            "messaging.destination.partition.id": str(queue_id),
        }

    def _metric_attrs(
        self, topic: str, group: str, queue_id: int
    ) -> tuple[dict[str, AttributeValue], object]:
        """Metric attributes of a topic's queue, built once (do not mutate them), and
        their key in the consumed-messages counts. One hook serves one consumer, so
        ``group`` is the same on every call."""
        key = (topic, queue_id)
        cached = self._metric_attrs_cache.get(key)
        if cached is None:
            attributes: dict[str, AttributeValue] = {
                "messaging.system": self.messaging_system,
                "messaging.operation.name": "process",
                "messaging.destination.name": topic,
                "messaging.consumer.group.name": group,
                "messaging.destination.partition.id": str(queue_id),
            }
            cached = self._metric_attrs_cache[key] = (
                attributes,
                self._consumed_counts.key_of(attributes),
            )
        return cached

    def _queue(self, mq: MessageQueue, group: str) -> _Queue:
        """The state of ``mq``, made on first use."""
        queue = self._queues.get(mq)
        if queue is None:
            queue = self._queues[mq] = _Queue(
                mq.topic, *self._metric_attrs(mq.topic, group, mq.queue_id)
            )
        return queue

    def _process_attrs(
        self, context: ConsumeMessageContext, topic: str
    ) -> tuple[str, dict[str, AttributeValue]]:
        """Name and the attributes a process span of ``context``'s queue and stage
        key always has (built once per queue and stage key; copy before adding)."""
        key = (
            topic,
            context.message_queue.queue_id,
            context.stage_index,
            context.strategy_id,
            context.group_id,
        )
        static = self._process_static.get(key)
        if static is None:
            if len(self._process_static) >= 4096:  # group ids may be per key: stay bounded
                self._process_static.clear()
            attributes = self._base(
                "process", "process", topic, context.consumer_group, context.message_queue.queue_id
            )
            attributes[STAGE_INDEX] = context.stage_index
            if context.strategy_id is not None:
                attributes[STAGE_STRATEGY] = context.strategy_id
            if context.group_id is not None:
                attributes[STAGE_GROUP] = context.group_id
            static = self._process_static[key] = (f"process {topic}", attributes)
        return static

    # -- receive ----------------------------------------------------------------------

    def messages_pulled(self, context: PullContext) -> None:
        if context.max_offset < 0:  # a SimpleConsumer's receive
            pop_received(self, context)
            return
        messages = context.messages
        mq = context.message_queue
        self._max_offsets[mq] = context.max_offset
        if not self.spans:
            return
        topic = messages[0].topic
        key = (topic, context.consumer_group, mq.queue_id)  # a hook may serve several groups
        static = self._receive_static.get(key)
        if static is None:
            static = self._receive_static[key] = self._base(
                "receive", "receive", topic, context.consumer_group, mq.queue_id
            )
        attributes = static.copy()
        if len(messages) == 1:
            attributes[MESSAGE_ID] = _message_id(messages[0])
            if self._kafka:
                add_kafka_attributes(attributes, messages[0])
        else:
            attributes[BATCH_COUNT] = len(messages)
        # Each message's traceparent is parsed once, here (or, when this span is
        # not recorded and links may come after creation, only if a recorded span
        # needs it): its process and settle spans reuse the link (links are
        # immutable once a span holds them).
        start_time = ns(context.wall(context.start_time))
        links: list[Link | None] | None = None
        if self._receive_links_after_creation:
            span = self._tracer.start_span(
                f"receive {topic}",
                context=_EMPTY,
                kind=SpanKind.CLIENT,
                attributes=attributes,
                start_time=start_time,
            )
            if span.is_recording():
                links = [_creation_link(message) for message in messages]
                for link in links:
                    if link is not None:
                        span.add_link(link.context, link.attributes)
        else:
            links = [_creation_link(message) for message in messages]
            span = self._tracer.start_span(
                f"receive {topic}",
                context=_EMPTY,
                kind=SpanKind.CLIENT,
                attributes=attributes,
                links=[link for link in links if link is not None],
                start_time=start_time,
            )
        span.end(end_time=ns(context.wall(context.end_time)))
        span_context = span.get_span_context()
        parent_span = NonRecordingSpan(span_context)
        parent = trace.set_span_in_context(parent_span, _EMPTY) if span_context.is_valid else None
        recorded = span.is_recording() or span_context.trace_flags.sampled
        received = self._queue(mq, context.consumer_group).received
        if links is None:
            # One entry shared by the pull's messages: one object per pull, not per
            # message, stays alive until they are handled.
            received.update(
                zip(map(_QUEUE_OFFSET, messages), repeat((parent, _PENDING, recorded, parent_span)))
            )
        else:
            for message, link in zip(messages, links):  # noqa: B905 - same length
                received[message.queue_offset] = (parent, link, recorded, parent_span)

    def _links(self, mq: MessageQueue, messages: Sequence[Message]) -> list[Link]:
        """The creation links of ``messages``: made when they were received, or now."""
        queue = self._queues.get(mq)
        received = queue.received if queue is not None else None
        links: list[Link] = []
        for message in messages:
            entry = received.get(message.queue_offset) if received else None
            link = entry[1] if entry is not None else _PENDING
            if isinstance(link, _Pending):
                link = _creation_link(message)
            if link is not None:
                links.append(link)
        return links

    # -- process ------------------------------------------------------------------------

    def messages_settled(self, context: SettleContext) -> None:
        """A SimpleConsumer's ``ack``, ``ack_batch`` or ``change_invisible_duration``:
        its settle span and ``messaging.client.operation.duration``."""
        pop_settled(self, context)

    def process(self, message: Message) -> contextlib.AbstractContextManager[Span]:
        """``with hook.process(message):`` a ``process <topic>`` span around the
        application's work on a message a :class:`~stagedconsumer.SimpleConsumer`
        received (pop consumption runs no handler, so the application says where
        processing is)::

            for message in await consumer.receive(16, 30):
                with hook.process(message):
                    await handle(message)
                await consumer.ack(message)

        The span is a child of the message's receive span, links the message's
        creation context and is current in the block (spans started there are its
        children, and so is the settle span of an ack made inside it). An exception
        leaving the block sets ``error.type`` and an ERROR status and goes on.
        Records ``messaging.process.duration``."""
        return pop_process(self, message)

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        if not self.spans or context.mode == "pop":
            return  # pop: receive and settle spans come from messages_pulled/_settled
        queue = self._queues.get(context.message_queue)
        # The first message's entry is taken now (put back if the call is suspended);
        # the others' are dropped after the call.
        entry = queue.received.pop(context.messages[0].queue_offset, None) if queue else None
        if entry is not None and not entry[2] and self._skip_unsampled:
            # The sampler would drop this span (see __init__): not made. The receive
            # span's context is current instead (made once per pull, used as it is
            # when nothing else is current, as in the consumer's own tasks).
            current = (
                entry[0]
                if entry[0] is not None and not otel_context.get_current()
                else trace.set_span_in_context(entry[3])
            )
            context.props[self._props_key] = (
                None,
                otel_context.attach(current),
                current,
                queue,
                entry,
            )
            return
        self._start_process_span(context, queue, entry)

    def _start_process_span(
        self, context: ConsumeMessageContext, queue: _Queue | None, entry: _Received | None
    ) -> None:
        """Starts the process span of ``context``'s call, current while it runs."""
        messages = context.messages
        mq = context.message_queue
        first = messages[0]
        name, static = self._process_attrs(context, first.topic)
        attributes = static.copy()
        if len(messages) == 1:
            attributes[MESSAGE_ID] = _message_id(first)
            if self._kafka:
                add_kafka_attributes(attributes, first)
        else:
            attributes[BATCH_COUNT] = len(messages)
        attributes[ATTEMPT] = context.attempt
        parent = entry[0] if entry is not None else None
        start_time = int((context.start_time + context.wall_offset) * 1e9)
        if not self._links_after_creation or (entry is not None and entry[2]):
            # Links at creation: the sampler may look at them, or the span will most
            # likely be recorded (its parent is).
            links: list[Link] | None
            if entry is not None and len(messages) == 1 and isinstance(entry[1], Link):
                links = [entry[1]]
            else:
                links = self._links(mq, messages)
            span = self._tracer.start_span(
                name,
                context=parent or _EMPTY,
                kind=SpanKind.CONSUMER,
                attributes=attributes,
                links=links,
                start_time=start_time,
            )
        else:
            span = self._tracer.start_span(
                name,
                context=parent or _EMPTY,
                kind=SpanKind.CONSUMER,
                attributes=attributes,
                start_time=start_time,
            )
            if span.is_recording():
                for link in self._links(mq, messages):
                    span.add_link(link.context, link.attributes)
        # Current while the handler runs: spans it starts are children (the one
        # context switch a handler's own spans need).
        current = trace.set_span_in_context(span)
        token = otel_context.attach(current)
        context.props[self._props_key] = (span, token, current, queue, entry)

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        if context.mode == "pop":
            return
        state = context.props.pop(self._props_key, None)
        messages = context.messages
        settled = context.settled
        error_type = None if context.success else _error_type(context)
        # Measurements are made in the process span's context, so that a recorded
        # span becomes their exemplar (the SDK's default, trace-based exemplar filter).
        if state is None:  # spans off
            measured_in = _EMPTY
            queue = self._queues.get(context.message_queue)
        else:
            span, token, measured_in, queue, entry = state
            if span is None:  # a process span not made (sampled out)
                otel_context.detach(token)
            else:
                try:
                    self._end_process_span(context, span, error_type)
                finally:
                    otel_context.detach(token)
            # Forget the messages that will not be handled again here (the first
            # one's entry was taken before the call); a suspended call's are kept.
            if settled and SettleOutcome.SUSPEND in settled:
                if entry is not None and queue is not None:
                    queue.received.setdefault(messages[0].queue_offset, entry)
            elif len(messages) > 1 and queue is not None:
                received = queue.received
                for message in messages:
                    received.pop(message.queue_offset, None)
        if not self.metrics:
            return
        topic = messages[0].topic if messages else context.message_queue.topic
        if queue is not None and queue.topic == topic:
            queue_attrs = queue.attributes
            consumed = queue.consumed
        else:  # spans off, or a retry queue's message (its own topic)
            queue_attrs, consumed = self._metric_attrs(
                topic, context.consumer_group, context.message_queue.queue_id
            )
        # Per handler call, as semconv defines them: one duration per process
        # operation, and the consumed count (an asynchronous counter kept here).
        # The histogram measurements of this call go to the SDK in bulk (see
        # _record_pending): the duration per call, and per message (our own
        # histograms) how long each waited for its call and for its stage's barrier.
        if error_type is None:
            metric_attrs = queue_attrs
            self._consumed_counts.by_key[consumed] += len(messages)
        else:
            metric_attrs = {**queue_attrs, "error.type": error_type}
            self._consumed_counts.add(len(messages), metric_attrs)
        start = context.start_time
        duration = context.end_time - start
        pending = self._pending
        pending.append((duration if duration > 0.0 else 0.0, metric_attrs, measured_in))
        if self.wait_metrics:
            cached_times = context.cached_times
            opened = context.runnable_at if context.mode == "staged" else None
            if len(cached_times) == 1:  # inline: ConsumeMessageContext.await_times of one
                cached = cached_times[0]
                self._pending_await.append(
                    (start - cached if start > cached else 0.0, queue_attrs, measured_in)
                )
                if opened is not None:
                    self._pending_barrier.append(
                        (opened - cached if opened > cached else 0.0, queue_attrs, measured_in)
                    )
            else:  # the context's own per-message waits, paired in C (repeat: endless)
                attrs, measured = repeat(queue_attrs), repeat(measured_in)
                self._pending_await.extend(
                    zip(context.await_times(), attrs, measured, strict=False)
                )
                if opened is not None:
                    waits = context.barrier_waits()
                    self._pending_barrier.extend(zip(waits, attrs, measured, strict=False))
        if len(pending) >= _RECORD_EVERY:
            self._record_pending()
        if settled:
            dead = settled.get(SettleOutcome.DLQ)
            if dead:
                self._dlq_counts.add(len(dead), queue_attrs)
            retried = len(settled.get(SettleOutcome.RETRY, ())) + len(
                settled.get(SettleOutcome.SUSPEND, ())
            )
            if retried:
                self._retried_counts.add(retried, queue_attrs)

    def _end_process_span(
        self, context: ConsumeMessageContext, span: Span, error_type: str | None
    ) -> None:
        """Ends the process span of ``context``'s call, after its settle spans."""
        if error_type is not None:
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR, error_type))
            if context.exception is not None:
                span.record_exception(context.exception)
        settled = context.settled
        if settled:
            messages = context.messages
            topic = messages[0].topic if messages else context.message_queue.topic
            now_ns = time.time_ns()
            parent = trace.set_span_in_context(span, _EMPTY)
            for outcome, settled_messages in settled.items():
                self._settle_span(context, outcome, settled_messages, parent, topic, now_ns)
        span.end(end_time=ns(context.end_time + context.wall_offset))

    def _record_pending(self) -> None:
        """Hand the buffered histogram measurements to the SDK.

        Called every ``_RECORD_EVERY`` handler calls from the worker, before every
        metric collection from the collecting thread (the consumed-messages
        counter's callback: the SDK runs callbacks before it reads the histograms),
        and when the consumer stops. Each buffer is drained by ``popleft`` into
        ``Histogram.record`` in C (``starmap``, consumed by a zero-length deque), so
        the only Python code per measurement is the SDK's; ``popleft`` hands each
        measurement out once, whichever thread drains, and the ``IndexError`` of an
        empty buffer ends the drain (one the SDK raised would end it too, and leave
        the rest for the next).
        """
        for pending, record in (
            (self._pending, self._process_duration.record),
            (self._pending_await, self._await.record),
            (self._pending_barrier, self._barrier.record),
        ):
            with contextlib.suppress(IndexError):  # drained
                deque(starmap(record, iter(pending.popleft, None)), maxlen=0)

    def _observe_consumed(self, options: CallbackOptions) -> Iterable[Observation]:
        self._record_pending()  # a collection starts: the histograms get what is buffered
        return self._consumed_counts.observe(options)

    def _settle_span(
        self,
        context: ConsumeMessageContext,
        outcome: SettleOutcome,
        settled: Sequence[Message],
        parent: otel_context.Context,
        topic: str,
        now_ns: int,
    ) -> None:
        name = _SETTLE_NAMES[outcome]
        attributes = self._base(
            name, "settle", topic, context.consumer_group, context.message_queue.queue_id
        )
        if len(settled) == 1:
            attributes[MESSAGE_ID] = _message_id(settled[0])
            if self._kafka:
                add_kafka_attributes(attributes, settled[0])
        else:
            attributes[BATCH_COUNT] = len(settled)
        attributes[STAGE_INDEX] = context.stage_index
        start_ns = min(ns(context.wall(context.end_time)), now_ns)
        span = self._tracer.start_span(
            f"{name} {topic}",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes=attributes,
            links=self._links(context.message_queue, settled),
            start_time=start_ns,
        )
        span.end(end_time=now_ns)

    # -- gauges -------------------------------------------------------------------------

    def _observe(self, value_of: Any) -> list[Observation]:
        consumer = self._consumer
        if consumer is None:
            return []
        stats = consumer.statistics()
        return [
            Observation(
                value_of(mq, queue),
                {
                    "messaging.system": self.messaging_system,
                    "messaging.destination.name": mq.topic,
                    "messaging.consumer.group.name": stats.group,
                    "messaging.destination.partition.id": str(mq.queue_id),
                },
            )
            for mq, queue in stats.queues.items()
        ]

    def _cached_messages(self, options: CallbackOptions) -> Iterable[Observation]:
        del options
        return self._observe(lambda mq, q: q.cached_count + q.pending_count)

    def _cached_bytes(self, options: CallbackOptions) -> Iterable[Observation]:
        del options
        return self._observe(lambda mq, q: q.cached_bytes)

    def _lag(self, options: CallbackOptions) -> Iterable[Observation]:
        del options
        max_offsets = self._max_offsets
        return self._observe(
            lambda mq, q: max(0, max_offsets.get(mq, q.highest_offset + 1) - q.committed_offset)
        )

    async def run(
        self,
        consumer: ConsumerView,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        if self._consumer is not None:
            raise RuntimeError("an OpenTelemetryHook serves one consumer; create one per consumer")
        self._consumer = consumer
        if not self._gauges_created:
            self._gauges_created = True
            meter = self._meter
            meter.create_observable_gauge(
                "stagedconsumer.consumer.cached.messages",
                [self._cached_messages],
                unit="{message}",
                description="Messages pulled and not finished (cached or in a handler).",
            )
            meter.create_observable_gauge(
                "stagedconsumer.consumer.cached.bytes",
                [self._cached_bytes],
                unit="By",
                description="Body bytes of messages pulled and not finished.",
            )
            meter.create_observable_gauge(
                "stagedconsumer.consumer.lag",
                [self._lag],
                unit="{message}",
                description="Messages in the queue past the committed consume offset.",
            )
        task_status.started()

    async def aclose(self) -> None:
        self._record_pending()
        self._consumer = None
        self._queues.clear()


@attrs.define(eq=False)
class PrometheusEndpoint:
    """A Prometheus scrape endpoint for consumer metrics (see :func:`serve_prometheus`)."""

    meter_provider: Any
    """An SDK ``MeterProvider``: pass it to :class:`OpenTelemetryHook`."""
    port: int
    """The port it serves on (the free one picked for ``serve_prometheus(0)``)."""
    _server: Any
    _thread: Any
    _reader: Any

    def close(self) -> None:
        """Stop serving and shut the meter provider down."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self.meter_provider.shutdown()


def serve_prometheus(
    port: int = 9464, addr: str = "0.0.0.0", *, registry: Any = None
) -> PrometheusEndpoint:
    """Serve metrics for Prometheus on ``http://addr:port/metrics``.

    Needs ``opentelemetry-exporter-prometheus`` and ``prometheus_client`` (both in
    the ``otel`` extra). Returns the endpoint; pass its ``meter_provider`` to
    :class:`OpenTelemetryHook`. ``port=0`` picks a free port (see ``.port``).
    ``addr`` defaults to ``"0.0.0.0"``, every interface (``prometheus_client``'s
    default), so anyone who can reach the machine can scrape it; pass
    ``addr="127.0.0.1"`` to serve this machine only (e.g. behind a local agent), or
    the address of one interface. ``registry`` defaults to ``prometheus_client``'s
    global registry.
    """
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
        from prometheus_client import REGISTRY, start_http_server
    except ImportError as exc:
        raise ImportError(
            f"serve_prometheus needs {exc.name or 'the Prometheus exporter'}, which is not"
            " installed: pip install 'stagedconsumer[otel]'",
            name=exc.name,
        ) from None

    if registry is None:
        registry = REGISTRY
    try:
        server, thread = start_http_server(port, addr, registry=registry)
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            reason = {
                errno.EADDRINUSE: "is already in use (another process or endpoint serves it)",
                errno.EACCES: "needs privileges (ports below 1024)",
                errno.EADDRNOTAVAIL: "is on an address this machine does not have",
            }[exc.errno]
            raise OSError(
                exc.errno,
                f"serve_prometheus: cannot listen on {addr}:{port}: the port {reason};"
                " pass another port, or port=0 for a free one",
            ) from exc
        raise
    # The reader registers itself with the registry: made once the port is ours.
    reader = PrometheusMetricReader(registry=registry)
    provider = SdkMeterProvider(metric_readers=[reader])
    return PrometheusEndpoint(
        meter_provider=provider,
        port=server.server_port,
        server=server,
        thread=thread,
        reader=reader,
    )
