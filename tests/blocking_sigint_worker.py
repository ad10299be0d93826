"""A blocking program (``stagedconsumer.blocking``) whose plain ``def`` handler takes
a while, run as a process by tests/test_blocking.py.

    python -m tests.blocking_sigint_worker BACKEND SHUTDOWN_TIMEOUT HANDLER_SECONDS

Prints ``started`` once the handler runs, and on the way out what the consumer did;
the test sends Ctrl-C (SIGINT). Nothing here touches signal handling: the main thread
waits in ``wait_stopped()`` as a user's service would.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from offsetstore import MemoryOffsetStore
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
)
from stagedconsumer.blocking import BlockingConsumer


class Slow(MessageListenerConcurrently):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def consume_message(self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext) -> None:
        print("started", flush=True)
        time.sleep(self.seconds)  # blocking code: deaf to cancellation


def main(backend: str, shutdown_timeout: float, seconds: float) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    broker.send("t", b"x")
    store = MemoryOffsetStore()
    consumer = PushConsumer(
        "g",
        broker,
        Slow(seconds),
        offset_store=store,
        options=ConsumerOptions(shutdown_timeout=shutdown_timeout),
    )
    consumer.subscribe("t")
    try:
        with BlockingConsumer(consumer, backend=backend) as running:
            running.wait_stopped()
    finally:
        stats = consumer.statistics()
        stored = store._stored.get(store._key("g", MessageQueue("t", 0)))
        print(
            f"left consumed_ok={stats.consumed_ok} abandoned={stats.abandoned_calls}"
            f" committed={None if stored is None else stored.consume_offset}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]))
