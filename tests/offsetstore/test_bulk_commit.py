"""Progress commits of many queues: one statement per chunk of rows (offsetstore._bulk),
only the queues whose progress changed, fences checked for every queue, marks folded."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from offsetstore import (
    AlreadyFinishedError,
    QueueProgress,
    ReadOffsetType,
    SqlOffsetStore,
    StageKey,
    StoreFencedError,
)
from stagedconsumer import MessageQueue

from .conftest import Backend
from .test_transact import marks_left, stores

pytestmark = pytest.mark.anyio

GROUP = "g"
ODD_NAMES = ["plain", "it's", 'say "hi"', "back\\slash", "100%", "ünïcødé", "emoji 🙂", ""]


async def test_a_large_fenced_commit_refuses_exactly_the_queues_claimed_since(
    backend: Backend,
) -> None:
    queues = [MessageQueue(f"T{i % 3}", i) for i in range(2050)]  # more than a lock chunk
    claimed_by_new = set(queues[::64])
    never_stored = set(queues[5::100]) - claimed_by_new
    old, new = stores(backend)
    async with old, new:
        for mq in queues:
            if mq not in never_stored:
                old.update_progress(GROUP, mq, QueueProgress(consume_offset=1))
        await old.persist_all(GROUP, queues)
        for mq in claimed_by_new:
            await new.claim(GROUP, mq, 11)
            new.update_progress(GROUP, mq, QueueProgress(consume_offset=3))
        await new.persist_fenced(GROUP, dict.fromkeys(claimed_by_new, 11))

        for mq in queues:
            old.update_progress(GROUP, mq, QueueProgress(consume_offset=7))
        with pytest.raises(StoreFencedError) as refused:
            await old.persist_fenced(GROUP, dict.fromkeys(queues, 10))
        assert refused.value.queues == claimed_by_new
        stored = await new.list_progress(GROUP)
        assert {mq for mq, p in stored.items() if p.consume_offset == 3} == claimed_by_new
        assert {mq for mq, p in stored.items() if p.consume_offset == 7} == (
            set(queues) - claimed_by_new
        )
        # Unchanged since: still checked, still refused.
        with pytest.raises(StoreFencedError) as again:
            await old.persist_fenced(GROUP, dict.fromkeys(queues, 10))
        assert again.value.queues == claimed_by_new


async def test_a_bulk_commit_keeps_names_exact_and_consume_offsets_increase_only(
    sql_backend: Backend,
) -> None:
    # More rows than one statement holds; names that need quoting in every dialect.
    queues = [MessageQueue(f"{ODD_NAMES[i % len(ODD_NAMES)]}", i) for i in range(2100)]
    keys = [StageKey(name, None if i % 2 else name[::-1]) for i, name in enumerate(ODD_NAMES)]

    def progress(i: int, offset: int | None) -> QueueProgress:
        finished = [(offset + 2, offset + 3)] if offset is not None and i % 5 == 0 else []
        return QueueProgress(
            consume_offset=offset,
            stage_offsets={keys[i % len(keys)]: offset or 0, keys[(i + 1) % len(keys)]: i},
            finished=finished,
        )

    first: dict[MessageQueue, QueueProgress] = {}
    for i, mq in enumerate(queues):
        first[mq] = progress(i, None if i % 7 == 0 else 100)
    store = sql_backend.new_store()
    async with store:
        for mq, value in first.items():
            store.update_progress(GROUP, mq, value)
        await store.persist_all(GROUP, queues)
        assert await sql_backend.new_store().list_progress(GROUP) == first

        # Back (ignored, stage offsets included), forward, and to no consume offset.
        expected = dict(first)
        for i, mq in enumerate(queues):
            offset = [50, 150, None][i % 3]
            store.update_progress(GROUP, mq, progress(i + 1, offset))
            if first[mq].consume_offset is None or (offset is not None and offset >= 100):
                expected[mq] = progress(i + 1, offset)
        await store.persist_all(GROUP, queues)
        reader = sql_backend.new_store()
        assert await reader.list_progress(GROUP) == expected


async def test_one_commit_folds_the_marks_of_many_queues(sql_backend: Backend) -> None:
    queues = [MessageQueue("T", i) for i in range(130)]  # more than one delete's queues
    store = sql_backend.new_store()
    assert isinstance(store, SqlOffsetStore)
    async with store:
        for mq in queues:
            store.update_progress(GROUP, mq, QueueProgress(consume_offset=0))
        await store.persist_all(GROUP, queues)
        for mq in queues:
            await store.transact(GROUP, mq, [0, 1], lambda connection: None)
        assert marks_left(store) == 2 * len(queues)
        # Progress unchanged, marks above it: nothing to fold yet.
        await store.persist_all(GROUP, queues)
        assert marks_left(store) == 2 * len(queues)
        for mq in queues[:-1]:
            store.update_progress(GROUP, mq, QueueProgress(consume_offset=2))
        await store.persist_all(GROUP, queues)
        assert marks_left(store) == 2  # those of the queue whose progress did not move
        reader = sql_backend.new_store()
        assert (await reader.read_progress(GROUP, queues[-1])) == QueueProgress(
            consume_offset=0, finished=[(0, 1)]
        )


async def test_progress_committed_and_unchanged_is_not_written_again(
    sql_backend: Backend,
) -> None:
    a, b = MessageQueue("T", 0), MessageQueue("T", 1)
    store, operator = sql_backend.new_store(), sql_backend.new_store()
    assert isinstance(store, SqlOffsetStore)
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if store.progress_table_name in statement and "INSERT" in statement.upper():
            statements.append(statement)

    async with store, operator:
        sa.event.listen(store._engine, "before_cursor_execute", record)
        store.update_progress(GROUP, a, QueueProgress(consume_offset=5))
        store.update_progress(GROUP, b, QueueProgress(consume_offset=5))
        await store.persist_all(GROUP, [a, b])
        assert len(statements) == 1
        await store.persist_all(GROUP, [a, b])
        assert len(statements) == 1  # nothing changed: no statement
        # An operator moves both back (the group stopped); only the queue whose
        # progress changes in this store is written again.
        await operator.reset_progress(
            GROUP, {a: QueueProgress(consume_offset=1), b: QueueProgress(consume_offset=1)}
        )
        store.update_progress(GROUP, b, QueueProgress(consume_offset=6))
        await store.persist_all(GROUP, [a, b])
        stored = await operator.list_progress(GROUP)
        assert (stored[a].consume_offset, stored[b].consume_offset) == (1, 6)
        # Its own reset and a claim are not "committed and unchanged".
        await store.reset_progress(GROUP, {a: QueueProgress(consume_offset=2)})
        store.update_progress(GROUP, a, QueueProgress(consume_offset=5))
        await store.persist_all(GROUP, [a, b])
        assert (await operator.list_progress(GROUP))[a].consume_offset == 5
        await operator.reset_progress(GROUP, {a: QueueProgress(consume_offset=1)})
        claimed = await store.claim(GROUP, a, 3)
        assert claimed is not None
        assert claimed.consume_offset == 1
        store.update_progress(GROUP, a, QueueProgress(consume_offset=5))
        await store.persist_fenced(GROUP, {a: 3})
        assert (await operator.list_progress(GROUP))[a].consume_offset == 5


def _kill_connections(store: SqlOffsetStore) -> None:
    """Close the server side of every connection in the store's pool."""
    engine = sa.create_engine(store._url)
    with store._engine.connect() as conn:
        if store._backend == "postgresql":
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            kill = f"SELECT pg_terminate_backend({int(pid)})"
        else:
            pid = conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar_one()
            kill = f"KILL {int(pid)}"
    try:
        with engine.connect() as other:
            other.exec_driver_sql(kill)
            other.commit()
    finally:
        engine.dispose()


async def test_a_connection_the_server_closed_is_replaced_without_failing_a_call(
    server_backend: Backend,
) -> None:
    mq = MessageQueue("T", 0)
    store = server_backend.new_store(engine_options={"pool_size": 1, "max_overflow": 0})
    assert isinstance(store, SqlOffsetStore)
    async with store:
        store.update_progress(GROUP, mq, QueueProgress(consume_offset=1))
        await store.persist_all(GROUP, [mq])
        # Just used, so not pinged on checkout: the first statement finds it closed,
        # and the call is made again on a new connection.
        _kill_connections(store)
        assert await store.transact(GROUP, mq, [3], lambda connection: "done") == "done"
        _kill_connections(store)
        store.update_progress(GROUP, mq, QueueProgress(consume_offset=2))
        await store.persist_all(GROUP, [mq])
        _kill_connections(store)
        await store.claim(GROUP, mq, 4)
        assert await store.read_progress(GROUP, mq) == QueueProgress(
            consume_offset=2, finished=[(3, 3)]
        )


@pytest.mark.postgres
async def test_transactions_leave_pooled_connections_as_they_found_them(
    postgres_backend: Backend,
) -> None:
    server_backend = postgres_backend  # psycopg's connections have the autocommit switch
    mq = MessageQueue("T", 0)
    store = server_backend.new_store(engine_options={"pool_size": 1, "max_overflow": 0})
    assert isinstance(store, SqlOffsetStore)

    def autocommit() -> bool:
        with store._engine.connect() as conn:
            return bool(conn.connection.dbapi_connection.autocommit)  # type: ignore[union-attr]

    def fail(connection: Any) -> None:
        raise KeyError("the caller's own failure")

    async with store:
        await store.claim(GROUP, mq, 5)
        assert await store.transact(GROUP, mq, [0], lambda connection: 1, fence=5) == 1
        assert not autocommit()
        with pytest.raises(KeyError):
            await store.transact(GROUP, mq, [1], fail, fence=5)
        assert not autocommit()
        with pytest.raises(StoreFencedError):
            await store.transact(GROUP, mq, [1], fail, fence=4)
        assert not autocommit()
        # The session lost its prepared statements (a pooler's reset): prepared again.
        with store._engine.connect() as conn:
            conn.exec_driver_sql("DEALLOCATE ALL")
        assert await store.transact(GROUP, mq, [1], lambda connection: 2, fence=5) == 2
        assert not autocommit()
        assert await store.read_progress(GROUP, mq, ReadOffsetType.READ_FROM_STORE) == (
            QueueProgress(consume_offset=None, finished=[(0, 1)])
        )


@pytest.mark.postgres
async def test_transactions_of_queues_whose_names_need_quoting(server_backend: Backend) -> None:
    """PostgreSQL's mark query carries the queue's key as literals: names with quotes,
    backslashes and percent signs reach the right rows, and one queue's marks are not
    another's (on MariaDB, through its own statements, the same holds)."""
    group = "g'%s\\"
    queues = [MessageQueue("T'); DROP TABLE x; --", 0), MessageQueue("T\\'%(k0)s", 0)]
    store = server_backend.new_store()
    assert isinstance(store, SqlOffsetStore)
    async with store:
        for n, mq in enumerate(queues):
            await store.claim(group, mq, 3)
            done = await store.transact(group, mq, [n], lambda connection: "done", fence=3)
            assert done == "done"
            with pytest.raises(AlreadyFinishedError):
                await store.transact(group, mq, [n], lambda connection: "done", fence=3)
            with pytest.raises(StoreFencedError):
                await store.transact(group, mq, [n + 1], lambda connection: "done", fence=2)
        for n, mq in enumerate(queues):
            assert await store.read_progress(group, mq, ReadOffsetType.READ_FROM_STORE) == (
                QueueProgress(consume_offset=None, finished=[(n, n)])
            )


@pytest.mark.postgres
async def test_the_progress_table_leaves_room_for_hot_updates(
    postgres_backend: Backend,
) -> None:
    """PostgreSQL: the progress table is created with a fill factor under 100, so a
    progress commit's updates can stay on their page."""
    server_backend = postgres_backend
    store = server_backend.new_store()
    assert isinstance(store, SqlOffsetStore)
    async with store:
        with store._engine.connect() as conn:
            options = conn.execute(
                sa.text("SELECT reloptions FROM pg_class WHERE relname = :name"),
                {"name": store.progress_table_name},
            ).scalar_one()
    assert options == ["fillfactor=50"]
