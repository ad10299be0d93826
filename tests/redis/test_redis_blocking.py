"""The blocking API on RedisBroker: plain sync tests, the broker opened, used and
closed on the portal's event loop (asyncio: redis-py; trio: coredis)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
from anyio.from_thread import start_blocking_portal

from stagedconsumer import (
    ConfigurationError,
    ConsumeOrderlyContext,
    ConsumerOptions,
    Message,
    MessageListenerOrderly,
    ProducerOptions,
    PushConsumer,
    SendTimeoutError,
)
from stagedconsumer._sources._redis_broker import RedisBroker
from stagedconsumer.blocking import BlockingConsumer, BlockingProducer
from tests.redis._server import RedisServer

pytestmark = pytest.mark.redis


class Collect(MessageListenerOrderly):
    """A plain ``def`` orderly handler."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[Message] = []

    def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> None:
        with self.lock:
            self.seen.extend(msgs)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_blocking_producer_and_consumer_over_redis(
    redis_url: str, namespace: str, backend: str
) -> None:
    listener = Collect()
    with start_blocking_portal(backend) as portal:
        broker = RedisBroker(redis_url, namespace=namespace)
        with portal.wrap_async_context_manager(broker):  # closed on its event loop
            try:
                portal.call(broker.create_topic, "orders", 4)
                consumer = PushConsumer(
                    "g", broker, listener, options=ConsumerOptions(pull_long_polling_timeout=0.2)
                )
                consumer.subscribe("orders")
                with (
                    BlockingProducer(broker, portal=portal) as producer,
                    BlockingConsumer(consumer, portal=portal) as running,
                ):
                    results = [
                        producer.send("orders", f"{order}:{step}".encode(), keys=[order])
                        for step in range(5)
                        for order in ("o-1", "o-2", "o-3")
                    ]
                    batch = producer.send_batch("orders", [b"b0", b"b1"], queue_id=0)
                    running.wait_caught_up(timeout=30)
                    stats = running.statistics()
                    assert len(running.assigned_queues) == 4
                stored = portal.call(broker.messages, "orders", 0)
            finally:
                portal.call(broker.delete_namespace)
    assert stats.consumed_ok == 17
    assert len(listener.seen) == 17
    for order in ("o-1", "o-2", "o-3"):
        mine = [m for m in listener.seen if m.keys == (order,)]
        assert len({m.queue_id for m in mine}) == 1  # one queue per key
        assert [m.body for m in mine] == [f"{order}:{s}".encode() for s in range(5)]
        sent = [r for r in results if r.msg_id in {m.msg_id for m in mine}]
        assert [r.queue_offset for r in sent] == sorted(r.queue_offset for r in sent)
    assert [r.queue_offset for r in batch] == [batch[0].queue_offset, batch[0].queue_offset + 1]
    assert [m.body for m in stored[batch[0].queue_offset :]] == [b"b0", b"b1"]


def test_a_redis_broker_used_on_a_trio_portal_before_entering_is_a_clear_error(
    redis_url: str, namespace: str
) -> None:
    broker = RedisBroker(redis_url, namespace=namespace)
    with (
        BlockingProducer(broker, backend="trio") as producer,
        pytest.raises(ConfigurationError, match="on trio, enter the RedisBroker"),
    ):
        producer.send("orders", b"x")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_unreachable_redis_ends_a_blocking_send_at_its_deadline(
    redis_server: RedisServer, backend: str
) -> None:
    with start_blocking_portal(backend) as portal:
        broker = RedisBroker(redis_server.url, namespace="p", socket_timeout=1)
        with (
            portal.wrap_async_context_manager(broker),
            BlockingProducer(
                broker, options=ProducerOptions(send_msg_timeout=0.5), portal=portal
            ) as producer,
        ):
            redis_server.stop()  # nothing listens on its port now
            started = time.monotonic()
            with pytest.raises(SendTimeoutError):
                producer.send("t", b"x")
            assert 0.5 <= time.monotonic() - started < 5
