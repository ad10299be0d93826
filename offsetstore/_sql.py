"""SqlOffsetStore: progress of consumer groups in SQLite, PostgreSQL or MariaDB/MySQL.

Layout (``prefix`` defaults to ``stagedconsumer_``)::

    <prefix>schema     component VARCHAR(64) PK, version INT
                       one row ("offsetstore", SCHEMA_VERSION); load() migrates
                       older versions (1 -> 2 added the fence column, 2 -> 3 the
                       finished column and the marks table, 3 -> 4 the source column)
    <prefix>progress   source, consumer_group, topic, queue_id   (primary key)
                       source VARCHAR(191) NOT NULL DEFAULT ''  (schema version 4) the
                       identity of the message source (MessageSource.source_id()):
                       offsets count the messages of one log; '' for rows stored
                       without one (schema version 3 and before), adopted by the first
                       source that uses their group (adopt_unscoped_progress)
                       consume_offset BIGINT NULL
                       stage_offsets  TEXT  JSON [[strategy_id, group_id|null, offset], ...]
                       fence BIGINT NOT NULL DEFAULT 0   (schema version 2) the highest
                       fencing token (queue lock epoch) that claimed the queue
                       finished TEXT NULL   (schema version 3) sparse progress: ranges of
                       finished offsets above consume_offset, "gap+length,..." (see
                       offsetstore._types.encode_finished); NULL: none
    <prefix>marks      source, consumer_group, topic, queue_id, queue_offset   (primary key)
                       (schema version 3) finished marks written by transact() in the
                       transaction of a handler's effects; deleted by the progress
                       commit whose consume offset passes them

One row per queue holds the whole unit of progress (consume offset and the stage
offsets of every stage key of the queue), so writing one queue's progress is a single
row upsert, atomic by construction, and "increase-only" is a single ``WHERE`` on that
upsert: a write whose consume offset is lower than the stored one changes nothing of
that row, neither its consume offset nor its stage offsets. The stage offsets are a
JSON list rather than rows of a second table because they are only ever read and
written together with their consume offset; a second table would need the conditional
upsert's outcome before deciding whether to replace child rows, which costs a
round trip per queue.

Why a synchronous engine in worker threads (``anyio.to_thread.run_sync``) rather
than SQLAlchemy's asyncio extension: the extension runs only on asyncio (it relies on
greenlets bridging into asyncio drivers), and the runtime must run on trio too. The
store's work is a few statements per ``persist_consumer_offset_interval``, so a
thread per call costs nothing measurable, and while a large commit runs in its thread
the event loop keeps handling messages: slower while the thread holds the GIL (the
driver's per-row Python work), never stopped (``benchmarks/store_commit.py``
measures loop lag and handler throughput during back-to-back 10,000-queue commits).
Only a cheap snapshot of the in-memory table runs on the loop, in chunks.
"""

from __future__ import annotations

import gc
import json
import os
import shlex
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any, Final, NamedTuple, TypeVar

import anyio.lowlevel
import anyio.to_thread
import attrs
import sqlalchemy as sa
import sqlalchemy.exc as sa_exc
from sqlalchemy.dialects import mysql as mysql_dialect
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect

from ._abc import SOURCE_MAX_LENGTH, UNSCOPED, StageOffsetStore, _check_reset_entry, _fenced_error
from ._bulk import BulkRow, BulkUpsert
from ._exceptions import (
    AlreadyFinishedError,
    OffsetStoreError,
    StoreCommitError,
    StoreConfigurationError,
    StoreFencedError,
    StoreReadOnlyError,
    StoreUnavailableError,
)
from ._inspect import StoredRow, decode_row, fence_problem
from ._types import (
    MessageQueue,
    QueueProgress,
    StageKey,
    check_offset,
    decode_finished,
    encode_finished,
    merge_marks,
)

__all__ = ("SCHEMA_VERSION", "SqlOffsetStore", "migration_sql", "schema_sql")

SCHEMA_VERSION: Final = 4
"""Version of the table layout this module writes and reads. Version 2 added the
``fence`` column (fencing tokens of consumer groups), version 3 the ``finished``
column (sparse progress) and the marks table (exactly-once effects), version 4 the
``source`` column, first in both primary keys (progress scoped by message source)."""

_COMPONENT: Final = "offsetstore"
_DEADLOCK_RETRIES: Final = 3
_SNAPSHOT_CHUNK: Final = 500
_FOLD_CHUNK: Final = 100
"""Queues whose marks one ``DELETE`` folds."""
_PING_AFTER_IDLE: Final = 1.0
"""Seconds a pooled connection may rest before its checkout pings the server."""
_GIL_PAUSE: Final = 0.001
_PROGRESS_FILLFACTOR: Final = 50
"""PostgreSQL: percent of each page of the progress table filled by inserts."""
_MARK_HEADS: Final = 100_000
"""Queue keys whose mark query start a store keeps (all forgotten past that)."""
_CREATE_ATTEMPTS: Final = 3
"""Tries at creating the tables when stores race to: one per table, and one more."""
_T = TypeVar("_T")

_DDL_DIALECTS: Final = {
    "sqlite": sqlite_dialect.dialect,
    "postgresql": pg_dialect.dialect,
    "mysql": mysql_dialect.dialect,
    "mariadb": mysql_dialect.dialect,
}

_DRIVER_HINTS: Final = {
    "psycopg": "pip install 'stagedconsumer[postgres]'",
    "pymysql": "pip install 'stagedconsumer[mysql]'",
}


class _Utf8Bytes(sa.types.TypeDecorator[str]):
    """UTF-8 text kept in a ``VARBINARY`` column (MariaDB/MySQL).

    Under their default collations MariaDB and MySQL compare strings ignoring case,
    and even their ``_bin`` collations ignore trailing spaces (``PAD SPACE``); group
    and topic names are exact, so there they are stored and compared as bytes.
    """

    impl = mysql_dialect.VARBINARY
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: sa.Dialect) -> Any:
        return None if value is None else value.encode("utf-8")

    def process_result_value(self, value: Any, dialect: sa.Dialect) -> str | None:
        return None if value is None else bytes(value).decode("utf-8")


def _name_column(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(_Utf8Bytes(length * 4), "mysql", "mariadb")


def _source_column() -> sa.Column[str]:
    """The key column of schema version 4: the source's identity, ``''`` (UNSCOPED)
    for rows of older versions (hence the server default)."""
    return sa.Column(
        "source", _name_column(SOURCE_MAX_LENGTH), primary_key=True, server_default=UNSCOPED
    )


def _build_tables(prefix: str) -> tuple[sa.MetaData, sa.Table, sa.Table, sa.Table]:
    metadata = sa.MetaData()
    schema = sa.Table(
        f"{prefix}schema",
        metadata,
        sa.Column("component", _name_column(64), primary_key=True),
        sa.Column("version", sa.Integer, nullable=False),
        mysql_engine="InnoDB",
    )
    progress = sa.Table(
        f"{prefix}progress",
        metadata,
        _source_column(),
        sa.Column("consumer_group", _name_column(255), primary_key=True),
        sa.Column("topic", _name_column(255), primary_key=True),
        sa.Column("queue_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("consume_offset", sa.BigInteger, nullable=True),
        sa.Column(
            "stage_offsets",
            sa.Text().with_variant(mysql_dialect.MEDIUMTEXT(), "mysql", "mariadb"),
            nullable=False,
        ),
        sa.Column("fence", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column(
            "finished",
            sa.Text().with_variant(mysql_dialect.MEDIUMTEXT(), "mysql", "mariadb"),
            nullable=True,
        ),
        mysql_engine="InnoDB",
        # Room on every page for a row's next version: a progress commit updates
        # every row it writes, and PostgreSQL then keeps the new version beside the
        # old one (a HOT update, the primary key untouched: 10,000 rows took 40 ms
        # of the server's CPU instead of 60-70).
        postgresql_with={"fillfactor": _PROGRESS_FILLFACTOR},
    )
    marks = sa.Table(
        f"{prefix}marks",
        metadata,
        _source_column(),
        sa.Column("consumer_group", _name_column(255), primary_key=True),
        sa.Column("topic", _name_column(255), primary_key=True),
        sa.Column("queue_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("queue_offset", sa.BigInteger, primary_key=True, autoincrement=False),
        mysql_engine="InnoDB",
    )
    return metadata, schema, progress, marks


# -- encoding of stage offsets -------------------------------------------------------------


def _sort_key(item: tuple[StageKey, int]) -> tuple[str, bool, str]:
    key = item[0]
    return (key.strategy_id, key.group_id is not None, key.group_id or "")


def _json_str(text: str) -> str:
    return encode_basestring_ascii(text)  # the C speedup when available


def encode_stage_offsets(stage_offsets: Mapping[StageKey, int]) -> str:
    """Canonical JSON of stage offsets; ``group_id`` ``None`` stays ``null``, apart from ``""``.

    Built as text rather than through ``json.dumps`` of nested lists: at 10,000 queues
    per commit the lists are garbage-collector work that pauses the event loop too.
    The order and the JSON of the keys are worked out once per tuple of keys (queues
    of one listener all have the same ones) and kept (:func:`_encoding_plan`).
    """
    if not stage_offsets:
        return "[]"
    plan = _PLANS.get(tuple(stage_offsets))
    if plan is None:
        plan = _encoding_plan(tuple(stage_offsets))
    offsets = list(stage_offsets.values())
    return f"[{','.join([f'{head}{int(offsets[i])}]' for i, head in plan])}]"


_PLANS: dict[tuple[StageKey, ...], list[tuple[int, str]]] = {}
_MAX_PLANS: Final = 10_000


def _encoding_plan(keys: tuple[StageKey, ...]) -> list[tuple[int, str]]:
    """For stage offsets with ``keys`` (in this order): per entry of their canonical
    JSON, the index of its key in ``keys`` and the entry's text up to the offset."""
    order = sorted(range(len(keys)), key=lambda i: _sort_key((keys[i], 0)))
    plan = []
    for i in order:
        key = keys[i]
        group = "null" if key.group_id is None else _json_str(key.group_id)
        plan.append((i, f"[{_json_str(key.strategy_id)},{group},"))
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[keys] = plan
    return plan


def decode_stage_offsets(text: str) -> dict[StageKey, int]:
    """Inverse of :func:`encode_stage_offsets`; raises ``ValueError`` on anything else."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"stage offsets must be a JSON list, got {text[:80]!r}")
    result: dict[StageKey, int] = {}
    for item in data:
        if not (isinstance(item, list) and len(item) == 3):
            raise ValueError(f"bad stage offset entry {item!r}")
        strategy, group, offset = item
        if (
            not isinstance(strategy, str)
            or not (group is None or isinstance(group, str))
            or not isinstance(offset, int)
            or isinstance(offset, bool)
            or offset < 0
        ):
            raise ValueError(f"bad stage offset entry {item!r}")
        result[StageKey(strategy, group)] = offset
    return result


# -- errors ------------------------------------------------------------------------------


def _is_deadlock(exc: sa_exc.DBAPIError) -> bool:
    orig = exc.orig
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate in ("40P01", "40001"):  # PostgreSQL deadlock / serialization failure
        return True
    args: tuple[Any, ...] = getattr(orig, "args", ())
    return bool(args) and args[0] in (1213, 1205)  # MySQL deadlock / lock wait timeout


_SQLITE_BUSY: Final = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED
_SQLITE_READONLY: Final = 8
_SQLITE_CANTOPEN: Final = 14
_MYSQL_READ_ONLY: Final = frozenset(
    {
        1036,  # ER_OPEN_AS_READONLY: "Table '...' is read only"
        1792,  # ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION (SET TRANSACTION READ ONLY)
        1836,  # ER_READ_ONLY_MODE: "Running in read-only mode"
    }
)
_MYSQL_OPTION_PREVENTS_STATEMENT: Final = 1290  # "--read-only option", among other options


def _sqlite_code(exc: object) -> int | None:
    """The primary SQLite result code of a ``sqlite3`` error, else ``None``."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def _is_sqlite_busy(exc: BaseException) -> bool:
    """Whether a SQLite error is "busy" or "locked": another connection holds the file."""
    code = _sqlite_code(exc)
    if code is None:  # a driver without result codes: its message says
        text = str(exc).lower()
        return "locked" in text or "busy" in text
    return code in _SQLITE_BUSY


def _is_read_only(exc: BaseException) -> bool:
    """Whether ``exc`` (a SQLAlchemy or driver error) says the database refuses writes.

    SQLite ``SQLITE_READONLY`` ("attempt to write a readonly database": a file opened
    with ``mode=ro``, a read-only file or file system, ``PRAGMA query_only``);
    PostgreSQL SQLSTATE 25006 ("cannot execute ... in a read-only transaction": a hot
    standby, ``default_transaction_read_only``); MariaDB/MySQL 1290 about
    ``--read-only`` / ``--super-read-only``, 1792 (a ``READ ONLY`` transaction), 1836
    and 1036. Trying again does not help with any of them.
    """
    orig: object = getattr(exc, "orig", None) or exc
    if _sqlite_code(orig) == _SQLITE_READONLY:
        return True
    if getattr(orig, "sqlstate", None) == "25006":
        return True
    args: tuple[Any, ...] = getattr(orig, "args", ())
    if len(args) >= 2 and isinstance(args[0], int):
        if args[0] in _MYSQL_READ_ONLY:
            return True
        if args[0] == _MYSQL_OPTION_PREVENTS_STATEMENT:
            return "read-only" in str(args[1]).lower()
    return False


def _unwritable_place(path: Path) -> str | None:
    """Why the SQLite file ``path`` cannot be created or written, if the file system says.

    Asked of the file system rather than of the permission bits, so it holds for root
    too: ``statvfs`` flags a read-only mount, and ``access(W_OK)`` answers ``EROFS``
    there even to root.
    """
    target = path if path.exists() else path.parent
    try:
        if os.statvfs(target).f_flag & os.ST_RDONLY:
            return f"{target} is on a read-only file system"
    except OSError:
        return None
    if not os.access(target, os.W_OK):
        return f"{target} is not writable"
    if target is path and not os.access(path.parent, os.W_OK):
        return f"its directory {path.parent} is not writable (SQLite keeps its journal there)"
    return None


def _detail(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class SqlOffsetStore(StageOffsetStore):
    """A :class:`StageOffsetStore` in a SQL database through SQLAlchemy 2.

    ``url`` is a SQLAlchemy URL: ``sqlite:///path/to/progress.db`` (the embedded
    default; WAL journal, ``synchronous=FULL``), ``postgresql+psycopg://user@host/db``
    or ``mysql+pymysql://user@host/db`` (MariaDB or MySQL). Tables are created by
    :meth:`load` when missing (unless ``create_tables=False``), with names starting
    with ``table_prefix``; several consumer groups share them. A store that creates no
    tables (``create_tables=False`` or ``read_only=True``) creates no SQLite file
    either: :meth:`load` raises :class:`~offsetstore.StoreConfigurationError` when
    the file does not exist.

    Ordering guarantee: each queue's progress (consume offset and stage offsets) is
    one row written by one statement, and every :meth:`persist_all` is one
    transaction, so a reader sees each queue's progress as of one moment and all the
    queues of one persist together or not at all. The stored consume offset only
    moves forward (enforced by the database, so concurrent writers cannot move it
    back); a write that would lower it is ignored for that queue, stage offsets
    included. Only :meth:`reset_progress` moves it back.

    Every database call runs in a worker thread, so the store works on asyncio and
    trio and keeps database work and waiting off the event loop. Failures raise
    :class:`~offsetstore.OffsetStoreError` subclasses (``retriable`` says whether a
    retry can help), with the driver's error as ``__cause__``.

    :meth:`load` checks that the database can be written (a write, rolled back) and
    raises :class:`~offsetstore.StoreReadOnlyError` at once when it cannot: a SQLite
    file opened with ``?mode=ro`` or on a read-only file system, a PostgreSQL hot
    standby, a MariaDB/MySQL server in ``--read-only``. A write that fails later
    because the database became read-only raises it too (not retriable). To only
    read progress from such a database (an operator looking at a replica), pass
    ``read_only=True``: :meth:`load` then neither creates, migrates nor checks
    anything it would have to write, and every write raises
    :class:`~offsetstore.StoreReadOnlyError` without touching the database.

    Rows are keyed by :attr:`~offsetstore.StageOffsetStore.source` too (``source=``,
    or bound by the first consumer: see :class:`~offsetstore.StageOffsetStore`), so
    one database keeps the progress of groups of many brokers and namespaces apart.

    ``connect_timeout`` (seconds, default 10) bounds connecting to a server (and,
    for SQLite, waiting for a locked file). ``operation_timeout`` (seconds, default
    60, ``None``: no limit) bounds every call: a call that takes longer (a frozen
    server, a half-open connection) raises a retriable
    :class:`~offsetstore.StoreUnavailableError` and is left to finish in its thread;
    should it commit late, the increase-only rule keeps it from moving progress
    back. ``engine_options`` go to :func:`sqlalchemy.create_engine` unchanged.
    """

    def __init__(
        self,
        url: str | sa.URL,
        *,
        table_prefix: str = "stagedconsumer_",
        create_tables: bool = True,
        read_only: bool = False,
        connect_timeout: float = 10.0,
        operation_timeout: float | None = 60.0,
        engine_options: Mapping[str, Any] | None = None,
        source: str | None = None,
    ) -> None:
        super().__init__(source=source)
        if (
            not table_prefix.isascii()
            or not table_prefix.replace("_", "a").isalnum()
            or not table_prefix[:1].isalpha()
            or len(table_prefix) > 48  # MySQL names have at most 64 characters
        ):
            raise StoreConfigurationError(
                "table_prefix must be at most 48 ASCII letters, digits and '_', starting"
                f" with a letter; got {table_prefix!r}"
            )
        try:
            self._url = sa.make_url(url)
        except (sa_exc.ArgumentError, ValueError) as exc:
            raise StoreConfigurationError(
                f"malformed offset store URL {_redact(url)!r}: {exc}. Expected e.g."
                " 'sqlite:///progress.db', 'postgresql+psycopg://user@host/db' or"
                " 'mysql+pymysql://user@host/db'"
            ) from exc
        backend = self._url.get_backend_name()
        if backend not in ("sqlite", "postgresql", "mysql", "mariadb"):
            raise StoreConfigurationError(
                f"unsupported offset store database {backend!r} in {self.url}: use sqlite,"
                " postgresql or mysql/mariadb"
            )
        self._backend = "mysql" if backend == "mariadb" else backend
        self._table_prefix = table_prefix
        self._read_only = read_only
        self._create_tables = create_tables and not read_only
        self._metadata, self._schema_table, self._progress, self._marks = _build_tables(
            table_prefix
        )
        self._version = SCHEMA_VERSION
        """The schema version of the tables (older ones are read by a read-only store)."""
        self._marked: dict[tuple[str, MessageQueue], int] = {}
        """Queues that may have finished marks, with the highest one: the progress
        commits that pass them delete them."""
        if operation_timeout is not None and operation_timeout <= 0:
            raise StoreConfigurationError(
                f"operation_timeout must be > 0 or None, got {operation_timeout!r}"
            )
        self._operation_timeout = operation_timeout
        self._engine = self._create_engine(connect_timeout, dict(engine_options or {}))
        self._key_names = [c.name for c in self._progress.primary_key.columns]
        self._bulk: BulkUpsert | None = None
        self._written: dict[tuple[str, MessageQueue], _Raw] = {}
        """The progress this store last committed per queue (a queue whose in-memory
        progress is still that is not written again)."""
        self._pg_mark_stmt = sa.text(self._pg_mark_sql(lambda name: f":{name}"))
        self._pg_begin_mark_sql: str | None = None
        """BEGIN and the execution of the prepared mark statement as one query, bound by
        the driver's client-side cursor: transact()'s first round trip on PostgreSQL
        through psycopg (3); ``_pg_prepare_mark_sql`` prepares it on a connection."""
        self._pg_prepare_mark_sql = ""
        self._pg_mark_heads: dict[tuple[Any, ...], str] = {}
        """Per queue key: the start of its mark query, up to the offsets (see
        :meth:`_pg_begin_mark_query`)."""
        if self._backend == "postgresql" and self._url.get_driver_name() == "psycopg":
            self._pg_begin_mark_sql, self._pg_prepare_mark_sql = self._pg_prepared_mark()
        self._overwrite_stmt = self._build_overwrite_statement()
        self._setup_lock = threading.Lock()
        # One SQLite database in memory is one connection: serialize its users.
        self._serial: threading.Lock | None = threading.Lock() if self._is_sqlite_memory() else None
        self._loaded = False
        self._closed = False
        # Operations running in worker threads, abandoned ones included (see aclose).
        self._busy_lock = threading.Lock()
        self._busy = 0
        self._idle = threading.Event()
        self._idle.set()

    # -- construction ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The database URL, password hidden."""
        return self._url.render_as_string(hide_password=True)

    @property
    def table_prefix(self) -> str:
        """The prefix of the store's table names."""
        return self._table_prefix

    @property
    def progress_table_name(self) -> str:
        """The name of the progress table (one row per group, topic and queue)."""
        return self._progress.name

    @property
    def schema_table_name(self) -> str:
        """The name of the table that records the schema's version."""
        return self._schema_table.name

    def __repr__(self) -> str:
        return f"SqlOffsetStore({self.url!r}, table_prefix={self._table_prefix!r})"

    def _is_sqlite_memory(self) -> bool:
        return self._backend == "sqlite" and self._url.database in (None, "", ":memory:")

    def _create_engine(self, connect_timeout: float, options: dict[str, Any]) -> sa.Engine:
        connect_args: dict[str, Any] = {}
        if self._backend == "sqlite":
            connect_args["timeout"] = connect_timeout  # how long to wait on a locked file
            if self._is_sqlite_memory():
                options.setdefault("poolclass", sa.StaticPool)
                connect_args["check_same_thread"] = False
        elif self._backend == "postgresql":
            connect_args["connect_timeout"] = max(int(connect_timeout), 1)
            # Notice a server that vanished without closing the connection.
            connect_args.update(keepalives=1, keepalives_idle=10, keepalives_interval=5)
            connect_args["keepalives_count"] = 3
        else:
            connect_args["connect_timeout"] = max(int(connect_timeout), 1)
            if self._operation_timeout is not None:
                io_timeout = max(int(self._operation_timeout), 1)
                connect_args.update(read_timeout=io_timeout, write_timeout=io_timeout)
            options.setdefault("isolation_level", "READ COMMITTED")
        connect_args.update(options.pop("connect_args", {}))
        # A server's connection is pinged on checkout after it rested (see
        # _ping_when_idle), unless the caller chose SQLAlchemy's ping on every checkout.
        idle_ping = self._backend != "sqlite" and "pool_pre_ping" not in options
        try:
            engine = sa.create_engine(self._url, connect_args=connect_args, **options)
        except ImportError as exc:
            driver = self._url.get_driver_name()
            hint = _DRIVER_HINTS.get(driver, f"install the {driver!r} driver")
            raise StoreConfigurationError(
                f"the database driver {driver!r} for {self.url} is not installed ({hint})"
            ) from exc
        except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError, TypeError) as exc:
            raise StoreConfigurationError(f"cannot use offset store URL {self.url}: {exc}") from exc
        if idle_ping:
            _ping_when_idle(engine, _PING_AFTER_IDLE)
        if self._backend == "sqlite":
            _configure_sqlite(
                engine,
                memory=self._is_sqlite_memory(),
                read_only=self._read_only,
                wait=connect_timeout,
            )
        return engine

    def _pg_mark_sql(self, param: Callable[[str], str]) -> str:
        """PostgreSQL: lock the progress row of a queue against a claim (``FOR KEY
        SHARE``), insert the finished marks of ``offsets`` if its fence is at most
        ``fence``, and return the row (fence, consume offset, finished) with the number
        of marks inserted: no row when the queue has none. Parameters: the key values
        ``k0``, ``k1``, ... (:meth:`_key`), ``offsets`` and ``fence``; ``param`` writes
        a parameter in the driver's style."""
        prep = self._engine.dialect.identifier_preparer
        keys = [param(f"k{i}") for i in range(len(self._key_names))]
        where = " AND ".join(
            f"{prep.quote(name)} = {value}"
            for name, value in zip(self._key_names, keys, strict=True)
        )
        columns = ", ".join(prep.quote(name) for name in [*self._key_names, "queue_offset"])
        return (
            f"WITH p AS (SELECT fence, consume_offset, finished"
            f" FROM {prep.format_table(self._progress)} WHERE {where} FOR KEY SHARE),"
            f" ins AS (INSERT INTO {prep.format_table(self._marks)} ({columns})"
            f" SELECT {', '.join(keys)}, o FROM p,"
            f" unnest(CAST({param('offsets')} AS BIGINT[])) AS o"
            f" WHERE p.fence <= {param('fence')} RETURNING 1)"
            " SELECT p.fence, p.consume_offset, p.finished, (SELECT count(*) FROM ins) AS marked"
            " FROM p"
        )

    def _pg_prepared_mark(self) -> tuple[str, str]:
        """(``BEGIN`` and ``EXECUTE`` of the mark statement, its ``PREPARE``). Prepared
        once per connection: sent in the simple query protocol (several statements in
        one query), it would otherwise be parsed and planned on every call, which
        costs the server more than running it."""
        name = f"{self._table_prefix}mark"
        names = [f"k{i}" for i in range(len(self._key_names))] + ["offsets", "fence"]
        position = {n: f"${i}" for i, n in enumerate(names, 1)}
        t = self._progress
        dialect = self._engine.dialect
        types = [
            "text" if isinstance(t.c[k].type, sa.String) else t.c[k].type.compile(dialect=dialect)
            for k in self._key_names
        ] + ["bigint[]", "bigint"]
        prepare = (
            f"PREPARE {name} ({', '.join(types)}) AS {self._pg_mark_sql(position.__getitem__)}"
        )
        return f"BEGIN; EXECUTE {name} (", prepare

    def _pg_begin_mark_query(
        self, driver_conn: Any, key: tuple[Any, ...], offsets: Sequence[int], fence: int
    ) -> str:
        """``BEGIN`` and the execution of the prepared mark statement for ``key``,
        ``offsets`` and ``fence``, as one query of literals. The key's literals are
        quoted by psycopg (its quoting, not ours) once per queue and kept; offsets and
        fence are integers, written as such: no parameter is bound per call."""
        head = self._pg_mark_heads.get(key)
        if head is None:
            from psycopg import sql as pg_sql

            literals = "".join(f"{pg_sql.Literal(v).as_string(driver_conn)}, " for v in key)
            head = f"{self._pg_begin_mark_sql}{literals}"
            if len(self._pg_mark_heads) >= _MARK_HEADS:
                self._pg_mark_heads.clear()
            self._pg_mark_heads[key] = head
        numbers = ",".join([str(int(o)) for o in offsets])
        return f"{head}'{{{numbers}}}', {int(fence)})"

    def _build_overwrite_statement(self) -> sa.Executable:
        t = self._progress
        if self._backend == "mysql":
            mstmt = mysql_dialect.insert(t)
            return mstmt.on_duplicate_key_update(
                consume_offset=mstmt.inserted.consume_offset,
                stage_offsets=mstmt.inserted.stage_offsets,
                finished=mstmt.inserted.finished,
            )
        stmt = (pg_dialect.insert if self._backend == "postgresql" else sqlite_dialect.insert)(t)
        return stmt.on_conflict_do_update(
            index_elements=[t.c.source, t.c.consumer_group, t.c.topic, t.c.queue_id],
            set_={
                "consume_offset": stmt.excluded.consume_offset,
                "stage_offsets": stmt.excluded.stage_offsets,
                "finished": stmt.excluded.finished,
            },
        )

    # -- threads and errors -----------------------------------------------------------------

    async def _run(self, action: str, func: Callable[[], _T], *, writes: bool) -> _T:
        if self._closed:
            raise StoreUnavailableError(f"{self!r} is closed", retriable=False)
        if writes and self._read_only:
            raise StoreReadOnlyError(f"{action}: {self!r} was opened with read_only=True")
        return await self._in_thread(action, self._call, action, func, writes)

    async def _in_thread(self, action: str, func: Callable[..., _T], *args: Any) -> _T:
        """Run ``func`` in a worker thread, for at most ``operation_timeout`` seconds."""
        timeout = self._operation_timeout
        if timeout is None:
            return await anyio.to_thread.run_sync(self._tracked, func, *args)
        with anyio.move_on_after(timeout) as scope:
            return await anyio.to_thread.run_sync(
                self._tracked, func, *args, abandon_on_cancel=True
            )
        if scope.cancelled_caught:
            raise StoreUnavailableError(
                f"{action} on {self.url} took longer than {timeout:g} s (operation_timeout);"
                " abandoned it"
            )
        raise AssertionError("unreachable")  # pragma: no cover

    def _tracked(self, func: Callable[..., _T], *args: Any) -> _T:
        """``func(*args)`` in a worker thread, counted until it returns, even when the
        caller was cancelled and stopped waiting for it (``aclose`` waits for it)."""
        with self._busy_lock:
            self._busy += 1
            self._idle.clear()
        try:
            return func(*args)
        finally:
            with self._busy_lock:
                self._busy -= 1
                if not self._busy:
                    self._idle.set()

    def _call(self, action: str, func: Callable[[], _T], writes: bool) -> _T:
        try:
            if not self._loaded:
                self._setup()
            lost: sa_exc.DBAPIError | None = None
            for attempt in range(_DEADLOCK_RETRIES):
                try:
                    with self._serialized():
                        return func()
                except sa_exc.DBAPIError as exc:
                    if attempt + 1 < _DEADLOCK_RETRIES and _is_deadlock(exc):
                        continue
                    if exc.connection_invalidated and lost is None:
                        # A pooled connection the server had closed (no ping on a
                        # connection that just rested, see _ping_when_idle): once
                        # more, on a new one. Every call is safe to repeat: writes
                        # are increase-only or idempotent, and a transaction that did
                        # commit finds its marks.
                        lost = exc
                        continue
                    if lost is not None and isinstance(
                        exc, (sa_exc.OperationalError, sa_exc.InterfaceError)
                    ):
                        raise lost from None  # no new connection either: the first loss
                    raise
            if lost is not None:
                raise lost
            raise AssertionError("unreachable")  # pragma: no cover
        except OffsetStoreError:
            raise
        except sa_exc.SQLAlchemyError as exc:
            raise self._wrap(action, exc, writes=writes) from exc
        except OSError as exc:
            raise StoreUnavailableError(f"{action} on {self.url} failed: {exc}") from exc

    @contextmanager
    def _serialized(self) -> Iterator[None]:
        if self._serial is None:
            yield
            return
        with self._serial:
            yield

    def _wrap(self, action: str, exc: sa_exc.SQLAlchemyError, *, writes: bool) -> OffsetStoreError:
        explained = self._explain(action, exc)
        if explained is not None:
            return explained
        detail = _detail(exc)
        if isinstance(exc, sa_exc.DBAPIError) and (
            exc.connection_invalidated or isinstance(exc, sa_exc.InterfaceError)
        ):
            return StoreUnavailableError(f"{action}: lost the connection to {self.url}: {detail}")
        if isinstance(exc, sa_exc.OperationalError):
            if writes:
                return StoreCommitError(f"{action} on {self.url} failed: {detail}")
            return StoreUnavailableError(f"{action} on {self.url} failed: {detail}")
        if isinstance(exc, (sa_exc.IntegrityError, sa_exc.DataError, sa_exc.ProgrammingError)):
            return StoreCommitError(f"{action} on {self.url} failed: {detail}", retriable=False)
        if isinstance(exc, sa_exc.TimeoutError):
            return StoreUnavailableError(f"{action}: no connection to {self.url} free: {detail}")
        return StoreCommitError(f"{action} on {self.url} failed: {detail}", retriable=writes)

    def _explain(self, action: str, exc: sa_exc.SQLAlchemyError) -> OffsetStoreError | None:
        """A database that refuses writes, or a SQLite file that cannot be opened, said
        plainly; ``None`` for every other failure."""
        if _is_read_only(exc):
            return StoreReadOnlyError(
                f"{action}: the offset store database at {self.url} is read-only, so progress"
                f" cannot be saved ({_detail(exc)})"
            )
        if (
            self._backend != "sqlite"
            or _sqlite_code(getattr(exc, "orig", None)) != _SQLITE_CANTOPEN
        ):
            return None
        path = self._sqlite_path()
        if path is None:
            return None
        if not path.parent.is_dir():
            return StoreUnavailableError(
                f"{action}: cannot reach the offset store database at {self.url}: the"
                f" directory {path.parent} does not exist (SQLite creates the database"
                " file, not its directory)"
            )
        why = _unwritable_place(path)
        if why is None:
            return None
        state = "is read-only" if path.exists() else "cannot be created (read-only location)"
        return StoreReadOnlyError(
            f"{action}: the offset store database at {self.url} {state}, so progress cannot"
            f" be saved: {why} ({_detail(exc)})"
        )

    def _sqlite_path(self) -> Path | None:
        """The file of a SQLite URL (a plain path or a ``file:`` URI), else ``None``."""
        database = self._url.database
        if not database or database == ":memory:":
            return None
        if database.startswith("file:"):
            database = urllib.parse.unquote(urllib.parse.urlsplit(database).path)
            if not database:
                return None
        return Path(database)

    def _missing_sqlite_file(self) -> Path | None:
        """The file of a SQLite URL when it does not exist; ``None`` when it does or
        the database is not a file (another backend, a database in memory)."""
        if self._backend != "sqlite" or self._url.query.get("mode") == "memory":
            return None
        path = self._sqlite_path()
        if path is None or str(path) == ":memory:" or path.exists():
            return None
        return path

    # -- setup ------------------------------------------------------------------------------

    async def load(self) -> None:
        """Connect, create the tables when missing and check the schema version.

        Raises :class:`~offsetstore.StoreUnavailableError` when the database cannot
        be reached, :class:`~offsetstore.StoreReadOnlyError` (not retriable) when it
        can be read but not written (unless the store was made with
        ``read_only=True``), and :class:`~offsetstore.StoreConfigurationError` when
        its tables are missing (with ``create_tables=False``) or of a newer schema
        version.
        """
        if self._closed:
            raise StoreUnavailableError(f"{self!r} is closed", retriable=False)
        await self._in_thread("preparing the offset store", self._load_sync)

    def _load_sync(self) -> None:
        try:
            self._setup()
        except OffsetStoreError:
            raise
        except sa_exc.SQLAlchemyError as exc:
            explained = self._explain("preparing the offset store", exc)
            if explained is not None:
                raise explained from exc
            if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)):
                raise StoreUnavailableError(
                    f"cannot reach the offset store database at {self.url}: {_detail(exc)}"
                ) from exc
            raise self._wrap("preparing the offset store", exc, writes=False) from exc
        except OSError as exc:
            raise StoreUnavailableError(
                f"cannot reach the offset store database at {self.url}: {exc}"
            ) from exc

    def _setup(self) -> None:
        with self._setup_lock:
            if self._loaded:
                return
            with self._serialized():
                self._setup_locked()
            self._loaded = True

    def _setup_locked(self) -> None:
        engine = self._engine
        if self._create_tables:
            # Several processes may race to create the tables: a store that loses the
            # race for one table (created between its check and its CREATE) tries
            # again, skipping what exists by then. The winner may still be creating the
            # other table, so the tables' existence is judged only after the last
            # attempt: one per table, and one that finds both there.
            for attempt in range(_CREATE_ATTEMPTS):
                try:
                    with self._write_transaction() as conn:
                        self._metadata.create_all(conn, checkfirst=True)
                    break
                except (
                    sa_exc.ProgrammingError,
                    sa_exc.IntegrityError,
                    sa_exc.OperationalError,
                ) as exc:
                    if _is_read_only(exc):
                        raise
                    if attempt == _CREATE_ATTEMPTS - 1:
                        if self._tables_exist():
                            break
                        raise
        elif (missing := self._missing_sqlite_file()) is not None:
            # Checked before connecting: connecting would create the file, empty.
            raise StoreConfigurationError(
                f"no offset store at {self.url}: the SQLite file {missing.absolute()} does"
                " not exist (only a store with create_tables=True creates it, a consumer's)"
            )
        elif not self._tables_exist():
            raise StoreConfigurationError(
                f"no offset store tables ({self._progress.name}, {self._schema_table.name})"
                f" in {self.url}"
            )
        schema = self._schema_table
        select = sa.select(schema.c.version).where(schema.c.component == _COMPONENT)
        with engine.begin() as conn:
            version = conn.execute(select).scalar_one_or_none()
        if version is None:
            if not self._create_tables:
                raise StoreConfigurationError(
                    f"the offset store tables in {self.url} have no schema version row"
                )
            try:
                with self._write_transaction() as conn:
                    conn.execute(
                        sa.insert(schema).values(component=_COMPONENT, version=SCHEMA_VERSION)
                    )
            except sa_exc.IntegrityError:
                pass  # another process inserted it first
            with engine.begin() as conn:
                version = conn.execute(select).scalar_one()
        if version > SCHEMA_VERSION:
            raise StoreConfigurationError(
                f"the offset store in {self.url} has schema version {version}, newer than"
                f" this stagedconsumer's {SCHEMA_VERSION}: upgrade stagedconsumer"
            )
        if self._read_only:
            # Older tables read as well: the fence column is never read, and the
            # finished column and the marks table are not read before version 3.
            self._version = version
            return
        if version < 2:
            self._migrate_to_2()
        if version < 3:
            self._migrate_to_3()
        if version < 4:
            self._migrate_to_4()
        self._check_writable()

    async def init_schema(self) -> list[str]:
        """Create the tables when missing and migrate them to this version's schema, as
        :meth:`load` does, and say what was done, one sentence per step
        (``stagedconsumer offsets init``). Needs a store made with ``create_tables=True``."""
        if not self._create_tables:
            raise StoreConfigurationError("init_schema() needs a store with create_tables=True")

        def state() -> tuple[list[str], int | None]:
            names = (self._schema_table.name, self._progress.name, self._marks.name)
            if self._missing_sqlite_file() is not None:
                return list(names), None
            with self._engine.connect() as conn:
                inspector = sa.inspect(conn)
                missing = [name for name in names if not inspector.has_table(name)]
                if self._schema_table.name in missing:
                    return missing, None
                schema = self._schema_table
                version = conn.execute(
                    sa.select(schema.c.version).where(schema.c.component == _COMPONENT)
                ).scalar_one_or_none()
            return missing, version

        def init() -> list[str]:
            missing, before = state()
            self._load_sync()
            _, after = state()
            done = [f"created table {name}" for name in missing]
            if before is None:
                done.append(f"recorded schema version {after} in {self._schema_table.name}")
            elif after != before:
                done.append(f"migrated the tables from schema version {before} to {after}")
                if before < 4 and after == SCHEMA_VERSION:
                    done.append(self._unscoped_note())
            if not done:
                done.append(
                    f"nothing to do: tables {self._schema_table.name}, {self._progress.name}"
                    f" and {self._marks.name} are at schema version {after}"
                )
            return done

        if self._closed:
            raise StoreUnavailableError(f"{self!r} is closed", retriable=False)
        return await self._in_thread("preparing the offset store", self._init_guarded, init)

    def _unscoped_note(self) -> str:
        t = self._progress
        with self._engine.connect() as conn:
            count = conn.execute(
                sa.select(sa.func.count()).select_from(t).where(t.c.source == UNSCOPED)
            ).scalar_one()
        return (
            f"added the source column to {t.name} and {self._marks.name}: {count} progress"
            " row(s) have no source yet; each group's are adopted, in one transaction, by"
            " the source of the first consumer of the group that starts (it logs it)"
        )

    def _init_guarded(self, init: Callable[[], list[str]]) -> list[str]:
        try:
            return init()
        except OffsetStoreError:
            raise
        except sa_exc.SQLAlchemyError as exc:
            raise self._wrap("creating the offset store tables", exc, writes=True) from exc

    def _check_writable(self) -> None:
        """Fail at load, not at the first commit, when the database refuses writes.

        The check is a write that is rolled back: an ``UPDATE`` of the progress table
        (the table every commit writes, so it needs no privilege a commit does not)
        whose ``WHERE`` matches no row, in the store's own write transaction. The
        three databases refuse it for being a write before looking for rows. It is
        the one check that asks the same question on the three and gets each
        database's own answer: SQLite has no pragma telling that a connection is
        read-only (``BEGIN IMMEDIATE`` even succeeds on a ``mode=ro`` file; the
        first write is refused); PostgreSQL's ``transaction_read_only`` and
        MariaDB's ``@@tx_read_only`` / ``@@read_only`` each miss a case
        (``@@read_only`` does not bind users allowed to bypass it, ``SUPER`` or,
        since MariaDB 10.11, ``READ ONLY ADMIN``, such as root; MySQL 8 has
        ``@@transaction_read_only`` and no ``@@tx_read_only``; neither says what a
        missing privilege would refuse). Nothing is written and no row is locked;
        on SQLite it holds the write lock for a moment, as every commit does.
        """
        t = self._progress
        probe = (
            sa.update(t)
            .where(t.c.consumer_group == "", t.c.topic == "", t.c.queue_id == -1)
            .values(consume_offset=t.c.consume_offset)
        )
        with self._engine.connect() as conn:
            conn.execution_options(stagedconsumer_begin="IMMEDIATE")
            with conn.begin() as transaction:
                conn.execute(probe)
                transaction.rollback()

    def _add_column(self, name: str, definition: str) -> None:
        """Add column ``name`` to the progress table unless it is there (processes
        may race: a failed ``ALTER`` is fine when another process added it)."""
        t = self._progress

        def has_it() -> bool:
            with self._engine.connect() as conn:
                return name in {c["name"] for c in sa.inspect(conn).get_columns(t.name)}

        if has_it():
            return
        try:
            with self._write_transaction() as conn:
                conn.exec_driver_sql(f"ALTER TABLE {t.name} ADD COLUMN {name} {definition}")
        except (sa_exc.ProgrammingError, sa_exc.OperationalError):
            if not has_it():
                raise

    def _set_version(self, version: int) -> None:
        """Record that the schema is at ``version`` (never lowering it)."""
        schema = self._schema_table
        with self._write_transaction() as conn:
            conn.execute(
                sa.update(schema)
                .where(schema.c.component == _COMPONENT, schema.c.version < version)
                .values(version=version)
            )

    def _migrate_to_2(self) -> None:
        """Version 1 -> 2: add the ``fence`` column (idempotent; processes may race)."""
        self._add_column("fence", "BIGINT NOT NULL DEFAULT 0")
        self._set_version(2)

    def _migrate_to_3(self) -> None:
        """Version 2 -> 3: add the ``finished`` column and the marks table (idempotent;
        processes may race)."""
        self._add_column("finished", "MEDIUMTEXT NULL" if self._backend == "mysql" else "TEXT NULL")
        try:
            with self._write_transaction() as conn:
                self._marks.create(conn, checkfirst=True)
        except (sa_exc.ProgrammingError, sa_exc.OperationalError, sa_exc.IntegrityError):
            with self._engine.connect() as conn:
                if not sa.inspect(conn).has_table(self._marks.name):
                    raise
        self._set_version(3)

    def _migrate_to_4(self) -> None:
        """Version 3 -> 4: the ``source`` column, first in the primary key of the
        progress and of the marks table; existing rows get ``''`` (UNSCOPED), adopted
        later by the first source that uses their group. Each table changes in one
        statement (MariaDB/MySQL: one ``ALTER TABLE``) or one transaction (SQLite,
        whose keys cannot be altered, copies the table; PostgreSQL), so a reader
        never sees it half done. Idempotent; processes may race."""
        for table in (self._progress, self._marks):
            try:
                self._add_source_key(table)
            except sa_exc.DBAPIError:
                if not self._has_source(table):  # else another process was first
                    raise
        self._set_version(4)

    def _has_source(self, table: sa.Table) -> bool:
        with self._engine.connect() as conn:
            return "source" in {c["name"] for c in sa.inspect(conn).get_columns(table.name)}

    def _add_source_key(self, table: sa.Table) -> None:
        if self._has_source(table):
            return
        keys = ", ".join(c.name for c in table.primary_key.columns)
        name = table.name
        if self._backend == "mysql":
            with self._write_transaction() as conn:
                conn.exec_driver_sql(
                    f"ALTER TABLE {name} ADD COLUMN source VARBINARY({SOURCE_MAX_LENGTH * 4})"
                    f" NOT NULL DEFAULT '' FIRST, DROP PRIMARY KEY, ADD PRIMARY KEY ({keys})"
                )
        elif self._backend == "postgresql":
            with self._write_transaction() as conn:
                pk = sa.inspect(conn).get_pk_constraint(name)["name"]
                conn.exec_driver_sql(
                    f"ALTER TABLE {name} ADD COLUMN source VARCHAR({SOURCE_MAX_LENGTH})"
                    f" NOT NULL DEFAULT '', DROP CONSTRAINT {pk}, ADD PRIMARY KEY ({keys})"
                )
        else:
            copy = table.to_metadata(sa.MetaData(), name=f"{name}_v4")
            old = ", ".join(c.name for c in table.columns if c.name != "source")
            with self._write_transaction() as conn:  # BEGIN IMMEDIATE: one at a time
                if self._has_source_in(conn, name):
                    return
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {copy.name}")
                conn.execute(sa.schema.CreateTable(copy))
                conn.exec_driver_sql(
                    f"INSERT INTO {copy.name} (source, {old}) SELECT '', {old} FROM {name}"
                )
                conn.exec_driver_sql(f"DROP TABLE {name}")
                conn.exec_driver_sql(f"ALTER TABLE {copy.name} RENAME TO {name}")

    @staticmethod
    def _has_source_in(conn: sa.Connection, name: str) -> bool:
        rows = conn.exec_driver_sql(f"PRAGMA table_info({name})").all()
        return any(row[1] == "source" for row in rows)

    @contextmanager
    def _write_transaction(self) -> Iterator[sa.Connection]:
        """A transaction that writes (SQLite: ``BEGIN IMMEDIATE``, so writers queue on
        the busy timeout instead of failing on a read-to-write lock upgrade)."""
        with self._engine.connect() as conn:
            conn.execution_options(stagedconsumer_begin="IMMEDIATE")
            with conn.begin():
                yield conn

    def _tables_exist(self) -> bool:
        with self._engine.connect() as conn:
            inspector = sa.inspect(conn)
            return all(
                inspector.has_table(name) for name in (self._progress.name, self._schema_table.name)
            )

    async def aclose(self) -> None:
        """Close every pooled connection. The store cannot be used afterwards.

        Operations still running in worker threads (an operation whose caller was
        cancelled or timed out keeps running there until the database answers) are
        waited for, at most 5 seconds (or ``operation_timeout`` if shorter), so that
        their connections go back to the pool and are closed with it rather than
        left open for the garbage collector.
        """
        if self._closed:
            return
        self._closed = True
        wait = min(5.0, self._operation_timeout or 5.0)
        await anyio.to_thread.run_sync(self._idle.wait, wait, abandon_on_cancel=True)
        await anyio.to_thread.run_sync(self._engine.dispose)

    # -- the durable part -------------------------------------------------------------------

    def _rows_to_progress(
        self, group: str, rows: Any, *, unreadable_stages: set[MessageQueue] | None = None
    ) -> dict[MessageQueue, QueueProgress]:
        """Decode rows of ``group``; a corrupt one raises, unless only its stage offsets
        are and ``unreadable_stages`` is given: then it has none and its queue goes
        there. When only its stage offsets are corrupt, the error gives the command
        that repairs the row."""
        result: dict[MessageQueue, QueueProgress] = {}
        for topic, queue_id, consume_offset, stage_text, *rest in rows:
            finished_text = rest[0] if rest else None
            mq = MessageQueue(str(topic), int(queue_id))
            repair = ""
            try:
                try:
                    stage_offsets = decode_stage_offsets(stage_text)
                except (ValueError, TypeError):
                    if unreadable_stages is None:
                        repair = self._repair_hint(group, mq, consume_offset)
                        raise
                    unreadable_stages.add(mq)
                    stage_offsets = {}
                offset = None if consume_offset is None else int(consume_offset)
                progress = QueueProgress(
                    consume_offset=offset,
                    stage_offsets=stage_offsets,
                    finished=decode_finished(offset, finished_text),
                )
            except (ValueError, TypeError) as exc:
                repair = repair or self._repair_hint(group, mq, consume_offset)
                raise OffsetStoreError(
                    f"corrupt progress row for {mq} in {self._progress.name} of {self.url}:"
                    f" {exc}{repair}",
                    retriable=False,
                ) from exc
            result[mq] = progress
        return result

    def _repair_hint(self, group: str, mq: MessageQueue, consume_offset: Any) -> str:
        """What to append to the error for a row of ``group`` whose stage offsets cannot
        be read: the ``stagedconsumer offsets reset`` command that rewrites them (it
        keeps a readable consume offset; an unreadable one needs a new one, ``N``)."""
        try:
            if consume_offset is not None:
                check_offset("consume offset", int(consume_offset))
            readable = True
        except (ValueError, TypeError):
            readable = False
        words = ["stagedconsumer", "offsets", "reset", "--store", self.url]
        if self._table_prefix != "stagedconsumer_":
            words += ["--table-prefix", self._table_prefix]
        if self._scope_of(group):
            words += ["--source", self._scope_of(group)]
        words += ["--group", group, "--topic", mq.topic, "--queue", str(mq.queue_id)]
        password = " (with the URL's password put back)" if self._url.password else ""
        if not readable:
            command = f"{shlex.join(words)} --to-offset N --force"
            return (
                "; with the group stopped, repair the row (N: the new consume offset; its"
                f" stage offsets are dropped) with: {command}{password}"
            )
        words.append("--clear-stage-offsets")
        return (
            "; with the group stopped, repair the row (its consume offset is kept, its"
            f" stage offsets are dropped) with: {shlex.join(words)}{password}"
        )

    def _fence_hint(self, group: str, mq: MessageQueue, problem: str) -> str:
        """What to append to a refused claim whose stored fence is corrupt: the
        ``stagedconsumer offsets reset`` command that repairs it."""
        words = ["stagedconsumer", "offsets", "reset", "--store", self.url]
        if self._table_prefix != "stagedconsumer_":
            words += ["--table-prefix", self._table_prefix]
        if self._scope_of(group):
            words += ["--source", self._scope_of(group)]
        words += ["--group", group, "--topic", mq.topic, "--queue", str(mq.queue_id), "--force"]
        return (
            f" ({problem}: the stored fence is corrupt and blocks the queue for every member;"
            f" with the group stopped, repair it with: {shlex.join(words)} --redis URL)"
        )

    # -- the key: source, group, queue ------------------------------------------------

    def _owned(self, table: sa.Table, group: str) -> list[sa.ColumnElement[bool]]:
        """The rows of ``group`` of this store's source in ``table`` (tables before
        schema version 4, read by a read-only store, have no source)."""
        if self._version < 4:
            return [table.c.consumer_group == group]
        return [table.c.source == self._scope_of(group), table.c.consumer_group == group]

    def _source_bound(self) -> None:
        self._marked.clear()
        self._written.clear()

    async def _adopt_stored(self, group: str) -> int:
        t, m = self._progress, self._marks
        scope = self._scope_of(group)
        if self._read_only or self._version < 4:
            return 0

        def adopt() -> int:
            with self._write_transaction() as conn:
                for table in (t, m):
                    own = sa.select(table.c.topic).where(*self._owned(table, group)).limit(1)
                    if conn.execute(own).first() is not None:
                        return 0
                queues: set[tuple[str, int]] = set()
                for table in (t, m):
                    legacy = (table.c.source == UNSCOPED, table.c.consumer_group == group)
                    found = conn.execute(
                        sa.select(table.c.topic, table.c.queue_id).distinct().where(*legacy)
                    )
                    queues.update((str(topic), int(queue)) for topic, queue in found)
                if not queues:
                    return 0
                legacy = (t.c.source == UNSCOPED, t.c.consumer_group == group)
                conn.execute(sa.update(t).where(*legacy).values(source=scope))
                # The marks move by INSERT and DELETE: the grants a consumer has there.
                names = [c.name for c in m.columns if c.name != "source"]
                copied = sa.select(sa.literal(scope, m.c.source.type), *(m.c[n] for n in names))
                legacy = (m.c.source == UNSCOPED, m.c.consumer_group == group)
                conn.execute(sa.insert(m).from_select(["source", *names], copied.where(*legacy)))
                conn.execute(sa.delete(m).where(*legacy))
                return len(queues)

        return await self._run(
            f"adopting the progress of group {group!r} stored without a source",
            adopt,
            writes=True,
        )

    async def _stored_sources(self, group: str) -> list[str]:
        return await self.list_sources(group)

    async def list_sources(self, group: str) -> list[str]:
        """The sources that have stored progress of ``group``, sorted (``''``,
        :data:`~offsetstore.UNSCOPED`, for rows stored without one)."""
        t = self._progress
        if self._version < 4:
            stmt = sa.select(sa.literal(UNSCOPED)).where(t.c.consumer_group == group).limit(1)
        else:
            stmt = sa.select(t.c.source).distinct().where(t.c.consumer_group == group)

        def read() -> list[str]:
            with self._engine.connect() as conn:
                return sorted({str(source) for (source,) in conn.execute(stmt)})

        return await self._run(f"listing the sources of group {group!r}", read, writes=False)

    def _select(self, group: str) -> sa.Select[Any]:
        t = self._progress
        columns = [t.c.topic, t.c.queue_id, t.c.consume_offset, t.c.stage_offsets]
        if self._version >= 3:
            columns.append(t.c.finished)
        return sa.select(*columns).where(*self._owned(t, group)).order_by(t.c.topic, t.c.queue_id)

    def _read_marks(
        self, conn: sa.Connection, group: str, mq: MessageQueue | None, topic: str | None = None
    ) -> dict[MessageQueue, list[int]]:
        """The finished marks of ``group`` (of ``mq``, or of ``topic``, when given)."""
        if self._version < 3:
            return {}
        m = self._marks
        stmt = sa.select(m.c.topic, m.c.queue_id, m.c.queue_offset).where(*self._owned(m, group))
        if mq is not None:
            stmt = stmt.where(m.c.topic == mq.topic, m.c.queue_id == mq.queue_id)
        elif topic is not None:
            stmt = stmt.where(m.c.topic == topic)
        result: dict[MessageQueue, list[int]] = {}
        for row_topic, queue_id, offset in conn.execute(stmt):
            result.setdefault(MessageQueue(str(row_topic), int(queue_id)), []).append(int(offset))
        return result

    def _with_marks(
        self,
        group: str,
        progress: dict[MessageQueue, QueueProgress],
        marks: Mapping[MessageQueue, list[int]],
    ) -> dict[MessageQueue, QueueProgress]:
        for mq, offsets in marks.items():
            merged = merge_marks(progress.get(mq), offsets)
            if merged is not None:
                progress[mq] = merged
            if not self._read_only:
                self._marked[(group, mq)] = max(offsets)
        return progress

    async def _read_stored(self, group: str, mq: MessageQueue) -> QueueProgress | None:
        t = self._progress
        stmt = self._select(group).where(t.c.topic == mq.topic, t.c.queue_id == mq.queue_id)

        def read() -> QueueProgress | None:
            with self._engine.connect() as conn:
                rows = conn.execute(stmt).all()
                marks = self._read_marks(conn, group, mq)
            return self._with_marks(group, self._rows_to_progress(group, rows), marks).get(mq)

        return await self._run(f"reading the progress of {mq} ({group})", read, writes=False)

    async def _list_stored(
        self, group: str, topic: str | None
    ) -> dict[MessageQueue, QueueProgress]:
        stmt = self._select(group)
        if topic is not None:
            stmt = stmt.where(self._progress.c.topic == topic)

        def read() -> dict[MessageQueue, QueueProgress]:
            with self._engine.connect() as conn:
                rows = conn.execute(stmt).all()
                marks = self._read_marks(conn, group, None, topic)
            return self._with_marks(group, self._rows_to_progress(group, rows), marks)

        return await self._run(f"listing the progress of group {group!r}", read, writes=False)

    async def list_progress_for_repair(
        self, group: str, topic: str | None = None
    ) -> tuple[dict[MessageQueue, QueueProgress], frozenset[MessageQueue]]:
        """:meth:`list_progress`, and the queues whose stored stage offsets cannot be
        read (written by an older version that did not check them): those come back
        without stage offsets instead of raising, for an operator to overwrite them
        (``stagedconsumer offsets reset --clear-stage-offsets``). A row whose consume
        offset cannot be read still raises."""
        await self._resolve_scope(group)
        stmt = self._select(group)
        if topic is not None:
            stmt = stmt.where(self._progress.c.topic == topic)
        unreadable: set[MessageQueue] = set()

        def read() -> dict[MessageQueue, QueueProgress]:
            with self._engine.connect() as conn:
                rows = conn.execute(stmt).all()
            return self._rows_to_progress(group, rows, unreadable_stages=unreadable)

        progress = await self._run(f"listing the progress of group {group!r}", read, writes=False)
        return progress, frozenset(unreadable)

    async def inspect_progress(
        self, group: str, topic: str | None = None, *, every_source: bool = False
    ) -> list[StoredRow]:
        """Every stored row of ``group`` (of one topic when given) as it is, corrupt
        ones included and marked (:attr:`StoredRow.problems`), for an operator: never
        raises for a row it cannot read (``stagedconsumer offsets show``). Rows of
        this store's source, or with ``every_source`` of every source (each row's
        :attr:`StoredRow.source` says which)."""
        if not every_source:
            await self._resolve_scope(group)
        t = self._progress
        columns: list[sa.ColumnElement[Any]] = [
            t.c.topic,
            t.c.queue_id,
            t.c.consume_offset,
            t.c.stage_offsets,
            t.c.fence,
        ]
        columns.append(t.c.finished if self._version >= 3 else sa.null())
        columns.append(t.c.source if self._version >= 4 else sa.literal(UNSCOPED))
        where = [t.c.consumer_group == group] if every_source else self._owned(t, group)
        order = [t.c.source] if every_source and self._version >= 4 else []
        stmt = sa.select(*columns).where(*where).order_by(*order, t.c.topic, t.c.queue_id)
        if topic is not None:
            stmt = stmt.where(t.c.topic == topic)

        def read() -> list[StoredRow]:
            with self._engine.connect() as conn:
                rows = conn.execute(stmt).all()
                marks = self._read_marks_by_source(conn, group, topic, every_source)
            decoded = []
            for r in rows:
                mq = MessageQueue(str(r[0]), int(r[1]))
                row = decode_row(mq, r[2], r[3], r[4], decode_stage_offsets, r[5])
                row = attrs.evolve(row, source=str(r[6]))
                progress = row.progress()
                queue_marks = marks.get((row.source, mq))
                if queue_marks and progress is not None:
                    merged = merge_marks(progress, queue_marks)
                    if merged is not None:
                        row = attrs.evolve(row, finished=merged.finished)
                decoded.append(row)
            return decoded

        return await self._run(f"listing the stored rows of group {group!r}", read, writes=False)

    def _read_marks_by_source(
        self, conn: sa.Connection, group: str, topic: str | None, every_source: bool
    ) -> dict[tuple[str, MessageQueue], list[int]]:
        """The finished marks of ``group`` (of ``topic``), by source and queue."""
        if not every_source or self._version < 4:
            return {
                (self._scope_of(group), mq): offsets
                for mq, offsets in self._read_marks(conn, group, None, topic).items()
            }
        m = self._marks
        stmt = sa.select(m.c.source, m.c.topic, m.c.queue_id, m.c.queue_offset).where(
            m.c.consumer_group == group
        )
        if topic is not None:
            stmt = stmt.where(m.c.topic == topic)
        result: dict[tuple[str, MessageQueue], list[int]] = {}
        for source, row_topic, queue_id, offset in conn.execute(stmt):
            key = (str(source), MessageQueue(str(row_topic), int(queue_id)))
            result.setdefault(key, []).append(int(offset))
        return result

    async def repair_progress(
        self,
        group: str,
        progress: Mapping[MessageQueue, QueueProgress],
        fences: Mapping[MessageQueue, int] | None = None,
    ) -> None:
        """:meth:`reset_progress` of ``progress`` and, in the same transaction, the
        stored fence of each queue of ``fences`` set to its value: the operator's repair
        of a row whose fence blocks its queue (see :class:`StoredRow`). Lowering a fence
        lets a member that lost the queue write over it again: only for a group none
        of whose members holds the queue."""
        progress = dict(progress)
        fences = dict(fences or {})
        for mq, value in progress.items():
            _check_reset_entry(mq, value)
        for mq, fence in fences.items():
            check_offset(f"fence of {mq}", fence)
        await self._resolve_scope(group)
        t = self._progress
        items = sorted(progress.items(), key=_queue_order)
        stmt = self._overwrite_stmt

        m = self._marks

        def write() -> None:
            with self._write_transaction() as conn:
                for mq, _ in items:
                    # As in a reset: the plan's finished ranges hold what stays finished
                    # (the marks included), and the marks are consumed again otherwise.
                    if self._version >= 3:
                        conn.execute(
                            sa.delete(m).where(
                                *self._owned(m, group),
                                m.c.topic == mq.topic,
                                m.c.queue_id == mq.queue_id,
                            )
                        )
                    self._marked.pop((group, mq), None)
                if items:
                    conn.execute(stmt, [self._params(group, mq, value) for mq, value in items])
                for mq, fence in sorted(fences.items(), key=_queue_order):
                    conn.execute(
                        sa.update(t)
                        .where(
                            *self._owned(t, group),
                            t.c.topic == mq.topic,
                            t.c.queue_id == mq.queue_id,
                        )
                        .values(fence=fence)
                    )

        try:
            await self._run(f"repairing the progress of group {group!r}", write, writes=True)
        finally:
            self._forget_written(group, [*progress, *fences])
        for mq, value in progress.items():
            self.update_progress(group, mq, value)

    def _key(self, group: str, mq: MessageQueue) -> tuple[Any, ...]:
        """The primary key values of the progress row of ``mq`` of ``group``, in the
        order of the table's key columns (the marks table's key begins with them)."""
        return (self._scope_of(group), group, mq.topic, mq.queue_id)

    def _params(self, group: str, mq: MessageQueue, progress: QueueProgress) -> dict[str, Any]:
        params = dict(zip(self._key_names, self._key(group, mq), strict=True))
        params["consume_offset"] = progress.consume_offset
        params["stage_offsets"] = encode_stage_offsets(progress.stage_offsets)
        params["finished"] = encode_finished(progress.consume_offset, progress.finished)
        return params

    def _bulk_upsert(self) -> BulkUpsert:
        bulk = self._bulk
        if bulk is None:
            bulk = self._bulk = BulkUpsert(self._progress, self._backend, self._engine.dialect)
        return bulk

    async def _snapshot(
        self, group: str, mqs: Iterable[MessageQueue], *, all_of_them: bool
    ) -> _Snapshot:
        """Copy the in-memory progress of ``mqs``, yielding to the event loop every
        ``_SNAPSHOT_CHUNK`` queues (a commit of 10,000 queues never holds the loop for
        more than a few milliseconds). Each queue's progress is copied as one unit;
        queues are independent, so a queue updated while the snapshot runs is simply
        written with its newer value.

        A queue whose progress is what this store last committed for it, and that has
        no finished marks to fold, is left out (``all_of_them``: kept, but marked
        ``clean``, to be checked without being written)."""
        raw: dict[MessageQueue, _Raw] = {}
        clean: set[MessageQueue] = set()
        table = self._table
        written = self._written
        marked = self._marked
        for count, mq in enumerate(mqs, 1):
            key = (group, mq)
            row = table.get(key)
            if row is not None:
                last = written.get(key)
                if (
                    last is not None
                    and last[0] == row.consume_offset
                    and last[2] == row.finished
                    and last[1] == row.stage_offsets
                    and (not marked or key not in marked)
                ):
                    if all_of_them:
                        raw[mq] = last
                        clean.add(mq)
                else:
                    raw[mq] = (row.consume_offset, dict(row.stage_offsets), row.finished)
            if count % _SNAPSHOT_CHUNK == 0:
                await anyio.lowlevel.checkpoint()
        return _Snapshot(raw, clean)

    async def persist_all(self, group: str, mqs: Iterable[MessageQueue]) -> None:
        """Write the in-memory progress of ``mqs`` to the database in one transaction.

        As :meth:`StageOffsetStore.persist_all`; the queues whose progress did not
        change since this store committed it are not written again (see
        :meth:`_snapshot`)."""
        batch = await self._snapshot(group, mqs, all_of_them=False)
        if batch:
            await self._resolve_scope(group)
            await self._write_stored(group, batch)

    async def persist_fenced(self, group: str, fences: Mapping[MessageQueue, int]) -> None:
        """:meth:`StageOffsetStore.persist_fenced`: the fence of every queue of
        ``fences`` is checked; of those that pass, only the ones whose progress
        changed since this store committed it are written again."""
        batch = await self._snapshot(group, fences, all_of_them=True)
        if not batch:
            return
        await self._resolve_scope(group)
        fenced = await self._write_fenced(group, batch, {mq: fences[mq] for mq in batch})
        if fenced:
            raise _fenced_error(group, fenced)

    def remove_offset(self, group: str, mq: MessageQueue) -> None:
        super().remove_offset(group, mq)
        self._written.pop((group, mq), None)

    def _forget_written(self, group: str, mqs: Iterable[MessageQueue]) -> None:
        """The stored progress of ``mqs`` was set by other means: write it next time."""
        for mq in mqs:
            self._written.pop((group, mq), None)

    async def _write_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress]
    ) -> None:
        await self._write_progress(group, _Snapshot.of(progress), None)

    async def _write_fenced(
        self,
        group: str,
        progress: Mapping[MessageQueue, QueueProgress],
        fences: Mapping[MessageQueue, int],
    ) -> set[MessageQueue]:
        return await self._write_progress(group, _Snapshot.of(progress), fences)

    async def _write_progress(
        self, group: str, batch: _Snapshot, fences: Mapping[MessageQueue, int] | None
    ) -> set[MessageQueue]:
        """Write ``batch`` (but its clean queues) in one transaction, increase-only;
        with ``fences``, lock the rows first and skip (and return) those whose stored
        fence is higher than their token."""
        raw = batch.raw
        clean = batch.clean

        def write() -> set[MessageQueue]:
            # Everything but the snapshot runs here, off the event loop: with 10,000
            # queues, sorting and encoding alone take milliseconds. Sorted, so
            # concurrent writers lock rows in the same order.
            with _collection_paused():
                items = sorted(raw.items(), key=_queue_order)
            scope = self._scope_of(group)  # the key of _key(), built inline
            fenced: set[MessageQueue] = set()
            with self._write_transaction() as conn:
                if fences is not None:
                    fenced = self._fenced_queues(conn, group, [mq for mq, _ in items], fences)
                skip = clean | fenced
                with _collection_paused():
                    rows: list[BulkRow] = [
                        (
                            (scope, group, mq.topic, mq.queue_id),
                            c,
                            encode_stage_offsets(s),
                            encode_finished(c, f),
                        )
                        for mq, (c, s, f) in items
                        if not skip or mq not in skip
                    ]
                    statements = list(self._bulk_upsert().statements(rows))
                    del rows
                for n, (sql, params) in enumerate(statements):
                    if n:
                        # Drivers drop and retake the GIL while they work; without a
                        # real pause the event loop's thread can wait for the GIL for
                        # the whole commit (the convoy effect).
                        time.sleep(_GIL_PAUSE)
                    conn.exec_driver_sql(sql, params)
                # The marks of a fenced queue are its new owner's to fold.
                folded = (
                    self._fold_marks(
                        conn, group, [(mq, value[0]) for mq, value in items if mq not in fenced]
                    )
                    if self._marked
                    else []
                )
            self._folded(group, folded)
            return fenced

        what = f"persisting the progress of {len(raw)} queue(s) of group {group!r}"
        fenced = await self._run(
            f"{what} (fenced)" if fences is not None else what, write, writes=True
        )
        written = self._written
        for mq, value in raw.items():
            if mq not in fenced:
                written[(group, mq)] = value
        return fenced

    def _fenced_queues(
        self,
        conn: sa.Connection,
        group: str,
        queues: Sequence[MessageQueue],
        fences: Mapping[MessageQueue, int],
    ) -> set[MessageQueue]:
        """Lock the stored rows of ``queues`` (SQLite: ``BEGIN IMMEDIATE`` already
        serializes writers) and return those whose fence is higher than their token
        in ``fences``. A queue with no row is not fenced."""
        by_key = {self._key(group, mq): mq for mq in queues}
        fenced: set[MessageQueue] = set()
        for sql, params in self._bulk_upsert().lock_statements(list(by_key)):
            for *key, fence in conn.exec_driver_sql(sql, params):
                mq = by_key[self._stored_key(key)]
                if int(fence) > fences[mq]:
                    fenced.add(mq)
        return fenced

    def _stored_key(self, values: Sequence[Any]) -> tuple[Any, ...]:
        """Key values as a driver returns them (MariaDB: bytes) as :meth:`_key` has them."""
        return tuple(
            bytes(v).decode("utf-8") if isinstance(v, (bytes, bytearray)) else v for v in values
        )

    def _fold_marks(
        self, conn: sa.Connection, group: str, items: Iterable[tuple[MessageQueue, int | None]]
    ) -> list[MessageQueue]:
        """Delete the finished marks below the consume offsets just written (only of
        queues that may have some), ``_FOLD_CHUNK`` queues per statement; returns the
        queues left with none."""
        marked = self._marked
        if not marked:
            return []
        m = self._marks
        keys = [m.c[name] for name in self._key_names]
        folded = []
        below = []
        for mq, consume_offset in items:
            highest = marked.get((group, mq))
            if highest is None or consume_offset is None:
                continue
            below.append(
                sa.and_(
                    *(c == v for c, v in zip(keys, self._key(group, mq), strict=True)),
                    m.c.queue_offset < consume_offset,
                )
            )
            if highest < consume_offset:
                folded.append(mq)
        for start in range(0, len(below), _FOLD_CHUNK):
            conn.execute(sa.delete(m).where(sa.or_(*below[start : start + _FOLD_CHUNK])))
        return folded

    def _folded(self, group: str, mqs: Iterable[MessageQueue]) -> None:
        for mq in mqs:
            self._marked.pop((group, mq), None)

    def _lock_row(
        self, conn: sa.Connection, group: str, mq: MessageQueue, *, share: bool = False
    ) -> Any:
        """The row of ``mq`` (consume offset, stage offsets, fence, finished), locked for
        update (``share``: against updates only, so transactions of one queue run side
        by side while a claim, which updates the fence, waits for them)."""
        t = self._progress
        columns = [t.c.consume_offset, t.c.stage_offsets, t.c.fence]
        if self._version >= 3:
            columns.append(t.c.finished)
        stmt = sa.select(*columns).where(
            *self._owned(t, group), t.c.topic == mq.topic, t.c.queue_id == mq.queue_id
        )
        if self._backend != "sqlite":  # SQLite: BEGIN IMMEDIATE already serializes writers
            # PostgreSQL: FOR KEY SHARE, the lightest lock that a claim's FOR UPDATE waits for.
            pg_share = share and self._backend == "postgresql"
            stmt = stmt.with_for_update(read=share, key_share=pg_share)
        return conn.execute(stmt).first()

    async def transact(
        self,
        group: str,
        mq: MessageQueue,
        offsets: Sequence[int],
        fn: Callable[[sa.Connection], _T],
        *,
        fence: int | None = None,
    ) -> _T:
        """:meth:`StageOffsetStore.transact`: ``fn(connection)`` runs in a worker thread
        with a :class:`sqlalchemy.Connection` in the transaction that writes the
        marks. The fence check takes a shared lock on the queue's progress row, so a
        new owner's claim (which raises the fence) waits for transactions in progress
        and then sees their marks; once it committed, the old owner's transactions
        fail the check. Its statements are retried (``fn`` too) on a deadlock;
        anything ``fn`` raises propagates as it is, nothing committed."""
        m = self._marks
        key_values = self._key(group, mq)
        highest = max(offsets)
        fence_token = _NO_FENCE if fence is None else fence

        def mark_params() -> dict[str, Any]:
            params: dict[str, Any] = {f"k{i}": value for i, value in enumerate(key_values)}
            params["offsets"] = list(offsets)
            params["fence"] = fence_token
            return params

        def mark_rows() -> list[dict[str, Any]]:
            key = dict(zip(self._key_names, key_values, strict=True))
            return [{**key, "queue_offset": o} for o in offsets]

        def already(done: set[int]) -> AlreadyFinishedError:
            return AlreadyFinishedError(
                f"group {group!r}: {mq} offsets {sorted(done)} already finished: their"
                " effects were committed before",
                offsets=done,
            )

        def run() -> _T:
            try:
                with self._mark_transaction() as (conn, driver_conn):
                    if driver_conn is not None:
                        # Begin, lock, check and mark in one round trip.
                        query = self._pg_begin_mark_query(
                            driver_conn, key_values, offsets, fence_token
                        )
                        row = self._pg_begin_and_mark(conn, driver_conn, query)
                        marked = row is not None and int(row.marked) == len(offsets)
                    elif self._backend == "postgresql" and self._version >= 4:
                        # Lock, check and mark in one round trip.
                        row = conn.execute(self._pg_mark_stmt, mark_params()).first()
                        marked = row is not None and int(row.marked) == len(offsets)
                    else:
                        row = self._lock_row(conn, group, mq, share=True)
                        marked = False
                    if fence is not None and (row is None or int(row.fence) > fence):
                        raise StoreFencedError(
                            f"group {group!r}: {mq} was claimed with fencing token"
                            f" {'(none)' if row is None else row.fence} > {fence}: this"
                            " member lost the queue, its transaction was not committed",
                            queues=(mq,),
                        )
                    done = self._committed_offsets(row, offsets)
                    if done:
                        raise already(done)  # (rolls back the marks inserted above)
                    # A mark that exists fails the insert (primary key): looked up then.
                    if not marked:
                        conn.execute(sa.insert(m), mark_rows())
                    self._marked[(group, mq)] = max(highest, self._marked.get((group, mq), -1))
                    try:
                        return fn(conn)
                    except sa_exc.DBAPIError as exc:
                        if _is_deadlock(exc):
                            raise
                        raise _HandlerFailed(exc) from exc
                    except Exception as exc:
                        raise _HandlerFailed(exc) from exc
            except sa_exc.IntegrityError as exc:
                with self._engine.connect() as conn:
                    done = self._marked_offsets(conn, group, mq, offsets)
                if done:
                    raise already(done) from exc
                raise

        try:
            return await self._run(
                f"a transaction of {mq} ({group}) at offsets {offsets[0]}..{offsets[-1]}",
                run,
                writes=True,
            )
        except _HandlerFailed as failed:
            raise failed.exc from None

    @contextmanager
    def _mark_transaction(self) -> Iterator[tuple[sa.Connection, Any]]:
        """The transaction of :meth:`transact`: a write transaction, and the driver's
        connection when its first statement is to begin it (PostgreSQL through
        psycopg, see :meth:`_pg_begin_and_mark`), else ``None``.

        psycopg sends ``BEGIN`` on its own, a round trip before the first statement,
        unless the connection is in autocommit mode: for the transaction, it is
        switched to autocommit (the server's transaction, begun by our ``BEGIN``, is
        then committed or rolled back by SQLAlchemy as any other: psycopg ends a
        transaction in progress whatever the mode), and switched back before the
        connection returns to the pool; a connection that cannot be switched back is
        discarded rather than pooled."""
        if self._pg_begin_mark_sql is None or self._version < 3:
            with self._write_transaction() as conn:
                yield conn, None
            return
        with self._engine.connect() as conn:
            driver_conn = conn.connection.dbapi_connection
            assert driver_conn is not None
            driver_conn.autocommit = True
            try:
                with conn.begin():
                    yield conn, driver_conn
            finally:
                self._end_autocommit(conn, driver_conn)

    def _end_autocommit(self, conn: sa.Connection, driver_conn: Any) -> None:
        if conn.invalidated or driver_conn.closed:
            return
        try:
            driver_conn.rollback()  # nothing to do unless a transaction was left open
            driver_conn.autocommit = False
        except Exception as exc:
            conn.invalidate(exc)

    def _pg_begin_and_mark(self, conn: sa.Connection, driver_conn: Any, query: str) -> Any:
        """``BEGIN`` and the mark statement (:meth:`_pg_mark_sql`, prepared on the
        connection at its first use) sent as one query (one round trip) on
        ``driver_conn``, a psycopg connection in autocommit mode; the row it returns
        or ``None``. Several statements in one query need the simple query protocol:
        ``query`` carries its values as literals (:meth:`_pg_begin_mark_query`).
        Driver errors come out as SQLAlchemy's, as from ``conn.execute``."""
        dialect = self._engine.dialect
        dbapi = dialect.loaded_dbapi
        info = conn.connection.info
        cursor = dbapi.ClientCursor(driver_conn)
        try:
            for attempt in range(2):
                if not info.get("stagedconsumer_mark_prepared"):
                    cursor.execute(self._pg_prepare_mark_sql)  # autocommit: outlives transactions
                    info["stagedconsumer_mark_prepared"] = True
                try:
                    cursor.execute(query)
                    break
                except dbapi.Error as exc:
                    if attempt or getattr(exc, "sqlstate", None) != "26000":
                        raise
                    # No such prepared statement (a pooler reset the session): end the
                    # failed transaction, prepare it again, begin again.
                    driver_conn.rollback()
                    info.pop("stagedconsumer_mark_prepared", None)
            cursor.nextset()  # past BEGIN's result
            row = cursor.fetchone()
        except dbapi.Error as exc:
            invalidated = bool(dialect.is_disconnect(exc, driver_conn, cursor))
            if invalidated:
                conn.invalidate(exc)
            raise sa_exc.DBAPIError.instance(
                query,
                None,
                exc,
                dbapi.Error,
                connection_invalidated=invalidated,
                dialect=dialect,
            ) from exc
        finally:
            cursor.close()
        return None if row is None else _MarkRow(*row)

    def _committed_offsets(self, row: Any, offsets: Sequence[int]) -> set[int]:
        """Those of ``offsets`` that the stored progress ``row`` says finished: below
        its consume offset or in its finished ranges."""
        if row is None or row.consume_offset is None:
            return set()
        base = int(row.consume_offset)
        ranges = decode_finished(base, row.finished) if self._version >= 3 else ()
        return {o for o in offsets if o < base or any(f <= o <= last for f, last in ranges)}

    def _marked_offsets(
        self, conn: sa.Connection, group: str, mq: MessageQueue, offsets: Sequence[int]
    ) -> set[int]:
        """Those of ``offsets`` that have a finished mark."""
        done: set[int] = set()
        m = self._marks
        marked = conn.execute(
            sa.select(m.c.queue_offset).where(
                *self._owned(m, group),
                m.c.topic == mq.topic,
                m.c.queue_id == mq.queue_id,
                m.c.queue_offset >= min(offsets),
                m.c.queue_offset <= max(offsets),
            )
        )
        wanted = set(offsets)
        done.update(int(o) for (o,) in marked if int(o) in wanted)
        return done

    async def _claim_stored(self, group: str, mq: MessageQueue, fence: int) -> QueueProgress | None:
        t = self._progress
        where = (*self._owned(t, group), t.c.topic == mq.topic, t.c.queue_id == mq.queue_id)

        def claim() -> QueueProgress | None:
            for attempt in range(2):
                try:
                    with self._write_transaction() as conn:
                        row = self._lock_row(conn, group, mq)
                        if row is None:
                            conn.execute(
                                sa.insert(t).values(
                                    source=self._scope_of(group),
                                    consumer_group=group,
                                    topic=mq.topic,
                                    queue_id=mq.queue_id,
                                    consume_offset=None,
                                    stage_offsets="[]",
                                    fence=fence,
                                )
                            )
                            return None
                        if int(row.fence) > fence:
                            problem = fence_problem(int(row.fence))
                            why = "" if problem is None else self._fence_hint(group, mq, problem)
                            raise StoreFencedError(
                                f"group {group!r}: {mq} was claimed with fencing token"
                                f" {row.fence} > {fence}{why}",
                                queues=(mq,),
                            )
                        conn.execute(sa.update(t).where(*where).values(fence=fence))
                        rows = [
                            (mq.topic, mq.queue_id, row.consume_offset, row.stage_offsets)
                            + ((row.finished,) if self._version >= 3 else ())
                        ]
                        marks = self._read_marks(conn, group, mq)
                        return self._with_marks(group, self._rows_to_progress(group, rows), marks)[
                            mq
                        ]
                except sa_exc.IntegrityError:
                    if attempt:  # a concurrent claim inserted the row first: look again
                        raise
            raise AssertionError("unreachable")  # pragma: no cover

        try:
            return await self._run(
                f"claiming {mq} ({group}) with fence {fence}", claim, writes=True
            )
        finally:
            self._forget_written(group, (mq,))

    async def _overwrite_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress | None]
    ) -> None:
        t = self._progress
        items = sorted(progress.items(), key=_queue_order)
        stmt = self._overwrite_stmt

        m = self._marks

        def write() -> None:
            upserts = [self._params(group, mq, value) for mq, value in items if value is not None]
            with self._write_transaction() as conn:
                for mq, value in items:
                    # An operator's reset: its messages are consumed again.
                    conn.execute(
                        sa.delete(m).where(
                            *self._owned(m, group),
                            m.c.topic == mq.topic,
                            m.c.queue_id == mq.queue_id,
                        )
                    )
                    self._marked.pop((group, mq), None)
                    if value is None:
                        conn.execute(
                            sa.delete(t).where(
                                *self._owned(t, group),
                                t.c.topic == mq.topic,
                                t.c.queue_id == mq.queue_id,
                            )
                        )
                if upserts:
                    conn.execute(stmt, upserts)

        try:
            await self._run(f"resetting the progress of group {group!r}", write, writes=True)
        finally:
            self._forget_written(group, progress)


class _MarkRow(NamedTuple):
    """What the mark statement returns (:meth:`SqlOffsetStore._pg_mark_sql`)."""

    fence: int
    consume_offset: int | None
    finished: str | None
    marked: int


_NO_FENCE: Final = (1 << 63) - 1
"""The fence passed when a transaction has none: every stored fence is below it."""


class _HandlerFailed(Exception):
    """What ``fn`` of :meth:`SqlOffsetStore.transact` raised, carried past the store's
    error wrapping."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(str(exc))
        self.exc = exc


_Raw = tuple["int | None", dict[StageKey, int], tuple[tuple[int, int], ...]]
"""A queue's progress as copied from the in-memory table: (consume offset, stage
offsets, finished ranges)."""


class _Snapshot(Mapping[MessageQueue, QueueProgress]):
    """Progress of queues to commit, as copied from the in-memory table (``raw``).

    A mapping of :class:`QueueProgress` for overrides of ``_write_stored`` (built on
    access only: at 10,000 queues, building them all costs as much as the commit's
    SQL). ``clean`` holds the queues whose progress this store committed already: a
    fenced commit checks their fence without writing them."""

    __slots__ = ("clean", "raw")

    def __init__(self, raw: dict[MessageQueue, _Raw], clean: set[MessageQueue]) -> None:
        self.raw = raw
        self.clean = clean

    @classmethod
    def of(cls, progress: Mapping[MessageQueue, QueueProgress]) -> _Snapshot:
        if isinstance(progress, _Snapshot):
            return progress
        raw = {
            mq: (value.consume_offset, dict(value.stage_offsets), value.finished)
            for mq, value in progress.items()
        }
        return cls(raw, set())

    def __getitem__(self, mq: MessageQueue) -> QueueProgress:
        consume_offset, stage_offsets, finished = self.raw[mq]
        return QueueProgress(
            consume_offset=consume_offset, stage_offsets=stage_offsets, finished=finished
        )

    def __iter__(self) -> Iterator[MessageQueue]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_resume = False


@contextmanager
def _collection_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a bulk commit builds and sends its
    rows (left as it was found, also when commits of several threads overlap).

    A commit of 10,000 queues makes tens of thousands of short-lived tuples and
    lists that live through several young collections: the collector then promotes
    them and, counting them, runs full collections of the whole heap, which cost
    more CPU than the commit's own work (30 of 70 ms measured) and hold the GIL
    against the event loop. What they leave behind is freed by reference counting.
    Only around work on the CPU, never while waiting for the database: a server that
    does not answer must not keep the collector off."""
    global _gc_pausers, _gc_resume
    with _gc_lock:
        if not _gc_pausers:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if not _gc_pausers and _gc_resume:
                gc.enable()


def _queue_order(item: tuple[MessageQueue, object]) -> tuple[str, int]:
    # A key function: attrs' generated ordering of MessageQueue is ~30x slower.
    mq = item[0]
    return (mq.topic, mq.queue_id)


def _ping_when_idle(engine: sa.Engine, idle: float) -> None:
    """Ping a pooled connection on checkout only when it rested ``idle`` seconds or more.

    SQLAlchemy's ``pool_pre_ping`` pings on every checkout: a round trip before each
    transaction, a fifth of a one-row transaction's time. A connection back in the
    pool for less than a second is taken as alive; should the server have closed it
    meanwhile, the statement fails as a lost connection, the pool drops it (and the
    connections older than it), and the store's call is tried once more on a new
    one (:meth:`SqlOffsetStore._call`). A rested connection that fails its ping is
    replaced before use, as with ``pool_pre_ping``."""
    dialect = engine.dialect

    @sa.event.listens_for(engine, "connect")
    def _on_connect(_dbapi_connection: Any, record: Any) -> None:
        record.info["stagedconsumer_rested_since"] = time.monotonic()

    @sa.event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection: Any, record: Any) -> None:
        if record is not None:
            record.info["stagedconsumer_rested_since"] = time.monotonic()

    @sa.event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("stagedconsumer_rested_since")
        if since is not None and time.monotonic() - since < idle:
            return
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as exc:
            if dialect.is_disconnect(exc, dbapi_connection, None):
                raise sa_exc.DisconnectionError(f"ping failed: {exc}") from exc
            raise


def _configure_sqlite(engine: sa.Engine, *, memory: bool, read_only: bool, wait: float) -> None:
    """WAL journal, full sync, and transactions under SQLAlchemy's control.

    pysqlite's own transaction handling begins transactions late and never for
    DDL; the recipe from SQLAlchemy's SQLite dialect documentation hands it to
    SQLAlchemy, and writers begin ``IMMEDIATE`` so two writers queue on the busy
    timeout instead of failing on a lock upgrade. ``wait`` (seconds) bounds how long a
    new connection retries switching a fresh file to WAL while another holds it. A
    ``read_only`` store changes nothing in the file (no WAL switch) and sets
    ``query_only``, so not even a bug of ours can write.
    """

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            if read_only:
                cursor.execute("PRAGMA query_only=ON")
                return
            if not memory:
                _switch_to_wal(cursor, wait)
            cursor.execute("PRAGMA synchronous=FULL")
        finally:
            cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        mode = conn.get_execution_options().get("stagedconsumer_begin", "")
        conn.exec_driver_sql(f"BEGIN {mode}".strip())


def _switch_to_wal(cursor: Any, wait: float) -> None:
    """``PRAGMA journal_mode=WAL`` on a new SQLite connection.

    The switch needs a moment alone with the file, and SQLite answers "database is
    locked" at once (no busy timeout) while another connection holds it, for example
    one switching the same fresh file at the same time. WAL sticks to the file, so
    the switch is done once the mode reads ``wal``; until then it is retried for up
    to ``wait`` seconds. Only "busy" and "locked" are retried: any other failure (a
    read-only file or file system, a journal that cannot be created) cannot go away
    by waiting and is raised at once. Retrying those too stalled ``load()`` on a
    read-only database for twice ``connect_timeout`` (20 s by default: once for the
    connection creating the tables, once for the one checking whether they exist).
    """
    deadline = time.monotonic() + wait
    pause = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except Exception as exc:
            if not _is_sqlite_busy(exc):
                raise
            try:
                if cursor.execute("PRAGMA journal_mode").fetchone() == ("wal",):
                    return
            except Exception:
                pass  # locked as well: retry below
            if time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def schema_sql(dialect: str, table_prefix: str = "stagedconsumer_") -> str:
    """The SQL that creates the offset store's tables for ``dialect`` (``sqlite``,
    ``postgresql``, ``mysql`` or ``mariadb``) and records their schema version: what
    :meth:`SqlOffsetStore.load` would do, for a DBA to run (``stagedconsumer offsets
    init --sql``). Each table's ``CREATE TABLE`` is SQLAlchemy's, compiled for the dialect."""
    make = _DDL_DIALECTS.get(dialect)
    if make is None:
        raise StoreConfigurationError(
            f"unknown SQL dialect {dialect!r}: use one of {', '.join(_DDL_DIALECTS)}"
        )
    SqlOffsetStore("sqlite://", table_prefix=table_prefix, create_tables=False)  # checks it
    _, schema, progress, marks = _build_tables(table_prefix)
    statements = [
        str(sa.schema.CreateTable(table).compile(dialect=make())).strip()
        for table in (schema, progress, marks)
    ]
    statements.append(
        f"INSERT INTO {schema.name} (component, version) VALUES ('{_COMPONENT}', {SCHEMA_VERSION})"
    )
    lines = "\n".join(f"{statement};" for statement in statements).splitlines()
    return "".join(f"{line.rstrip()}\n" for line in lines)


def migration_sql(
    dialect: str, table_prefix: str = "stagedconsumer_", from_version: int = 3
) -> str:
    """The SQL that migrates the offset store's tables from schema version
    ``from_version`` (3, the only one this prints) to :data:`SCHEMA_VERSION` for
    ``dialect``: what :meth:`SqlOffsetStore.load` would do, for a DBA to run
    (``stagedconsumer offsets init --sql --from-version 3``). Version 4 puts the
    ``source`` column first in the primary key of the progress and marks tables;
    existing rows get ``''`` and are adopted by the first source that uses their
    group. PostgreSQL: the primary key constraints are assumed to have their default
    names (``<table>_pkey``)."""
    if dialect not in _DDL_DIALECTS:
        raise StoreConfigurationError(
            f"unknown SQL dialect {dialect!r}: use one of {', '.join(_DDL_DIALECTS)}"
        )
    if from_version != 3:
        raise StoreConfigurationError(
            f"migration SQL is printed from schema version 3 only, not {from_version!r}:"
            " run stagedconsumer offsets init --store URL, which migrates from any version"
        )
    SqlOffsetStore("sqlite://", table_prefix=table_prefix, create_tables=False)  # checks it
    _, schema, progress, marks = _build_tables(table_prefix)
    statements: list[str] = []
    for table in (progress, marks):
        keys = ", ".join(c.name for c in table.primary_key.columns)
        name = table.name
        if dialect in ("mysql", "mariadb"):
            statements.append(
                f"ALTER TABLE {name} ADD COLUMN source VARBINARY({SOURCE_MAX_LENGTH * 4})"
                f" NOT NULL DEFAULT '' FIRST, DROP PRIMARY KEY, ADD PRIMARY KEY ({keys})"
            )
        elif dialect == "postgresql":
            statements.append(
                f"ALTER TABLE {name} ADD COLUMN source VARCHAR({SOURCE_MAX_LENGTH})"
                f" NOT NULL DEFAULT '', DROP CONSTRAINT {name}_pkey, ADD PRIMARY KEY ({keys})"
            )
        else:
            copy = table.to_metadata(sa.MetaData(), name=f"{name}_v4")
            old = ", ".join(c.name for c in table.columns if c.name != "source")
            create = sa.schema.CreateTable(copy).compile(dialect=sqlite_dialect.dialect())
            statements += [
                str(create).strip(),
                f"INSERT INTO {copy.name} (source, {old}) SELECT '', {old} FROM {name}",
                f"DROP TABLE {name}",
                f"ALTER TABLE {copy.name} RENAME TO {name}",
            ]
    statements.append(
        f"UPDATE {schema.name} SET version = {SCHEMA_VERSION}"
        f" WHERE component = '{_COMPONENT}' AND version = 3"
    )
    body = "\n".join(f"{statement};" for statement in statements)
    if dialect in ("sqlite", "postgresql"):  # transactional DDL: all or nothing
        body = f"BEGIN;\n{body}\nCOMMIT;"
    lines = body.splitlines()
    return "".join(f"{line.rstrip()}\n" for line in lines)


def _redact(url: object) -> str:
    text = str(url)
    if "@" in text and "://" in text:
        scheme, rest = text.split("://", 1)
        credentials, host = rest.rsplit("@", 1)
        user = credentials.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}" if ":" in credentials else text
    return text
