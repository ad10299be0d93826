"""RocketMQ's message ids on Redis: ``msg_id`` stays across retries and dead-lettering,
``offset_msg_id`` is the id of each stored copy (a consumer run included)."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
)
from stagedconsumer._sources._redis_broker import RedisBroker
from stagedconsumer._sources._source import PROPERTY_ORIGIN_MESSAGE_ID

pytestmark = pytest.mark.anyio


@pytest.mark.slow
async def test_retries_and_the_dead_letter_copy_keep_the_message_id(broker: RedisBroker) -> None:
    await broker.create_topic("t", 1)
    sent = await broker.send("t", b"x", keys="k", properties={"a": "b"})
    assert sent.offset_msg_id == sent.msg_id
    [stored] = await broker.messages("t")
    assert (stored.msg_id, stored.offset_msg_id) == (sent.msg_id, sent.msg_id)
    retry = MessageQueue("%RETRY%g", 0)
    copies = [stored]
    for attempt in range(2):
        await broker.send_back("g", copies[-1], delay_level=1)
        with anyio.fail_after(30):
            [retried] = (await broker.pull(retry, attempt, 10, timeout=10)).messages
        copies.append(retried)
    await broker.send_back("g", copies[-1], max_reconsume_times=2)
    [dead] = await broker.messages("%DLQ%g")
    copies.append(dead)
    assert [m.msg_id for m in copies] == [sent.msg_id] * 4
    assert len({m.offset_msg_id for m in copies}) == 4  # one id per stored copy
    assert [m.reconsume_times for m in copies] == [0, 1, 2, 2]
    assert all(m.properties[PROPERTY_ORIGIN_MESSAGE_ID] == sent.msg_id for m in copies[1:])
    assert all(m.properties["a"] == "b" for m in copies)


@pytest.mark.slow
async def test_a_consumer_sees_one_msg_id_for_every_attempt(broker: RedisBroker) -> None:
    await broker.create_topic("t", 2)
    sent = await broker.send("t", b"fails twice", keys="k")
    seen: list[Message] = []

    class FailTwice(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            seen.extend(msgs)
            context.delay_level_when_next_consume = 1
            if msgs[0].reconsume_times < 2:
                raise ValueError("not yet")

    consumer = PushConsumer("g", broker, FailTwice())
    consumer.subscribe("t")
    async with consumer:
        with anyio.fail_after(60):
            while len(seen) < 3:
                await anyio.sleep(0.05)
    assert [m.msg_id for m in seen] == [sent.msg_id] * 3
    assert len({m.offset_msg_id for m in seen}) == 3
    assert [m.topic for m in seen] == ["t"] * 3
