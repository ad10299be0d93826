"""Staged queues with one strategy, no groups and no reset hook count the stage offset
at the committed offset instead of keeping one per message: the same committed
progress, step by step, as a queue whose plan goes the general way (a ``compute_group``
that always returns ``None`` puts every message in the same one lane)."""

from __future__ import annotations

import random

import pytest

from stagedconsumer import Message, MessageQueue
from stagedconsumer._core import (
    Batch,
    ConsumeMode,
    EraseStatus,
    ProcessQueue,
    StageDefinition,
    StageKey,
    StagePlan,
)

MQ = MessageQueue("t", 0)


def _queue(
    general: bool, stage_offsets: dict[StageKey, int], finished: list[tuple[int, int]]
) -> ProcessQueue:
    definitions = {"default": StageDefinition.of([3, 1, 4])}
    plan = StagePlan(definitions=definitions, compute_group=(lambda m: None) if general else None)
    return ProcessQueue(
        MQ,
        ConsumeMode.STAGED,
        start_offset=5,
        stage_offsets=stage_offsets,
        plan=plan,
        finished=finished,
    )


@pytest.mark.parametrize("seed", range(40))
def test_one_lane_progress_is_the_general_ways(seed: int) -> None:
    rng = random.Random(seed)
    stage_offsets = {StageKey("default", None): rng.randrange(0, 9)} if seed % 3 else {}
    finished = [(8, 9), (15, 15)] if seed % 2 else []
    queues = [_queue(False, stage_offsets, finished), _queue(True, stage_offsets, finished)]
    next_offset = 5
    taken: list[list[Batch]] = [[], []]
    for _ in range(60):
        action = rng.random()
        if action < 0.3:
            n = rng.randrange(1, 6)
            messages = [
                Message(topic="t", queue_id=0, queue_offset=o, body=b"x")
                for o in range(next_offset, next_offset + n)
            ]
            next_offset += n
            for pq in queues:
                pq.put_messages(messages)
        elif action < 0.65:
            count = rng.randrange(1, 4)
            for pq, held in zip(queues, taken, strict=True):
                batch = pq.try_take_messages(count)
                if batch is not None:
                    held.append(batch)
            assert len(taken[0]) == len(taken[1])
        elif taken[0]:
            i = rng.randrange(len(taken[0]))
            for pq, held in zip(queues, taken, strict=True):
                pq.erase_messages(held.pop(i), EraseStatus.SUCCESS)
        one, general = queues
        assert one.committed_offset == general.committed_offset
        assert dict(one.committed_stage_offsets) == dict(general.committed_stage_offsets)
        assert one.finished_ranges(10) == general.finished_ranges(10)
