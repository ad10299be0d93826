"""MemoryBroker: the embedded, in-process message source (the default)."""

from __future__ import annotations

import bisect
import heapq
import itertools
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

import anyio
import attrs

from .._core import retry_delay_seconds
from .._exceptions import (
    ConfigurationError,
    InvalidMessageError,
    UnknownTopicError,
    WrongThreadError,
)
from .._message import (
    EMPTY_PROPERTIES,
    Message,
    MessageQueue,
    OutgoingMessage,
    _MessageFields,
)
from .._observability._traceparent import with_traceparent
from ._gray import PROPERTY_GRAY
from ._group import GroupCoordinator, GroupOptions
from ._memory_coordinator import MemoryCoordinator
from ._source import (
    DLQ_PREFIX,
    RETRY_PREFIX,
    MessageSource,
    PullResult,
    SendBackResult,
    TraceWriter,
    dlq_topic,
    is_spent,
    origin_properties,
    retry_topic,
    source_id_of,
)

__all__ = ("MemoryBroker", "MemoryBrokerStatistics")


@attrs.frozen(kw_only=True)
class MemoryBrokerStatistics:
    """A snapshot of a :class:`MemoryBroker`."""

    topics: Mapping[str, int]
    """Queue count per topic (retry and DLQ topics included)."""
    messages: int
    """Messages stored in all queues."""
    delayed: int
    """Messages handed back for retry and not yet due."""


class _Queue:
    __slots__ = ("log", "thread", "waiters")

    def __init__(self) -> None:
        self.log: list[Message] = []
        self.waiters: list[anyio.Event] = []
        self.thread = 0
        """The thread of the event loop whose pulls wait in :attr:`waiters`."""

    def check_thread(self, topic: str) -> None:
        """Refuse an append from another thread while an event loop waits here:
        waking its waiters from outside the loop is not thread-safe (asyncio would
        not wake up, trio raises), and offsets could be given twice."""
        if self.waiters and threading.get_ident() != self.thread:
            raise WrongThreadError(
                f"MemoryBroker.send({topic!r}, ...) called from thread"
                f" {threading.current_thread().name!r} while the event loop of another"
                " thread uses the broker: send through that loop (a BlockingProducer on"
                " its portal, or portal.call(broker.send, ...)), or before it starts"
            )

    def wake(self) -> None:
        if self.waiters:
            waiters, self.waiters = self.waiters, []
            for waiter in waiters:
                waiter.set()

    async def wait(self, timeout: float | None) -> None:
        """Wait for an append (or ``timeout``); leaves nothing behind when cancelled,
        so the broker can serve another event loop later."""
        waiter = anyio.Event()
        self.thread = threading.get_ident()
        self.waiters.append(waiter)
        try:
            with anyio.move_on_after(timeout):
                await waiter.wait()
        finally:
            if waiter in self.waiters:
                self.waiters.remove(waiter)


class MemoryBroker(MessageSource):
    """An in-process broker: topics of N queues held in memory.

    Ordering guarantee: each queue is an append-only log; pulls return its messages
    in offset order. :meth:`send` picks the queue by a stable hash (CRC-32) of the
    first key, round-robin when there are no keys, or ``queue_id`` when given.
    Failed messages handed back by a concurrent consumer wait their retry delay
    (RocketMQ's delay levels) and then appear in the group's retry queue; spent ones
    go to the group's dead-letter queue.

    The broker lives on one event loop: call it from that loop's thread (from a worker
    thread, go through ``anyio.from_thread``; from other threads, through the loop's
    portal, see :mod:`stagedconsumer.blocking`). Before any loop uses it (topics and a
    first backlog made by the main thread), and after, any single thread may. A
    :meth:`send` from another thread while a consumer's pull waits for that queue
    raises :class:`~stagedconsumer.WrongThreadError`; other cross-thread calls are
    not detected. ``clock`` is the time source of retry
    delays; by default the running event loop's clock (``anyio.current_time``), so
    virtual-time tests see virtual delays.

    Consumers of one group on one broker share its queues: the broker coordinates
    them (:class:`~stagedconsumer._sources._memory_coordinator.MemoryCoordinator`,
    the same protocol as over Redis, with ``group_options``: RocketMQ's lock expiry,
    renewal and allocation by default), so each queue is consumed by one member of
    the group at a time, and when a member joins or leaves the others rebalance at
    once (gray release on the embedded broker uses this). With
    ``coordinate_groups=False`` there is no coordinator: each consumer owns every
    queue of its subscriptions, without locks, so two consumers of one group each
    consume every message.

    A group's retry topic ``%RETRY%<group>`` has two queues: retries of normal
    traffic go to queue 0, retries of gray traffic (messages handed back with the
    ``GRAY`` property, see gray release) to queue 1, the retry topic's gray queue.
    """

    retry_queue_count = 2
    """Queues of a retry topic: one for normal and one for gray retries."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] | None = None,
        group_options: GroupOptions | None = None,
        coordinate_groups: bool = True,
        name: str = "embedded",
    ) -> None:
        self.name = name
        """Names the broker in its :meth:`source_id`, ``memory://<name>``."""
        self._source_id = source_id_of(f"memory://{name}")
        self._topics: dict[str, list[_Queue]] = {}
        self._queue_lists: dict[str, tuple[MessageQueue, ...]] = {}
        """What :meth:`get_queues` returns, per topic."""
        self._round_robin: dict[str, itertools.count[int]] = {}
        self._delayed: list[tuple[float, int, str, Message]] = []
        self._delay_seq = itertools.count()
        self._clock = clock
        self._id_prefix = f"{os.getpid():08X}{id(self) & 0xFFFFFFFF:08X}"
        self._id_seq = itertools.count()
        self._coordinator = (
            MemoryCoordinator(
                group_options if group_options is not None else GroupOptions(), clock=self._now
            )
            if coordinate_groups
            else None
        )

    # -- producer side ---------------------------------------------------------

    def create_topic(self, topic: str, queue_count: int = 8) -> list[MessageQueue]:
        """Create ``topic`` with ``queue_count`` queues (idempotent for the same count)."""
        if not topic or not isinstance(topic, str):
            raise ConfigurationError(f"topic must be a non-empty string, got {topic!r}")
        if topic.startswith((RETRY_PREFIX, DLQ_PREFIX)):
            raise ConfigurationError(f"topic {topic!r} uses a reserved prefix")
        if isinstance(queue_count, bool) or not isinstance(queue_count, int) or queue_count < 1:
            raise ConfigurationError(f"queue_count must be a positive int, got {queue_count!r}")
        existing = self._topics.get(topic)
        if existing is not None:
            if len(existing) != queue_count:
                raise ConfigurationError(
                    f"topic {topic!r} exists with {len(existing)} queues, not {queue_count}"
                )
        else:
            self._topics[topic] = [_Queue() for _ in range(queue_count)]
            self._round_robin[topic] = itertools.count()
        return [MessageQueue(topic, i) for i in range(queue_count)]

    def _queues_of(self, topic: str) -> list[_Queue]:
        queues = self._topics.get(topic)
        if queues is None:
            if topic.startswith(RETRY_PREFIX):
                queues = self._topics[topic] = [_Queue() for _ in range(self.retry_queue_count)]
                return queues
            if topic.startswith(DLQ_PREFIX):
                queues = self._topics[topic] = [_Queue()]
                return queues
            raise UnknownTopicError(
                f"topic {topic!r} does not exist; create it with create_topic()"
                + (f" (known topics: {', '.join(sorted(self._topics))})" if self._topics else "")
            )
        return queues

    def _next_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_seq):016X}"

    def send(
        self,
        topic: str,
        body: bytes,
        *,
        keys: Sequence[str] | str = (),
        tags: str | None = None,
        properties: Mapping[str, str] | None = None,
        queue_id: int | None = None,
    ) -> Message:
        """Append a message to a queue of ``topic`` and return it as stored.

        When OpenTelemetry is loaded and a span is current, its context is added as
        the W3C ``traceparent`` property (the message's creation context).

        The message is checked as :class:`~stagedconsumer.Producer` checks it:
        :class:`~stagedconsumer.InvalidMessageError` for a body that is not bytes,
        keys, tags or properties that are not strings.
        """
        outgoing = OutgoingMessage.of(body, keys=keys, tags=tags, properties=properties)
        queues = self._queues_of(topic)
        key_tuple = outgoing.keys
        if queue_id is None:
            if key_tuple:
                queue_id = zlib.crc32(key_tuple[0].encode()) % len(queues)
            else:
                queue_id = next(self._round_robin[topic]) % len(queues)
        elif isinstance(queue_id, bool) or not isinstance(queue_id, int):
            raise InvalidMessageError(f"queue_id must be an int or None, got {queue_id!r}")
        elif not 0 <= queue_id < len(queues):
            raise InvalidMessageError(
                f"queue_id {queue_id} out of range for topic {topic!r} with {len(queues)} queues"
            )
        queue = queues[queue_id]
        if queue.waiters:
            queue.check_thread(topic)
        message = Message(
            topic=topic,
            queue_id=queue_id,
            queue_offset=len(queue.log),
            body=outgoing.body,
            keys=key_tuple,
            tags=outgoing.tags,
            properties=with_traceparent(outgoing.properties) or {},
            msg_id=self._next_id(),
            born_timestamp=time.time(),
        )
        queue.log.append(message)
        queue.wake()
        return message

    async def offset_for_timestamp(self, mq: MessageQueue, timestamp: float) -> int:
        """Binary search on born times (they only grow within a queue)."""
        log = self._queues_of(mq.topic)[mq.queue_id].log
        return bisect.bisect_left(log, timestamp, key=lambda m: m.born_timestamp)

    async def append(self, mq: MessageQueue, messages: Sequence[OutgoingMessage]) -> list[Message]:
        queues = self._queues_of(mq.topic)
        if not 0 <= mq.queue_id < len(queues):
            raise InvalidMessageError(
                f"queue_id {mq.queue_id} out of range for topic {mq.topic!r} with"
                f" {len(queues)} queues"
            )
        queue = queues[mq.queue_id]
        born = time.time()
        stored = [
            Message(
                topic=mq.topic,
                queue_id=mq.queue_id,
                queue_offset=len(queue.log) + i,
                body=outgoing.body,
                keys=outgoing.keys,
                tags=outgoing.tags,
                properties=outgoing.properties,
                msg_id=self._next_id(),
                born_timestamp=born,
            )
            for i, outgoing in enumerate(messages)
        ]
        queue.log.extend(stored)
        queue.wake()
        return stored

    def send_many(self, topic: str, bodies: Iterable[bytes], *, queue_id: int | None = None) -> int:
        """Append many key-less messages (round-robin, or all to ``queue_id``)."""
        count = 0
        for body in bodies:
            self.send(topic, body, queue_id=queue_id)
            count += 1
        return count

    def send_trace(self, topic: str, body: bytes, keys: tuple[str, ...]) -> Message:
        """``send(topic, body, keys=keys)`` for the message trace writer, which calls it
        once per batch of trace records (see :meth:`trace_writer`): the same queue
        choice and the same stored fields, except that no ``traceparent`` is added.
        Built as ``_MessageFields`` made a ``Message``, as the sender's values are
        already in their stored form."""
        queues = self._queues_of(topic)
        count = len(queues)
        if count == 1:
            queue_id = 0
        elif keys:
            queue_id = zlib.crc32(keys[0].encode()) % count
        else:
            queue_id = next(self._round_robin[topic]) % count
        queue = queues[queue_id]
        m = _MessageFields()
        m.topic = topic
        m.queue_id = queue_id
        m.queue_offset = len(queue.log)
        m.body = body
        m.keys = keys
        m.tags = None
        m.properties = EMPTY_PROPERTIES
        m.msg_id = m.offset_msg_id = self._next_id()
        m.born_timestamp = time.time()
        m.reconsume_times = 0
        m.__class__ = Message
        message = cast(Message, m)
        queue.log.append(message)
        queue.wake()
        return message

    def _append(self, topic: str, message: Message) -> Message:
        """Append to the topic's queue 0, or (retry topics) its last queue when the
        message is gray."""
        queues = self._queues_of(topic)
        queue_id = len(queues) - 1 if message.properties.get(PROPERTY_GRAY) == "true" else 0
        queue = queues[queue_id]
        stored = attrs.evolve(message, topic=topic, queue_id=queue_id, queue_offset=len(queue.log))
        queue.log.append(stored)
        queue.wake()
        return stored

    # -- MessageSource -----------------------------------------------------------

    def source_id(self) -> str:
        """``memory://<name>`` (``memory://embedded`` unless ``name=`` was given): the
        identity offset stores key this broker's progress by.

        The same for every embedded broker of that name, in this process and the
        next: the broker keeps its messages in memory only, so whether a new one holds
        the same messages is up to the program that fills it (tests and replays
        refill it alike and resume from a durable store). A store that outlived the
        messages it counted finds offsets beyond the new queues' ends, which the
        consumer reports and corrects (``consume_from_where``). Give brokers that
        hold different messages different names when one offset store serves them."""
        return self._source_id

    def store_host(self) -> str:
        """``"embedded"``: the messages are in this process's memory."""
        return "embedded"

    def trace_writer(self) -> TraceWriter | None:
        """:meth:`send_trace`, unless a subclass changed :meth:`send` (its trace
        messages then go through its ``send``)."""
        if type(self).send is MemoryBroker.send:
            return self.send_trace
        return None

    def topic_exists(self, topic: str) -> bool:
        return topic in self._topics or topic.startswith((RETRY_PREFIX, DLQ_PREFIX))

    async def get_queues(self, topic: str) -> Sequence[MessageQueue]:
        count = len(self._queues_of(topic))
        queues = self._queue_lists.get(topic)
        if queues is None or len(queues) != count:  # built once per topic (and size)
            queues = self._queue_lists[topic] = tuple(MessageQueue(topic, i) for i in range(count))
        return queues

    def _now(self) -> float:
        return self._clock() if self._clock is not None else anyio.current_time()

    def _release_due(self) -> float | None:
        """Move due retry messages into their retry queue; returns the next due time."""
        delayed = self._delayed
        if not delayed:
            return None
        now = self._now()
        while delayed and delayed[0][0] <= now:
            _, _, topic, message = heapq.heappop(delayed)
            self._append(topic, message)
        return delayed[0][0] if delayed else None

    async def pull(
        self, mq: MessageQueue, offset: int, max_count: int, *, timeout: float = 0.0
    ) -> PullResult:
        queue = self._queues_of(mq.topic)[mq.queue_id]
        if offset < 0:
            offset = 0
        if mq.topic.startswith(RETRY_PREFIX):
            self._release_due()
        log = queue.log
        if offset >= len(log) and timeout > 0:
            with anyio.move_on_after(timeout):
                while offset >= len(log):
                    wait = None
                    if mq.topic.startswith(RETRY_PREFIX):
                        due = self._release_due()
                        if offset < len(log):
                            break
                        if due is not None:
                            wait = max(0.0, due - self._now())
                    await queue.wait(wait)
        messages = log[offset : offset + max_count]
        return PullResult(
            messages=messages,
            next_offset=offset + len(messages) if messages else min(offset, len(log)),
            max_offset=len(log),
        )

    async def max_offset(self, mq: MessageQueue) -> int:
        if mq.topic.startswith(RETRY_PREFIX):
            self._release_due()
        return len(self._queues_of(mq.topic)[mq.queue_id].log)

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
        # RocketMQ: the retry is a new stored copy (a new offsetMsgId) of the same
        # message (its msgId, the producer's UNIQ_KEY, is copied over).
        retried = attrs.evolve(
            message,
            properties=origin_properties(message),
            reconsume_times=message.reconsume_times + 1,
            offset_msg_id=self._next_id(),
        )
        due = self._now() + retry_delay_seconds(message.reconsume_times, delay_level)
        topic = retry_topic(group)
        queues = self._queues_of(topic)
        heapq.heappush(self._delayed, (due, next(self._delay_seq), topic, retried))
        for queue in queues:
            queue.wake()
        return SendBackResult.RETRY

    async def send_to_dlq(self, group: str, message: Message) -> None:
        self._append(
            dlq_topic(group),
            attrs.evolve(
                message, properties=origin_properties(message), offset_msg_id=self._next_id()
            ),
        )

    def group_coordinator(self) -> GroupCoordinator | None:
        """The in-process coordinator of this broker's consumer groups (``None``
        with ``coordinate_groups=False``: every consumer then consumes every queue)."""
        return self._coordinator

    # -- inspection ----------------------------------------------------------------

    def messages(self, topic: str, queue_id: int = 0) -> Sequence[Message]:
        """The stored messages of one queue (read-only view, for tests and tools)."""
        return tuple(self._queues_of(topic)[queue_id].log)

    def statistics(self) -> MemoryBrokerStatistics:
        """A snapshot: queues per topic, messages stored, retries waiting for their delay."""
        return MemoryBrokerStatistics(
            topics={name: len(queues) for name, queues in self._topics.items()},
            messages=sum(len(q.log) for queues in self._topics.values() for q in queues),
            delayed=len(self._delayed),
        )
