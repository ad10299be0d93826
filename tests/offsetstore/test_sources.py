"""Progress keyed by source (schema version 4): the migration of a version 3
database with rows, its adoption by the first source that uses a group, and one
database keeping the progress of several sources apart."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import sqlalchemy as sa

from offsetstore import (
    MemoryOffsetStore,
    QueueProgress,
    ReadOffsetType,
    SqlOffsetStore,
    StageKey,
    StoreConfigurationError,
    StoreFencedError,
)
from stagedconsumer import MemoryBroker, MessageListenerConcurrently, MessageQueue, PushConsumer
from stagedconsumer._cli import main

from ._v3 import create_v3
from .conftest import Backend, _backend_fixture

T0, T1 = MessageQueue("t", 0), MessageQueue("t", 1)
DEFAULT = StageKey("default")
A, B = "redis://127.0.0.1:6379/0#a", "redis://127.0.0.1:6379/0#b"


def _v3_rows() -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    def row(group: str, queue: int, offset: int, **more: object) -> dict[str, object]:
        values: dict[str, object] = {"stage_offsets": "[]", "fence": 0, "finished": None}
        values.update(more)
        return {"consumer_group": group, "topic": "t", "queue_id": queue,
                "consume_offset": offset, **values}  # fmt: skip

    rows = [
        row("g", 0, 10, stage_offsets='[["default",null,3]]', fence=7, finished="2+1"),
        row("g", 1, 5),
        row("h", 0, 1),
    ]
    marks = [{"consumer_group": "g", "topic": "t", "queue_id": 1, "queue_offset": 8}]
    return rows, marks


@pytest.mark.anyio
async def test_a_v3_database_with_rows_is_migrated_and_adopted_by_the_first_source(
    sql_backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    url, prefix = sql_backend.url, sql_backend.prefix
    assert url is not None
    create_v3(url, prefix, *_v3_rows())
    init = ["offsets", "init", "--store", url, "--table-prefix", prefix]
    assert await anyio.to_thread.run_sync(main, init) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "migrated the tables from schema version 3 to 4" in out
    assert "3 progress row(s) have no source yet" in out

    async with SqlOffsetStore(url, table_prefix=prefix, source=A) as first:
        assert await first.adopt_unscoped_progress("g") == 2
        assert await first.adopt_unscoped_progress("g") == 0  # once
        assert await first.list_progress("g") == {
            T0: QueueProgress(consume_offset=10, stage_offsets={DEFAULT: 3}, finished=[(12, 13)]),
            T1: QueueProgress(consume_offset=5, finished=[(8, 8)]),  # its mark moved too
        }
        with pytest.raises(StoreFencedError):
            await first.claim("g", T0, 6)  # the fence came along: 7
        assert await first.claim("g", T0, 7) is not None
    async with SqlOffsetStore(url, table_prefix=prefix, source=B) as other:
        assert await other.adopt_unscoped_progress("g") == 0  # taken by the first source
        assert await other.list_progress("g") == {}
        assert await other.read_progress("g", T0) is None
        assert await other.adopt_unscoped_progress("h") == 1  # nobody had used h
        assert await other.list_progress("h") == {T0: QueueProgress(consume_offset=1)}
    async with SqlOffsetStore(url, table_prefix=prefix, read_only=True) as reader:
        assert await reader.list_sources("g") == [A]
        assert (await reader.list_progress("g"))[T0].consume_offset == 10  # g's only source


def _run_printed_sql(url: str, text: str) -> None:
    statements = [
        "\n".join(line for line in chunk.splitlines() if not line.startswith("--")).strip()
        for chunk in text.split(";\n")
    ]
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            for statement in statements:
                if statement and statement not in ("BEGIN", "COMMIT"):
                    conn.exec_driver_sql(statement)
    finally:
        engine.dispose()


@pytest.mark.anyio
async def test_the_printed_migration_sql_migrates_a_v3_database(
    sql_backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    """For a DBA: ``offsets init --sql --from-version 3``, run by hand, gives the
    tables a store of this version uses without migrating anything itself."""
    url, prefix = sql_backend.url, sql_backend.prefix
    assert url is not None
    create_v3(url, prefix, *_v3_rows())
    dialect = sa.make_url(url).get_backend_name()
    args = ["offsets", "init", "--sql", "--dialect", dialect, "--from-version", "3",
            "--table-prefix", prefix]  # fmt: skip
    assert await anyio.to_thread.run_sync(main, args) == 0
    _run_printed_sql(url, capsys.readouterr().out)
    async with SqlOffsetStore(url, table_prefix=prefix, source=A, create_tables=False) as store:
        assert await store.adopt_unscoped_progress("g") == 2
        assert (await store.read_progress("g", T1)) == QueueProgress(
            consume_offset=5, finished=[(8, 8)]
        )
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            version = conn.exec_driver_sql(f"SELECT version FROM {prefix}schema").scalar_one()
    finally:
        engine.dispose()
    assert version == 4


@pytest.mark.anyio
async def test_one_database_keeps_the_progress_of_two_sources_apart(sql_backend: Backend) -> None:
    url, prefix = sql_backend.url, sql_backend.prefix
    assert url is not None
    async with (
        SqlOffsetStore(url, table_prefix=prefix, source=A) as a,
        SqlOffsetStore(url, table_prefix=prefix, source=B) as b,
    ):
        assert await a.claim("g", T0, 5) is None
        assert await b.claim("g", T0, 1) is None  # fences are per source too
        a.update_progress("g", T0, QueueProgress(consume_offset=50))
        await a.persist_fenced("g", {T0: 5})
        b.update_progress("g", T0, QueueProgress(consume_offset=3))
        await b.persist_fenced("g", {T0: 1})
        await b.transact("g", T0, [4], lambda connection: None, fence=1)
        assert await a.list_progress("g") == {T0: QueueProgress(consume_offset=50)}
        assert await b.list_progress("g") == {
            T0: QueueProgress(consume_offset=3, finished=[(4, 4)])
        }
        b.update_progress("g", T0, QueueProgress(consume_offset=2))
        await b.persist_all("g", [T0])  # increase-only, per source
        assert (await b.read_progress("g", T0, ReadOffsetType.READ_FROM_STORE)) == QueueProgress(
            consume_offset=3, finished=[(4, 4)]
        )
    async with SqlOffsetStore(url, table_prefix=prefix, read_only=True) as unbound:
        assert await unbound.list_sources("g") == [A, B]
        with pytest.raises(StoreConfigurationError, match="2 sources"):
            await unbound.list_progress("g")
        rows = await unbound.inspect_progress("g", every_source=True)
        assert [(row.source, row.consume_offset) for row in rows] == [(A, 50), (B, 3)]


class _Quiet(MessageListenerConcurrently):
    async def consume_message(self, msgs: object, context: object) -> None:
        pass


def test_a_store_object_keeps_one_source() -> None:
    store = MemoryOffsetStore()
    PushConsumer("g", MemoryBroker(name="a"), _Quiet(), offset_store=store)
    assert store.source == "memory://a"
    PushConsumer("g2", MemoryBroker(name="a"), _Quiet(), offset_store=store)  # the same: fine
    with pytest.raises(StoreConfigurationError, match=r"memory://a.*memory://b"):
        PushConsumer("g", MemoryBroker(name="b"), _Quiet(), offset_store=store)
    with pytest.raises(StoreConfigurationError, match=r"memory://a.*memory://b"):
        PushConsumer("g", MemoryBroker(name="b"), _Quiet(), offset_store=MemoryOffsetStore(
            source="memory://a"))  # fmt: skip


@pytest.mark.anyio
async def test_the_memory_store_adopts_progress_stored_without_a_source() -> None:
    store = MemoryOffsetStore()
    store.update_progress("g", T0, QueueProgress(consume_offset=4))
    await store.persist_all("g", [T0])
    store.bind_source(A)
    assert await store.adopt_unscoped_progress("g") == 1
    assert await store.read_progress("g", T0) == QueueProgress(consume_offset=4)
    other = MemoryOffsetStore(source=B)
    assert await other.adopt_unscoped_progress("g") == 0
    assert await other.read_progress("g", T0) is None


def test_show_and_reset_name_the_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'progress.db'}"

    async def fill() -> None:
        for source, offset in ((A, 50), (B, 3)):
            async with SqlOffsetStore(url, source=source) as store:
                store.update_progress("g", T0, QueueProgress(consume_offset=offset))
                await store.persist_all("g", [T0])

    anyio.run(fill)
    show = ["offsets", "show", "--store", url, "--group", "g"]
    assert main([*show, "--json"]) == 0
    queues = json.loads(capsys.readouterr().out)["queues"]
    assert [(q["source"], q["consume_offset"]) for q in queues] == [(A, 50), (B, 3)]
    assert main([*show, "--source", B, "--json"]) == 0
    assert [q["consume_offset"] for q in json.loads(capsys.readouterr().out)["queues"]] == [3]
    reset = ["offsets", "reset", "--store", url, "--group", "g", "--topic", "t",
             "--to-offset", "0", "--yes"]  # fmt: skip
    assert main(reset) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"2 sources ({A}, {B}): say which with --source" in err
    assert main([*reset, "--source", B]) == 0
    assert f"Source: {B}" in capsys.readouterr().out
    assert main([*show, "--json"]) == 0
    queues = json.loads(capsys.readouterr().out)["queues"]
    assert [(q["source"], q["consume_offset"]) for q in queues] == [(A, 50), (B, 0)]


@pytest.fixture
async def postgres_backend(tmp_path: Path) -> AsyncIterator[Backend]:
    async for value in _backend_fixture("postgres", tmp_path):
        yield value


@pytest.mark.postgres
@pytest.mark.anyio
async def test_a_least_privilege_role_adopts_migrated_progress_with_the_same_grants(
    postgres_backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    """After ``offsets init`` migrated a version 3 database (as the tables' owner), a
    role with only the grants ``--sql`` prints adopts the rows, finished marks
    included, for its source."""
    url, prefix = postgres_backend.url, postgres_backend.prefix
    assert url is not None
    create_v3(url, prefix, *_v3_rows())
    init = ["offsets", "init", "--store", url, "--table-prefix", prefix]
    assert await anyio.to_thread.run_sync(main, init) == 0
    role = f"sc_app_{uuid.uuid4().hex[:10]}"
    sql = ["offsets", "init", "--sql", "--dialect", "postgresql", "--table-prefix", prefix,
           "--grant-to", role]  # fmt: skip
    assert await anyio.to_thread.run_sync(main, sql) == 0
    grants = [line for line in capsys.readouterr().out.splitlines() if line.startswith("GRANT")]
    _run_printed_sql(url, f"CREATE ROLE {role} LOGIN;\n" + ";\n".join(grants) + "\n")
    try:
        role_url = sa.make_url(url).set(username=role, password=None)
        async with SqlOffsetStore(role_url, table_prefix=prefix, source=A) as store:
            assert await store.adopt_unscoped_progress("g") == 2
            assert (await store.read_progress("g", T1)) == QueueProgress(
                consume_offset=5, finished=[(8, 8)]
            )
    finally:
        _run_printed_sql(url, f"DROP OWNED BY {role};\nDROP ROLE {role};\n")


@pytest.mark.anyio
async def test_stores_racing_to_migrate_a_v3_database_all_start(sql_backend: Backend) -> None:
    url, prefix = sql_backend.url, sql_backend.prefix
    assert url is not None
    create_v3(url, prefix, *_v3_rows())
    stores = [SqlOffsetStore(url, table_prefix=prefix, source=A) for _ in range(4)]
    try:
        async with anyio.create_task_group() as tg:
            for store in stores:
                tg.start_soon(store.load)
        adopted = [await store.adopt_unscoped_progress("g") for store in stores]
        assert sorted(adopted) == [0, 0, 0, 2]
        assert (await stores[0].read_progress("g", T0)) is not None
    finally:
        for store in stores:
            await store.aclose()
