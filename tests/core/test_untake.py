"""Giving a taken batch back (``untake``): the queue is as if it had never been taken.

The shell gives a batch back when its queue's lease ended between the take and the
start of the handler. Each test takes a batch from one queue and gives it back, and
compares that queue with a twin that was never touched: the same statistics
(cached, pending and suspended counts, bytes, committed offset and stage offsets),
the same next batch, and the same batches, stages and committed progress when both
are then consumed to the end. The state machine in
``test_process_queue_state_machine.py`` also gives batches back at random.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest

from stagedconsumer import Message, MessageQueue
from stagedconsumer._core import (
    DRAINED,
    NOTHING,
    READY,
    Batch,
    ConsumeMode,
    Dispatcher,
    EraseStatus,
    ProcessQueue,
    StageDefinition,
    StagePlan,
)

MQ = MessageQueue("t", 0)


def message(offset: int, tag: str | None = None, key: str | None = None) -> Message:
    return Message(
        topic="t",
        queue_id=0,
        queue_offset=offset,
        body=b"x" * (offset % 5 + 1),
        tags=tag,
        keys=(key,) if key is not None else (),
    )


@attrs.frozen
class Case:
    """One way to build a queue: its mode, arguments and the messages it caches."""

    mode: ConsumeMode
    messages: list[Message]
    plan: StagePlan | None = None
    key_of: Callable[[Message], str | None] | None = None
    start_offset: int = 0

    def new(self, *, now: float | None = 1.0) -> ProcessQueue:
        pq = ProcessQueue(
            MQ,
            self.mode,
            start_offset=self.start_offset,
            plan=self.plan,
            key_of=self.key_of,
        )
        half = len(self.messages) // 2
        pq.put_messages(self.messages[:half], now=now)
        pq.put_messages(self.messages[half:], now=None if now is None else now + 1.0)
        return pq


def _strategy(m: Message) -> str | None:
    return {"a": "a", "b": "b"}.get(m.tags or "")  # untagged: no stage


def _group(m: Message) -> str | None:
    return m.keys[0] if m.keys else None


def _key(m: Message) -> str | None:
    return m.keys[0] if m.keys else None


CASES = {
    "concurrent": Case(ConsumeMode.CONCURRENT, [message(o) for o in range(7)]),
    "orderly": Case(ConsumeMode.ORDERLY, [message(o) for o in range(5)], start_offset=0),
    "staged": Case(
        ConsumeMode.STAGED,
        [message(o) for o in range(10, 20)],
        plan=StagePlan.single([2, 3]),
        start_offset=10,
    ),
    "staged-strategies-groups-direct": Case(
        ConsumeMode.STAGED,
        [message(o, tag=("a", "b", None)[o % 3], key=("g1", "g2")[o % 2]) for o in range(14)],
        plan=StagePlan(
            definitions={"a": StageDefinition.of([1, 2]), "b": StageDefinition.of([2])},
            compute_strategy=_strategy,
            compute_group=_group,
        ),
    ),
    "key-ordered": Case(
        ConsumeMode.KEY_ORDERED,
        [message(o, key=("k1", "k2", None, "k1")[o % 4]) for o in range(9)],
        key_of=_key,
    ),
}


def snapshot(pq: ProcessQueue) -> tuple[object, ...]:
    stats = pq.statistics()
    return (
        stats.cached_count,
        stats.pending_count,
        stats.suspended_count,
        stats.cached_bytes,
        stats.committed_offset,
        dict(stats.stage_offsets),
        stats.span,
        stats.key_count,
        pq.in_handlers,
        pq.is_cache_full(),
        pq.has_ready(),
    )


def describe(batch: Batch | None) -> tuple[object, ...] | None:
    if batch is None:
        return None
    return (
        [(m.queue_offset, m.reconsume_times) for m in batch.messages],
        batch.stage_index,
        batch.strategy_id,
        batch.group_id,
        batch.attempt,
        list(batch.cached_times),
        batch.runnable_at,
    )


def consume_to_the_end(
    pq: ProcessQueue, max_count: int = 2, *, any_lane_order: bool = False
) -> list[object]:
    """Take every batch that may run, then finish them all, until nothing is left:
    what was taken, and the committed progress after each round (``any_lane_order``:
    the batches of a round in offset order, whichever lane came first)."""
    seen: list[object] = []
    while True:
        taken = []
        while (batch := pq.try_take_messages(max_count)) is not None:
            taken.append(batch)
        if not taken:
            break
        if any_lane_order:
            seen.append(sorted(map(repr, map(describe, taken))))
        else:
            seen.extend(map(describe, taken))
        for batch in taken:
            pq.erase_messages(batch, EraseStatus.SUCCESS, now=9.0)
        seen.append((pq.committed_offset, dict(pq.committed_stage_offsets)))
    assert pq.unfinished_count == 0
    return seen


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("max_count", [1, 2, 3])
@pytest.mark.parametrize("timed", [True, False])
def test_take_then_untake_leaves_the_queue_as_it_was(
    name: str, max_count: int, timed: bool
) -> None:
    case = CASES[name]
    pq, twin = case.new(now=1.0 if timed else None), case.new(now=1.0 if timed else None)
    before = snapshot(pq)
    batch = pq.try_take_messages(max_count)
    assert batch is not None
    assert snapshot(pq) != before
    assert pq.untake_messages(batch) == READY
    assert snapshot(pq) == snapshot(twin) == before
    nexts = pq.try_take_messages(max_count), twin.try_take_messages(max_count)
    assert describe(nexts[0]) == describe(nexts[1]) == describe(batch)
    for queue, taken in zip((pq, twin), nexts, strict=True):
        assert taken is not None
        queue.erase_messages(taken, EraseStatus.SUCCESS, now=9.0)
    assert consume_to_the_end(pq, max_count) == consume_to_the_end(twin, max_count)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("timed", [True, False])
def test_batches_given_back_in_any_order_keep_each_lane_in_offset_order(
    name: str, timed: bool
) -> None:
    """Several batches taken, then given back last-taken-first (the queue is exactly
    as it was) or first-taken-first (each lane is as it was, in offset order; the
    lanes' turns may come in another order, which no ordering rule depends on)."""
    case = CASES[name]
    for last_first in (True, False):
        now = 1.0 if timed else None
        pq, twin = case.new(now=now), case.new(now=now)
        taken = []
        while (batch := pq.try_take_messages(1)) is not None:
            taken.append(batch)
        assert len(taken) >= 2 or name == "orderly"
        for batch in reversed(taken) if last_first else taken:
            pq.untake_messages(batch)
        assert snapshot(pq) == snapshot(twin)
        exact = not last_first
        assert consume_to_the_end(pq, any_lane_order=exact) == consume_to_the_end(
            twin, any_lane_order=exact
        )


def test_a_batch_given_back_is_not_counted_as_an_attempt_or_a_delivery() -> None:
    pq = CASES["orderly"].new()
    batch = pq.try_take_messages(2)
    assert batch is not None
    pq.untake_messages(batch)
    again = pq.try_take_messages(2)
    assert again is not None
    assert again is not batch
    assert again.attempt == 1
    assert [m.reconsume_times for m in again] == [0, 0]
    assert [m.queue_offset for m in again] == [0, 1]


def test_a_run_grown_by_take_next_goes_back_whole() -> None:
    case = CASES["concurrent"]
    pq, twin = case.new(), case.new()
    batch = pq.try_take_messages(1)
    assert batch is not None
    assert pq.take_next(batch) is not None
    assert pq.take_next(batch) is not None
    pq.untake_messages(batch)
    assert snapshot(pq) == snapshot(twin)
    assert consume_to_the_end(pq, 1) == consume_to_the_end(twin, 1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_retry_given_back_is_suspended_again_and_first_in_line(name: str) -> None:
    """A suspended batch taken again and given back: still pending and suspended, its
    attempt and reconsume_times as the suspension left them, taken next."""
    case = CASES[name]
    pq = case.new()
    failed = pq.try_take_messages(2)
    assert failed is not None
    pq.suspend_messages(failed, retry_at=5.0)
    assert pq.resume(failed) == READY
    before = snapshot(pq)
    retry = pq.try_take_messages(2)
    assert retry is failed
    assert pq.untake_messages(retry) == READY
    assert snapshot(pq) == before
    assert pq.statistics().suspended_count == len(failed)
    again = pq.try_take_messages(2)
    assert again is failed
    assert again.attempt == 2
    assert {m.reconsume_times for m in again} == {1}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_batch_given_back_to_a_dropped_queue_drains_it(name: str) -> None:
    """The queue was released (its lease lost) while the batch was between its take
    and its handler: nothing of it is handed out again, and giving the last batch in
    a handler back lets the release go on (``DRAINED``)."""
    case = CASES[name]
    pq = case.new()
    first = pq.try_take_messages(1)
    suspended = pq.try_take_messages(1) if name != "orderly" else None
    if suspended is not None:
        pq.suspend_messages(suspended, retry_at=5.0)  # suspended: not in a handler
    pq.drop()
    committed = pq.committed_offset
    assert first is not None
    assert pq.in_handlers == len(first)
    assert pq.untake_messages(first) == DRAINED
    assert pq.in_handlers == 0
    assert pq.committed_offset == committed
    assert not pq.has_ready()
    assert pq.try_take_messages(10) is None


def test_a_retry_given_back_to_a_dropped_queue_is_not_handed_out_again() -> None:
    pq = CASES["concurrent"].new()
    other = pq.try_take_messages(1)
    failed = pq.try_take_messages(1)
    assert other is not None
    assert failed is not None
    pq.suspend_messages(failed, retry_at=5.0)
    pq.resume(failed)
    retry = pq.try_take_messages(1)
    assert retry is failed
    pq.drop()
    assert pq.untake_messages(retry) == NOTHING  # ``other`` is still in a handler
    assert pq.statistics().suspended_count == 1
    assert pq.try_take_messages(1) is None
    assert pq.erase_messages(other, EraseStatus.SUCCESS) & DRAINED


def test_a_batch_given_back_after_its_lease_ended_waits_for_a_renewal() -> None:
    """Through the dispatcher, as the shell does it: the lease ends between the take
    and the handler, the batch goes back, the queue gives nothing until its lease is
    renewed, and then the same messages come out as the next batch."""
    dispatcher = Dispatcher()
    pq = ProcessQueue(MQ, ConsumeMode.STAGED, plan=StagePlan.single([3]))
    dispatcher.set_lease(pq, 1.0)
    dispatcher.put_messages(pq, [message(o) for o in range(5)], now=0.5)
    batch = dispatcher.take(2, now=0.9)
    assert batch is not None
    taken = describe(batch)
    assert dispatcher.untake(batch) & READY  # at 1.0 or later: the lease ended
    assert dispatcher.take(2, now=1.0) is None  # the queue gives nothing now
    assert pq.statistics().pending_count == 0
    assert dispatcher.set_lease(pq, 10.0) == READY  # renewed
    again = dispatcher.take(2, now=1.0)
    assert again is not None
    assert describe(again) == taken


def test_the_dispatcher_puts_the_queue_first_in_line_again() -> None:
    dispatcher = Dispatcher()
    queues = [ProcessQueue(MessageQueue("t", q), ConsumeMode.CONCURRENT) for q in range(3)]
    for pq in queues:
        dispatcher.put_messages(
            pq,
            [
                Message(topic="t", queue_id=pq.message_queue.queue_id, queue_offset=o, body=b"x")
                for o in range(4)
            ],
        )
    batch = dispatcher.take(1)
    assert batch is not None
    assert batch.process_queue is queues[0]
    dispatcher.untake(batch)
    again = dispatcher.take(1)
    assert again is not None
    assert describe(again) == describe(batch)
    assert again.process_queue is queues[0]


def test_cached_times_stay_aligned_when_the_batch_had_none() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.CONCURRENT)
    pq.put_messages([message(0), message(1)])  # no times kept yet
    batch = pq.try_take_messages(1)
    assert batch is not None
    pq.put_messages([message(2)], now=3.0)  # times from here on
    pq.untake_messages(batch)
    taken = [pq.try_take_messages(1) for _ in range(3)]
    assert [describe(b) for b in taken] == [
        ([(o, 0)], -1, None, None, 1, [at], 0.0) for o, at in ((0, 0.0), (1, 0.0), (2, 3.0))
    ]
