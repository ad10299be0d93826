"""Fencing tokens: a consumer that lost a queue cannot overwrite its new owner's progress.

Runs on every store (memory, SQLite, PostgreSQL, MariaDB) and the schema migration
from version 1 (no fence column) on the SQL ones.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from offsetstore import (
    MemoryOffsetStore,
    QueueProgress,
    ReadOffsetType,
    SqlOffsetStore,
    StageKey,
    StageOffsetStore,
    StoreFencedError,
)
from offsetstore._sql import SCHEMA_VERSION
from stagedconsumer import MessageQueue

from ._v3 import create_v3
from .conftest import Backend

pytestmark = pytest.mark.anyio

GROUP = "g"
MQ = MessageQueue("T", 0)
MQ2 = MessageQueue("T", 1)
KEY = StageKey("s", None)


def _stores(backend: Backend) -> tuple[StageOffsetStore, StageOffsetStore]:
    old, new = backend.new_store(), backend.new_store()
    if isinstance(old, MemoryOffsetStore) and isinstance(new, MemoryOffsetStore):
        new._fences = old._fences  # one durable place, as for _stored
    return old, new


@pytest.mark.slow
async def test_new_owner_fences_off_the_old_one(backend: Backend) -> None:
    old, new = _stores(backend)
    async with old, new:
        assert await old.claim(GROUP, MQ, 10) is None
        old.update_progress(GROUP, MQ, QueueProgress(consume_offset=5, stage_offsets={KEY: 5}))
        old.update_progress(GROUP, MQ2, QueueProgress(consume_offset=7))
        await old.claim(GROUP, MQ2, 10)
        await old.persist_fenced(GROUP, {MQ: 10, MQ2: 10})

        # The lock of MQ expires; the new owner claims it with a newer epoch and
        # reads what the old one committed.
        claimed = await new.claim(GROUP, MQ, 11)
        assert claimed == QueueProgress(consume_offset=5, stage_offsets={KEY: 5})
        assert await new.read_offset(GROUP, MQ, ReadOffsetType.READ_FROM_MEMORY) == 5

        # The old owner, late, tries to commit more: refused for MQ, written for MQ2.
        old.update_progress(GROUP, MQ, QueueProgress(consume_offset=9, stage_offsets={KEY: 9}))
        old.update_progress(GROUP, MQ2, QueueProgress(consume_offset=8))
        with pytest.raises(StoreFencedError) as refused:
            await old.persist_fenced(GROUP, {MQ: 10, MQ2: 10})
        assert refused.value.queues == {MQ}
        assert not refused.value.retriable
        stored = await new.list_progress(GROUP)
        assert stored[MQ] == QueueProgress(consume_offset=5, stage_offsets={KEY: 5})
        assert stored[MQ2].consume_offset == 8

        # The new owner commits with its token; a claim with an older token fails.
        new.update_progress(GROUP, MQ, QueueProgress(consume_offset=6, stage_offsets={KEY: 6}))
        await new.persist_fenced(GROUP, {MQ: 11})
        with pytest.raises(StoreFencedError):
            await old.claim(GROUP, MQ, 10)
        assert (await new.list_progress(GROUP))[MQ].consume_offset == 6
        # Same token again (a renewal of the same lock) is fine.
        assert (await new.claim(GROUP, MQ, 11)) == QueueProgress(
            consume_offset=6, stage_offsets={KEY: 6}
        )


async def test_unfenced_persist_still_works_and_increase_only_holds(backend: Backend) -> None:
    store, _ = _stores(backend)
    async with store:
        await store.claim(GROUP, MQ, 3)
        store.update_progress(GROUP, MQ, QueueProgress(consume_offset=10))
        await store.persist_fenced(GROUP, {MQ: 3})
        store.update_progress(GROUP, MQ, QueueProgress(consume_offset=4))
        await store.persist_fenced(GROUP, {MQ: 4})
        assert (await store.list_progress(GROUP))[MQ].consume_offset == 10


@pytest.mark.parametrize("old_version", [1, 2])
async def test_older_schema_versions_are_migrated(sql_backend: Backend, old_version: int) -> None:
    assert SCHEMA_VERSION == 4
    assert sql_backend.url is not None
    prefix = sql_backend.prefix
    # An older database: version 3's tables without what later versions added
    # (version 2: the fence column; version 3: the finished column and the marks table).
    row = {"consumer_group": GROUP, "topic": MQ.topic, "queue_id": MQ.queue_id}
    create_v3(sql_backend.url, prefix, [{**row, "consume_offset": 42, "stage_offsets": "[]"}])
    engine = sa.create_engine(sql_backend.url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE {prefix}marks"))
            conn.execute(sa.text(f"ALTER TABLE {prefix}progress DROP COLUMN finished"))
            if old_version < 2:
                conn.execute(sa.text(f"ALTER TABLE {prefix}progress DROP COLUMN fence"))
            conn.execute(sa.text(f"UPDATE {prefix}schema SET version = {old_version}"))
    finally:
        engine.dispose()
    store = sql_backend.new_store()
    assert isinstance(store, SqlOffsetStore)
    async with store:
        assert (await store.list_progress(GROUP))[MQ].consume_offset == 42
        assert await store.claim(GROUP, MQ, 1) == QueueProgress(consume_offset=42)
        store.update_progress(GROUP, MQ, QueueProgress(consume_offset=43, finished=[(45, 47)]))
        await store.persist_fenced(GROUP, {MQ: 1})
        with pytest.raises(StoreFencedError):
            await store.claim(GROUP, MQ, 0)
        await store.transact(GROUP, MQ, [48], lambda conn: None, fence=1)
        assert (await store.read_progress(GROUP, MQ, ReadOffsetType.READ_FROM_STORE)) == (
            QueueProgress(consume_offset=43, finished=[(45, 48)])
        )
    engine = sa.create_engine(sql_backend.url)
    try:
        with engine.connect() as conn:
            version = conn.execute(sa.text(f"SELECT version FROM {prefix}schema")).scalar_one()
    finally:
        engine.dispose()
    assert version == 4
