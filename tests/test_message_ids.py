"""RocketMQ's message ids: ``msg_id`` (``getMsgId()``, the producer's ``UNIQ_KEY``) is
the same for every stored copy of a message, its retries and its dead-letter copy
included; ``offset_msg_id`` (``offsetMsgId``) is the id of each stored copy."""

from __future__ import annotations

import pickle

import anyio
import pytest
from trio.testing import MockClock

from stagedconsumer import MemoryBroker, Message, MessageQueue
from stagedconsumer._sources._source import PROPERTY_ORIGIN_MESSAGE_ID

pytestmark = pytest.mark.anyio

VIRTUAL_TRIO = pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-virtual")


@pytest.mark.parametrize("anyio_backend", [VIRTUAL_TRIO])
async def test_retries_and_the_dead_letter_copy_keep_the_message_id() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    sent = broker.send("t", b"x", keys="k")
    assert sent.offset_msg_id == sent.msg_id
    retry = MessageQueue("%RETRY%g", 0)
    copies = [sent]
    for attempt in range(2):
        await broker.send_back("g", copies[-1], delay_level=1)
        with anyio.fail_after(60):
            [retried] = (await broker.pull(retry, attempt, 10, timeout=30)).messages
        copies.append(retried)
    await broker.send_back("g", copies[-1], max_reconsume_times=2)
    [dead] = broker.messages("%DLQ%g")
    copies.append(dead)
    assert [m.msg_id for m in copies] == [sent.msg_id] * 4
    assert len({m.offset_msg_id for m in copies}) == 4  # one id per stored copy
    assert [m.reconsume_times for m in copies] == [0, 1, 2, 2]
    assert all(m.properties[PROPERTY_ORIGIN_MESSAGE_ID] == sent.msg_id for m in copies[1:])


def test_offset_msg_id_defaults_to_msg_id_and_survives_pickling() -> None:
    plain = Message(topic="t", queue_id=0, queue_offset=1, body=b"", msg_id="A")
    assert plain.offset_msg_id == "A"
    copy = Message(topic="t", queue_id=0, queue_offset=1, body=b"", msg_id="A", offset_msg_id="B")
    assert pickle.loads(pickle.dumps(copy)).offset_msg_id == "B"
    assert pickle.loads(pickle.dumps(plain)).offset_msg_id == "A"
