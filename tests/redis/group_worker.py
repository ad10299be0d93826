"""One consumer process of a group, for the failover tests (run as a subprocess).

    python -m tests.redis.group_worker CONFIG_JSON

Consumes a topic over RedisBroker with a staged listener and a SqlOffsetStore, and
appends one line per handler start and end to its event log, fsynced before the
handler goes on, so a SIGKILL loses nothing that happened:

    S <queue_id> <offset> <stage_index> <time> <pid>
    E <queue_id> <offset> <stage_index> <time> <pid>

and, with ``"log_takeovers": true`` in the config, one line per queue it takes:

    T <queue_id> <offset> <epoch> <time> <pid>

Prints ``READY <client_id>`` once started; leaves gracefully on SIGTERM. Optional
``"consumer_options"`` in the config are passed on to ``ConsumerOptions`` (for
example the gray release settings). With ``"effects_table"``, each handler call
inserts one row per message (queue id, offset, pid) into that table through
``context.transact_blocking`` (exactly-once effects), writing its ``E`` lines inside
the transaction. SIGUSR1 dumps every thread's stack to standard error.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import anyio
import sqlalchemy as sa

from offsetstore import SqlOffsetStore, StageOffsetStore
from stagedconsumer import (
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    GroupOptions,
    Message,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PushConsumer,
)
from stagedconsumer._sources._redis_broker import RedisBroker

STAGES = (40, 80, 120)


class EventLog:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def write(self, kind: str, message: Message, stage: int) -> None:
        at = time.time()
        line = f"{kind} {message.queue_id} {message.queue_offset} {stage} {at:.6f} {self._pid}\n"
        with self._lock:
            os.write(self._fd, line.encode())
            os.fsync(self._fd)


class TakeoverLog(logging.Handler):
    """Writes a ``T`` line when the consumer logs that it took a queue."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, record: logging.LogRecord) -> None:
        if " took " not in record.msg or not isinstance(record.args, tuple):
            return
        # the arguments of the consumer's "group %s: %s took %s at offset %d (epoch %d)"
        took = cast("tuple[str, str, MessageQueue, int, int]", record.args)
        _group, _client, mq, offset, epoch = took
        line = f"T {mq.queue_id} {offset} {epoch} {time.time():.6f} {os.getpid()}\n"
        os.write(self._fd, line.encode())
        os.fsync(self._fd)


class LoggingStagedListener(MessageListenerStagedConcurrently):
    """Sleeps ``cost`` seconds (jittered) per message, logging start and end."""

    def __init__(self, log: EventLog, cost: float) -> None:
        self._log = log
        self._cost = cost

    def get_stage_definitions(self) -> Sequence[int]:
        return STAGES

    def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        for message in msgs:
            self._log.write("S", message, context.stage_index)
        time.sleep(self._cost * random.uniform(0.5, 1.5))
        for message in msgs:
            self._log.write("E", message, context.stage_index)


class TransactingStagedListener(LoggingStagedListener):
    """:class:`LoggingStagedListener` whose calls commit an effect row per message
    with their messages' finished marks."""

    def __init__(self, log: EventLog, cost: float, table: str) -> None:
        super().__init__(log, cost)
        self._insert = sa.insert(
            sa.table(table, sa.column("queue_id"), sa.column("queue_offset"), sa.column("pid"))
        )

    def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        for message in msgs:
            self._log.write("S", message, context.stage_index)
        time.sleep(self._cost * random.uniform(0.5, 1.5))
        rows = [
            {"queue_id": m.queue_id, "queue_offset": m.queue_offset, "pid": os.getpid()}
            for m in msgs
        ]

        def effects(connection: sa.Connection) -> None:
            connection.execute(self._insert, rows)
            for message in msgs:  # before the commit: never later than the finish
                self._log.write("E", message, context.stage_index)

        context.transact_blocking(effects)


async def serve_until_sigterm(consumer: PushConsumer, store: StageOffsetStore) -> None:
    """Run ``consumer`` (printing ``READY <client_id>`` once started) until SIGTERM,
    then leave gracefully; ``store`` is closed at the end. Shared by the group
    workers of every broker (``tests.kafka.group_worker``)."""
    stop = anyio.Event()

    async def on_sigterm() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                stop.set()
                return

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(on_sigterm)
            async with consumer:
                print(f"READY {consumer.client_id}", flush=True)
                await stop.wait()
            tg.cancel_scope.cancel()
    finally:
        await store.aclose()


def run_worker(run: Callable[[dict[str, Any]], Awaitable[None]], argv: Sequence[str]) -> None:
    """``run(config)`` with the JSON config of ``argv[1]``, logging at INFO, on the
    config's ``"backend"`` (asyncio by default); SIGUSR1 dumps every thread's stack."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = json.loads(argv[1])
    anyio.run(run, config, backend=config.get("backend", "asyncio"))


async def run(config: dict[str, Any]) -> None:
    group_options = GroupOptions(**config["group_options"])
    log = EventLog(config["log"])
    if config.get("log_takeovers"):
        logging.getLogger("stagedconsumer").addHandler(TakeoverLog(config["log"]))
    async with RedisBroker(
        config["redis_url"],
        namespace=config["namespace"],
        group_options=group_options,
        cluster=config.get("cluster", False),
    ) as broker:
        store = SqlOffsetStore(config["store_url"], table_prefix=config["table_prefix"])
        consumer = PushConsumer(
            config["group"],
            broker,
            (
                TransactingStagedListener(log, config["cost"], config["effects_table"])
                if config.get("effects_table")
                else LoggingStagedListener(log, config["cost"])
            ),
            offset_store=store,
            options=ConsumerOptions(
                persist_consumer_offset_interval=config["persist_interval"],
                consume_thread_max=config.get("threads", 20),
                pull_long_polling_timeout=1.0,
                pull_time_delay_when_exception=0.2,
                shutdown_timeout=10.0,
                **config.get("consumer_options", {}),
            ),
        )
        consumer.subscribe(config["topic"])
        await serve_until_sigterm(consumer, store)


if __name__ == "__main__":
    run_worker(run, sys.argv)
