"""Consumer groups on the embedded broker (MemoryBroker coordinates them by default):
hand-overs between members of one process."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import anyio
import pytest

from offsetstore import MemoryOffsetStore, QueueProgress, StoreCommitError
from stagedconsumer import (
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PushConsumer,
)

pytestmark = pytest.mark.anyio


class Stages(MessageListenerStagedConcurrently):
    def __init__(self, handled: list[tuple[int, int]]) -> None:
        self.handled = handled

    def get_stage_definitions(self) -> Sequence[int]:
        return [2, 3]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        await anyio.sleep(0.001)
        self.handled.extend((m.queue_id, m.queue_offset) for m in msgs)


async def _until(predicate: Callable[[], bool], timeout: float) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


async def test_a_released_queue_is_not_locked_again_while_its_unlock_is_under_way() -> None:
    """The member that keeps running releases half of its queues when a second one
    joins. Its rebalance round, woken by its own unlock, must not renew the lock
    being handed back (that would take it anew and keep it from the new member
    until the lock expires, 60 s by default). The unlock answers slowly here, as
    over a network, so a round always runs in between."""
    broker = MemoryBroker()
    broker.create_topic("t", 8)
    coordinator = broker.group_coordinator()
    assert coordinator is not None
    unlock = coordinator.unlock

    async def slow_unlock(group: str, client_id: str, queues: Sequence[MessageQueue]) -> None:
        await unlock(group, client_id, queues)
        await anyio.sleep(0.05)

    coordinator.unlock = slow_unlock  # type: ignore[method-assign]
    store = MemoryOffsetStore()
    handled: list[tuple[int, int]] = []
    sent: set[tuple[int, int]] = set()
    a = PushConsumer("g", broker, Stages(handled), offset_store=store)
    b = PushConsumer("g", broker, Stages(handled), offset_store=store)
    a.subscribe("t")
    b.subscribe("t")
    async with a:
        await _until(lambda: len(a.assigned_queues) == 8, 5)
        async with b:
            await _until(lambda: len(a.assigned_queues) == len(b.assigned_queues) == 4, 5)
            for i in range(40):
                m = broker.send("t", f"m{i}".encode())
                sent.add((m.queue_id, m.queue_offset))
            await _until(lambda: sent <= set(handled), 5)
    assert sorted(handled) == sorted(sent)  # each once: nothing lost, nothing twice


class FailingStore(MemoryOffsetStore):
    """Refuses every write while ``failing`` is set."""

    failing = False

    async def _write_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress]
    ) -> None:
        if self.failing:
            raise StoreCommitError("the store is down", retriable=True)
        await super()._write_stored(group, progress)


async def test_a_member_whose_last_commit_failed_still_hands_its_queues_back() -> None:
    """Keeping the locks after a failed final commit would only hold the queues from
    the next member until they expire (60 s): it resumes from the last committed
    progress either way."""
    broker = MemoryBroker()
    broker.create_topic("t", 2)
    store = FailingStore()
    handled: list[tuple[int, int]] = []
    first = PushConsumer("g", broker, Stages(handled), offset_store=store)
    first.subscribe("t")
    async with first:
        for i in range(6):
            broker.send("t", f"m{i}".encode(), queue_id=i % 2)
        await _until(lambda: len(handled) == 6, 5)
        store.failing = True  # the final commit fails
    store.failing = False
    for i in range(6, 10):
        broker.send("t", f"m{i}".encode(), queue_id=i % 2)
    second = PushConsumer("g", broker, Stages(handled), offset_store=store)
    second.subscribe("t")
    async with second:
        await _until(lambda: len(second.assigned_queues) == 2, 5)
        # at least once: what the failed commit did not store comes again
        await _until(lambda: {(q, o) for q, o in handled} >= {(0, 4), (1, 4)}, 5)
    assert {(q, o) for q, o in handled} == {(q, o) for q in (0, 1) for o in range(5)}
