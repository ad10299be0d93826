"""``stagedconsumer offsets init``: the schema created (or migrated) apart from the
consumers, or printed for a DBA (``--sql``); a least-privilege role runs a consumer."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import sqlalchemy as sa

from offsetstore import QueueProgress, SqlOffsetStore
from stagedconsumer import (
    MemoryBroker,
    MessageListenerStagedConcurrently,
    MessageQueue,
    Producer,
    PushConsumer,
)
from stagedconsumer._cli import main
from tests.offsetstore.conftest import Backend, _backend_fixture, drop_tables

MQ = MessageQueue("orders", 0)


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # each line of output on one line


def _count(url: str, query: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.exec_driver_sql(query).scalar_one())
    finally:
        engine.dispose()


def _run_sql(url: str, text: str) -> None:
    statements = [
        "\n".join(line for line in chunk.splitlines() if not line.startswith("--")).strip()
        for chunk in text.split(";\n")
    ]
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            for statement in statements:
                if statement:
                    conn.exec_driver_sql(statement)
    finally:
        engine.dispose()


async def _round_trip(url: str, prefix: str) -> QueueProgress | None:
    store = SqlOffsetStore(url, table_prefix=prefix, create_tables=False)
    try:
        await store.load()
        assert await store.claim("g", MQ, 5) is None
        store.update_progress("g", MQ, QueueProgress(consume_offset=3))
        await store.persist_fenced("g", {MQ: 5})
        return (await store.list_progress("g"))[MQ]
    finally:
        await store.aclose()


def test_init_creates_the_tables_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'progress.db'}"
    init = ["offsets", "init", "--store", url, "--table-prefix", "x_"]
    assert main(init) == 0
    out = capsys.readouterr().out
    assert "created table x_schema" in out
    assert "created table x_progress" in out
    assert "created table x_marks" in out
    assert "recorded schema version 4 in x_schema" in out
    assert anyio.run(_round_trip, url, "x_") == QueueProgress(consume_offset=3)
    assert main(init) == 0
    assert "nothing to do: tables x_schema, x_progress and x_marks are at schema version 4" in (
        capsys.readouterr().out
    )


def test_init_migrates_an_older_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'progress.db'}"
    assert main(["offsets", "init", "--store", url]) == 0
    _run_sql(
        url,
        "ALTER TABLE stagedconsumer_progress DROP COLUMN fence;\n"
        "UPDATE stagedconsumer_schema SET version = 1;\n",
    )
    capsys.readouterr()
    assert main(["offsets", "init", "--store", url]) == 0
    out = capsys.readouterr().out
    assert "migrated the tables from schema version 1 to 4" in out
    assert "created" not in out
    assert anyio.run(_round_trip, url, "stagedconsumer_") == QueueProgress(consume_offset=3)


def test_init_needs_a_store_or_sql(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["offsets", "init"]) == 1
    assert "give --store URL" in capsys.readouterr().err
    assert main(["offsets", "init", "--sql"]) == 1
    assert "--dialect" in capsys.readouterr().err


@pytest.mark.anyio
async def test_sql_creates_tables_a_store_without_create_tables_uses(
    sql_backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    """The printed SQL, run by hand, gives tables the store reads and writes."""
    assert sql_backend.url is not None
    prefix = sql_backend.prefix
    args = ["offsets", "init", "--sql", "--store", sql_backend.url, "--table-prefix", prefix]
    assert await anyio.to_thread.run_sync(main, args) == 0
    text = capsys.readouterr().out
    assert f"CREATE TABLE {prefix}progress" in text
    _run_sql(sql_backend.url, text)
    assert await _round_trip(sql_backend.url, prefix) == QueueProgress(consume_offset=3)


@pytest.mark.parametrize("dialect", ["postgresql", "mysql", "mariadb", "sqlite"])
def test_sql_of_each_dialect_without_a_database(
    dialect: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["offsets", "init", "--sql", "--dialect", dialect]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "CREATE TABLE stagedconsumer_schema" in out
    assert (
        "INSERT INTO stagedconsumer_schema (component, version) VALUES ('offsetstore', 4);" in out
    )
    assert "CREATE TABLE stagedconsumer_marks" in out
    if dialect == "sqlite":
        assert "GRANT" not in out
        return
    assert "-- GRANT SELECT, INSERT, UPDATE ON stagedconsumer_progress TO ROLE;" in out
    assert main([*args, "--grant-to", "app"]) == 0
    out = capsys.readouterr().out
    assert "\nGRANT SELECT ON stagedconsumer_schema TO app;\n" in out
    assert "\nGRANT SELECT, INSERT, UPDATE ON stagedconsumer_progress TO app;\n" in out
    assert "\nGRANT SELECT, INSERT, DELETE ON stagedconsumer_marks TO app;\n" in out
    if dialect != "postgresql":
        assert "VARBINARY(1020)" in out  # exact names, as the store makes them there


@pytest.fixture
async def postgres_backend(tmp_path: Path) -> AsyncIterator[Backend]:
    async for value in _backend_fixture("postgres", tmp_path):
        yield value


class _Listener(MessageListenerStagedConcurrently):
    def get_stage_definitions(self) -> list[int]:
        return [1]

    async def consume_message(self, msgs: object, context: object) -> None:
        pass


@pytest.mark.postgres
@pytest.mark.anyio
async def test_a_least_privilege_role_runs_a_consumer_after_init(
    postgres_backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tables made by ``offsets init`` (as their owner); then a role with only
    SELECT, INSERT and UPDATE on them runs a consumer, which commits its progress."""
    assert postgres_backend.url is not None
    admin_url, prefix = postgres_backend.url, postgres_backend.prefix
    role = f"sc_app_{uuid.uuid4().hex[:10]}"
    init = ["offsets", "init", "--store", admin_url, "--table-prefix", prefix]
    assert await anyio.to_thread.run_sync(main, init) == 0
    assert "created table" in capsys.readouterr().out
    sql = ["offsets", "init", "--sql", "--dialect", "postgresql", "--table-prefix", prefix,
           "--grant-to", role]  # fmt: skip
    assert await anyio.to_thread.run_sync(main, sql) == 0
    grants = [line for line in capsys.readouterr().out.splitlines() if line.startswith("GRANT")]
    assert len(grants) == 3  # the schema, the progress and the marks tables
    _run_sql(admin_url, f"CREATE ROLE {role} LOGIN;\n" + "\n".join(grants) + "\n")
    try:
        role_url = sa.make_url(admin_url).set(username=role, password=None)
        broker = MemoryBroker()
        broker.create_topic("orders", 2)
        async with Producer(broker) as producer:
            for i in range(20):
                await producer.send("orders", b"x", keys=[f"k{i}"])
        store = SqlOffsetStore(role_url, table_prefix=prefix)
        try:
            consumer = PushConsumer("g", broker, _Listener(), offset_store=store)
            consumer.subscribe("orders")
            async with consumer:
                await consumer.wait_caught_up()
            # an exactly-once effect's mark (INSERT on marks), folded by the next
            # commit (DELETE on marks)
            mq = MessageQueue("orders", 0)
            done = await store.read_progress("g", mq)
            assert done is not None
            assert done.consume_offset is not None
            await store.transact("g", mq, [done.consume_offset], lambda connection: None)
            store.update_progress("g", mq, QueueProgress(consume_offset=done.consume_offset + 1))
            await store.persist_all("g", [mq])
        finally:
            await store.aclose()
        reader = SqlOffsetStore(role_url, table_prefix=prefix, read_only=True)
        try:
            progress = await reader.list_progress("g")
        finally:
            await reader.aclose()
        assert sum(p.consume_offset or 0 for p in progress.values()) == 21
        assert _count(admin_url, f"SELECT count(*) FROM {prefix}marks") == 0
        # the role could not have made the tables itself
        engine = sa.create_engine(role_url)
        try:
            with (
                pytest.raises(sa.exc.ProgrammingError, match="permission denied"),
                engine.begin() as conn,
            ):
                conn.exec_driver_sql(f"CREATE TABLE {prefix}probe (x INT)")
        finally:
            engine.dispose()
    finally:
        drop_tables(admin_url, prefix)
        _run_sql(admin_url, f"DROP OWNED BY {role};\nDROP ROLE {role};\n")
