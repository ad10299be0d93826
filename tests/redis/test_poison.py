"""Corrupt data in the keys the broker manages never stops a consumer: garbage in a
retry delay set, poison entries (the broker's fields, corrupt) and foreign entries
(another application's ``XADD``) in a topic's stream."""

from __future__ import annotations

import logging

import pytest
import redis

from stagedconsumer import MessageQueue
from stagedconsumer._sources._redis_broker import RedisBroker

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
