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
from tests.test_gray import ConcurrentLog

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


@pytest.mark.slow
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


@pytest.mark.slow
async def test_gray_retries_go_through_the_gray_retry_queue_to_the_gray_member_only(
    gray_broker: RedisBroker,
) -> None:
    broker = gray_broker
    queues = await broker.create_topic("t", 8)
    assert await broker.get_queues("%RETRY%g") == [
        MessageQueue("%RETRY%g", 0),
        MessageQueue("%RETRY%g", 1),
    ]
    store = MemoryOffsetStore()
    log: list[tuple[str, Message]] = []
    fast = {"persist_consumer_offset_interval": 0.3, "pull_long_polling_timeout": 0.5}
    options = {"enable_gray_switch": True, "gray_queue_ratio": 0.25, "max_reconsume_times": 2}
    gray = PushConsumer(
        "g",
        broker,
        ConcurrentLog("gray", log, fail_keys=True),
        offset_store=store,
        options=ConsumerOptions(gray_tag=True, **options, **fast),  # type: ignore[arg-type]
    )
    normal = PushConsumer(
        "g",
        broker,
        ConcurrentLog("normal", log, fail_keys=True),
        offset_store=store,
        options=ConsumerOptions(**options, **fast),  # type: ignore[arg-type]
    )
    gray.subscribe("t")
    normal.subscribe("t")
    selector = SelectMessageQueueByGray(0.25)
    async with gray, normal:
        # 8 queues of t and the 2 retry queues, each held by one member
        gray_side = {MessageQueue("t", 6), MessageQueue("t", 7), MessageQueue("%RETRY%g", 1)}
        await _until(
            lambda: set(gray.assigned_queues) == gray_side and len(normal.assigned_queues) == 7
        )
        assert MessageQueue("%RETRY%g", 0) in normal.assigned_queues
        for i in range(20):
            key = f"{'fail' if i % 5 == 0 else 'ok'}-{i}"  # 0, 10 gray; 5, 15 normal
            mq = selector.select(queues, OutgoingMessage.of(b"x", keys=[key]), i % 2 == 0)
            await broker.send("t", str(i).encode(), keys=[key], queue_id=mq.queue_id)

        async def dead_lettered() -> int:
            return len(await broker.messages("%DLQ%g"))

        with anyio.fail_after(30):
            while await dead_lettered() < 4:  # each failing message: 3 attempts, then DLQ
                await anyio.sleep(0.1)
    for name, m in log:
        assert name == ("gray" if int(m.body) % 2 == 0 else "normal"), (name, m.body)
    retried = sorted((int(m.body), name) for name, m in log if m.reconsume_times > 0)
    assert (
        retried
        == [(0, "gray")] * 2 + [(5, "normal")] * 2 + [(10, "gray")] * 2 + [(15, "normal")] * 2
    )
    gray_retry = await broker.messages("%RETRY%g", 1)
    normal_retry = await broker.messages("%RETRY%g", 0)
    assert sorted(int(m.body) for m in gray_retry) == [0, 0, 10, 10]
    assert sorted(int(m.body) for m in normal_retry) == [5, 5, 15, 15]
    dlq = {int(m.body): m.properties.get("GRAY") for m in await broker.messages("%DLQ%g")}
    assert dlq == {0: "true", 5: None, 10: "true", 15: None}


@pytest.mark.slow
@pytest.mark.parametrize("producers", ["all-gray", "mixed", "all-normal"])
@pytest.mark.parametrize("consumers", ["all-gray", "mixed", "all-normal"])
async def test_case_matrix_over_redis(
    gray_broker: RedisBroker, producers: str, consumers: str
) -> None:
    """RIP-72's case matrix: producers all gray, mixed or all normal, crossed with
    consumers all gray, mixed or all normal. While both kinds live, each consumes its
    side only; with one kind only, it consumes every queue (nothing stranded); every
    message once."""
    broker = gray_broker
    queues = await broker.create_topic("t", 8)
    store = MemoryOffsetStore()
    log: list[tuple[str, Message]] = []
    kinds = {"all-gray": [True, True], "mixed": [True, False], "all-normal": [False, False]}
    members = []
    for i, is_gray in enumerate(kinds[consumers]):
        options = ConsumerOptions(
            enable_gray_switch=True,
            gray_tag=is_gray,
            gray_queue_ratio=0.25,
            persist_consumer_offset_interval=0.3,
            pull_long_polling_timeout=0.5,
        )
        name = f"{'gray' if is_gray else 'normal'}{i}"
        member = PushConsumer("g", broker, Lanes(name, log), offset_store=store, options=options)
        member.subscribe("t")
        members.append(member)
    selector = SelectMessageQueueByGray(0.25)
    gray_queues = {MessageQueue("t", 6), MessageQueue("t", 7)}

    def settled() -> bool:
        owned = [{mq for mq in m.assigned_queues if mq.topic == "t"} for m in members]
        if sum(map(len, owned)) != 8:
            return False
        return consumers != "mixed" or owned[0] == gray_queues

    async with members[0], members[1]:
        await _until(settled)
        for i in range(40):
            is_gray = {"all-gray": True, "all-normal": False, "mixed": i % 2 == 0}[producers]
            mq = selector.select(queues, OutgoingMessage.of(b"x", keys=[f"k{i}"]), is_gray)
            await broker.send("t", str(i).encode(), keys=[f"k{i}"], queue_id=mq.queue_id)
        await _until(lambda: len(log) >= 40)
        await anyio.sleep(0.2)  # a duplicate would show up by now
    assert sorted(int(m.body) for _, m in log) == list(range(40)), "lost or handled twice"
    for name, m in log:
        on_gray_queue = MessageQueue("t", m.queue_id) in gray_queues
        if consumers == "mixed":
            assert name.startswith("gray") == on_gray_queue, (name, m.queue_id)
        else:
            assert name.startswith("gray" if consumers == "all-gray" else "normal")
