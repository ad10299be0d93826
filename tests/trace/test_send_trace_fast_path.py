"""The send trace hook's own encoder, held to the reference: ``encode_trace_context``
of the ``Pub`` contexts a send call describes, byte for byte."""

from __future__ import annotations

import anyio
import pytest

from stagedconsumer import MessageQueue, OutgoingMessage, SendResult, SendStatus
from stagedconsumer._observability._send_hooks import SendMessageContext
from stagedconsumer._observability._send_trace_hook import SendMessageTraceHook
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
from stagedconsumer._observability._trace_sinks import TraceSink

WALL = 1.7e9


class SyncSink(TraceSink):
    def __init__(self) -> None:
        self.messages: list[TraceMessage] = []

    async def write(self, message: TraceMessage) -> None:
        self.messages.append(message)

    def write_nowait(self, message: TraceMessage) -> bool:
        self.messages.append(message)
        return True


def _call(
    i: int,
    group: str,
    topic: str,
    messages: list[OutgoingMessage],
    ids: list[str],
    *,
    queue_id: int = 0,
    status: SendStatus = SendStatus.SEND_OK,
    failed: bool = False,
) -> SendMessageContext:
    start = 100.0 + i * 0.25
    context = SendMessageContext(
        producer_group=group,
        topic=topic,
        messages=messages,
        start_time=start,
        wall_offset=WALL,
        message_queue=MessageQueue(topic, queue_id),
        attempts=1 + i % 3,
        end_time=start + (0.0123 * i if i % 4 else -0.001),
    )
    if failed:
        context.exception = TimeoutError("no")
    else:
        context.results = [
            SendResult(
                msg_id=msg_id,
                message_queue=MessageQueue(topic, queue_id),
                queue_offset=10 * i + j,
                status=status,
            )
            for j, msg_id in enumerate(ids)
        ]
    return context


def _calls() -> list[SendMessageContext]:
    """Sends of one message and batches; traced and untraced messages; with and
    without keys, tags and regions; separators inside ids, keys, tags, topics and
    groups; a failed call and a send to the trace topic, neither traced."""
    off = {PROPERTY_TRACE_SWITCH: "false"}
    m = OutgoingMessage.of
    return [
        _call(0, "pg", "t1", [m(b"x")], ["A"]),
        _call(1, "pg", "t1", [m(b"xy", keys=("k1", "two words"), tags="tg")], ["B"], queue_id=3),
        _call(2, "pg", "t1", [m(b"", properties=off)], ["C"]),  # not traced at all
        _call(
            3,
            "p\x02g",
            "t\x01z",
            [
                m(b"1", keys=("k\x01x",), properties=off),
                m(b"22", keys=("k\x02y", "z"), tags="t\x01g"),
                m(b"333", properties={PROPERTY_MSG_REGION: "r\x021", "traceparent": "tp"}),
            ],
            ["D\x01d", "E\x02e", "F"],
            queue_id=1,
        ),
        _call(4, "pg", "t2", [m(b"x", keys="kg", properties={PROPERTY_MSG_REGION: "r2"})], ["G"]),
        _call(5, "pg", "t2", [m(b"x", properties={PROPERTY_TRACE_SWITCH: "true"})], ["H"]),
        _call(6, "pg", "t2", [m(b"x", properties=off), m(b"y", properties=off)], ["I", "J"]),
        _call(7, "pg", "t2", [m(b"x")], ["K"], status=SendStatus.FLUSH_DISK_TIMEOUT),
        _call(8, "pg", "t2", [m(b"x")], [], failed=True),  # raised: no Pub record
        _call(9, "pg", RMQ_SYS_TRACE_TOPIC, [m(b"x")], ["L"]),  # the trace topic itself
        _call(10, "pg", "t1", [m(b"x", keys=("", "kk")), m(b"y")], ["M", "N"], queue_id=2),
    ]


def _reference(hook: SendMessageTraceHook, context: SendMessageContext) -> list[TraceContext]:
    """The ``Pub`` contexts of one call, one per traced message, built field by field."""
    if context.exception is not None or context.topic.startswith(RMQ_SYS_TRACE_TOPIC):
        return []
    return [
        TraceContext(
            trace_type=TraceType.Pub,
            timestamp=round((context.start_time + context.wall_offset) * 1000),
            region_id=m.properties.get(PROPERTY_MSG_REGION) or hook.region_id,
            group_name=context.producer_group,
            cost_time=int(max(0.0, context.end_time - context.start_time) * 1000),
            success=r.status is SendStatus.SEND_OK,
            attempt=context.attempts,
            beans=[
                TraceBean(
                    topic=context.topic,
                    msg_id=r.msg_id,
                    tags=m.tags or "",
                    keys=KEY_SEPARATOR.join(m.keys),
                    store_host=hook.store_host or "",
                    body_length=len(m.body),
                    msg_type=0,
                    offset_msg_id=f"{r.message_queue.queue_id}:{r.queue_offset}",
                    client_host=hook.client_host,
                    queue_id=r.message_queue.queue_id,
                    queue_offset=r.queue_offset,
                )
            ],
        )
        for m, r in zip(context.messages, context.results, strict=True)
        if m.properties.get(PROPERTY_TRACE_SWITCH) != "false"
    ]


@pytest.mark.parametrize("batch_num", [1, 3, 10])
@pytest.mark.parametrize("store_host", ["embedded", "127.0.0.1:6379", "h\x01st"])
def test_hook_records_equal_the_reference_encoding(batch_num: int, store_host: str) -> None:
    sink = SyncSink()
    hook = SendMessageTraceHook(
        sink, batch_num=batch_num, region_id="R\x01", store_host=store_host, client_host="c\x02h"
    )
    calls = _calls()
    for context in calls:
        hook.send_message_before(context)
        hook.send_message_after(context)
    anyio.run(hook.dispatcher.flush)

    body = "".join(m.body for m in sink.messages)
    references = [_reference(hook, c) for c in calls]
    expected = "".join(encode_trace_context(ctx) for ref in references for ctx in ref)
    assert body == expected
    for message in sink.messages:
        assert message.topic == RMQ_SYS_TRACE_TOPIC
        assert message.keys == tuple(trace_keys(decode_trace_data(message.body)))
    traced_calls = sum(1 for ref in references if ref)
    assert traced_calls == 7
    stats = hook.statistics()
    count = traced_calls
    assert (stats.appended, stats.written, stats.dropped, stats.lost) == (count, count, 0, 0)
    assert stats.messages == len(sink.messages) == -(-traced_calls // batch_num)
