"""Send trace end to end: Producer -> SendMessageTraceHook -> sink, then the message's
history (its ``Pub`` record and every consume attempt) through the query and the CLI,
and what RocketMQ's decoder reads of the records."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumeMessageTraceHook,
    FileTraceSink,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    OutgoingMessage,
    Producer,
    PushConsumer,
    SendMessageTraceHook,
    SendResult,
    SourceError,
    UnknownTopicError,
    query_message_trace,
    read_trace_file,
    read_trace_topic,
    trace_messages_of,
)
from stagedconsumer._cli import main
from stagedconsumer._cli._trace import message_history
from stagedconsumer._observability._trace_codec import (
    PROPERTY_TRACE_SWITCH,
    RMQ_SYS_TRACE_TOPIC,
    TraceMessage,
    TraceType,
    decode_trace_data,
    encode_trace_context,
    trace_keys,
)
from stagedconsumer._observability._trace_sinks import TraceSink

from .test_codec import _rocketmq_decode

pytestmark = pytest.mark.anyio


class FailingBroker(MemoryBroker):
    """The embedded broker, whose appends fail for good while ``fail`` is set."""

    fail = False

    async def append(self, mq: MessageQueue, messages: Sequence[OutgoingMessage]) -> list[Message]:
        if self.fail:
            raise SourceError("disk full", retriable=False)
        return await super().append(mq, messages)


class RetryOnce(MessageListenerConcurrently):
    """Fails the first delivery of the messages whose key is in ``fail``: they come
    back through the retry queue after 1 s (delay level 1)."""

    def __init__(self, fail: set[str]) -> None:
        self.fail = fail

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        await anyio.sleep(0.01)
        context.delay_level_when_next_consume = 1
        if msgs[0].reconsume_times == 0 and set(msgs[0].keys) & self.fail:
            return ConsumeConcurrentlyStatus.RECONSUME_LATER
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


async def _send_and_consume(
    broker: MemoryBroker,
    send_hook: SendMessageTraceHook,
    consume_hook: ConsumeMessageTraceHook,
    count: int = 4,
) -> list[SendResult]:
    producer = Producer(broker, group="shop")
    producer.register_send_message_hook(send_hook)
    consumer = PushConsumer("billing", broker, RetryOnce({"ORDER-2"}))
    consumer.subscribe("orders")
    consumer.register_consume_message_hook(consume_hook)
    async with producer, consumer:
        sent = [
            await producer.send("orders", b"{}" * i, keys=[f"ORDER-{i}", "batch-7"], tags="paid")
            for i in range(count)
        ]
        with anyio.fail_after(10):
            while consumer.statistics().consumed_ok < count:
                await anyio.sleep(0.02)
    return sent


@pytest.mark.slow
async def test_a_retried_message_is_one_history_from_its_send_to_its_success(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl"
    broker = MemoryBroker()
    broker.create_topic("orders", 2)
    send_hook = SendMessageTraceHook(FileTraceSink(path), flush_interval=3600)
    consume_hook = ConsumeMessageTraceHook(FileTraceSink(path), flush_interval=3600)
    sent = await _send_and_consume(broker, send_hook, consume_hook)
    stats = send_hook.statistics()
    assert (stats.appended, stats.written, stats.dropped, stats.queued) == (4, 4, 0, 0)

    stored = list(read_trace_file(path))
    for message in stored:  # exactly what the reference encoder makes
        decoded = decode_trace_data(message.body)
        assert "".join(encode_trace_context(c) for c in decoded) == message.body
        assert set(message.keys) == set(trace_keys(decoded))
    retried = sent[2]
    contexts = query_message_trace(stored, "ORDER-2")
    assert contexts == query_message_trace(stored, retried.msg_id)  # by id or by key
    # In the order written (each hook flushes when its owner stops: the consumer first).
    assert Counter(c.trace_type for c in contexts) == {
        TraceType.Pub: 1,
        TraceType.SubBefore: 2,
        TraceType.SubAfter: 2,
    }
    # A business key shared by every message finds them all, one history each.
    assert [h.msg_id for h in message_history(query_message_trace(stored, "batch-7"))] == sorted(
        r.msg_id for r in sent
    )

    [history] = message_history(contexts)
    assert history.msg_id == retried.msg_id
    [send] = history.sends
    assert (send.group, send.topic, send.queue_id, send.queue_offset) == (
        "shop",
        "orders",
        retried.message_queue.queue_id,
        retried.queue_offset,
    )
    assert (send.success, send.attempts, send.store_host, send.tags) == (
        True,
        1,
        "embedded",
        "paid",
    )
    assert (send.keys, send.body_length) == ("ORDER-2 batch-7", 4)
    first, second = history.calls
    assert (first.attempt, first.success, first.settlement) == (1, False, "retry")
    assert (first.topic, first.queue_id, first.queue_offset) == (
        "orders",
        retried.message_queue.queue_id,
        retried.queue_offset,
    )
    assert (second.attempt, second.success, second.settlement) == (2, True, "")
    # The retry was pulled from the retry queue: a new message, traced under the first id.
    assert (second.topic, second.queue_id, second.queue_offset) == ("%RETRY%billing", 0, 0)
    assert send.sent_ms <= first.start_ms
    assert first.broker_wait_ms is not None
    assert first.cached_ms is not None
    assert first.broker_wait_ms == max(0, first.cached_ms - send.sent_ms - send.cost_ms)
    assert first.cache_wait_ms is not None
    assert second.broker_wait_ms is not None
    assert second.broker_wait_ms >= 900  # the retry queue's delay level 1 (1 s)
    assert not first.local_retry
    assert not second.local_retry

    assert main(["trace", "ORDER-2", "--trace-file", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("│")]
    assert [line.split("│")[1].strip() for line in lines] == ["send", "attempt 1", "attempt 2"]
    assert "shop" in lines[0]
    assert f"orders:{retried.message_queue.queue_id}@{retried.queue_offset}" in lines[0]
    assert "failed (FAILED) -> retry" in lines[1]
    assert "%RETRY%billing:0@0" in lines[2]
    assert "success" in lines[2]
    assert "stored on embedded" in out
    assert main(["trace", retried.msg_id, "--trace-file", str(path), "--json"]) == 0
    [data] = json.loads(capsys.readouterr().out)
    assert [s["group"] for s in data["sends"]] == ["shop"]
    assert [c["attempt"] for c in data["calls"]] == [1, 2]


@pytest.mark.slow
async def test_rocketmq_reads_every_record_with_its_meaning() -> None:
    broker = MemoryBroker()
    broker.create_topic("orders", 2)
    sent = await _send_and_consume(
        broker, SendMessageTraceHook(client_host="host-a"), ConsumeMessageTraceHook()
    )
    by_id = {r.msg_id: r for r in sent}
    records = [
        record for message in trace_messages_of(broker) for record in _rocketmq_decode(message.body)
    ]
    pubs = [r for r in records if r["type"] == "Pub"]
    assert sorted(str(p["msgId"]) for p in pubs) == sorted(by_id)
    for pub in pubs:
        result = by_id[str(pub["msgId"])]
        assert result.message is not None
        assert pub["timeStamp"] == pytest.approx(result.message.born_timestamp * 1000, abs=1000)
        assert (pub["regionId"], pub["groupName"], pub["topic"]) == (
            "DefaultRegion",
            "shop",
            "orders",
        )
        assert (pub["tags"], pub["keys"]) == ("paid", " ".join(result.message.keys))
        assert (pub["storeHost"], pub["bodyLength"]) == ("embedded", len(result.message.body))
        assert isinstance(pub["costTime"], int)
        assert pub["costTime"] >= 0
        assert (pub["msgType"], pub["isSuccess"], pub["clientHost"]) == (
            "Normal_Msg",
            True,
            "host-a",
        )
        assert pub["offsetMsgId"] == f"{result.message_queue.queue_id}:{result.queue_offset}"
    befores = [r for r in records if r["type"] == "SubBefore"]
    afters = [r for r in records if r["type"] == "SubAfter"]
    assert len(befores) == len(afters) == 5  # four messages, one of them twice
    retried = sent[2].msg_id
    assert sorted((b["msgId"], b["retryTimes"]) for b in befores if b["msgId"] == retried) == [
        (retried, 0),
        (retried, 1),
    ]
    assert {b["groupName"] for b in befores} == {a["groupName"] for a in afters} == {"billing"}
    assert {
        (a["msgId"], a["isSuccess"], a["contextCode"]) for a in afters if not a["isSuccess"]
    } == {
        (retried, False, 4)  # FAILED: RECONSUME_LATER
    }
    assert {b["requestId"] for b in befores} == {a["requestId"] for a in afters}


@pytest.mark.slow
async def test_the_trace_topic_of_the_producers_source_and_read_trace_topic() -> None:
    broker = MemoryBroker()
    broker.create_topic("orders", 2)
    sent = await _send_and_consume(broker, SendMessageTraceHook(), ConsumeMessageTraceHook())
    assert broker.statistics().topics[RMQ_SYS_TRACE_TOPIC] == 1  # created, one queue
    stored = await read_trace_topic(broker)
    assert stored == list(trace_messages_of(broker))
    for result in sent:
        [history] = message_history(query_message_trace(stored, result.msg_id))
        assert [s.group for s in history.sends] == ["shop"]
        assert history.calls[-1].success
    assert await read_trace_topic(broker, "no-such-topic") == []


async def test_a_batch_gets_a_record_per_message() -> None:
    broker = MemoryBroker()
    broker.create_topic("orders", 2)
    hook = SendMessageTraceHook(batch_num=1)
    producer = Producer(broker, group="shop")
    producer.register_send_message_hook(hook)
    async with producer:
        results = await producer.send_batch(
            "orders", [OutgoingMessage.of(b"a", keys="x"), b"bb", OutgoingMessage.of(b"c")]
        )
    assert hook.statistics().appended == 1  # one context per call
    [message] = trace_messages_of(broker)
    contexts = decode_trace_data(message.body)
    assert [c.beans[0].msg_id for c in contexts] == [r.msg_id for r in results]
    assert [c.beans[0].queue_offset for c in contexts] == [r.queue_offset for r in results]
    assert [c.beans[0].body_length for c in contexts] == [1, 2, 1]
    assert len({c.timestamp for c in contexts}) == len({c.cost_time for c in contexts}) == 1
    assert message.keys == (results[0].msg_id, "x", results[1].msg_id, results[2].msg_id)


async def test_failed_untraced_and_trace_topic_sends_write_no_pub() -> None:
    broker = FailingBroker()
    broker.create_topic("orders", 1)
    broker.create_topic(RMQ_SYS_TRACE_TOPIC, 1)
    hook = SendMessageTraceHook(batch_num=1)
    producer = Producer(broker, group="shop")
    producer.register_send_message_hook(hook)
    async with producer:
        with pytest.raises(UnknownTopicError):
            await producer.send("nope", b"x")
        broker.fail = True
        with pytest.raises(SourceError):
            await producer.send("orders", b"x")
        broker.fail = False
        await producer.send("orders", b"x", properties={PROPERTY_TRACE_SWITCH: "false"})
        await producer.send(RMQ_SYS_TRACE_TOPIC, b"not a trace record")
        traced = await producer.send("orders", b"x", keys="k")
    assert producer.statistics().send_errors == 2
    assert hook.statistics().appended == 1
    records = [c for m in trace_messages_of(broker) for c in decode_trace_data(m.body)]
    assert [c.beans[0].msg_id for c in records] == [traced.msg_id]


async def test_full_trace_queue_drops_are_in_producer_statistics() -> None:
    gate = anyio.Event()

    class Stuck(TraceSink):
        async def write(self, message: TraceMessage) -> None:
            await gate.wait()

    broker = MemoryBroker()
    broker.create_topic("orders", 1)
    hook = SendMessageTraceHook(Stuck(), queue_size=4, batch_num=2)
    producer = Producer(broker, group="shop")
    producer.register_send_message_hook(hook)
    async with producer:
        for _ in range(20):
            await producer.send("orders", b"x")
        stats = producer.statistics()
        gate.set()
    appended = hook.statistics().appended
    assert 4 <= appended <= 6  # 4 queued, at most 2 more taken by the stuck write
    assert stats.trace_records_dropped == 20 - appended == hook.records_dropped
