"""Bulk writes of the progress table: one statement per chunk of queues, per dialect.

A 10,000-queue progress commit through ``executemany`` of a one-row upsert costs a
statement per row on the server and, on the client, SQLAlchemy's and the driver's
processing of every parameter of every row. Here each chunk of rows is one
statement whose values go to the server in one piece:

- PostgreSQL: the rows as one JSON array parameter, unpacked with
  ``jsonb_array_elements`` (parsed once; ``json`` would parse each element again
  for every field read) into ``INSERT ... SELECT ... ON CONFLICT DO UPDATE ...
  WHERE`` (one parameter: psycopg adapts a list of Python values element by element,
  JSON is built by the C encoder);
- MariaDB/MySQL: a multi-row ``INSERT ... VALUES ... ON DUPLICATE KEY UPDATE`` with
  ``IF()`` guards, its values written as literals (numbers, ``NULL`` and hexadecimal
  strings: exact bytes whatever the connection's character set or ``sql_mode``);
- SQLite: a multi-row ``INSERT ... VALUES ... ON CONFLICT DO UPDATE ... WHERE``
  with ``?`` parameters (the driver binds them in C).

A fenced commit first reads (and, on the servers, locks) the fences of its rows the
same way, a chunk per statement (:meth:`BulkUpsert.lock_statements`).

The increase-only rule is the one of the single-row statement: a row is replaced
(consume offset, stage offsets and finished ranges together) when its stored consume
offset is ``NULL``, or the new one is not ``NULL`` and at least the stored one.

The key columns are the progress table's primary key, in its order: a row here is
``(key values, consume_offset, stage_offsets text, finished text)``, so a key
column added to the table (and to :meth:`SqlOffsetStore._key`) needs nothing here.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from typing import Any, Final

import sqlalchemy as sa

__all__ = ("BulkRow", "BulkUpsert")

BulkRow = tuple[tuple[Any, ...], "int | None", str, "str | None"]
"""One queue's progress to write: (key values, consume offset, stage offsets as
text, finished ranges as text)."""

_ROWS_PER_STATEMENT: Final = 2000
_MYSQL_STATEMENT_CHARS: Final = 1_000_000
"""Bytes of one MariaDB/MySQL statement at most (as PyMySQL's ``executemany``):
below the smallest ``max_allowed_packet`` in use (1 MiB before MariaDB 10.2)."""
_VALUE_COLUMNS: Final = ("consume_offset", "stage_offsets", "finished")


def _sqlite_max_variables() -> int:
    # SQLITE_MAX_VARIABLE_NUMBER: 999 before SQLite 3.32, 32766 since.
    return 32766 if sqlite3.sqlite_version_info >= (3, 32, 0) else 999


class BulkUpsert:
    """Increase-only upserts of many progress rows of ``table`` for one dialect."""

    def __init__(self, table: sa.Table, backend: str, dialect: sa.Dialect) -> None:
        self.backend = backend
        self.dialect = dialect
        prep = dialect.identifier_preparer
        self.table = prep.format_table(table)
        self.key_columns = list(table.primary_key.columns)
        columns = [*self.key_columns, *(table.c[name] for name in _VALUE_COLUMNS)]
        self.columns = columns
        self.names = [prep.quote(c.name) for c in columns]
        self.key_names = self.names[: len(self.key_columns)]
        self._head = f"INSERT INTO {self.table} ({', '.join(self.names)})"
        self._tail: str | None = None

    # -- statements -----------------------------------------------------------------------

    def _increase_only(self, stored: str, new: str) -> str:
        return (
            f"{stored}.consume_offset IS NULL OR ({new}.consume_offset IS NOT NULL"
            f" AND {new}.consume_offset >= {stored}.consume_offset)"
        )

    def _on_conflict(self) -> str:
        """The ``ON CONFLICT`` / ``ON DUPLICATE KEY`` clause (built at the first write:
        MySQL's form depends on the server version the dialect learned on connecting)."""
        if self._tail is not None:
            return self._tail
        if self.backend == "mysql":
            # MySQL 8.0.20+ deprecates VALUES() in favour of a row alias; MariaDB has
            # no alias. Assignments run left to right and later ones see earlier
            # results: the guard must be decided before consume_offset changes.
            alias = bool(getattr(self.dialect, "_requires_alias_for_on_duplicate_key", False))

            def new(column: str) -> str:
                return f"new.{column}" if alias else f"VALUES({column})"

            take = (
                f"consume_offset IS NULL OR ({new('consume_offset')} IS NOT NULL"
                f" AND {new('consume_offset')} >= consume_offset)"
            )
            sets = ", ".join(
                f"{c} = IF({take}, {new(c)}, {c})"
                for c in ("stage_offsets", "finished", "consume_offset")
            )
            self._tail = f"{' AS new' if alias else ''} ON DUPLICATE KEY UPDATE {sets}"
        else:
            sets = ", ".join(f"{c} = excluded.{c}" for c in _VALUE_COLUMNS)
            self._tail = (
                f" ON CONFLICT ({', '.join(self.key_names)}) DO UPDATE SET {sets}"
                f" WHERE {self._increase_only(self.table, 'excluded')}"
            )
        return self._tail

    # -- chunks ---------------------------------------------------------------------------

    def statements(self, rows: Sequence[BulkRow]) -> Iterator[tuple[str, Any]]:
        """``(sql, parameters)`` for ``conn.exec_driver_sql``, one per chunk of ``rows``
        (in their order)."""
        if self.backend == "postgresql":
            yield from self._postgresql(rows)
        elif self.backend == "mysql":
            yield from self._mysql(rows)
        else:
            yield from self._sqlite(rows)

    def _postgresql(self, rows: Sequence[BulkRow]) -> Iterator[tuple[str, Any]]:
        casts = ", ".join(self._postgresql_values(self.columns))
        sql = (
            f"{self._head} SELECT {casts}"
            " FROM jsonb_array_elements(CAST(%(rows)s AS jsonb)) AS e"
            f"{self._on_conflict()}"
        )
        dumps = json.JSONEncoder(separators=(",", ":")).encode
        for start in range(0, len(rows), _ROWS_PER_STATEMENT):
            chunk = rows[start : start + _ROWS_PER_STATEMENT]
            yield sql, {"rows": dumps([[*key, c, s, f] for key, c, s, f in chunk])}

    def _sqlite(self, rows: Sequence[BulkRow]) -> Iterator[tuple[str, Any]]:
        width = len(self.columns)
        per = max(1, min(_ROWS_PER_STATEMENT, _sqlite_max_variables() // width))
        one = f"({', '.join('?' * width)})"
        tail = self._on_conflict()
        for start in range(0, len(rows), per):
            chunk = rows[start : start + per]
            params: list[Any] = []
            for key, c, s, f in chunk:
                params.extend(key)
                params += (c, s, f)
            yield f"{self._head} VALUES {', '.join([one] * len(chunk))}{tail}", tuple(params)

    def lock_statements(self, keys: Sequence[tuple[Any, ...]]) -> Iterator[tuple[str, Any]]:
        """``(sql, parameters)`` selecting the key values and fence of the stored rows
        of ``keys``, a chunk per statement, locked for update (SQLite: not locked,
        ``BEGIN IMMEDIATE`` already serializes writers). Rows come back in key
        order within a chunk; a key with no row is not in the result."""
        if self.backend == "postgresql":
            yield from self._postgresql_lock(keys)
        elif self.backend == "mysql":
            yield from self._mysql_lock(keys)
        else:
            yield from self._sqlite_lock(keys)

    def _postgresql_values(self, columns: Sequence[sa.Column[Any]]) -> list[str]:
        """The elements of a JSON array ``e`` as values of ``columns``. Strings stay
        TEXT: a cast to VARCHAR(n) would cut a longer value silently, where the insert
        into the column refuses it."""
        return [
            f"e->>{i}"
            if isinstance(c.type, sa.String)
            else f"CAST(e->>{i} AS {c.type.compile(dialect=self.dialect)})"
            for i, c in enumerate(columns)
        ]

    def _postgresql_lock(self, keys: Sequence[tuple[Any, ...]]) -> Iterator[tuple[str, Any]]:
        p = [f"p.{name}" for name in self.key_names]
        order = ", ".join(p)
        values = self._postgresql_values(self.key_columns)
        on = " AND ".join(f"{column} = {v}" for column, v in zip(p, values, strict=True))
        sql = (
            f"SELECT {order}, p.fence"
            f" FROM jsonb_array_elements(CAST(%(keys)s AS jsonb)) AS e JOIN {self.table} AS p"
            f" ON {on} ORDER BY {order} FOR UPDATE OF p"
        )
        dumps = json.JSONEncoder(separators=(",", ":")).encode
        for start in range(0, len(keys), _ROWS_PER_STATEMENT):
            document = dumps([list(key) for key in keys[start : start + _ROWS_PER_STATEMENT]])
            yield sql, {"keys": document}

    def _mysql_lock(self, keys: Sequence[tuple[Any, ...]]) -> Iterator[tuple[str, Any]]:
        order = ", ".join(f"p.{name}" for name in self.key_names)
        for start in range(0, len(keys), _ROWS_PER_STATEMENT):
            wanted = ",".join(
                f"({','.join(map(_mysql_literal, key))})"
                for key in keys[start : start + _ROWS_PER_STATEMENT]
            )
            sql = (
                f"SELECT {order}, p.fence FROM {self.table} AS p"
                f" WHERE ({order}) IN ({wanted}) ORDER BY {order} FOR UPDATE"
            )
            yield sql, None

    def _sqlite_lock(self, keys: Sequence[tuple[Any, ...]]) -> Iterator[tuple[str, Any]]:
        width = len(self.key_columns)
        per = max(1, min(_ROWS_PER_STATEMENT, _sqlite_max_variables() // width))
        names = [f"k{i}" for i in range(width)]
        on = " AND ".join(
            f"p.{column} = e.{name}" for column, name in zip(self.key_names, names, strict=True)
        )
        one = f"({', '.join('?' * width)})"
        order = ", ".join(f"p.{name}" for name in self.key_names)
        for start in range(0, len(keys), per):
            chunk = keys[start : start + per]
            # CROSS JOIN: each key looked up in the primary key, in this order.
            yield (
                (
                    f"WITH e({', '.join(names)}) AS (VALUES {', '.join([one] * len(chunk))})"
                    f" SELECT {order}, p.fence FROM e CROSS JOIN {self.table} AS p WHERE {on}"
                    f" ORDER BY {order}"
                ),
                tuple(value for key in chunk for value in key),
            )

    def _mysql(self, rows: Sequence[BulkRow]) -> Iterator[tuple[str, Any]]:
        tail = self._on_conflict()
        head = f"{self._head} VALUES "
        values: list[str] = []
        size = len(head) + len(tail)
        # The key's leading values (source, group, topic) repeat from row to row:
        # their literals are written once per commit.
        heads: dict[tuple[Any, ...], str] = {}
        for key, c, s, f in rows:
            lead = key[:-1]
            head_of_row = heads.get(lead)
            if head_of_row is None:
                head_of_row = heads[lead] = "(" + "".join(f"{_mysql_literal(v)}," for v in lead)
            value = (
                f"{head_of_row}{_mysql_literal(key[-1])},{_mysql_literal(c)},"
                f"{_mysql_literal(s)},{_mysql_literal(f)})"
            )
            if values and (
                len(values) >= _ROWS_PER_STATEMENT or size + len(value) > _MYSQL_STATEMENT_CHARS
            ):
                yield head + ",".join(values) + tail, None
                values, size = [], len(head) + len(tail)
            values.append(value)
            size += len(value) + 1
        if values:
            yield head + ",".join(values) + tail, None


def _mysql_literal(value: Any) -> str:
    """``value`` (``None``, an int or a str) as a MariaDB/MySQL literal: a string as
    hexadecimal UTF-8 (``X'...'``), so no escaping depends on the ``sql_mode``
    (``NO_BACKSLASH_ESCAPES``) or the connection's character set."""
    if value is None:
        return "NULL"
    if type(value) is int:
        return str(value)
    if isinstance(value, str):
        return f"X'{value.encode('utf-8').hex()}'"
    raise TypeError(f"no MySQL literal for {value!r}")  # pragma: no cover
