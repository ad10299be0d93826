"""Exactly-once effects: ``context.transact`` against a hand-written idempotent insert.

Two handlers write one row per message into a table of PostgreSQL, the database of the
consumer's ``SqlOffsetStore``:

- ``transact``: ``await context.transact(fn)``, where ``fn`` inserts the call's rows in
  the transaction that also writes the messages' finished marks and checks the
  queue's fence (one transaction per handler call);
- ``ON CONFLICT``: what a user writes by hand for idempotency: the rows inserted with
  ``INSERT ... ON CONFLICT (message id) DO NOTHING`` in a transaction of its own, in a
  worker thread (one transaction per handler call too).

Each consumes the same backlog from the embedded broker at batch sizes 1 and 32, the
cases alternating (best of ``--repeat`` per case: the machine is shared). Reported:
wall time per message (from start to every message finished), and the ratio of
``transact`` to ``ON CONFLICT`` at each batch size.

    python -m benchmarks.exactly_once                          # 2,000 messages, 8 queues
    python -m benchmarks.exactly_once --messages 5000 --repeat 5
    python -m benchmarks.exactly_once --url postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import anyio
import anyio.to_thread
import sqlalchemy as sa
from rich.console import Console
from rich.table import Table
from sqlalchemy.dialects import postgresql

from benchmarks._reproduce import print_reproduce
from offsetstore import SqlOffsetStore
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    PushConsumer,
)

TOPIC = "bench"
DEFAULT_URL = os.environ.get(
    "STAGEDCONSUMER_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def effects_table(prefix: str) -> sa.Table:
    return sa.Table(
        f"{prefix}effects",
        sa.MetaData(),
        sa.Column("message_id", sa.String(64), primary_key=True),
        sa.Column("body", sa.LargeBinary, nullable=False),
    )


class Transact(MessageListenerConcurrently):
    def __init__(self, table: sa.Table) -> None:
        self.insert = sa.insert(table)

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        rows = [{"message_id": m.msg_id, "body": m.body} for m in msgs]
        await context.transact(lambda connection: connection.execute(self.insert, rows))


class OnConflict(MessageListenerConcurrently):
    def __init__(self, table: sa.Table, engine: sa.Engine) -> None:
        self.engine = engine
        self.insert = postgresql.insert(table).on_conflict_do_nothing(index_elements=["message_id"])

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        rows = [{"message_id": m.msg_id, "body": m.body} for m in msgs]

        def write() -> None:
            with self.engine.begin() as connection:
                connection.execute(self.insert, rows)

        await anyio.to_thread.run_sync(write)


async def run_case(
    url: str, handler: str, batch: int, messages: int, queues: int, workers: int
) -> float:
    """Seconds to consume ``messages`` with ``handler`` at batch size ``batch``."""
    prefix = f"bench{uuid.uuid4().hex[:8]}_"
    table = effects_table(prefix)
    engine = sa.create_engine(url, pool_size=workers, max_overflow=0)
    with engine.begin() as connection:
        table.create(connection)
    broker = MemoryBroker()
    broker.create_topic(TOPIC, queues)
    for i in range(messages):
        broker.send(TOPIC, b"x" * 16, queue_id=i % queues)
    store = SqlOffsetStore(
        url, table_prefix=prefix, engine_options={"pool_size": workers, "max_overflow": 0}
    )
    listener: Any = Transact(table) if handler == "transact" else OnConflict(table, engine)
    options = ConsumerOptions(
        consume_thread_max=workers,
        consume_message_batch_max_size=batch,
        persist_consumer_offset_interval=1.0,
    )
    try:
        async with store:
            consumer = PushConsumer("bench", broker, listener, offset_store=store, options=options)
            consumer.subscribe(TOPIC)
            start = time.perf_counter()
            async with consumer:
                await consumer.wait_caught_up()
                elapsed = time.perf_counter() - start
        with engine.connect() as connection:
            count = connection.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
        if count != messages:
            raise RuntimeError(f"{handler}: {count} rows for {messages} messages")
        return elapsed
    finally:
        with engine.begin() as connection:
            for name in ("effects", "progress", "schema", "marks"):
                connection.execute(sa.text(f"DROP TABLE IF EXISTS {prefix}{name}"))
        engine.dispose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default=DEFAULT_URL, help="PostgreSQL SQLAlchemy URL")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument("--workers", type=int, default=8, help="consume_thread_max")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the best counts")
    args = parser.parse_args(argv)
    cases = [(h, b) for b in (1, 32) for h in ("transact", "ON CONFLICT")]
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.repeat):
        for handler, batch in cases:  # alternating: load changes hit every case alike
            seconds = anyio.run(
                run_case,
                args.url,
                "transact" if handler == "transact" else "on_conflict",
                batch,
                args.messages,
                args.queues,
                args.workers,
            )
            key = (handler, batch)
            best[key] = min(best.get(key, float("inf")), seconds)
    console = Console()
    table = Table(
        title=f"One row per message on PostgreSQL, {args.messages:,} messages,"
        f" {args.queues} queues, {args.workers} workers (best of {args.repeat})"
    )
    for column in ("handler", "batch", "µs/message", "messages/s", "vs ON CONFLICT"):
        table.add_column(column, justify="left" if column == "handler" else "right")
    for handler, batch in cases:
        seconds = best[(handler, batch)]
        ratio = seconds / best[("ON CONFLICT", batch)]
        table.add_row(
            handler,
            str(batch),
            f"{seconds / args.messages * 1e6:,.0f}",
            f"{args.messages / seconds:,.0f}",
            f"{ratio:.2f}x",
        )
    console.print(table)
    print_reproduce(console, "exactly_once", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
