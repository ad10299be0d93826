"""SimpleConsumer on a Redis Cluster (three masters started for the module): every
script touches one slot (the queue's), messages of all queues are received, acked,
redelivered and kept in FIFO order, on asyncio and trio."""

from __future__ import annotations

from collections import defaultdict

import anyio
import pytest

from stagedconsumer import SimpleConsumer, SimpleConsumerOptions
from stagedconsumer._sources._redis_broker import RedisBroker
from tests.redis.test_cluster import cluster_broker, redis_cluster

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.slow]
__all__ = ("cluster_broker", "redis_cluster")  # the fixtures used here


async def test_fifo_pop_consumption_on_a_cluster(cluster_broker: RedisBroker) -> None:
    broker = cluster_broker
    await broker.create_topic("t", 6)
    order: dict[str, list[bytes]] = defaultdict(list)
    for seq in range(4):
        for group in ("A", "B", "C", "D", "E"):
            body = f"{group}{seq}".encode()
            await broker.send("t", body, keys=[group])
            order[group].append(body)
    consumer = SimpleConsumer(
        "g",
        broker,
        subscriptions={"t": "*"},
        await_duration=0,
        options=SimpleConsumerOptions(fifo=True),
    )
    seen: dict[str, list[bytes]] = defaultdict(list)
    async with consumer:
        first = await consumer.receive(32, 0.2)
        assert sorted(m.body for m in first) == [b"A0", b"B0", b"C0", b"D0", b"E0"]
        await anyio.sleep(0.3)  # none acked: they come back first
        with anyio.fail_after(60):
            while sum(map(len, seen.values())) < 20:
                for m in await consumer.receive(32, 600):
                    assert m.message_group is not None
                    seen[m.message_group].append(m.body)
                    await consumer.ack(m)
    assert seen == order
