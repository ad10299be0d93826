"""Offset store backends for the shared store suite.

Every SQL test gets its own tables (a unique ``table_prefix``) and drops them
afterwards, so tests never see each other's rows. PostgreSQL and MariaDB URLs come
from ``STAGEDCONSUMER_TEST_POSTGRES_URL`` / ``STAGEDCONSUMER_TEST_MYSQL_URL`` and
default to this machine's services; in CI an unreachable service fails the test.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import attrs
import pytest
import sqlalchemy as sa

from offsetstore import MemoryOffsetStore, SqlOffsetStore, StageOffsetStore
from tests.conftest import require_service

POSTGRES_URL = os.environ.get(
    "STAGEDCONSUMER_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
MYSQL_URL = os.environ.get(
    "STAGEDCONSUMER_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
)


@functools.cache
def service_error(url: str) -> str | None:
    """``None`` when ``url`` accepts connections, else why not."""
    engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError as exc:
        return str(exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc).splitlines()[0]
    finally:
        engine.dispose()
    return None


def require_url(name: str, url: str) -> str:
    error = service_error(url)
    require_service(name, error is None, f"{sa.make_url(url).render_as_string()}: {error}")
    return url


def drop_tables(url: str, prefix: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            for suffix in ("progress", "schema", "marks"):
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {prefix}{suffix}"))
    finally:
        engine.dispose()


@attrs.define(eq=False)
class Backend:
    """Makes stores that share one durable place (a database, or a dict in memory)."""

    name: str
    url: str | None
    prefix: str
    _opened: list[StageOffsetStore] = attrs.Factory(list)
    _shared: dict[object, object] = attrs.Factory(dict)

    @property
    def is_sql(self) -> bool:
        return self.url is not None

    def new_store(self, url: str | None = None, **kwargs: object) -> StageOffsetStore:
        """A fresh store instance: a consumer process after a restart.

        ``url`` replaces the backend's URL (e.g. to reach it through a proxy).
        """
        store: StageOffsetStore
        if self.url is None:
            memory = MemoryOffsetStore()
            memory._stored = self._shared  # type: ignore[assignment]  # one durable table
            store = memory
        else:
            store = SqlOffsetStore(url or self.url, table_prefix=self.prefix, **kwargs)  # type: ignore[arg-type]
        self._opened.append(store)
        return store

    async def close(self) -> None:
        """Close every store made so far (a test may close them early, and make more)."""
        opened, self._opened = self._opened, []
        for store in opened:
            await store.aclose()


def _make_backend(name: str, tmp_path: Path) -> Backend:
    prefix = f"t{uuid.uuid4().hex[:10]}_"
    if name == "memory":
        return Backend(name, None, prefix)
    if name == "sqlite":
        return Backend(name, f"sqlite:///{tmp_path / 'progress.db'}", prefix)
    if name == "postgres":
        return Backend(name, require_url("PostgreSQL", POSTGRES_URL), prefix)
    if name == "mariadb":
        return Backend(name, require_url("MariaDB", MYSQL_URL), prefix)
    raise AssertionError(name)


BACKENDS = [
    pytest.param("memory"),
    pytest.param("sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
]
SQL_BACKENDS = BACKENDS[1:]


async def _backend_fixture(name: str, tmp_path: Path) -> AsyncIterator[Backend]:
    backend = _make_backend(name, tmp_path)
    try:
        yield backend
    finally:
        await backend.close()
        if backend.url is not None:
            drop_tables(backend.url, backend.prefix)


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """Every store implementation: memory, SQLite, PostgreSQL, MariaDB."""
    async for value in _backend_fixture(request.param, tmp_path):
        yield value


@pytest.fixture(params=SQL_BACKENDS)
async def sql_backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """The SQL store on SQLite, PostgreSQL and MariaDB."""
    async for value in _backend_fixture(request.param, tmp_path):
        yield value


@pytest.fixture(params=BACKENDS[2:3])
async def postgres_backend(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Backend]:
    """The SQL store on PostgreSQL only (for what only psycopg's connections have)."""
    async for value in _backend_fixture(request.param, tmp_path):
        yield value


@pytest.fixture(params=BACKENDS[2:])
async def server_backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """The SQL store on the database servers (PostgreSQL, MariaDB)."""
    async for value in _backend_fixture(request.param, tmp_path):
        yield value


StoreFactory = Callable[..., StageOffsetStore]
