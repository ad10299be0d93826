"""The pop-consumption half of :class:`~._otel_hook.OpenTelemetryHook`
(:class:`~stagedconsumer.SimpleConsumer`), after the messaging semantic conventions:

- ``receive <topic>`` (CLIENT) per ``receive`` call that returned messages, from the
  call's start to its return, with a link per message to its creation context;
- ``process <topic>`` (CONSUMER) when the application asks for one with
  ``with hook.process(message):``, child of the receive span that brought the
  message, current while the block runs;
- ``ack|nack|change_invisible_duration <topic>`` (CLIENT,
  ``messaging.operation.type=settle``) per ``ack``, ``ack_batch`` or
  ``change_invisible_duration`` call, child of the span current at the call (a
  process span, when acked inside one), with a link per message to its creation
  context; ``error.type`` and an ERROR status when the broker refused.

Metrics: ``messaging.client.consumed.messages`` (counted at receive, per queue),
``messaging.client.operation.duration`` (receive and settle calls) and
``messaging.process.duration`` (``hook.process`` blocks).

This module imports OpenTelemetry; the rest of the package does not.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.metrics import Histogram
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from .._message import Message, MessageQueue
from ._hooks import PullContext, SettleContext
from ._otel_common import BATCH_COUNT, MESSAGE_ID, Counts, creation_link, error_type_of, ns

__all__ = ("pop_process", "pop_received", "pop_settled")

_EMPTY = otel_context.Context()


class OpenTelemetryHook(Protocol):
    """What these functions use of :class:`~._otel_hook.OpenTelemetryHook` (which
    imports this module)."""

    spans: bool
    metrics: bool
    messaging_system: str
    _tracer: Tracer
    _queues: dict[MessageQueue, Any]
    _consumed_counts: Counts
    _receive_consumed: dict[tuple[str, int], object]
    _operation_duration: Histogram
    _process_duration: Histogram

    def _base(
        self, operation: str, op_type: str, topic: str, group: str, queue_id: int
    ) -> dict[str, AttributeValue]: ...

    def _queue(self, mq: MessageQueue, group: str) -> Any: ...

    def _metric_attrs(
        self, topic: str, group: str, queue_id: int
    ) -> tuple[dict[str, AttributeValue], object]: ...


_MAX_HELD = 65536
"""Received messages whose receive span is remembered per queue (for their process
and settle spans); the oldest are forgotten past it (messages never settled here)."""


def pop_received(hook: OpenTelemetryHook, context: PullContext) -> None:
    """A ``receive`` call that returned ``context.messages`` (any queues)."""
    messages = context.messages
    first = messages[0]
    group = context.consumer_group
    queues = {(m.topic, m.queue_id) for m in messages}
    attributes = hook._base("receive", "receive", first.topic, group, first.queue_id)
    if len(queues) > 1:
        del attributes["messaging.destination.partition.id"]
        if len({topic for topic, _ in queues}) > 1:
            del attributes["messaging.destination.name"]
    if len(messages) == 1:
        attributes[MESSAGE_ID] = first.msg_id
    else:
        attributes[BATCH_COUNT] = len(messages)
    start, end = context.wall(context.start_time), context.wall(context.end_time)
    if hook.metrics:
        counts = hook._consumed_counts.by_key
        for message in messages:
            counts[_consumed_key(hook, message.topic, group, message.queue_id)] += 1
        hook._operation_duration.record(max(0.0, end - start), _op_attrs(attributes))
    if not hook.spans:
        return
    links = [_link(m) for m in messages]
    span = hook._tracer.start_span(
        f"receive {first.topic}",
        context=_EMPTY,
        kind=SpanKind.CLIENT,
        attributes=attributes,
        links=[link for link in links if link is not None],
        start_time=ns(start),
    )
    span.end(end_time=ns(end))
    span_context = span.get_span_context()
    parent_span = NonRecordingSpan(span_context)
    parent = trace.set_span_in_context(parent_span, _EMPTY) if span_context.is_valid else None
    recorded = span.is_recording() or span_context.trace_flags.sampled
    for message, link in zip(messages, links, strict=True):
        held = hook._queue(MessageQueue(message.topic, message.queue_id), group).received
        if len(held) >= _MAX_HELD:
            del held[next(iter(held))]
        held[message.queue_offset] = (parent, link, recorded, parent_span)


def _consumed_key(hook: OpenTelemetryHook, topic: str, group: str, queue_id: int) -> object:
    """The consumed-messages key of a queue's receives (attributes built once)."""
    cache = hook._receive_consumed
    key = cache.get((topic, queue_id))
    if key is None:
        attributes: dict[str, AttributeValue] = {
            "messaging.system": hook.messaging_system,
            "messaging.operation.name": "receive",
            "messaging.destination.name": topic,
            "messaging.consumer.group.name": group,
            "messaging.destination.partition.id": str(queue_id),
        }
        key = cache[topic, queue_id] = hook._consumed_counts.key_of(attributes)
    return key


def _link(message: Message) -> Link | None:
    """A link to the creation context in ``message``'s properties, or ``None``."""
    return creation_link(message.properties, message.msg_id)


def _op_attrs(attributes: dict[str, AttributeValue]) -> dict[str, AttributeValue]:
    """The metric attributes of an operation span's (no per-message ones)."""
    return {k: v for k, v in attributes.items() if k not in (MESSAGE_ID, BATCH_COUNT)}


def _entry(hook: OpenTelemetryHook, message: Message) -> Any:
    queue = hook._queues.get(MessageQueue(message.topic, message.queue_id))
    return None if queue is None else queue.received.get(message.queue_offset)


def pop_settled(hook: OpenTelemetryHook, context: SettleContext) -> None:
    """A settle span (and its duration) per ``ack``, ``ack_batch`` or
    ``change_invisible_duration`` call of a SimpleConsumer."""
    messages = context.messages
    first = messages[0]
    group = context.consumer_group
    operation = context.operation
    attributes = hook._base(operation, "settle", first.topic, group, first.queue_id)
    if len({(m.topic, m.queue_id) for m in messages}) > 1:
        del attributes["messaging.destination.partition.id"]
    exc = context.exception
    error_type = error_type_of(exc) if exc is not None else None
    if hook.metrics:
        metric_attrs = _op_attrs(attributes)
        if error_type is not None:
            metric_attrs["error.type"] = error_type
        duration = context.end_time - context.start_time
        hook._operation_duration.record(max(0.0, duration), metric_attrs)
    if not hook.spans:
        return
    if len(messages) == 1:
        attributes[MESSAGE_ID] = first.msg_id
    else:
        attributes[BATCH_COUNT] = len(messages)
    links: list[Link] = []
    for message in messages:
        entry = _entry(hook, message)
        link = entry[1] if entry is not None else _link(message)
        if isinstance(link, Link):
            links.append(link)
    span = hook._tracer.start_span(
        f"{operation} {first.topic}",
        kind=SpanKind.CLIENT,
        attributes=attributes,
        links=links,
        start_time=ns(context.wall(context.start_time)),
    )
    if error_type is not None:
        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, error_type))
    span.end(end_time=ns(context.wall(context.end_time)))
    if operation != "change_invisible_duration" or context.refused:
        # the deliveries are over here: forget their receive spans
        for message in messages:
            queue = hook._queues.get(MessageQueue(message.topic, message.queue_id))
            if queue is not None:
                queue.received.pop(message.queue_offset, None)


@contextlib.contextmanager
def pop_process(hook: OpenTelemetryHook, message: Message) -> Iterator[Span]:
    """See :meth:`OpenTelemetryHook.process <._otel_hook.OpenTelemetryHook.process>`."""
    group = getattr(message, "consumer_group", "") or ""
    topic = message.topic
    attributes: dict[str, AttributeValue] = {}
    span: Span = trace.INVALID_SPAN
    if hook.spans:
        entry = _entry(hook, message)
        attributes = hook._base("process", "process", topic, group, message.queue_id)
        attributes[MESSAGE_ID] = message.msg_id
        attributes["stagedconsumer.attempt"] = message.reconsume_times + 1
        link = entry[1] if entry is not None else _link(message)
        span = hook._tracer.start_span(
            f"process {topic}",
            context=(entry[0] if entry is not None else None) or _EMPTY,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            links=[link] if isinstance(link, Link) else None,
        )
    token = otel_context.attach(trace.set_span_in_context(span))
    start = time.perf_counter()
    error_type: str | None = None
    try:
        yield span
    except BaseException as exc:
        error_type = error_type_of(exc)
        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, error_type))
        span.record_exception(exc)
        raise
    finally:
        elapsed = time.perf_counter() - start
        otel_context.detach(token)
        span.end()
        if hook.metrics:
            _record_process(hook, topic, group, message.queue_id, elapsed, error_type)


def _record_process(
    hook: OpenTelemetryHook,
    topic: str,
    group: str,
    queue_id: int,
    elapsed: float,
    error_type: str | None,
) -> None:
    metric_attrs: dict[str, Any] = hook._metric_attrs(topic, group, queue_id)[0]
    if error_type is not None:
        metric_attrs = {**metric_attrs, "error.type": error_type}
    hook._process_duration.record(elapsed, metric_attrs)
