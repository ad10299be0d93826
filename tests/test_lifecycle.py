"""How a consumer fails and stops: stage callbacks that fail, exceptions out of
``async with``, handlers that do not return, Ctrl-C."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest
from trio.testing import MockClock

from offsetstore import MemoryOffsetStore
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

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[1]
VIRTUAL = pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-virtual")


def broker_with(per_queue: int, queues: int = 2) -> MemoryBroker:
    broker = MemoryBroker()
    broker.create_topic("t", queues)
    for q in range(queues):
        for i in range(per_queue):
            broker.send("t", f"{q}-{i}".encode(), queue_id=q)
    return broker


class FaultyStages(MessageListenerStagedConcurrently):
    """Stage size 2 per group; the stage callbacks misbehave on chosen messages for
    their first ``failures`` calls."""

    def __init__(self, bad: set[bytes], failures: int, how: str) -> None:
        self.bad = bad
        self.failures = failures
        self.how = how
        self.calls = 0
        self.started: list[tuple[int, int, float]] = []

    def get_stage_definitions(self) -> Sequence[int]:
        return [2, 2]

    def _misbehave(self, msg: Message) -> bool:
        if msg.body in self.bad and self.calls < self.failures:
            self.calls += 1
            return True
        return False

    def compute_strategy(self, msg: Message) -> Any:
        if self.how == "strategy type" and self._misbehave(msg):
            return 5  # not a str
        if self.how == "strategy unknown" and self._misbehave(msg):
            return "defualt"  # a typo: no such strategy
        return "default"

    def compute_group(self, msg: Message) -> Any:
        if self.how == "group raises" and self._misbehave(msg):
            raise KeyError("no campaign for this message")
        return "g"

    def reset_current_stage_offset_if_need(self, topic: str, current: int) -> int:
        return current

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        for m in msgs:
            self.started.append((m.queue_id, m.queue_offset, anyio.current_time()))
        await anyio.sleep(0.001)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio", VIRTUAL], indirect=True)
@pytest.mark.parametrize("how", ["group raises", "strategy type", "strategy unknown"])
async def test_a_failing_stage_callback_stops_its_queue_at_the_message_and_retries(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    broker = broker_with(6)
    bad = broker.messages("t", 0)[2]  # queue 0, offset 2
    listener = FaultyStages({bad.body}, failures=2, how=how)
    options = ConsumerOptions(suspend_current_queue_time_millis=200)
    consumer = PushConsumer("g", broker, listener, options=options)
    consumer.subscribe("t")
    with caplog.at_level(logging.ERROR, logger="stagedconsumer"):
        start = anyio.current_time()  # before the first pull
        async with consumer:
            await consumer.wait_caught_up(timeout=20)
            stats = consumer.statistics()
    assert stats.assignment_errors == 2
    assert stats.consumed_ok == 12  # nothing lost, nothing dropped
    assert sorted((q, o) for q, o, _ in listener.started) == [
        (q, o) for q in range(2) for o in range(6)
    ]
    # Queue 0 stopped at offset 2 until the assignment succeeded, at the earliest two
    # retry delays later; what came before it, and the other queue, went on meanwhile.
    first_of = {(q, o): t for q, o, t in reversed(listener.started)}
    resumed = min(first_of[(0, o)] for o in range(2, 6))
    assert resumed - start >= 0.4 - 1e-9  # (the virtual clock's float sums)
    assert max(t for (q, _), t in first_of.items() if q == 1) < resumed
    assert max(first_of[(0, o)] for o in (0, 1)) < resumed
    assert stats.queues[MessageQueue("t", 0)].held_count == 0
    logged = [r for r in caplog.records if bad.msg_id in r.getMessage()]
    assert len(logged) == 2
    assert ("compute_group" if how == "group raises" else "compute_strategy") in (
        logged[0].getMessage()
    )


@pytest.mark.parametrize("anyio_backend", [VIRTUAL], indirect=True)
async def test_an_unknown_strategy_id_holds_its_queue_instead_of_dropping_its_stage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = broker_with(6)
    bad = broker.messages("t", 0)[2]  # queue 0, offset 2
    listener = FaultyStages({bad.body}, failures=1_000_000, how="strategy unknown")
    store = MemoryOffsetStore()
    options = ConsumerOptions(suspend_current_queue_time_millis=200)
    consumer = PushConsumer("g", broker, listener, offset_store=store, options=options)
    consumer.subscribe("t")
    with caplog.at_level(logging.ERROR, logger="stagedconsumer"):
        async with consumer:
            await anyio.sleep(1.1)  # virtual time: every handler call, and 5 retries
            stats = consumer.statistics()
    # nothing of queue 0 from the typo on ran (before: offsets 2..5 ran with no stage)
    assert sorted((q, o) for q, o, _ in listener.started) == [(0, 0), (0, 1)] + [
        (1, o) for o in range(6)
    ]
    held = stats.queues[MessageQueue("t", 0)]
    assert held.held_count == 4
    assert held.committed_offset == 2
    assert await store.read_offset("g", MessageQueue("t", 0)) == 2  # never past it
    assert stats.assignment_errors == 6  # the first assignment and 5 retries
    logged = [r.getMessage() for r in caplog.records if bad.msg_id in r.getMessage()]
    assert len(logged) == 6
    assert (
        "compute_strategy() returned str 'defualt'; expected a strategy id of the stage"
        " definitions ('default') or None (no stage)"
    ) in logged[0]


class Slow(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.release = anyio.Event()

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        await self.release.wait()


async def test_an_exception_inside_async_with_comes_out_as_itself() -> None:
    broker = broker_with(1, queues=1)
    consumer = PushConsumer("g", broker, Slow(), options=ConsumerOptions(shutdown_timeout=0.1))
    consumer.subscribe("t")
    with pytest.raises(TimeoutError):
        async with consumer:
            await consumer.wait_caught_up(timeout=0.05)
    consumer = PushConsumer("g", broker_with(1, 1), Concurrently())
    consumer.subscribe("t")
    with pytest.raises(ValueError, match="mine"):
        async with consumer:
            raise ValueError("mine")


class Concurrently(MessageListenerConcurrently):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        return None


class BlockingSync(MessageListenerConcurrently):
    """A plain ``def`` handler stuck in blocking code until the test lets it go."""

    def __init__(self) -> None:
        self.running = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    def consume_message(self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext) -> None:
        self.running.set()
        self.release.wait(30)
        self.returned.set()


async def test_leaving_async_with_abandons_a_sync_handler_after_shutdown_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = broker_with(3, queues=1)
    store = MemoryOffsetStore()
    listener = BlockingSync()
    options = ConsumerOptions(shutdown_timeout=0.3, consume_thread_max=1)
    consumer = PushConsumer("g", broker, listener, offset_store=store, options=options)
    consumer.subscribe("t")
    try:
        with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
            async with consumer:
                await anyio.to_thread.run_sync(listener.running.wait, 10)
                left = anyio.current_time()
            took = anyio.current_time() - left
        stats = consumer.statistics()
        # Left while the handler still ran (it returns only when released, or after
        # 30 s): leaving did not wait for it. The bound is generous (a loaded machine).
        assert not listener.returned.is_set()
        assert took < 20, f"leaving took {took:.2f} s"
        assert stats.abandoned_calls == 1
        assert stats.consumed_ok == 0  # not counted as consumed
        assert await store.read_offset("g", MessageQueue("t", 0)) == 0  # not committed
        assert any(
            "abandoned" in r.getMessage() and "delivered again" in r.getMessage()
            for r in caplog.records
        )
    finally:
        listener.release.set()


class CallsBack(MessageListenerConcurrently):
    """A plain ``def`` handler that calls into the event loop, as blocking code does to
    send a message on the embedded broker."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.broker = broker

    def consume_message(self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext) -> None:
        for m in msgs:
            if m.topic == "t":
                anyio.from_thread.run_sync(self.broker.send, "out", m.body)


async def test_a_sync_handler_can_call_back_into_the_event_loop() -> None:
    broker = broker_with(5, queues=1)
    broker.create_topic("out", 1)
    consumer = PushConsumer("g", broker, CallsBack(broker))
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert sorted(m.body for m in broker.messages("out")) == [f"0-{i}".encode() for i in range(5)]


def _start_worker(backend: str, shutdown_timeout: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sigint_worker", backend, str(shutdown_timeout), "60"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_with_a_stuck_sync_handler_ends_the_process(backend: str, presses: int) -> None:
    """One Ctrl-C: the consumer drains for shutdown_timeout, abandons the handler and the
    process exits; a second Ctrl-C stops it at once, well before shutdown_timeout.
    (The handler sleeps 60 s: the old code waited for it.)"""
    timeout = 2.0 if presses == 1 else 5.0
    proc = _start_worker(backend, timeout)
    try:
        pressed = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if presses == 2:
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        took = time.monotonic() - pressed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "KeyboardInterrupt" in err
    if presses == 1:
        assert "left abandoned=1" in out
        assert timeout <= took < timeout + 4.0, f"exited {took:.2f} s after Ctrl-C"
    else:
        assert took < timeout - 1.0, f"exited {took:.2f} s after the second Ctrl-C"
