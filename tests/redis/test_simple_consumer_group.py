"""SimpleConsumer groups on Redis across consumers (each with its own broker client,
as in separate processes): the group's settings are checked on join, and gray
release splits the queues."""

from __future__ import annotations

import anyio
import pytest
import redis

from stagedconsumer import ConfigurationError, SimpleConsumer, SimpleConsumerOptions
from stagedconsumer._runtime import _simple_members
from stagedconsumer._sources._redis_broker import RedisBroker

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


def consumer(broker: RedisBroker, **options: object) -> SimpleConsumer:
    return SimpleConsumer(
        "g",
        broker,
        subscriptions={"t": "*"},
        await_duration=0,
        options=SimpleConsumerOptions(**options),  # type: ignore[arg-type]
    )


async def test_a_consumer_with_other_settings_is_refused_while_members_live(
    broker: RedisBroker, redis_url: str, namespace: str, inspect: redis.Redis
) -> None:
    await broker.create_topic("t", 1)
    async with RedisBroker(redis_url, namespace=namespace) as other:
        async with consumer(broker, fifo=True):
            with pytest.raises(ConfigurationError, match="other pop settings") as info:
                async with consumer(other, fifo=False):
                    pass
            assert "fifo=True" in str(info.value)
            assert "max_delivery_attempts=16" in str(info.value)
            with pytest.raises(ConfigurationError, match="other pop settings"):
                async with consumer(other, fifo=True, max_delivery_attempts=3):
                    pass
            async with consumer(other, fifo=True):  # the same settings: welcome
                members = inspect.zrange(f"{namespace}:pop:members:{{pop:g}}", 0, -1)
                assert len(members) == 2
        # nobody runs the group any more: its settings may change
        assert inspect.zcard(f"{namespace}:pop:members:{{pop:g}}") == 0
        async with consumer(other, fifo=False):
            pass


async def test_gray_release_over_redis(
    broker: RedisBroker, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_simple_members, "HEARTBEAT", 0.05)
    await broker.create_topic("t", 4)  # ratio 0.25: queue 3 is gray
    gray = {"enable_gray_switch": True, "gray_queue_ratio": 0.25}

    async def drain(c: SimpleConsumer) -> set[int]:
        queues: set[int] = set()
        while batch := await c.receive(32, 600):
            queues |= {m.queue_id for m in batch}
            await c.ack_batch(batch)
        return queues

    async def fill() -> None:
        for q in range(4):
            await broker.send("t", b"x", queue_id=q)

    async with (
        RedisBroker(redis_url, namespace=namespace) as other,
        consumer(broker, **gray) as normal,
    ):
        async with consumer(other, gray_tag=True, **gray) as canary:
            await fill()
            with anyio.fail_after(10):
                while normal._membership is None or normal._membership.allowed is None:
                    await anyio.sleep(0.02)  # the next heartbeat sees the canary
            assert await drain(normal) == {0, 1, 2}
            assert await drain(canary) == {3}
        await fill()
        with anyio.fail_after(10):
            while normal._membership.allowed is not None:
                await anyio.sleep(0.02)  # the canary left
        assert await drain(normal) == {0, 1, 2, 3}


async def test_an_idle_consumer_keeps_its_presence(
    broker: RedisBroker,
    redis_url: str,
    namespace: str,
    inspect: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer that does not receive still refreshes its presence (a task of its
    own), so the group's settings stay checked past the presence's lifetime."""
    monkeypatch.setattr(_simple_members, "MEMBER_TTL", 0.5)
    monkeypatch.setattr(_simple_members, "HEARTBEAT", 0.1)
    await broker.create_topic("t", 1)
    async with (
        RedisBroker(redis_url, namespace=namespace) as other,
        consumer(broker, fifo=True) as idle,
    ):
        await anyio.sleep(1.2)  # more than two lifetimes, no receive
        members = inspect.zrange(f"{namespace}:pop:members:{{pop:g}}", 0, -1)
        assert [m.decode() for m in members] == [idle.client_id]
        with pytest.raises(ConfigurationError, match="other pop settings"):
            async with consumer(other, fifo=False):
                pass
