"""Offset store commit cost, per backend, and proof that a commit never blocks handling.

1. Time to persist the progress of 1, 100 and 10,000 queues (each with two stage
   keys) in one ``persist_all``: the first commit (rows inserted) and the steady
   state (every row updated, increase-only upsert), median of ``--repeat`` runs; then
   the steady state when 1 % of the queues moved (the others are as committed), and
   ``persist_fenced`` of every queue (the consumer-group commit: each row's fence
   checked, every row updated). The baseline, measured in the same run, is
   :class:`MemoryOffsetStore` (no I/O).
2. Event-loop responsiveness while 10,000-queue commits run back to back: a ticker
   sleeping 1 ms records how late it wakes up, next to the same ticker on an idle
   loop (the baseline).
3. Handler throughput of a staged :class:`PushConsumer` (no-op async handler,
   ``--messages`` messages on 8 queues) alone, and while 10,000-queue commits run
   back to back on the same event loop.

    python -m benchmarks.store_commit        # or: python benchmarks/store_commit.py
    python -m benchmarks.store_commit --backends sqlite postgres --repeat 5 --json out.json

PostgreSQL and MariaDB URLs come from ``--postgres-url`` / ``--mysql-url`` (defaults:
``STAGEDCONSUMER_TEST_POSTGRES_URL`` / ``STAGEDCONSUMER_TEST_MYSQL_URL`` or this
machine's services); an unreachable server is reported and skipped. Every run uses
fresh tables with a unique prefix and drops them afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script, benchmarks/ comes first on sys.path: put the repository root
    # there instead, so that imports resolve as under ``python -m benchmarks.X``.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import anyio
import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from offsetstore import (
    MemoryOffsetStore,
    OffsetStoreError,
    QueueProgress,
    SqlOffsetStore,
    StageKey,
    StageOffsetStore,
)
from stagedconsumer import (
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PushConsumer,
)

GROUP = "bench"
SIZES = (1, 100, 10_000)
KEYS = (StageKey("default", "a"), StageKey("default", "b"))
BACKENDS = ("memory", "sqlite", "postgres", "mariadb")


def _urls(args: argparse.Namespace, tmp: Path) -> dict[str, str | None]:
    return {
        "memory": None,
        "sqlite": f"sqlite:///{tmp / 'progress.db'}",
        "postgres": args.postgres_url,
        "mariadb": args.mysql_url,
    }


class Backend:
    def __init__(self, name: str, url: str | None) -> None:
        self.name = name
        self.url = url
        self.prefix = f"bench{uuid.uuid4().hex[:8]}_"

    def store(self) -> StageOffsetStore:
        if self.url is None:
            return MemoryOffsetStore()
        return SqlOffsetStore(self.url, table_prefix=self.prefix)

    def drop(self) -> None:
        if self.url is None:
            return
        engine = sa.create_engine(self.url)
        try:
            with engine.begin() as conn:
                for table in ("progress", "schema", "marks"):
                    conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.prefix}{table}"))
        finally:
            engine.dispose()


def _fill(store: StageOffsetStore, queues: Sequence[MessageQueue], base: int) -> None:
    for i, mq in enumerate(queues):
        store.update_progress(
            GROUP,
            mq,
            QueueProgress(
                consume_offset=base + i, stage_offsets={KEYS[0]: base + i, KEYS[1]: base}
            ),
        )


async def _commit_times(backend: Backend, n: int, repeat: int) -> dict[str, float]:
    """First commit, median and best steady-state commit, median commit with 1 % of the
    queues changed and median fenced commit, in seconds, for ``n`` queues."""
    store = backend.store()
    queues = [MessageQueue(f"topic{i % 10}", i // 10) for i in range(n)]
    try:
        await store.load()
        _fill(store, queues, 1000)
        start = time.perf_counter()
        await store.persist_all(GROUP, queues)
        first = time.perf_counter() - start
        steady = []
        for r in range(repeat):
            _fill(store, queues, 2000 + r)
            start = time.perf_counter()
            await store.persist_all(GROUP, queues)
            steady.append(time.perf_counter() - start)
        few = []
        moved = queues[:: max(1, len(queues) // max(1, n // 100))]
        for r in range(repeat):
            for mq in moved:
                store.update_offset(GROUP, mq, 3000 + r)
            start = time.perf_counter()
            await store.persist_all(GROUP, queues)
            few.append(time.perf_counter() - start)
        fenced = []
        tokens = dict.fromkeys(queues, 1)
        for r in range(repeat):
            _fill(store, queues, 4000 + r)
            start = time.perf_counter()
            await store.persist_fenced(GROUP, tokens)
            fenced.append(time.perf_counter() - start)
        stored = await store.list_progress(GROUP, "topic3")
        assert len(stored) == len([q for q in queues if q.topic == "topic3"])
        assert all(
            p.consume_offset is not None and p.consume_offset >= 4000 for p in stored.values()
        )
        return {
            "first_s": first,
            "steady_s": statistics.median(steady),
            "best_s": min(steady),
            "few_s": statistics.median(few),
            "fenced_s": statistics.median(fenced),
        }
    finally:
        await store.aclose()
        backend.drop()


async def _ticker_lag(duration: float, busy: Any = None) -> tuple[float, float]:
    """(p99, max) lateness in ms of a 1 ms sleep loop, while ``busy`` runs."""
    lags: list[float] = []

    async def tick() -> None:
        deadline = time.perf_counter() + duration
        while time.perf_counter() < deadline:
            before = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append((time.perf_counter() - before - 0.001) * 1000)

    async with anyio.create_task_group() as tg:
        if busy is not None:
            tg.start_soon(busy)
        await tick()
        tg.cancel_scope.cancel()
    lags.sort()
    return lags[int(len(lags) * 0.99)], lags[-1]


class _Noop(MessageListenerStagedConcurrently):
    def get_stage_definitions(self) -> Sequence[int]:
        return [50, 100, 200]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        return None


async def _throughput(messages: int, busy: Any = None) -> float:
    broker = MemoryBroker()
    broker.create_topic("t", 8)
    for i in range(messages):
        broker.send("t", b"x", queue_id=i % 8)
    consumer = PushConsumer("tp", broker, _Noop(), options=ConsumerOptions())
    consumer.subscribe("t")
    async with anyio.create_task_group() as tg:
        if busy is not None:
            tg.start_soon(busy)
        start = time.perf_counter()
        async with consumer:
            await consumer.wait_caught_up(timeout=600)
        elapsed = time.perf_counter() - start
        tg.cancel_scope.cancel()
    return messages / elapsed


def _committer(store: StageOffsetStore, counter: list[int]) -> Any:
    """Commits of 10,000 queues back to back (the worst case: a consumer commits once
    per ``persist_consumer_offset_interval``, 5 s by default). The in-memory table is
    filled once, so the loop measures the store, not the caller's ``update_progress``."""
    queues = [MessageQueue(f"topic{i % 10}", i // 10) for i in range(10_000)]
    _fill(store, queues, 10_000)

    async def loop() -> None:
        while True:
            counter[0] += 1  # commits begun (the last one may be cut short)
            await store.persist_all(GROUP, queues)

    return loop


async def _blocking(backend: Backend, args: argparse.Namespace) -> dict[str, Any]:
    store = backend.store()
    try:
        await store.load()
        commits = [0]
        idle = await _ticker_lag(args.lag_seconds)
        busy = await _ticker_lag(args.lag_seconds, _committer(store, commits))
        lag_commits = commits[0]
        alone = await _throughput(args.messages)
        commits[0] = 0
        together = await _throughput(args.messages, _committer(store, commits))
        return {
            "backend": backend.name,
            "lag_idle_p99_ms": idle[0],
            "lag_idle_max_ms": idle[1],
            "lag_committing_p99_ms": busy[0],
            "lag_committing_max_ms": busy[1],
            "commits_during_lag_test": lag_commits,
            "handler_msgs_per_s_alone": alone,
            "handler_msgs_per_s_committing": together,
            "commits_during_throughput_test": commits[0],
        }
    finally:
        await store.aclose()
        backend.drop()


def _reachable(url: str) -> str | None:
    engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except (sa.exc.SQLAlchemyError, OffsetStoreError) as exc:
        return str(exc).splitlines()[0]
    finally:
        engine.dispose()
    return None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="offsetstore-bench-"))
    urls = _urls(args, tmp)
    backends: list[Backend] = []
    for name in args.backends:
        url = urls[name]
        if url is not None and name != "sqlite":
            problem = _reachable(url)
            if problem is not None:
                console.print(f"[yellow]skipping {name}: {problem}[/]")
                continue
        backends.append(Backend(name, url))

    commit_rows: list[dict[str, Any]] = []
    for backend in backends:
        for n in args.sizes:
            times = await _commit_times(backend, n, args.repeat)
            commit_rows.append({"backend": backend.name, "queues": n, **times})
            console.print(
                f"{backend.name:>8} {n:>6} queues: first {times['first_s'] * 1000:8.1f} ms,"
                f" steady median {times['steady_s'] * 1000:8.1f} ms,"
                f" best {times['best_s'] * 1000:8.1f} ms",
                highlight=False,
            )

    table = Table(
        title="persist_all: ms per commit of N queues (first = insert; steady = upsert,"
        f" median / best of {args.repeat}); x memory = steady median / MemoryOffsetStore's;"
        " 1 % changed = steady with 1 % of the queues moved; fenced = persist_fenced, every"
        " row checked and updated (medians)"
    )
    for column in (
        "backend",
        "queues",
        "first ms",
        "steady ms (median / best)",
        "x memory",
        "1 % changed ms",
        "fenced ms",
    ):
        table.add_column(column, justify="left" if column == "backend" else "right")
    memory = {r["queues"]: r["steady_s"] for r in commit_rows if r["backend"] == "memory"}
    for row in commit_rows:
        n = row["queues"]
        ratio = row["steady_s"] / memory[n] if memory.get(n) else float("nan")
        table.add_row(
            row["backend"],
            f"{n:,}",
            f"{row['first_s'] * 1000:,.1f}",
            f"{row['steady_s'] * 1000:,.1f} / {row['best_s'] * 1000:,.1f}",
            f"{ratio:,.1f}",
            f"{row['few_s'] * 1000:,.1f}",
            f"{row['fenced_s'] * 1000:,.1f}",
        )
    console.print(table)

    blocking_rows = []
    if not args.skip_blocking:
        for backend in backends:
            if backend.url is None:
                continue
            backend.prefix = f"bench{uuid.uuid4().hex[:8]}_"
            blocking_rows.append(await _blocking(backend, args))
        table = Table(
            title="Does a 10,000-queue commit block message handling? (commits back to back;"
            " lag = how late a 1 ms sleep wakes up)"
        )
        for column in (
            "backend",
            "lag idle p99 / max ms",
            "lag committing p99 / max ms",
            "commits begun",
            "handler msg/s alone",
            "msg/s committing",
            "commits begun",
        ):
            table.add_column(column, justify="left" if column == "backend" else "right")
        for row in blocking_rows:
            table.add_row(
                row["backend"],
                f"{row['lag_idle_p99_ms']:.2f} / {row['lag_idle_max_ms']:.2f}",
                f"{row['lag_committing_p99_ms']:.2f} / {row['lag_committing_max_ms']:.2f}",
                str(row["commits_during_lag_test"]),
                f"{row['handler_msgs_per_s_alone']:,.0f}",
                f"{row['handler_msgs_per_s_committing']:,.0f}",
                str(row["commits_during_throughput_test"]),
            )
        console.print(table)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *sys.argv[1:]])
    console.print(f"Reproduce: [bold]{command}[/]", highlight=False)
    console.print(
        f"Python {platform.python_version()}, SQLAlchemy {sa.__version__},"
        f" anyio backend {args.backend}, {os.cpu_count()} CPUs",
        highlight=False,
    )
    return {"commit": commit_rows, "blocking": blocking_rows, "command": command}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    parser.add_argument("--repeat", type=int, default=3, help="steady-state commits (3)")
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "STAGEDCONSUMER_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument(
        "--mysql-url",
        default=os.environ.get(
            "STAGEDCONSUMER_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
        ),
    )
    parser.add_argument("--messages", type=int, default=100_000, help="throughput test (100000)")
    parser.add_argument("--lag-seconds", type=float, default=3.0, help="lag test length (3)")
    parser.add_argument("--skip-blocking", action="store_true", help="only time commits")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--json", type=Path, help="also write results as JSON here")
    args = parser.parse_args(argv)
    results = anyio.run(run, args, backend=args.backend)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
