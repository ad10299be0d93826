"""The rebalance listener in a consumer group over Redis: a queue that moves to a new
member is revoked from the old one after its calls drained and its progress was
committed, while the old member still holds its lock; the new member hears of it
after the progress was loaded and before its first handler call there."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from offsetstore import MemoryOffsetStore
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    MessageQueueListener,
    PushConsumer,
)
from stagedconsumer._sources._redis_broker import RedisBroker

from .test_groups import OPTIONS, group_broker  # noqa: F401 - the fixture

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


class Work(MessageListenerConcurrently):
    def __init__(self, name: str, calls: list[tuple[str, MessageQueue, int]]) -> None:
        self.name = name
        self.calls = calls

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        for m in msgs:
            self.calls.append((self.name, MessageQueue(m.topic, m.queue_id), m.queue_offset))
        await anyio.sleep(0.001)


class Watch(MessageQueueListener):
    """Records, per event, what the lock and the store say at that moment."""

    def __init__(
        self,
        name: str,
        broker: RedisBroker,
        store: MemoryOffsetStore,
        calls: list[tuple[str, MessageQueue, int]],
    ) -> None:
        self.name = name
        self.coordinator = broker.group_coordinator()
        self.store = store
        self.calls = calls
        self.seen: list[tuple[str, MessageQueue, str | None, int | None, int]] = []

    async def _record(self, event: str, queues: Sequence[MessageQueue]) -> None:
        progress = await self.store.list_progress("grp")
        for mq in queues:
            if mq.topic != "t":
                continue
            owner = await self.coordinator.lock_owner("grp", mq)
            committed = progress[mq].consume_offset if mq in progress else None
            handled = sum(1 for name, q, _ in self.calls if name == self.name and q == mq)
            self.seen.append((event, mq, owner, committed, handled))

    async def on_queues_assigned(self, queues: Sequence[MessageQueue]) -> None:
        await self._record("assigned", queues)

    async def on_queues_revoked(self, queues: Sequence[MessageQueue]) -> None:
        await self._record("revoked", queues)


async def test_a_moving_queue_is_revoked_committed_and_still_locked_then_assigned(
    group_broker: RedisBroker,  # noqa: F811 - the fixture imported above
) -> None:
    broker = group_broker
    await broker.create_topic("t", 4)
    store = MemoryOffsetStore()  # shared: what one member committed, the other loads
    calls: list[tuple[str, MessageQueue, int]] = []
    a = PushConsumer("grp", broker, Work("a", calls), offset_store=store, options=OPTIONS)
    b = PushConsumer("grp", broker, Work("b", calls), offset_store=store, options=OPTIONS)
    watch_a = Watch("a", broker, store, calls)
    watch_b = Watch("b", broker, store, calls)
    a.register_message_queue_listener(watch_a)
    b.register_message_queue_listener(watch_b)
    for consumer in (a, b):
        consumer.subscribe("t")
    await broker.send_many("t", [b"x"] * 200)  # 50 a queue
    async with a:
        await a.wait_caught_up(timeout=20)
        async with b:
            with anyio.fail_after(20):  # 4 queues of t and the 2 retry queues, 3 each
                while not len(a.assigned_queues) == len(b.assigned_queues) == 3:
                    await anyio.sleep(0.05)
            moved = [mq for mq in b.assigned_queues if mq.topic == "t"]
            await broker.send_many("t", [b"y"] * 200)
            await b.wait_caught_up(timeout=20)
            await a.wait_caught_up(timeout=20)
    assert moved, "no queue of t moved to b"
    revoked = [s for s in watch_a.seen if s[0] == "revoked" and s[1] in moved]
    # Revoked once per moved queue while a still held the lock, after all of a's
    # work there was committed.
    assert sorted(s[1] for s in revoked[: len(moved)]) == sorted(moved)
    for _event, _mq, owner, committed, handled in revoked[: len(moved)]:
        assert owner == a.client_id
        assert committed == handled == 50
    assigned = [s for s in watch_b.seen if s[0] == "assigned" and s[1] in moved]
    assert sorted(s[1] for s in assigned) == sorted(moved)
    for _event, _mq, owner, committed, handled in assigned:
        assert owner == b.client_id  # b holds the lock and loaded a's progress
        assert committed == 50
        assert handled == 0  # before b's first handler call on it
    # Nothing lost, nothing twice: each message handled exactly once.
    assert sorted((q, o) for _n, q, o in calls) == sorted(
        {(MessageQueue("t", q), o) for q in range(4) for o in range(100)}
    )
