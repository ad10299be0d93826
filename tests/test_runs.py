"""Runs: a worker calls a fast ``async def`` handler on one message after another of
the same batch and finishes them together (``consume_message_batch_max_size`` 1, no
hooks). A run must be invisible: nothing taken that another worker could run, the
earlier messages finished before a call waits, and a failure, a time-out or
``sys.exit()`` in the middle of a run settles that call's message alone."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from trio.testing import MockClock

from offsetstore import MemoryOffsetStore, ReadOffsetType
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PushConsumer,
)
from stagedconsumer._core import ProcessQueue

pytestmark = pytest.mark.anyio

VIRTUAL = pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-virtual")
MQ = MessageQueue("t", 0)


def broker_with(count: int) -> MemoryBroker:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for i in range(count):
        broker.send("t", b"%d" % i, queue_id=0)
    return broker


async def drain(consumer: PushConsumer, timeout: float = 20) -> None:
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=timeout)


def original_offset(message: Message) -> int:
    """The offset in ``t`` (a retried message's body holds it)."""
    return int(message.body)


async def test_fast_calls_run_back_to_back_on_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    added: list[int] = []
    take_more = ProcessQueue.take_more

    def spy(self: ProcessQueue, batch: Any, max_count: int, now: float = float("-inf")) -> int:
        got = take_more(self, batch, max_count, now)
        added.extend(m.queue_offset for m in batch.messages[len(batch.messages) - got :])
        return got

    monkeypatch.setattr(ProcessQueue, "take_more", spy)
    seen: list[int] = []

    class Fast(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            seen.extend(m.queue_offset for m in msgs)

    await drain(PushConsumer("g", broker_with(100), Fast()))
    assert sorted(seen) == list(range(100))
    assert len(added) >= 50  # most messages joined a run instead of a batch of their own


def spy_take_ahead(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record each take ahead as (the offset of its batch's first message, the most it
    may take)."""
    takes: list[tuple[int, int]] = []
    take_more = ProcessQueue.take_more

    def spy(self: ProcessQueue, batch: Any, max_count: int, now: float = float("-inf")) -> int:
        takes.append((batch.messages[0].queue_offset, max_count))
        return take_more(self, batch, max_count, now)

    monkeypatch.setattr(ProcessQueue, "take_more", spy)
    return takes


class StagesOf8(MessageListenerStagedConcurrently):
    def __init__(self, waits_at: int | None = None) -> None:
        self.seen: list[int] = []
        self.waits_at = waits_at

    def get_stage_definitions(self) -> Sequence[int]:
        return [8] * 16

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        self.seen.extend(m.queue_offset for m in msgs)
        if msgs[0].queue_offset == self.waits_at:
            await anyio.lowlevel.checkpoint()


async def test_the_take_ahead_goes_on_from_one_run_to_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each stage of 8 ends a run; the next run of the worker, whose calls never wait,
    # takes the rest of its stage in one step instead of 1, 2, 4 again.
    takes = spy_take_ahead(monkeypatch)
    listener = StagesOf8()
    options = ConsumerOptions(consume_thread_max=1)
    await drain(PushConsumer("g", broker_with(64), listener, options=options))
    assert sorted(listener.seen) == list(range(64))
    first_take: dict[int, int] = {}
    for first, most in takes:
        first_take.setdefault(first, most)
    later = [most for first, most in first_take.items() if first >= 16]
    assert later
    assert min(later) >= 4


async def test_the_take_ahead_starts_again_from_one_after_a_call_that_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Offset 19's call waits: the run of offsets 16-23 ends there, and the next run
    # (offset 20 on) takes ahead one message at first, as after a call that waited.
    takes = spy_take_ahead(monkeypatch)
    listener = StagesOf8(waits_at=19)
    options = ConsumerOptions(consume_thread_max=1)
    await drain(PushConsumer("g", broker_with(64), listener, options=options))
    assert sorted(listener.seen) == list(range(64))
    after = [most for first, most in takes if first == 20]
    assert after[:1] == [1]
    before = [most for first, most in takes if first == 8]
    assert before[:1] != [1]  # taken ahead several at once before the wait


async def test_a_run_lets_other_tasks_run_every_64_calls() -> None:
    # Calls that never wait run back to back; the worker still yields to the event
    # loop every 64 of them, so a run never holds the loop for a whole backlog.
    ticks = 0
    at_tick: Counter[int] = Counter()

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    class Fast(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            at_tick[ticks] += len(msgs)

    options = ConsumerOptions(consume_thread_max=1, pull_batch_size=500)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await drain(PushConsumer("g", broker_with(500), Fast(), options=options))
        tg.cancel_scope.cancel()
    assert sum(at_tick.values()) == 500
    # Runs of 64 calls, then the loop's turn. Trio picks the order of the tasks
    # ready in each of its batches at random, so the ticker may run before the
    # worker in one batch and after it in the next: two runs between two ticks.
    assert 64 <= max(at_tick.values()) <= 2 * 64


async def test_a_call_that_waits_leaves_the_next_message_to_another_worker() -> None:
    # Offset 1 waits for offset 2's call. Had the run of offsets 0 and 1 also taken
    # offset 2, nobody could call it: offset 1 would time out.
    released = anyio.Event()
    outcome: dict[int, str] = {}

    class Waits(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            offset = msgs[0].queue_offset
            if offset == 1:
                with anyio.move_on_after(5) as scope:
                    await released.wait()
                outcome[1] = "timed out" if scope.cancelled_caught else "released"
            elif offset == 2:
                released.set()

    options = ConsumerOptions(consume_thread_max=2)
    await drain(PushConsumer("g", broker_with(4), Waits(), options=options))
    assert outcome == {1: "released"}


@pytest.mark.parametrize(("waiter", "awaited"), [(4, 5), (4, 7), (9, 12), (20, 27)])
async def test_a_call_that_waits_gives_back_what_its_run_took_ahead(
    waiter: int, awaited: int
) -> None:
    # A run takes messages ahead of its calls (1, 2, 4, ... at a time). The call on
    # ``waiter`` waits for the call on ``awaited``, which its run may have taken ahead:
    # had that not gone back to the queue as the call began to wait, nobody could
    # call it and the waiting call would time out.
    released = anyio.Event()
    outcome: dict[int, str] = {}
    seen: Counter[int] = Counter()

    class Waits(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            offset = msgs[0].queue_offset
            seen[offset] += 1
            if offset == waiter:
                with anyio.move_on_after(5) as scope:
                    await released.wait()
                outcome[waiter] = "timed out" if scope.cancelled_caught else "released"
            elif offset == awaited:
                released.set()

    options = ConsumerOptions(consume_thread_max=2)
    await drain(PushConsumer("g", broker_with(40), Waits(), options=options))
    assert outcome == {waiter: "released"}
    assert seen == Counter(range(40))  # every message called once


async def test_earlier_messages_of_a_run_are_finished_before_a_call_waits() -> None:
    committed: dict[int, int] = {}

    class Checks(MessageListenerOrderly):
        def __init__(self) -> None:
            self.consumer: PushConsumer | None = None

        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeOrderlyContext
        ) -> ConsumeOrderlyStatus:
            offset = msgs[0].queue_offset
            if offset % 3 == 2:  # every third call waits, the others do not
                await anyio.lowlevel.checkpoint()
                assert self.consumer is not None
                stats = self.consumer.statistics().queues[MQ]
                committed[offset] = stats.committed_offset
            return ConsumeOrderlyStatus.SUCCESS

    listener = Checks()
    consumer = PushConsumer("g", broker_with(9), listener)
    listener.consumer = consumer
    await drain(consumer)
    # one queue, in order: everything before the waiting call is finished
    assert committed == {2: 2, 5: 5, 8: 8}


@pytest.mark.slow
async def test_a_failure_in_a_run_retries_that_message_alone() -> None:
    calls: Counter[int] = Counter()

    class FailsOnce(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            (message,) = msgs
            calls[original_offset(message)] += 1
            if original_offset(message) == 3 and message.reconsume_times == 0:
                context.delay_level_when_next_consume = 1  # retried after 1 s
                raise RuntimeError("offset 3 fails once")

    options = ConsumerOptions(consume_thread_max=1)
    store = MemoryOffsetStore()
    consumer = PushConsumer("g", broker_with(6), FailsOnce(), options=options, offset_store=store)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=20)
        with anyio.fail_after(20):
            while calls[3] < 2:
                await anyio.sleep(0.01)
    assert calls == {0: 1, 1: 1, 2: 1, 3: 2, 4: 1, 5: 1}
    assert await store.read_offset("g", MQ, ReadOffsetType.READ_FROM_STORE) == 6


async def test_an_orderly_failure_in_a_run_suspends_from_that_message() -> None:
    calls: list[int] = []

    class SuspendsOnce(MessageListenerOrderly):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeOrderlyContext
        ) -> ConsumeOrderlyStatus:
            (message,) = msgs
            calls.append(message.queue_offset)
            if message.queue_offset == 2 and message.reconsume_times == 0:
                context.suspend_current_queue_time_millis = 10
                return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
            return ConsumeOrderlyStatus.SUCCESS

    await drain(PushConsumer("g", broker_with(5), SuspendsOnce()))
    assert calls == [0, 1, 2, 2, 3, 4]


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_a_time_out_in_a_run_retries_that_message_alone() -> None:
    calls: list[tuple[int, int]] = []

    class Slow(MessageListenerOrderly):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeOrderlyContext
        ) -> ConsumeOrderlyStatus:
            (message,) = msgs
            calls.append((message.queue_offset, message.reconsume_times))
            if message.queue_offset == 1 and message.reconsume_times == 0:
                await anyio.sleep(100)  # past consume_timeout
            return ConsumeOrderlyStatus.SUCCESS

    options = ConsumerOptions(consume_timeout=5)
    await drain(PushConsumer("g", broker_with(3), Slow(), options=options), timeout=60)
    assert calls == [(0, 0), (1, 0), (1, 1), (2, 0)]


async def test_sys_exit_in_a_run_commits_the_calls_before_it() -> None:
    store = MemoryOffsetStore()

    class Exits(MessageListenerOrderly):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeOrderlyContext
        ) -> ConsumeOrderlyStatus:
            if msgs[0].queue_offset == 2:
                sys.exit(3)
            return ConsumeOrderlyStatus.SUCCESS

    consumer = PushConsumer("g", broker_with(4), Exits(), offset_store=store)
    consumer.subscribe("t")
    with pytest.raises(SystemExit):
        async with consumer:
            await anyio.sleep(10)
    assert await store.read_offset("g", MQ, ReadOffsetType.READ_FROM_STORE) == 2


class _Stop(BaseException):
    """Not an ``Exception``: as a cancellation or ``KeyboardInterrupt``, it is no
    handler failure and goes through the consumer."""


async def test_calls_of_a_run_stay_finished_when_the_next_one_raises_a_base_exception() -> None:
    # A BaseException in a call's first step ends the consumer; offsets 0 and 1, whose
    # calls succeeded in the same run, are finished and committed on the way out.
    store = MemoryOffsetStore()

    class Stops(MessageListenerOrderly):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeOrderlyContext
        ) -> ConsumeOrderlyStatus:
            if msgs[0].queue_offset == 2:
                raise _Stop
            return ConsumeOrderlyStatus.SUCCESS

    consumer = PushConsumer("g", broker_with(4), Stops(), offset_store=store)
    consumer.subscribe("t")
    with pytest.raises(BaseException) as info:  # noqa: PT011 - checked below
        async with consumer:
            await anyio.sleep(10)
    stopped = info.value
    if isinstance(stopped, BaseExceptionGroup):
        assert stopped.subgroup(_Stop) is not None
    else:
        assert isinstance(stopped, _Stop)
    assert await store.read_offset("g", MQ, ReadOffsetType.READ_FROM_STORE) == 2
