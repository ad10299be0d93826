"""SqlOffsetStore specifics: URLs, connection failures, schema version, SQLite setup."""

from __future__ import annotations

import json
import shlex
import sqlite3
from pathlib import Path

import anyio
import pytest
import sqlalchemy as sa

from benchmarks._ports import free_port
from offsetstore import (
    OffsetStoreError,
    QueueProgress,
    ReadOffsetType,
    SqlOffsetStore,
    StageKey,
    StoreCommitError,
    StoreConfigurationError,
    StoreUnavailableError,
)
from offsetstore._sql import SCHEMA_VERSION, decode_stage_offsets, encode_stage_offsets
from stagedconsumer import MessageQueue
from stagedconsumer._cli import main

from .conftest import Backend, drop_tables

pytestmark = pytest.mark.anyio

MQ = MessageQueue("t", 0)


# -- configuration errors (raised at construction, no database needed) -------------------


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("not a url", "malformed offset store URL"),
        ("postgresql+psycopg://user:secret@host:port/db", "malformed offset store URL"),
        ("oracle://scott@host/db", "unsupported offset store database 'oracle'"),
        ("postgresql+nosuchdriver://u@h/db", "cannot use offset store URL"),
    ],
)
def test_malformed_or_unsupported_url_is_a_configuration_error(url: str, match: str) -> None:
    with pytest.raises(StoreConfigurationError, match=match) as info:
        SqlOffsetStore(url)
    assert info.value.retriable is False
    assert "secret" not in str(info.value)


@pytest.mark.parametrize("prefix", ["", "1abc_", "drop table;", "a-b", "é_", "a" * 49])
def test_bad_table_prefix_is_a_configuration_error(prefix: str) -> None:
    with pytest.raises(StoreConfigurationError, match="table_prefix"):
        SqlOffsetStore("sqlite://", table_prefix=prefix)


def test_password_is_hidden_in_repr_and_url() -> None:
    store = SqlOffsetStore("postgresql+psycopg://user:secret@127.0.0.1:1/db")
    assert "secret" not in repr(store)
    assert "secret" not in store.url


# -- unreachable databases at load() ------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        "postgresql+psycopg://postgres@127.0.0.1:{port}/test",
        "mysql+pymysql://root@127.0.0.1:{port}/test",
    ],
    ids=["postgres", "mariadb"],
)
async def test_unreachable_database_at_load_is_a_clear_retriable_error(template: str) -> None:
    url = template.format(port=free_port())
    store = SqlOffsetStore(url, connect_timeout=2)
    try:
        with pytest.raises(StoreUnavailableError, match="cannot reach the offset store") as info:
            await store.load()
        assert info.value.retriable is True
        assert isinstance(info.value.__cause__, sa.exc.DBAPIError)
        assert "127.0.0.1" in str(info.value)
        # Every later call reports the same, wrapped.
        with pytest.raises(OffsetStoreError) as later:
            await store.read_progress("g", MQ)
        assert later.value.retriable is True
    finally:
        await store.aclose()


async def test_sqlite_file_in_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    store = SqlOffsetStore(f"sqlite:///{tmp_path / 'missing' / 'progress.db'}")
    try:
        with pytest.raises(StoreUnavailableError, match="cannot reach the offset store") as info:
            await store.load()
        assert f"the directory {tmp_path / 'missing'} does not exist" in str(info.value)
    finally:
        await store.aclose()


async def test_closed_store_refuses_work(tmp_path: Path) -> None:
    store = SqlOffsetStore(f"sqlite:///{tmp_path / 'p.db'}")
    await store.load()
    await store.aclose()
    await store.aclose()  # idempotent
    with pytest.raises(StoreUnavailableError, match="closed") as info:
        await store.read_progress("g", MQ)
    assert info.value.retriable is False


# -- schema -----------------------------------------------------------------------------------


def _engine(backend: Backend) -> sa.Engine:
    assert backend.url is not None
    return sa.create_engine(backend.url)


def _execute(backend: Backend, statement: str, **params: object) -> None:
    """Run ``statement`` on the backend's database directly (behind the store's back)."""
    engine = _engine(backend)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(statement), params)
    finally:
        engine.dispose()


async def test_load_creates_tables_with_a_schema_version_row(sql_backend: Backend) -> None:
    store = sql_backend.new_store()
    await store.load()
    await store.load()  # idempotent
    assert isinstance(store, SqlOffsetStore)
    engine = _engine(sql_backend)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(f"SELECT component, version FROM {store.schema_table_name}")
            ).all()
    finally:
        engine.dispose()
    # (MariaDB keeps names as VARBINARY, so its driver returns bytes.)
    decoded = [(c.decode() if isinstance(c, bytes) else c, v) for c, v in rows]
    assert decoded == [("offsetstore", SCHEMA_VERSION)]


@pytest.mark.slow
async def test_stores_creating_tables_at_once_all_succeed(sql_backend: Backend) -> None:
    """Stores that race to create the tables all load, round after round on fresh
    tables: one that loses the race for the first table while the winner is still
    creating the second one tries again instead of failing (it did, about one round
    in ten on MariaDB)."""
    assert sql_backend.url is not None
    first_prefix = sql_backend.prefix
    try:
        for round_ in range(8):
            sql_backend.prefix = f"{first_prefix}r{round_}_"
            stores = [sql_backend.new_store() for _ in range(6)]
            async with anyio.create_task_group() as tg:
                for store in stores:
                    tg.start_soon(store.load)
            stores[0].update_offset("g", MQ, round_ + 1)
            await stores[0].persist("g", MQ)
            assert await stores[-1].read_offset("g", MQ) == round_ + 1
            await sql_backend.close()
            drop_tables(sql_backend.url, sql_backend.prefix)
    finally:
        sql_backend.prefix = first_prefix


async def test_newer_schema_version_is_refused(sql_backend: Backend) -> None:
    store = sql_backend.new_store()
    await store.load()
    assert isinstance(store, SqlOffsetStore)
    _execute(
        sql_backend, f"UPDATE {store.schema_table_name} SET version = :v", v=SCHEMA_VERSION + 1
    )
    newer = sql_backend.new_store()
    with pytest.raises(StoreConfigurationError, match="newer than") as info:
        await newer.load()
    assert info.value.retriable is False


async def test_without_create_tables_missing_tables_are_an_error(sql_backend: Backend) -> None:
    if sql_backend.name == "sqlite":  # an empty database; a missing file: the test below
        assert sql_backend.url is not None
        await anyio.Path(sa.make_url(sql_backend.url).database or "").touch()
    store = sql_backend.new_store(create_tables=False)
    with pytest.raises(StoreConfigurationError, match="no offset store tables"):
        await store.load()
    await sql_backend.new_store().load()
    existing = sql_backend.new_store(create_tables=False)
    await existing.load()
    assert await existing.list_progress("g") == {}


async def test_corrupt_row_is_a_non_retriable_error(sql_backend: Backend) -> None:
    store = sql_backend.new_store()
    await store.load()
    store.update_offset("g", MQ, 3)
    await store.persist("g", MQ)
    assert isinstance(store, SqlOffsetStore)
    _execute(sql_backend, f"UPDATE {store.progress_table_name} SET stage_offsets = '{{}}'")
    with pytest.raises(OffsetStoreError, match="corrupt progress row") as info:
        await sql_backend.new_store().read_progress("g", MQ)
    assert info.value.retriable is False


async def test_unreadable_stage_offsets_name_the_command_that_repairs_them(
    sql_backend: Backend,
) -> None:
    """A row stored before stage offsets were checked (a negative one, from seek())
    fails every read; the error gives the ``offsets reset`` command that repairs that
    row, ready to paste, and the command does."""
    store = sql_backend.new_store()
    await store.load()
    store.update_progress(
        "g", MQ, QueueProgress(consume_offset=3, stage_offsets={StageKey("s"): 2})
    )
    await store.persist("g", MQ)
    assert isinstance(store, SqlOffsetStore)
    bad = '[["s",null,-1]]'
    _execute(sql_backend, f"UPDATE {store.progress_table_name} SET stage_offsets = :bad", bad=bad)
    with pytest.raises(OffsetStoreError, match="corrupt progress row for t#0") as info:
        await sql_backend.new_store().read_progress("g", MQ)
    message = str(info.value)
    assert "bad stage offset entry ['s', None, -1]; with the group stopped, repair" in message
    command = message.partition(" with: ")[2]
    assert command == (
        f"stagedconsumer offsets reset --store {sql_backend.url}"
        f" --table-prefix {sql_backend.prefix} --group g --topic t --queue 0"
        " --clear-stage-offsets"
    )
    words = shlex.split(command)
    assert await anyio.to_thread.run_sync(main, [*words[1:], "--yes"]) == 0
    assert await sql_backend.new_store().read_progress("g", MQ) == QueueProgress(consume_offset=3)


async def test_unreadable_consume_offset_names_the_forced_repair(sql_backend: Backend) -> None:
    """``--clear-stage-offsets`` keeps the consume offset, so it cannot repair a row
    whose consume offset is bad too: the error names ``--to-offset N --force``."""
    store = sql_backend.new_store()
    await store.load()
    store.update_offset("g", MQ, 3)
    await store.persist("g", MQ)
    assert isinstance(store, SqlOffsetStore)
    _execute(
        sql_backend,
        f"UPDATE {store.progress_table_name} SET consume_offset = -1, stage_offsets = :bad",
        bad='[["s",null,-1]]',
    )
    with pytest.raises(OffsetStoreError, match="corrupt progress row for t#0") as info:
        await sql_backend.new_store().read_progress("g", MQ)
    assert "--clear-stage-offsets" not in str(info.value)
    assert "--queue 0 --to-offset N --force" in str(info.value)


# -- SQLite -----------------------------------------------------------------------------------


async def test_sqlite_uses_wal_and_survives_a_new_process_view(tmp_path: Path) -> None:
    path = tmp_path / "progress.db"
    store = SqlOffsetStore(f"sqlite:///{path}")
    try:
        store.update_progress(
            "g", MQ, QueueProgress(consume_offset=5, stage_offsets={StageKey("s"): 2})
        )
        await store.persist("g", MQ)  # tables are created on first use
    finally:
        await store.aclose()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        rows = conn.execute(
            "SELECT consumer_group, topic, queue_id, consume_offset, stage_offsets"
            " FROM stagedconsumer_progress"
        ).fetchall()
    conn.close()
    assert rows == [("g", "t", 0, 5, '[["s",null,2]]')]


@pytest.mark.parametrize("read_only", [False, True])
def test_a_store_that_creates_no_tables_creates_no_sqlite_file(
    tmp_path: Path, read_only: bool
) -> None:
    path = tmp_path / "typo.db"

    async def use(store: SqlOffsetStore) -> None:
        try:
            with pytest.raises(StoreConfigurationError, match=r"the SQLite file .* does not exist"):
                await store.load()
            with pytest.raises(StoreConfigurationError, match="does not exist"):
                await store.list_progress("g")
        finally:
            await store.aclose()

    anyio.run(use, SqlOffsetStore(f"sqlite:///{path}", create_tables=False, read_only=read_only))
    assert not path.exists()


async def test_a_database_in_memory_has_no_file_to_miss() -> None:
    memory = SqlOffsetStore(
        "sqlite:///file:nofile?mode=memory&uri=true",
        create_tables=False,
        engine_options={"poolclass": sa.StaticPool, "connect_args": {"check_same_thread": False}},
    )
    try:
        with pytest.raises(StoreConfigurationError, match="no offset store tables"):
            await memory.load()
    finally:
        await memory.aclose()


async def test_sqlite_in_memory_works_from_worker_threads() -> None:
    store = SqlOffsetStore("sqlite://")
    try:
        for i in range(20):
            store.update_offset("g", MessageQueue("t", i), i)
        await store.persist_all("g", [MessageQueue("t", i) for i in range(20)])
        assert len(await store.list_progress("g")) == 20
    finally:
        await store.aclose()


async def test_locked_sqlite_database_is_a_retriable_commit_error(tmp_path: Path) -> None:
    path = tmp_path / "progress.db"
    store = SqlOffsetStore(f"sqlite:///{path}", connect_timeout=0.2)
    try:
        await store.load()
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            blocker.execute("BEGIN EXCLUSIVE")
            store.update_offset("g", MQ, 7)
            with pytest.raises(StoreCommitError, match="locked") as info:
                await store.persist("g", MQ)
            assert info.value.retriable is True
            assert isinstance(info.value.__cause__, sa.exc.OperationalError)
        finally:
            blocker.rollback()
            blocker.close()
        await store.persist("g", MQ)  # the retry succeeds once the lock is gone
        assert await store.read_offset("g", MQ, read_type=ReadOffsetType.READ_FROM_STORE) == 7
    finally:
        await store.aclose()


# -- encoding -------------------------------------------------------------------------------------


def test_stage_offsets_encoding_is_canonical_and_strict() -> None:
    offsets = {StageKey("b", ""): 1, StageKey("a", None): 2, StageKey("b", None): 3}
    text = encode_stage_offsets(offsets)
    assert text == '[["a",null,2],["b",null,3],["b","",1]]'
    assert decode_stage_offsets(text) == offsets
    for bad in ["{}", '[["a"]]', '[["a",null,-1]]', '[["a",1,2]]', '[["a",null,true]]']:
        with pytest.raises(ValueError, match="stage offset"):
            decode_stage_offsets(bad)


def test_stage_offsets_encoding_kept_per_key_order_matches_a_fresh_one() -> None:
    """The encoding worked out once per tuple of keys gives, for every insertion order
    and every value, what sorting the entries gives."""
    keys = [StageKey("b", ""), StageKey("a", None), StageKey("b", None), StageKey('q"\\', "é")]

    def expected(offsets: dict[StageKey, int]) -> str:
        entries = sorted(
            offsets.items(),
            key=lambda kv: (kv[0].strategy_id, kv[0].group_id is not None, kv[0].group_id or ""),
        )
        return json.dumps(
            [[k.strategy_id, k.group_id, v] for k, v in entries], separators=(",", ":")
        )

    for shift in range(len(keys)):
        order = keys[shift:] + keys[:shift]
        for base in (0, 7, 2**40):
            offsets = {key: base + i for i, key in enumerate(order)}
            for _ in range(2):  # worked out, then kept
                assert encode_stage_offsets(offsets) == expected(offsets)
                assert decode_stage_offsets(encode_stage_offsets(offsets)) == offsets
    assert encode_stage_offsets({}) == "[]"


@pytest.mark.slow
async def test_operation_timeout_abandons_a_stuck_call_and_late_commits_never_regress(
    tmp_path: Path,
) -> None:
    path = tmp_path / "progress.db"
    # The tables are made first, by a store without the short timeout: creating them
    # can take longer than 0.3 s on a loaded machine, and is not what is tested here.
    setup = SqlOffsetStore(f"sqlite:///{path}")
    await setup.load()
    await setup.aclose()
    store = SqlOffsetStore(f"sqlite:///{path}", connect_timeout=3, operation_timeout=0.3)
    try:
        await store.load()
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            blocker.execute("BEGIN EXCLUSIVE")
            store.update_offset("g", MQ, 10)
            with pytest.raises(StoreUnavailableError, match="operation_timeout") as info:
                await store.persist("g", MQ)  # stuck on the lock, abandoned after 0.3 s
            assert info.value.retriable is True
            store.update_offset("g", MQ, 5)  # an older value, also left stuck
            with pytest.raises(StoreUnavailableError, match="operation_timeout"):
                await store.persist("g", MQ)
        finally:
            blocker.rollback()
            blocker.close()
        # Both abandoned writes now finish in their threads, in either order.
        reader = SqlOffsetStore(f"sqlite:///{path}")
        try:
            with anyio.fail_after(10):
                while await reader.read_offset("g", MQ, ReadOffsetType.READ_FROM_STORE) != 10:
                    await anyio.sleep(0.05)
            await anyio.sleep(0.5)
            assert await reader.read_offset("g", MQ, ReadOffsetType.READ_FROM_STORE) == 10
        finally:
            await reader.aclose()
    finally:
        await store.aclose()


def test_operation_timeout_must_be_positive() -> None:
    with pytest.raises(StoreConfigurationError, match="operation_timeout"):
        SqlOffsetStore("sqlite://", operation_timeout=0)


# -- closing ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.postgres
async def test_close_waits_for_an_abandoned_operation_and_closes_its_connection() -> None:
    """An operation whose caller gave up keeps running in its thread until the
    database answers; closing the store waits for it, so its connection is closed
    with the pool instead of being left open for the garbage collector (psycopg
    warns when it collects an open connection)."""
    import gc
    import uuid
    import warnings

    from .conftest import POSTGRES_URL, drop_tables, require_url

    url = require_url("PostgreSQL", POSTGRES_URL)
    prefix = f"t{uuid.uuid4().hex[:10]}_"
    store = SqlOffsetStore(url, table_prefix=prefix, source="s")
    locker = sa.create_engine(url)
    try:
        store.update_offset("g", MQ, 1)
        await store.persist("g", MQ)  # creates the tables
        conn = locker.connect()
        conn.execute(sa.text(f"LOCK TABLE {store.progress_table_name} IN ACCESS EXCLUSIVE MODE"))
        store.update_offset("g", MQ, 2)
        with anyio.move_on_after(0.3) as scope:
            await store.persist("g", MQ)  # waits for the lock: abandoned in its thread
        assert scope.cancelled_caught

        async def release() -> None:
            await anyio.sleep(0.3)
            await anyio.to_thread.run_sync(conn.close)  # rolls back: the lock goes

        async with anyio.create_task_group() as tg:
            tg.start_soon(release)
            await store.aclose()
        await anyio.sleep(0.5)  # time for an operation still running to finish
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gc.collect()
        assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
        check = SqlOffsetStore(url, table_prefix=prefix, source="s")
        try:
            assert await check.read_offset("g", MQ) == 2  # the abandoned write completed
        finally:
            await check.aclose()
    finally:
        await store.aclose()
        locker.dispose()
        drop_tables(url, prefix)


def test_a_bulk_commit_pauses_the_collector_and_leaves_it_as_it_found_it() -> None:
    import gc

    from offsetstore._sql import _collection_paused

    was = gc.isenabled()
    try:
        gc.enable()
        with _collection_paused():
            assert not gc.isenabled()
            with _collection_paused():  # a second commit's thread overlapping
                assert not gc.isenabled()
            assert not gc.isenabled()  # the first one is still running
        assert gc.isenabled()
        gc.disable()  # the application's choice
        with _collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
