"""A database the store can read but not write: told at load(), and never retried.

The tests run as root in CI, and root ignores permission bits, so ``chmod`` makes
nothing read-only here. What does: SQLite's ``?mode=ro`` URI parameter and
``PRAGMA query_only``, a directory where nothing can be created (``/proc/sys``), a
read-only mount (only where this process may mount; skipped elsewhere), PostgreSQL's
``default_transaction_read_only`` and MariaDB's ``SET SESSION TRANSACTION READ ONLY``,
both per connection, so the shared servers stay writable for every other test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from offsetstore import (
    OffsetStoreError,
    QueueProgress,
    SqlOffsetStore,
    StageKey,
    StoreCommitError,
    StoreReadOnlyError,
    StoreUnavailableError,
)
from stagedconsumer import MessageQueue

from .conftest import Backend

pytestmark = pytest.mark.anyio

GROUP = "g"
MQ = MessageQueue("t", 0)
KEY = StageKey("s", None)
STORED = QueueProgress(consume_offset=5, stage_offsets={KEY: 2})
FAST = 5.0
"""Seconds a failing load() may take. Before the fix a read-only SQLite file stalled
load() for twice ``connect_timeout`` (20 s) before failing."""


def _sqlite_path(backend: Backend) -> Path:
    assert backend.url is not None
    database = sa.make_url(backend.url).database
    assert database is not None
    return Path(database)


def read_only_store(backend: Backend, **kwargs: Any) -> SqlOffsetStore:
    """A store on ``backend``'s database whose every connection is read-only."""
    assert backend.url is not None
    if backend.name == "sqlite":
        url = f"sqlite:///file:{_sqlite_path(backend)}?mode=ro&uri=true"
        store = backend.new_store(url, **kwargs)
    elif backend.name == "postgres":
        url = (
            sa.make_url(backend.url)
            .update_query_dict({"options": "-c default_transaction_read_only=on"})
            .render_as_string(hide_password=False)
        )
        store = backend.new_store(url, **kwargs)
    else:
        init = {"init_command": "SET SESSION TRANSACTION READ ONLY"}
        store = backend.new_store(engine_options={"connect_args": init}, **kwargs)
    assert isinstance(store, SqlOffsetStore)
    return store


_READ_ONLY_SESSION = {
    "sqlite": "PRAGMA query_only=ON",
    "postgres": "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
    "mariadb": "SET SESSION TRANSACTION READ ONLY",
}


@contextlib.contextmanager
def connections_made_read_only(backend: Backend, store: SqlOffsetStore) -> Iterator[None]:
    """From now on the store's connections are read-only (a database remounted
    read-only, a primary demoted to a standby), until the block ends."""
    engine: sa.Engine = store._engine
    statement = _READ_ONLY_SESSION[backend.name]

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        autocommit = backend.name == "postgres"  # PostgreSQL would roll the SET back
        if autocommit:
            dbapi_connection.autocommit = True
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(statement)
        finally:
            cursor.close()
        if autocommit:
            dbapi_connection.autocommit = False

    sa.event.listen(engine, "connect", on_connect)
    engine.dispose()  # pooled connections were made before: replace them
    try:
        yield
    finally:
        sa.event.remove(engine, "connect", on_connect)
        engine.dispose()


async def _store_some_progress(backend: Backend) -> None:
    writer = backend.new_store()
    await writer.load()
    writer.update_progress(GROUP, MQ, STORED)
    await writer.persist(GROUP, MQ)
    await writer.aclose()


def _assert_read_only_error(error: OffsetStoreError, store: SqlOffsetStore) -> None:
    assert isinstance(error, StoreReadOnlyError)
    assert isinstance(error, StoreUnavailableError)  # where it sits in the tree
    assert error.retriable is False
    assert "read-only" in str(error)
    assert store.url in str(error)
    assert isinstance(error.__cause__, sa.exc.DBAPIError)


async def _load_fails_read_only(store: SqlOffsetStore) -> None:
    started = time.monotonic()
    with pytest.raises(StoreReadOnlyError) as info:
        await store.load()
    assert time.monotonic() - started < FAST
    _assert_read_only_error(info.value, store)


# -- at load() ---------------------------------------------------------------------------------


async def test_load_on_a_read_only_database_raises_at_once(sql_backend: Backend) -> None:
    """The tables exist, so load() itself writes nothing; before the fix it succeeded
    and every commit after it failed, retriable, forever."""
    await _store_some_progress(sql_backend)
    store = read_only_store(sql_backend, connect_timeout=10)
    await _load_fails_read_only(store)
    # Nothing was changed by the check (a write rolled back).
    reader = sql_backend.new_store()
    await reader.load()
    assert await reader.list_progress(GROUP) == {MQ: STORED}


async def test_load_creating_tables_on_a_read_only_database_raises_at_once(
    sql_backend: Backend,
) -> None:
    if sql_backend.name == "sqlite":
        sqlite3.connect(_sqlite_path(sql_backend)).close()  # an empty file, no tables
    store = read_only_store(sql_backend, connect_timeout=10)
    await _load_fails_read_only(store)


async def test_sqlite_file_in_rollback_journal_mode_opened_read_only_fails_fast(
    tmp_path: Path,
) -> None:
    """The stall: switching the file to WAL failed ("attempt to write a readonly
    database") and was retried for connect_timeout, twice."""
    path = tmp_path / "progress.db"
    writer = SqlOffsetStore(f"sqlite:///{path}")
    await writer.load()
    await writer.aclose()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode=DELETE").fetchone() == ("delete",)
    store = SqlOffsetStore(f"sqlite:///file:{path}?mode=ro&uri=true", connect_timeout=10)
    try:
        await _load_fails_read_only(store)
    finally:
        await store.aclose()


@pytest.fixture
def unwritable_directory() -> Path:
    directory = Path("/proc/sys")  # exists, and nobody, root included, creates files in it
    if not directory.is_dir() or os.access(directory, os.W_OK):
        pytest.skip(f"{directory} is not an unwritable directory here")
    return directory


async def test_sqlite_file_that_cannot_be_created_fails_fast_as_read_only(
    unwritable_directory: Path,
) -> None:
    directory = unwritable_directory
    store = SqlOffsetStore(f"sqlite:///{directory / f'{uuid.uuid4().hex}.db'}")
    try:
        started = time.monotonic()
        with pytest.raises(StoreReadOnlyError, match="read-only") as info:
            await store.load()
        assert time.monotonic() - started < FAST
        assert info.value.retriable is False
        assert store.url in str(info.value)
        assert f"{directory} is not writable" in str(info.value)
    finally:
        await store.aclose()


@contextlib.contextmanager
def _tmpfs(directory: Path) -> Iterator[Callable[[], None]]:
    """A tmpfs on ``directory``; yields a function remounting it read-only."""
    mount = shutil.which("mount")
    if mount is None or os.geteuid() != 0:
        pytest.skip("mounting a file system needs root and mount(8)")
    directory.mkdir()
    result = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")

    def remount_read_only() -> None:
        subprocess.run([mount, "-o", "remount,ro", str(directory)], check=True)

    try:
        yield remount_read_only
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


@pytest.mark.parametrize("journal", ["wal", "delete", "no file"])
async def test_sqlite_database_on_a_read_only_file_system_fails_fast(
    tmp_path: Path, journal: str
) -> None:
    """The report: on a read-only file system start-up stalled ~20 s, then said
    "unable to open database file"."""
    directory = tmp_path / "mnt"
    with _tmpfs(directory) as remount_read_only:
        path = directory / "progress.db"
        if journal != "no file":
            writer = SqlOffsetStore(f"sqlite:///{path}")
            await writer.load()
            await writer.aclose()
            with contextlib.closing(sqlite3.connect(path)) as conn:
                conn.execute(f"PRAGMA journal_mode={journal}")
        remount_read_only()
        store = SqlOffsetStore(f"sqlite:///{path}", connect_timeout=10)
        try:
            started = time.monotonic()
            with pytest.raises(StoreReadOnlyError, match="read-only") as info:
                await store.load()
            assert time.monotonic() - started < FAST
            assert info.value.retriable is False
            assert store.url in str(info.value)
        finally:
            await store.aclose()


# -- writes after a good load() ------------------------------------------------------------------


WRITES: dict[str, Callable[[SqlOffsetStore], Awaitable[object]]] = {
    "persist": lambda store: store.persist(GROUP, MQ),
    "persist_all": lambda store: store.persist_all(GROUP, [MQ]),
    "persist_fenced": lambda store: store.persist_fenced(GROUP, {MQ: 1}),
    "claim": lambda store: store.claim(GROUP, MQ, 2),
    "reset_progress": lambda store: store.reset_progress(GROUP, {MQ: None}),
}


@pytest.mark.parametrize("write", sorted(WRITES))
async def test_write_to_a_database_that_became_read_only_is_not_retriable(
    sql_backend: Backend, write: str
) -> None:
    store = sql_backend.new_store()
    assert isinstance(store, SqlOffsetStore)
    await store.load()
    await store.claim(GROUP, MQ, 1)
    store.update_progress(GROUP, MQ, STORED)
    with connections_made_read_only(sql_backend, store):
        with pytest.raises(StoreReadOnlyError) as info:
            await WRITES[write](store)
        _assert_read_only_error(info.value, store)
    # Writable again (an operator fixed it): the same store writes.
    await store.persist_fenced(GROUP, {MQ: 1})
    assert await store.list_progress(GROUP) == {MQ: STORED}


async def test_locked_sqlite_database_is_still_retriable(tmp_path: Path) -> None:
    """Only "read-only" stopped being retriable: a lock held by another writer is not."""
    path = tmp_path / "progress.db"
    store = SqlOffsetStore(f"sqlite:///{path}", connect_timeout=0.2)
    try:
        await store.load()
        store.update_progress(GROUP, MQ, STORED)
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            blocker.execute("BEGIN EXCLUSIVE")
            with pytest.raises(StoreCommitError, match="locked") as info:
                await store.persist(GROUP, MQ)
            assert not isinstance(info.value, StoreReadOnlyError)
            assert info.value.retriable is True
        finally:
            blocker.rollback()
            blocker.close()
    finally:
        await store.aclose()


# -- MariaDB/MySQL errors the shared server cannot be made to raise ------------------------------


@pytest.mark.parametrize(
    ("code", "message", "read_only"),
    [
        (
            1290,
            "The MariaDB server is running with the --read-only option so it cannot"
            " execute this statement",
            True,
        ),
        (
            1290,
            "The MySQL server is running with the --super-read-only option so it cannot"
            " execute this statement",
            True,
        ),
        (1836, "Running in read-only mode", True),
        (1792, "Cannot execute statement in a READ ONLY transaction.", True),
        (
            1290,
            "The MySQL server is running with the --secure-file-priv option so it cannot"
            " execute this statement",
            False,
        ),
        (1205, "Lock wait timeout exceeded; try restarting transaction", False),
    ],
)
def test_mysql_read_only_errors_are_recognised(code: int, message: str, read_only: bool) -> None:
    pymysql_err = pytest.importorskip("pymysql.err")
    store = SqlOffsetStore("mysql+pymysql://root@127.0.0.1:1/test")
    orig = pymysql_err.OperationalError(code, message)
    error = store._wrap("persisting", sa.exc.OperationalError("UPDATE", {}, orig), writes=True)
    assert isinstance(error, StoreReadOnlyError) is read_only
    assert error.retriable is not read_only


# -- reading a read-only database on purpose -------------------------------------------------------


async def test_a_read_only_store_reads_a_read_only_database_and_refuses_writes(
    sql_backend: Backend,
) -> None:
    """``read_only=True`` (an operator looking at a replica): load() checks nothing it
    would have to write, reads work, writes fail without reaching the database."""
    await _store_some_progress(sql_backend)
    store = read_only_store(sql_backend, read_only=True)
    await store.load()
    assert await store.list_progress(GROUP) == {MQ: STORED}
    assert await store.read_progress(GROUP, MQ) == STORED
    with pytest.raises(StoreReadOnlyError, match="read_only=True") as info:
        await store.persist(GROUP, MQ)
    assert info.value.retriable is False
    assert info.value.__cause__ is None  # refused before reaching the database
