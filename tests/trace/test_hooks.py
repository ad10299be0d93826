"""ConsumeMessageHook: what hooks see, and that a failing hook never stops consumption."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    ConsumerStateError,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerStagedConcurrently,
    PushConsumer,
)
from stagedconsumer._observability._hooks import (
    ConsumeMessageContext,
    ConsumeMessageHook,
    ConsumeReturnType,
    PullContext,
    SettleOutcome,
)

pytestmark = pytest.mark.anyio


class Recorder(ConsumeMessageHook):
    def __init__(self) -> None:
        self.before: list[ConsumeMessageContext] = []
        self.after: list[ConsumeMessageContext] = []
        self.pulls: list[PullContext] = []

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        assert context.end_time == 0.0
        assert context.status is None
        self.before.append(context)

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        self.after.append(context)

    def messages_pulled(self, context: PullContext) -> None:
        self.pulls.append(context)


class Raising(ConsumeMessageHook):
    def __init__(self) -> None:
        self.calls = 0

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        self.calls += 1
        raise RuntimeError("hook bug")

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        raise RuntimeError("hook bug")


class Staged(MessageListenerStagedConcurrently):
    def __init__(self, sizes: Sequence[int], cost: float = 0.0, fail_once: bytes = b"") -> None:
        self.sizes = list(sizes)
        self.cost = cost
        self.fail_once = fail_once
        self.consumed: list[bytes] = []

    def get_stage_definitions(self) -> Sequence[int]:
        return self.sizes

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        await anyio.sleep(self.cost)
        for m in msgs:
            if m.body == self.fail_once and m.reconsume_times == 0:
                raise ValueError("first attempt fails")
        self.consumed.extend(m.body for m in msgs)


class Failing(MessageListenerConcurrently):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        raise ValueError("always")


def broker_with(n: int, topic: str = "t") -> MemoryBroker:
    broker = MemoryBroker()
    broker.create_topic(topic, 1)
    for i in range(n):
        broker.send(topic, str(i).encode(), keys=[f"k{i}"])
    return broker


async def test_hook_sees_stage_attempt_timings_and_settlement() -> None:
    broker = broker_with(5)
    listener = Staged([2, 2], cost=0.02, fail_once=b"2")
    consumer = PushConsumer(
        "g", broker, listener, options=ConsumerOptions(suspend_current_queue_time_millis=10)
    )
    consumer.subscribe("t")
    hook = Recorder()
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert sorted(listener.consumed) == [str(i).encode() for i in range(5)]
    assert len(hook.before) == len(hook.after) == 6  # five messages, one retried
    assert sum(len(p.messages) for p in hook.pulls) == 5
    by_body: dict[bytes, list[ConsumeMessageContext]] = {}
    for ctx in hook.after:
        assert ctx.consumer_group == "g"
        assert ctx.mode == "staged"
        assert ctx.start_time <= ctx.end_time
        assert all(cached <= ctx.start_time for cached in ctx.cached_times)
        by_body.setdefault(ctx.messages[0].body, []).append(ctx)
    assert [c.stage_index for b in (b"0", b"1", b"2", b"3", b"4") for c in by_body[b][:1]] == [
        0,
        0,
        1,
        1,
        -1,
    ]
    failed, retried = by_body[b"2"]
    assert (failed.attempt, failed.success, failed.status) == (
        1,
        False,
        ConsumeReturnType.EXCEPTION,
    )
    assert isinstance(failed.exception, ValueError)
    assert list(failed.settled) == [SettleOutcome.SUSPEND]
    assert (retried.attempt, retried.success, retried.status) == (
        2,
        True,
        ConsumeReturnType.SUCCESS,
    )
    # Stage 1 waited for stage 0 (two 20 ms handlers) behind its barrier, the tail
    # stage waited for stage 1 and its 10 ms retry delay.
    assert by_body[b"0"][0].barrier_waits() == [0.0]
    assert by_body[b"2"][0].barrier_waits()[0] >= 0.015
    assert by_body[b"4"][0].barrier_waits()[0] >= by_body[b"2"][0].barrier_waits()[0] + 0.03


async def test_dead_letter_settlement_is_reported() -> None:
    broker = broker_with(2)
    consumer = PushConsumer("g", broker, Failing(), options=ConsumerOptions(max_reconsume_times=0))
    consumer.subscribe("t")
    hook = Recorder()
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert len(hook.after) == 2
    for ctx in hook.after:
        assert ctx.status is ConsumeReturnType.EXCEPTION
        assert ctx.settled == {SettleOutcome.DLQ: list(ctx.messages)}
    assert len(broker.messages("%DLQ%g")) == 2


async def test_raising_hook_is_logged_once_and_never_stops_consumption(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = broker_with(20)
    listener = Staged([5])
    consumer = PushConsumer("g", broker, listener)
    consumer.subscribe("t")
    raising, recorder = Raising(), Recorder()
    consumer.register_consume_message_hook(raising)
    consumer.register_consume_message_hook(recorder)  # later hooks still run
    with caplog.at_level(logging.ERROR, logger="stagedconsumer.hooks"):
        async with consumer:
            await consumer.wait_caught_up(timeout=10)
    assert len(listener.consumed) == 20
    assert raising.calls == 20
    assert len(recorder.after) == 20
    assert consumer.statistics().hook_errors == 40
    hook_logs = [r for r in caplog.records if r.name == "stagedconsumer.hooks"]
    # Rate limited: one record per hook method in 10 s.
    assert len(hook_logs) == 2
    assert "consume_message_before" in hook_logs[0].getMessage()


async def test_registration_rules() -> None:
    consumer = PushConsumer("g", broker_with(1), Staged([1]))
    consumer.subscribe("t")
    with pytest.raises(ConfigurationError):
        consumer.register_consume_message_hook(object())  # type: ignore[arg-type]
    async with consumer:
        with pytest.raises(ConsumerStateError):
            consumer.register_consume_message_hook(Recorder())
    assert consumer.statistics().hook_errors == 0


def test_consumer_constructor_of_the_context_sets_every_field_as_attrs_init() -> None:
    import attrs

    from stagedconsumer import MessageQueue

    mq = MessageQueue("t", 3)
    args: tuple[Any, ...] = ("g", mq, [], "staged", 2, "s", "k", 3, [1.0], 2.0, 5.0, 100.0)
    names = [
        "consumer_group",
        "message_queue",
        "messages",
        "mode",
        "stage_index",
        "strategy_id",
        "group_id",
        "attempt",
        "cached_times",
        "runnable_at",
        "start_time",
        "wall_offset",
    ]
    fast = ConsumeMessageContext._of_call(*args)
    slow = ConsumeMessageContext(**dict(zip(names, args, strict=True)))
    assert attrs.asdict(fast, recurse=False) == attrs.asdict(slow, recurse=False)
    assert [f.name for f in attrs.fields(ConsumeMessageContext)] == [
        *names,
        "end_time",
        "success",
        "status",
        "exception",
        "result",
        "settled",
        "props",
    ]
    assert fast.settled is not ConsumeMessageContext._of_call(*args).settled  # fresh dicts
