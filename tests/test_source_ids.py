"""Every message source names the log it reads (``source_id()``): what offset stores
key progress by. Stable (no credentials, no TLS, nothing per instance), and settable
where the same data may move."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from stagedconsumer import ConfigurationError, MemoryBroker, Message, MessageQueue
from stagedconsumer._sources._redis_broker import RedisBroker
from stagedconsumer._sources._source import MessageSource, PullResult, SendBackResult


def test_redis_identity_is_address_db_and_namespace_without_credentials() -> None:
    plain = RedisBroker("redis://127.0.0.1:6379/0", namespace="shop")
    assert plain.source_id() == "redis://127.0.0.1:6379/0#shop"
    secret = RedisBroker("rediss://app:s3cret@127.0.0.1:6380/2", namespace="shop")
    assert secret.source_id() == "redis://127.0.0.1:6380/2#shop"  # same data over TLS
    assert "s3cret" not in secret.source_id()
    assert RedisBroker("redis://localhost").source_id() == "redis://localhost:6379/0#sc"
    cluster = RedisBroker("redis://10.0.0.5:7000", namespace="x", cluster=True)
    assert cluster.source_id() == "redis-cluster://10.0.0.5:7000#x"
    assert RedisBroker("unix:///tmp/r.sock?db=3").source_id() == "unix:///tmp/r.sock?db=3#sc"
    other = RedisBroker("redis://127.0.0.1:6379/0", namespace="fresh")
    assert other.source_id() != plain.source_id()


def test_a_source_id_given_replaces_the_address() -> None:
    moved = RedisBroker("redis://new-host:6379/0", source_id="redis://old-host:6379/0#sc")
    assert moved.source_id() == "redis://old-host:6379/0#sc"
    long = RedisBroker("redis://h", source_id="x" * 500).source_id()
    assert len(long) <= 191
    assert long == RedisBroker("redis://h", source_id="x" * 500).source_id()  # stable
    assert long != RedisBroker("redis://h", source_id="x" * 499 + "y").source_id()


def test_the_embedded_broker_is_named() -> None:
    assert MemoryBroker().source_id() == "memory://embedded"
    assert MemoryBroker().source_id() == MemoryBroker().source_id()  # across instances
    assert MemoryBroker(name="replay").source_id() == "memory://replay"


def test_kafka_identity_is_its_bootstrap_servers() -> None:
    from stagedconsumer import KafkaBroker

    broker = KafkaBroker(["b:9092", "a:9092"])
    assert broker.source_id() == "kafka://a:9092,b:9092"
    assert KafkaBroker("a:9092", source_id="kafka://prod").source_id() == "kafka://prod"


class _Own(MessageSource):
    async def get_queues(self, topic: str) -> Sequence[MessageQueue]:
        return []

    async def pull(
        self, mq: MessageQueue, offset: int, max_count: int, *, timeout: float = 0.0
    ) -> PullResult:
        return PullResult(messages=[], next_offset=offset, max_offset=0)

    async def max_offset(self, mq: MessageQueue) -> int:
        return 0

    async def send_back(
        self, group: str, message: Message, *, delay_level: int = 0, max_reconsume_times: int = 16
    ) -> SendBackResult:
        return SendBackResult.RETRY

    async def send_to_dlq(self, group: str, message: Message) -> None:
        pass


def test_a_source_of_ones_own_is_named_by_its_class() -> None:
    assert _Own().source_id() == "source://tests.test_source_ids._Own"


def test_an_empty_source_id_is_refused() -> None:
    from stagedconsumer._sources._source import source_id_of

    with pytest.raises(ConfigurationError):
        source_id_of("")
