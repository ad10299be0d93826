"""A staged consumer process for the crash-resume test (``tests/test_crash_resume.py``).

Run as ``python -m tests.crash_resume_worker --store URL --prefix P --log PATH --run N``.
Every start fills a fresh :class:`MemoryBroker` with the same seeded messages, so
the source has the same content at every start; progress lives in a
:class:`SqlOffsetStore`. The process appends one JSON line per event to ``--log``
(``O_APPEND``, one ``write`` per line, ``fsync`` after each), so after a SIGKILL the
log holds everything that happened before it:

- ``run``: the process started (run number, anyio backend);
- ``resume``: the progress the consumer read from the store for a queue;
- ``start`` / ``fail`` / ``done``: a handler call began, raised, succeeded;
- ``persisted``: a persist transaction committed (after the commit returned);
- ``finished``: the consumer caught up and shut down cleanly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from offsetstore import QueueProgress, SqlOffsetStore, StageKey
from stagedconsumer import (
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PushConsumer,
)

SEED = 22
TOPIC = "orders"
GROUP = "crash-resume"
QUEUES = 4
PER_QUEUE = 100
STAGES = (3, 4, 6)
"""Per stage key (one per order key): stages of 3, 4 and 6 messages, then the tail."""
KEYS = ("k0", "k1")


def content(seed: int = SEED) -> list[list[dict[str, Any]]]:
    """The messages of every queue, the same at every start: key, cost, failure."""
    rng = random.Random(seed)
    return [
        [
            {
                "key": rng.choice(KEYS),
                "ms": rng.randint(2, 20),
                "fail_first": rng.random() < 0.06,
            }
            for _ in range(PER_QUEUE)
        ]
        for _ in range(QUEUES)
    ]


class Log:
    def __init__(self, path: str, run: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.run = run

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ev": event, "run": self.run, **fields}, separators=(",", ":"))
        os.write(self.fd, (line + "\n").encode())
        os.fsync(self.fd)


def _stage_offsets_json(offsets: Mapping[StageKey, int]) -> dict[str, int]:
    return {f"{k.strategy_id}|{k.group_id}": v for k, v in offsets.items()}


class LoggingStore(SqlOffsetStore):
    """Logs what was read at start and what each persist committed."""

    def __init__(self, url: str, prefix: str, log: Log) -> None:
        super().__init__(url, table_prefix=prefix)
        self.log = log

    async def _read_stored(self, group: str, mq: MessageQueue) -> QueueProgress | None:
        value = await super()._read_stored(group, mq)
        self.log.write(
            "resume",
            q=mq.queue_id,
            c=value.consume_offset if value else None,
            so=_stage_offsets_json(value.stage_offsets) if value else {},
        )
        return value

    async def _write_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress]
    ) -> None:
        await super()._write_stored(group, progress)
        for mq, value in progress.items():
            self.log.write(
                "persisted",
                q=mq.queue_id,
                c=value.consume_offset,
                so=_stage_offsets_json(value.stage_offsets),
            )


class Listener(MessageListenerStagedConcurrently):
    """Staged: one stage sequence per order key; logs every call."""

    def __init__(self, log: Log) -> None:
        self.log = log

    def get_stage_definitions(self) -> Sequence[int]:
        return STAGES

    def compute_group(self, msg: Message) -> str | None:
        return msg.keys[0]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        (msg,) = msgs
        spec = json.loads(msg.body)
        fields = {
            "q": msg.queue_id,
            "o": msg.queue_offset,
            "stage": context.stage_index,
            "sg": context.group_id,
            "attempt": msg.reconsume_times,
        }
        self.log.write("start", **fields)
        await anyio.sleep(spec["ms"] / 1000)
        if spec["fail_first"] and msg.reconsume_times == 0:
            self.log.write("fail", **fields)
            context.suspend_current_queue_time_millis = 10
            raise RuntimeError("first attempt fails")
        self.log.write("done", **fields)


async def run(args: argparse.Namespace) -> None:
    log = Log(args.log, args.run)
    log.write("run", pid=os.getpid(), backend=args.backend)
    broker = MemoryBroker()
    broker.create_topic(TOPIC, QUEUES)
    for queue_id, messages in enumerate(content()):
        for spec in messages:
            broker.send(TOPIC, json.dumps(spec).encode(), keys=(spec["key"],), queue_id=queue_id)
    store = LoggingStore(args.store, args.prefix, log)
    consumer = PushConsumer(
        GROUP,
        broker,
        Listener(log),
        offset_store=store,
        options=ConsumerOptions(
            consume_thread_max=8, persist_consumer_offset_interval=args.persist_interval
        ),
    )
    consumer.subscribe(TOPIC)
    try:
        async with consumer:
            await consumer.wait_caught_up(timeout=60)
    finally:
        await store.aclose()
    log.write("finished")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store", required=True)
    parser.add_argument("--prefix", default="stagedconsumer_")
    parser.add_argument("--log", required=True)
    parser.add_argument("--run", type=int, required=True)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--persist-interval", type=float, default=0.05)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the planned handler failures are noise here
    anyio.run(run, args, backend=args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
