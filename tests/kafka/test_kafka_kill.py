"""Three consumer processes in one Kafka consumer group, one SIGKILLed mid-stream:
Kafka's session timeout ends its membership, its partitions move to the others at
the progress it committed, nothing is lost and stages and their barrier hold."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from benchmarks._tansu import TansuServer
from stagedconsumer import Producer
from tests.kafka.conftest import new_broker
from tests.redis._events import check_stages_and_barrier, read_events

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
QUEUES = 6
PER_QUEUE = 150


def _wait(condition: object, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def _produce(tansu: TansuServer, name: str) -> None:
    async with new_broker(tansu) as broker:
        await broker.create_topic(name, QUEUES)
        async with Producer(broker) as producer:
            for q in range(QUEUES):
                for i in range(PER_QUEUE):
                    await producer.send(name, b"%d" % i, queue_id=q)


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_killed_or_paused_member_loses_nothing_and_stages_hold(
    tansu: TansuServer, name: str, tmp_path: Path, how: str
) -> None:
    """``kill``: SIGKILL. ``stop``: SIGSTOP past the session timeout, then SIGCONT: a
    zombie whose partitions Kafka gave to the others meanwhile; it must hand out no
    batch of them (its grants lapse without Kafka's confirmation) and Kafka refuses
    its commits (old generation)."""
    anyio.run(_produce, tansu, name, backend="asyncio")
    config = {
        "bootstrap": tansu.bootstrap,
        "topic": name,
        "group": name,
        "store_url": f"sqlite:///{tmp_path / 'progress.db'}",
        "cost": 0.01,
    }
    logs = [tmp_path / f"events-{i}.log" for i in range(3)]
    procs: list[subprocess.Popen[str]] = []
    try:
        for i, log in enumerate(logs):
            with open(tmp_path / f"stderr-{i}.log", "w") as stderr:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "tests.kafka.group_worker",
                            json.dumps(dict(config, log=str(log))),
                        ],
                        cwd=ROOT,
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        text=True,
                    )
                )
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("READY"), "a worker did not start"
        # the victim is consuming (Kafka gave it partitions) and the others too
        _wait(
            lambda: all(any(e.kind == "E" for e in read_events([log])) for log in logs),
            "all 3 consuming",
        )
        if how == "kill":
            procs[0].kill()
            procs[0].wait()
        else:
            procs[0].send_signal(signal.SIGSTOP)
            time.sleep(10)  # the session timeout is 6 s
            procs[0].send_signal(signal.SIGCONT)
        done = QUEUES * PER_QUEUE

        def finished() -> int:
            return len({(e.queue, e.offset) for e in read_events(logs) if e.kind == "E"})

        _wait(lambda: finished() >= done, f"{done} messages finished")
        alive = procs[1:] if how == "kill" else procs
        for proc in alive:
            proc.send_signal(signal.SIGTERM)
        for proc in alive:
            log = tmp_path / f"stderr-{procs.index(proc)}.log"
            assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    events = read_events(logs)
    assert {e.pid for e in events if e.kind == "E"} >= {procs[0].pid}
    check_stages_and_barrier(events, queues=QUEUES, per_queue=PER_QUEUE)
