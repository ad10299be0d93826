"""Focused ProcessQueue cases: per-message times, barriers and memory shape.

The state machine in ``test_process_queue_state_machine.py`` covers the ordering and
counting rules; these tests pin the bookkeeping the shell relies on for message trace
and metrics, and that caching allocates no object per message.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest

from offsetstore import StageKey
from stagedconsumer import Message, MessageQueue
from stagedconsumer._core import (
    HELD,
    Batch,
    ConsumeMode,
    EraseStatus,
    ProcessQueue,
    StageDefinition,
    StagePlan,
)

MQ = MessageQueue("t", 0)


def messages(start: int, count: int) -> list[Message]:
    return [
        Message(topic="t", queue_id=0, queue_offset=offset, body=b"x" * 10)
        for offset in range(start, start + count)
    ]


def test_cached_times_stay_aligned_when_now_is_given_only_sometimes() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.CONCURRENT)
    pq.put_messages(messages(0, 2))  # no clock yet
    pq.put_messages(messages(2, 2), now=3.0)
    pq.put_messages(messages(4, 1))
    taken = [pq.try_take_messages(1) for _ in range(5)]
    assert [b.cached_times if b else None for b in taken] == [[0.0], [0.0], [3.0], [3.0], [0.0]]


def test_staged_cached_times_and_barrier_opening_time() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.STAGED, plan=StagePlan.single([2, 2]))
    pq.put_messages(messages(0, 4), now=1.0)
    first = pq.try_take_messages(10)
    assert first is not None
    assert [m.queue_offset for m in first] == [0, 1]
    assert first.cached_times == [1.0, 1.0]
    assert first.runnable_at == 1.0
    assert pq.try_take_messages(10) is None  # stage 1 waits for stage 0
    assert pq.erase_messages(first, EraseStatus.SUCCESS, now=5.0)
    second = pq.try_take_messages(10)
    assert second is not None
    assert [m.queue_offset for m in second] == [2, 3]
    assert second.stage_index == 1
    assert second.runnable_at == 5.0
    assert second.cached_times == [1.0, 1.0]


def test_erase_some_keeps_the_rest_pending_with_their_times() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.ORDERLY)
    pq.put_messages(messages(0, 1), now=1.0)
    pq.put_messages(messages(1, 2), now=2.0)
    batch = pq.try_take_messages(3)
    assert batch is not None
    pq.erase_some(batch, [batch.messages[1]], EraseStatus.DEAD_LETTER)
    assert [m.queue_offset for m in batch] == [0, 2]
    assert batch.cached_times == [1.0, 2.0]
    assert pq.committed_offset == 0  # offset 1 finished, 0 still pending
    assert pq.pending_count == 2
    assert pq.try_take_messages(1) is None  # orderly: the batch still holds the queue
    pq.erase_messages(batch, EraseStatus.SUCCESS)
    assert pq.committed_offset == 3
    assert pq.unfinished_count == 0
    assert pq.cached_bytes == 0


def test_committed_stage_offsets_follow_the_lowest_unfinished_message() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.STAGED, plan=StagePlan.single([3]))
    pq.put_messages(messages(0, 3))
    batches = [pq.try_take_messages(1) for _ in range(3)]
    b0, b1, b2 = batches
    assert b0 is not None
    assert b1 is not None
    assert b2 is not None
    pq.erase_messages(b2, EraseStatus.SUCCESS)
    pq.erase_messages(b1, EraseStatus.SUCCESS)
    assert pq.committed_offset == 0
    assert dict(pq.committed_stage_offsets) == {}
    pq.erase_messages(b0, EraseStatus.SUCCESS)
    assert pq.committed_offset == 3
    assert list(pq.committed_stage_offsets.values()) == [3]


@pytest.mark.slow
def test_caching_allocates_no_container_object_per_message() -> None:
    """Cached messages cost no tracked object each (the cyclic GC's work grows with
    the number of live container objects, so per-message objects that live from
    pull to finish would make full collections frequent and slow)."""
    for mode, plan in (
        (ConsumeMode.CONCURRENT, None),
        (ConsumeMode.STAGED, StagePlan.single([100] * 20)),
    ):
        pq = ProcessQueue(MQ, mode, plan=plan)
        backlog = messages(0, 2000)
        pq.put_messages(backlog[:1])  # lanes and epochs exist from here on
        gc.collect()
        before = len(gc.get_objects())
        pq.put_messages(backlog[1:], now=1.0)
        gc.collect()
        after = len(gc.get_objects())
        assert pq.cached_count == 2000
        assert after - before < 100, (mode, after - before)


def test_move_to_resumes_an_idle_queue_backwards_keeping_stage_offsets() -> None:
    key = StageKey("default", None)
    pq = ProcessQueue(
        MQ, ConsumeMode.STAGED, start_offset=500, stage_offsets={key: 3}, plan=StagePlan.single([5])
    )
    pq.move_to(10)
    assert pq.committed_offset == 10
    assert pq.committed_stage_offsets == {key: 3}
    pq.put_messages(messages(10, 2))
    batch = pq.try_take_messages(10)
    assert batch is not None
    assert [m.queue_offset for m in batch] == [10, 11]
    assert batch.stage_index == 0  # stage offsets 3 and 4 of [5]
    with pytest.raises(ValueError, match="unfinished"):
        pq.move_to(0)  # never past (or before) an unfinished message


def tagged(start: int, tags: list[str | None]) -> list[Message]:
    return [
        Message(topic="t", queue_id=0, queue_offset=offset, body=b"x", tags=tag)
        for offset, tag in enumerate(tags, start)
    ]


def take_all(pq: ProcessQueue) -> list[tuple[int, str | None, int]]:
    """Take and finish everything that may run: (offset, strategy id, stage) each."""
    out: list[tuple[int, str | None, int]] = []
    while (batch := pq.try_take_messages(10)) is not None:
        out.extend((m.queue_offset, batch.strategy_id, batch.stage_index) for m in batch)
        pq.erase_messages(batch, EraseStatus.SUCCESS)
    return sorted(out)


def test_an_unknown_strategy_id_holds_the_queue_at_its_message() -> None:
    """A typo in compute_strategy is a bad value: it does not drop the message's order
    by consuming it with no stage. None still means no stage."""
    strategy_of = {"a": "a", "b": "b", "typo": "bb", None: None}
    plan = StagePlan(
        definitions={"a": StageDefinition.of([2]), "b": StageDefinition.of([1])},
        compute_strategy=lambda m: strategy_of[m.tags],
    )
    pq = ProcessQueue(MQ, ConsumeMode.STAGED, plan=plan)
    assert pq.put_messages(tagged(0, ["a", None, "b", "typo", "a"])) & HELD
    assert pq.held_count == 2  # the typo and everything after it
    failure = pq.assignment_error
    assert failure is not None
    assert failure.message.queue_offset == 3
    assert failure.callback == "compute_strategy"
    assert failure.exception is None
    assert failure.detail == (
        "compute_strategy() returned str 'bb'; expected a strategy id of the stage"
        " definitions ('a', 'b') or None (no stage)"
    )
    assert take_all(pq) == [(0, "a", 0), (1, None, -1), (2, "b", 0)]
    assert pq.committed_offset == 3  # never past the held message
    assert pq.put_messages(tagged(5, ["a"])) & HELD  # new messages wait behind it
    assert pq.held_count == 3
    assert pq.retry_assignment() & HELD  # still a typo
    assert pq.committed_offset == 3
    strategy_of["typo"] = "b"  # fixed: the held messages are assigned in order
    assert not pq.retry_assignment() & HELD
    assert pq.assignment_error is None
    assert take_all(pq) == [(3, "b", -1), (4, "a", 0), (5, "a", -1)]
    assert pq.committed_offset == 6


def test_the_default_strategy_missing_from_the_definitions_holds_the_queue() -> None:
    # without compute_strategy every message asks for DEFAULT_STRATEGY
    pq = ProcessQueue(
        MQ, ConsumeMode.STAGED, plan=StagePlan(definitions={"a": StageDefinition.of([1])})
    )
    assert pq.put_messages(messages(0, 2)) & HELD
    assert pq.held_count == 2
    assert pq.committed_offset == 0
    failure = pq.assignment_error
    assert failure is not None
    assert "returned str 'default'" in failure.detail
    assert pq.try_take_messages(10) is None


# -- take_next: a run of one-message calls on one batch ------------------------------


def test_take_next_adds_the_next_cached_messages_to_the_batch_until_none_is_left() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.CONCURRENT)
    pq.put_messages(messages(0, 3), now=1.0)
    batch = pq.try_take_messages(1)
    assert batch is not None
    added = [pq.take_next(batch), pq.take_next(batch)]
    assert [m.queue_offset for m in added if m is not None] == [1, 2]
    assert pq.take_next(batch) is None
    assert [m.queue_offset for m in batch] == [0, 1, 2]
    assert batch.cached_times == [1.0, 1.0, 1.0]
    stats = pq.statistics()
    assert (stats.cached_count, stats.pending_count) == (0, 3)
    pq.erase_messages(batch, EraseStatus.SUCCESS)
    assert pq.committed_offset == 3
    assert pq.statistics().pending_count == 0


def test_take_next_leaves_what_it_did_not_take_to_other_takes() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.CONCURRENT)
    pq.put_messages(messages(0, 4))
    run = pq.try_take_messages(1)
    assert run is not None
    other = pq.try_take_messages(1)  # another worker, while the run's call waits
    assert other is not None
    assert [m.queue_offset for m in other] == [1]
    message = pq.take_next(run)
    assert message is not None
    assert message.queue_offset == 2
    pq.erase_messages(run, EraseStatus.SUCCESS)
    assert pq.committed_offset == 1  # offset 1 is still in the other call
    pq.erase_messages(other, EraseStatus.SUCCESS)
    assert pq.committed_offset == 3


def test_take_next_stops_at_the_stage_boundary() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.STAGED, plan=StagePlan.single([2, 2]))
    pq.put_messages(messages(0, 4))
    batch = pq.try_take_messages(1)
    assert batch is not None
    assert pq.take_next(batch) is not None
    assert pq.take_next(batch) is None  # offset 2 is in the next stage
    assert [m.queue_offset for m in batch] == [0, 1]
    assert pq.try_take_messages(1) is None  # its barrier is closed until the run ends
    pq.erase_messages(batch, EraseStatus.SUCCESS)
    after = pq.try_take_messages(1)
    assert after is not None
    assert after.stage_index == 1


def _take_next(pq: ProcessQueue, batch: Batch, now: float) -> int:
    return 0 if pq.take_next(batch, now) is None else 1


def _take_more(pq: ProcessQueue, batch: Batch, now: float) -> int:
    return pq.take_more(batch, 3, now)


@pytest.mark.parametrize(
    ("take", "takes"), [(_take_next, 1), (_take_more, 3)], ids=["next", "more"]
)
def test_taking_ahead_gives_nothing_from_a_closed_queue_or_for_a_retry(
    take: Callable[[ProcessQueue, Batch, float], int], takes: int
) -> None:
    pq = ProcessQueue(MQ, ConsumeMode.CONCURRENT)
    pq.put_messages(messages(0, 6))
    batch = pq.try_take_messages(1)
    assert batch is not None
    pq.pause()
    assert take(pq, batch, float("-inf")) == 0
    pq.unpause()
    pq.set_lease(10.0)
    assert take(pq, batch, 10.0) == 0  # the lease ended
    assert take(pq, batch, 9.0) == takes
    retried = pq.try_take_messages(1)
    assert retried is not None
    pq.suspend_messages(retried, retry_at=1.0)
    pq.resume(retried)
    again = pq.try_take_messages(1)
    assert again is retried
    assert again.attempt == 2
    assert take(pq, again, float("-inf")) == 0  # a retry is called as it was taken


def test_take_next_in_an_orderly_queue_keeps_it_exclusive() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.ORDERLY)
    pq.put_messages(messages(0, 3))
    batch = pq.try_take_messages(1)
    assert batch is not None
    assert pq.take_next(batch) is not None
    assert pq.try_take_messages(1) is None  # the queue's one batch is in flight
    # a call fails after one success: finish the first, keep the failed one
    pq.erase_some(batch, batch.messages[:1], EraseStatus.SUCCESS)
    assert [m.queue_offset for m in batch] == [1]
    assert pq.committed_offset == 1
    assert pq.try_take_messages(1) is None
    pq.erase_messages(batch, EraseStatus.SUCCESS)
    last = pq.try_take_messages(1)
    assert last is not None
    assert [m.queue_offset for m in last] == [2]


def test_take_more_adds_up_to_max_count_and_stops_at_the_stage_boundary() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.STAGED, plan=StagePlan.single([5, 3]))
    pq.put_messages(messages(0, 8), now=1.0)
    batch = pq.try_take_messages(1)
    assert batch is not None
    assert pq.take_more(batch, 0) == 0  # a run at its checkpoint takes none
    assert [m.queue_offset for m in batch] == [0]
    assert pq.take_more(batch, 2) == 2
    assert pq.take_more(batch, 10) == 2  # offsets 3 and 4: offset 5 is the next stage
    assert pq.take_more(batch, 10) == 0
    assert [m.queue_offset for m in batch] == [0, 1, 2, 3, 4]
    assert batch.cached_times == [1.0] * 5
    stats = pq.statistics()
    assert (stats.cached_count, stats.pending_count) == (3, 5)
    pq.erase_messages(batch, EraseStatus.SUCCESS)
    assert pq.committed_offset == 5


def test_untake_rest_gives_back_what_was_taken_ahead_first_in_line() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.CONCURRENT)
    pq.put_messages(messages(0, 3), now=1.0)
    pq.put_messages(messages(3, 3), now=2.0)
    batch = pq.try_take_messages(1)
    assert batch is not None
    assert pq.take_more(batch, 4) == 4
    before = pq.statistics()
    pq.untake_rest(batch, 2)  # offsets 0 and 1 called, 2 to 4 not
    assert [m.queue_offset for m in batch] == [0, 1]
    assert batch.cached_times == [1.0, 1.0]
    stats = pq.statistics()
    assert stats.cached_count == before.cached_count + 3
    assert stats.pending_count == before.pending_count - 3
    pq.untake_rest(batch, 2)  # nothing more to give back
    assert [m.queue_offset for m in batch] == [0, 1]
    other = pq.try_take_messages(10)  # another worker gets them, in offset order
    assert other is not None
    assert [m.queue_offset for m in other] == [2, 3, 4, 5]
    assert other.cached_times == [1.0, 2.0, 2.0, 2.0]
    pq.erase_messages(other, EraseStatus.SUCCESS)
    assert pq.committed_offset == 0  # offsets 0 and 1 still in the run's batch
    pq.erase_messages(batch, EraseStatus.SUCCESS)
    assert pq.committed_offset == 6
    assert pq.statistics().pending_count == 0


def test_untake_rest_in_an_orderly_queue_keeps_the_order() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.ORDERLY)
    pq.put_messages(messages(0, 5))
    batch = pq.try_take_messages(1)
    assert batch is not None
    assert pq.take_more(batch, 4) == 4
    pq.untake_rest(batch, 1)
    assert pq.try_take_messages(1) is None  # the queue's one batch is still in flight
    pq.erase_messages(batch, EraseStatus.SUCCESS)
    taken = []
    while (next_batch := pq.try_take_messages(1)) is not None:
        taken += [m.queue_offset for m in next_batch]
        pq.erase_messages(next_batch, EraseStatus.SUCCESS)
    assert taken == [1, 2, 3, 4]
    assert pq.committed_offset == 5


def test_take_next_keeps_times_aligned_when_the_cache_had_none() -> None:
    pq = ProcessQueue(MQ, ConsumeMode.CONCURRENT)
    pq.put_messages(messages(0, 1), now=2.0)
    batch = pq.try_take_messages(1)
    assert batch is not None
    pq.put_messages(messages(1, 1))  # cached without a time
    assert pq.take_next(batch) is not None
    assert len(batch.cached_times) == len(batch.messages) == 2


@pytest.mark.parametrize("finish_first", [0, 1], ids=["head-first", "tail-first"])
def test_the_stage_barrier_waits_for_unfinished_not_only_cached_messages(
    finish_first: int,
) -> None:
    """Stage 1 opens only once *every* message of stage 0 has finished: with both of
    stage 0's messages taken (none cached) and one of them still pending, nothing of
    stage 1 may be taken, whichever of the two finishes first."""
    pq = ProcessQueue(MQ, ConsumeMode.STAGED, plan=StagePlan.single([2, 2]))
    pq.put_messages(messages(0, 4), now=1.0)
    batches = [pq.try_take_messages(1), pq.try_take_messages(1)]
    assert all(b is not None for b in batches)
    assert [b.messages[0].queue_offset for b in batches if b] == [0, 1]
    assert [b.stage_index for b in batches if b] == [0, 0]
    assert pq.try_take_messages(10) is None  # stage 0 has nothing cached, two pending
    done, still = batches[finish_first], batches[1 - finish_first]
    assert done is not None
    assert still is not None
    pq.erase_messages(done, EraseStatus.SUCCESS, now=2.0)
    assert pq.try_take_messages(10) is None  # one message of stage 0 still unfinished
    pq.erase_messages(still, EraseStatus.SUCCESS, now=3.0)
    opened = pq.try_take_messages(10)
    assert opened is not None
    assert [m.queue_offset for m in opened] == [2, 3]
    assert opened.stage_index == 1
    assert opened.runnable_at == 3.0
