"""The core's settlement helpers, shared by the runtime's consume services and the
replay's core engine."""

from __future__ import annotations

from stagedconsumer import Message
from stagedconsumer._core import split_exhausted


def _message(offset: int, reconsume_times: int) -> Message:
    return Message(
        topic="t", queue_id=0, queue_offset=offset, body=b"", reconsume_times=reconsume_times
    )


def test_split_exhausted_sends_used_up_messages_to_the_dead_letter_queue_in_batch_order() -> None:
    batch = [_message(0, 3), _message(1, 0), _message(2, 2), _message(3, 5)]
    suspended, exhausted = split_exhausted(batch, 3)
    assert [m.queue_offset for m in suspended] == [1, 2]
    assert [m.queue_offset for m in exhausted] == [0, 3]


def test_split_exhausted_without_a_limit_suspends_every_message() -> None:
    batch = [_message(0, 1000), _message(1, 0)]
    suspended, exhausted = split_exhausted(batch, None)
    assert suspended == batch
    assert exhausted == []


def test_split_exhausted_with_limit_zero_suspends_nothing() -> None:
    batch = [_message(0, 0), _message(1, 0)]
    assert split_exhausted(batch, 0) == ([], batch)
