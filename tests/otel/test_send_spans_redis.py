"""OpenTelemetry from send to consume over the Redis broker: the send hook's context
travels in the stream entry's properties and the consumer's spans link to it."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    Message,
    MessageListenerConcurrently,
    Producer,
    PushConsumer,
    RedisBroker,
)
from stagedconsumer.otel import OpenTelemetryHook, OpenTelemetrySendHook
from tests.redis.conftest import require_redis

from .conftest import Otel

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return ("asyncio", {})  # redis-py's asyncio client


class Collect(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.messages.extend(msgs)


async def test_consumer_spans_link_to_the_send_spans_over_redis(otel: Otel) -> None:
    url = require_redis()
    async with RedisBroker(url, namespace=f"test-{uuid.uuid4().hex[:12]}") as broker:
        try:
            await broker.create_topic("t", 2)
            producer = Producer(broker, group="pg")
            producer.register_send_message_hook(
                OpenTelemetrySendHook(
                    tracer_provider=otel.tracer_provider,
                    meter_provider=otel.meter_provider,
                    messaging_system="redis",
                )
            )
            async with producer:
                single = await producer.send("t", b"one", keys=["k1"])
                batch = await producer.send_batch("t", [b"b1", b"b2"], queue_id=1)
            listener = Collect()
            consumer = PushConsumer("g", broker, listener)
            consumer.subscribe("t")
            consumer.register_consume_message_hook(
                OpenTelemetryHook(
                    tracer_provider=otel.tracer_provider,
                    meter_provider=otel.meter_provider,
                    messaging_system="redis",
                )
            )
            async with consumer:
                await consumer.wait_caught_up(timeout=10)
        finally:
            await broker.delete_namespace()
    assert len(listener.messages) == 3
    send_single, _ = otel.spans("send")
    creates = otel.spans("create")
    expected = {
        single.msg_id: send_single.context.span_id,
        batch[0].msg_id: creates[0].context.span_id,
        batch[1].msg_id: creates[1].context.span_id,
    }
    linked = {
        link.attributes["messaging.message.id"]: link.context.span_id  # type: ignore[index]
        for span in otel.spans("process")
        for link in span.links
    }
    assert linked == expected
    # What was stored in Redis is what the consumer read: the W3C traceparent.
    consumed = {m.msg_id: m.properties["traceparent"] for m in listener.messages}
    assert consumed[single.msg_id].split("-")[2] == f"{send_single.context.span_id:016x}"
    assert dict(send_single.attributes or {})["messaging.system"] == "redis"
