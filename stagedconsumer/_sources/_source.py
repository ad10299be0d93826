"""MessageSource: what a consumer pulls from (the embedded broker, Redis, ...)."""

from __future__ import annotations

import abc
import enum
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import attrs

from .._exceptions import ConfigurationError, SourceError
from .._message import Message, MessageQueue, OutgoingMessage

if TYPE_CHECKING:
    from offsetstore import StageOffsetStore

    from ._group import GroupCoordinator

__all__ = (
    "DLQ_PREFIX",
    "PROPERTY_DECODE_ERROR",
    "PROPERTY_POISON_ENTRY_ID",
    "PROPERTY_POISON_STREAM",
    "PROPERTY_ORIGIN_MESSAGE_ID",
    "PROPERTY_RETRY_TOPIC",
    "PROPERTY_TOMBSTONE",
    "RETRY_PREFIX",
    "MessageSource",
    "PullResult",
    "SendBackResult",
    "TraceWriter",
    "UndecodableEntry",
    "dlq_topic",
    "is_spent",
    "origin_properties",
    "retry_topic",
    "source_id_of",
)

RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"
PROPERTY_RETRY_TOPIC = "RETRY_TOPIC"
"""Property of a retried message: the topic it was first sent to."""
PROPERTY_ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
"""Property of a retried or dead-lettered message: its ``msg_id`` (which retries
keep; once the id of the first delivery when a retry got a new one)."""
PROPERTY_DECODE_ERROR = "DECODE_ERROR"
"""Property of the dead-letter copy of an entry that could not be decoded (a poison
entry): why, as ``<exception type>: <message>``."""
PROPERTY_POISON_STREAM = "POISON_STREAM"
"""Property of the dead-letter copy of a poison entry: the stream (Redis key) it was in."""
PROPERTY_POISON_ENTRY_ID = "POISON_ENTRY_ID"
"""Property of the dead-letter copy of a poison entry: its stream entry id."""
PROPERTY_TOMBSTONE = "TOMBSTONE"
"""Property ``"true"`` of a message made of a Kafka record with a null value (a
tombstone; its body is empty); kept by its retry and dead-letter copies."""

TraceWriter = Callable[[str, bytes, tuple[str, ...]], object]
"""``writer(topic, body, keys)``: stores one trace message before returning (see
:meth:`MessageSource.trace_writer`); raises
:class:`~stagedconsumer.UnknownTopicError` when ``topic`` does not exist."""


def origin_properties(message: Message) -> dict[str, str]:
    """``message``'s properties plus where it came from (``RETRY_TOPIC``,
    ``ORIGIN_MESSAGE_ID``), kept from its first delivery when already set."""
    properties = dict(message.properties)
    properties.setdefault(PROPERTY_RETRY_TOPIC, message.topic)
    properties.setdefault(PROPERTY_ORIGIN_MESSAGE_ID, message.msg_id)
    return properties


def is_spent(message: Message, *, delay_level: int, max_reconsume_times: int) -> bool:
    """Whether a message handed back goes to the DLQ rather than the retry queue
    (RocketMQ's broker rule: attempts used up, or a negative delay level)."""
    return delay_level < 0 or message.reconsume_times >= max_reconsume_times


SOURCE_ID_MAX_LENGTH = 191
"""The longest source identity an offset store keeps as it is (the SQL store's key
column; MariaDB/MySQL bound the length of a primary key)."""


def source_id_of(text: str) -> str:
    """``text`` as a source identity: unchanged when it is at most
    :data:`SOURCE_ID_MAX_LENGTH` characters, else its first 160 characters and a hash
    of the whole (still stable, still distinct); ``ConfigurationError`` for an empty
    or non-string one."""
    if not isinstance(text, str) or not text:
        raise ConfigurationError(f"a source identity must be a non-empty string, got {text!r}")
    if len(text) <= SOURCE_ID_MAX_LENGTH:
        return text
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]
    return f"{text[:160]}~{digest}"


def retry_topic(group: str) -> str:
    """The retry topic of a consumer group, ``%RETRY%<group>``."""
    return RETRY_PREFIX + group


def dlq_topic(group: str) -> str:
    """The dead-letter topic of a consumer group, ``%DLQ%<group>``."""
    return DLQ_PREFIX + group


@attrs.frozen(kw_only=True)
class UndecodableEntry:
    """An entry of a queue that a source could not decode into a message (a *poison
    entry*: its fields are in the source's format but corrupt), returned by a pull in
    its place (:attr:`PullResult.undecodable`) so that the messages around it are
    delivered. A consumer sends :attr:`message` to its group's dead-letter queue
    (:meth:`MessageSource.send_undecodable_to_dlq`) and moves past it."""

    offset: int
    """Its offset in the queue."""
    error: str
    """Why it could not be decoded: ``<exception type>: <message>``."""
    message: Message
    """What the dead-letter queue gets: its topic, queue and offset, the body as
    stored (empty when it has none), its message id as far as it can be read, and the
    properties ``DECODE_ERROR`` (:attr:`error`), ``POISON_STREAM`` and
    ``POISON_ENTRY_ID`` (where it was stored)."""
    fields: tuple[tuple[bytes, bytes], ...] = ()
    """The entry's fields and values as stored (kept in the dead-letter entry)."""


@attrs.frozen(kw_only=True)
class PullResult:
    """What one pull returned.

    ``messages`` are consecutive in offset order starting at or after the requested
    offset; ``next_offset`` is where the next pull starts (past the last message
    returned, or moved forward when the requested offset no longer exists);
    ``max_offset`` is the queue's next offset to be written. ``undecodable`` are the
    entries among them that could not be decoded (poison entries), in offset order;
    ``next_offset`` is past them too.
    """

    messages: Sequence[Message]
    """The messages pulled, consecutive, in offset order."""
    next_offset: int
    """Where the next pull of the queue starts."""
    max_offset: int
    """The queue's next offset to be written (its end)."""
    undecodable: Sequence[UndecodableEntry] = ()
    """Entries in the pulled range that are in the broker's format but could not be
    decoded (poison entries), in offset order, beside the messages around them."""
    offset_moved: bool = False
    """The requested offset is no longer stored (retention removed the entries from
    it on; RocketMQ's ``PULL_OFFSET_MOVED``): nothing is returned, and
    ``next_offset`` is the first offset still stored."""


class SendBackResult(enum.Enum):
    """Where a message handed back by a consumer went."""

    RETRY = "retry"
    """Sent to the group's retry topic, to come back after its delay."""
    DLQ = "dlq"
    """Sent to the group's dead-letter topic (its attempts were used up)."""


class MessageSource(abc.ABC):
    """A partitioned log that consumers pull from by offset.

    Ordering guarantee: within one message queue, :meth:`pull` returns messages in
    offset order and every offset once (a repeated pull of the same offset returns
    the same messages). Nothing is ordered across queues. Messages handed back for
    retry come back through the group's retry queue, in the order they become due.
    """

    groups_span_processes: ClassVar[bool] = False
    """Whether consumers in other processes can be members of a group consuming this
    source (``RedisBroker``: yes). A consumer of such a source given no offset store
    warns: its default store keeps progress in this process only."""

    @abc.abstractmethod
    async def get_queues(self, topic: str) -> Sequence[MessageQueue]:
        """The queues of ``topic``; raises :class:`~stagedconsumer.UnknownTopicError`.

        Retry topics (``%RETRY%<group>``) always exist.
        """

    @abc.abstractmethod
    async def pull(
        self, mq: MessageQueue, offset: int, max_count: int, *, timeout: float = 0.0
    ) -> PullResult:
        """Up to ``max_count`` messages of ``mq`` from ``offset`` on.

        When none is available, waits up to ``timeout`` seconds for one (long polling)
        before returning an empty result.
        """

    @abc.abstractmethod
    async def max_offset(self, mq: MessageQueue) -> int:
        """The offset the next message sent to ``mq`` will get."""

    def topic_exists(self, topic: str) -> bool | None:
        """Whether ``topic`` exists, if the source knows without I/O; ``None`` if not.

        Lets ``subscribe()`` reject an unknown topic at once. The default is ``None``
        (checked when the consumer starts).
        """
        del topic
        return None

    async def min_offset(self, mq: MessageQueue) -> int:
        """The lowest offset still stored in ``mq`` (default 0)."""
        del mq
        return 0

    @abc.abstractmethod
    async def send_back(
        self,
        group: str,
        message: Message,
        *,
        delay_level: int = 0,
        max_reconsume_times: int = 16,
    ) -> SendBackResult:
        """Hand a failed message to the group's retry queue, or its DLQ when spent.

        The message goes to the DLQ when its ``reconsume_times`` has reached
        ``max_reconsume_times`` or ``delay_level`` is negative; otherwise it comes back
        through ``%RETRY%<group>`` with ``reconsume_times + 1`` after the delay of
        ``delay_level`` (0: RocketMQ's level ``3 + reconsume_times``).
        """

    @abc.abstractmethod
    async def send_to_dlq(self, group: str, message: Message) -> None:
        """Move a message to the group's dead-letter queue ``%DLQ%<group>``."""

    async def hold_offsets(self, group: str, offsets: Mapping[MessageQueue, int]) -> None:
        """``group`` has committed these offsets of the queues it holds: a source with
        retention keeps every entry from there on while the group is live. Called
        by consumers every ``persist_consumer_offset_interval``; the default does
        nothing."""
        del group, offsets

    async def send_undecodable_to_dlq(self, group: str, entry: UndecodableEntry) -> None:
        """Store a poison entry's :attr:`~UndecodableEntry.message` in the group's
        dead-letter queue (a source that can keeps the raw fields with it). The
        default: :meth:`send_to_dlq`."""
        await self.send_to_dlq(group, entry.message)

    async def offset_for_timestamp(self, mq: MessageQueue, timestamp: float) -> int:
        """The offset of the first message of ``mq`` born at or after ``timestamp``
        (seconds since the epoch), or the max offset when there is none. The default:
        the source cannot tell (``SourceError``, not retriable)."""
        del mq, timestamp
        raise SourceError(f"{type(self).__name__} cannot find an offset by time", retriable=False)

    async def append(self, mq: MessageQueue, messages: Sequence[OutgoingMessage]) -> list[Message]:
        """Store ``messages`` in queue ``mq``, in order and at consecutive offsets, in
        one attempt; returns them as stored (with offset, message id, born time).

        The producer's primitive (:class:`~stagedconsumer.Producer` chooses the queue,
        retries and keeps the deadline): no retry and no queue choice here, and no
        property added. Raises :class:`~stagedconsumer.UnknownTopicError` for an
        unknown topic and :class:`~stagedconsumer.SourceError` on failure, with
        ``retriable`` set when another attempt may succeed (it may also have stored
        the messages, if only the reply was lost). The default: the source does not
        accept messages.
        """
        del mq, messages
        raise SourceError(f"{type(self).__name__} does not accept messages", retriable=False)

    def group_coordinator(self) -> GroupCoordinator | None:
        """Membership and queue locks shared by the processes of a consumer group.

        ``None`` (the default, and the embedded broker's answer) means the source
        serves one process: a consumer owns every queue of its subscriptions. A
        source that returns a coordinator gets consumers that allocate queues among
        the group's live members and consume only the queues whose lock they hold.
        """
        return None

    def default_offset_store(self) -> StageOffsetStore | None:
        """Where consumers of this source given no ``offset_store`` keep progress;
        ``None`` (the default): a :class:`~offsetstore.MemoryOffsetStore` per source
        object. :class:`~stagedconsumer.KafkaBroker`: the group's Kafka offset
        commits."""
        return None

    def source_id(self) -> str:
        """The identity of the log this source reads: what offset stores key the
        progress of its consumer groups by, beside group, topic and queue, so that
        progress made on one source is never taken for another's (a fresh Redis
        namespace, another broker: their queues' offsets mean other messages).

        It must be stable across restarts of the consumer, and identical in every
        member of a group. :class:`~stagedconsumer.MemoryBroker`:
        ``memory://<name>``; :class:`~stagedconsumer.RedisBroker`:
        ``redis://host:port/db#namespace`` (no credentials; ``redis-cluster://``
        for a cluster); :class:`~stagedconsumer.KafkaBroker`: ``kafka://`` and the
        bootstrap servers. Each of them takes ``source_id=`` to set it instead
        (keep the progress when Redis moves to another host). The default: the
        class's qualified name, ``source://<module>.<class>``."""
        return source_id_of(f"source://{type(self).__module__}.{type(self).__qualname__}")

    def store_host(self) -> str:
        """Where this source stores messages, as message trace writes it (the
        ``storeHost`` of a ``Pub`` record; RocketMQ: the address of the broker that
        stored the message). :class:`~stagedconsumer.MemoryBroker`: ``"embedded"``;
        :class:`~stagedconsumer.RedisBroker`: the Redis server's ``host:port``. The
        default is the class name."""
        return type(self).__name__

    def trace_writer(self) -> TraceWriter | None:
        """A function that stores a message trace record batch synchronously, or ``None``.

        Message trace (``SourceTraceSink``) writes batches of encoded records to a
        topic of the source (``RMQ_SYS_TRACE_TOPIC``), keyed by message ids and
        business keys. A source that can store a message without I/O (the embedded
        broker appends to memory) returns ``writer(topic, body, keys)``, which stores
        it as ``send(topic, body, keys=keys)`` would, except that no ``traceparent``
        is added (a trace message holds the records of many handler calls; the span
        current where its batch filled up is not its creation context). The sink
        then writes full batches inline, right where they fill up, instead of from
        its background task.

        ``None`` (the default) means the source cannot: the sink writes through the
        source's ``send``, awaited from the dispatcher's task when it is async.
        """
        return None

    async def aclose(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections. The default does nothing."""
