"""Message trace end to end: consumer -> hook -> dispatcher -> sink -> query / CLI."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumerOptions,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
)
from stagedconsumer._cli import main
from stagedconsumer._cli._trace import message_life
from stagedconsumer._observability._trace_codec import (
    RMQ_SYS_TRACE_TOPIC,
    TraceMessage,
    TraceType,
    decode_trace_data,
    encode_trace_context,
    trace_keys,
)
from stagedconsumer._observability._trace_hook import ConsumeMessageTraceHook
from stagedconsumer._observability._trace_query import (
    query_message_trace,
    read_trace_file,
    trace_messages_of,
)
from stagedconsumer._observability._trace_sinks import FileTraceSink, TraceSink

from .test_hooks import Staged, broker_with

pytestmark = pytest.mark.anyio


async def test_staged_trace_to_file_and_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl"
    broker = broker_with(5)
    consumer = PushConsumer(
        "g",
        broker,
        Staged([2, 2], cost=0.02, fail_once=b"3"),
        options=ConsumerOptions(suspend_current_queue_time_millis=10),
    )
    consumer.subscribe("t")
    hook = ConsumeMessageTraceHook(FileTraceSink(path), flush_interval=3600)
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    # Flushed on shutdown: 6 handler calls, one SubBefore and one SubAfter each.
    stats = hook.statistics()
    assert (stats.appended, stats.written, stats.dropped, stats.queued) == (12, 12, 0, 0)
    stored = list(read_trace_file(path))
    assert all(m.topic == RMQ_SYS_TRACE_TOPIC for m in stored)
    # The hook writes records directly; they are exactly what the encoder makes.
    for message in stored:
        decoded = decode_trace_data(message.body)
        assert "".join(encode_trace_context(c) for c in decoded) == message.body
        assert set(message.keys) == set(trace_keys(decoded))

    msg3 = broker.messages("t")[3]
    contexts = query_message_trace(stored, msg3.msg_id)
    assert contexts == query_message_trace(stored, "k3")  # by id or by business key
    assert [c.trace_type for c in contexts] == [TraceType.SubBefore, TraceType.SubAfter] * 2
    rows = message_life(contexts)
    assert [(r.attempt, r.stage_index, r.success, r.settlement) for r in rows] == [
        (1, 1, False, "suspend"),
        (2, 1, True, ""),
    ]
    first = rows[0]
    assert (first.topic, first.queue_id, first.queue_offset, first.group) == ("t", 0, 3, "g")
    assert first.context_code == 2  # EXCEPTION
    assert first.barrier_wait_ms is not None
    assert first.barrier_wait_ms >= 15
    assert first.cached_ms is not None
    assert first.cached_ms <= first.start_ms
    assert first.end_ms is not None
    assert first.end_ms - first.start_ms >= 15
    assert first.cost_ms is not None
    assert first.cost_ms >= 15

    assert main(["trace", "k3", "--trace-file", str(path)]) == 0
    out = capsys.readouterr().out
    assert msg3.msg_id in out
    assert "failed (EXCEPTION) -> suspend" in out
    assert "success" in out
    assert main(["trace", "k3", "--trace-file", str(path), "--json"]) == 0
    [history] = json.loads(capsys.readouterr().out)
    assert history["msg_id"] == msg3.msg_id
    assert history["sends"] == []  # not sent through a traced Producer
    assert [c["attempt"] for c in history["calls"]] == [1, 2]
    # The second attempt is a local retry: it never left the cache.
    assert [c["local_retry"] for c in history["calls"]] == [False, True]
    assert [c["broker_wait_ms"] for c in history["calls"]] == [None, None]
    assert history["calls"][1]["cache_wait_ms"] >= 10  # suspended for 10 ms
    assert main(["trace", "nope", "--trace-file", str(path)]) == 1


async def test_default_sink_is_the_trace_topic_of_the_broker() -> None:
    broker = broker_with(3)
    consumer = PushConsumer("g", broker, Staged([]))
    consumer.subscribe("t")
    consumer.register_consume_message_hook(ConsumeMessageTraceHook())
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert broker.statistics().topics[RMQ_SYS_TRACE_TOPIC] == 1  # created, one queue
    stored = list(trace_messages_of(broker))
    sent = broker.messages("t")
    for i, message in enumerate(sent):
        assert message.msg_id in {k for m in stored for k in m.keys}
        contexts = query_message_trace(stored, f"k{i}")
        assert {c.trace_type for c in contexts} == {TraceType.SubBefore, TraceType.SubAfter}
        assert {c.beans[0].msg_id for c in contexts} == {message.msg_id}


@pytest.mark.slow
async def test_trace_switch_off_and_retries_traced_under_the_first_id() -> None:
    class FailFirst(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> ConsumeConcurrentlyStatus:
            context.delay_level_when_next_consume = 1
            if msgs[0].reconsume_times == 0:
                return ConsumeConcurrentlyStatus.RECONSUME_LATER
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

    broker = MemoryBroker()
    broker.create_topic("t", 1)
    traced = broker.send("t", b"a", keys="traced")
    broker.send("t", b"b", keys="silent", properties={"TRACE_ON": "false"})

    class Sink(TraceSink):
        def __init__(self) -> None:
            self.messages: list[TraceMessage] = []

        async def write(self, message: TraceMessage) -> None:
            self.messages.append(message)

    sink = Sink()
    consumer = PushConsumer("g", broker, FailFirst())
    consumer.subscribe("t")
    consumer.register_consume_message_hook(ConsumeMessageTraceHook(sink))
    async with consumer:
        with anyio.fail_after(10):
            while consumer.statistics().consumed_ok < 2:
                await anyio.sleep(0.05)
    assert query_message_trace(sink.messages, "silent") == []
    rows = message_life(query_message_trace(sink.messages, traced.msg_id))
    assert [(r.attempt, r.success, r.settlement) for r in rows] == [
        (1, False, "retry"),
        (2, True, ""),
    ]
    assert rows[0].context_code == 4  # FAILED: RECONSUME_LATER


async def test_full_trace_queue_drops_are_in_consumer_statistics() -> None:
    gate = anyio.Event()

    class Stuck(TraceSink):
        async def write(self, message: TraceMessage) -> None:
            await gate.wait()

    broker = broker_with(30)
    listener = Staged([])
    consumer = PushConsumer("g", broker, listener)
    consumer.subscribe("t")
    hook = ConsumeMessageTraceHook(Stuck(), queue_size=8, batch_num=4)
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
        stats = consumer.statistics()
        gate.set()
    assert len(listener.consumed) == 30  # tracing never holds consumption back
    # 60 contexts: 8 queued, at most 4 more taken by the stuck write, the rest dropped.
    appended = hook.statistics().appended
    assert 8 <= appended <= 12
    assert stats.trace_records_dropped == 60 - appended
    assert hook.statistics().dropped == stats.trace_records_dropped


async def test_async_source_gets_its_trace_topic_created_and_written_by_the_task() -> None:
    class AsyncBroker(MemoryBroker):
        """A source whose producer side is async (as RedisBroker's is)."""

        async def send(self, topic: str, body: bytes, **kwargs: Any) -> Message:  # type: ignore[override]
            await anyio.lowlevel.checkpoint()
            return super().send(topic, body, **kwargs)

        async def create_topic(self, topic: str, queue_count: int = 8) -> list[MessageQueue]:  # type: ignore[override]
            await anyio.lowlevel.checkpoint()
            return super().create_topic(topic, queue_count)

    broker = AsyncBroker()
    await broker.create_topic("t", 1)
    for i in range(12):
        await broker.send("t", str(i).encode(), keys=[f"k{i}"])
    hook = ConsumeMessageTraceHook(batch_num=5)
    consumer = PushConsumer("g", broker, Staged([3]))
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    stats = hook.statistics()
    assert (stats.written, stats.dropped, stats.write_errors) == (24, 0, 0)
    assert broker.statistics().topics[RMQ_SYS_TRACE_TOPIC] == 1
    rows = message_life(query_message_trace(trace_messages_of(broker), "k7"))
    assert [(r.attempt, r.success) for r in rows] == [(1, True)]


async def test_a_call_whose_sub_before_was_dropped_still_gets_its_sub_after() -> None:
    from stagedconsumer._observability._hooks import ConsumeMessageContext, ConsumeReturnType

    class ListSink(TraceSink):
        def __init__(self) -> None:
            self.messages: list[TraceMessage] = []

        async def write(self, message: TraceMessage) -> None:
            self.messages.append(message)

    broker = broker_with(2)
    first, second = broker.messages("t")
    sink = ListSink()
    hook = ConsumeMessageTraceHook(sink, queue_size=1)

    def call(message: Message) -> ConsumeMessageContext:
        return ConsumeMessageContext._of_call(
            "g", MessageQueue("t", 0), [message], "concurrent", -1, None, None, 1, [1.0], 1.0,
            2.0, 1e9,
        )  # fmt: skip

    a, b = call(first), call(second)
    hook.consume_message_before(a)
    hook.consume_message_before(b)  # the queue is full: dropped
    await hook.dispatcher.flush()
    for context in (a, b):
        context.end_time, context.success = 2.5, True
        context.status = ConsumeReturnType.SUCCESS
        hook.consume_message_after(context)
        await hook.dispatcher.flush()
    stats = hook.statistics()
    assert (stats.appended, stats.dropped, stats.written) == (3, 1, 3)
    decoded = [c for m in sink.messages for c in decode_trace_data(m.body)]
    assert [(c.trace_type, c.beans[0].msg_id) for c in decoded] == [
        (TraceType.SubBefore, first.msg_id),
        (TraceType.SubAfter, first.msg_id),
        (TraceType.SubAfter, second.msg_id),
    ]
    assert decoded[0].request_id == decoded[1].request_id
    assert decoded[2].request_id not in ("", decoded[0].request_id)
    assert decoded[2].cost_time == 500
