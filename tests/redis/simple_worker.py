"""One SimpleConsumer process of a group, for the multi-process pop tests.

    python -m tests.redis.simple_worker CONFIG_JSON

Receives from topic ``t`` over RedisBroker and acks every message, appending lines
to a log shared by every worker (``O_APPEND``, one ``write`` per line, fsynced), so a
SIGKILL loses nothing that happened:

    recv <msg_id> <delivery_attempt> <pid>     after a receive returned it
    acking <msg_id> <pid>                      before its ack is sent
    acked <msg_id> <pid>                       after the ack succeeded
    refused <msg_id> <pid>                     the ack was refused (expired)

Prints ``READY`` once started.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import anyio
import anyio.lowlevel

from stagedconsumer import InvalidReceiptHandleError, SimpleConsumer, SimpleConsumerOptions
from stagedconsumer._sources._redis_broker import RedisBroker


async def main(config: dict[str, Any]) -> None:
    fd = os.open(config["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.getpid()

    def log(line: str) -> None:
        os.write(fd, f"{line} {pid}\n".encode())
        os.fsync(fd)

    options = SimpleConsumerOptions(fifo=config["fifo"], max_delivery_attempts=1000)
    async with RedisBroker(config["url"], namespace=config["namespace"]) as broker:
        consumer = SimpleConsumer(
            "g", broker, subscriptions={"t": "*"}, await_duration=0.5, options=options
        )
        async with consumer:
            print("READY", flush=True)
            while True:
                for m in await consumer.receive(4, config["invisible"]):
                    log(f"recv {m.msg_id} {m.delivery_attempt}")
                    await anyio.lowlevel.checkpoint()
                    log(f"acking {m.msg_id}")
                    try:
                        await consumer.ack(m)
                    except InvalidReceiptHandleError:
                        log(f"refused {m.msg_id}")
                    else:
                        log(f"acked {m.msg_id}")


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    anyio.run(main, cfg, backend=cfg["backend"])
