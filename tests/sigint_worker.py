"""A consumer whose plain-``def`` handler blocks, run as a process by tests/test_lifecycle.py.

    python -m tests.sigint_worker BACKEND SHUTDOWN_TIMEOUT HANDLER_SECONDS

Prints ``started`` once the handler is running and ``left`` when leaving
``async with`` returned; the test sends Ctrl-C (SIGINT) and times both that and
the exit. Nothing here touches signal handling: the process behaves as a user's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import anyio

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    PushConsumer,
)


class Blocking(MessageListenerConcurrently):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def consume_message(self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext) -> None:
        print("started", flush=True)
        time.sleep(self.seconds)  # blocking code: deaf to cancellation


async def main(shutdown_timeout: float, seconds: float) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    broker.send("t", b"x")
    consumer = PushConsumer(
        "g", broker, Blocking(seconds), options=ConsumerOptions(shutdown_timeout=shutdown_timeout)
    )
    consumer.subscribe("t")
    try:
        async with consumer:
            await anyio.sleep_forever()
    finally:
        print(f"left abandoned={consumer.statistics().abandoned_calls}", flush=True)


if __name__ == "__main__":
    backend, timeout, handler_seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    anyio.run(main, timeout, handler_seconds, backend=backend)
