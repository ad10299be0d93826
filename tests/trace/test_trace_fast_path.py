"""The hook's own encoders and the embedded broker's trace write path, held to the
reference: ``encode_trace_context`` of the contexts a call describes, and what
``MemoryBroker.send`` stores."""

from __future__ import annotations

import random

import anyio
import pytest

from stagedconsumer import MemoryBroker, Message, MessageQueue
from stagedconsumer._observability._hooks import (
    ConsumeMessageContext,
    ConsumeReturnType,
    SettleOutcome,
)
from stagedconsumer._observability._trace_codec import (
    KEY_SEPARATOR,
    PROPERTY_MSG_REGION,
    PROPERTY_TRACE_SWITCH,
    RMQ_SYS_TRACE_TOPIC,
    TraceBean,
    TraceContext,
    TraceMessage,
    TraceType,
    decode_trace_data,
    encode_trace_context,
    trace_keys,
)
from stagedconsumer._observability._trace_hook import ConsumeMessageTraceHook
from stagedconsumer._observability._trace_sinks import SourceTraceSink, TraceSink
from stagedconsumer._sources._source import PROPERTY_ORIGIN_MESSAGE_ID

WALL = 1.7e9


class SyncSink(TraceSink):
    def __init__(self) -> None:
        self.messages: list[TraceMessage] = []

    async def write(self, message: TraceMessage) -> None:
        self.messages.append(message)

    def write_nowait(self, message: TraceMessage) -> bool:
        self.messages.append(message)
        return True


def _message(
    topic: str,
    queue_id: int,
    offset: int,
    *,
    msg_id: str,
    keys: tuple[str, ...] = (),
    properties: dict[str, str] | None = None,
    reconsume_times: int = 0,
) -> Message:
    return Message(
        topic=topic,
        queue_id=queue_id,
        queue_offset=offset,
        body=b"x",
        keys=keys,
        properties=properties,
        msg_id=msg_id,
        reconsume_times=reconsume_times,
    )


def _calls() -> list[ConsumeMessageContext]:
    """Calls mixing traced and untraced messages, with and without keys, on several
    topics and queues, with separators inside ids, keys, topics and groups."""
    off = {PROPERTY_TRACE_SWITCH: "false"}
    batches: list[tuple[str, list[Message]]] = [
        ("g", [_message("t1", 0, 0, msg_id="A")]),
        ("g", [_message("t1", 1, 5, msg_id="B", keys=("k1", "two words"))]),
        ("g", [_message("t1", 1, 6, msg_id="C", properties=off)]),  # not traced at all
        (
            "g\x02x",
            [
                _message("t2", 2, 7, msg_id="D\x01d", keys=("k\x01x",), properties=off),
                _message("t2", 2, 8, msg_id="E\x02e", keys=("k\x02y", "z")),
                _message("t\x01z", 0, 9, msg_id="F", properties={"traceparent": "tp"}),
            ],
        ),
        (
            "g",
            [
                _message(
                    "t3",
                    0,
                    1,
                    msg_id="G",
                    keys=("kg",),
                    properties={PROPERTY_ORIGIN_MESSAGE_ID: "G0", PROPERTY_MSG_REGION: "r1"},
                    reconsume_times=2,
                )
            ],
        ),
        ("g", [_message("t3", 1, 2, msg_id="H", properties={PROPERTY_TRACE_SWITCH: "true"})]),
        (
            "g",
            [
                _message("t1", 0, 3, msg_id="I", properties=off),
                _message("t1", 0, 4, msg_id="J", properties=off),
            ],
        ),
        (
            "g",
            [
                _message("t1", 0, 10, msg_id="K\x01", keys=("kk",)),
                _message("t1", 0, 11, msg_id="L"),
            ],
        ),
    ]
    calls = []
    for i, (group, messages) in enumerate(batches):
        start = 100.0 + i * 0.25
        cached = [start - 0.1 * (j + 1) for j in range(len(messages))]
        context = ConsumeMessageContext._of_call(
            group,
            MessageQueue(messages[0].topic, messages[0].queue_id),
            messages,
            "staged" if i % 2 else "concurrent",
            i % 3 - 1,
            "s\x01" if i % 4 == 1 else None,
            "gid" if i % 3 == 2 else None,
            messages[0].reconsume_times + 1,
            cached,
            start - 0.05 * (i % 3),
            start,
            WALL,
        )
        context.end_time = start + (0.0123 if i % 5 else -0.001)
        context.success = i % 3 != 1
        context.status = [ConsumeReturnType.SUCCESS, ConsumeReturnType.FAILED, None][i % 3]
        if i == 3:
            context.settled = {
                SettleOutcome.RETRY: list(messages),
                SettleOutcome.DLQ: messages[:1],
            }
        elif i == 4:
            context.settled = {SettleOutcome.SUSPEND: list(messages)}
        calls.append(context)
    return calls


def _reference(
    hook: ConsumeMessageTraceHook, context: ConsumeMessageContext, request_id: str
) -> tuple[TraceContext, TraceContext] | None:
    """The SubBefore and SubAfter contexts of one call, built field by field."""
    traced = [
        (m, cached)
        for m, cached in zip(context.messages, context.cached_times, strict=True)
        if m.properties.get(PROPERTY_TRACE_SWITCH) != "false"
    ]
    if not traced:
        return None
    region = traced[0][0].properties.get(PROPERTY_MSG_REGION) or hook.region_id
    opened, wall = context.runnable_at, context.wall_offset
    ids = [m.properties.get(PROPERTY_ORIGIN_MESSAGE_ID) or m.msg_id for m, _ in traced]
    before = TraceContext(
        trace_type=TraceType.SubBefore,
        timestamp=round((context.start_time + wall) * 1000),
        region_id=region,
        group_name=context.consumer_group,
        request_id=request_id,
        stage_index=context.stage_index,
        attempt=context.attempt,
        strategy_id=context.strategy_id or "",
        stage_group_id=context.group_id or "",
        beans=[
            TraceBean(
                msg_id=msg_id,
                retry_times=m.reconsume_times,
                keys=KEY_SEPARATOR.join(m.keys),
                barrier_wait_ms=round((opened - cached) * 1000) if opened > cached else 0,
                cached_timestamp=round((cached + wall) * 1000),
                topic=context.message_queue.topic,
                queue_id=m.queue_id,
                queue_offset=m.queue_offset,
            )
            for msg_id, (m, cached) in zip(ids, traced, strict=True)
        ],
    )
    settlement = next(
        (
            o.value
            for o in (SettleOutcome.DLQ, SettleOutcome.RETRY, SettleOutcome.SUSPEND)
            if o in context.settled
        ),
        "",
    )
    took = max(0.0, context.end_time - context.start_time)
    after = TraceContext(
        trace_type=TraceType.SubAfter,
        request_id=request_id,
        cost_time=int(took * 1000 / max(1, len(context.messages))),
        success=context.success,
        context_code=0 if context.status is None else context.status.value,
        timestamp=round((context.end_time + wall) * 1000),
        group_name=context.consumer_group,
        stage_index=context.stage_index,
        settlement=settlement,
        attempt=context.attempt,
        beans=[
            TraceBean(msg_id=msg_id, keys=KEY_SEPARATOR.join(m.keys))
            for msg_id, (m, _) in zip(ids, traced, strict=True)
        ],
    )
    return before, after


@pytest.mark.parametrize("batch_num", [1, 3, 10, 20])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hook_records_equal_the_reference_encoding(batch_num: int, seed: int) -> None:
    sink = SyncSink()
    hook = ConsumeMessageTraceHook(sink, batch_num=batch_num, region_id="R\x01")
    calls = _calls()
    afters = list(calls)
    random.Random(seed).shuffle(afters)
    for context in calls:
        hook.consume_message_before(context)
    for context in afters[:3]:  # some calls end before others are queued
        hook.consume_message_after(context)
    for context in afters[3:]:
        hook.consume_message_after(context)
    anyio.run(hook.dispatcher.flush)

    body = "".join(m.body for m in sink.messages)
    decoded = decode_trace_data(body)
    # One request id per traced call (each SubBefore record of a call repeats it).
    request_ids = iter(
        dict.fromkeys(c.request_id for c in decoded if c.trace_type is TraceType.SubBefore)
    )
    references: dict[int, tuple[TraceContext, TraceContext]] = {}
    for context in calls:
        if _reference(hook, context, "") is not None:
            reference = _reference(hook, context, next(request_ids))
            assert reference is not None
            references[id(context)] = reference
    assert len({r[0].request_id for r in references.values()}) == len(references)
    expected = [
        *(encode_trace_context(references[id(c)][0]) for c in calls if id(c) in references),
        *(encode_trace_context(references[id(c)][1]) for c in afters if id(c) in references),
    ]
    assert body == "".join(expected)
    for message in sink.messages:
        assert message.topic == RMQ_SYS_TRACE_TOPIC
        assert message.keys == tuple(trace_keys(decode_trace_data(message.body)))
    count = 2 * len(references)
    stats = hook.statistics()
    assert (stats.appended, stats.written, stats.dropped, stats.lost) == (count, count, 0, 0)
    assert stats.messages == len(sink.messages) == -(-count // batch_num)


def test_trace_messages_are_stored_as_send_stores_them_without_a_traceparent() -> None:
    trace = pytest.importorskip("opentelemetry.trace")

    async def main() -> None:
        broker = MemoryBroker()
        broker.create_topic("t", 1)
        broker.send("t", b"m", keys="k")

        class Consumer:
            source = broker

        sink = SourceTraceSink()
        await sink.prepare(Consumer())  # type: ignore[arg-type]
        body = "SubAfter\x01r\x01m\x02"
        span = trace.NonRecordingSpan(
            trace.SpanContext(1, 2, is_remote=False, trace_flags=trace.TraceFlags(1))
        )
        with trace.use_span(span):  # e.g. a consumer span current where a batch fills up
            assert sink.write_nowait(TraceMessage(topic="tt", keys=("a", "b"), body=body))
            await sink.write(TraceMessage(topic="tt", keys=("b",), body=body))
            sent = broker.send("tt", body.encode(), keys=("a", "b"))
        assert broker.statistics().topics["tt"] == 1  # created with one queue
        first, second, third = broker.messages("tt")
        assert "traceparent" in sent.properties  # send() adds the current span
        for stored, offset, keys in ((first, 0, ("a", "b")), (second, 1, ("b",))):
            assert (stored.topic, stored.queue_id, stored.queue_offset) == ("tt", 0, offset)
            assert (stored.body, stored.keys, stored.tags) == (body.encode(), keys, None)
            assert dict(stored.properties) == {}
            assert stored.reconsume_times == 0
            assert stored.msg_id != ""
            assert stored.born_timestamp > 0
        assert first.msg_id < second.msg_id < third.msg_id  # one id sequence with send()

    anyio.run(main)


def test_trace_topic_of_several_queues_is_chosen_by_the_first_key_as_send_does() -> None:
    broker = MemoryBroker()
    broker.create_topic("tt", 4)
    keys = [("alpha",), ("beta", "x"), ("gamma",), ("delta",)]
    for k in keys:
        stored = broker.send_trace("tt", b"x", k)
        sent = broker.send("tt", b"x", keys=k)
        assert stored.queue_id == sent.queue_id
        assert stored.queue_offset + 1 == sent.queue_offset
