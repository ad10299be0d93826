from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.lowlevel
import pytest

from stagedconsumer import (
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerStagedConcurrently,
    PushConsumer,
)

pytestmark = pytest.mark.anyio


class Recorder(MessageListenerStagedConcurrently):
    def __init__(self) -> None:
        self.stages: dict[int, int] = {}

    def get_stage_definitions(self) -> Sequence[int]:
        return [10, 20, 70]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        for m in msgs:
            self.stages[m.queue_offset] = context.stage_index
        await anyio.lowlevel.checkpoint()


async def test_rip22_example_assigns_stages() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for _ in range(110):
        broker.send("t", b"x", queue_id=0)
    listener = Recorder()
    consumer = PushConsumer("g", broker, listener)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    expected = {o: 0 if o < 10 else 1 if o < 30 else 2 if o < 100 else -1 for o in range(110)}
    assert listener.stages == expected
