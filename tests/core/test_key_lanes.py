"""Key-ordered lanes: small while a key holds a message or two, the same behaviour
when a key has a backlog (its cache changes container past a few messages), and a
lane's memory bounded (the million-key row of ``benchmarks.memory``)."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from stagedconsumer import Message, MessageQueue
from stagedconsumer._core import ConsumeMode, EraseStatus, ProcessQueue

MQ = MessageQueue("t", 0)


def _key(m: Message) -> str | None:
    return m.keys[0] if m.keys else None


def message(offset: int, key: str | None) -> Message:
    return Message(
        topic="t", queue_id=0, queue_offset=offset, body=b"x", keys=() if key is None else (key,)
    )


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("per_key", [1, 15, 16, 17, 40])
def test_a_key_with_a_backlog_keeps_its_order_and_times(timed: bool, per_key: int) -> None:
    """Messages of two keys (``per_key`` each, interleaved, put in chunks at growing
    times) come out one batch per key at a time, in offset order with their cached
    times, also when batches are given back (untake) or partly given back
    (take_more, untake_rest) on the way."""
    pq = ProcessQueue(MQ, ConsumeMode.KEY_ORDERED, key_of=_key)
    messages = [message(i, "ab"[i % 2]) for i in range(2 * per_key)]
    cached_at: dict[int, float] = {}
    for chunk, start in enumerate(range(0, len(messages), 5)):
        now = float(chunk) if timed else None
        pq.put_messages(messages[start : start + 5], now=now)
        for m in messages[start : start + 5]:
            cached_at[m.queue_offset] = float(chunk) if timed else 0.0
    seen: dict[str, list[int]] = {"a": [], "b": []}
    rounds = 0
    while pq.cached_count:
        rounds += 1
        batch = pq.try_take_messages(3)
        assert batch is not None
        if rounds % 3 == 1:  # given back whole: the next take is the same
            pq.untake_messages(batch)
            again = pq.try_take_messages(3)
            assert again is not None
            assert [m.queue_offset for m in again.messages] == [
                m.queue_offset for m in batch.messages
            ]
            batch = again
        if rounds % 4 == 2 and pq.take_more(batch, 4):  # taken ahead, one kept
            pq.untake_rest(batch, len(batch.messages) - 1)
        key = batch.messages[0].keys[0]
        assert all(m.keys[0] == key for m in batch.messages)
        assert list(batch.cached_times) == [cached_at[m.queue_offset] for m in batch.messages]
        seen[key] += [m.queue_offset for m in batch.messages]
        pq.erase_messages(batch, EraseStatus.SUCCESS)
    assert seen["a"] == [m.queue_offset for m in messages if m.keys[0] == "a"]
    assert seen["b"] == [m.queue_offset for m in messages if m.keys[0] == "b"]
    assert pq.key_count == 0
    assert pq.committed_offset == len(messages)


def test_one_batch_per_key_at_a_time_past_the_small_cache() -> None:
    """A key with more than a small cache's worth: still one batch in a handler at a
    time, the next one only once it finished."""
    pq = ProcessQueue(MQ, ConsumeMode.KEY_ORDERED, key_of=_key)
    pq.put_messages([message(i, "k") for i in range(50)], now=1.0)
    first = pq.try_take_messages(10)
    assert first is not None
    assert [m.queue_offset for m in first.messages] == list(range(10))
    assert pq.try_take_messages(10) is None
    pq.erase_messages(first, EraseStatus.SUCCESS)
    second = pq.try_take_messages(10)
    assert second is not None
    assert second.messages[0].queue_offset == 10


def test_a_key_ordered_lane_takes_at_most_half_a_kib() -> None:
    """8,000 keys with a message cached each (a queue at its flow-control bound, a
    distinct key per message) against the same messages under 10 keys: the traced
    memory of the difference, per key, at most 512 bytes (it was about 2.5 KiB with
    three deques per lane)."""

    def cached(keys: int | None) -> int:
        n = 8000
        messages = [message(i, f"key-{i if keys is None else i % keys}") for i in range(n)]
        pq = ProcessQueue(MQ, ConsumeMode.KEY_ORDERED, key_of=_key)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for start in range(0, n, 32):
                pq.put_messages(messages[start : start + 32])
            return tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()

    per_lane = (cached(None) - cached(10)) / 8000
    assert per_lane <= 512, f"{per_lane:.0f} bytes per key-ordered lane"
