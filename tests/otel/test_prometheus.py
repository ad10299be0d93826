"""serve_prometheus: the consumer's metrics on a scrape endpoint, with the README's names."""

from __future__ import annotations

import errno
import inspect
import re
import socket
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
from prometheus_client import CollectorRegistry

from stagedconsumer import (
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerStagedConcurrently,
    Producer,
    PushConsumer,
)
from stagedconsumer.otel import OpenTelemetryHook, OpenTelemetrySendHook, serve_prometheus

pytestmark = pytest.mark.anyio

# The names the README documents.
EXPECTED = (
    "messaging_process_duration_seconds_bucket{",
    'le="0.005"',
    'le="10",',
    "messaging_client_consumed_messages_total{",
    "stagedconsumer_consumer_await_duration_seconds_bucket{",
    "stagedconsumer_consumer_barrier_wait_duration_seconds_bucket{",
    "stagedconsumer_consumer_cached_messages{",
    "stagedconsumer_consumer_cached_bytes{",
    "stagedconsumer_consumer_lag{",
    'messaging_consumer_group_name="g"',
    'messaging_destination_name="t"',
)


class Staged(MessageListenerStagedConcurrently):
    def get_stage_definitions(self) -> Sequence[int]:
        return [1]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        return None


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


async def test_metrics_are_served_for_prometheus() -> None:
    endpoint = serve_prometheus(0, "127.0.0.1", registry=CollectorRegistry())
    try:
        broker = MemoryBroker()
        broker.create_topic("t", 1)
        for i in range(3):
            broker.send("t", str(i).encode())
        consumer = PushConsumer("g", broker, Staged())
        consumer.subscribe("t")
        consumer.register_consume_message_hook(
            OpenTelemetryHook(meter_provider=endpoint.meter_provider)
        )
        async with consumer:
            await consumer.wait_caught_up(timeout=10)
            text = await anyio.to_thread.run_sync(scrape, endpoint.port)
    finally:
        endpoint.close()
    for expected in EXPECTED:
        assert expected in text, expected
    consumed = [
        line
        for line in text.splitlines()
        if line.startswith("messaging_client_consumed_messages_total{")
    ]
    assert [float(line.rsplit(" ", 1)[1]) for line in consumed] == [3.0]


def test_a_busy_port_is_named_in_the_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        registry = CollectorRegistry()
        with pytest.raises(
            OSError, match=rf"127\.0\.0\.1:{port}.*already in use.*port=0"
        ) as caught:
            serve_prometheus(port, "127.0.0.1", registry=registry)
    assert caught.value.errno == errno.EADDRINUSE
    # Nothing was left registered for the port that was not served.
    assert list(registry.collect()) == []


async def test_send_metrics_are_served_for_prometheus() -> None:
    endpoint = serve_prometheus(0, "127.0.0.1", registry=CollectorRegistry())
    try:
        broker = MemoryBroker()
        broker.create_topic("orders", 1)
        producer = Producer(broker, group="shop")
        producer.register_send_message_hook(
            OpenTelemetrySendHook(meter_provider=endpoint.meter_provider)
        )
        async with producer:
            for i in range(3):
                await producer.send("orders", str(i).encode())
        text = await anyio.to_thread.run_sync(scrape, endpoint.port)
    finally:
        endpoint.close()
    lines = text.splitlines()
    sent = [line for line in lines if line.startswith("messaging_client_sent_messages_total{")]
    assert len(sent) == 1
    for label in (
        'messaging_destination_name="orders"',
        'messaging_destination_partition_id="0"',
        'messaging_operation_name="send"',
        'messaging_system="stagedconsumer"',
    ):
        assert label in sent[0]
    assert float(sent[0].rsplit(" ", 1)[1]) == 3.0
    count = [
        line
        for line in lines
        if line.startswith("messaging_client_operation_duration_seconds_count{")
    ]
    assert len(count) == 1
    assert 'messaging_operation_type="send"' in count[0]
    assert float(count[0].rsplit(" ", 1)[1]) == 3.0


def test_the_readme_shows_addr_for_a_local_only_endpoint() -> None:
    """The default stays prometheus_client's every-interface address; the README
    shows the ``addr=`` that keeps the endpoint on this machine, and it does."""
    assert inspect.signature(serve_prometheus).parameters["addr"].default == "0.0.0.0"
    readme = (Path(__file__).resolve().parents[2] / "docs/how-to/opentelemetry.md").read_text()
    shown = re.search(r'serve_prometheus\(9464, addr="([^"]+)"\)', readme)
    assert shown is not None, "the README's Prometheus fragment does not show addr="
    assert shown.group(1) == "127.0.0.1"
    assert 'addr` defaults to `"0.0.0.0"`' in readme.replace("\n", " ")
    endpoint = serve_prometheus(0, addr=shown.group(1), registry=CollectorRegistry())
    try:
        assert endpoint._server.server_address[0] == "127.0.0.1"
        scrape(endpoint.port)  # served, on the loopback address
    finally:
        endpoint.close()
