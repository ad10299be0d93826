"""The Redis producer adds the W3C traceparent of the current span, like the embedded one."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider

from stagedconsumer import MessageQueue, RedisBroker

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
