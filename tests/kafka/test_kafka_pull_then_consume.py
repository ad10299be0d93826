"""A pull on a broker object, then a consumer of the same object.

A pull assigns its partition to the broker's fetching consumer, which from then on
keeps a fetch of it open (aiokafka fetches ahead in the background; a broker answers
one connection's requests in order). Offset look-ups made on that consumer waited
for the open fetch's long poll, 500 ms each: a push consumer taking over its
partitions (and its 18 retry partitions) after a pull outlasted the lease of what it
was granted and consumed nothing. Look-ups go through a consumer of their own."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    KafkaBroker,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
)
from tests.kafka.conftest import send_messages

pytestmark = [pytest.mark.anyio, pytest.mark.kafka]

OPTIONS = ConsumerOptions(
    persist_consumer_offset_interval=0.2, pull_long_polling_timeout=0.5, shutdown_timeout=5
)


class _Seen(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.seen: list[Message] = []
        self.event = anyio.Event()

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.seen.extend(msgs)
        self.event.set()


async def test_offset_lookups_do_not_wait_for_the_fetch_a_pull_left_open(
    broker: KafkaBroker, name: str
) -> None:
    await broker.create_topic(name, 1)
    await send_messages(broker, name, 1)
    mq = MessageQueue(name, 0)
    assert [m.body for m in (await broker.pull(mq, 0, 10, timeout=5)).messages] == [b"m0"]
    # the fetcher now long-polls the partition (500 ms a fetch): 20 look-ups behind
    # those fetches took about 10 s (each waits for a fetch to come back); on a
    # connection of their own, milliseconds each. The bound is half the time the
    # look-ups take queued behind the fetches, generous for a loaded machine.
    started = anyio.current_time()
    for _ in range(10):
        assert await broker.min_offset(mq) == 0
        assert await broker.max_offset(mq) == 1
    assert anyio.current_time() - started < 5.0


@pytest.mark.slow
async def test_a_push_consumer_consumes_after_a_pull_on_the_same_broker(
    broker: KafkaBroker, name: str
) -> None:
    await broker.create_topic(name, 1)
    await send_messages(broker, name, 1)
    pulled = await broker.pull(MessageQueue(name, 0), 0, 10, timeout=5)
    assert [m.body for m in pulled.messages] == [b"m0"]
    listener = _Seen()
    consumer = PushConsumer(name, broker, listener, options=OPTIONS)
    consumer.subscribe(name)
    async with consumer:
        with anyio.move_on_after(15):
            await listener.event.wait()
    assert [m.body for m in listener.seen] == [b"m0"]
