"""SQLite: opening a fresh file in WAL mode while other connections do the same.

Switching a file to WAL needs a moment alone with it; two connections switching at
once deadlock on the upgrade, and SQLite answers one of them "database is locked"
at once, without its busy timeout. The store retries until the file reads ``wal``.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from offsetstore import SqlOffsetStore
from offsetstore._sql import _switch_to_wal


@pytest.mark.slow
def test_connections_switching_fresh_files_to_wal_at_once_all_succeed(tmp_path: Path) -> None:
    threads_per_file = 8
    failures: list[BaseException] = []
    for n in range(60):
        path = tmp_path / f"p{n}.db"
        start = threading.Barrier(threads_per_file)

        def switch(path: Path = path, start: threading.Barrier = start) -> None:
            conn = sqlite3.connect(path, timeout=10, isolation_level=None)
            try:
                start.wait()
                _switch_to_wal(conn.cursor(), 10.0)
            except BaseException as exc:  # collected and asserted below
                failures.append(exc)
            finally:
                conn.close()

        threads = [threading.Thread(target=switch) for _ in range(threads_per_file)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with sqlite3.connect(path) as check:
            assert check.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert failures == []


@pytest.mark.anyio
async def test_load_waits_while_another_connection_reads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "progress.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE other (x)")  # a fresh file in rollback-journal mode
    holder.execute("BEGIN")
    holder.execute("SELECT count(*) FROM other").fetchone()  # a reader holds the file
    release = threading.Timer(0.3, holder.rollback)
    release.start()
    store = SqlOffsetStore(f"sqlite:///{path}")
    try:
        started = time.monotonic()
        await store.load()
        waited = time.monotonic() - started
    finally:
        release.join()
        await store.aclose()
        holder.close()
    assert waited >= 0.25  # it waited for the reader
    with sqlite3.connect(path) as check:
        assert check.execute("PRAGMA journal_mode").fetchone() == ("wal",)
