"""KafkaBroker: Kafka topics as a message source, over aiokafka (asyncio).

Each partition of a topic is a message queue (``topic#partition``); its offsets are
Kafka's. Pulls read through one fetching consumer per broker object (no group, manual
assignment, a seek whenever a pull asks for another offset than the one after the
last pull), so that every pull returns the records at the offset asked for; the
offsets of a partition's ends and of a timestamp are asked through another consumer
that fetches nothing (see :meth:`KafkaBroker._clients`); group membership goes through
Kafka's own consumer groups (:class:`KafkaCoordinator`), and progress into the group's
offset commits (:class:`KafkaOffsetStore`).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import attrs
import sniffio

from .._core import DELAY_LEVELS, retry_delay_seconds
from .._exceptions import ConfigurationError, InvalidMessageError, SourceError, UnknownTopicError
from .._message import Message, MessageQueue, OutgoingMessage
from .._observability._traceparent import with_traceparent
from ._kafka_codec import (
    TopicNames,
    decode_records,
    delay_until_ms,
    encode_headers,
    poison_entry,
)
from ._kafka_group import KafkaCoordinator, KafkaOffsetStore
from ._selectors import MessageQueueSelector
from ._source import (
    DLQ_PREFIX,
    RETRY_PREFIX,
    MessageSource,
    PullResult,
    SendBackResult,
    UndecodableEntry,
    dlq_topic,
    is_spent,
    origin_properties,
    retry_topic,
    source_id_of,
)

if TYPE_CHECKING:
    from offsetstore import StageOffsetStore

__all__ = ("KafkaBroker", "KafkaBrokerStatistics", "SelectMessageQueueByKafkaKey")

_TOPIC_CACHE_SECONDS = 30.0
_FETCH_MS = 1000
"""How long a pull with a shorter timeout waits for a fetch when records may be
stored (the partition's end is not known, or is past the offset asked for)."""


@attrs.frozen(kw_only=True)
class KafkaBrokerStatistics:
    """A snapshot of a :class:`KafkaBroker`'s counters."""

    pulls: int
    """Pulls answered."""
    seeks: int
    """Pulls that had to move the fetching consumer (another offset than the last
    pull's next one)."""
    metadata_overflows: int
    """Stage keys left out of offset commits whose metadata would have passed
    ``metadata_limit`` bytes (their stage assignment is not kept)."""
    finished_overflows: int
    """Sparse progress: finished ranges left out of offset commits whose metadata
    would have passed ``metadata_limit`` bytes (their messages come again after a
    hand-over)."""
    metadata_rejections: int
    """Commits the broker refused as ``OFFSET_METADATA_TOO_LARGE`` (``metadata_limit``
    is above its ``offset.metadata.max.bytes``): each lowered the limit (Kafka's
    default 4096 first, then halves) and the commit was made again with less
    metadata."""
    metadata_missing: int
    """Commits read back without this project's metadata: made by another Kafka
    client, or by a broker that does not keep commit metadata (Tansu 0.6 does not):
    their stage offsets are unknown."""
    retry_paused: int
    """Retry partitions paused now: their head is not due yet, nothing is fetched
    from them until it is."""


class SelectMessageQueueByKafkaKey(MessageQueueSelector):
    """The partition Kafka's Java producer (and aiokafka's) chooses for a keyed record:
    ``murmur2(key) & 0x7fffffff % partitions``. The key is ``arg`` when it is a
    ``str`` or ``bytes``, else the message's first key. Pass it to
    ``Producer.send(..., selector=SelectMessageQueueByKafkaKey())`` so that records
    sent here land where other Kafka producers put the same key (the producer's own
    default, the first key's ``stable_hash``, does not)."""

    def select(
        self, queues: Sequence[MessageQueue], message: OutgoingMessage, arg: object
    ) -> MessageQueue:
        from aiokafka.partitioner import murmur2

        key = arg if isinstance(arg, (str, bytes)) else (message.keys[0] if message.keys else None)
        if key is None:
            raise InvalidMessageError("SelectMessageQueueByKafkaKey needs a key (or a str arg)")
        data = key.encode() if isinstance(key, str) else key
        index: int = (murmur2(data) & 0x7FFFFFFF) % len(queues)
        return queues[index]


class _Ahead:
    """Messages fetched ahead for one partition, served to the pulls that follow."""

    __slots__ = ("messages", "offset", "start")

    def __init__(self, messages: list[Message]) -> None:
        self.messages = messages
        self.start = 0
        """The first message not yet served."""
        self.offset = -1
        """The offset the next pull must ask for to be served from here."""

    def __bool__(self) -> bool:
        return self.start < len(self.messages)

    def take(self, offset: int, max_count: int, high: int | None) -> PullResult:
        start = self.start
        end = start + max_count
        taken = self.messages[start:end]
        self.start = min(end, len(self.messages))
        next_offset = taken[-1].queue_offset + 1 if taken else offset
        self.offset = next_offset
        return PullResult(
            messages=taken,
            next_offset=next_offset,
            max_offset=max(high if high is not None else 0, next_offset),
        )


def _require_asyncio(what: str) -> None:
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = "none"
    if library != "asyncio":
        raise ConfigurationError(
            f"{what} runs on asyncio only: its client, aiokafka, is built on asyncio"
            f" (this is {library}). Run the consumer with anyio.run(..., backend='asyncio')."
        )


def _kafka_error(exc: BaseException) -> SourceError:
    retriable = bool(getattr(exc, "retriable", False)) or isinstance(exc, OSError)
    return SourceError(f"Kafka: {type(exc).__name__}: {exc}", retriable=retriable)


class KafkaBroker(MessageSource):
    """Kafka topics as a message source: partitions are message queues.

    ``bootstrap_servers`` is where the cluster is (``"host:port"`` or a list);
    ``client_options`` go to every aiokafka client made here (security settings,
    ``request_timeout_ms``, ...). Clients connect on first use, in the running
    event loop, which must be asyncio: aiokafka has no trio support (a consumer of
    this broker under trio raises :class:`~stagedconsumer.ConfigurationError`).

    Consumer groups are Kafka consumer groups (the consumer's group name is the
    ``group.id``): Kafka's group coordinator assigns partitions, and a member's
    progress goes into the group's offset commits, the stage offsets in the commit's
    metadata (see :class:`KafkaOffsetStore`). Topics keep their names; a group's
    retry topic is ``<retry_prefix><group>`` and its dead-letter topic
    ``<dlq_prefix><group>``, made on first use: the retry topic with
    ``retry_partitions`` partitions per delay level (18 levels), the dead-letter
    topic with ``retry_partitions`` partitions. A message handed back goes to a
    partition of its delay level, so every retry partition holds records of one delay
    in the order they are due; a retry partition whose head is not due is paused
    (nothing fetched from it) until it is.

    - ``session_timeout``, ``heartbeat_interval``: the group member's session (Kafka:
      ``session.timeout.ms``, ``heartbeat.interval.ms``).
    - ``rebalance_timeout``: how long a rebalance waits for members to rejoin, which
      bounds how long a revoked partition may take to drain and commit (Kafka:
      ``max.poll.interval.ms``, the rebalance timeout of the JoinGroup request).
    - ``metadata_limit``: the longest commit metadata written (Kafka's
      ``offset.metadata.max.bytes``, 4096 by default). Set above the broker's own
      limit, the commit refused (``OFFSET_METADATA_TOO_LARGE``) is made again with
      less metadata (4096, then halves) and counted in
      ``statistics().metadata_rejections``.
    - ``read_ahead`` (default 256): a pull that calls into the client takes up to
      this many records of its partition; the pulls that follow on from it are
      served from them. Each consumed partition holds up to ``read_ahead - 1``
      messages beyond the consumer's own ``pull_threshold_for_queue``; aiokafka's
      fetch buffer (``max_partition_fetch_bytes``, 1 MiB) comes on top. Measured
      (8 partitions): 256 costs about 10% less CPU per message than 500, whose
      4,000 messages held ahead set off Python's garbage collector about 12 times
      as often.
    """

    groups_span_processes: ClassVar[bool] = True

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str] = "127.0.0.1:9092",
        *,
        client_options: Mapping[str, Any] | None = None,
        retry_prefix: str = "stagedconsumer-retry.",
        dlq_prefix: str = "stagedconsumer-dlq.",
        retry_partitions: int = 1,
        session_timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        rebalance_timeout: float = 60.0,
        metadata_limit: int = 4096,
        read_ahead: int = 256,
        source_id: str | None = None,
    ) -> None:
        if isinstance(bootstrap_servers, str):
            bootstrap_servers = [bootstrap_servers]
        if not bootstrap_servers:
            raise ConfigurationError("bootstrap_servers must name at least one broker")
        if retry_partitions < 1:
            raise ConfigurationError(f"retry_partitions must be >= 1, got {retry_partitions}")
        self.bootstrap_servers = list(bootstrap_servers)
        """Where the cluster is (``host:port`` of one or more brokers)."""
        self._source_id = source_id_of(
            source_id
            if source_id is not None
            else "kafka://" + ",".join(sorted(self.bootstrap_servers))
        )
        self.client_options = dict(client_options or {})
        """Passed to every aiokafka client made here."""
        self.names = TopicNames(retry_prefix, dlq_prefix)
        """How the retry and dead-letter topics of a group are named."""
        self.retry_partitions = retry_partitions
        """Partitions per delay level of a retry topic (and of a dead-letter topic)."""
        self.session_timeout = session_timeout
        """Seconds (Kafka's ``session.timeout.ms``)."""
        self.heartbeat_interval = heartbeat_interval
        """Seconds (Kafka's ``heartbeat.interval.ms``)."""
        self.rebalance_timeout = rebalance_timeout
        """Seconds a rebalance waits for members to rejoin (``max.poll.interval.ms``)."""
        self.metadata_limit = metadata_limit
        """The longest commit metadata written, in bytes."""
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ConfigurationError(f"read_ahead must be an int >= 0, got {read_ahead!r}")
        self.read_ahead = read_ahead
        """Records a pull that calls into the client takes of its partition, at most."""
        self._admin: Any = None
        self._fetcher: Any = None
        self._lookup: Any = None
        self._producer: Any = None
        self._starting: anyio.Lock | None = None
        self._locks: dict[Any, anyio.Lock] = {}
        self._positions: dict[Any, int] = {}
        self._ahead: dict[Any, _Ahead] = {}
        self._assigned: set[Any] = set()
        self._topics: dict[str, tuple[float, int]] = {}
        self._tps: dict[MessageQueue, Any] = {}
        self._waiting: dict[Any, tuple[int, float]] = {}
        """Paused retry partitions: the offset of their head and when it is due (s)."""
        self._coordinator: KafkaCoordinator | None = None
        self._store: StageOffsetStore | None = None
        self._closed = False
        self.pulls = 0
        """Pulls served (as in :meth:`statistics`)."""
        self.seeks = 0
        """Times the fetch position of a partition was moved."""
        self.metadata_overflows = 0
        """Commits whose stage offsets did not fit ``metadata_limit`` whole."""
        self.finished_overflows = 0
        """Commits whose finished ranges did not fit ``metadata_limit`` whole."""
        self.metadata_rejections = 0
        """Commits refused as ``OFFSET_METADATA_TOO_LARGE`` (see statistics)."""
        self._metadata_cap: int | None = None
        """The longest metadata the broker is known to accept, once it refused longer
        (``None``: ``metadata_limit``; 0: none)."""
        self.metadata_missing = 0
        """Committed offsets read back without the metadata written with them."""

    # -- clients ----------------------------------------------------------------------

    def _options(self, **extra: Any) -> dict[str, Any]:
        return {"bootstrap_servers": self.bootstrap_servers, **self.client_options, **extra}

    async def _clients(self) -> tuple[Any, Any, Any]:
        """The admin client, the fetching consumer and the producer (started once).

        Offset look-ups (ListOffsets) go through a consumer of their own,
        :attr:`_lookup`, started with them and never assigned a partition. On the
        fetching consumer they would wait: once a partition is assigned to it (by a
        pull), aiokafka keeps a fetch of it open in the background, and a broker
        answers the requests of one connection in order, so a look-up waited for that
        fetch's long poll (``fetch_max_wait_ms``, 500 ms). A consumer taking over its
        partitions after a pull on the same broker object asks for offsets of each:
        at 18 retry partitions and more, the takeover outlasted the lease of the
        partitions it was granted, which were lost again, round after round."""
        if self._producer is not None:
            return self._admin, self._fetcher, self._producer
        _require_asyncio("KafkaBroker")
        if self._closed:
            raise SourceError("the KafkaBroker is closed", retriable=False)
        if self._starting is None:
            self._starting = anyio.Lock()
        async with self._starting:
            if self._producer is None:
                from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
                from aiokafka.admin import AIOKafkaAdminClient

                admin = AIOKafkaAdminClient(**self._options())
                fetcher = AIOKafkaConsumer(
                    **self._options(enable_auto_commit=False, auto_offset_reset="none")
                )
                lookup = AIOKafkaConsumer(**self._options(enable_auto_commit=False))
                producer = AIOKafkaProducer(**self._options(acks="all"))
                try:
                    await admin.start()
                    await fetcher.start()
                    await lookup.start()
                    await producer.start()
                except Exception as exc:
                    for client in (producer, lookup, fetcher):
                        await client.stop()
                    await admin.close()
                    raise _kafka_error(exc) from exc
                self._admin, self._fetcher, self._lookup = admin, fetcher, lookup
                self._producer = producer
        return self._admin, self._fetcher, self._producer

    async def aclose(self) -> None:
        self._closed = True
        if self._coordinator is not None:
            await self._coordinator.aclose()
        admin, fetcher, producer = self._admin, self._fetcher, self._producer
        lookup = self._lookup
        self._admin = self._fetcher = self._lookup = self._producer = None
        if producer is not None:
            await producer.stop()
        if lookup is not None:
            await lookup.stop()
        if fetcher is not None:
            await fetcher.stop()
        if admin is not None:
            await admin.close()

    async def __aenter__(self) -> KafkaBroker:
        await self._clients()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- topics -----------------------------------------------------------------------

    async def create_topic(
        self, topic: str, partitions: int = 4, replication_factor: int = 1
    ) -> None:
        """Create ``topic`` with ``partitions`` partitions (for tests and demos; an
        existing topic stays as it is)."""
        from aiokafka.admin import NewTopic
        from aiokafka.errors import TopicAlreadyExistsError

        admin, _, _ = await self._clients()
        name = self.names.kafka(topic)
        try:
            response = await admin.create_topics([NewTopic(name, partitions, replication_factor)])
        except TopicAlreadyExistsError:
            return
        except Exception as exc:
            raise _kafka_error(exc) from exc
        for _topic, code, *_rest in getattr(response, "topic_errors", ()):
            if code not in (0, TopicAlreadyExistsError.errno):
                raise SourceError(f"Kafka: cannot create topic {name!r} (error {code})")
        self._topics.pop(name, None)

    async def _partition_count(self, kafka_topic: str) -> int | None:
        cached = self._topics.get(kafka_topic)
        now = time.monotonic()
        if cached is not None and now - cached[0] < _TOPIC_CACHE_SECONDS:
            return cached[1]
        admin, _, _ = await self._clients()
        try:
            # listed first: a describe of a missing topic creates it on brokers that
            # create topics automatically (auto.create.topics.enable)
            if kafka_topic not in await admin.list_topics():
                return None
            described = await admin.describe_topics([kafka_topic])
        except Exception as exc:
            raise _kafka_error(exc) from exc
        for entry in described:
            if entry.get("topic") == kafka_topic and entry.get("error_code", 0) == 0:
                count = len(entry.get("partitions", ()))
                if count:
                    self._topics[kafka_topic] = (now, count)
                    return count
        return None

    async def get_queues(self, topic: str) -> Sequence[MessageQueue]:
        name = self.names.kafka(topic)
        count = await self._partition_count(name)
        if count is None and topic.startswith((RETRY_PREFIX, DLQ_PREFIX)):
            levels = len(DELAY_LEVELS) if topic.startswith(RETRY_PREFIX) else 1
            await self.create_topic(topic, levels * self.retry_partitions)
            count = await self._partition_count(name)
        if count is None:
            raise UnknownTopicError(f"topic {topic!r} does not exist in Kafka ({name!r})")
        return [MessageQueue(topic, i) for i in range(count)]

    # -- reading ----------------------------------------------------------------------

    def _tp(self, mq: MessageQueue) -> Any:
        tp = self._tps.get(mq)
        if tp is None:  # made once per queue: every pull asks
            from aiokafka import TopicPartition

            tp = self._tps[mq] = TopicPartition(self.names.kafka(mq.topic), mq.queue_id)
        return tp

    def _lock(self, tp: Any) -> anyio.Lock:
        lock = self._locks.get(tp)
        if lock is None:
            lock = self._locks[tp] = anyio.Lock()
        return lock

    async def pull(
        self, mq: MessageQueue, offset: int, max_count: int, *, timeout: float = 0.0
    ) -> PullResult:
        """Up to ``max_count`` messages from ``offset``. A fetch takes up to
        ``read_ahead`` records; the pulls that follow on from it are served from what
        it took, without a call into the client."""
        tp = self._tp(mq)
        offset = max(offset, 0)
        ahead = self._ahead.get(tp)
        if ahead is not None and ahead.offset == offset and self._fetcher is not None:
            result = ahead.take(offset, max_count, self._fetcher.highwater(tp))
            if not ahead:
                del self._ahead[tp]
            return result
        _, fetcher, _ = await self._clients()
        if tp in self._waiting and not await self._head_due(fetcher, tp, offset, timeout):
            high = fetcher.highwater(tp)  # the head at offset is stored: the end is past it
            return PullResult(
                messages=(), next_offset=offset, max_offset=max(high or 0, offset + 1)
            )
        async with self._lock(tp):
            self.pulls += 1
            ahead = self._ahead.pop(tp, None)
            if ahead is not None and ahead.offset == offset:  # filled while we waited
                result = ahead.take(offset, max_count, fetcher.highwater(tp))
                if ahead:
                    self._ahead[tp] = ahead
                return result
            is_retry = mq.topic.startswith(RETRY_PREFIX)
            count = max_count if is_retry else max(max_count, self.read_ahead)
            records, high = await self._fetch(fetcher, tp, offset, count, timeout)
            if records is None:  # offset out of range: high is where to go on
                return PullResult(messages=(), next_offset=high, max_offset=high)
            if records and is_retry:
                records = self._due(fetcher, tp, records)
            if not records:
                return PullResult(messages=(), next_offset=offset, max_offset=max(high, offset))
            bad: list[tuple[Any, Exception]] = []
            messages = decode_records(mq.topic, mq.queue_id, tp.topic, records, bad)
            if bad:
                return self._poisoned(mq, tp, records[:max_count], high)
            ahead = _Ahead(messages)
            result = ahead.take(offset, max_count, high)
            if ahead:
                self._ahead[tp] = ahead
            return result

    def _poisoned(self, mq: MessageQueue, tp: Any, records: list[Any], high: int) -> PullResult:
        """A pull whose records hold poison records: the messages and the poison
        records among ``records`` (no read-ahead; the next pull seeks)."""
        bad: list[tuple[Any, Exception]] = []
        messages = decode_records(mq.topic, mq.queue_id, tp.topic, records, bad)
        self._positions.pop(tp, None)
        next_offset = records[-1].offset + 1
        return PullResult(
            messages=messages,
            next_offset=next_offset,
            max_offset=max(high, next_offset),
            undecodable=[poison_entry(mq.topic, mq.queue_id, tp.topic, r, e) for r, e in bad],
        )

    async def _fetch(
        self, fetcher: Any, tp: Any, offset: int, count: int, timeout: float
    ) -> tuple[list[Any] | None, int]:
        """Up to ``count`` records of ``tp`` from ``offset`` and the high watermark;
        ``(None, next offset)`` when ``offset`` is out of range."""
        from aiokafka.errors import (
            IllegalStateError,
            KafkaError,
            NoOffsetForPartitionError,
            OffsetOutOfRangeError,
        )

        try:
            if tp not in self._assigned:
                self._assign(fetcher, tp)
            if self._positions.get(tp) != offset:
                self.seeks += 1
                fetcher.seek(tp, offset)
                self._positions[tp] = offset
            try:
                wait_ms = int(timeout * 1000)
                fetched = await fetcher.getmany(tp, timeout_ms=wait_ms, max_records=count)
                high = fetcher.highwater(tp)
                if not fetched and wait_ms < _FETCH_MS and (high is None or offset < high):
                    # records may be stored that no fetch has brought yet: a pull
                    # without (or with a short) wait still gets them
                    fetched = await fetcher.getmany(tp, timeout_ms=_FETCH_MS, max_records=count)
            except (NoOffsetForPartitionError, IllegalStateError):
                # another pull assigned a partition meanwhile: seek and go on
                fetcher.seek(tp, offset)
                self._positions[tp] = offset
                fetched = {}
            except OffsetOutOfRangeError:
                self._positions.pop(tp, None)
                first = (await self._lookup.beginning_offsets([tp]))[tp]
                end = (await self._lookup.end_offsets([tp]))[tp]
                return None, first if offset < first else end
        except KafkaError as exc:
            self._positions.pop(tp, None)
            raise _kafka_error(exc) from exc
        records = [r for r in fetched.get(tp, ()) if r.offset >= offset]
        if records and self._positions.get(tp) == offset:
            self._positions[tp] = records[-1].offset + 1
        high = fetcher.highwater(tp)
        return records, high if high is not None else offset

    def _assign(self, fetcher: Any, tp: Any) -> None:
        """Add ``tp`` to the fetcher's partitions. Those already read keep their
        positions (seeks right after the reassignment, in the same step)."""
        self._assigned.add(tp)
        fetcher.assign(sorted(self._assigned))
        for other, position in list(self._positions.items()):
            if other in self._assigned:
                fetcher.seek(other, position)
        waiting = [other for other in self._waiting if other in self._assigned]
        if waiting:  # a new assignment resumes every partition
            fetcher.pause(*waiting)

    def _due(self, fetcher: Any, tp: Any, records: list[Any]) -> list[Any]:
        """The records of a retry partition up to the first not yet due; from that
        one on the partition is paused (the fetcher fetches nothing of it) until its
        due time (:meth:`_head_due`)."""
        now_ms = time.time() * 1000
        for i, record in enumerate(records):
            due = delay_until_ms(record)
            if due is not None and due > now_ms:
                self._positions.pop(tp, None)  # the fetcher read past it: seek back next time
                self._waiting[tp] = (record.offset, due / 1000)
                fetcher.pause(tp)
                return records[:i]
        return records

    async def _head_due(self, fetcher: Any, tp: Any, offset: int, timeout: float) -> bool:
        """Whether a pull of the paused retry partition ``tp`` at ``offset`` goes on
        to fetch: after waiting (at most ``timeout``, without any fetch) for its head
        to be due. A pull at another offset (the consumer moved) resumes at once."""
        head, due = self._waiting[tp]
        if head == offset:
            wait = due - time.time()
            if wait > timeout:
                await anyio.sleep(timeout)
                return False
            if wait > 0:
                await anyio.sleep(wait)
        if self._waiting.pop(tp, None) is not None:
            fetcher.resume(tp)
        return True

    async def max_offset(self, mq: MessageQueue) -> int:
        _, fetcher, _ = await self._clients()
        tp = self._tp(mq)
        try:
            end = int((await self._lookup.end_offsets([tp]))[tp])
        except Exception as exc:
            raise _kafka_error(exc) from exc
        # Never below the high watermark a fetch saw: Tansu 0.6 answers ListOffsets
        # too low for partitions written in multi-record batches by librdkafka.
        high = fetcher.highwater(tp) if tp in self._assigned else None
        return max(end, high) if high is not None else end

    async def min_offset(self, mq: MessageQueue) -> int:
        await self._clients()
        tp = self._tp(mq)
        try:
            return int((await self._lookup.beginning_offsets([tp]))[tp])
        except Exception as exc:
            raise _kafka_error(exc) from exc

    async def offset_for_timestamp(self, mq: MessageQueue, timestamp: float) -> int:
        await self._clients()
        tp = self._tp(mq)
        try:
            found = (await self._lookup.offsets_for_times({tp: int(timestamp * 1000)}))[tp]
        except Exception as exc:
            raise _kafka_error(exc) from exc
        if found is None:
            return await self.max_offset(mq)
        return int(found.offset)

    # -- writing ----------------------------------------------------------------------

    async def append(self, mq: MessageQueue, messages: Sequence[OutgoingMessage]) -> list[Message]:
        count = await self._partition_count(self.names.kafka(mq.topic))
        if count is None:
            raise UnknownTopicError(f"topic {mq.topic!r} does not exist in Kafka")
        if not 0 <= mq.queue_id < count:
            raise InvalidMessageError(
                f"queue_id {mq.queue_id} out of range for topic {mq.topic!r} with {count} queues"
            )
        born = time.time()
        stored = await self._produce(
            mq, [(m, m.properties, 0, None) for m in messages], round(born * 1000)
        )
        return [
            Message(
                topic=mq.topic,
                queue_id=mq.queue_id,
                queue_offset=offset,
                body=m.body,
                keys=m.keys,
                tags=m.tags,
                properties=m.properties,
                msg_id=f"{self.names.kafka(mq.topic)}-{mq.queue_id}@{offset}",
                born_timestamp=born,
            )
            for m, offset in zip(messages, stored, strict=True)
        ]

    async def send(
        self,
        topic: str,
        body: bytes,
        *,
        keys: Sequence[str] | str = (),
        tags: str | None = None,
        properties: Mapping[str, str] | None = None,
        queue_id: int | None = None,
    ) -> Message:
        """Write one record to ``topic`` and return it as stored (what message trace's
        ``SourceTraceSink`` writes the trace topic with; applications use
        :class:`~stagedconsumer.Producer`). The partition: ``queue_id``, else the one
        Kafka's producers choose for the first key (murmur2), else the first. When
        OpenTelemetry is loaded and a span is current, its context is added as the
        W3C ``traceparent`` property."""
        outgoing = OutgoingMessage.of(body, keys=keys, tags=tags, properties=properties)
        outgoing.properties = dict(with_traceparent(outgoing.properties) or {})
        queues = await self.get_queues(topic)
        if queue_id is not None:
            mq = MessageQueue(topic, queue_id)
        elif outgoing.keys:
            mq = SelectMessageQueueByKafkaKey().select(queues, outgoing, None)
        else:
            mq = queues[0]
        (stored,) = await self.append(mq, [outgoing])
        return stored

    async def _produce(
        self,
        mq: MessageQueue,
        items: Sequence[tuple[OutgoingMessage | Message, Mapping[str, str], int, int | None]],
        born_ms: int,
    ) -> list[int]:
        """Send records to one partition; their offsets."""
        _, _, producer = await self._clients()
        name = self.names.kafka(mq.topic)
        try:
            futures = []
            for message, properties, reconsume_times, due in items:
                key, headers = encode_headers(
                    message, properties, reconsume_times=reconsume_times, delay_until_ms=due
                )
                futures.append(
                    await producer.send(
                        name,
                        message.body,
                        key=key,
                        partition=mq.queue_id,
                        headers=headers,
                        timestamp_ms=born_ms,
                    )
                )
            return [int((await future).offset) for future in futures]
        except Exception as exc:
            raise _kafka_error(exc) from exc

    async def send_back(
        self,
        group: str,
        message: Message,
        *,
        delay_level: int = 0,
        max_reconsume_times: int = 16,
    ) -> SendBackResult:
        if is_spent(message, delay_level=delay_level, max_reconsume_times=max_reconsume_times):
            await self.send_to_dlq(group, message)
            return SendBackResult.DLQ
        due = time.time() + retry_delay_seconds(message.reconsume_times, delay_level)
        queues = await self.get_queues(retry_topic(group))
        # the partitions of the message's delay level (RocketMQ's level rule), then
        # by message id: a retry partition holds records of one delay, due in order
        level = delay_level if delay_level > 0 else 3 + message.reconsume_times
        level = max(1, min(level, len(DELAY_LEVELS)))
        spread = self.retry_partitions
        index = (level - 1) * spread + zlib.crc32(message.msg_id.encode()) % spread
        mq = queues[index % len(queues)]
        await self._produce(
            mq,
            [(message, origin_properties(message), message.reconsume_times + 1, round(due * 1000))],
            round(message.born_timestamp * 1000),
        )
        return SendBackResult.RETRY

    async def send_to_dlq(self, group: str, message: Message) -> None:
        queues = await self.get_queues(dlq_topic(group))
        mq = queues[zlib.crc32(message.msg_id.encode()) % len(queues)]
        await self._produce(
            mq,
            [(message, origin_properties(message), message.reconsume_times, None)],
            round(message.born_timestamp * 1000),
        )

    async def send_undecodable_to_dlq(self, group: str, entry: UndecodableEntry) -> None:
        """The poison record's body, key and properties (``DECODE_ERROR``,
        ``POISON_STREAM``, ``POISON_ENTRY_ID``), its headers as stored under
        ``raw:<name>`` (UTF-8, undecodable bytes replaced)."""
        message = entry.message
        properties = origin_properties(message)
        for name, value in entry.fields:
            properties["raw:" + name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        queues = await self.get_queues(dlq_topic(group))
        mq = queues[zlib.crc32(message.msg_id.encode()) % len(queues)]
        await self._produce(
            mq, [(message, properties, 0, None)], round(message.born_timestamp * 1000)
        )

    # -- groups -----------------------------------------------------------------------

    def group_coordinator(self) -> KafkaCoordinator:
        """Membership through Kafka's consumer groups (one per broker object)."""
        if self._coordinator is None:
            self._coordinator = KafkaCoordinator(self)
        return self._coordinator

    def default_offset_store(self) -> StageOffsetStore:
        """Progress in the group's Kafka offset commits (one per broker object)."""
        if self._store is None:
            self._store = KafkaOffsetStore(self)
        return self._store

    def store_host(self) -> str:
        return ",".join(self.bootstrap_servers)

    def source_id(self) -> str:
        """``kafka://`` and the bootstrap servers, sorted, or the ``source_id=``
        given: the identity an external offset store keys this broker's progress by
        (the default store, the group's Kafka commits, lives in the cluster itself).
        Not the cluster id: the identity is needed before the first connection, and
        a cluster rebuilt at the same address shows as offsets beyond the queues'
        ends, which the consumer reports and corrects."""
        return self._source_id

    def statistics(self) -> KafkaBrokerStatistics:
        """A snapshot of the counters above, and the retry partitions paused now."""
        return KafkaBrokerStatistics(
            pulls=self.pulls,
            seeks=self.seeks,
            metadata_overflows=self.metadata_overflows,
            finished_overflows=self.finished_overflows,
            metadata_rejections=self.metadata_rejections,
            metadata_missing=self.metadata_missing,
            retry_paused=len(self._waiting),
        )
