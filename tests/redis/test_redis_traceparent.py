"""The Redis producer adds the W3C traceparent of the current span, like the embedded one."""

from __future__ import annotations

import anyio
import pytest
from opentelemetry.sdk.trace import TracerProvider

from stagedconsumer import (
    ConsumeMessageTraceHook,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
    RedisBroker,
)

pytestmark = pytest.mark.anyio


async def test_send_injects_traceparent_of_the_current_span(broker: RedisBroker) -> None:
    await broker.create_topic("t", 1)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("publish") as span:
        sent = await broker.send("t", b"x", properties={"a": "b"})
    context = span.get_span_context()
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
    assert sent.properties["traceparent"] == expected
    (stored,) = (await broker.pull(MessageQueue("t", 0), 0, 10)).messages
    assert stored.properties["traceparent"] == expected
    assert stored.properties["a"] == "b"
    plain = await broker.send("t", b"y")
    assert "traceparent" not in plain.properties


async def test_trace_messages_carry_no_traceparent_of_a_consumer_span(
    broker: RedisBroker,
) -> None:
    """A consumer started inside a span: its trace dispatcher's task inherits that span,
    and RedisBroker.send injects the current span; trace messages must not get it."""

    class Noop(MessageListenerConcurrently):
        async def consume_message(self, msgs: object, context: object) -> None:
            return None

    await broker.create_topic("t", 1)
    for i in range(3):
        await broker.send("t", str(i).encode(), keys=[f"k{i}"])
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("application"):
        consumer = PushConsumer("g", broker, Noop())
        consumer.subscribe("t")
        hook = ConsumeMessageTraceHook(flush_interval=0.05)
        consumer.register_consume_message_hook(hook)
        async with consumer:
            await consumer.wait_caught_up(timeout=10)
            with anyio.fail_after(10):
                while hook.statistics().written < 6:  # SubBefore + SubAfter per message
                    await anyio.sleep(0.02)
    written = (await broker.pull(MessageQueue("RMQ_SYS_TRACE_TOPIC", 0), 0, 100)).messages
    assert written
    assert all("traceparent" not in message.properties for message in written)
