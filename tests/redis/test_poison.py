"""Corrupt data in the keys the broker manages never stops a consumer: garbage in a
retry delay set, poison entries (the broker's fields, corrupt) and foreign entries
(another application's ``XADD``) in a topic's stream."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
import redis

from offsetstore import MemoryOffsetStore
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageQueue,
    PushConsumer,
    SourceError,
)
from stagedconsumer._sources._redis_broker import RedisBroker
from tests.redis.conftest import entry_id

pytestmark = pytest.mark.anyio


async def test_a_garbage_member_of_the_delay_set_is_moved_aside_and_the_retries_go_on(
    broker: RedisBroker, inspect: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    await broker.create_topic("t", 1)
    original = await broker.send("t", b"payload")
    delay = f"{broker.namespace}:delay:{{%RETRY%g:0}}"
    bad = f"{broker.namespace}:delay-bad:{{%RETRY%g:0}}"
    # Due at once, before and after a real retry: not <len>:<bytes> pairs, a length
    # past the end, an odd field count.
    inspect.zadd(delay, {b"garbage": 0, b"99:short": 1, b"1:i1:x1:b": 2})
    await broker.send_back("g", original, delay_level=1)
    inspect.zadd(delay, {b"secret-garbage-after": 3})
    [retry_member] = inspect.zrange(delay, -1, -1)
    assert isinstance(retry_member, bytes)
    inspect.zadd(delay, {retry_member: 0})  # the retry: due now
    retry = MessageQueue("%RETRY%g", 0)
    with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
        [retried] = (await broker.pull(retry, 0, 10)).messages
        assert (await broker.pull(retry, 1, 10)).messages == []
    assert retried.body == b"payload"
    assert retried.reconsume_times == 1
    assert inspect.zcard(delay) == 0
    assert sorted(inspect.lrange(bad, 0, -1)) == sorted(
        [b"garbage", b"99:short", b"1:i1:x1:b", b"secret-garbage-after"]
    )
    assert broker.statistics().bad_retries == 4
    warnings = [r.getMessage() for r in caplog.records if "not a retry" in r.getMessage()]
    assert len(warnings) == 4  # once each, though pulled twice
    assert all(delay in w and bad in w for w in warnings)
    assert not any("secret" in w for w in warnings)  # sizes, not contents


def _corrupt(inspect: redis.Redis, broker: RedisBroker, fields: dict[bytes, bytes]) -> str:
    """Append an entry with the broker's layout (the next offset, the counter raised)
    and ``fields``: what a bug or a bit flip in a writer would leave. Its entry id."""
    seq = f"{broker.namespace}:seq:{{t:0}}"
    offset = int(inspect.get(seq) or 0)
    entry = f"{offset + 1}-0"
    inspect.xadd(f"{broker.namespace}:q:{{t:0}}", fields, id=entry)  # type: ignore[arg-type]
    inspect.set(seq, offset + 1)
    return entry


POISON: list[tuple[dict[bytes, bytes], str]] = [
    ({b"i": b"x", b"b": b"body", b"t": b"soon"}, "ValueError"),
    ({b"i": b"\xff\xfe", b"b": b"body", b"t": b"1"}, "UnicodeDecodeError"),
    ({b"i": b"x", b"b": b"body", b"t": b"1", b"k": b"not json"}, "JSONDecodeError"),
    ({b"i": b"x", b"b": b"body", b"t": b"1", b"p": b"[1, 2]"}, "TypeError"),
    ({b"i": b"x", b"b": b"body", b"t": b"1", b"p": b'{"a": 1}'}, "TypeError"),
    ({b"i": b"x", b"b": b"body", b"t": b"1", b"k": b'"one"'}, "TypeError"),
]


async def test_poison_entries_are_returned_beside_the_messages_around_them(
    broker: RedisBroker, inspect: redis.Redis
) -> None:
    await broker.create_topic("t", 1)
    await broker.send("t", b"before", queue_id=0)
    entries = [_corrupt(inspect, broker, fields) for fields, _ in POISON]
    await broker.send("t", b"after", queue_id=0)
    mq = MessageQueue("t", 0)
    result = await broker.pull(mq, 0, 32)
    assert [m.body for m in result.messages] == [b"before", b"after"]
    assert [m.queue_offset for m in result.messages] == [0, len(POISON) + 1]
    assert result.next_offset == result.max_offset == len(POISON) + 2
    assert [u.offset for u in result.undecodable] == list(range(1, len(POISON) + 1))
    assert [u.error.split(":")[0] for u in result.undecodable] == [e for _, e in POISON]
    for poison, entry, (fields, _) in zip(result.undecodable, entries, POISON, strict=True):
        assert poison.message.properties["POISON_ENTRY_ID"] == entry
        assert poison.message.properties["POISON_STREAM"] == f"{broker.namespace}:q:{{t:0}}"
        assert poison.message.properties["DECODE_ERROR"] == poison.error
        assert poison.message.body == b"body"
        assert dict(poison.fields) == fields
    # One at a time (no read-ahead), every offset is served once.
    broker.read_ahead = 0
    seen: list[int] = []
    offset = 0
    while offset < len(POISON) + 2:
        step = await broker.pull(mq, offset, 1)
        seen += [m.queue_offset for m in step.messages] + [u.offset for u in step.undecodable]
        offset = step.next_offset
    assert seen == list(range(len(POISON) + 2))


async def test_a_poison_entry_can_stop_the_queue_instead(
    redis_url: str, namespace: str, inspect: redis.Redis
) -> None:
    async with RedisBroker(redis_url, namespace=namespace, poison_entries="stop") as broker:
        try:
            await broker.create_topic("t", 1)
            await broker.send("t", b"before", queue_id=0)
            entry = _corrupt(inspect, broker, {b"i": b"x", b"b": b"secret", b"t": b"soon"})
            await broker.send("t", b"after", queue_id=0)
            mq = MessageQueue("t", 0)
            first = await broker.pull(mq, 0, 32)
            assert [m.body for m in first.messages] == [b"before"]
            assert first.next_offset == 1
            with pytest.raises(SourceError) as stopped:
                await broker.pull(mq, 1, 32)
            text = str(stopped.value)
            assert not stopped.value.retriable
            assert f"{namespace}:q:{{t:0}}" in text
            assert entry in text
            assert "ValueError" in text
            assert "'b': 6 bytes" in text
            assert "secret" not in text
        finally:
            await broker.delete_namespace()


async def test_a_foreign_entry_stops_the_queue_after_the_messages_before_it(
    broker: RedisBroker, inspect: redis.Redis
) -> None:
    await broker.create_topic("t", 1)
    for i in range(3):
        await broker.send("t", b"m%d" % i, queue_id=0)
    stream = f"{broker.namespace}:q:{{t:0}}"
    foreign = entry_id(inspect.xadd(stream, {"card": "4111-1111-1111-1111"})).decode()
    mq = MessageQueue("t", 0)
    result = await broker.pull(mq, 0, 32)  # read ahead: the foreign entry in the same read
    assert [m.body for m in result.messages] == [b"m0", b"m1", b"m2"]
    assert result.next_offset == 3
    with pytest.raises(SourceError, match=f"holds a foreign entry {foreign}") as stopped:
        await broker.pull(mq, 3, 32)
    assert "'card': 19 bytes" in str(stopped.value)
    assert "4111" not in str(stopped.value)


class _Bodies(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.bodies.extend(m.body for m in msgs)


class _OrderlyBodies(MessageListenerOrderly):
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        self.bodies.extend(m.body for m in msgs)


@pytest.mark.parametrize("orderly", [False, True], ids=["concurrent", "orderly"])
async def test_a_consumer_dead_letters_poison_entries_and_consumes_around_them(
    broker: RedisBroker,
    inspect: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    orderly: bool,
) -> None:
    await broker.create_topic("t", 1)
    await broker.send("t", b"before", queue_id=0)
    entries = [_corrupt(inspect, broker, fields) for fields, _ in POISON[:3]]
    await broker.send("t", b"after", queue_id=0)
    listener = _OrderlyBodies() if orderly else _Bodies()
    store = MemoryOffsetStore()
    with caplog.at_level(logging.ERROR, logger="stagedconsumer"):
        for _ in range(2):  # a restart does not see them again
            consumer = PushConsumer("g", broker, listener, offset_store=store)
            consumer.subscribe("t")
            async with consumer:
                await consumer.wait_caught_up(timeout=30)
                stats = consumer.statistics()
            if not stats.undecodable_entries:
                break
            assert stats.undecodable_entries == 3
            assert stats.committed_offsets[MessageQueue("t", 0)] == 5
    assert listener.bodies == [b"before", b"after"]
    logged = [r.getMessage() for r in caplog.records if "cannot be decoded" in r.getMessage()]
    assert len(logged) == 3
    assert all("%DLQ%g" in line for line in logged)
    dead = await broker.messages("%DLQ%g")
    assert [m.properties["POISON_ENTRY_ID"] for m in dead] == entries
    assert [m.properties["DECODE_ERROR"].split(":")[0] for m in dead] == [e for _, e in POISON[:3]]
    assert all(m.body == b"body" for m in dead)
    # The dead-letter entries keep the poison entries' fields as stored.
    raw: Any = inspect.xrange(f"{broker.namespace}:q:{{%DLQ%g:0}}")
    for (_, stored), (fields, _) in zip(raw, POISON[:3], strict=True):
        assert {k[4:]: v for k, v in stored.items() if k.startswith(b"raw:")} == fields
