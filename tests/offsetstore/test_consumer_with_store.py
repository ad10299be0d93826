"""PushConsumer on a SqlOffsetStore: resume after restart, and database outages.

Outages are real: PostgreSQL and MariaDB are reached through a TCP proxy in the
test that is shut down (connections cut, port closed) and brought back; SQLite is
locked by another connection holding ``BEGIN EXCLUSIVE``.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
import sqlalchemy as sa
from anyio.abc import SocketAttribute

from offsetstore import QueueProgress, StageKey, StageOffsetStore
from stagedconsumer import (
    ConfigurationError,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PushConsumer,
)
from stagedconsumer.testing import stage_of

from .conftest import Backend

pytestmark = pytest.mark.anyio

GROUP = "g"
TOPIC = "t"
QUEUES = 4
STAGES = (5, 10)
DEFAULT_KEY = StageKey("default", None)


class Recorder(MessageListenerStagedConcurrently):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def get_stage_definitions(self) -> Sequence[int]:
        return STAGES

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        for m in msgs:
            self.seen.append((m.queue_id, m.queue_offset, context.stage_index))
        await anyio.lowlevel.checkpoint()


def _consumer(broker: MemoryBroker, store: StageOffsetStore, listener: Recorder) -> PushConsumer:
    consumer = PushConsumer(
        GROUP,
        broker,
        listener,
        offset_store=store,
        options=ConsumerOptions(persist_consumer_offset_interval=0.05, shutdown_timeout=5),
    )
    consumer.subscribe(TOPIC)
    return consumer


def _fill(broker: MemoryBroker, per_queue: int) -> None:
    for q in range(QUEUES):
        for _ in range(per_queue):
            broker.send(TOPIC, b"x", queue_id=q)


def _expected_stage(offset: int) -> int:
    return stage_of(STAGES, offset)  # the kit's naive stage model


@pytest.mark.slow
async def test_consumer_resumes_from_the_sql_store_with_the_same_stages(
    sql_backend: Backend,
) -> None:
    broker = MemoryBroker()
    broker.create_topic(TOPIC, QUEUES)
    _fill(broker, 7)
    first = Recorder()
    async with _consumer(broker, sql_backend.new_store(), first) as consumer:
        await consumer.wait_caught_up(timeout=10)
    _fill(broker, 13)
    second = Recorder()
    async with _consumer(broker, sql_backend.new_store(), second) as consumer:
        await consumer.wait_caught_up(timeout=10)
    assert sorted(first.seen) == [
        (q, o, _expected_stage(o)) for q in range(QUEUES) for o in range(7)
    ]
    assert sorted(second.seen) == [
        (q, o, _expected_stage(o)) for q in range(QUEUES) for o in range(7, 20)
    ], "the restarted consumer redelivered or restaged messages"
    stored = await sql_backend.new_store().list_progress(GROUP, TOPIC)
    assert stored == {
        MessageQueue(TOPIC, q): QueueProgress(consume_offset=20, stage_offsets={DEFAULT_KEY: 20})
        for q in range(QUEUES)
    }


@pytest.mark.slow
async def test_seek_with_bad_stage_offsets_stores_nothing_and_the_consumer_goes_on(
    sql_backend: Backend,
) -> None:
    """A str stage key used to raise AttributeError inside the SQL store and stop the
    consumer; a negative stage offset was written, and no consumer nor ``stagedconsumer
    offsets`` could read the row again."""
    broker = MemoryBroker()
    broker.create_topic(TOPIC, QUEUES)
    _fill(broker, 7)
    mq = MessageQueue(TOPIC, 0)
    first = Recorder()
    async with _consumer(broker, sql_backend.new_store(), first) as consumer:
        await consumer.wait_caught_up(timeout=10)
        for bad in ({"default": 25}, {DEFAULT_KEY: -1}):
            with pytest.raises(ConfigurationError, match="bad stage_offsets for t#0"):
                await consumer.seek(mq, 2, stage_offsets=bad)  # type: ignore[arg-type]
        _fill(broker, 3)
        await consumer.wait_caught_up(timeout=10)
    assert sorted(first.seen) == [
        (q, o, _expected_stage(o)) for q in range(QUEUES) for o in range(10)
    ]
    stored = await sql_backend.new_store().list_progress(GROUP, TOPIC)
    assert stored[mq] == QueueProgress(consume_offset=10, stage_offsets={DEFAULT_KEY: 10})
    _fill(broker, 1)
    second = Recorder()
    async with _consumer(broker, sql_backend.new_store(), second) as consumer:
        await consumer.wait_caught_up(timeout=10)
    assert sorted(second.seen) == [(q, 10, _expected_stage(10)) for q in range(QUEUES)]


class TcpProxy:
    """Forwards a local port to a database; :meth:`down` cuts every connection."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._scope: anyio.CancelScope | None = None

    async def up(self, tg: anyio.abc.TaskGroup) -> None:
        await tg.start(self._serve)

    def down(self) -> None:
        assert self._scope is not None
        self._scope.cancel()

    async def _serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.CancelScope() as scope:
            self._scope = scope
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=self.port)
            self.port = listener.extra(SocketAttribute.local_port)
            task_status.started()
            async with listener:
                await listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        async with (
            client,
            await anyio.connect_tcp(*self.target) as upstream,
            anyio.create_task_group() as tg,
        ):

            async def pipe(a: anyio.abc.SocketStream, b: anyio.abc.SocketStream) -> None:
                try:
                    async for chunk in a:
                        await b.send(chunk)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(pipe, client, upstream)
            tg.start_soon(pipe, upstream, client)


class SqliteLock:
    """An outage of a SQLite file: another connection holds it exclusively."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.conn: sqlite3.Connection | None = None

    async def down(self) -> None:
        self.conn = sqlite3.connect(self.path, isolation_level=None)
        self.conn.execute("BEGIN EXCLUSIVE")

    async def up(self) -> None:
        assert self.conn is not None
        self.conn.rollback()
        self.conn.close()


class ProxyOutage:
    """An outage of a database server: its proxy cuts connections and closes its port."""

    def __init__(self, proxy: TcpProxy, tg: anyio.abc.TaskGroup) -> None:
        self.proxy = proxy
        self.tg = tg

    async def down(self) -> None:
        self.proxy.down()
        await anyio.sleep(0.01)

    async def up(self) -> None:
        await self.proxy.up(self.tg)


@asynccontextmanager
async def _outage_control(
    backend: Backend, tg: anyio.abc.TaskGroup
) -> AsyncIterator[tuple[str, SqliteLock | ProxyOutage]]:
    """Yields the URL the consumer's store should use, and the outage switch."""
    assert backend.url is not None
    url = sa.make_url(backend.url)
    if backend.name == "sqlite":
        assert url.database is not None
        yield backend.url, SqliteLock(url.database)
        return
    assert url.host is not None
    assert url.port is not None
    proxy = TcpProxy(url.host, url.port)
    await proxy.up(tg)
    try:
        yield (
            url.set(host="127.0.0.1", port=proxy.port).render_as_string(False),
            ProxyOutage(proxy, tg),
        )
    finally:
        proxy.down()


async def _wait_for(condition: Callable[[], Awaitable[bool]], timeout: float) -> None:
    with anyio.fail_after(timeout):
        while not await condition():
            await anyio.sleep(0.02)


@pytest.mark.slow
async def test_consumer_keeps_consuming_while_the_database_is_down(sql_backend: Backend) -> None:
    broker = MemoryBroker()
    broker.create_topic(TOPIC, QUEUES)
    listener = Recorder()
    observer = sql_backend.new_store()  # direct connection: sees what was committed
    queues = [MessageQueue(TOPIC, q) for q in range(QUEUES)]
    history: list[dict[MessageQueue, QueueProgress]] = []

    async def stored() -> dict[MessageQueue, QueueProgress]:
        value = await observer.list_progress(GROUP, TOPIC)
        history.append(value)
        return value

    async def stored_at(offset: int) -> bool:
        value = await stored()
        expected = QueueProgress(consume_offset=offset, stage_offsets={DEFAULT_KEY: offset})
        return all(value.get(mq) == expected for mq in queues)

    async with (
        anyio.create_task_group() as tg,
        _outage_control(sql_backend, tg) as (url, outage),
    ):
        store = sql_backend.new_store(url=url, connect_timeout=0.3)
        async with _consumer(broker, store, listener) as consumer:
            _fill(broker, 10)
            await consumer.wait_caught_up(timeout=10)
            await _wait_for(lambda: stored_at(10), timeout=10)

            await outage.down()
            errors_before = consumer.statistics().commit_errors
            _fill(broker, 10)
            await consumer.wait_caught_up(timeout=10)  # consuming goes on
            assert consumer.statistics().consumed_ok == QUEUES * 20

            async def failing() -> bool:
                return consumer.statistics().commit_errors >= errors_before + 2

            await _wait_for(failing, timeout=10)
            assert await stored_at(10), "progress moved while the database was down"

            # Read before the database is back: the first commit after it may land
            # while outage.up() is still returning.
            commits = consumer.statistics().commits
            await outage.up()
            await _wait_for(lambda: stored_at(20), timeout=15)

            async def counted() -> bool:  # the row can be seen before the commit returns
                return consumer.statistics().commits > commits

            await _wait_for(counted, timeout=5)
        tg.cancel_scope.cancel()

    assert sorted(listener.seen) == [
        (q, o, _expected_stage(o)) for q in range(QUEUES) for o in range(20)
    ]
    for mq in queues:
        offsets = [h[mq].consume_offset or 0 for h in history if mq in h]
        assert offsets == sorted(offsets), f"stored progress of {mq} went backwards"


@pytest.mark.slow
async def test_consumer_start_with_an_unreachable_database_waits_then_is_a_clear_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The store is retried with backoff for start_timeout (each failed attempt logged),
    then the error comes out of ``async with`` as itself."""
    import socket

    from offsetstore import SqlOffsetStore, StoreUnavailableError

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    broker = MemoryBroker()
    broker.create_topic(TOPIC, 1)
    store = SqlOffsetStore(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test")
    consumer = PushConsumer(
        GROUP, broker, Recorder(), offset_store=store, options=ConsumerOptions(start_timeout=1.5)
    )
    consumer.subscribe(TOPIC)
    try:
        started = anyio.current_time()
        with (
            caplog.at_level(logging.WARNING, logger="stagedconsumer"),
            pytest.raises(StoreUnavailableError, match="cannot reach the offset store"),
        ):
            async with consumer:
                pytest.fail("the consumer started without its offset store")
        waited = anyio.current_time() - started
    finally:
        await store.aclose()
    assert 1.5 <= waited < 1.5 + 20  # gave up after start_timeout (generous: a loaded machine)
    attempts = [r for r in caplog.records if "unavailable at start" in r.getMessage()]
    assert len(attempts) >= 2


@pytest.mark.slow
async def test_consumer_started_during_a_database_outage_starts_when_it_is_back(
    server_backend: Backend,
) -> None:
    """A member started while its database restarts does not die: it waits."""
    broker = MemoryBroker()
    broker.create_topic(TOPIC, QUEUES)
    _fill(broker, 3)
    listener = Recorder()
    async with (
        anyio.create_task_group() as tg,
        _outage_control(server_backend, tg) as (url, outage),
    ):
        await outage.down()
        store = server_backend.new_store(url=url, connect_timeout=0.3)
        consumer = PushConsumer(
            GROUP,
            broker,
            listener,
            offset_store=store,
            options=ConsumerOptions(start_timeout=30, persist_consumer_offset_interval=0.05),
        )
        consumer.subscribe(TOPIC)

        async def back_in_a_second() -> None:
            await anyio.sleep(1.0)
            await outage.up()

        tg.start_soon(back_in_a_second)
        started = anyio.current_time()
        async with consumer:
            assert anyio.current_time() - started >= 1.0
            await consumer.wait_caught_up(timeout=10)
        tg.cancel_scope.cancel()
    assert len(listener.seen) == QUEUES * 3


async def test_a_read_only_store_stops_the_consumer_at_start(sql_backend: Backend) -> None:
    from offsetstore import StoreReadOnlyError

    from .test_read_only import read_only_store

    writer = sql_backend.new_store()
    await writer.load()  # the tables exist: only writing is refused
    broker = MemoryBroker()
    broker.create_topic(TOPIC, 1)
    store = read_only_store(sql_backend)
    consumer = PushConsumer(
        GROUP, broker, Recorder(), offset_store=store, options=ConsumerOptions(start_timeout=30)
    )
    consumer.subscribe(TOPIC)
    started = anyio.current_time()
    with pytest.raises(StoreReadOnlyError, match="read-only"):
        async with consumer:
            pytest.fail("the consumer started on a store it cannot write")
    assert anyio.current_time() - started < 5.0  # at once, not after start_timeout


class SlowRecorder(Recorder):
    """Holds every handler call until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.go = anyio.Event()
        self.finished: list[tuple[int, int]] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        await super().consume_message(msgs, context)
        if msgs[0].body == b"slow":
            await self.go.wait()
        self.finished.extend((m.queue_id, m.queue_offset) for m in msgs)


async def test_a_store_that_turns_read_only_stops_the_consumer_after_draining(
    sql_backend: Backend,
) -> None:
    """A permanent store failure is not only logged: the consumer stops, lets the
    handler calls in flight finish, and raises the error out of ``async with``."""
    from offsetstore import SqlOffsetStore, StoreReadOnlyError

    from .test_read_only import connections_made_read_only

    broker = MemoryBroker()
    broker.create_topic(TOPIC, 1)
    listener = SlowRecorder()
    store = sql_backend.new_store()
    assert isinstance(store, SqlOffsetStore)
    consumer = PushConsumer(
        GROUP,
        broker,
        listener,
        offset_store=store,
        options=ConsumerOptions(persist_consumer_offset_interval=0.05, shutdown_timeout=10),
    )
    consumer.subscribe(TOPIC)
    reached_the_end_of_the_body = False

    async def run() -> None:
        nonlocal reached_the_end_of_the_body
        async with consumer:
            broker.send(TOPIC, b"x")
            await consumer.wait_caught_up(timeout=10)
            with connections_made_read_only(sql_backend, store):
                broker.send(TOPIC, b"slow")  # in a handler when the commit fails
                await anyio.sleep(30)  # the consumer's failure cancels this
            reached_the_end_of_the_body = True

    async def let_the_slow_call_finish_later() -> None:
        with anyio.fail_after(10):
            while len(listener.seen) < 2:
                await anyio.sleep(0.01)
        await anyio.sleep(0.5)  # the commit fails meanwhile; the drain waits for this
        listener.go.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(let_the_slow_call_finish_later)
        with pytest.raises(StoreReadOnlyError):
            await run()
    assert not reached_the_end_of_the_body
    assert listener.finished == [(0, 0), (0, 1)]  # the call in flight was drained
    stats = consumer.statistics()
    assert stats.commit_errors >= 1
