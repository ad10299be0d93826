"""Observability overhead: no-op throughput with tracing off, message trace on,
OpenTelemetry on, and everything on, measured in one run.

Reuses the consumers of ``benchmarks/overhead.py`` (no-op ``async`` handler, the same
backlog from the embedded broker, 20 workers). Every message carries a W3C
``traceparent`` (sent inside a producer span), so the OpenTelemetry cases pay for
parsing it and linking to it. Cases:

- ``off``: no hook registered (the default);
- ``no-op hook``: a hook that does nothing (the cost of the hook machinery);
- ``message trace``: ``ConsumeMessageTraceHook`` writing to the broker's trace topic;
- ``opentelemetry``: ``OpenTelemetryHook`` on an SDK ``TracerProvider`` with a
  ``BatchSpanProcessor`` (discarding exporter) and an SDK ``MeterProvider``;
- ``everything``: both hooks;
- ``everything, spans sampled 1%``: both, with ``ParentBased(TraceIdRatioBased(0.01))``
  as the tracer provider's sampler (metrics stay complete);
- ``everything, spans sampled 1%, no wait histograms``: the same with
  ``OpenTelemetryHook(wait_metrics=False)`` (no per-message await and barrier-wait
  histograms; duration, counts and gauges stay).

Next to them, measured in the same run, two rows without a consumer:

- ``SDK floor: spans + metrics``: a plain loop that makes, per message, exactly the
  OpenTelemetry SDK calls the hook makes (the same spans with the same attributes
  and links, the same histogram measurements) on the same tracer and meter setup,
  with every input built before the clock starts (see :func:`sdk_floor`);
- ``SDK floor, spans sampled 1%``: the same with the 1% sampler.

Its ``CPU vs off`` is ``off / (off + floor)``: the best ratio any hook making those
calls could reach, if everything it did besides them were free. Below the table, the
consume-side target: with everything on and 1% of spans sampled, the CPU the
OpenTelemetry hook adds per message (``everything, spans sampled 1%`` minus
``message trace``) against the sampled SDK floor, at most 1.3 times. It is a ratio
of three measurements that each move by several percent from run to run, so those
three cases run ``--target-repeat`` rounds (default 7; the rest ``--repeat``),
interleaved, and the verdict uses the median of each over the rounds (see
:func:`sampled_target` for why not the best); the line also gives the ratio from
the best run of each and its range computed round by round (each round's three runs
alone).

A second table, the producer side, in the same run: ``--sends`` messages sent one
``await`` after another (16-byte bodies, 8 queues) through

- ``MemoryBroker.send``: the broker's bare, synchronous send (no producer);
- ``Producer``: no hook;
- ``Producer + message trace``: ``SendMessageTraceHook`` writing ``Pub`` records to
  the broker's trace topic;
- ``Producer + OpenTelemetry``: ``OpenTelemetrySendHook``, every span recorded
  (``BatchSpanProcessor``, discarding exporter; SDK meter);
- ``Producer + OpenTelemetry, spans sampled 1%``;
- ``Producer + everything``: both hooks, every span recorded.

Timed from the first send until the producer has flushed (its trace records
written, the span processor's queue exported), by wall clock and process CPU.

Every run of a case or a floor runs in a child forked for it from the benchmark's
process (see :func:`isolated`): each starts from the same heap, whatever ran
before it.

Each run is timed twice: wall clock (``messages/s``, ``vs off``) and CPU time of the
process (``time.process_time()``, all threads, so the span processor's export
thread counts), which is steadier on a shared machine. The best of ``--repeat``
runs is reported for each. The target (issue 6) is ``everything >= 50%`` of ``off``
for every mode. Compare ratios within one run, not across runs.

    python -m benchmarks.tracing_overhead                 # 100,000 messages, 8 queues
    python -m benchmarks.tracing_overhead --messages 200000 --repeat 3
    python -m benchmarks.tracing_overhead --messages 20000 --handler-ms 1
    python -m benchmarks.tracing_overhead --messages 20000 --gc off   # GC's share
    python -m benchmarks.tracing_overhead --part producer --sends 50000
    python -m benchmarks.tracing_overhead --part consumer --target-repeat 9
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from rich.console import Console
from rich.table import Table

from benchmarks._reproduce import print_reproduce
from benchmarks.overhead import (
    TOPIC,
    NoopConcurrently,
    NoopOrderly,
    NoopStaged,
    fill,
    run_consumer,
)
from stagedconsumer import (
    ConsumeMessageContext,
    ConsumeMessageHook,
    ConsumeMessageTraceHook,
    ConsumerOptions,
    MemoryBroker,
    Producer,
    SendMessageHook,
    SendMessageTraceHook,
)
from stagedconsumer._observability._otel_hook import SCHEMA_URL
from stagedconsumer.otel import (
    DURATION_BUCKETS,
    OpenTelemetryHook,
    OpenTelemetrySendHook,
    parse_traceparent,
)

OPTIONS = ConsumerOptions(consume_thread_max=20)
TRACE_CASE = "message trace"
SAMPLED_CASE = "everything, spans sampled 1%"
SAMPLED_FLOOR = "SDK floor, spans sampled 1%"
TARGET = 1.3
"""The consume-side target: the CPU the OpenTelemetry hook adds, everything on and
1% of spans sampled, at most this many times the sampled SDK floor."""
SPAN_QUEUE = 1 << 16
"""The span processor's queue: large enough that no span is dropped when its export
thread falls behind (the SDK's default of 2048 drops spans under a 1 ms handler, which
would make the OpenTelemetry cases look cheaper than they are)."""


class DiscardingExporter(SpanExporter):
    """Counts spans and drops them (the export itself is not what we measure)."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def traced_fill(messages: int, queues: int) -> MemoryBroker:
    """The backlog of ``overhead.py``, sent inside a producer span (so every message
    has a ``traceparent``)."""
    provider = TracerProvider()
    with provider.get_tracer("producer").start_as_current_span("produce"):
        broker = fill(messages, queues)
    provider.shutdown()
    return broker


Case = Callable[[], tuple[list[ConsumeMessageHook], Callable[[], dict[str, Any]]]]


def case_off() -> tuple[list[ConsumeMessageHook], Callable[[], dict[str, Any]]]:
    return [], dict


class NoopHook(ConsumeMessageHook):
    """Measures the hook machinery alone (context, clock reads, calls)."""

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        return None

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        return None


def case_noop_hook() -> tuple[list[ConsumeMessageHook], Callable[[], dict[str, Any]]]:
    return [NoopHook()], dict


def case_trace() -> tuple[list[ConsumeMessageHook], Callable[[], dict[str, Any]]]:
    hook = ConsumeMessageTraceHook()

    def extra() -> dict[str, Any]:
        stats = hook.statistics()
        return {"trace_written": stats.written, "trace_dropped": stats.dropped}

    return [hook], extra


def _otel(
    sampled: float = 1.0, *, wait_metrics: bool = True
) -> tuple[OpenTelemetryHook, Callable[[], dict[str, Any]]]:
    exporter = DiscardingExporter()
    tracer_provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(sampled)))
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=SPAN_QUEUE))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    hook = OpenTelemetryHook(
        tracer_provider=tracer_provider, meter_provider=meter_provider, wait_metrics=wait_metrics
    )

    def extra() -> dict[str, Any]:
        tracer_provider.force_flush()
        tracer_provider.shutdown()
        meter_provider.shutdown()
        return {"spans": exporter.spans}

    return hook, extra


def case_otel() -> tuple[list[ConsumeMessageHook], Callable[[], dict[str, Any]]]:
    hook, extra = _otel()
    return [hook], extra


def case_all() -> tuple[list[ConsumeMessageHook], Callable[[], dict[str, Any]]]:
    otel_hook, otel_extra = _otel()
    trace_hook, trace_extra = case_trace()
    return [*trace_hook, otel_hook], lambda: {**trace_extra(), **otel_extra()}


def case_all_sampled() -> tuple[list[ConsumeMessageHook], Callable[[], dict[str, Any]]]:
    otel_hook, otel_extra = _otel(sampled=0.01)
    trace_hook, trace_extra = case_trace()
    return [*trace_hook, otel_hook], lambda: {**trace_extra(), **otel_extra()}


def case_all_lean() -> tuple[list[ConsumeMessageHook], Callable[[], dict[str, Any]]]:
    otel_hook, otel_extra = _otel(sampled=0.01, wait_metrics=False)
    trace_hook, trace_extra = case_trace()
    return [*trace_hook, otel_hook], lambda: {**trace_extra(), **otel_extra()}


CASES: dict[str, Case] = {
    "off": case_off,
    "no-op hook": case_noop_hook,
    TRACE_CASE: case_trace,
    "opentelemetry": case_otel,
    "everything": case_all,
    SAMPLED_CASE: case_all_sampled,
    "everything, spans sampled 1%, no wait histograms": case_all_lean,
}


def with_cost(listener: Any, seconds: float) -> Any:
    """``listener`` with a handler that sleeps ``seconds`` (0: the no-op handler)."""
    if seconds > 0:

        async def consume_message(msgs: Any, context: Any) -> None:
            await anyio.sleep(seconds)

        listener.consume_message = consume_message
    return listener


# -- the SDK floor ------------------------------------------------------------------


def sdk_floor(broker: MemoryBroker, n: int, *, staged: bool, sampled: float = 1.0) -> float:
    """CPU seconds the OpenTelemetry SDK alone spends on what the hook asks of it
    for ``n`` messages handled one per call: per pull of ``pull_batch_size``
    messages a ``receive`` span with a link per message; per message a ``process``
    span (child of the receive span, one link, made current while the handler
    would run) and the histogram measurements (process duration, await time, and
    in staged mode barrier wait). Same attribute sets, links, tracer and meter
    setup as the ``opentelemetry`` case; every input (attribute dicts, links,
    parent contexts) is built before the clock starts, so this is the cost of the
    SDK calls only: no consumer, no hook, no parsing of ``traceparent``.
    """
    exporter = DiscardingExporter()
    tracer_provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(sampled)))
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=SPAN_QUEUE))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    tracer = tracer_provider.get_tracer("stagedconsumer", schema_url=SCHEMA_URL)
    meter = meter_provider.get_meter("stagedconsumer", schema_url=SCHEMA_URL)
    histograms = [
        meter.create_histogram(name, unit="s", explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        for name in (
            "messaging.process.duration",
            "stagedconsumer.consumer.await.duration",
            "stagedconsumer.consumer.barrier_wait.duration",
        )
    ][: 3 if staged else 2]
    empty = otel_context.Context()
    pull = OPTIONS.pull_batch_size
    plans: list[tuple[dict[str, Any], list[Link], list[tuple[dict[str, Any], Link]]]] = []
    base: dict[str, Any]
    metric_attrs: list[dict[str, Any]] = []
    for queue_id in range(broker.statistics().topics[TOPIC]):
        base = {
            "messaging.system": "stagedconsumer",
            "messaging.destination.name": TOPIC,
            "messaging.consumer.group.name": "bench",
            "messaging.destination.partition.id": str(queue_id),
        }
        metric_attrs.append({**base, "messaging.operation.name": "process"})
        log = list(broker.messages(TOPIC, queue_id))
        for i in range(0, len(log), pull):
            chunk = log[i : i + pull]
            links = []
            for message in chunk:
                parsed = parse_traceparent(message.properties["traceparent"])
                assert parsed is not None
                trace_id, span_id, flags = parsed
                creation = SpanContext(trace_id, span_id, True, TraceFlags(flags))
                links.append(Link(creation, {"messaging.message.id": message.msg_id}))
            receive_attrs: dict[str, Any] = {
                **base,
                "messaging.operation.name": "receive",
                "messaging.operation.type": "receive",
                "messaging.batch.message_count": len(chunk),
            }
            process = [
                (
                    {
                        **base,
                        "messaging.operation.name": "process",
                        "messaging.operation.type": "process",
                        "messaging.message.id": message.msg_id,
                        "stagedconsumer.stage.index": -1,
                        "stagedconsumer.attempt": 1,
                    },
                    link,
                )
                for message, link in zip(chunk, links, strict=True)
            ]
            plans.append((receive_attrs, links, process))
    now = time.time_ns()
    attach, detach, get_current = otel_context.attach, otel_context.detach, otel_context.get_current
    set_span = trace.set_span_in_context
    gc.collect()
    start = time.process_time()
    for plan_index, (receive_attrs, links, process) in enumerate(plans):
        attrs = metric_attrs[plan_index % len(metric_attrs)]
        receive = tracer.start_span(
            "receive bench",
            context=empty,
            kind=SpanKind.CLIENT,
            attributes=receive_attrs,
            links=links,
            start_time=now,
        )
        receive.end(end_time=now)
        receive_span = NonRecordingSpan(receive.get_span_context())
        parent = set_span(receive_span, empty)
        if not receive.get_span_context().trace_flags.sampled:
            # The sampler (parent based) would drop the process spans: like the hook,
            # make none and run each call with the receive span's context current
            # (which the hook attaches as it is when no other context is current).
            for _ in process:
                get_current()
                token = attach(parent)
                detach(token)
                for histogram in histograms:
                    histogram.record(0.0001, attrs, parent)
            continue
        for process_attrs, link in process:
            span = tracer.start_span(
                "process bench",
                context=parent,
                kind=SpanKind.CONSUMER,
                attributes=process_attrs,
                links=[link],
                start_time=now,
            )
            current = set_span(span)
            token = attach(current)
            detach(token)
            span.end(end_time=now)
            for histogram in histograms:
                histogram.record(0.0001, attrs, current)
    tracer_provider.force_flush()
    elapsed = time.process_time() - start
    tracer_provider.shutdown()
    meter_provider.shutdown()
    return elapsed


FLOORS: dict[str, float] = {
    "SDK floor: spans + metrics": 1.0,
    SAMPLED_FLOOR: 0.01,
}


@contextlib.contextmanager
def collector(mode: str) -> Iterator[None]:
    """``--gc off``: the cyclic garbage collector disabled while a run is timed, to
    see its share of the cost (the SDK allocates many container objects per span)."""
    if mode == "on":
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    n, queues = args.messages, args.queues
    per_queue = -(-n // queues)
    rows: list[dict[str, Any]] = []
    modes: list[tuple[str, Callable[[], Any]]] = [
        ("concurrent", NoopConcurrently),
        (
            f"staged [{args.stage_size}]*k",
            lambda: NoopStaged(args.stage_size, -(-per_queue // args.stage_size)),
        ),
        (f"orderly, {queues} queues", NoopOrderly),
    ]

    def consumer_row(mode: str, make_listener: Callable[[], Any], case: str) -> dict[str, Any]:
        broker = traced_fill(n, queues)  # a fresh broker: no trace topic left over
        hooks, extra = CASES[case]()
        gc.collect()
        listener = with_cost(make_listener(), args.handler_ms / 1000)
        with collector(args.gc):
            cpu = time.process_time()
            elapsed = anyio.run(
                run_consumer, broker, listener, OPTIONS, n, hooks, backend=args.backend
            )
            cpu = time.process_time() - cpu
        return {
            "mode": mode,
            "case": case,
            "seconds": elapsed,
            "rate": n / elapsed,
            "cpu": cpu,
            **extra(),
        }

    rounds = args.repeat if args.handler_ms else max(args.repeat, args.target_repeat)
    for round_index in range(rounds):
        # Past --repeat rounds, only the target's cases (see the module's docstring).
        cases = list(CASES) if round_index < args.repeat else [TRACE_CASE, SAMPLED_CASE]
        floors = list(FLOORS) if round_index < args.repeat else [SAMPLED_FLOOR]
        for mode, make_listener in modes:
            # Interleave the cases so that drifting machine load hits them alike.
            for case in cases:
                row = isolated(consumer_row, mode, make_listener, case)
                rows.append({**row, "round": round_index})
            if not args.handler_ms:  # the floor is about the no-op handler's budget
                for case in floors:
                    row = isolated(floor_row, mode, case, args)
                    rows.append({**row, "round": round_index})
    return rows


def isolated(run: Callable[..., dict[str, Any]], *run_args: Any) -> dict[str, Any]:
    """``run(*run_args)`` in a child forked from this process for the purpose, so that
    every run starts from the same heap: what one run made and freed (a case that
    records every span makes and frees 51,000 spans and more) does not slow the
    next. In one process, six runs of ``everything, spans sampled 1%`` had a median
    of 43 µs per message before a run that recorded every span and 51 µs after it.
    The child's CPU time is its own (``time.process_time`` counts the process)."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def child() -> None:
        try:
            sender.send((True, run(*run_args)))
        except BaseException as exc:  # the parent raises it
            sender.send((False, f"{type(exc).__name__}: {exc}"))

    process = context.Process(target=child)
    process.start()
    sender.close()
    try:
        ok, result = receiver.recv()
    except EOFError:
        ok, result = False, "the child exited without a result"
    process.join()
    if not ok:
        raise RuntimeError(f"a benchmark run failed: {result}")
    row: dict[str, Any] = result
    return row


def floor_row(mode: str, case: str, args: argparse.Namespace) -> dict[str, Any]:
    broker = traced_fill(args.messages, args.queues)
    with collector(args.gc):
        cpu = sdk_floor(
            broker, args.messages, staged=mode.startswith("staged"), sampled=FLOORS[case]
        )
    return {"mode": mode, "case": case, "cpu": cpu, "floor": True}


# -- the producer side ----------------------------------------------------------------

BODY = b"x" * 16
PRODUCER_QUEUES = 8


def _send_otel(sampled: float) -> tuple[SendMessageHook, Callable[[], None]]:
    exporter = DiscardingExporter()
    tracer_provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(sampled)))
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=SPAN_QUEUE))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    hook = OpenTelemetrySendHook(tracer_provider=tracer_provider, meter_provider=meter_provider)

    def flush() -> None:
        tracer_provider.force_flush()

    def close() -> None:
        tracer_provider.shutdown()
        meter_provider.shutdown()

    _closers.append(close)
    return hook, flush


_closers: list[Callable[[], None]] = []


def _producer_case(
    otel: float | None, trace_hook: bool
) -> Callable[[], tuple[list[SendMessageHook], Callable[[], None]]]:
    def make() -> tuple[list[SendMessageHook], Callable[[], None]]:
        hooks: list[SendMessageHook] = []
        flush: Callable[[], None] = lambda: None  # noqa: E731
        if trace_hook:
            hooks.append(SendMessageTraceHook())
        if otel is not None:
            hook, flush = _send_otel(otel)
            hooks.append(hook)
        return hooks, flush

    return make


PRODUCER_CASES: dict[str, Callable[[], tuple[list[SendMessageHook], Callable[[], None]]] | None] = {
    "MemoryBroker.send (bare)": None,
    "Producer": _producer_case(None, False),
    "Producer + message trace": _producer_case(None, True),
    "Producer + OpenTelemetry": _producer_case(1.0, False),
    "Producer + OpenTelemetry, spans sampled 1%": _producer_case(0.01, False),
    "Producer + everything": _producer_case(1.0, True),
}


async def _bare_sends(broker: MemoryBroker, n: int) -> tuple[float, float]:
    send = broker.send
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        send(TOPIC, BODY)
    return time.perf_counter() - wall, time.process_time() - cpu


async def _producer_sends(
    broker: MemoryBroker,
    n: int,
    hooks: list[SendMessageHook],
    flush: Callable[[], None],
) -> tuple[float, float]:
    producer = Producer(broker, group="bench")
    for hook in hooks:
        producer.register_send_message_hook(hook)
    async with producer:
        send = producer.send
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            await send(TOPIC, BODY)
    flush()  # after the producer flushed its trace records: the spans' export
    elapsed = time.perf_counter() - wall, time.process_time() - cpu
    if producer.statistics().sent != n:
        raise RuntimeError(f"sent {producer.statistics().sent} messages, expected {n}")
    return elapsed


def measure_producer(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    n = args.sends
    for _ in range(args.repeat):
        for case, make in PRODUCER_CASES.items():  # interleaved, as the consumer cases
            broker = MemoryBroker()
            broker.create_topic(TOPIC, PRODUCER_QUEUES)
            gc.collect()
            with collector(args.gc):
                if make is None:
                    wall, cpu = anyio.run(_bare_sends, broker, n, backend=args.backend)
                else:
                    hooks, flush = make()
                    wall, cpu = anyio.run(
                        _producer_sends, broker, n, hooks, flush, backend=args.backend
                    )
            while _closers:
                _closers.pop()()
            rows.append({"mode": "producer", "case": case, "rate": n / wall, "cpu": cpu})
    return rows


def producer_table(rows: dict[tuple[str, str], dict[str, Any]], n: int, backend: str) -> Table:
    table = Table(title=f"Producer overhead, {n:,} sends one after another, {backend}")
    for column in (
        "case",
        "sends/s",
        "vs bare",
        "CPU µs/send",
        "CPU µs/send added to Producer",
    ):
        table.add_column(column, justify="left" if column == "case" else "right")
    bare = rows[("producer", "MemoryBroker.send (bare)")]
    plain = rows[("producer", "Producer")]
    for case in PRODUCER_CASES:
        row = rows[("producer", case)]
        added = (row["cpu"] - plain["cpu"]) / n * 1e6
        table.add_row(
            case,
            f"{row['rate']:,.0f}",
            f"{row['rate'] / bare['rate']:.0%}",
            f"{row['cpu'] / n * 1e6:.1f}",
            f"{added:+.1f}" if case.startswith("Producer +") else "",
        )
    return table


def best(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (mode, case): the highest rate, and separately the lowest CPU time."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["mode"], row["case"])
        kept = out.get(key)
        if kept is None:
            out[key] = dict(row)
            continue
        if "rate" in row and row["rate"] > kept["rate"]:
            out[key] = {**row, "cpu": min(row["cpu"], kept["cpu"])}
        else:
            kept["cpu"] = min(row["cpu"], kept["cpu"])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument("--stage-size", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the best is reported")
    parser.add_argument(
        "--target-repeat",
        type=int,
        default=7,
        help="runs of the target's three cases (message trace, everything 1%%, sampled"
        " floor), at least --repeat (default 7)",
    )
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument(
        "--handler-ms",
        type=float,
        default=0.0,
        help="handler cost (async sleep) in ms; 0, the default, is the no-op handler",
    )
    parser.add_argument(
        "--gc",
        choices=["on", "off"],
        default="on",
        help="off: disable the cyclic garbage collector while runs are timed",
    )
    parser.add_argument("--sends", type=int, default=20_000, help="messages sent per producer case")
    parser.add_argument(
        "--part",
        choices=["all", "consumer", "producer"],
        default="all",
        help="which tables to measure (default both)",
    )
    parser.add_argument("--json", type=Path, help="also write results as JSON here")
    args = parser.parse_args(argv)

    console = Console(width=max(Console().width, 160))
    all_rows: dict[tuple[str, str], dict[str, Any]] = {}
    if args.part in ("all", "consumer"):
        all_rows.update(consumer_tables(args, console))
    if args.part in ("all", "producer"):
        producer_rows = best(measure_producer(args))
        all_rows.update(producer_rows)
        console.print(producer_table(producer_rows, args.sends, args.backend))
    console.print(
        f"python {platform.python_version()}, best of {args.repeat};"
        f" load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print_reproduce(console, "tracing_overhead", argv)
    if args.json:
        args.json.write_text(
            json.dumps([{**row} for row in all_rows.values()], indent=2, default=str)
        )
    return 0


def consumer_tables(
    args: argparse.Namespace, console: Console
) -> dict[tuple[str, str], dict[str, Any]]:
    """Measure the consumer cases, print their table and the targets' verdicts."""
    raw = measure(args)
    rows = best(raw)
    n = args.messages
    handler = f"{args.handler_ms:g} ms handler" if args.handler_ms else "no-op handler"
    table = Table(
        title=f"Observability overhead, {handler}, {n:,} messages,"
        f" {args.queues} queues, {args.backend}"
        + (", garbage collector off" if args.gc == "off" else "")
    )
    for column in (
        "mode",
        "case",
        "seconds",
        "messages/s",
        "vs off",
        "µs/msg added",
        "CPU µs/msg",
        "CPU vs off",
        "CPU µs/msg added",
        "spans",
        "trace dropped",
    ):
        table.add_column(column, justify="left" if column in ("mode", "case") else "right")
    worst = worst_cpu = 1.0
    for (mode, case), row in rows.items():
        off = rows[(mode, "off")]
        cpu_ratio = off["cpu"] / (row["cpu"] if "floor" not in row else off["cpu"] + row["cpu"])
        cpu_added = (row["cpu"] - (0 if "floor" in row else off["cpu"])) / n * 1e6
        if "floor" in row:
            # The floor's "vs off": the best any hook could do, off / (off + SDK alone).
            table.add_row(
                mode, case, "", "", "", "", "", f"≤ {cpu_ratio:.0%}", f"{cpu_added:.1f}", "", ""
            )
            continue
        ratio = row["rate"] / off["rate"]
        if case == "everything":
            worst = min(worst, ratio)
            worst_cpu = min(worst_cpu, cpu_ratio)
        table.add_row(
            mode,
            case,
            f"{row['seconds']:.3f}",
            f"{row['rate']:,.0f}",
            f"{ratio:.0%}",
            f"{(1 / row['rate'] - 1 / off['rate']) * 1e6:.1f}",
            f"{row['cpu'] / n * 1e6:.1f}",
            f"{cpu_ratio:.0%}",
            f"{cpu_added:.1f}",
            f"{row['spans']:,}" if "spans" in row else "",
            f"{row['trace_dropped']:,}" if "trace_dropped" in row else "",
        )
    console.print(table)
    verdict = "met" if worst >= 0.5 else "NOT met"
    console.print(
        f"target everything >= 50% of off: {verdict}"
        f" (worst mode {worst:.0%} by wall clock, {worst_cpu:.0%} by CPU time)"
    )
    if not args.handler_ms:
        console.print(sampled_target(rows, raw, n), soft_wrap=True)
    return rows


def sampled_target(
    rows: dict[tuple[str, str], dict[str, Any]], raw: list[dict[str, Any]], n: int
) -> str:
    """The consume-side target: with everything on and 1% sampled, the CPU the
    OpenTelemetry hook adds (everything minus message trace) at most 1.3 times the
    sampled SDK floor, per mode.

    The verdict takes each case's median CPU time over the rounds (``raw``), not
    its best run (``rows``): the three cases run for different lengths (message
    trace about a third of everything's time, the floor about half), and on a
    shared machine whose load comes in bursts a short run is more likely than a
    long one to miss every burst, so the best runs of the three need not have met
    the same conditions. A burst slows every case alike while it lasts, and the
    medians take a like share of it into each case, which cancels out of the
    ratio. The line also gives the ratio from the best runs, and its range computed
    in each round from that round's three runs alone."""
    cpu_of: dict[tuple[str, str], list[float]] = {}
    by_round: dict[tuple[str, int], dict[str, float]] = {}
    for row in raw:
        cpu_of.setdefault((row["mode"], row["case"]), []).append(row["cpu"])
        by_round.setdefault((row["mode"], row["round"]), {})[row["case"]] = row["cpu"]
    parts, met = [], True
    for mode in dict.fromkeys(mode for mode, _ in rows):
        try:
            everything, traced, floor = (
                statistics.median(cpu_of[(mode, case)])
                for case in (SAMPLED_CASE, TRACE_CASE, SAMPLED_FLOOR)
            )
            best_ratio = (
                rows[(mode, SAMPLED_CASE)]["cpu"] - rows[(mode, TRACE_CASE)]["cpu"]
            ) / rows[(mode, SAMPLED_FLOOR)]["cpu"]
        except KeyError:
            continue
        added = (everything - traced) / n * 1e6
        ratio = added / (floor / n * 1e6)
        met = met and ratio <= TARGET
        per_round = [
            (cpu[SAMPLED_CASE] - cpu[TRACE_CASE]) / cpu[SAMPLED_FLOOR]
            for (round_mode, _), cpu in by_round.items()
            if round_mode == mode and {SAMPLED_CASE, TRACE_CASE, SAMPLED_FLOOR} <= cpu.keys()
        ]
        spread = (
            f", rounds {min(per_round):.2f}-{max(per_round):.2f}x" if len(per_round) > 1 else ""
        )
        parts.append(
            f"{mode}: +{added:.1f} µs vs floor {floor / n * 1e6:.1f} µs = {ratio:.2f}x"
            f" (best runs {best_ratio:.2f}x{spread})"
        )
    verdict = "met" if met else "NOT met"
    rounds = len({row["round"] for row in raw if row["case"] == SAMPLED_FLOOR})
    return (
        f"target OpenTelemetry hook, everything on, 1% sampled <= {TARGET} x SDK floor:"
        f" {verdict}, medians of {rounds} rounds ({'; '.join(parts)})"
    )


if __name__ == "__main__":
    sys.exit(main())
