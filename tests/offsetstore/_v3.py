"""Tables of offset store schema version 3 (before the source column), as that
version created them, for migration tests."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as mysql_dialect

from offsetstore._sql import _name_column


def _text() -> sa.types.TypeEngine[str]:
    return sa.Text().with_variant(mysql_dialect.MEDIUMTEXT(), "mysql", "mariadb")


def create_v3(
    url: str,
    prefix: str,
    rows: Sequence[dict[str, object]] = (),
    marks: Sequence[dict[str, object]] = (),
) -> None:
    """Create the three tables of schema version 3 with ``prefix`` at ``url``, record
    version 3, and insert progress ``rows`` and finished ``marks`` (dicts of columns)."""
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
        sa.Column("consumer_group", _name_column(255), primary_key=True),
        sa.Column("topic", _name_column(255), primary_key=True),
        sa.Column("queue_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("consume_offset", sa.BigInteger, nullable=True),
        sa.Column("stage_offsets", _text(), nullable=False),
        sa.Column("fence", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("finished", _text(), nullable=True),
        mysql_engine="InnoDB",
    )
    marks_table = sa.Table(
        f"{prefix}marks",
        metadata,
        sa.Column("consumer_group", _name_column(255), primary_key=True),
        sa.Column("topic", _name_column(255), primary_key=True),
        sa.Column("queue_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("queue_offset", sa.BigInteger, primary_key=True, autoincrement=False),
        mysql_engine="InnoDB",
    )
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            metadata.create_all(conn)
            conn.execute(sa.insert(schema).values(component="offsetstore", version=3))
            if rows:
                conn.execute(sa.insert(progress), list(rows))
            if marks:
                conn.execute(sa.insert(marks_table), list(marks))
    finally:
        engine.dispose()
