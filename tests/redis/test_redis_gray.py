"""Gray release over Redis: the member id carries the gray flag, so gray and normal
members of one group split the queues as on the embedded broker, and the gray
queues move to the normal member when the gray one leaves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import anyio
import pytest

from offsetstore import MemoryOffsetStore
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    GroupOptions,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    OutgoingMessage,
    PushConsumer,
    SelectMessageQueueByGray,
)
from stagedconsumer._sources._redis_broker import RedisBroker

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

FAST_GROUP = GroupOptions(
    lock_ttl=3.0, lock_renew_interval=0.3, rebalance_interval=0.3, member_ttl=1.0
)


class Lanes(MessageListenerConcurrently):
    def __init__(self, name: str, log: list[tuple[str, Message]]) -> None:
        self.name = name
        self.log = log

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.log.extend((self.name, m) for m in msgs)


@pytest.fixture
async def gray_broker(redis_url: str, namespace: str) -> AsyncIterator[RedisBroker]:
    async with RedisBroker(redis_url, namespace=namespace, group_options=FAST_GROUP) as broker:
        try:
            yield broker
        finally:
            await broker.delete_namespace()


async def _until(predicate: object, timeout: float = 15.0) -> None:
    assert callable(predicate)
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.02)


async def test_gray_and_normal_members_split_the_queues_and_hand_over(
    gray_broker: RedisBroker,
) -> None:
    broker = gray_broker
    await broker.create_topic("t", 8)
    queues = [MessageQueue("t", i) for i in range(8)]
    store = MemoryOffsetStore()
    log: list[tuple[str, Message]] = []
    base = ConsumerOptions(
        enable_gray_switch=True,
        gray_queue_ratio=0.25,
        persist_consumer_offset_interval=0.3,
        pull_long_polling_timeout=0.5,
    )
    normal = PushConsumer("g", broker, Lanes("normal", log), offset_store=store, options=base)
    gray = PushConsumer(
        "g",
        broker,
        Lanes("gray", log),
        offset_store=store,
        options=ConsumerOptions(
            enable_gray_switch=True,
            gray_tag=True,
            gray_queue_ratio=0.25,
            persist_consumer_offset_interval=0.3,
            pull_long_polling_timeout=0.5,
        ),
    )
    normal.subscribe("t")
    gray.subscribe("t")
    selector = SelectMessageQueueByGray(0.25)

    async def send(first: int, n: int) -> None:
        for i in range(first, first + n):
            outgoing_gray = i % 2 == 0
            mq = selector.select(queues, OutgoingMessage.of(b"x", keys=[f"k{i}"]), outgoing_gray)
            await broker.send("t", str(i).encode(), keys=[f"k{i}"], queue_id=mq.queue_id)

    async with normal:
        async with gray:
            await _until(
                lambda: (
                    {mq for mq in gray.assigned_queues if mq.topic == "t"}
                    == {MessageQueue("t", 6), MessageQueue("t", 7)}
                )
            )
            await send(0, 20)
            await _until(lambda: len(log) >= 20)
        await _until(lambda: len([mq for mq in normal.assigned_queues if mq.topic == "t"]) == 8)
        await send(20, 20)
        await _until(lambda: len(log) >= 40)
    assert sorted(int(m.body) for _, m in log) == list(range(40))
    for name, m in log:
        if int(m.body) < 20:
            assert name == ("gray" if int(m.body) % 2 == 0 else "normal")
        else:
            assert name == "normal"


async def test_group_show_prints_members_with_their_gray_flag(
    gray_broker: RedisBroker, redis_url: str, namespace: str
) -> None:
    import sys

    await gray_broker.create_topic("t", 4)
    store = MemoryOffsetStore()
    log: list[tuple[str, Message]] = []
    gray = PushConsumer(
        "g",
        gray_broker,
        Lanes("gray", log),
        offset_store=store,
        options=ConsumerOptions(enable_gray_switch=True, gray_tag=True, gray_queue_ratio=0.5),
    )
    normal = PushConsumer(
        "g",
        gray_broker,
        Lanes("normal", log),
        offset_store=store,
        options=ConsumerOptions(enable_gray_switch=True, gray_queue_ratio=0.5),
    )
    gray.subscribe("t")
    normal.subscribe("t")
    async with gray, normal:
        await _until(lambda: len([mq for mq in gray.assigned_queues if mq.topic == "t"]) == 2)
        args = ["group", "show", "--group", "g", "--topic", "t"]
        args += ["--redis", redis_url, "--redis-namespace", namespace]
        result = await anyio.run_process(
            [sys.executable, "-m", "stagedconsumer", *args], check=False
        )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "2 live member(s)" in out
    assert f"{gray.client_id}  gray (ratio 0.5)" in out
    assert f"{normal.client_id}  normal" in out
    assert f"t#3: {gray.client_id}" in out  # the last half of the queues is gray
    assert f"t#0: {normal.client_id}" in out
