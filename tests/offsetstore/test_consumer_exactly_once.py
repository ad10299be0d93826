"""The consumer with sparse progress and transactions, on every store: a restart skips
the messages recorded finished (counted in statistics), and ``transact`` /
``transact_blocking`` commit a call's effects with its messages' marks."""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from offsetstore import QueueProgress, StageKey
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PushConsumer,
)

from .conftest import Backend

pytestmark = pytest.mark.anyio

MQ = MessageQueue("t", 0)


class Staged(MessageListenerStagedConcurrently):
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def get_stage_definitions(self) -> Sequence[int]:
        return [3, 3]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        self.calls.extend((m.queue_offset, context.stage_index) for m in msgs)


async def test_a_restart_skips_the_recorded_finished_messages(backend: Backend) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for _ in range(10):
        broker.send("t", b"x", queue_id=0)
    store = backend.new_store()
    async with store:
        # Progress as a consumer left it: offsets 2..4 and 7 finished above 1.
        store.update_progress(
            "g",
            MQ,
            QueueProgress(
                consume_offset=1,
                stage_offsets={StageKey("default"): 1},
                finished=[(2, 4), (7, 7)],
            ),
        )
        await store.persist_all("g", [MQ])
        listener = Staged()
        consumer = PushConsumer("g", broker, listener, offset_store=store)
        consumer.subscribe("t")
        async with consumer:
            await consumer.wait_caught_up()
            stats = consumer.statistics()
        # Stage offsets 1..10 from offset 1: 1 and 2 in stage 0, 3..5 in stage 1, the
        # tail (-1) from 6 on; the skipped messages count in their stages.
        assert listener.calls == [(1, 0), (5, 1), (6, -1), (8, -1), (9, -1)]
        assert stats.skipped_finished == 4
        assert stats.queues[MQ].committed_offset == 10
        stored = await store.list_progress("g")
        assert stored[MQ] == QueueProgress(
            consume_offset=10, stage_offsets={StageKey("default"): 10}
        )


class Blocking(MessageListenerConcurrently):
    """A plain ``def`` handler: its transaction from a worker thread."""

    def __init__(self) -> None:
        self.effects: list[int] = []
        self.threads: set[int] = set()

    def consume_message(self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext) -> None:
        def write(connection: Any) -> None:
            self.threads.add(threading.get_ident())
            self.effects.extend(m.queue_offset for m in msgs)

        context.transact_blocking(write)


async def test_plain_def_handlers_transact_from_their_threads() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for _ in range(20):
        broker.send("t", b"x", queue_id=0)
    listener = Blocking()
    consumer = PushConsumer("g", broker, listener)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up()
        stats = consumer.statistics()
    assert sorted(listener.effects) == list(range(20))
    assert collections.Counter(listener.effects).most_common(1)[0][1] == 1
    assert stats.transactions == 20
    assert threading.get_ident() in listener.threads  # MemoryOffsetStore: on the loop


async def test_transact_outside_a_handler_call_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="context a consumer passes"):
        await ConsumeConcurrentlyContext(message_queue=MQ).transact(lambda connection: None)


class FailsOnceBeforeTransact(MessageListenerConcurrently):
    """Fails its first call on offset 1 before transacting; writes an effect per
    message otherwise (in the store's transaction)."""

    def __init__(self) -> None:
        self.effects: list[int] = []
        self.failed = False

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        if any(m.queue_offset == 1 for m in msgs) and not self.failed:
            self.failed = True
            raise RuntimeError("failed before its transaction")
        await context.transact(lambda connection: self.effects.extend(m.queue_offset for m in msgs))


async def test_a_concurrent_listener_retried_in_place_commits_each_effect_once(
    backend: Backend,
) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for _ in range(5):
        broker.send("t", b"x", queue_id=0)
    listener = FailsOnceBeforeTransact()
    options = ConsumerOptions(retry_in_place=True, suspend_current_queue_time_millis=10)
    async with backend.new_store() as store:
        consumer = PushConsumer("g", broker, listener, offset_store=store, options=options)
        consumer.subscribe("t")
        async with consumer:
            await consumer.wait_caught_up()
            stats = consumer.statistics()
        assert listener.failed
        assert sorted(listener.effects) == list(range(5))  # offset 1 once, in place
        assert stats.sent_back == 0
        assert stats.transactions == 5
        assert (await store.list_progress("g"))[MQ].consume_offset == 5
