"""A consumer application for ``stagedconsumer run``, as users write one (tests/redis/test_run.py).

    STAGEDCONSUMER_TEST_RUN=CONFIG_JSON stagedconsumer run tests.redis.run_app:make

``make`` returns the broker, the offset store and the consumer, which the command
enters in that order and leaves in the reverse. The handler is group_worker's: staged,
sleeping ``cost`` seconds per message, appending ``S``/``E`` lines to the event log.
"""

from __future__ import annotations

import json
import os

from offsetstore import SqlOffsetStore
from stagedconsumer import ConsumerOptions, GroupOptions, PushConsumer
from stagedconsumer._sources._redis_broker import RedisBroker

from .group_worker import EventLog, LoggingStagedListener


def make() -> list[object]:
    config = json.loads(os.environ["STAGEDCONSUMER_TEST_RUN"])
    broker = RedisBroker(
        config["redis_url"],
        namespace=config["namespace"],
        group_options=GroupOptions(**config.get("group_options", {})),
    )
    store = SqlOffsetStore(config["store_url"], table_prefix=config["table_prefix"])
    consumer = PushConsumer(
        config["group"],
        broker,
        LoggingStagedListener(EventLog(config["log"]), config["cost"]),
        offset_store=store,
        options=ConsumerOptions(
            persist_consumer_offset_interval=config.get("persist_interval", 5.0),
            consume_thread_max=config.get("threads", 4),
            pull_long_polling_timeout=1.0,
            pull_time_delay_when_exception=0.2,
            shutdown_timeout=config.get("shutdown_timeout", 30.0),
        ),
    )
    consumer.subscribe(config["topic"])
    return [broker, store, consumer]
