from __future__ import annotations

import zlib

import anyio
import pytest
from trio.testing import MockClock

from stagedconsumer import (
    ConfigurationError,
    InvalidMessageError,
    MemoryBroker,
    MessageQueue,
    UnknownTopicError,
)
from stagedconsumer._sources._source import PROPERTY_ORIGIN_MESSAGE_ID, PROPERTY_RETRY_TOPIC

pytestmark = pytest.mark.anyio

VIRTUAL_TRIO = pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-virtual")


def test_create_topic_and_queues() -> None:
    broker = MemoryBroker()
    assert broker.create_topic("t", 3) == [MessageQueue("t", i) for i in range(3)]
    assert broker.create_topic("t", 3) == [MessageQueue("t", i) for i in range(3)]
    with pytest.raises(ConfigurationError, match="exists with 3 queues"):
        broker.create_topic("t", 4)
    with pytest.raises(ConfigurationError, match="queue_count"):
        broker.create_topic("u", 0)
    with pytest.raises(ConfigurationError, match="reserved"):
        broker.create_topic("%RETRY%g", 1)


def test_send_to_unknown_topic_names_it() -> None:
    broker = MemoryBroker()
    broker.create_topic("known", 1)
    with pytest.raises(UnknownTopicError, match=r"'missing'.*known"):
        broker.send("missing", b"x")


def test_queue_selection_by_key_hash_round_robin_and_explicit() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 4)
    keyed = [broker.send("t", b"x", keys=["order-7"]) for _ in range(3)]
    assert {m.queue_id for m in keyed} == {zlib.crc32(b"order-7") % 4}
    assert [m.queue_offset for m in keyed] == [0, 1, 2]
    plain = [broker.send("t", b"x") for _ in range(8)]
    assert [m.queue_id for m in plain] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert broker.send("t", b"x", queue_id=2).queue_id == 2
    with pytest.raises(InvalidMessageError, match="out of range"):  # as Producer.send
        broker.send("t", b"x", queue_id=4)


def test_message_fields() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    m = broker.send("t", b"body", keys="k", tags="a", properties={"p": "v"})
    assert (m.topic, m.queue_id, m.queue_offset, m.body) == ("t", 0, 0, b"body")
    assert m.keys == ("k",)
    assert m.tags == "a"
    assert dict(m.properties) == {"p": "v"}
    assert m.msg_id
    assert m.born_timestamp > 0
    assert m.reconsume_times == 0
    other = broker.send("t", b"body")
    assert other.msg_id != m.msg_id


async def test_pull_by_offset_in_batches() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for i in range(10):
        broker.send("t", str(i).encode(), queue_id=0)
    mq = MessageQueue("t", 0)
    result = await broker.pull(mq, 3, 4)
    assert [m.queue_offset for m in result.messages] == [3, 4, 5, 6]
    assert result.next_offset == 7
    assert result.max_offset == 10
    assert await broker.max_offset(mq) == 10
    empty = await broker.pull(mq, 10, 4)
    assert list(empty.messages) == []
    assert empty.next_offset == 10


async def test_long_poll_wakes_on_send() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    mq = MessageQueue("t", 0)
    got: list[int] = []

    async def pull() -> None:
        result = await broker.pull(mq, 0, 10, timeout=30)
        got.extend(m.queue_offset for m in result.messages)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(pull)
            await anyio.wait_all_tasks_blocked()
            broker.send("t", b"x")
    assert got == [0]


async def test_long_poll_times_out_empty() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    result = await broker.pull(MessageQueue("t", 0), 0, 10, timeout=0.01)
    assert list(result.messages) == []


@pytest.mark.parametrize("anyio_backend", [VIRTUAL_TRIO])
async def test_send_back_waits_rocketmq_delay_then_appears_in_retry_queue() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    original = broker.send("t", b"x", keys="k", tags="a")
    retry = MessageQueue("%RETRY%g", 0)
    start = anyio.current_time()
    assert (await broker.send_back("g", original)).value == "retry"
    assert await broker.max_offset(retry) == 0  # level 3: 10 s
    result = await broker.pull(retry, 0, 10, timeout=60)
    assert anyio.current_time() - start >= 10
    (retried,) = result.messages
    assert retried.reconsume_times == 1
    assert retried.body == b"x"
    assert retried.keys == ("k",)
    assert retried.tags == "a"
    assert retried.properties[PROPERTY_RETRY_TOPIC] == "t"
    assert retried.properties[PROPERTY_ORIGIN_MESSAGE_ID] == original.msg_id


async def test_send_back_spent_goes_to_dlq() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    original = broker.send("t", b"x")
    assert (await broker.send_back("g", original, max_reconsume_times=0)).value == "dlq"
    (dead,) = broker.messages("%DLQ%g")
    assert dead.body == b"x"
    assert dead.properties[PROPERTY_ORIGIN_MESSAGE_ID] == original.msg_id
    assert (await broker.send_back("g", original, delay_level=-1)).value == "dlq"
    assert len(broker.messages("%DLQ%g")) == 2


def test_statistics() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 2)
    broker.send_many("t", [b"a", b"b", b"c"])
    stats = broker.statistics()
    assert stats.topics == {"t": 2}
    assert stats.messages == 3
    assert stats.delayed == 0


def test_broker_serves_a_second_event_loop_after_cancelled_pull() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    mq = MessageQueue("t", 0)

    async def abandoned_pull() -> None:
        with anyio.move_on_after(0.01):
            await broker.pull(mq, 0, 1, timeout=10)

    async def later() -> int:
        async def send_soon() -> None:
            await anyio.sleep(0.01)
            broker.send("t", b"x")

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_soon)
            result = await broker.pull(mq, 0, 1, timeout=5)
        return len(result.messages)

    anyio.run(abandoned_pull)
    assert anyio.run(later) == 1


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"tags": 5}, "tags must be a string or None, got int"),
        ({"properties": {"a": 1}}, "properties must map str to str"),
        ({"properties": {1: "a"}}, "properties must map str to str"),
        ({"properties": "x"}, "properties must be a mapping of str to str, got str"),
        ({"keys": [1, 2]}, "keys must be strings, got int"),
        ({"keys": None}, "keys must be a string or a sequence of strings, got NoneType"),
        ({"body": "text"}, "body must be bytes, got str"),
    ],
)
def test_send_checks_the_message_as_the_producer_does(
    fields: dict[str, object], fragment: str
) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 2)
    kwargs: dict[str, object] = {"body": b"x", **fields}
    body = kwargs.pop("body")
    with pytest.raises(InvalidMessageError) as info:
        broker.send("t", body, **kwargs)  # type: ignore[arg-type]
    assert fragment in str(info.value)
    for q in (0, 1):  # nothing stored
        assert anyio.run(broker.max_offset, MessageQueue("t", q)) == 0


def test_send_rejects_a_queue_id_that_is_not_an_int() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 2)
    with pytest.raises(InvalidMessageError, match="queue_id must be an int"):
        broker.send("t", b"x", queue_id="0")  # type: ignore[arg-type]
