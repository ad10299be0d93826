"""attach_stream says when a key does not exist and when entries lack the body field
(each most often a typo that would consume nothing, or empty bodies)."""

from __future__ import annotations

import logging

import pytest
import redis

from stagedconsumer._sources._redis_broker import RedisBroker

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


async def test_attaching_a_key_that_does_not_exist_warns(
    broker: RedisBroker, namespace: str, inspect: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    there, typo = f"{namespace}:orders", f"{namespace}:ordres"
    inspect.xadd(there, {"body": "x"})
    try:
        with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
            await broker.attach_stream("orders", [there, typo])
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert f"no stream {typo} exists (yet); attached anyway" in warnings[0]
        assert there not in warnings[0]
    finally:
        inspect.delete(there)


async def test_a_body_field_the_entries_do_not_have_warns(
    broker: RedisBroker, namespace: str, inspect: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    key = f"{namespace}:payments"
    inspect.xadd(key, {"payload": "x", "shop": "s1"})
    try:
        with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
            await broker.attach_stream("payments", key, body_field="body")
            warnings = [r.getMessage() for r in caplog.records]
            assert len(warnings) == 1, warnings
            assert (
                f"the last entry of {key} (fields 'payload', 'shop') has no field 'body'"
                in (warnings[0])
            )
            caplog.clear()
            await broker.attach_stream("payments2", key, body_field="payload")  # right
            await broker.attach_stream("payments3", key, decode=lambda i, f: f)  # type: ignore[arg-type,return-value]
            assert not caplog.records
    finally:
        inspect.delete(key)
