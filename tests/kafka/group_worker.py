"""One consumer process of a Kafka consumer group, for the kill test (a subprocess).

    python -m tests.kafka.group_worker CONFIG_JSON

Consumes a topic over KafkaBroker with the staged listener of the Redis group tests
(``tests.redis.group_worker``: same stages, same fsynced event log of handler starts
and ends) and a SqlOffsetStore shared by the group (Tansu 0.6 drops commit metadata,
so stage offsets cannot travel in Kafka's commits there). Prints ``READY
<client_id>`` once started; leaves gracefully on SIGTERM.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from offsetstore import SqlOffsetStore
from stagedconsumer import ConsumerOptions, KafkaBroker, PushConsumer
from tests.redis.group_worker import EventLog, LoggingStagedListener


async def run(config: dict[str, Any]) -> None:
    stop = anyio.Event()

    async def on_sigterm() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                stop.set()
                return

    log = EventLog(config["log"])
    async with KafkaBroker(
        config["bootstrap"], session_timeout=6.0, heartbeat_interval=0.5, rebalance_timeout=10.0
    ) as broker:
        store = SqlOffsetStore(config["store_url"])
        consumer = PushConsumer(
            config["group"],
            broker,
            LoggingStagedListener(log, config["cost"]),
            offset_store=store,
            options=ConsumerOptions(
                persist_consumer_offset_interval=0.2,
                pull_long_polling_timeout=0.5,
                pull_time_delay_when_exception=0.2,
                shutdown_timeout=10.0,
            ),
        )
        consumer.subscribe(config["topic"])
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(on_sigterm)
                async with consumer:
                    print(f"READY {consumer.client_id}", flush=True)
                    await stop.wait()
                tg.cancel_scope.cancel()
        finally:
            await store.aclose()


def main(argv: Sequence[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    anyio.run(run, json.loads(argv[1]), backend="asyncio")


if __name__ == "__main__":
    main(sys.argv)
