"""OpenTelemetry spans and metrics of the three modes, after semconv v1.44."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics.export import HistogramDataPoint, NumberDataPoint
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import SpanKind, StatusCode

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    PushConsumer,
)
from stagedconsumer.otel import DURATION_BUCKETS, OpenTelemetryHook, parse_traceparent

from .conftest import Otel

pytestmark = pytest.mark.anyio

REQUIRED = {
    "messaging.system": "stagedconsumer",
    "messaging.destination.name": "t",
    "messaging.consumer.group.name": "g",
    "messaging.destination.partition.id": "0",
}


def ids(contexts: Sequence[Any]) -> list[tuple[int, int]]:
    return [(c.trace_id, c.span_id) for c in contexts]


class Concurrent(MessageListenerConcurrently):
    def __init__(self, fail: bool = False, tracer: trace.Tracer | None = None) -> None:
        self.fail = fail
        self.tracer = tracer or trace.get_tracer("app")
        self.inner_parents: list[int] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        # A span the handler starts is a child of the process span.
        with self.tracer.start_as_current_span("handler work") as span:
            parent = getattr(span, "parent", None)
            self.inner_parents.append(parent.span_id if parent else 0)
        if self.fail:
            raise ValueError("handler bug")


class Orderly(MessageListenerOrderly):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        context.suspend_current_queue_time_millis = 10
        if msgs[0].body == b"1" and msgs[0].reconsume_times == 0:
            raise KeyError("once")


class Staged(MessageListenerStagedConcurrently):
    def get_stage_definitions(self) -> Sequence[int]:
        return [2, 1]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        await anyio.sleep(0.01)


def produce(otel: Otel, n: int) -> tuple[MemoryBroker, list[Message], list[Any]]:
    """Send ``n`` messages, each inside its own producer span."""
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    tracer = otel.tracer_provider.get_tracer("producer")
    sent, contexts = [], []
    for i in range(n):
        with tracer.start_as_current_span("create t", kind=SpanKind.PRODUCER) as span:
            sent.append(broker.send("t", str(i).encode(), keys=[f"k{i}"]))
            contexts.append(span.get_span_context())
    return broker, sent, contexts


async def consume(otel: Otel, broker: MemoryBroker, listener: Any, **options: Any) -> PushConsumer:
    consumer = PushConsumer("g", broker, listener, options=ConsumerOptions(**options))
    consumer.subscribe("t")
    consumer.register_consume_message_hook(
        OpenTelemetryHook(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    )
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    return consumer


def assert_required(span: ReadableSpan, operation: str, op_type: str) -> None:
    attributes = dict(span.attributes or {})
    for key, value in REQUIRED.items():
        assert attributes[key] == value, key
    assert attributes["messaging.operation.name"] == operation
    assert attributes["messaging.operation.type"] == op_type


async def test_producer_injects_traceparent(otel: Otel) -> None:
    _, sent, contexts = produce(otel, 1)
    context = contexts[0]
    assert sent[0].properties["traceparent"] == (
        f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
    )
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    assert "traceparent" not in broker.send("t", b"no span").properties


async def test_concurrent_span_tree_links_and_metrics(otel: Otel) -> None:
    broker, sent, creation = produce(otel, 3)
    listener = Concurrent(tracer=otel.tracer_provider.get_tracer("app"))
    await consume(otel, broker, listener)
    [receive] = otel.spans("receive")
    processes = otel.spans("process")
    assert len(otel.spans("handler work")) == 3
    assert receive.name == "receive t"
    assert receive.kind is SpanKind.CLIENT
    assert receive.parent is None
    assert_required(receive, "receive", "receive")
    assert receive.attributes["messaging.batch.message_count"] == 3  # type: ignore[index]
    assert ids([link.context for link in receive.links]) == ids(creation)
    assert len(processes) == 3
    for span in processes:
        assert span.name == "process t"
        assert span.kind is SpanKind.CONSUMER
        assert span.parent is not None
        assert span.parent.span_id == receive.context.span_id
        assert_required(span, "process", "process")
        attributes = dict(span.attributes or {})
        i = [m.msg_id for m in sent].index(str(attributes["messaging.message.id"]))
        [link] = span.links
        assert ids([link.context]) == ids([creation[i]])
        assert link.attributes == {"messaging.message.id": sent[i].msg_id}
        assert attributes["stagedconsumer.stage.index"] == -1
        assert "error.type" not in attributes
        assert span.status.status_code is StatusCode.UNSET
    assert sorted(listener.inner_parents) == sorted(s.context.span_id for s in processes)

    metrics = otel.metrics()
    [duration] = metrics["messaging.process.duration"]
    assert isinstance(duration, HistogramDataPoint)
    assert duration.count == 3
    assert tuple(duration.explicit_bounds) == tuple(DURATION_BUCKETS)
    assert dict(duration.attributes or {}) == {**REQUIRED, "messaging.operation.name": "process"}
    # Measured in the process span's context: recorded spans are their exemplars.
    process_ids = {span.context.span_id for span in processes}
    assert duration.exemplars
    assert {exemplar.span_id for exemplar in duration.exemplars} <= process_ids
    [consumed] = metrics["messaging.client.consumed.messages"]
    assert isinstance(consumed, NumberDataPoint)
    assert consumed.value == 3
    [awaited] = metrics["stagedconsumer.consumer.await.duration"]
    assert isinstance(awaited, HistogramDataPoint)
    assert awaited.count == 3
    assert awaited.exemplars
    assert {exemplar.span_id for exemplar in awaited.exemplars} <= process_ids


async def test_batch_process_span_has_per_link_ids(otel: Otel) -> None:
    broker, sent, creation = produce(otel, 3)
    await consume(otel, broker, Concurrent(), consume_message_batch_max_size=3, pull_batch_size=3)
    [process] = otel.spans("process")
    attributes = dict(process.attributes or {})
    assert attributes["messaging.batch.message_count"] == 3
    assert "messaging.message.id" not in attributes
    assert ids([link.context for link in process.links]) == ids(creation)
    assert [dict(link.attributes or {}) for link in process.links] == [
        {"messaging.message.id": m.msg_id} for m in sent
    ]
    # One duration for the call, an await time per message of it.
    metrics = otel.metrics()
    [duration] = metrics["messaging.process.duration"]
    [awaited] = metrics["stagedconsumer.consumer.await.duration"]
    assert isinstance(duration, HistogramDataPoint)
    assert isinstance(awaited, HistogramDataPoint)
    assert (duration.count, awaited.count) == (1, 3)


async def test_concurrent_failure_goes_to_dlq_with_settle_span(otel: Otel) -> None:
    broker, sent, creation = produce(otel, 1)
    consumer = await consume(otel, broker, Concurrent(fail=True), max_reconsume_times=0)
    assert consumer.statistics().dead_lettered == 1
    [process] = otel.spans("process")
    assert process.status.status_code is StatusCode.ERROR
    assert process.attributes["error.type"] == "ValueError"  # type: ignore[index]
    assert any(event.name == "exception" for event in process.events)
    [settle] = otel.spans("dead_letter")
    assert settle.name == "dead_letter t"
    assert settle.kind is SpanKind.CLIENT
    assert settle.parent is not None
    assert settle.parent.span_id == process.context.span_id
    assert_required(settle, "dead_letter", "settle")
    assert settle.attributes["messaging.message.id"] == sent[0].msg_id  # type: ignore[index]
    assert ids([link.context for link in settle.links]) == ids(creation)
    metrics = otel.metrics()
    [dlq] = metrics["stagedconsumer.consumer.dlq.messages"]
    assert isinstance(dlq, NumberDataPoint)
    assert dlq.value == 1
    [duration] = metrics["messaging.process.duration"]
    assert dict(duration.attributes or {})["error.type"] == "ValueError"  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_concurrent_failure_retried_through_the_retry_queue(otel: Otel) -> None:
    class FailOnce(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            context.delay_level_when_next_consume = 1
            if msgs[0].reconsume_times == 0:
                raise ValueError("once")

    broker, sent, creation = produce(otel, 1)
    consumer = PushConsumer("g", broker, FailOnce())
    consumer.subscribe("t")
    consumer.register_consume_message_hook(
        OpenTelemetryHook(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    )
    async with consumer:
        with anyio.fail_after(10):
            while consumer.statistics().consumed_ok < 1:
                await anyio.sleep(0.05)
    first, second = otel.spans("process")
    [retry] = otel.spans("retry")
    assert retry.parent is not None
    assert retry.parent.span_id == first.context.span_id
    assert first.attributes["stagedconsumer.attempt"] == 1  # type: ignore[index]
    assert second.attributes["stagedconsumer.attempt"] == 2  # type: ignore[index]
    # The retry is a new message of the retry queue, reported under its first id,
    # still linked to the original creation context.
    assert second.attributes["messaging.message.id"] == sent[0].msg_id  # type: ignore[index]
    assert ids([link.context for link in second.links]) == ids(creation)
    assert second.status.status_code is StatusCode.UNSET


async def test_orderly_failure_is_suspended_and_retried(otel: Otel) -> None:
    broker, sent, creation = produce(otel, 3)
    await consume(otel, broker, Orderly())
    processes = otel.spans("process")
    message_ids = [s.attributes["messaging.message.id"] for s in processes]  # type: ignore[index]
    assert message_ids == [sent[0].msg_id, sent[1].msg_id, sent[1].msg_id, sent[2].msg_id]
    failed = processes[1]
    assert failed.attributes["error.type"] == "KeyError"  # type: ignore[index]
    [suspend] = otel.spans("suspend")
    assert suspend.parent is not None
    assert suspend.parent.span_id == failed.context.span_id
    assert_required(suspend, "suspend", "settle")
    assert processes[2].attributes["stagedconsumer.attempt"] == 2  # type: ignore[index]
    assert ids([processes[2].links[0].context]) == ids([creation[1]])
    # The retry runs under the receive span that brought the message, as the failed
    # call did: a suspended message is still known to the hook.
    [receive] = otel.spans("receive")
    assert processes[1].parent is not None
    assert processes[2].parent is not None
    assert processes[1].parent.span_id == receive.context.span_id
    assert processes[2].parent.span_id == receive.context.span_id
    [retried] = otel.metrics()["stagedconsumer.consumer.retried.messages"]
    assert retried.value == 1  # type: ignore[attr-defined]


async def test_staged_spans_carry_the_stage_and_barrier_wait_is_measured(otel: Otel) -> None:
    broker, sent, _ = produce(otel, 5)
    await consume(otel, broker, Staged())
    by_id = {
        s.attributes["messaging.message.id"]: s  # type: ignore[index]
        for s in otel.spans("process")
    }
    assert [by_id[m.msg_id].attributes["stagedconsumer.stage.index"] for m in sent] == [  # type: ignore[index]
        0,
        0,
        1,
        -1,
        -1,
    ]
    assert by_id[sent[0].msg_id].attributes["stagedconsumer.stage.strategy_id"] == "default"  # type: ignore[index]
    # Stage 1 starts only after both stage-0 spans ended.
    stage0_end = max(by_id[m.msg_id].end_time or 0 for m in sent[:2])
    assert (by_id[sent[2].msg_id].start_time or 0) >= stage0_end
    [barrier] = otel.metrics()["stagedconsumer.consumer.barrier_wait.duration"]
    assert isinstance(barrier, HistogramDataPoint)
    assert barrier.count == 5
    assert barrier.max >= 0.005  # the tail waited for stage 0 and stage 1 (10 ms each)


async def test_staged_batches_measure_each_message_and_one_duration_per_call(
    otel: Otel,
) -> None:
    broker, _, _ = produce(otel, 5)
    await consume(otel, broker, Staged(), consume_message_batch_max_size=2)
    calls = len(otel.spans("process"))
    assert calls < 5  # some calls held two messages
    metrics = otel.metrics()
    [duration] = metrics["messaging.process.duration"]
    [awaited] = metrics["stagedconsumer.consumer.await.duration"]
    [barrier] = metrics["stagedconsumer.consumer.barrier_wait.duration"]
    assert isinstance(duration, HistogramDataPoint)
    assert isinstance(awaited, HistogramDataPoint)
    assert isinstance(barrier, HistogramDataPoint)
    assert (duration.count, awaited.count, barrier.count) == (calls, 5, 5)
    assert barrier.max >= 0.005  # the later stages waited for the earlier ones


async def test_gauges_report_cache_and_lag_while_running(otel: Otel) -> None:
    gate = anyio.Event()

    class Blocked(MessageListenerOrderly):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeOrderlyContext
        ) -> None:
            await gate.wait()

    broker, _, _ = produce(otel, 4)
    consumer = PushConsumer("g", broker, Blocked())
    consumer.subscribe("t")
    consumer.register_consume_message_hook(
        OpenTelemetryHook(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    )
    async with consumer:
        with anyio.fail_after(10):
            while consumer.statistics().in_flight < 1:
                await anyio.sleep(0.01)
        metrics = otel.metrics()
        gate.set()
    [cached] = metrics["stagedconsumer.consumer.cached.messages"]
    [size] = metrics["stagedconsumer.consumer.cached.bytes"]
    [lag] = metrics["stagedconsumer.consumer.lag"]
    assert cached.value == 4  # type: ignore[attr-defined]
    assert size.value == 4  # type: ignore[attr-defined]
    assert lag.value == 4  # type: ignore[attr-defined]
    assert dict(lag.attributes or {}) == REQUIRED  # type: ignore[attr-defined]


@pytest.mark.parametrize(("spans", "metrics"), [(False, True), (True, False)])
async def test_spans_or_metrics_can_be_turned_off(otel: Otel, spans: bool, metrics: bool) -> None:
    broker, _, _ = produce(otel, 2)
    consumer = PushConsumer("g", broker, Concurrent())
    consumer.subscribe("t")
    hook = OpenTelemetryHook(
        tracer_provider=otel.tracer_provider,
        meter_provider=otel.meter_provider,
        spans=spans,
        metrics=metrics,
    )
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert len(otel.spans("process")) == (2 if spans else 0)
    assert len(otel.spans("receive")) == (1 if spans else 0)
    assert ("messaging.process.duration" in otel.metrics()) is metrics
    assert not hook._queues  # nothing left behind either way


async def test_sync_handler_runs_inside_the_process_span(otel: Otel) -> None:
    tracer = otel.tracer_provider.get_tracer("app")

    class SyncHandler(MessageListenerConcurrently):
        def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            with tracer.start_as_current_span("work in a thread"):
                pass

    broker, _, _ = produce(otel, 2)
    await consume(otel, broker, SyncHandler())
    processes = {s.context.span_id for s in otel.spans("process")}
    inner = otel.spans("work in a thread")
    assert len(inner) == 2
    assert {s.parent.span_id for s in inner if s.parent is not None} == processes


class LinkAwareSampler(Sampler):
    """Samples a span if any of its links points to a sampled context: a sampler
    that needs links at creation."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def should_sample(
        self,
        parent_context: Any,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        self.seen.append((name, len(links or ())))
        decision = Decision.RECORD_AND_SAMPLE if links else Decision.DROP
        return SamplingResult(decision, attributes)

    def get_description(self) -> str:
        return "LinkAwareSampler"


async def test_a_sampler_that_may_use_links_sees_them_at_creation(otel: Otel) -> None:
    broker, _, creation = produce(otel, 2)
    sampler = LinkAwareSampler()
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    hook = OpenTelemetryHook(tracer_provider=provider, meter_provider=otel.meter_provider)
    assert not hook._links_after_creation
    consumer = PushConsumer("g", broker, Concurrent(tracer=provider.get_tracer("app")))
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert ("receive t", 2) in sampler.seen
    assert sampler.seen.count(("process t", 1)) == 2
    processes = [s for s in exporter.get_finished_spans() if s.name == "process t"]
    assert sorted(ids([s.links[0].context for s in processes])) == sorted(ids(creation))
    provider.shutdown()


async def test_unsampled_spans_do_no_link_work(otel: Otel, monkeypatch: pytest.MonkeyPatch) -> None:
    import stagedconsumer._observability._otel_common as otel_common

    broker, _, _ = produce(otel, 3)
    parsed: list[str] = []
    real = parse_traceparent

    def counting(value: str) -> tuple[int, int, int] | None:
        parsed.append(value)
        return real(value)

    monkeypatch.setattr(otel_common, "parse_traceparent", counting)
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    hook = OpenTelemetryHook(tracer_provider=provider, meter_provider=otel.meter_provider)
    assert hook._links_after_creation
    consumer = PushConsumer("g", broker, Concurrent(tracer=provider.get_tracer("app")))
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert exporter.get_finished_spans() == ()
    assert parsed == []
    [duration] = otel.metrics()["messaging.process.duration"]
    assert duration.count == 3  # type: ignore[attr-defined]  # metrics stay complete
    provider.shutdown()


@pytest.mark.parametrize(
    ("sampler", "at_creation"),
    [
        (None, True),  # the SDK's default, ParentBased(ALWAYS_ON)
        (ParentBased(TraceIdRatioBased(1.0)), True),
        (TraceIdRatioBased(0.5), False),
    ],
)
async def test_receive_links_go_in_at_creation_when_every_root_is_recorded(
    otel: Otel, monkeypatch: pytest.MonkeyPatch, sampler: Sampler | None, at_creation: bool
) -> None:
    from opentelemetry.sdk.trace import Span

    broker, _, creation = produce(otel, 3)
    added: list[object] = []
    real_add_link = Span.add_link

    def counting_add_link(self: Span, *args: Any, **kwargs: Any) -> None:
        added.append(args)
        real_add_link(self, *args, **kwargs)

    monkeypatch.setattr(Span, "add_link", counting_add_link)
    exporter = InMemorySpanExporter()
    provider = TracerProvider() if sampler is None else TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    hook = OpenTelemetryHook(tracer_provider=provider, meter_provider=otel.meter_provider)
    assert hook._receive_links_after_creation is not at_creation
    consumer = PushConsumer("g", broker, Concurrent(tracer=provider.get_tracer("app")))
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    receives = [s for s in exporter.get_finished_spans() if s.name == "receive t"]
    if at_creation:
        [receive] = receives
        assert ids([link.context for link in receive.links]) == ids(creation)
        assert added == []
    else:
        for receive in receives:  # recorded or not, by trace id: links only if recorded
            assert ids([link.context for link in receive.links]) == ids(creation)
        assert len(added) == 3 * len(receives)
    provider.shutdown()


async def test_wait_metrics_can_be_turned_off_alone(otel: Otel) -> None:
    broker, _, _ = produce(otel, 3)
    consumer = PushConsumer("g", broker, Staged())
    consumer.subscribe("t")
    hook = OpenTelemetryHook(
        tracer_provider=otel.tracer_provider,
        meter_provider=otel.meter_provider,
        wait_metrics=False,
    )
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    metrics = otel.metrics()
    [duration] = metrics["messaging.process.duration"]
    assert duration.count == 3  # type: ignore[attr-defined]
    [consumed] = metrics["messaging.client.consumed.messages"]
    assert consumed.value == 3  # type: ignore[attr-defined]
    assert "stagedconsumer.consumer.await.duration" not in metrics
    assert "stagedconsumer.consumer.barrier_wait.duration" not in metrics
    assert len(otel.spans("process")) == 3


class CountingParentBased(ParentBased):
    """The SDK's ParentBased sampler, counting the spans it is asked about by name
    (a subclass: the hook cannot tell what it decides, so it asks for every span)."""

    def __init__(self, root: Sampler) -> None:
        super().__init__(root)
        self.asked: list[str] = []

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        self.asked.append(args[2] if len(args) > 2 else kwargs["name"])
        return super().should_sample(*args, **kwargs)


class CurrentSpans(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.current: list[Any] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.current.append(trace.get_current_span())


async def test_process_spans_the_sampler_would_drop_are_not_made(otel: Otel) -> None:
    broker, _, _ = produce(otel, 4)
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    hook = OpenTelemetryHook(tracer_provider=provider, meter_provider=otel.meter_provider)
    assert hook._skip_unsampled
    listener = CurrentSpans()
    consumer = PushConsumer("g", broker, listener)
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert exporter.get_finished_spans() == ()
    # The handler ran under the (unsampled) receive span of its messages: spans it
    # starts stay in that trace, unsampled, as children of a dropped span would.
    assert len(listener.current) == 4
    for span in listener.current:
        span_context = span.get_span_context()
        assert span_context.is_valid
        assert not span.is_recording()
        assert not span_context.trace_flags.sampled
    # Metrics stay complete.
    [duration] = otel.metrics()["messaging.process.duration"]
    assert duration.count == 4  # type: ignore[attr-defined]
    provider.shutdown()


async def test_a_sampler_of_another_kind_is_asked_about_every_process_span(otel: Otel) -> None:
    broker, _, _ = produce(otel, 3)
    sampler = CountingParentBased(TraceIdRatioBased(0.0))
    provider = TracerProvider(sampler=sampler)
    hook = OpenTelemetryHook(tracer_provider=provider, meter_provider=otel.meter_provider)
    assert not hook._skip_unsampled
    consumer = PushConsumer("g", broker, CurrentSpans())
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert sampler.asked.count("process t") == 3
    provider.shutdown()


def histogram_counts(otel: Otel) -> dict[str, int]:
    """How many measurements each histogram holds, and the consumed-messages count."""
    metrics = otel.metrics()
    names = ("messaging.process.duration", "stagedconsumer.consumer.await.duration")
    # Otel.metrics() holds the points of every kind as objects: these names are a
    # histogram's and a counter's
    counts = {
        name: sum(point.count for point in cast("list[HistogramDataPoint]", metrics.get(name, [])))
        for name in names
    }
    consumed = cast("list[NumberDataPoint]", metrics.get("messaging.client.consumed.messages", []))
    counts["consumed"] = sum(int(point.value) for point in consumed)
    return counts


def hooked_consumer(otel: Otel, broker: MemoryBroker) -> tuple[PushConsumer, OpenTelemetryHook]:
    hook = OpenTelemetryHook(
        tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider
    )
    consumer = PushConsumer("g", broker, Concurrent())
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    return consumer, hook


async def test_a_collection_while_the_consumer_runs_sees_every_measurement(otel: Otel) -> None:
    # Fewer handler calls than the hook buffers before recording: only the
    # collection itself can have handed them to the SDK.
    broker, _, _ = produce(otel, 5)
    consumer, hook = hooked_consumer(otel, broker)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
        assert histogram_counts(otel) == {
            "messaging.process.duration": 5,
            "stagedconsumer.consumer.await.duration": 5,
            "consumed": 5,
        }
        assert not hook._pending
        # Collections from another thread, as a periodic reader or a scrape makes them,
        # while handler calls go on: every measurement is recorded once.
        for i in range(300):
            broker.send("t", str(i).encode())
        seen = [await anyio.to_thread.run_sync(histogram_counts, otel) for _ in range(5)]
        await consumer.wait_caught_up(timeout=10)
        assert histogram_counts(otel) == {
            "messaging.process.duration": 305,
            "stagedconsumer.consumer.await.duration": 305,
            "consumed": 305,
        }
    counts = [c["messaging.process.duration"] for c in seen]
    assert counts == sorted(counts)  # cumulative: never a measurement taken back


async def test_buffered_measurements_are_recorded_without_a_collection(otel: Otel) -> None:
    broker, _, _ = produce(otel, 0)
    for i in range(600):
        broker.send("t", str(i).encode())
    consumer, hook = hooked_consumer(otel, broker)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
        # 600 calls, recorded in bulk every 256: what waits is fewer than 256 calls.
        assert 0 < len(hook._pending) < 256
    assert not hook._pending  # handed to the SDK when the consumer stopped
    assert histogram_counts(otel)["messaging.process.duration"] == 600
    assert histogram_counts(otel)["consumed"] == 600


async def test_an_unsampled_pull_keeps_one_entry_for_its_messages(otel: Otel) -> None:
    broker, _, _ = produce(otel, 0)
    for i in range(5):
        broker.send("t", str(i).encode(), queue_id=0)
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0)))
    hook = OpenTelemetryHook(tracer_provider=provider, meter_provider=otel.meter_provider)
    listener = CurrentSpans()
    consumer = PushConsumer("g", broker, listener)
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    seen: list[dict[int, Any]] = []
    pulled = hook.messages_pulled

    def recording(context: Any) -> None:
        pulled(context)
        seen.append(dict(hook._queues[context.message_queue].received))

    hook.messages_pulled = recording  # type: ignore[method-assign]
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
        # Every one forgotten once handled (while the consumer still runs).
        assert hook._queues
        assert not any(queue.received for queue in hook._queues.values())
    assert not hook._queues  # and the rest when it stops
    [entries] = seen  # one pull brought all five
    assert sorted(entries) == [0, 1, 2, 3, 4]
    # The pull's messages share one entry (their receive span's context): one object
    # per pull stays alive until they are handled, not one per message.
    assert len({id(entry) for entry in entries.values()}) == 1
    # Each handler call still ran under that receive span.
    [receive] = {span.get_span_context().span_id for span in listener.current}
    [entry] = {id(e): e for e in entries.values()}.values()
    assert entry[3].get_span_context().span_id == receive
    provider.shutdown()
