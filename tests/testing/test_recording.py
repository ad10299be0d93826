"""RecordingListener: records every call and changes nothing the consumer sees."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Sequence

import anyio
import pytest

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    ListenerTypeError,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    Ordering,
)
from stagedconsumer.testing import (
    CallLog,
    MessageSpec,
    Outcome,
    RecordingListener,
    assert_at_least_once,
    run_virtual,
)


class Plain(MessageListenerStagedConcurrently):
    """Overrides nothing but the two required methods."""

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        return None

    def get_stage_definitions(self) -> Sequence[int]:
        return [2, 3]


class Keyed(Plain):
    def compute_group(self, msg: Message) -> str | None:
        return msg.keys[0] if msg.keys else None


class Failing(MessageListenerStagedConcurrently):
    """Fails each message's first attempt: offset 0 raises, offset 1 returns the
    failure status (setting its suspend time), the rest are cancelled by a short
    consume timeout the first time."""

    def get_stage_definitions(self) -> Sequence[int]:
        return [1]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> ConsumeOrderlyStatus | None:
        m = msgs[0]
        if m.reconsume_times == 0:
            if m.queue_offset == 0:
                raise ValueError("boom")
            if m.queue_offset == 1:
                context.suspend_current_queue_time_millis = 20_000
                return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
            await anyio.sleep(100)
        return None


def specs(n: int, *, queue: int = 0, keys: Sequence[str] = ()) -> list[MessageSpec]:
    return [
        MessageSpec(topic="t", queue_id=queue, keys=(keys[i % len(keys)],) if keys else ())
        for i in range(n)
    ]


def test_a_recorder_is_a_listener_of_the_same_kind() -> None:
    class Orderly(MessageListenerOrderly):
        ordering = Ordering.BY_KEY

        def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> None:
            return None

    class Concurrent(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            return None

    staged = RecordingListener(Plain())
    assert isinstance(staged, MessageListenerStagedConcurrently)
    assert isinstance(staged, RecordingListener)
    assert inspect.iscoroutinefunction(staged.consume_message)
    orderly = RecordingListener(Orderly())
    assert isinstance(orderly, MessageListenerOrderly)
    assert orderly.ordering is Ordering.BY_KEY
    assert not inspect.iscoroutinefunction(orderly.consume_message)
    assert isinstance(RecordingListener(Concurrent()), MessageListenerConcurrently)
    with pytest.raises(TypeError, match="listener instance"):
        RecordingListener(Plain)  # type: ignore[arg-type]


def test_a_listener_of_the_wrong_shape_is_refused_before_it_is_wrapped() -> None:
    # The consumer sees only the wrapper, whose methods take (*args): the recorder and
    # run_virtual check the listener itself, as PushConsumer does.
    class NoContext(MessageListenerConcurrently):
        async def consume_message(self, msgs: Sequence[Message]) -> None:  # type: ignore[override]
            return None

    fragment = r"NoContext\.consume_message\(self, msgs\) cannot be called as"
    with pytest.raises(ListenerTypeError, match=fragment):
        RecordingListener(NoContext())
    with pytest.raises(ListenerTypeError, match=fragment):
        run_virtual(NoContext(), [MessageSpec(topic="t", body=b"x", queue_id=0)])


def test_only_the_callbacks_the_listener_overrides_are_forwarded() -> None:
    base = MessageListenerStagedConcurrently
    plain = RecordingListener(Plain())
    assert type(plain).compute_group is base.compute_group  # type: ignore[attr-defined]
    assert type(plain).compute_strategy is base.compute_strategy  # type: ignore[attr-defined]
    keyed = RecordingListener(Keyed())
    assert type(keyed).compute_group is not base.compute_group  # type: ignore[attr-defined]
    message = Message(topic="t", queue_id=0, queue_offset=0, body=b"", keys=("k",))
    assert keyed.compute_group(message) == "k"  # type: ignore[attr-defined]
    assert keyed.get_stage_definitions() == [2, 3]  # type: ignore[attr-defined]


class TwoStrategies(Plain):
    def get_stage_definition_strategies(self) -> dict[str, Sequence[int]]:
        return {"default": [1], "vip": [2, 2]}


def test_the_stage_definitions_the_consumer_reads_are_recorded_per_run() -> None:
    run = run_virtual(Plain(), specs(6), costs=[1.0], crash_at=[1])
    assert run.crashes == 1
    assert run.log.stage_definitions == [(0, {"default": (2, 3)}), (1, {"default": (2, 3)})]
    strategies = RecordingListener(TwoStrategies())
    assert strategies.get_stage_definition_strategies() == {"default": [1], "vip": [2, 2]}  # type: ignore[attr-defined]
    assert strategies.log.stage_definitions == [(0, {"default": (1,), "vip": (2, 2)})]


def test_every_call_is_recorded_with_its_stage_key_and_times() -> None:
    log = CallLog()
    listener = RecordingListener(Keyed(), log)
    run = run_virtual(listener, specs(7, keys=["a", "b"]), costs=[1.0])
    assert run.log is log
    assert len(log.calls) == 7
    assert [c.number for c in log.calls] == list(range(7))
    for call in log.calls:
        (message,) = call.messages
        assert call.queue.topic == "t"
        assert call.group_id == message.keys[0]
        assert call.strategy_id == "default"
        assert call.attempt == 1
        assert call.outcome is Outcome.SUCCESS
        assert call.acked == 1
        assert call.end - call.start == 1.0
        assert call.start_seq < call.end_seq
    # group a holds offsets 0, 2, 4, 6: stages 0, 0, 1, 1; group b: 1, 3, 5 -> 0, 0, 1
    stages = {c.messages[0].queue_offset: c.stage_index for c in log.calls}
    assert stages == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1}
    assert run.makespan == 2.0


def test_failures_and_cancellations_are_recorded_and_pass_through() -> None:
    options = ConsumerOptions(consume_timeout=5.0)
    run = run_virtual(Failing(), specs(3), options=options)
    assert run.completed
    calls = {(c.messages[0].queue_offset, c.attempt): c for c in run.log.calls}
    assert calls[0, 1].outcome is Outcome.RAISED
    assert calls[0, 1].error == "ValueError('boom')"
    assert calls[1, 1].outcome is Outcome.RETURNED_FAILURE
    assert calls[2, 1].outcome is Outcome.CANCELLED  # timed out by consume_timeout
    assert all(calls[o, 2].outcome is Outcome.SUCCESS for o in range(3))
    # the handler's suspend time reached the consumer: 20 s before the retry
    assert calls[1, 2].start - calls[1, 1].end == pytest.approx(20.0)
    # the raising one was retried after the default 1 s
    assert calls[0, 2].start - calls[0, 1].end == pytest.approx(1.0)
    assert not any(c.finished_messages for c in run.log.calls if not c.succeeded)


def test_concurrent_ack_index_and_reconsume_later() -> None:
    class Partial(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> ConsumeConcurrentlyStatus | None:
            if msgs[0].reconsume_times == 0 and len(msgs) > 1:
                context.ack_index = 0
            if msgs[0].reconsume_times == 0 and any(m.queue_offset == 3 for m in msgs):
                return ConsumeConcurrentlyStatus.RECONSUME_LATER
            return None

    options = ConsumerOptions(consume_message_batch_max_size=2, consume_thread_max=1)
    run = run_virtual(Partial(), specs(4), options=options)
    assert run.completed
    first = run.log.calls[0]
    assert len(first.messages) == 2
    assert first.acked == 1
    assert [m.queue_offset for m in first.finished_messages] == [0]
    failed = [c for c in run.log.calls if c.outcome is Outcome.RETURNED_FAILURE]
    assert [c.offsets for c in failed] == [(2, 3)]
    assert all(c.acked == 0 for c in failed)
    # the messages sent back came back (from the retry queue) and finished
    assert {m.queue_offset for m in run.sent} == {0, 1, 2, 3}
    assert set(run.log.finish_seqs()) == {m.msg_id for m in run.sent}


def test_a_sync_handler_still_runs_in_a_worker_thread() -> None:
    threads: list[threading.Thread] = []

    class Sync(MessageListenerOrderly):
        def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> None:
            threads.append(threading.current_thread())

    listener = RecordingListener(Sync())
    assert isinstance(listener, MessageListenerOrderly)  # a recorder is of its listener's kind
    assert not inspect.iscoroutinefunction(listener.consume_message)
    run = run_virtual(listener, specs(3), costs=[2.0])
    assert len(threads) == 3
    assert all(t is not threading.main_thread() for t in threads)
    assert [c.outcome for c in run.log.calls] == [Outcome.SUCCESS] * 3
    # times come from the event loop's (virtual) clock: the cost, stayed virtual, plus
    # the wall time the thread computed (the clock does not jump meanwhile)
    assert all(2.0 <= c.end - c.start <= 2.0 + run.wall_seconds for c in run.log.calls)


def test_describe_names_the_call() -> None:
    run = run_virtual(Keyed(), specs(1, keys=["a"]))
    line = run.log.calls[0].describe()
    assert line.startswith("call #0 (run 0) t:0 [0] stage 0 key default/a attempt 1")
    assert line.endswith(": success")


def test_a_slow_sync_handler_keeps_its_consume_timeout_and_is_not_timed_out() -> None:
    """While a plain def handler's thread computes, the mock clock neither jumps (it
    used to race from deadline to deadline, to the consume timeout, in a moment of
    wall time) nor stands still: it runs at wall speed, so a 50 ms call takes 50 ms of
    virtual time, well inside a consume timeout of 5 s."""
    calls: list[int] = []

    class Slow(MessageListenerOrderly):
        def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> None:
            calls.append(msgs[0].queue_offset)
            time.sleep(0.05)

    run = run_virtual(
        RecordingListener(Slow()), specs(3), options=ConsumerOptions(consume_timeout=5.0)
    )
    assert run.completed
    assert calls == [0, 1, 2]
    assert [c.outcome for c in run.log.calls] == [Outcome.SUCCESS] * 3
    assert all(0.05 <= c.end - c.start <= run.wall_seconds for c in run.log.calls)


def test_a_sync_handler_blocking_past_the_consume_timeout_is_timed_out_and_retried() -> None:
    """A def handler that blocks longer than consume_timeout is timed out in virtual
    time as in production: its call is abandoned (counted as failed, its thread left
    to finish unobserved) and the message is retried, once, and finished once."""
    release = threading.Event()
    attempts: list[tuple[int, int]] = []

    class Stuck(MessageListenerOrderly):
        def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> None:
            attempts.append((msgs[0].queue_offset, msgs[0].reconsume_times))
            if msgs[0].queue_offset == 1 and msgs[0].reconsume_times == 0:
                release.wait(60)  # far past the timeout; released when the run is over

    try:
        run = run_virtual(
            RecordingListener(Stuck()), specs(3), options=ConsumerOptions(consume_timeout=0.3)
        )
    finally:
        release.set()
    assert run.completed
    assert attempts == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert [(c.offsets, c.attempt, c.outcome) for c in run.log.calls] == [
        ((0,), 1, Outcome.SUCCESS),
        ((1,), 1, Outcome.CANCELLED),
        ((1,), 2, Outcome.SUCCESS),
        ((2,), 1, Outcome.SUCCESS),
    ]
    stuck = run.log.calls[1]
    assert stuck.end - stuck.start >= 0.3  # timed out no earlier than the timeout
    assert_at_least_once(run.log, run.sent, exactly_once=True)


def test_scheduled_costs_of_a_sync_handler_stay_virtual_and_can_time_out() -> None:
    """A def handler's scheduled cost is a virtual sleep taken from its thread: a call
    costing 3 s against consume_timeout=1 s is timed out every time, each abandoned
    thread finishing its cost unobserved without holding the clock afterwards, so the
    run reaches its 60 s (virtual) timeout without 60 s of wall time."""

    class Quick(MessageListenerOrderly):
        def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> None:
            return None

    run = run_virtual(
        Quick(), specs(2), costs=[3.0], options=ConsumerOptions(consume_timeout=1.0), timeout=60
    )
    assert not run.completed
    assert len(run.log.calls) > 10  # retried, again and again, in virtual time
    assert {c.outcome for c in run.log.calls} == {Outcome.CANCELLED}
    assert {c.offsets for c in run.log.calls} == {(0,)}  # orderly: offset 1 waits
    # (all but the last, which the end of the run may cancel sooner)
    assert all(c.end - c.start >= 1.0 for c in run.log.calls[:-1])
    assert run.wall_seconds < 60  # a clock left held would run at wall speed
    fine = run_virtual(Quick(), specs(2), costs=[0.5], options=ConsumerOptions(consume_timeout=1.0))
    assert fine.completed
    assert [c.outcome for c in fine.log.calls] == [Outcome.SUCCESS] * 2
    assert all(0.5 <= c.end - c.start <= 0.5 + fine.wall_seconds for c in fine.log.calls)
