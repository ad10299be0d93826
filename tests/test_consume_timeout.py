"""consume_timeout: a handler call running longer is timed out (cancelled, or abandoned
for a plain ``def`` handler), counted, and retried as the mode retries failures."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from trio.testing import MockClock

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeMessageContext,
    ConsumeMessageHook,
    ConsumeOrderlyContext,
    ConsumeReturnType,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    InvalidOptionError,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    PushConsumer,
)

pytestmark = pytest.mark.anyio

VIRTUAL = pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-virtual")


@pytest.fixture(params=["asyncio", "trio", VIRTUAL])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def broker_with(messages: int) -> MemoryBroker:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for i in range(messages):
        broker.send("t", str(i).encode(), queue_id=0)
    return broker


class Calls(ConsumeMessageHook):
    """Every handler call: offsets, start, end and status."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], float, float, ConsumeReturnType | None]] = []

    @property
    def hook_name(self) -> str:
        return "calls"

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        pass

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        offsets = [int(m.body) for m in context.messages]
        self.calls.append((offsets, context.start_time, context.end_time, context.status))


class Hangs:
    """Handler body: the first attempt on offset ``hang`` sleeps forever."""

    def __init__(self, hang: int, seconds: float = 0.01) -> None:
        self.hang = hang
        self.seconds = seconds
        self.done: list[int] = []
        self.running = 0
        self.overlap = False

    async def __call__(self, msgs: Sequence[Message]) -> None:
        self.running += 1
        try:
            # The body is the original offset: a concurrent retry comes from the
            # retry queue, with an offset of its own.
            if any(int(m.body) == self.hang and m.reconsume_times == 0 for m in msgs):
                await anyio.sleep_forever()
            await anyio.sleep(self.seconds)
            self.done.extend(int(m.body) for m in msgs)
        finally:
            self.running -= 1


class Concurrently(MessageListenerConcurrently):
    def __init__(self, body: Hangs) -> None:
        self.body = body

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        await self.body(msgs)


class Orderly(MessageListenerOrderly):
    def __init__(self, body: Hangs) -> None:
        self.body = body

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        await self.body(msgs)


class Staged(MessageListenerStagedConcurrently):
    def __init__(self, body: Hangs) -> None:
        self.body = body
        self.stage_of: dict[int, int] = {}

    def get_stage_definitions(self) -> list[int]:
        return [3, 3]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        for m in msgs:
            self.stage_of[int(m.body)] = context.stage_index
        await self.body(msgs)


def timeout_for(anyio_backend: Any) -> float:
    """Virtual time can afford a long timeout; on the wall clock keep the test short."""
    return 60.0 if isinstance(anyio_backend, tuple) else 0.3


@pytest.mark.parametrize("mode", ["orderly", "staged"])
async def test_a_hung_async_handler_is_cancelled_counted_and_retried(
    anyio_backend: Any, mode: str
) -> None:
    await hung_handler(anyio_backend, mode)


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_a_hung_concurrent_handler_is_retried_through_the_retry_queue(
    anyio_backend: Any,
) -> None:
    """Virtual time only: the retry queue's first delay is 10 s."""
    await hung_handler(anyio_backend, "concurrent")


async def hung_handler(anyio_backend: Any, mode: str) -> None:
    timeout = timeout_for(anyio_backend)
    body = Hangs(hang=1)
    listener: Any = {"concurrent": Concurrently, "orderly": Orderly, "staged": Staged}[mode](body)
    hook = Calls()
    consumer = PushConsumer(
        "g",
        broker_with(6),
        listener,
        options=ConsumerOptions(
            consume_timeout=timeout, suspend_current_queue_time_millis=10, consume_thread_max=4
        ),
    )
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=30 + 20 * timeout)
        with anyio.fail_after(60):  # concurrent: the retry comes through the retry queue
            while len(body.done) < 6:
                await anyio.sleep(0.5)
        stats = consumer.statistics()
    assert sorted(body.done) == list(range(6))
    assert body.running == 0  # the hung call was cancelled, not left behind
    assert stats.timed_out_calls == 1
    assert stats.abandoned_calls == 0
    timed_out = [call for call in hook.calls if call[3] is ConsumeReturnType.TIME_OUT]
    assert [call[0] for call in timed_out] == [[1]]
    _offsets, start, end, _status = timed_out[0]
    assert end - start >= timeout
    if isinstance(anyio_backend, tuple):  # virtual time: exact bounds
        assert end - start <= 1.1 * timeout
    successes = [call for call in hook.calls if call[3] is ConsumeReturnType.SUCCESS]
    if mode == "orderly":  # the queue waited for the retry: offsets in order
        assert [call[0][0] for call in successes] == list(range(6))
    if mode == "staged":  # stage 1 started only after the retried stage-0 message
        retry_end = next(end for offs, _s, end, _st in successes if offs == [1])
        stage1_starts = [s for offs, s, _e, _st in successes if listener.stage_of[offs[0]] == 1]
        assert stage1_starts
        assert min(stage1_starts) >= retry_end


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_calls_shorter_than_the_timeout_are_never_timed_out() -> None:
    body = Hangs(hang=-1, seconds=59.0)  # never hangs; each call 59 of 60 s
    hook = Calls()
    consumer = PushConsumer(
        "g",
        broker_with(5),
        Orderly(body),
        options=ConsumerOptions(consume_timeout=60.0),
    )
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    with anyio.fail_after(10_000):
        async with consumer:
            await consumer.wait_caught_up()
            stats = consumer.statistics()
    assert stats.timed_out_calls == 0
    assert [call[3] for call in hook.calls] == [ConsumeReturnType.SUCCESS] * 5


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_none_turns_the_timeout_off() -> None:
    body = Hangs(hang=-1, seconds=1_000.0)  # longer than the 900 s default
    # no loop watchdog: in virtual time it reports nothing, and its beat every 0.1 s
    # over 2,000 virtual seconds was nearly all of this test's time
    options = ConsumerOptions(consume_timeout=None, event_loop_block_threshold=None)
    consumer = PushConsumer("g", broker_with(2), Orderly(body), options=options)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up()
        stats = consumer.statistics()
    assert body.done == [0, 1]
    assert stats.timed_out_calls == 0


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_a_handler_that_swallows_the_cancellation_is_still_timed_out() -> None:
    """The handler catches the cancellation and returns normally: its result is ignored,
    the call counts as timed out and the message comes again."""
    attempts: list[int] = []

    class Stubborn(MessageListenerOrderly):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeOrderlyContext
        ) -> None:
            attempts.append(msgs[0].reconsume_times)
            if msgs[0].reconsume_times == 0:
                try:
                    await anyio.sleep_forever()
                except anyio.get_cancelled_exc_class():
                    return  # swallowed

    consumer = PushConsumer(
        "g", broker_with(1), Stubborn(), options=ConsumerOptions(consume_timeout=5.0)
    )
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up()
        stats = consumer.statistics()
    assert attempts == [0, 1]
    assert stats.timed_out_calls == 1
    assert stats.consumed_ok == 1


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_hung_sync_handler_is_abandoned_and_its_late_result_ignored() -> None:
    release = threading.Event()
    calls: list[tuple[int, int]] = []
    finished_late: list[int] = []

    class Blocking(MessageListenerOrderly):  # orderly: the retry comes at once, in place
        def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> None:
            m = msgs[0]
            calls.append((m.queue_offset, m.reconsume_times))
            if m.queue_offset == 0 and m.reconsume_times == 0:
                release.wait(30)
                finished_late.append(m.queue_offset)

    consumer = PushConsumer(
        "g",
        broker_with(3),
        Blocking(),
        options=ConsumerOptions(consume_timeout=0.3, suspend_current_queue_time_millis=10),
    )
    consumer.subscribe("t")
    try:
        async with consumer:
            await consumer.wait_caught_up(timeout=30)
            stats = consumer.statistics()
            release.set()
            await anyio.sleep(0.2)  # the abandoned call returns now, to nobody
            after = consumer.statistics()
    finally:
        release.set()
    assert sorted(offset for offset, _ in calls) == [0, 0, 1, 2]
    assert calls[:2] == [(0, 0), (0, 1)]  # offset 0 came again, before the others
    assert stats.timed_out_calls == 1
    assert finished_late == [0]
    assert after.consumed_ok == stats.consumed_ok == 3  # the late return counted nothing
    assert after.in_flight == 0


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "60", True])
def test_consume_timeout_must_be_a_positive_finite_number_or_none(value: object) -> None:
    with pytest.raises(InvalidOptionError, match="consume_timeout"):
        ConsumerOptions(consume_timeout=value)  # type: ignore[arg-type]


def test_the_default_is_rocketmqs_fifteen_minutes() -> None:
    assert ConsumerOptions().consume_timeout == 900.0
    assert ConsumerOptions(consume_timeout=None).consume_timeout is None
