"""One consumer process of a Kafka consumer group, for the kill test (a subprocess).

    python -m tests.kafka.group_worker CONFIG_JSON

Consumes a topic over KafkaBroker with the staged listener of the Redis group tests
(``tests.redis.group_worker``: same stages, same fsynced event log of handler starts
and ends) and a SqlOffsetStore shared by the group (Tansu 0.6 drops commit metadata,
so stage offsets cannot travel in Kafka's commits there). Prints ``READY
<client_id>`` once started; leaves gracefully on SIGTERM.
"""

from __future__ import annotations

import sys
from typing import Any

from offsetstore import SqlOffsetStore
from stagedconsumer import ConsumerOptions, KafkaBroker, PushConsumer
from tests.redis.group_worker import (
    EventLog,
    LoggingStagedListener,
    run_worker,
    serve_until_sigterm,
)


async def run(config: dict[str, Any]) -> None:
    log = EventLog(config["log"])
    async with KafkaBroker(
        config["bootstrap"], session_timeout=6.0, heartbeat_interval=0.5, rebalance_timeout=10.0
    ) as broker:
        consumer = PushConsumer(
            config["group"],
            broker,
            LoggingStagedListener(log, config["cost"]),
            offset_store=(store := SqlOffsetStore(config["store_url"])),
            options=ConsumerOptions(
                persist_consumer_offset_interval=0.2,
                pull_long_polling_timeout=0.5,
                pull_time_delay_when_exception=0.2,
                shutdown_timeout=10.0,
            ),
        )
        consumer.subscribe(config["topic"])
        await serve_until_sigterm(consumer, store)


if __name__ == "__main__":
    run_worker(run, sys.argv)
