"""Sparse progress in the core: finished ranges above the committed offset, and a queue
rebuilt from them that hands out exactly the messages that had not finished, each in
the stage it had."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagedconsumer import Message, MessageQueue
from stagedconsumer._core import (
    Batch,
    ConsumeMode,
    EraseStatus,
    ProcessQueue,
    StageDefinition,
    StagePlan,
)

MQ = MessageQueue("t", 0)


def messages(offsets: list[int], keys: list[str] | None = None) -> list[Message]:
    return [
        Message(
            topic="t",
            queue_id=0,
            queue_offset=offset,
            body=b"x",
            keys=(keys[i % len(keys)],) if keys else (),
        )
        for i, offset in enumerate(offsets)
    ]


def by_key(message: Message) -> str | None:
    return message.keys[0] if message.keys else None


def new_queue(
    mode: ConsumeMode,
    sizes: list[int],
    start: int = 0,
    stage_offsets: dict | None = None,  # type: ignore[type-arg]
    finished: tuple[tuple[int, int], ...] = (),
) -> ProcessQueue:
    plan = None
    if mode is ConsumeMode.STAGED:
        plan = StagePlan(
            definitions={
                "default": StageDefinition.of(sizes),
                "other": StageDefinition.of([1, *sizes]),
            },
            compute_strategy=lambda m: "other" if m.queue_offset % 5 == 4 else "default",
            compute_group=by_key,
        )
    return ProcessQueue(
        MQ,
        mode,
        start_offset=start,
        stage_offsets=stage_offsets,
        plan=plan,
        key_of=by_key if mode is ConsumeMode.KEY_ORDERED else None,
        finished=finished,
    )


def test_finished_ranges_are_the_runs_above_the_committed_offset() -> None:
    pq = new_queue(ConsumeMode.CONCURRENT, [])
    pq.put_messages(messages([0, 1, 2, 3, 5, 6, 9, 10]))
    batches = [pq.try_take_messages(1) for _ in range(8)]
    for index in (2, 3, 4, 6, 7):  # offsets 2, 3, 5, 9, 10
        batch = batches[index]
        assert batch is not None
        pq.erase_messages(batch, EraseStatus.SUCCESS)
    assert pq.committed_offset == 0
    # 4, 7 and 8 were never seen (sparse offsets): a run spans them
    assert pq.finished_ranges(10) == (((2, 5), (9, 10)), False)
    assert pq.finished_ranges(1) == (((2, 5),), True)
    assert pq.finished_ranges(0) == ((), True)
    assert pq.finished_above == 5


def test_a_rebuilt_queue_skips_finished_messages_and_resumes_past_them() -> None:
    pq = new_queue(ConsumeMode.ORDERLY, [], start=10, finished=((11, 12), (15, 15)))
    pq.put_messages(messages(list(range(10, 18))))
    taken = []
    while (batch := pq.try_take_messages(1)) is not None:
        taken.append(batch.messages[0].queue_offset)
        pq.erase_messages(batch, EraseStatus.SUCCESS)
    assert taken == [10, 13, 14, 16, 17]
    assert pq.skipped_count == 3
    assert pq.committed_offset == 18
    # ranges the queue has not reached are kept in what it commits
    ahead = new_queue(ConsumeMode.CONCURRENT, [], start=10, finished=((11, 12), (20, 30)))
    ahead.put_messages(messages([10, 11, 12, 13]))
    assert ahead.finished_ranges(10) == (((11, 12), (20, 30)), False)
    assert ahead.committed_offset == 10


def _drive(
    pq: ProcessQueue,
    incoming: list[Message],
    data: st.DataObject,
    stop_after: int | None,
) -> tuple[list[tuple[int, int, str | None, str | None]], set[int]]:
    """Pull, take and finish in an order ``data`` draws; stop once ``stop_after``
    messages finished (``None``: run to the end). Returns every message handed out
    (offset, stage index, strategy, group) and the offsets finished."""
    handed: list[tuple[int, int, str | None, str | None]] = []
    pending: list[Batch] = []
    position = 0
    finished: set[int] = set()
    while True:
        if stop_after is not None and len(finished) >= stop_after:
            return handed, finished
        choices = []
        if position < len(incoming):
            choices.append("pull")
        if pq.has_ready():
            choices.append("take")
        if pending:
            choices.append("finish")
        if not choices:
            return handed, finished
        choice = data.draw(st.sampled_from(choices))
        if choice == "pull":
            count = data.draw(st.integers(1, 4))
            pq.put_messages(incoming[position : position + count])
            position += count
        elif choice == "take":
            batch = pq.try_take_messages(data.draw(st.integers(1, 3)))
            if batch is not None:
                pending.append(batch)
                handed.extend(
                    (m.queue_offset, batch.stage_index, batch.strategy_id, batch.group_id)
                    for m in batch.messages
                )
        else:
            batch = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
            pq.erase_messages(batch, EraseStatus.SUCCESS)
            finished.update(m.queue_offset for m in batch.messages)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(list(ConsumeMode)),
    st.lists(st.integers(1, 4), max_size=3),
    st.lists(st.integers(1, 3), min_size=0, max_size=30),
    st.integers(0, 30),
    st.sampled_from([None, ["a"], ["a", "b"]]),
    st.data(),
)
def test_a_queue_rebuilt_from_sparse_progress_hands_out_exactly_the_unfinished(
    mode: ConsumeMode,
    sizes: list[int],
    gaps: list[int],
    stop_after: int,
    keys: list[str] | None,
    data: st.DataObject,
) -> None:
    offsets = []
    offset = 0
    for gap in gaps:  # sparse offsets, as on a Redis stream
        offsets.append(offset)
        offset += gap
    incoming = messages(offsets, keys)
    # The first life, stopped (a crash) after some messages finished.
    first = new_queue(mode, sizes)
    handed_first, first_finished = _drive(first, incoming, data, stop_after)
    stage_of = {offset: rest for offset, *rest in handed_first}
    committed = first.committed_offset
    stages = dict(first.committed_stage_offsets)
    ranges, cut = first.finished_ranges(1000)
    assert not cut
    done_first = {o for o in offsets if o < committed or any(f <= o <= last for f, last in ranges)}
    # Sparse progress records exactly what the first life finished (and the offsets
    # it never saw in between, which no message has).
    assert done_first == first_finished
    # The second life, from the progress: it hands out exactly the rest.
    second = new_queue(mode, sizes, committed, stages, ranges)
    rest = [m for m in incoming if m.queue_offset >= committed]
    handed_second, second_finished = _drive(second, rest, data, None)
    assert first_finished | second_finished == set(offsets)
    assert sorted(o for o, *_ in handed_second) == sorted(set(offsets) - done_first)
    assert second.skipped_count == len([o for o in offsets if o >= committed and o in done_first])
    assert second.committed_offset == (offsets[-1] + 1 if offsets else 0)
    # Each message is handed out in the stage (and stage key) it had in the first life.
    for offset, *rest_of in handed_second:
        if offset in stage_of:
            assert stage_of[offset] == rest_of
    # And the stage offsets at the end are those of one life that ran through.
    whole = new_queue(mode, sizes)
    handed_whole, _finished = _drive(whole, incoming, data, None)
    assert dict(second.committed_stage_offsets) == dict(whole.committed_stage_offsets)
    whole_stage = {offset: rest for offset, *rest in handed_whole}
    for offset, *rest_of in handed_second:
        assert whole_stage[offset] == rest_of
