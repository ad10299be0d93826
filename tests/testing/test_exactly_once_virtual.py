"""Sparse progress and exactly-once effects under failures and crashes, in virtual time.

- Sparse progress: after a crash, the restart hands no handler a message the store
  recorded finished (below the consume offset, in a finished range or marked), and
  with a commit after every call only the calls in flight at the crash come again.
- ``context.transact``: every message's effect is committed exactly once, whatever
  fails and crashes around it (dead-lettered messages: never).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import anyio
import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offsetstore import QueueProgress
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    Message,
    MessageListener,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    MessageQueue,
)
from stagedconsumer.testing import (
    FailureKind,
    FailureSchedule,
    MessageSpec,
    StagePlan,
    VirtualRun,
    assert_at_least_once,
    assert_orderly,
    assert_staged,
    failure_schedules,
    handler_costs,
    messages,
    origin_id,
    run_virtual,
    stage_definitions,
)


def recorded_finished(progress: QueueProgress | None, offset: int) -> bool:
    if progress is None or progress.consume_offset is None:
        return False
    return offset < progress.consume_offset or any(
        first <= offset <= last for first, last in progress.finished
    )


def redelivered_recorded(run: VirtualRun) -> list[str]:
    """Calls of the run after each crash on messages the store had recorded finished."""
    bad = []
    for crash, progress in enumerate(run.crash_progress):
        for call in run.log.calls:
            if call.run != crash + 1:
                continue
            for message in call.messages:
                mq = MessageQueue(message.topic, message.queue_id)
                if recorded_finished(progress.get(mq), message.queue_offset):
                    bad.append(call.describe())
    return bad


class ByCampaign(MessageListenerStagedConcurrently):
    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = list(sizes)

    def get_stage_definitions(self) -> Sequence[int]:
        return self.sizes

    def compute_group(self, msg: Message) -> str | None:
        return msg.keys[0] if msg.keys else None

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        return None


@pytest.mark.slow
@given(
    messages(topic="t", queues=st.integers(1, 2), keys=st.sampled_from([("a",), ("b",), ()])),
    stage_definitions(),
    failure_schedules(),
    handler_costs(),
    st.lists(st.integers(1, 40), min_size=1, max_size=2),
    st.integers(1, 6),
    st.integers(1, 3),
)
def test_a_restart_never_redelivers_what_sparse_progress_recorded(
    specs: list[MessageSpec],
    sizes: list[int],
    failures: Any,
    costs: tuple[float, ...],
    crash_at: list[int],
    workers: int,
    batch: int,
) -> None:
    listener = ByCampaign(sizes)
    options = ConsumerOptions(
        consume_thread_max=workers,
        consume_message_batch_max_size=batch,
        persist_consumer_offset_interval=1.5,
    )
    run = run_virtual(
        listener, specs, options=options, failures=failures, costs=costs, crash_at=crash_at
    )
    assert run.completed
    assert redelivered_recorded(run) == []
    assert_staged(run.log, StagePlan.of(listener, run.sent), within_runs=True)
    assert_at_least_once(run.log, run.sent)


class Concurrent(MessageListenerConcurrently):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        return None


def duplicates(run: VirtualRun) -> dict[int, float]:
    """Messages a call finished in run 0 and the restart called again: when they
    finished."""
    finished = {
        m.queue_offset: call.end
        for call in run.log.calls
        if call.run == 0
        for m in call.finished_messages
    }
    again = {m.queue_offset for call in run.log.calls if call.run == 1 for m in call.messages}
    return {offset: end for offset, end in finished.items() if offset in again}


def test_with_frequent_commits_a_crash_redelivers_only_what_was_in_flight() -> None:
    # Costs 10, 1, 1, 1 cycled over 40 messages on 4 workers: every fourth message
    # holds the committed offset back while the others finish above it; calls end on
    # whole seconds, progress is committed every 0.25 s, between them. The crash
    # comes right after the 14th call ends: what finished before that instant was
    # committed.
    options = ConsumerOptions(consume_thread_max=4, persist_consumer_offset_interval=0.25)
    specs = [MessageSpec(topic="t", queue_id=0) for _ in range(40)]
    sparse = run_virtual(
        Concurrent(), specs, options=options, costs=[10.0, 1.0, 1.0, 1.0], crash_at=[14]
    )
    assert sparse.completed
    assert sparse.crashes == 1
    assert_at_least_once(sparse.log, sparse.sent)
    ended = sorted((c for c in sparse.log.calls if c.run == 0 and c.ended), key=lambda c: c.end_seq)
    crash_time = ended[13].end
    cut = [c for c in sparse.log.calls if c.run == 0 and not c.succeeded]
    assert cut  # the crash cut calls short: they come again
    again = {m.queue_offset for c in sparse.log.calls if c.run == 1 for m in c.messages}
    assert {c.messages[0].queue_offset for c in cut} <= again
    # Of the finished messages, only those that finished at the crash's instant
    # (after the last commit) come again, although the committed offset stayed below
    # the calls still in flight.
    assert set(duplicates(sparse).values()) <= {crash_time}
    assert sparse.crash_progress[0][MessageQueue("t", 0)].finished
    # Recording the committed offset alone (sparse_progress_max_ranges=0) redelivers
    # every message finished above it.
    plain = run_virtual(
        Concurrent(),
        specs,
        options=attrs.evolve(options, sparse_progress_max_ranges=0),
        costs=[10.0, 1.0, 1.0, 1.0],
        crash_at=[14],
    )
    assert not plain.crash_progress[0][MessageQueue("t", 0)].finished
    assert len(duplicates(plain)) > len(duplicates(sparse))


# -- exactly-once effects -------------------------------------------------------------


class Effects:
    """What the handlers' transactions committed: one entry per message."""

    def __init__(self, raise_after: set[int], sleep_after: float) -> None:
        self.committed: list[str] = []
        self.raise_after = raise_after
        self.sleep_after = sleep_after

    async def handle(self, msgs: Sequence[Message], context: Any) -> None:
        ids = [origin_id(m) for m in msgs]
        await context.transact(lambda connection: self.committed.extend(ids))
        if self.sleep_after:
            await anyio.sleep(self.sleep_after)  # a crash or a timeout may cut in here
        if any(m.queue_offset in self.raise_after for m in msgs):
            raise RuntimeError("failed after its transaction committed")


def listener_for(mode: str, sizes: list[int], effects: Effects) -> MessageListener:
    if mode == "staged":

        class Staged(ByCampaign):
            async def consume_message(
                self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
            ) -> None:
                await effects.handle(msgs, context)

        return Staged(sizes)
    if mode == "orderly":

        class Orderly(MessageListenerOrderly):
            async def consume_message(
                self, msgs: Sequence[Message], context: ConsumeOrderlyContext
            ) -> None:
                await effects.handle(msgs, context)

        return Orderly()

    class Transactional(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            await effects.handle(msgs, context)

    return Transactional()


class FailsFirstThenCommits(MessageListenerConcurrently):
    """Fails its first call before its transaction; commits an effect on the next."""

    def __init__(self) -> None:
        self.calls = 0
        self.committed: list[str] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("failed before its transaction")
        ids = [origin_id(m) for m in msgs]
        await context.transact(lambda connection: self.committed.extend(ids))


@pytest.mark.parametrize(("in_place", "effects"), [(False, 2), (True, 1)])
def test_a_retry_copy_can_commit_an_effect_twice_unless_retried_in_place(
    in_place: bool, effects: int, caplog: pytest.LogCaptureFixture
) -> None:
    # The message fails once: concurrent mode copies it to the retry topic, and the
    # consumer dies right after that call, before any progress commit. The restart
    # delivers the original again and the copy comes too: each commits its effect.
    # Retried in place, the message has one copy, and its mark stops a second effect.
    listener = FailsFirstThenCommits()
    run = run_virtual(
        listener,
        [MessageSpec(topic="t", queue_id=0)],
        options=ConsumerOptions(retry_in_place=in_place),
        crash_at=[1],
    )
    assert run.completed
    assert run.crashes == 1
    assert listener.committed == [origin_id(run.sent[0])] * effects
    retried = [c for c in run.log.calls if c.queue.topic.startswith("%RETRY%")]
    assert bool(retried) is not in_place
    # Without retry_in_place, the first transaction of a concurrent consumer warns.
    warned = [r for r in caplog.records if "retry_in_place=True" in r.getMessage()]
    assert len(warned) == (0 if in_place else 1)


@pytest.mark.timeout(120)
@settings(max_examples=60)  # ~10 ms each: every mode retries in place
@given(
    # Concurrent mode with retry_in_place: a failed message is retried in its queue
    # rather than copied to the retry topic (see the test above).
    st.sampled_from(["staged", "orderly", "concurrent"]),
    messages(topic="t", queues=st.integers(1, 2), keys=st.sampled_from([("a",), ("b",), ()])),
    stage_definitions(),
    failure_schedules(),
    handler_costs(),
    st.lists(st.integers(1, 40), max_size=3),
    st.sets(st.integers(0, 30), max_size=4),
    st.sampled_from([0.0, 0.5, 1.0]),
    st.integers(1, 6),
    st.integers(1, 3),
    st.sampled_from([0, 128]),
)
def test_effects_happen_exactly_once_under_failures_and_crashes(
    mode: str,
    specs: list[MessageSpec],
    sizes: list[int],
    failures: Any,
    costs: tuple[float, ...],
    crash_at: list[int],
    raise_after: set[int],
    sleep_after: float,
    workers: int,
    batch: int,
    max_ranges: int,
) -> None:
    effects = Effects(raise_after, sleep_after)
    listener = listener_for(mode, sizes, effects)
    options = ConsumerOptions(
        consume_thread_max=workers,
        consume_message_batch_max_size=batch,
        persist_consumer_offset_interval=2.0,
        sparse_progress_max_ranges=max_ranges,
        retry_in_place=True,
    )
    run = run_virtual(
        listener, specs, options=options, failures=failures, costs=costs, crash_at=crash_at
    )
    assert run.completed
    dead = {origin_id(d.message) for d in run.log.dead_letters}
    counts = collections.Counter(effects.committed)
    expected = {origin_id(m): 0 if origin_id(m) in dead else 1 for m in run.sent}
    assert {origin_id(m): counts[origin_id(m)] for m in run.sent} == expected
    assert not [c for c in run.log.calls if c.queue.topic.startswith("%RETRY%")]
    assert redelivered_recorded(run) == []
    if isinstance(listener, MessageListenerStagedConcurrently):
        assert_staged(run.log, StagePlan.of(listener, run.sent), within_runs=True)
    if mode == "orderly" and not run.crashes:
        assert_orderly(run.log)


def test_retry_in_place_waits_the_suspend_time_then_dead_letters() -> None:
    # Concurrent mode with retry_in_place: a failing message is retried in its own
    # queue every suspend_current_queue_time_millis, the other messages go on, and
    # after max_reconsume_times retries it goes to the dead-letter queue.
    always = FailureSchedule.of({(0, n): FailureKind.RAISE for n in (1, 2, 3)})
    options = ConsumerOptions(
        retry_in_place=True, max_reconsume_times=2, suspend_current_queue_time_millis=2500
    )
    run = run_virtual(
        Concurrent(),
        [MessageSpec(topic="t", queue_id=0) for _ in range(3)],
        options=options,
        failures=always,
    )
    assert run.completed
    first = [c for c in run.log.calls if c.messages[0].queue_offset == 0]
    assert [(c.queue.topic, c.attempt, c.start) for c in first] == [
        ("t", 1, 0.0),
        ("t", 2, 2.5),
        ("t", 3, 5.0),
    ]
    assert [d.message.queue_offset for d in run.log.dead_letters] == [0]
    assert all(c.succeeded for c in run.log.calls if c.messages[0].queue_offset != 0)
    assert_at_least_once(run.log, run.sent)
