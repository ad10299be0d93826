"""RedisBroker against a real Redis: offsets, pulls, long polling, retries, DLQ, outages."""

from __future__ import annotations

import socket
import time
import zlib
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import redis.exceptions

from benchmarks._ports import free_port
from offsetstore import MemoryOffsetStore
from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    InvalidMessageError,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
    SourceError,
    UnknownTopicError,
)
from stagedconsumer._sources._redis_broker import RedisBroker
from stagedconsumer._sources._source import (
    PROPERTY_ORIGIN_MESSAGE_ID,
    PROPERTY_RETRY_TOPIC,
    SendBackResult,
)
from tests.redis._server import RedisServer
from tests.redis.conftest import entry_id

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


async def test_offsets_are_consecutive_per_queue_and_entry_ids_derive_from_them(
    broker: RedisBroker,
    inspect: redis.Redis,
) -> None:
    await broker.create_topic("t", 2)
    sent = [await broker.send("t", b"m%d" % i, queue_id=i % 2) for i in range(10)]
    assert [m.queue_offset for m in sent if m.queue_id == 0] == [0, 1, 2, 3, 4]
    assert [m.queue_offset for m in sent if m.queue_id == 1] == [0, 1, 2, 3, 4]
    entries = inspect.xrange(f"{broker.namespace}:q:{{t:0}}", "-", "+")
    assert entries is not None
    assert [entry[0] for entry in entries] == [b"1-0", b"2-0", b"3-0", b"4-0", b"5-0"]
    assert await broker.max_offset(MessageQueue("t", 0)) == 5
    assert await broker.min_offset(MessageQueue("t", 0)) == 0


async def test_pull_by_offset_in_batches_round_trips_every_field(broker: RedisBroker) -> None:
    await broker.create_topic("t", 1)
    first = await broker.send(
        "t", b"\x00body\xff", keys=["k1", "k2"], tags="tagA", properties={"a": "1", "b": ":"}
    )
    for i in range(99):
        await broker.send("t", b"%d" % i)
    mq = MessageQueue("t", 0)
    pulled = await broker.pull(mq, 0, 32)
    assert len(pulled.messages) == 32
    assert pulled.next_offset == 32
    got = pulled.messages[0]
    assert got == first
    assert (got.body, got.keys, got.tags, dict(got.properties)) == (
        b"\x00body\xff",
        ("k1", "k2"),
        "tagA",
        {"a": "1", "b": ":"},
    )
    assert got.msg_id == first.msg_id
    assert abs(got.born_timestamp - time.time()) < 60
    assert got.reconsume_times == 0
    offsets = []
    offset = 0
    while True:
        result = await broker.pull(mq, offset, 32)
        if not result.messages:
            assert result.max_offset == 100
            assert result.next_offset == 100
            break
        offsets += [m.queue_offset for m in result.messages]
        offset = result.next_offset
    assert offsets == list(range(100))
    middle = await broker.pull(mq, 57, 3)
    assert [m.queue_offset for m in middle.messages] == [57, 58, 59]
    assert [m.body for m in middle.messages] == [b"56", b"57", b"58"]


def _count_xranges(broker: RedisBroker, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the COUNT of every XRANGE the broker sends."""
    counts: list[int] = []
    connection = broker._connection
    execute = connection.execute

    async def counting(*args: Any, **options: Any) -> Any:
        if args[0] == "XRANGE":
            counts.append(int(args[-1]))
        return await execute(*args, **options)

    monkeypatch.setattr(connection, "execute", counting)
    return counts


async def test_read_ahead_serves_the_next_pulls_of_a_queue_without_a_round_trip(
    broker: RedisBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    await broker.create_topic("t", 1)
    await broker.send_many("t", [b"%d" % i for i in range(100)], queue_id=0)
    mq = MessageQueue("t", 0)
    counts = _count_xranges(broker, monkeypatch)
    broker.read_ahead = 64
    first = await broker.pull(mq, 0, 16)
    assert [m.queue_offset for m in first.messages] == list(range(16))
    assert (first.next_offset, first.max_offset) == (16, 64)  # a lower bound
    assert counts == [64]
    offset, bodies = 16, [m.body for m in first.messages]
    for _ in range(3):
        result = await broker.pull(mq, offset, 16)
        bodies += [m.body for m in result.messages]
        offset = result.next_offset
    assert offset == 64
    assert counts == [64]  # served from what the first XRANGE read
    assert bodies == [b"%d" % i for i in range(64)]
    # A pull from elsewhere reads again, and reads only what is left.
    again = await broker.pull(mq, 10, 4)
    assert [m.body for m in again.messages] == [b"10", b"11", b"12", b"13"]
    assert counts == [64, 64]
    rest = await broker.pull(mq, 64, 100)
    assert [m.queue_offset for m in rest.messages] == list(range(64, 100))
    assert (rest.next_offset, rest.max_offset) == (100, 100)  # short read: exact
    broker.read_ahead = 0
    await broker.pull(mq, 0, 5)
    assert counts == [64, 64, 100, 5]


async def test_offsets_come_from_entry_ids_when_entries_were_deleted(
    broker: RedisBroker,
    inspect: redis.Redis,
) -> None:
    await broker.create_topic("t", 1)
    await broker.send_many("t", [b"%d" % i for i in range(10)], queue_id=0)
    inspect.xdel(f"{broker.namespace}:q:{{t:0}}", b"4-0", b"5-0")
    pulled = await broker.pull(MessageQueue("t", 0), 0, 32)
    assert [m.queue_offset for m in pulled.messages] == [0, 1, 2, 5, 6, 7, 8, 9]
    assert [m.body for m in pulled.messages] == [b"0", b"1", b"2", b"5", b"6", b"7", b"8", b"9"]
    assert (pulled.next_offset, pulled.max_offset) == (10, 10)


def _send_during_min_offset(
    broker: RedisBroker, producer: RedisBroker, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    """Make ``producer`` append ``count`` messages to ``t#0`` right after the first
    Redis round trip of ``broker.min_offset(t#0)`` (a producer racing a consumer that
    starts on a queue without committed progress)."""
    once = broker._connection.call
    sent = False

    async def once_then_send(what: str, call: Any) -> Any:
        nonlocal sent
        result = await once(what, call)
        if what == "reading the min offset of t#0" and not sent:
            sent = True
            await producer.send_many("t", [b"x"] * count, queue_id=0)
        return result

    monkeypatch.setattr(broker._connection, "call", once_then_send)


async def test_min_offset_of_an_empty_queue_never_passes_a_message_sent_meanwhile(
    broker: RedisBroker, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A queue read empty must not report the counter read later: messages sent in
    # between would be skipped by a consumer starting there (no committed progress).
    await broker.create_topic("t", 1)
    async with RedisBroker(redis_url, namespace=broker.namespace) as producer:
        _send_during_min_offset(broker, producer, monkeypatch, 10)
        assert await broker.min_offset(MessageQueue("t", 0)) == 0
    assert await broker.max_offset(MessageQueue("t", 0)) == 10


async def test_a_consumer_starting_on_an_empty_queue_while_a_producer_sends_loses_nothing(
    broker: RedisBroker, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Listener(MessageListenerConcurrently):
        def __init__(self) -> None:
            self.offsets: list[int] = []

        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            self.offsets.extend(m.queue_offset for m in msgs)

    await broker.create_topic("t", 1)
    listener = Listener()
    consumer = PushConsumer(
        "g", broker, listener, options=ConsumerOptions(pull_long_polling_timeout=0.2)
    )
    consumer.subscribe("t")
    async with RedisBroker(redis_url, namespace=broker.namespace) as producer:
        _send_during_min_offset(broker, producer, monkeypatch, 10)
        async with consumer:
            monkeypatch.undo()
            await consumer.wait_caught_up(timeout=10)
            assert sorted(listener.offsets) == list(range(10))


async def test_a_connection_error_drops_what_was_read_ahead(
    broker: RedisBroker,
    monkeypatch: pytest.MonkeyPatch,
    inspect: redis.Redis,
) -> None:
    # After an outage Redis may have restarted without its data and reuse offsets.
    await broker.create_topic("t", 1)
    await broker.send_many("t", [b"old%d" % i for i in range(10)], queue_id=0)
    mq = MessageQueue("t", 0)
    assert len((await broker.pull(mq, 0, 2)).messages) == 2
    connection = broker._connection
    execute = connection.execute

    async def failing(*args: Any, **options: Any) -> Any:
        raise redis.exceptions.ConnectionError("gone")

    monkeypatch.setattr(connection, "execute", failing)
    with pytest.raises(SourceError):
        await broker.pull(mq, 7, 2)
    monkeypatch.setattr(connection, "execute", execute)
    ns = broker.namespace
    inspect.delete(f"{ns}:q:{{t:0}}", f"{ns}:seq:{{t:0}}")  # the data loss
    await broker.send_many("t", [b"new%d" % i for i in range(10)], queue_id=0)
    pulled = await broker.pull(mq, 2, 2)
    assert [m.body for m in pulled.messages] == [b"new2", b"new3"]


async def test_queue_choice_crc32_of_first_key_round_robin_or_explicit(
    broker: RedisBroker,
) -> None:
    await broker.create_topic("t", 8)
    for key in ("alpha", "beta", "order-17"):
        message = await broker.send("t", b"x", keys=[key, "other"])
        assert message.queue_id == zlib.crc32(key.encode()) % 8
    round_robin = [(await broker.send("t", b"x")).queue_id for _ in range(16)]
    assert sorted(round_robin) == sorted(list(range(8)) * 2)
    assert (await broker.send("t", b"x", queue_id=5)).queue_id == 5
    with pytest.raises(ConfigurationError):
        await broker.send("t", b"x", queue_id=8)


async def test_topic_metadata(broker: RedisBroker, redis_url: str) -> None:
    assert [mq.queue_id for mq in await broker.create_topic("t", 3)] == [0, 1, 2]
    await broker.create_topic("t", 3)  # idempotent
    with pytest.raises(ConfigurationError, match="exists with 3 queues"):
        await broker.create_topic("t", 4)
    with pytest.raises(UnknownTopicError):
        await broker.get_queues("missing")
    with pytest.raises(ConfigurationError):
        await broker.create_topic("%RETRY%g", 1)
    # Another broker (another process) sees the topic through Redis.
    async with RedisBroker(redis_url, namespace=broker.namespace) as other:
        assert len(await other.get_queues("t")) == 3
        assert len(await other.get_queues("%RETRY%g")) == 2  # normal and gray retries
        assert len(await other.get_queues("%DLQ%g")) == 1


async def test_long_poll_wakes_on_send_and_times_out_when_idle(broker: RedisBroker) -> None:
    await broker.create_topic("t", 1)
    mq = MessageQueue("t", 0)
    started = time.monotonic()
    empty = await broker.pull(mq, 0, 10, timeout=0.3)
    assert empty.messages == []
    assert time.monotonic() - started >= 0.28

    got: list[int] = []

    async def waiter() -> None:
        result = await broker.pull(mq, 0, 10, timeout=60)
        got.extend(m.queue_offset for m in result.messages)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.sleep(0.2)
        sent_at = time.monotonic()
        await broker.send("t", b"wake")
    assert got == [0]
    assert time.monotonic() - sent_at < 30  # woken by the send, long before its timeout


@pytest.mark.slow
async def test_retry_waits_its_delay_level_then_appears_in_the_retry_queue(
    broker: RedisBroker,
) -> None:
    await broker.create_topic("t", 1)
    original = await broker.send("t", b"payload", keys="k")
    assert await broker.send_back("g", original, delay_level=1) is SendBackResult.RETRY
    retry_mq = MessageQueue("%RETRY%g", 0)
    assert await broker.delayed_count("g") == 1
    assert (await broker.pull(retry_mq, 0, 10)).messages == []
    started = time.monotonic()
    result = await broker.pull(retry_mq, 0, 10, timeout=60)
    waited = time.monotonic() - started
    assert 0.5 <= waited < 30, waited  # level 1 = 1 s; released long before the timeout
    [retried] = result.messages
    assert retried.body == b"payload"
    assert retried.reconsume_times == 1
    assert retried.properties[PROPERTY_RETRY_TOPIC] == "t"
    assert retried.properties[PROPERTY_ORIGIN_MESSAGE_ID] == original.msg_id
    assert retried.msg_id == original.msg_id
    assert retried.offset_msg_id != original.offset_msg_id == original.msg_id
    assert await broker.delayed_count("g") == 0
    # Released once: pulling again does not append it twice.
    assert await broker.max_offset(retry_mq) == 1


@pytest.mark.slow
async def test_default_delay_level_follows_reconsume_times(
    broker: RedisBroker, inspect: redis.Redis
) -> None:
    await broker.create_topic("t", 1)
    message = await broker.send("t", b"x")
    await broker.send_back("g", message)  # level 3 + 0 = 10 s
    await anyio.sleep(1.2)
    retry_mq = MessageQueue("%RETRY%g", 0)
    assert (await broker.pull(retry_mq, 0, 10)).messages == []
    score = inspect.zrange(f"{broker.namespace}:delay:{{%RETRY%g:0}}", 0, 0, withscores=True)
    server_now = inspect.time()[0]
    assert isinstance(score[0], tuple)  # withscores: (member, score) pairs
    assert 8 <= score[0][1] / 1000 - server_now <= 10.5


async def test_spent_messages_and_negative_levels_go_to_the_dlq(broker: RedisBroker) -> None:
    await broker.create_topic("t", 1)
    message = await broker.send("t", b"poison", tags="x")
    assert await broker.send_back("g", message, max_reconsume_times=0) is SendBackResult.DLQ
    assert await broker.send_back("g", message, delay_level=-1) is SendBackResult.DLQ
    await broker.send_to_dlq("g", message)
    dead = await broker.messages("%DLQ%g")
    assert [m.queue_offset for m in dead] == [0, 1, 2]
    assert all(m.body == b"poison" and m.tags == "x" for m in dead)
    assert all(m.properties[PROPERTY_ORIGIN_MESSAGE_ID] == message.msg_id for m in dead)
    assert await broker.delayed_count("g") == 0


async def test_concurrent_producers_get_distinct_consecutive_offsets(
    broker: RedisBroker, redis_url: str
) -> None:
    await broker.create_topic("t", 1)
    async with RedisBroker(redis_url, namespace=broker.namespace) as other:
        offsets: list[int] = []

        async def produce(b: RedisBroker) -> None:
            for _ in range(100):
                message = await b.send("t", b"x", queue_id=0)
                offsets.append(message.queue_offset)

        async with anyio.create_task_group() as tg:
            for b in (broker, other, broker, other):
                tg.start_soon(produce, b)
    assert sorted(offsets) == list(range(400))
    assert await broker.send_many("t", [b"y"] * 250, queue_id=0, chunk=100) == 250
    assert await broker.max_offset(MessageQueue("t", 0)) == 650


async def test_entering_fails_with_a_source_error_when_nothing_listens() -> None:
    # refused connections are retried up to connect_timeout (tests/redis/test_start_while_down.py)
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with pytest.raises(SourceError, match=f"cannot connect to Redis at {url}") as raised:
        async with RedisBroker(url, namespace="nowhere", connect_timeout=0.3):
            pytest.fail("entered a broker with nothing listening")
    assert raised.value.retriable


async def test_entering_gives_up_after_connect_timeout_when_redis_does_not_answer() -> None:
    # A listening socket that never answers: the TCP connection succeeds, PING does not.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        started = time.monotonic()
        # redis-py connects, then PING times out; coredis's handshake times out first
        with pytest.raises(SourceError, match=f"Redis at {url}"):
            async with RedisBroker(url, namespace="nowhere", connect_timeout=0.3):
                pytest.fail("entered a broker whose Redis never answered")
        assert 0.25 < time.monotonic() - started < 20  # gave up, generously bounded


async def test_entering_pings_a_reachable_redis(redis_url: str) -> None:
    async with RedisBroker(redis_url, namespace="ping-check", connect_timeout=1) as broker:
        assert broker.connection_errors == 0
        assert broker.connect_timeout == 1


async def test_a_connection_lost_after_entering_is_retriable_and_sends_retry(
    redis_server: RedisServer,
) -> None:
    async with RedisBroker(redis_server.url, namespace="gone", send_timeout=0.5) as broker:
        redis_server.stop()
        with pytest.raises(SourceError) as pulled:
            await broker.pull(MessageQueue("t", 0), 0, 10)
        assert pulled.value.retriable
        started = time.monotonic()
        with pytest.raises(SourceError) as sent:
            await broker.send("t", b"x", queue_id=0)
        assert sent.value.retriable
        assert time.monotonic() - started >= 0.3  # retried with backoff first
        assert broker.connection_errors >= 3


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # redis-py's asyncio connection
async def test_a_write_on_a_connection_closed_meanwhile_is_a_connection_loss(
    redis_url: str,
) -> None:
    # redis-py lets a write race with the connection's close (as its cluster client's
    # fail-over handling causes) out as a bare AttributeError: the writer is already
    # None. Here the connection is put in the state that race leaves, then written on.
    async with RedisBroker(redis_url, namespace="closed-writer") as broker:
        connection = broker._connection
        pool = connection.client.connection_pool
        closed = await pool.get_connection()
        try:
            await closed.disconnect(nowait=True)
            with pytest.raises(AttributeError):  # what redis-py itself raises
                await closed._send_packed_command([b"PING\r\n"])
            errors = connection.connection_errors
            with pytest.raises(SourceError, match="closed during a write") as caught:
                await connection.call("writing", lambda: closed._send_packed_command([b"x"]))
            assert caught.value.retriable
            assert connection.connection_errors == errors + 1
        finally:
            await pool.release(closed)
        assert await broker.create_topic("t", 1)  # the next call connects again

        async def bug() -> None:
            raise AttributeError("not a connection's")

        with pytest.raises(AttributeError, match="not a connection's"):
            await connection.call("our own bug", bug)
        assert connection.connection_errors == errors + 1


async def test_statistics(broker: RedisBroker) -> None:
    await broker.create_topic("t", 3)
    stats = broker.statistics()
    assert stats.namespace == broker.namespace
    assert stats.topics == {"t": 3}
    assert stats.connection_errors == 0


def test_on_trio_a_broker_used_before_entering_gets_a_clear_error(redis_url: str) -> None:
    import trio

    async def use() -> None:
        broker = RedisBroker(redis_url, namespace="trio-check")
        with pytest.raises(ConfigurationError, match="on trio, enter the RedisBroker"):
            await broker.pull(MessageQueue("t", 0), 0, 1)
        async with broker:
            assert broker.client_library == "coredis"
            assert (await broker.pull(MessageQueue("t", 0), 0, 1)).messages == []

    trio.run(use)


async def test_the_client_follows_the_event_loop(broker: RedisBroker, anyio_backend: str) -> None:
    expected = {"asyncio": "redis-py", "trio": "coredis"}[anyio_backend]
    assert broker.client_library == expected
    assert type(broker.redis).__module__.split(".")[0] == expected.replace("-py", "")


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"tags": 5}, "tags must be a string or None, got int"),
        ({"properties": {"a": 1}}, "properties must map str to str"),
        ({"properties": "x"}, "properties must be a mapping of str to str, got str"),
        ({"keys": [1, 2]}, "keys must be strings, got int"),
        ({"keys": None}, "keys must be a string or a sequence of strings, got NoneType"),
        ({"body": "text"}, "body must be bytes, got str"),
        ({"queue_id": "0"}, "queue_id must be an int"),
        ({"queue_id": 2}, "queue_id 2 out of range for topic 't' with 2 queues"),
    ],
)
async def test_send_checks_the_message_as_the_producer_does(
    broker: RedisBroker, fields: dict[str, Any], fragment: str
) -> None:
    await broker.create_topic("t", 2)
    kwargs: dict[str, Any] = {"body": b"x", **fields}
    body = kwargs.pop("body")
    with pytest.raises(InvalidMessageError) as info:
        await broker.send("t", body, **kwargs)
    assert fragment in str(info.value)
    for q in (0, 1):  # nothing stored
        assert await broker.max_offset(MessageQueue("t", q)) == 0
    with pytest.raises(InvalidMessageError, match="body must be bytes"):
        await broker.send_many("t", ["text"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"group_options": "x"}, "group_options must be GroupOptions or None, got str"),
        ({"group_options": {"lock_ttl": 60}}, "group_options must be GroupOptions"),
        ({"url": 5}, "url must be a redis:// URL string, got int"),
        ({"url": b"redis://127.0.0.1"}, "url must be a redis:// URL string, got bytes"),
        ({"namespace": 5}, "namespace must be a non-empty string"),
        ({"send_timeout": float("inf")}, "send_timeout must be a positive, finite"),
        ({"send_timeout": "3"}, "send_timeout must be a positive, finite"),
        ({"send_timeout": True}, "send_timeout must be a positive, finite"),
        ({"socket_timeout": "x"}, "socket_timeout must be a positive, finite"),
        ({"socket_timeout": None}, "socket_timeout must be a positive, finite"),
        ({"socket_timeout": float("nan")}, "socket_timeout must be a positive, finite"),
        ({"connect_timeout": 0}, "connect_timeout must be a positive, finite"),
        ({"connect_timeout": float("inf")}, "connect_timeout must be a positive, finite"),
        ({"read_ahead": 1.5}, "read_ahead must be an int"),
    ],
)
def test_constructor_checks_argument_types(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        RedisBroker(**kwargs)
    assert fragment in str(info.value)


async def _send_three(broker: RedisBroker) -> str:
    await broker.create_topic("t", 1)
    for i in range(3):
        await broker.send("t", b"m%d" % i, queue_id=0)
    return f"{broker.namespace}:q:{{t:0}}"


async def test_a_foreign_entry_is_named_by_pulls_and_refused_by_send(
    broker: RedisBroker, inspect: redis.Redis
) -> None:
    stream = await _send_three(broker)
    foreign = entry_id(inspect.xadd(stream, {"body": "x"})).decode()
    mq = MessageQueue("t", 0)
    broker.read_ahead = 0  # what comes before the foreign entry is still served
    assert [m.queue_offset for m in (await broker.pull(mq, 0, 2)).messages] == [0, 1]
    assert [m.queue_offset for m in (await broker.pull(mq, 2, 10)).messages] == [2]
    with pytest.raises(SourceError, match=f"stream {stream} holds a foreign entry {foreign}"):
        await broker.pull(mq, 3, 10)
    with pytest.raises(SourceError, match=f"FOREIGN stream {stream} holds entry {foreign}") as sent:
        await broker.send("t", b"mine", queue_id=0)
    assert not sent.value.retriable
    # Nothing written, the counter not raised by the failed send.
    assert inspect.get(f"{broker.namespace}:seq:{{t:0}}") == b"3"
    assert inspect.xlen(stream) == 4


async def test_a_foreign_entry_with_our_fields_past_the_counter_is_detected(
    broker: RedisBroker,
    inspect: redis.Redis,
) -> None:
    stream = await _send_three(broker)
    foreign = entry_id(inspect.xadd(stream, {"i": "someone", "b": "else", "t": "0"}))
    mq = MessageQueue("t", 0)
    # Read with ours: they are served, the queue stops at the foreign entry.
    assert [m.queue_offset for m in (await broker.pull(mq, 0, 10)).messages] == [0, 1, 2]
    with pytest.raises(SourceError, match="past the queue's last offset 3") as pulled:
        await broker.pull(mq, 3, 10)
    assert foreign.decode() in str(pulled.value)


async def test_a_foreign_entry_id_with_a_sequence_part_is_detected(
    broker: RedisBroker, inspect: redis.Redis
) -> None:
    stream = await _send_three(broker)
    inspect.xadd(stream, {"i": "x", "b": "y", "t": "0"}, id="3-1")
    mq = MessageQueue("t", 0)
    # The messages before it are served; it sits between offsets 2 and 3, so a pull
    # from 3 on never reads it, but no message can be sent after it.
    assert [m.queue_offset for m in (await broker.pull(mq, 0, 10)).messages] == [0, 1, 2]
    assert (await broker.pull(mq, 3, 10)).messages == []
    with pytest.raises(SourceError, match="holds entry 3-1"):
        await broker.send("t", b"mine", queue_id=0)
    assert inspect.get(f"{broker.namespace}:seq:{{t:0}}") == b"3"


async def test_a_stream_of_foreign_entries_only_never_hands_out_offsets(
    broker: RedisBroker,
    inspect: redis.Redis,
) -> None:
    await broker.create_topic("t", 1)
    stream = f"{broker.namespace}:q:{{t:0}}"
    for i in range(3):
        inspect.xadd(stream, {"v": str(i)})
    mq = MessageQueue("t", 0)
    with pytest.raises(SourceError, match="foreign entry"):
        await broker.pull(mq, 0, 10)
    with pytest.raises(SourceError, match="foreign entry"):
        await broker.min_offset(mq)
    for _ in range(2):
        with pytest.raises(SourceError, match="FOREIGN"):
            await broker.send("t", b"mine", queue_id=0)
    assert inspect.get(f"{broker.namespace}:seq:{{t:0}}") is None


async def test_every_script_touches_one_cluster_slot(
    broker: RedisBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis Cluster refuses a script whose keys live in several slots: the hash tags
    put a queue's stream and counter, a group's retry queue and delay set, and a
    group's members, locks and epochs together."""
    from redis.crc import key_slot

    connection = broker._connection
    execute = connection.execute
    calls: list[tuple[str, list[str]]] = []

    async def recording(*args: Any, **options: Any) -> Any:
        if args[0] in ("EVALSHA", "EVAL"):
            n = int(args[2])
            calls.append((str(args[1])[:8], [str(k) for k in args[3 : 3 + n]]))
        return await execute(*args, **options)

    monkeypatch.setattr(connection, "execute", recording)
    await broker.create_topic("t", 3)
    for q in range(3):
        await broker.send("t", b"x", queue_id=q)
    message = (await broker.pull(MessageQueue("t", 1), 0, 1)).messages[0]
    await broker.send_back("g", message, delay_level=1)
    await broker.pull(MessageQueue("%RETRY%g", 0), 0, 10)
    await broker.min_offset(MessageQueue("t", 2))
    await broker.offset_for_timestamp(MessageQueue("t", 2), 0)
    coordinator = broker.group_coordinator()
    queues = [MessageQueue("t", q) for q in range(3)]
    await coordinator.heartbeat("g", "member-1")
    await coordinator.lock("g", "member-1", queues)
    await coordinator.unlock("g", "member-1", queues)
    await coordinator.leave("g", "member-1")
    assert len(calls) >= 10
    for sha, keys in calls:
        assert len({key_slot(k.encode()) for k in keys}) == 1, (sha, keys)
    assert any(len(keys) == 6 for _, keys in calls)  # the three queues' locks in one call


async def test_a_consumer_given_no_store_warns_that_its_progress_stays_in_the_process(
    broker: RedisBroker, caplog: pytest.LogCaptureFixture
) -> None:
    class Listener(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            pass

    await broker.create_topic("t", 1)
    for store in (None, MemoryOffsetStore()):
        caplog.clear()
        consumer = PushConsumer("g", broker, Listener(), offset_store=store)
        consumer.subscribe("t")
        async with consumer:
            pass
        messages = [record.getMessage() for record in caplog.records]
        warned = [message for message in messages if "no offset_store given" in message]
        if store is None:
            assert len(warned) == 1
            assert warned[0].startswith("group g: ")
            assert "SqlOffsetStore" in warned[0]
        else:
            assert warned == []
