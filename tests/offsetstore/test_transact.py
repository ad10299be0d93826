"""transact(): a caller's writes committed in one transaction with its messages'
finished marks, fenced, on every store."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.to_thread
import pytest
import sqlalchemy as sa

from offsetstore import (
    AlreadyFinishedError,
    MemoryOffsetStore,
    QueueProgress,
    ReadOffsetType,
    SqlOffsetStore,
    StageOffsetStore,
    StoreFencedError,
)
from stagedconsumer import MessageQueue

from .conftest import Backend

pytestmark = pytest.mark.anyio

GROUP = "g"
MQ = MessageQueue("T", 0)


class Effects:
    """A table of effects in the store's database (a list for the memory store)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.rows: list[int] = []
        self.table = sa.Table(
            f"{backend.prefix}effects",
            sa.MetaData(),
            sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        )
        if backend.url is not None:
            engine = sa.create_engine(backend.url)
            with engine.begin() as conn:
                self.table.create(conn)
            engine.dispose()

    def writer(self, ids: list[int], fail: bool = False) -> Any:
        def write(connection: sa.Connection | None) -> str:
            if connection is None:
                self.rows.extend(ids)
            else:
                connection.execute(sa.insert(self.table), [{"id": i} for i in ids])
            if fail:
                raise KeyError("the caller's own failure")
            return "written"

        return write

    def read(self) -> list[int]:
        if self.backend.url is None:
            return sorted(self.rows)
        engine = sa.create_engine(self.backend.url)
        try:
            with engine.connect() as conn:
                return sorted(conn.execute(sa.select(self.table.c.id)).scalars())
        finally:
            engine.dispose()

    def drop(self) -> None:
        if self.backend.url is not None:
            engine = sa.create_engine(self.backend.url)
            with engine.begin() as conn:
                self.table.drop(conn, checkfirst=True)
            engine.dispose()


@pytest.fixture
def effects(backend: Backend) -> Any:
    table = Effects(backend)
    yield table
    table.drop()


def stores(backend: Backend) -> tuple[StageOffsetStore, StageOffsetStore]:
    """Two members' stores over one durable place."""
    old, new = backend.new_store(), backend.new_store()
    if isinstance(old, MemoryOffsetStore) and isinstance(new, MemoryOffsetStore):
        new._fences = old._fences
        new._marks = old._marks
    return old, new


def marks_left(store: StageOffsetStore) -> int:
    if isinstance(store, MemoryOffsetStore):
        return sum(len(marks) for marks in store._marks.values())
    assert isinstance(store, SqlOffsetStore)
    engine = sa.create_engine(store._url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(sa.select(sa.func.count()).select_from(store._marks)).scalar_one()
            )
    finally:
        engine.dispose()


async def test_effects_and_marks_commit_together_and_fold_into_progress(
    backend: Backend, effects: Effects
) -> None:
    old, new = stores(backend)
    async with old, new:
        await old.claim(GROUP, MQ, 5)
        old.update_progress(GROUP, MQ, QueueProgress(consume_offset=0))
        await old.persist_fenced(GROUP, {MQ: 5})
        assert await old.transact(GROUP, MQ, [3, 4], effects.writer([3, 4]), fence=5) == "written"
        assert await old.transact(GROUP, MQ, [7], effects.writer([7]), fence=5) == "written"
        # What another member reads: the marks, as finished ranges.
        stored = await new.read_progress(GROUP, MQ, ReadOffsetType.READ_FROM_STORE)
        assert stored == QueueProgress(consume_offset=0, finished=[(3, 4), (7, 7)])
        assert effects.read() == [3, 4, 7]
        # A mark that exists: nothing is done, the caller's function is not called.
        with pytest.raises(AlreadyFinishedError) as done:
            await old.transact(GROUP, MQ, [4, 5], effects.writer([99]), fence=5)
        assert done.value.offsets == {4}
        assert effects.read() == [3, 4, 7]
        # A progress commit past the marks deletes them.
        old.update_progress(GROUP, MQ, QueueProgress(consume_offset=5, finished=[(7, 7)]))
        await old.persist_fenced(GROUP, {MQ: 5})
        assert marks_left(old) == 1  # 7 is above the committed offset
        old.update_progress(GROUP, MQ, QueueProgress(consume_offset=8))
        await old.persist_fenced(GROUP, {MQ: 5})
        assert marks_left(old) == 0
        # Below the committed offset counts as finished too.
        with pytest.raises(AlreadyFinishedError):
            await old.transact(GROUP, MQ, [6], effects.writer([6]), fence=5)


async def test_a_failing_function_commits_nothing(backend: Backend, effects: Effects) -> None:
    store = backend.new_store()
    async with store:
        store.update_progress(GROUP, MQ, QueueProgress(consume_offset=0))
        await store.persist_all(GROUP, [MQ])
        with pytest.raises(KeyError, match="own failure"):
            await store.transact(GROUP, MQ, [1], effects.writer([1], fail=True))
        assert marks_left(store) == 0
        if backend.url is not None:  # the memory store cannot roll back a list
            assert effects.read() == []
        assert await store.transact(GROUP, MQ, [1], effects.writer([2])) == "written"


async def test_a_member_that_lost_the_queue_cannot_commit(
    backend: Backend, effects: Effects
) -> None:
    old, new = stores(backend)
    async with old, new:
        await old.claim(GROUP, MQ, 10)
        old.update_progress(GROUP, MQ, QueueProgress(consume_offset=0))
        await old.persist_fenced(GROUP, {MQ: 10})
        await old.transact(GROUP, MQ, [0], effects.writer([0]), fence=10)
        # The new owner claims the queue: it sees the old owner's mark.
        claimed = await new.claim(GROUP, MQ, 11)
        assert claimed == QueueProgress(consume_offset=0, finished=[(0, 0)])
        with pytest.raises(StoreFencedError) as fenced:
            await old.transact(GROUP, MQ, [1], effects.writer([1]), fence=10)
        assert fenced.value.queues == {MQ}
        assert "lost the queue" in str(fenced.value)
        assert await new.transact(GROUP, MQ, [1], effects.writer([1]), fence=11) == "written"
        assert effects.read() == [0, 1]


async def test_an_operator_reset_forgets_the_marks(backend: Backend, effects: Effects) -> None:
    store = backend.new_store()
    async with store:
        store.update_progress(GROUP, MQ, QueueProgress(consume_offset=0))
        await store.persist_all(GROUP, [MQ])
        await store.transact(GROUP, MQ, [2], effects.writer([2]))
        await store.reset_progress(GROUP, {MQ: QueueProgress(consume_offset=0)})
        assert marks_left(store) == 0
        assert (await store.list_progress(GROUP))[MQ] == QueueProgress(consume_offset=0)


async def test_a_claim_during_a_transaction_sees_its_mark_or_fences_it(
    sql_backend: Backend,
) -> None:
    effects = Effects(sql_backend)
    try:
        old, new = stores(sql_backend)
        async with old, new:
            await old.claim(GROUP, MQ, 1)
            old.update_progress(GROUP, MQ, QueueProgress(consume_offset=0))
            await old.persist_fenced(GROUP, {MQ: 1})
            inside, go = threading.Event(), threading.Event()

            def slow(connection: sa.Connection) -> None:
                connection.execute(sa.insert(effects.table), [{"id": 0}])
                inside.set()
                go.wait(30)

            outcome: dict[str, object] = {}

            async def transaction() -> None:
                try:
                    await old.transact(GROUP, MQ, [0], slow, fence=1)
                    outcome["transact"] = "committed"
                except StoreFencedError:
                    outcome["transact"] = "fenced"

            async def claim() -> None:
                await anyio.to_thread.run_sync(inside.wait, 30)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_claim)
                    await anyio.to_thread.run_sync(go.set)

            async def _claim() -> None:
                outcome["claim"] = await new.claim(GROUP, MQ, 2)

            async with anyio.create_task_group() as tg:
                tg.start_soon(transaction)
                tg.start_soon(claim)
            seen = outcome["claim"]
            assert isinstance(seen, QueueProgress)
            if outcome["transact"] == "committed":
                assert seen.finished == ((0, 0),)
                assert effects.read() == [0]
            else:
                assert seen.finished == ()
                assert effects.read() == []
    finally:
        effects.drop()
