"""A plain ``def`` handler never starts on a queue whose lease ended after its batch
was taken.

A worker takes a batch on the event loop (the lease is checked there) and hands the
call to a worker thread, which starts it a moment later. A pause of the whole
process in between (SIGSTOP, a long GC pause) used to let the call start after the
lease ended, when another member may own the queue
(``tests/redis/test_lease.py`` saw it once). The thread now checks the lease again
right before the call and gives the batch back uncalled.

The window is made deterministic here with one seam: the worker pool's
``ThreadRunner`` is replaced by a subclass that, on the event loop, ends the lease
(or loses the queue, as the membership does when a lease runs out) right before it
hands the first call to its thread, that is after the take and before the thread.
Everything else is the real consumer on the embedded broker, whose group
coordinator leases its queues.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest

from offsetstore import MemoryOffsetStore
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeMessageContext,
    ConsumeMessageHook,
    ConsumeOrderlyContext,
    ConsumeReturnType,
    ConsumeStagedConcurrentlyContext,
    LeaseEndedError,
    MemoryBroker,
    Message,
    MessageListener,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    MessageQueue,
    MessageQueueListener,
    PushConsumer,
)
from stagedconsumer._runtime import _workers
from stagedconsumer._runtime._threads import ThreadRunner

pytestmark = pytest.mark.anyio

COUNT = 3
QUEUE = MessageQueue("t", 0)


class Window:
    """Whether the lease is over (set by the seam, cleared once the queue is consumed
    here again), and every handler call as (offset, reconsume_times, in the window)."""

    def __init__(self) -> None:
        self.open = False
        self.calls: list[tuple[int, int, bool]] = []
        self._lock = threading.Lock()

    def record(self, msgs: Sequence[Message]) -> None:
        with self._lock:  # handler threads
            self.calls.extend((m.queue_offset, m.reconsume_times, self.open) for m in msgs)


class Concurrent(MessageListenerConcurrently):
    def __init__(self, window: Window) -> None:
        self.window = window

    def consume_message(self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext) -> None:
        self.window.record(msgs)


class Orderly(MessageListenerOrderly):
    def __init__(self, window: Window) -> None:
        self.window = window

    def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> None:
        self.window.record(msgs)


class Staged(MessageListenerStagedConcurrently):
    def __init__(self, window: Window) -> None:
        self.window = window

    def get_stage_definitions(self) -> Sequence[int]:
        return [1, 1]

    def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        self.window.record(msgs)


LISTENERS: dict[str, Callable[[Window], MessageListener]] = {
    "concurrent": Concurrent,
    "orderly": Orderly,
    "staged": Staged,
}


class Reassigned(MessageQueueListener):
    """Closes the window when :data:`QUEUE` is consumed here again (a new lease)."""

    def __init__(self, window: Window) -> None:
        self.window = window
        self.assigned = 0

    async def on_queues_assigned(self, queues: Sequence[MessageQueue]) -> None:
        if QUEUE in queues:  # not a retry queue (concurrent mode has them)
            self.assigned += 1
            self.window.open = False


class _EndsBeforeTheThread(ThreadRunner):
    """A ThreadRunner that calls ``end`` on the event loop right before it hands its
    first call to a thread, and sets ``returned`` when that call came back."""

    def __init__(self, limit: int, end: Callable[[], None], returned: anyio.Event) -> None:
        super().__init__(limit)
        self._end: Callable[[], None] | None = end
        self._returned = returned

    async def run_sync(self, func: Callable[..., Any], *args: Any) -> Any:
        end, self._end = self._end, None
        if end is None:
            return await super().run_sync(func, *args)
        end()
        try:
            return await super().run_sync(func, *args)
        finally:
            self._returned.set()


def _lease_ender(window: Window, consumer: PushConsumer) -> Callable[[], None]:
    """What the seam runs before the hand-off: every queue's lease ends now."""

    def end_the_lease() -> None:
        window.open = True
        for queue in consumer._queues:
            consumer._dispatcher.set_lease(queue.pq, anyio.current_time())

    return end_the_lease


def _seam(monkeypatch: pytest.MonkeyPatch, end: Callable[[], None]) -> anyio.Event:
    returned = anyio.Event()
    monkeypatch.setattr(
        _workers, "ThreadRunner", lambda limit: _EndsBeforeTheThread(limit, end, returned)
    )
    return returned


def _consumer(listener: MessageListener) -> PushConsumer:
    broker = MemoryBroker()  # coordinates its groups: queues are leased
    broker.create_topic("t", 1)
    for i in range(COUNT):
        broker.send("t", b"%d" % i)
    consumer = PushConsumer("g", broker, listener, offset_store=MemoryOffsetStore())
    consumer.subscribe("t")
    return consumer


EACH_ONCE = [(offset, 0, False) for offset in range(COUNT)]
"""Every message handled once, as a first attempt, outside the window."""


@pytest.mark.parametrize("kind", sorted(LISTENERS))
async def test_a_batch_whose_lease_ended_before_its_thread_started_goes_back_uncalled(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease ends between the take and the thread: the handler is not called,
    the batch is back in the queue as it was, and once the next rebalance round
    renews the lease every message is handled once, as a first attempt."""
    window = Window()
    consumer = _consumer(LISTENERS[kind](window))

    returned = _seam(monkeypatch, _lease_ender(window, consumer))
    async with consumer:
        with anyio.fail_after(5):
            await returned.wait()
        assert window.calls == [], "a handler started after its queue's lease ended"
        stats = consumer.statistics()
        queue = stats.queues[QUEUE]
        assert (queue.cached_count, queue.pending_count, queue.suspended_count) == (COUNT, 0, 0)
        assert queue.committed_offset == 0
        assert (stats.consumed_ok, stats.consumed_failed, stats.in_flight) == (0, 0, 0)
        window.open = False
        membership = consumer._membership
        assert membership is not None
        await membership._round()  # what the next round does: renew the lease
        with anyio.fail_after(5):
            await consumer.wait_caught_up()
        stats = consumer.statistics()
        assert (stats.consumed_ok, stats.consumed_failed, stats.in_flight) == (COUNT, 0, 0)
    assert sorted(window.calls) == EACH_ONCE


@pytest.mark.parametrize("kind", sorted(LISTENERS))
async def test_a_queue_lost_between_the_take_and_the_thread_is_drained_and_consumed_anew(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The membership finds the lease over between the take and the thread (as after
    a long pause) and releases the queue: the handler is not called on it, the
    release does not wait for a call that never starts, and the queue's next owner
    (this member, on its next round) handles every message once."""
    window = Window()
    consumer = _consumer(LISTENERS[kind](window))
    reassigned = Reassigned(window)
    consumer.register_message_queue_listener(reassigned)

    def lose_the_queue() -> None:
        window.open = True
        membership = consumer._membership
        assert membership is not None
        membership._on_lost(membership.ownership.expired(math.inf))

    returned = _seam(monkeypatch, lose_the_queue)
    async with consumer:
        with anyio.fail_after(5):  # well under shutdown_timeout, the release's drain bound
            await returned.wait()
            while reassigned.assigned < 2:
                await anyio.sleep(0.01)
            await consumer.wait_caught_up()
        assert consumer.statistics().abandoned_calls == 0
    assert [call for call in window.calls if call[2]] == [], (
        "a handler started on a queue after it was lost"
    )
    assert sorted(window.calls) == EACH_ONCE


class Recorder(ConsumeMessageHook):
    def __init__(self) -> None:
        self.before = 0
        self.after: list[ConsumeMessageContext] = []

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        self.before += 1

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        self.after.append(context)


async def test_hooks_see_a_call_given_back_end_with_lease_ended_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hooks saw the call begin (they run before the thread), so they see it end:
    with :class:`LeaseEndedError`, nothing settled; the batch is not counted as an
    attempt, and its messages come again as first attempts."""
    window = Window()
    consumer = _consumer(Staged(window))
    hook = Recorder()
    consumer.register_consume_message_hook(hook)

    returned = _seam(monkeypatch, _lease_ender(window, consumer))
    async with consumer:
        with anyio.fail_after(5):
            await returned.wait()
        assert window.calls == []
        assert hook.before == len(hook.after) == 1
        [given_back] = hook.after
        assert isinstance(given_back.exception, LeaseEndedError)
        assert given_back.status is ConsumeReturnType.EXCEPTION
        assert not given_back.success
        assert given_back.settled == {}
        assert [m.queue_offset for m in given_back.messages] == [0]
        window.open = False
        membership = consumer._membership
        assert membership is not None
        await membership._round()
        with anyio.fail_after(5):
            await consumer.wait_caught_up()
    assert sorted(window.calls) == EACH_ONCE
    assert hook.before == len(hook.after) == 1 + COUNT
    assert [c.attempt for c in hook.after[1:]] == [1] * COUNT
    assert all(c.success for c in hook.after[1:])
