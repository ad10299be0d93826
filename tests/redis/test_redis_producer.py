"""Producer on RedisBroker: what it sends is what a consumer gets, a Redis restart is
retried within the deadline, and a server that never answers ends at the deadline."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.abc
import pytest

from stagedconsumer import (
    ConsumeOrderlyContext,
    ConsumerOptions,
    Message,
    MessageListenerOrderly,
    OutgoingMessage,
    Producer,
    ProducerOptions,
    PushConsumer,
    SelectMessageQueueByHash,
    SendTimeoutError,
)
from stagedconsumer._sources._redis_broker import RedisBroker
from tests.redis._server import HangingProxy, RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


class Collect(MessageListenerOrderly):
    def __init__(self) -> None:
        self.seen: list[Message] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        self.seen.extend(msgs)


async def test_orders_sent_by_hash_are_consumed_in_order(broker: RedisBroker) -> None:
    await broker.create_topic("orders", 4)
    async with Producer(broker) as producer:
        by_order = SelectMessageQueueByHash()
        for step in range(5):
            for order in ("o-1", "o-2", "o-3"):
                await producer.send(
                    "orders",
                    f"{order}:{step}".encode(),
                    keys=[order],
                    tags="step",
                    properties={"step": str(step)},
                    selector=by_order,
                    arg=order,
                )
        batch = await producer.send_batch(
            "orders", [OutgoingMessage.of(b"b1"), OutgoingMessage.of(b"b2")], queue_id=0
        )
        assert [r.queue_offset for r in batch] == [batch[0].queue_offset, batch[0].queue_offset + 1]
    listener = Collect()
    consumer = PushConsumer(
        "g", broker, listener, options=ConsumerOptions(pull_long_polling_timeout=0.2)
    )
    consumer.subscribe("orders")
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert len(listener.seen) == 17
    for order in ("o-1", "o-2", "o-3"):
        mine = [m for m in listener.seen if m.keys == (order,)]
        assert len({m.queue_id for m in mine}) == 1  # one queue per order
        assert [m.body for m in mine] == [f"{order}:{s}".encode() for s in range(5)]
        assert [m.properties["step"] for m in mine] == [str(s) for s in range(5)]
        assert {m.tags for m in mine} == {"step"}


@pytest.mark.slow
async def test_sends_during_a_redis_restart_are_retried_within_the_deadline(
    redis_server: RedisServer,
) -> None:
    async with RedisBroker(redis_server.url, namespace="p", socket_timeout=2) as broker:
        await broker.create_topic("t", 2)
        options = ProducerOptions(send_msg_timeout=10, retry_times_when_send_failed=100)
        async with Producer(broker, options=options) as producer:
            await producer.send("t", b"before")
            await anyio.to_thread.run_sync(redis_server.stop)

            async def back_in_a_second() -> None:
                await anyio.sleep(1.0)
                await anyio.to_thread.run_sync(redis_server.start)

            async with anyio.create_task_group() as tg:
                tg.start_soon(back_in_a_second)
                result = await producer.send("t", b"during")
            stats = producer.statistics()
        assert stats.retries > 0
        stored = await broker.messages("t", result.message_queue.queue_id)
        assert b"during" in [m.body for m in stored]


async def test_a_server_that_stops_answering_ends_at_the_deadline(
    hanging_proxy: HangingProxy,
) -> None:
    async with RedisBroker(hanging_proxy.url, namespace="p", socket_timeout=30) as broker:
        hanging_proxy.hang()
        options = ProducerOptions(send_msg_timeout=0.5)
        async with Producer(broker, options=options) as producer:
            started = anyio.current_time()
            with pytest.raises(SendTimeoutError):
                await producer.send("t", b"x")
            assert 0.5 <= anyio.current_time() - started < 3.0
