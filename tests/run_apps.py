"""Applications for ``stagedconsumer run`` on the embedded broker (tests/test_run.py).

Each factory reads its settings from ``STAGEDCONSUMER_TEST_RUN`` (JSON):

- ``gated``: an ``async def`` factory that waits for the file ``start_gate`` before it
  returns its consumer (so ``/readyz`` can be seen while starting); the handler logs
  ``handler started`` and waits for the file ``handler_gate`` (so a shutdown can be
  seen while it drains).
- ``stuck``: one message whose plain-``def`` handler blocks for ten minutes.
- ``several``: a producer and a consumer, from a plain function.
- ``lifespan``: an ``@asynccontextmanager`` function yielding a producer and a consumer.
- ``main``: an ``async def`` that runs its consumer itself until cancelled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    Producer,
    PushConsumer,
)

logger = logging.getLogger("tests.run_apps")


def _config() -> dict[str, Any]:
    return dict(json.loads(os.environ.get("STAGEDCONSUMER_TEST_RUN", "{}")))


class Gated(MessageListenerConcurrently):
    def __init__(self, gate: Path) -> None:
        self.gate = gate

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        logger.warning("handler started")
        while not await anyio.Path(self.gate).exists():  # written by the test
            await anyio.sleep(0.02)


class Stuck(MessageListenerConcurrently):
    def consume_message(self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext) -> None:
        logger.warning("handler started")
        time.sleep(600)


def _consumer(listener: MessageListenerConcurrently, messages: int = 1) -> PushConsumer:
    broker = MemoryBroker()
    broker.create_topic("t", 2)
    for _ in range(messages):
        broker.send("t", b"x")
    consumer = PushConsumer("g", broker, listener, options=ConsumerOptions(shutdown_timeout=600.0))
    consumer.subscribe("t")
    return consumer


async def gated() -> PushConsumer:
    config = _config()
    start_gate = Path(config["start_gate"])
    while not await anyio.Path(start_gate).exists():  # written by the test
        await anyio.sleep(0.02)
    return _consumer(Gated(Path(config["handler_gate"])))


def stuck() -> PushConsumer:
    return _consumer(Stuck())


def several() -> tuple[Producer, PushConsumer]:
    consumer = _consumer(Gated(Path(os.devnull)), messages=0)
    return Producer(consumer.source, group="p"), consumer


def needs_arguments(name: str) -> PushConsumer:
    raise AssertionError("never called")


def returns_nothing() -> None:
    return None


NOT_RUNNABLE = 42


@contextlib.asynccontextmanager
async def lifespan() -> AsyncIterator[list[object]]:
    """Set-up and tear-down around the consumers it yields (not started: the run
    starts them after the set-up and stops them before the tear-down)."""
    logger.warning("set up")
    consumer = _consumer(Gated(Path(os.devnull)), messages=3)
    try:
        yield [Producer(consumer.source, group="p"), consumer]
    finally:
        logger.warning("torn down (consumer closed: %s)", consumer._state.closed)


async def main() -> None:
    """A program's own ``main``: it runs its consumer itself until it is cancelled."""
    consumer = _consumer(Gated(Path(os.devnull)), messages=3)
    async with consumer:
        logger.warning("main running")
        await anyio.sleep_forever()


def with_a_stray_item() -> list[object]:
    return [_consumer(Gated(Path(os.devnull))), "orders"]


def nothing_to_run() -> list[object]:
    return []
