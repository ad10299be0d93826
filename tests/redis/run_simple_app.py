"""A SimpleWorker application for ``stagedconsumer run`` over Redis
(tests/redis/test_run_simple.py).

    STAGEDCONSUMER_TEST_RUN=CONFIG_JSON stagedconsumer run tests.redis.run_simple_app:make

Each handler call appends ``S <body> <attempt> <pid>`` when it starts and ``E <body>
<attempt> <pid>`` when it ends (one ``write`` each, ``O_APPEND``, fsynced: a SIGKILL
loses no line), sleeping ``cost`` seconds in between.
"""

from __future__ import annotations

import json
import os

import anyio

from stagedconsumer import ReceivedMessage, SimpleConsumer, SimpleWorker
from stagedconsumer._sources._redis_broker import RedisBroker


def make() -> list[object]:
    config = json.loads(os.environ["STAGEDCONSUMER_TEST_RUN"])
    path, cost, pid = config["log"], config["cost"], os.getpid()

    def log(kind: str, message: ReceivedMessage) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(
                fd, f"{kind} {message.body.decode()} {message.delivery_attempt} {pid}\n".encode()
            )
            os.fsync(fd)
        finally:
            os.close(fd)

    async def handle(message: ReceivedMessage) -> None:
        log("S", message)
        await anyio.sleep(cost)
        log("E", message)

    broker = RedisBroker(config["redis_url"], namespace=config["namespace"])
    consumer = SimpleConsumer("jobs", broker, subscriptions={"t": "*"}, await_duration=0.5)
    worker = SimpleWorker(
        consumer,
        handle,
        concurrency=4,
        batch=4,
        invisible_duration=config["invisible"],
        shutdown_timeout=30,
    )
    return [broker, worker]
