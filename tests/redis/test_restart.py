"""Redis restarting under a running consumer group member and a producer.

The test starts its own redis-server (``appendonly yes``, ``appendfsync always``, in a
temporary directory) so the data survives the restart, as it must in production; the
machine's shared Redis keeps nothing on disk. During the outage the broker reports
and retries (pulls back off, sends retry), the consumer keeps running, and
afterwards every message whose send returned has been consumed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import pytest

from offsetstore import MemoryOffsetStore
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    GroupOptions,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
)
from stagedconsumer._sources._redis_broker import RedisBroker
from tests.redis._server import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.slow]


class Collect(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.seen.extend((m.queue_id, m.queue_offset) for m in msgs)


async def test_consumer_and_producer_survive_a_redis_restart(redis_server: RedisServer) -> None:
    group_options = GroupOptions(lock_ttl=4, lock_renew_interval=0.5, rebalance_interval=0.5)
    listener = Collect()
    async with RedisBroker(redis_server.url, namespace="r", group_options=group_options) as broker:
        await broker.create_topic("t", 4)
        consumer = PushConsumer(
            "grp",
            broker,
            listener,
            offset_store=MemoryOffsetStore(),
            options=ConsumerOptions(
                pull_long_polling_timeout=0.5, pull_time_delay_when_exception=0.1
            ),
        )
        consumer.subscribe("t")
        sent: list[Message] = []

        async def produce() -> None:
            for i in range(400):
                sent.append(await broker.send("t", b"%d" % i))
                await anyio.sleep(0.005)

        async with consumer:
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                await anyio.sleep(0.6)
                assert 0 < len(sent) < 400
                await anyio.to_thread.run_sync(redis_server.stop)
                await anyio.sleep(1.0)  # the outage
                await anyio.to_thread.run_sync(redis_server.start)
            with anyio.fail_after(30):
                while {(m.queue_id, m.queue_offset) for m in sent} - set(listener.seen):
                    await anyio.sleep(0.1)
            stats = consumer.statistics()
        assert len(sent) == 400
        assert broker.connection_errors > 0
        assert stats.pull_errors > 0
        # Nothing lost; the queues' offsets stayed consecutive across the restart (no
        # hole: the consumer handled every offset up to the max). A send whose reply
        # was lost in the restart and that was sent again is stored twice (at least
        # once), so a queue may hold an entry more than the sends that returned.
        seen = set(listener.seen)
        for q in range(4):
            offsets = [m.queue_offset for m in sent if m.queue_id == q]
            assert offsets == sorted(set(offsets))
            max_offset = await broker.max_offset(MessageQueue("t", q))
            assert {(q, o) for o in range(max_offset)} <= seen
            assert len(offsets) <= max_offset <= len(offsets) + 2


async def test_a_member_cut_off_from_redis_stops_consuming_when_its_locks_lapse(
    redis_server: RedisServer,
) -> None:
    """Without renewals, a member must assume its locks expired: it stops handing out
    messages of its queues ``lock_ttl / 2`` after the last renewal was sent, commits
    what finished, and takes the queues again once Redis is back."""
    group_options = GroupOptions(lock_ttl=2, lock_renew_interval=0.3, rebalance_interval=0.3)
    listener = Collect()
    store = MemoryOffsetStore()
    async with RedisBroker(redis_server.url, namespace="r", group_options=group_options) as broker:
        await broker.create_topic("t", 2)
        await broker.send_many("t", [b"x"] * 100)
        consumer = PushConsumer(
            "grp",
            broker,
            listener,
            offset_store=store,
            options=ConsumerOptions(
                pull_long_polling_timeout=0.5, pull_time_delay_when_exception=0.1
            ),
        )
        consumer.subscribe("t")
        async with consumer:
            await consumer.wait_caught_up(timeout=10)
            assert len(consumer.assigned_queues) == 4  # 2 queues + the 2 retry queues
            await anyio.to_thread.run_sync(redis_server.stop)
            cut_at = time.monotonic()
            with anyio.fail_after(5):
                while consumer.assigned_queues:
                    await anyio.sleep(0.05)
            released_after = time.monotonic() - cut_at
            assert released_after <= group_options.local_lock_ttl + 1.0
            # What finished was committed before letting go.
            stored = await store.list_progress("grp", "t")
            assert sum(p.consume_offset or 0 for p in stored.values()) == 100
            await anyio.to_thread.run_sync(redis_server.start)
            with anyio.fail_after(10):
                while len(consumer.assigned_queues) < 4:
                    await anyio.sleep(0.05)
            await broker.send_many("t", [b"y"] * 10)
            await consumer.wait_caught_up(timeout=10)
    assert len(listener.seen) == 110
    assert len(set(listener.seen)) == 110
