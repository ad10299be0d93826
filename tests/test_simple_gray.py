"""Gray release (RIP-72) for SimpleConsumer on the embedded broker: gray members
receive from the gray queues, normal members from the others, while both kinds are
live; with one kind only, every queue."""

from __future__ import annotations

import pytest

from stagedconsumer import (
    InvalidOptionError,
    MemoryBroker,
    SimpleConsumer,
    SimpleConsumerOptions,
)
from stagedconsumer._runtime._simple_members import gray_queues
from stagedconsumer._sources._gray import gray_member_id

pytestmark = pytest.mark.anyio

RATIO = 0.25  # of 8 queues, 6 and 7 are gray


def member(broker: MemoryBroker, gray: bool, switch: bool = True) -> SimpleConsumer:
    options = (
        SimpleConsumerOptions(enable_gray_switch=True, gray_tag=gray, gray_queue_ratio=RATIO)
        if switch
        else SimpleConsumerOptions()
    )
    return SimpleConsumer(
        "shop", broker, subscriptions={"orders": "*"}, await_duration=0, options=options
    )


def fill(broker: MemoryBroker) -> None:
    for queue_id in range(8):
        for _ in range(3):
            broker.send("orders", b"%d" % queue_id, queue_id=queue_id)


async def drain(consumer: SimpleConsumer) -> set[int]:
    queues: set[int] = set()
    while batch := await consumer.receive(32, 600):
        queues |= {m.queue_id for m in batch}
        await consumer.ack_batch(batch)
    return queues


async def test_gray_and_normal_members_split_the_queues() -> None:
    broker = MemoryBroker()
    broker.create_topic("orders", 8)
    fill(broker)
    async with member(broker, False) as normal, member(broker, True) as canary:
        assert canary.client_id.endswith("@gray[0.25]")
        assert "@gray" not in normal.client_id
        assert await drain(canary) == {6, 7}
        assert await drain(normal) == {0, 1, 2, 3, 4, 5}
        fill(broker)
        assert await drain(normal) == {0, 1, 2, 3, 4, 5}
        # the canary goes away: its queues are not stranded
        await canary.aclose()
        assert await drain(normal) == {6, 7}


async def test_gray_members_alone_receive_every_queue() -> None:
    broker = MemoryBroker()
    broker.create_topic("orders", 8)
    fill(broker)
    async with member(broker, True) as canary:
        assert await drain(canary) == set(range(8))


async def test_a_normal_member_joining_takes_the_normal_queues_from_the_canary() -> None:
    broker = MemoryBroker()
    broker.create_topic("orders", 8)
    async with member(broker, True) as canary:
        fill(broker)
        async with member(broker, False):
            assert await drain(canary) == {6, 7}


def test_gray_options_are_checked_as_on_the_push_side() -> None:
    with pytest.raises(InvalidOptionError, match="needs enable_gray_switch"):
        SimpleConsumerOptions(gray_tag=True)
    with pytest.raises(InvalidOptionError, match="only with"):
        SimpleConsumerOptions(gray_queue_ratio=0.5)
    with pytest.raises(InvalidOptionError, match=r"\(0, 1\]"):
        SimpleConsumerOptions(enable_gray_switch=True, gray_queue_ratio=1.5)


def test_gray_queues_takes_the_largest_ratio_of_the_gray_members() -> None:
    from stagedconsumer import MessageQueue

    queues = [MessageQueue("t", i) for i in range(8)]
    small = gray_member_id("a", 0.125)
    large = gray_member_id("b", 0.5)
    assert gray_queues(["n", small, large], "n", 0.125, queues) == {("t", i) for i in range(4)}
    assert gray_queues(["n", small, large], small, 0.125, queues) == {("t", i) for i in range(4, 8)}
    assert gray_queues([small, large], small, 0.125, queues) is None
    assert gray_queues(["n", "m"], "n", 0.125, queues) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("switch", [True, False])
async def test_dead_letters_from_gray_queues_are_marked_gray(switch: bool) -> None:
    """As the push consumer's: a message dead-lettered from a gray queue has
    ``GRAY=true`` (with the gray switch on), one from a normal queue has not."""
    clock = _Clock()
    broker = MemoryBroker(clock=clock)
    broker.create_topic("orders", 8)
    broker.send("orders", b"normal", queue_id=1)
    broker.send("orders", b"gray", queue_id=7)
    options = (
        SimpleConsumerOptions(
            max_delivery_attempts=1, enable_gray_switch=True, gray_queue_ratio=RATIO
        )
        if switch
        else SimpleConsumerOptions(max_delivery_attempts=1)
    )
    c = SimpleConsumer("shop", broker, subscriptions={"orders": "*"}, await_duration=0,
                       options=options)  # fmt: skip
    async with c:
        assert len(await c.receive(32, 5)) == 2
        clock.now += 5
        assert await c.receive(32, 5) == []
    dead = {m.body: m.properties for m in broker.messages("%DLQ%shop")}
    assert set(dead) == {b"normal", b"gray"}
    assert "GRAY" not in dead[b"normal"]
    assert dead[b"gray"].get("GRAY") == ("true" if switch else None)
