"""SimpleWorker applications for ``stagedconsumer run`` (tests/test_run_simple.py).

Settings come from ``STAGEDCONSUMER_TEST_RUN`` (JSON): ``gate`` (a file each handler
call waits for, written by the test), ``free`` (bodies below it do not wait),
``shutdown_timeout``, ``messages``.

- ``gated``: an ``@asynccontextmanager`` yielding a SimpleWorker over the embedded
  broker; each handler call logs ``handling <body>`` then waits for the gate. Its
  tear-down logs the consumer's counts, after the worker left: ``received=R acked=A
  handed_back=H``.
- ``sync_gated``: the same with a plain ``def`` handler.
- ``bare``: a SimpleConsumer with no worker.
- ``worker``: a SimpleWorker built on import (before the event loop runs), whose
  handler logs ``handled <body>``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from stagedconsumer import MemoryBroker, ReceivedMessage, SimpleConsumer, SimpleWorker

logger = logging.getLogger("tests.run_simple_apps")


def _config() -> dict[str, Any]:
    return dict(json.loads(os.environ.get("STAGEDCONSUMER_TEST_RUN", "{}")))


def _consumer(messages: int) -> SimpleConsumer:
    broker = MemoryBroker()
    broker.create_topic("t", 2)
    for n in range(messages):
        broker.send("t", b"%d" % n)
    return SimpleConsumer("g", broker, subscriptions={"t": "*"}, await_duration=0.2)


@contextlib.asynccontextmanager
async def _run(sync: bool) -> AsyncIterator[SimpleWorker]:
    config = _config()
    gate = Path(config["gate"])
    consumer = _consumer(config.get("messages", 20))
    free = config.get("free", 0)

    async def handle(message: ReceivedMessage) -> None:
        logger.warning("handling %s", message.body.decode())
        while (
            int(message.body) >= free and not await anyio.Path(gate).exists()
        ):  # written by the test
            await anyio.sleep(0.02)

    def handle_sync(message: ReceivedMessage) -> None:
        logger.warning("handling %s", message.body.decode())
        while int(message.body) >= free and not gate.exists():
            time.sleep(0.02)

    worker = SimpleWorker(
        consumer,
        handle_sync if sync else handle,
        concurrency=4,
        batch=2,
        invisible_duration=600,
        shutdown_timeout=config.get("shutdown_timeout", 600.0),
    )
    try:
        yield worker
    finally:
        counts = consumer._counts
        logger.warning(
            "received=%d acked=%d handed_back=%d",
            counts["received"],
            counts["acked"],
            counts["nacked"],
        )


def gated() -> contextlib.AbstractAsyncContextManager[SimpleWorker]:
    return _run(sync=False)


def sync_gated() -> contextlib.AbstractAsyncContextManager[SimpleWorker]:
    return _run(sync=True)


def bare() -> SimpleConsumer:
    return _consumer(1)


async def _log_it(message: ReceivedMessage) -> None:
    logger.warning("handled %s", message.body.decode())


worker = SimpleWorker(_consumer(3), _log_it)
