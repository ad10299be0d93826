"""Message trace on RedisBroker: producer and consumer write their records to the trace
topic in Redis, ``read_trace_topic`` and ``stagedconsumer trace --redis`` read them
back as one history per message."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumeMessageTraceHook,
    ConsumerOptions,
    Message,
    MessageListenerConcurrently,
    Producer,
    PushConsumer,
    SendMessageTraceHook,
    query_message_trace,
    read_trace_topic,
    trace_messages_of,
)
from stagedconsumer._cli import main
from stagedconsumer._cli._trace import message_history
from stagedconsumer._observability._trace_codec import RMQ_SYS_TRACE_TOPIC, TraceType
from stagedconsumer._sources._redis_broker import RedisBroker

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


class RetryOnce(MessageListenerConcurrently):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        context.delay_level_when_next_consume = 1  # back after 1 s
        if msgs[0].reconsume_times == 0 and msgs[0].keys == ("ORDER-1",):
            return ConsumeConcurrentlyStatus.RECONSUME_LATER
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


async def test_trace_messages_of_says_to_await_read_trace_topic(broker: RedisBroker) -> None:
    with pytest.raises(ConfigurationError, match=r"await read_trace_topic\(source\)"):
        trace_messages_of(broker)
    assert await read_trace_topic(broker) == []  # no trace topic yet


@pytest.mark.slow
async def test_trace_topic_in_redis_read_back_as_one_history(
    broker: RedisBroker, redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await broker.create_topic("orders", 2)
    producer = Producer(broker, group="shop")
    producer.register_send_message_hook(SendMessageTraceHook(batch_num=1))
    consumer = PushConsumer(
        "billing", broker, RetryOnce(), options=ConsumerOptions(pull_long_polling_timeout=0.2)
    )
    consumer.subscribe("orders")
    consumer.register_consume_message_hook(ConsumeMessageTraceHook(batch_num=1))
    async with producer, consumer:
        sent = [await producer.send("orders", b"{}", keys=f"ORDER-{i}") for i in range(3)]
        with anyio.fail_after(15):
            while consumer.statistics().consumed_ok < 3:
                await anyio.sleep(0.05)

    assert await broker.queue_count(RMQ_SYS_TRACE_TOPIC) == 1  # created with one queue
    stored = await read_trace_topic(broker)
    assert stored
    assert {m.topic for m in stored} == {RMQ_SYS_TRACE_TOPIC}
    retried = sent[1]
    contexts = query_message_trace(stored, "ORDER-1")
    assert {c.trace_type for c in contexts} == {
        TraceType.Pub,
        TraceType.SubBefore,
        TraceType.SubAfter,
    }
    [history] = message_history(contexts)
    assert history.msg_id == retried.msg_id
    [send] = history.sends
    assert (send.group, send.queue_id, send.queue_offset) == (
        "shop",
        retried.message_queue.queue_id,
        retried.queue_offset,
    )
    assert send.store_host == broker.store_host() == "127.0.0.1:6379"
    assert [(c.attempt, c.success, c.settlement, c.topic) for c in history.calls] == [
        (1, False, "retry", "orders"),
        (2, True, "", "%RETRY%billing"),
    ]
    assert history.calls[1].broker_wait_ms is not None
    assert history.calls[1].broker_wait_ms >= 900  # the retry waited 1 s in Redis

    # The CLI reads the same records from Redis (its own event loop, in a thread).
    args = ["trace", "ORDER-1", "--redis", redis_url, "--namespace", namespace]
    assert await anyio.to_thread.run_sync(main, args) == 0
    out = capsys.readouterr().out
    steps = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert steps == ["send", "attempt 1", "attempt 2"]
    assert retried.msg_id in out
    assert "stored on 127.0.0.1:6379" in out
    other = ["trace", "ORDER-1", "--redis", redis_url, "--namespace", namespace + "-empty"]
    assert await anyio.to_thread.run_sync(main, other) == 1
    assert "no trace records" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_reports_an_unreachable_redis(capsys: pytest.CaptureFixture[str]) -> None:
    closed = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    assert main(["trace", "k", "--redis", closed]) == 1
    captured = capsys.readouterr()
    assert "cannot read RMQ_SYS_TRACE_TOPIC" in captured.err
    assert captured.out == ""
    assert main(["trace", "k", "--redis", closed, "--json"]) == 1
    captured = capsys.readouterr()
    assert "cannot read RMQ_SYS_TRACE_TOPIC" in captured.err
    assert captured.out == ""  # nothing for a JSON reader to choke on
