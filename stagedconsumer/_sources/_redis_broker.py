"""RedisBroker: topics of queues on Redis Streams, and consumer groups across processes.

The broker is in four modules: this one (producer and message source),
``_redis_scripts`` (the Lua scripts, and the key layout: queue offsets are stream
entry ids, ``<offset + 1>-0``), ``_redis_codec`` (how a message is stored) and
``_redis_connection`` (the client and its call wrappers, shared with the
``_redis_coordinator``'s group membership and queue locks).

Retries: :meth:`RedisBroker.send_back` puts the message (its fields packed as
``<len>:<bytes>`` pairs) into the group's ``delay`` sorted set with its due time
(Redis server time plus RocketMQ's delay of its level). Pulling the retry queue first
runs a Lua script that moves every due member into ``%RETRY%<group>``'s stream, with
the next offsets, and removes it from the set, in one atomic step: a retry is never
lost between the two and never appended twice.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import ssl as ssl_module
import time
import urllib.parse
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, ClassVar, Literal, TypeVar

import attrs

from .._core import retry_delay_seconds
from .._exceptions import (
    ConfigurationError,
    InvalidMessageError,
    SourceError,
    SourcePermissionError,
    UnknownTopicError,
)
from .._message import Message, MessageQueue, OutgoingMessage
from .._observability._traceparent import with_traceparent
from ._gray import PROPERTY_GRAY
from ._group import GroupOptions
from ._redis_acl import check_permissions, permission_message
from ._redis_codec import (
    EntryDecoder,
    _attached_id,
    _attached_offset,
    _decode_attached,
    _decode_entries,
    _decode_one,
    _encode_fields,
    _entry_offset,
    _field_sizes,
    _ForeignEntry,
    _message_fields,
    _pack,
    _poison_message,
    default_entry_decoder,
)
from ._redis_connection import RedisConnection, RedisScript
from ._redis_coordinator import RedisCoordinator
from ._redis_scripts import (
    DELAY_LUA,
    FLOOR_LUA,
    MIN_OFFSET_LUA,
    OFFSET_FOR_TIME_LUA,
    RELEASE_LUA,
    SEND_LUA,
)
from ._redis_tls import RedisTLS, resolve_tls
from ._redis_url import redis_source_id
from ._source import (
    DLQ_PREFIX,
    PROPERTY_DECODE_ERROR,
    PROPERTY_POISON_ENTRY_ID,
    PROPERTY_POISON_STREAM,
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

logger = logging.getLogger("stagedconsumer")

__all__ = ("RedisBroker", "RedisBrokerStatistics", "StreamRetention")


@attrs.frozen(kw_only=True)
class RedisBrokerStatistics:
    """A snapshot of a :class:`RedisBroker`."""

    namespace: str
    topics: Mapping[str, int]
    """Queue count of the topics this broker has used."""
    connection_errors: int
    """Redis calls that failed on the connection (each retried or reported)."""
    forced_trims: int = 0
    """Entries a live consumer group had not committed that this broker's sends
    trimmed because a queue reached ``StreamRetention.hard_max_length``
    (approximate; each trim logged as a WARNING)."""
    bad_retries: int = 0
    """Members of a group's delay set that were not packed messages (written there by
    something else), moved aside to ``<namespace>:delay-bad:{%RETRY%<group>:<n>}``
    instead of blocking the retries behind them; each logged once (WARNING)."""


logger = logging.getLogger("stagedconsumer.redis")


@attrs.frozen(kw_only=True)
class StreamRetention:
    """How long a :class:`RedisBroker` keeps the entries of the streams it writes
    (every topic's queues, retry and dead-letter queues, the message trace topic),
    as RocketMQ's ``fileReservedTime`` and Kafka's ``retention.ms`` /
    ``retention.bytes``.

    - ``max_age`` (seconds, default 72 hours as RocketMQ's ``fileReservedTime``):
      entries stored longer ago than this (the Redis server's clock) are removed.
    - ``max_length`` (entries per queue, default none): entries beyond the newest
      ``max_length`` are removed.
    - Neither removes an entry a *live* consumer group has not committed: consumers
      report their committed offsets of the queues they hold every
      ``persist_consumer_offset_interval`` (a group stays live ``group_ttl``
      seconds, default 10 minutes, after its last report).
    - ``hard_max_length`` (entries per queue, default none): entries beyond the
      newest ``hard_max_length`` are removed even when a live group has not
      committed them; the broker that trims them logs a WARNING and counts them
      (``RedisBrokerStatistics.forced_trims``), and the group's consumer reports
      its offset as trimmed.

    Applied on write, cheaply: every ``check_every`` appends to a queue (and, with a
    ``max_age``, when a 64th of it passed since the last check) the send's Lua script
    trims the stream with ``XTRIM MINID ~``. Redis removes whole stream nodes only,
    so a stream keeps up to about ``check_every`` plus 100 entries more than the
    limits say, never fewer. Streams attached with
    :meth:`RedisBroker.attach_stream` (written by other applications) are never
    trimmed.
    """

    max_age: float | None = 72 * 3600.0
    """Seconds an entry is kept (``None``: no age limit)."""
    max_length: int | None = None
    """Entries kept per queue (``None``: no length limit)."""
    hard_max_length: int | None = None
    """Entries kept per queue even when a live group has not committed them."""
    group_ttl: float = 600.0
    """Seconds a group counts as live after its last offset report."""
    check_every: int = 100
    """Appends to a queue between two trims."""

    def __attrs_post_init__(self) -> None:
        if self.max_age is not None:
            _check_seconds("max_age", self.max_age)
        for name in ("max_length", "hard_max_length"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigurationError(f"{name} must be a positive int or None, got {value!r}")
        _check_seconds("group_ttl", self.group_ttl)
        every = self.check_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigurationError(f"check_every must be a positive int, got {every!r}")

    def script_args(self) -> list[int]:
        """The retention as the Lua scripts take it (0: no limit)."""
        return [
            self.max_length or 0,
            round(self.max_age * 1000) if self.max_age is not None else 0,
            self.hard_max_length or 0,
            self.check_every,
        ]


_NO_RETENTION = [0, 0, 0, 1]

_T = TypeVar("_T")
_MAX_BLOCK = 5.0
"""Longest single ``XREAD BLOCK`` (seconds); longer long polls loop, so a blocked
read never outlives the socket timeout."""
_RELEASE_BATCH = 256
_MAX_BUFFERED = 1024
"""Read-ahead buffers kept at most (one per queue and offset a pull will continue
from); past this the oldest is dropped (a stale one is left by a consumer that moved
elsewhere: reset, stopped, or lost the queue)."""


def _check_seconds(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or not math.isfinite(value)
    ):
        raise ConfigurationError(
            f"{name} must be a positive, finite number of seconds, got {value!r}"
        )


@attrs.frozen
class _Attached:
    """A topic attached to streams written by other applications."""

    stream_keys: tuple[str, ...]
    decode: EntryDecoder


def _foreign_error(stream: str, exc: _ForeignEntry, why: str = "") -> SourceError:
    return SourceError(
        f"stream {stream} holds a foreign {exc}{', ' + why if why else ''}: only"
        " RedisBroker writes the streams of its topics (another application's XADD?);"
        " consume streams written by others with attach_stream()",
        retriable=False,
    )


def _is_system(topic: str) -> bool:
    return topic.startswith((RETRY_PREFIX, DLQ_PREFIX))


RETRY_QUEUE_COUNT = 2
"""Queues of a group's retry topic: 0 for retries of normal traffic, 1 (the retry
topic's gray queue) for retries of gray traffic."""


_DEFAULT_RETENTION = StreamRetention()


def _check_options(
    *,
    url: object,
    namespace: object,
    group_options: object,
    timeouts: dict[str, object],
    read_ahead: object,
    cluster: object,
    poison_entries: object,
    retention: object,
    check_acl: object,
) -> None:
    """Raise :class:`~stagedconsumer.ConfigurationError` for the first option of
    :class:`RedisBroker` that is not valid."""
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"url must be a redis:// URL string, got {type(url).__name__}")
    if not namespace or not isinstance(namespace, str):
        raise ConfigurationError(f"namespace must be a non-empty string, got {namespace!r}")
    if group_options is not None and not isinstance(group_options, GroupOptions):
        raise ConfigurationError(
            f"group_options must be GroupOptions or None, got"
            f" {type(group_options).__name__} {group_options!r}"
            " (use GroupOptions(lock_ttl=..., ...))"
        )
    for name, seconds in timeouts.items():
        _check_seconds(name, seconds)
    if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
        raise ConfigurationError(f"read_ahead must be an int >= 0, got {read_ahead!r}")
    if not isinstance(cluster, bool):
        raise ConfigurationError(f"cluster must be True or False, got {cluster!r}")
    if poison_entries not in ("dead-letter", "stop"):
        raise ConfigurationError(
            f"poison_entries must be 'dead-letter' or 'stop', got {poison_entries!r}"
        )
    if retention is not None and not isinstance(retention, StreamRetention):
        raise ConfigurationError(
            f"retention must be StreamRetention or None, got {type(retention).__name__}"
        )
    if not isinstance(check_acl, bool):
        raise ConfigurationError(f"check_acl must be True or False, got {check_acl!r}")


class RedisBroker(MessageSource):
    """Topics of N queues on Redis Streams: producer, message source and group coordinator.

    Ordering guarantee: each queue is one stream whose entry ids are the queue
    offsets (offset ``n`` is id ``<n+1>-0``); pulls return messages in offset order,
    and offsets are consecutive (assigned atomically with the append by a Lua
    script). :meth:`send` picks the queue by CRC-32 of the first key, round-robin
    (per broker instance) without keys, or ``queue_id``. Nothing is ordered across
    queues. Retries come back through ``%RETRY%<group>`` in due order, after
    RocketMQ's delay levels measured on the Redis server's clock.

    Failures: a lost connection is retried with exponential backoff (``send`` and
    ``send_back`` for up to ``send_timeout`` seconds, then
    :class:`~stagedconsumer.SourceError`; :meth:`pull` raises
    ``SourceError(retriable=True)`` at once and the consumer's pull loop backs off).
    A send retried after its reply was lost may append the message twice
    (at-least-once); a send that raised was not appended, or is a duplicate of one
    that was. Redis without persistence loses everything on a restart: use
    ``appendonly yes`` for data that must survive it.

    Entering it (``async with RedisBroker(...)``) checks the connection with a
    ``PING``. A refused or reset connection (Redis starting or restarting) is
    retried with backoff, one WARNING per attempt, for up to ``connect_timeout``
    seconds (5 by default), then :class:`~stagedconsumer.SourceError`; an unknown
    host, refused credentials or a failed TLS handshake raise it at once
    (``retriable=False``).

    Runs on asyncio (with redis-py's asyncio client, replies parsed by hiredis) and on
    trio (with coredis, anyio-based); the event loop it is entered on picks the
    client. On trio it must be entered before use.

    :meth:`group_coordinator` provides membership and queue locks for consumer
    groups spread over several processes, with ``group_options``.

    **Redis Cluster**: ``RedisBroker("redis://host:port", cluster=True)`` with the URL
    of any node; the client reads the cluster's layout from it and sends each
    command to the master of its key's slot (redis-py's
    ``redis.asyncio.cluster.RedisCluster`` on asyncio, ``coredis.RedisCluster`` on
    trio). Every key carries a hash tag, so each Lua script touches one slot: a
    queue's stream and counter share the queue's slot, a group's members, locks
    and retry set the group's. Queues spread over the masters; a group's
    coordination lives on one. When a master fails, its replica takes over and the
    calls in between fail as connection losses (retried as above). Replication is
    asynchronous in Redis Cluster: a write a master acknowledged just before it
    crashed can be missing on the replica that replaces it.

    **Retention** (``retention``, a :class:`StreamRetention`): by default every
    stream the broker writes (topics' queues, retry and dead-letter queues, the
    message trace topic) keeps its entries 72 hours (RocketMQ's
    ``fileReservedTime``), trimmed on write with ``XTRIM MINID ~``, never past what
    a live consumer group has not committed (unless ``hard_max_length`` is
    reached); a consumer whose offset was trimmed away logs a WARNING, counts it
    (``trimmed_offsets``) and goes on per ``consume_from_where``. ``None`` keeps
    everything. Attached streams are never trimmed.

    **Corrupt entries** never stop a consumer for good. An entry with the
    broker's fields that cannot be decoded (a *poison entry*: a born time that is
    not a number, a message id that is not UTF-8, keys or properties that are not
    JSON of strings) is returned by :meth:`pull` as an
    :class:`~stagedconsumer.UndecodableEntry` beside the messages around it, and a
    consumer moves it to its group's dead-letter queue with its fields as stored,
    logs it once and counts it (``undecodable_entries``). With
    ``poison_entries="stop"`` the queue stops at it instead (pulls raise
    :class:`~stagedconsumer.SourceError` naming the stream, the entry and the
    error, and the consumer retries with backoff until someone repairs or deletes
    it). An entry the broker did not write (a *foreign* entry, another
    application's ``XADD *``) always stops the queue there, after the messages
    before it are delivered; errors and logs name its fields and their sizes, never
    its values.

    **Permissions** (Redis ACLs): entering checks, in one ``EVAL`` (Redis 7.0 and
    later), that the connection's user may run every command the broker needs on
    the keys ``<namespace>:*``, and raises :class:`~stagedconsumer.SourcePermissionError`
    naming the ones it may not and the ACL to grant (``check_acl=False`` skips this,
    for a user that only reads). A command refused later (``NOPERM``, also from
    inside the broker's Lua scripts, which then name the refused command) raises
    it too: a consumer that gets it stops after draining, and raises it.

    **Source identity**: offset stores key progress by :meth:`source_id`,
    ``redis://host:port/db#namespace`` by default, so a group given a store that
    holds its progress on another Redis or namespace starts afresh there
    (``consume_from_where``) instead of resuming at offsets that mean other
    messages. ``source_id=`` sets it: keep the old one when the same data moves to
    another address.

    **TLS**: ``ssl=`` an :class:`ssl.SSLContext` of your own, or
    :class:`~stagedconsumer.RedisTLS` (``ca_file``, and ``cert_file``/``key_file``
    for mutual TLS), or ``True`` (the system's CAs); a ``rediss://`` URL means
    ``ssl=True``. The same context serves redis-py (asyncio) and coredis (trio):
    the server's certificate and its host name are checked on both (unless the
    context says ``check_hostname=False``), and a failed handshake fails entering
    the broker at once, with the TLS reason. TLS options in the URL's query
    (``ssl_ca_certs=...``) are refused: each client read them differently.

    ``read_ahead`` (default 128): every ``XRANGE`` of a pull reads at least this many
    entries, and the next pulls of that queue take the surplus without a round trip
    (the consumer pulls ``pull_batch_size``, 32, at a time). Round trips dominate the
    cost of a pull, so this is what lets a consumer process keep up with a busy
    topic. Each consumed queue holds up to ``read_ahead - 1`` messages beyond the
    consumer's own ``pull_threshold_*`` limits: lower it for large messages, 0
    turns it off. Much larger values do not pay: 64 to 256 cost the same CPU per
    message, and larger replies make the cyclic garbage collector run more often
    (``benchmarks/redis_e2e.py`` shows its share).
    """

    groups_span_processes: ClassVar[bool] = True

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "sc",
        group_options: GroupOptions | None = None,
        send_timeout: float = 30.0,
        socket_timeout: float = 10.0,
        read_ahead: int = 128,
        connect_timeout: float = 5.0,
        cluster: bool = False,
        poison_entries: Literal["dead-letter", "stop"] = "dead-letter",
        retention: StreamRetention | None = _DEFAULT_RETENTION,
        ssl: ssl_module.SSLContext | RedisTLS | bool | None = None,
        check_acl: bool = True,
        source_id: str | None = None,
    ) -> None:
        _check_options(
            url=url,
            namespace=namespace,
            group_options=group_options,
            timeouts={
                "send_timeout": send_timeout,
                "socket_timeout": socket_timeout,
                "connect_timeout": connect_timeout,
            },
            read_ahead=read_ahead,
            cluster=cluster,
            poison_entries=poison_entries,
            retention=retention,
            check_acl=check_acl,
        )
        self.connect_timeout = connect_timeout
        """Entering the broker waits this long at most for Redis to answer ``PING``
        (retrying refused connections meanwhile)."""
        self.read_ahead = read_ahead
        """Entries read per ``XRANGE`` at least (see :meth:`pull`); 0: only what a
        pull asks for."""
        self._buffered: dict[tuple[str, int, int], tuple[list[Message], int]] = {}
        self._url = url
        self.namespace = namespace
        """The prefix of the keys of the broker's own topics, groups and retries
        (``"sc"`` by default): brokers with different namespaces share one Redis."""
        self.send_timeout = send_timeout
        """How long ``send`` retries a lost connection on its queue, in seconds."""
        self.cluster = cluster
        """Whether ``url`` is a node of a Redis Cluster (see the class documentation)."""
        self.retention = retention
        """How long the streams this broker writes keep their entries (``None``: for
        ever; see :class:`StreamRetention`)."""
        self._retention_args = retention.script_args() if retention else _NO_RETENTION
        self._forced_trims = 0
        self.poison_entries: Literal["dead-letter", "stop"] = poison_entries
        """What a pull does at an entry with the broker's fields that cannot be decoded
        (see the class documentation)."""
        self.check_acl = check_acl
        """Entering checks that the Redis user may run every command the broker needs
        on the keys of its namespace (see the class documentation)."""
        self._connect(url, socket_timeout, connect_timeout, cluster, ssl)
        self._topic_cache: dict[str, int] = {}
        self._attached: dict[str, _Attached] = {}
        self._round_robin: dict[str, itertools.count[int]] = {}
        self._id_prefix = f"{os.getpid():08X}{id(self) & 0xFFFFFFFF:08X}"
        self._id_seq = itertools.count()
        self._coordinator = RedisCoordinator(
            self._connection, group_options or GroupOptions(), namespace=namespace
        )
        self._bad_retries = 0
        self._source_id = source_id_of(
            source_id or redis_source_id(url, namespace, cluster=cluster)
        )

    def source_id(self) -> str:
        """``redis://host:port/db#namespace`` (``redis-cluster://host:port#namespace``
        for a cluster), without credentials, or the ``source_id=`` given: the
        identity offset stores key this broker's progress by. Set ``source_id`` to
        the old identity when the same data moves to another address (a new host,
        a restored backup), so that groups resume where they were."""
        return self._source_id

    def _connect(
        self,
        url: str,
        socket_timeout: float,
        connect_timeout: float,
        cluster: bool,
        ssl: ssl_module.SSLContext | RedisTLS | bool | None,
    ) -> None:
        """The connection (no round trip yet: entering the broker connects) and the
        Lua scripts run on it."""
        connection = RedisConnection(
            url,
            socket_timeout=socket_timeout,
            connect_timeout=connect_timeout,
            cluster=cluster,
            tls=resolve_tls(url, ssl),
        )
        # Redis may have restarted without its data: offsets could be reused.
        connection.on_connection_error.append(self._buffered.clear)
        self._connection = connection
        self._send_script = RedisScript(connection, SEND_LUA)
        self._release_script = RedisScript(connection, RELEASE_LUA)
        self._floor_script = RedisScript(connection, FLOOR_LUA)
        self._delay_script = RedisScript(connection, DELAY_LUA)
        self._min_offset_script = RedisScript(connection, MIN_OFFSET_LUA)
        self._offset_for_time_script = RedisScript(connection, OFFSET_FOR_TIME_LUA)

    @property
    def tls(self) -> ssl_module.SSLContext | None:
        """The TLS context of the connections (``None``: plain TCP)."""
        return self._connection.tls

    @property
    def url(self) -> str:
        """The Redis URL, its password masked (``redis://user:***@host:6379/0``), as
        every message, log line and ``repr`` of the broker shows it."""
        return self._connection.url

    def __repr__(self) -> str:
        return f"RedisBroker({self.url!r}, namespace={self.namespace!r})"

    # -- keys ----------------------------------------------------------------------------

    def _stream_key(self, topic: str, queue_id: int) -> str:
        return f"{self.namespace}:q:{{{topic}:{queue_id}}}"

    def _seq_key(self, topic: str, queue_id: int) -> str:
        return f"{self.namespace}:seq:{{{topic}:{queue_id}}}"

    def _times_key(self, topic: str, queue_id: int) -> str:
        return f"{self.namespace}:times:{{{topic}:{queue_id}}}"

    def _floors_key(self, topic: str, queue_id: int) -> str:
        return f"{self.namespace}:floors:{{{topic}:{queue_id}}}"

    def _delay_key(self, group: str, queue_id: int = 0) -> str:
        # the retry queue's hash tag: RELEASE_LUA moves from here into that queue
        return f"{self.namespace}:delay:{{{RETRY_PREFIX}{group}:{queue_id}}}"

    def _bad_delay_key(self, group: str, queue_id: int = 0) -> str:
        return f"{self.namespace}:delay-bad:{{{RETRY_PREFIX}{group}:{queue_id}}}"

    @property
    def _topics_key(self) -> str:
        return f"{self.namespace}:topics"

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> RedisBroker:
        """Check that Redis answers (``PING``) within ``connect_timeout`` seconds.

        A refused or reset connection is retried with backoff (one WARNING per
        attempt) while Redis is not there yet. Raises
        :class:`~stagedconsumer.SourceError` naming the URL (its password masked)
        when it still is not after ``connect_timeout`` seconds, and at once when
        waiting cannot help (``retriable=False``: an unknown host, a wrong password,
        a failed TLS handshake); the broker is closed then. Connection losses after
        this are retried with backoff (see the class documentation).
        """
        try:
            await self._connection.open(self.connect_timeout)
            if self.check_acl:
                await self._check_acl()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def _check_acl(self) -> None:
        """Raise ``SourceError(retriable=False)`` naming the commands the Redis user
        may not run on ``<namespace>:*`` (nothing on a server older than 7.0, which
        cannot tell)."""
        connection = self._connection
        user = urllib.parse.urlsplit(self._url).username or "default"
        try:
            refused = await connection.call(
                "checking the Redis user's permissions",
                lambda: check_permissions(connection.execute, self.namespace),
            )
        except SourcePermissionError as exc:
            if "'eval'" not in str(exc).lower():
                raise
            refused = ["EVAL"]
        if refused:
            raise SourcePermissionError(permission_message(refused, self.namespace, user))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (when the broker created the client)."""
        self._buffered.clear()
        await self._connection.aclose()

    @property
    def redis(self) -> Any:
        """The Redis client in use, for tools: redis-py's ``redis.asyncio.Redis`` on
        asyncio, ``coredis.Redis`` on trio, their ``RedisCluster`` with ``cluster=True``
        (``None`` before the broker was entered or first used). Its replies are raw
        (no response callbacks)."""
        return self._connection.client if self._connection.library else None

    @property
    def client_library(self) -> str | None:
        """The client in use: ``"redis-py"`` (asyncio) or ``"coredis"`` (trio);
        ``None`` before the broker was entered or first used."""
        return self._connection.library

    @property
    def connection_errors(self) -> int:
        """Redis calls that failed on the connection (each retried or reported),
        the coordinator's included."""
        return self._connection.connection_errors

    def store_host(self) -> str:
        """The Redis server's ``host:port`` (its socket path for a ``unix://`` URL)."""
        parsed = urllib.parse.urlparse(self._url)
        if parsed.scheme == "unix":
            return parsed.path
        return f"{parsed.hostname or 'localhost'}:{parsed.port or 6379}"

    def group_coordinator(self) -> RedisCoordinator:
        return self._coordinator

    async def _retrying(self, what: str, fn: Callable[[], Awaitable[_T]]) -> _T:
        """A call retried on connection loss for up to ``send_timeout`` seconds."""
        return await self._connection.call_retrying(what, fn, self.send_timeout)

    # -- topics ------------------------------------------------------------------------------

    async def create_topic(self, topic: str, queue_count: int = 8) -> list[MessageQueue]:
        """Create ``topic`` with ``queue_count`` queues (idempotent for the same count)."""
        if not topic or not isinstance(topic, str):
            raise ConfigurationError(f"topic must be a non-empty string, got {topic!r}")
        if _is_system(topic) or ":" in topic:
            raise ConfigurationError(f"topic {topic!r} uses a reserved prefix or ':'")
        if isinstance(queue_count, bool) or not isinstance(queue_count, int) or queue_count < 1:
            raise ConfigurationError(f"queue_count must be a positive int, got {queue_count!r}")
        key = self._topics_key

        execute = self._connection.execute

        async def create() -> Any:
            await execute("HSETNX", key, topic, queue_count)
            return await execute("HGET", key, topic)

        stored = int(await self._retrying(f"creating topic {topic!r}", create))
        if stored != queue_count:
            raise ConfigurationError(
                f"topic {topic!r} exists with {stored} queues, not {queue_count}"
            )
        self._topic_cache[topic] = queue_count
        return [MessageQueue(topic, i) for i in range(queue_count)]

    async def queue_count(self, topic: str) -> int:
        """The number of queues of ``topic`` (2 for a retry topic, normal and gray;
        1 for a DLQ topic)."""
        if topic.startswith(RETRY_PREFIX):
            return RETRY_QUEUE_COUNT
        if _is_system(topic):
            return 1
        attached = self._attached.get(topic)
        if attached is not None:
            return len(attached.stream_keys)
        cached = self._topic_cache.get(topic)
        if cached is not None:
            return cached
        value = await self._retrying(
            f"reading topic {topic!r}",
            lambda: self._connection.execute("HGET", self._topics_key, topic),
        )
        if value is None:
            raise UnknownTopicError(
                f"topic {topic!r} does not exist in Redis namespace {self.namespace!r};"
                " create it with create_topic()"
            )
        self._topic_cache[topic] = count = int(value)
        return count

    async def get_queues(self, topic: str) -> Sequence[MessageQueue]:
        return [MessageQueue(topic, i) for i in range(await self.queue_count(topic))]

    # -- producer --------------------------------------------------------------------------

    def _next_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_seq):016X}"

    async def _pick_queue(self, topic: str, keys: tuple[str, ...], queue_id: int | None) -> int:
        count = await self.queue_count(topic)
        if queue_id is None:
            if keys:
                return zlib.crc32(keys[0].encode()) % count
            rr = self._round_robin.get(topic)
            if rr is None:
                rr = self._round_robin[topic] = itertools.count()
            return next(rr) % count
        if isinstance(queue_id, bool) or not isinstance(queue_id, int):
            raise InvalidMessageError(f"queue_id must be an int or None, got {queue_id!r}")
        if not 0 <= queue_id < count:
            raise InvalidMessageError(
                f"queue_id {queue_id} out of range for topic {topic!r} with {count} queues"
            )
        return queue_id

    def _send_call(
        self, topic: str, queue_id: int, encoded: Sequence[list[bytes]]
    ) -> Callable[[], Awaitable[Any]]:
        args: list[bytes | int] = [*self._retention_args, len(encoded)]
        for fields in encoded:
            args.append(len(fields))
            args.extend(fields)
        keys = [
            self._seq_key(topic, queue_id),
            self._stream_key(topic, queue_id),
            self._times_key(topic, queue_id),
            self._floors_key(topic, queue_id),
        ]
        return functools.partial(self._send_script, keys=keys, args=args)

    def _sent(self, topic: str, queue_id: int, reply: Sequence[Any]) -> int:
        """The first offset of a send's reply; logs and counts a forced trim."""
        forced = int(reply[1])
        if forced:
            self._trimmed_live(MessageQueue(topic, queue_id), forced, int(reply[2]))
        return int(reply[0])

    def _trimmed_live(self, mq: MessageQueue, forced: int, cut: int) -> None:
        self._forced_trims += forced
        logger.warning(
            "%s reached its hard max length (%s entries): trimmed it to offset %d, about"
            " %d entries a live consumer group had not committed (its consumer reports"
            " the offset as trimmed and goes on per consume_from_where)",
            mq,
            self.retention.hard_max_length if self.retention else None,
            cut,
            forced,
        )

    async def _append(self, topic: str, queue_id: int, encoded: Sequence[list[bytes]]) -> int:
        reply = await self._retrying(
            f"sending to {topic}#{queue_id}", self._send_call(topic, queue_id, encoded)
        )
        return self._sent(topic, queue_id, reply)

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
        """Append a message to a queue of ``topic`` and return it as stored.

        When OpenTelemetry is loaded and a span is current, its context is added as
        the W3C ``traceparent`` property (the message's creation context).

        The message is checked as :class:`~stagedconsumer.Producer` checks it:
        :class:`~stagedconsumer.InvalidMessageError` for a body that is not bytes,
        keys, tags or properties that are not strings.
        """
        outgoing = OutgoingMessage.of(body, keys=keys, tags=tags, properties=properties)
        if _is_system(topic):
            raise ConfigurationError(f"cannot send to system topic {topic!r}")
        properties = with_traceparent(outgoing.properties)
        key_tuple, tags, body = outgoing.keys, outgoing.tags, outgoing.body
        self._check_not_attached(topic)
        qid = await self._pick_queue(topic, key_tuple, queue_id)
        msg_id = self._next_id()
        born = time.time()
        fields = _encode_fields(msg_id, body, round(born * 1000), key_tuple, tags, properties, 0)
        offset = await self._append(topic, qid, [fields])
        return Message(
            topic=topic,
            queue_id=qid,
            queue_offset=offset,
            body=body,
            keys=key_tuple,
            tags=tags,
            properties=properties,
            msg_id=msg_id,
            born_timestamp=round(born * 1000) / 1000,
        )

    async def append(self, mq: MessageQueue, messages: Sequence[OutgoingMessage]) -> list[Message]:
        """One Lua call appends every message (consecutive offsets); no retry here."""
        topic, queue_id = mq.topic, mq.queue_id
        self._check_not_attached(topic)
        count = await self.queue_count(topic)
        if not 0 <= queue_id < count:
            raise InvalidMessageError(
                f"queue_id {queue_id} out of range for topic {topic!r} with {count} queues"
            )
        born_ms = round(time.time() * 1000)
        ids = [self._next_id() for _ in messages]
        encoded = [
            _encode_fields(msg_id, m.body, born_ms, m.keys, m.tags, m.properties, 0)
            for msg_id, m in zip(ids, messages, strict=True)
        ]
        reply = await self._connection.call(
            f"sending to {mq}", self._send_call(topic, queue_id, encoded)
        )
        first = self._sent(topic, queue_id, reply)
        return [
            Message(
                topic=topic,
                queue_id=queue_id,
                queue_offset=first + i,
                body=m.body,
                keys=m.keys,
                tags=m.tags,
                properties=m.properties,
                msg_id=msg_id,
                born_timestamp=born_ms / 1000,
            )
            for i, (msg_id, m) in enumerate(zip(ids, messages, strict=True))
        ]

    async def send_many(
        self,
        topic: str,
        bodies: Iterable[bytes],
        *,
        queue_id: int | None = None,
        chunk: int = 500,
    ) -> int:
        """Append many key-less messages (round-robin over queues, or all to
        ``queue_id``), ``chunk`` per Lua call per queue. Returns how many."""
        self._check_not_attached(topic)
        count = await self.queue_count(topic)
        pending: dict[int, list[list[bytes]]] = {}
        total = 0
        for body in bodies:
            if not isinstance(body, (bytes, bytearray, memoryview)):
                raise InvalidMessageError(f"body must be bytes, got {type(body).__name__}")
            qid = await self._pick_queue(topic, (), queue_id)
            batch = pending.setdefault(qid, [])
            batch.append(
                _encode_fields(
                    self._next_id(), bytes(body), round(time.time() * 1000), (), None, None, 0
                )
            )
            total += 1
            if len(batch) >= chunk:
                await self._append(topic, qid, batch)
                pending[qid] = []
        for qid, batch in pending.items():
            if batch:
                await self._append(topic, qid, batch)
        del count
        return total

    # -- MessageSource ---------------------------------------------------------------------

    async def pull(
        self, mq: MessageQueue, offset: int, max_count: int, *, timeout: float = 0.0
    ) -> PullResult:
        """Up to ``max_count`` messages from ``offset`` (one ``XRANGE``); long polls
        with ``XREAD BLOCK``. On the retry queue, due retries are released first.

        Each ``XRANGE`` asks for ``max(max_count, read_ahead)`` entries; what the pull
        does not return is kept, and the next pull of the queue from where this one
        ended takes its messages from there without a round trip (entries never
        change once written, so they are the same messages a later ``XRANGE`` would
        return).

        ``max_offset`` of the result is exact when the ``XRANGE`` came back short,
        and a lower bound (the end of what was read) otherwise: reading the counter
        too would cost a second round trip on every pull of a busy queue.
        """
        topic, queue_id = mq.topic, mq.queue_id
        offset = max(offset, 0)
        if self._buffered:
            buffered = self._buffered.pop((topic, queue_id, offset), None)
            if buffered is not None:
                return self._serve(topic, queue_id, *buffered, max_count)
        if self._attached:
            attached = self._attached.get(topic)
            if attached is not None:
                return await self._pull_attached(mq, attached, offset, max_count, timeout)
        stream = self._stream_key(topic, queue_id)
        what = f"pulling {mq} at {offset}"
        count = max(max_count, self.read_ahead)
        entries = await self._read(mq, stream, offset, count, timeout, what)
        if not entries:
            return await self._pulled_nothing(mq, stream, offset, what)
        try:
            messages = _decode_entries(topic, queue_id, entries)
        except Exception:  # a foreign or a poison entry: one by one
            return await self._pull_entry_by_entry(mq, stream, entries, max_count)
        end = messages[-1].queue_offset + 1
        if messages[0].queue_offset == offset and end - offset == len(messages):
            # Consecutive from ``offset`` on: ``end`` is the max offset when the
            # read came back short, a lower bound when it was full.
            return self._serve(topic, queue_id, messages, end, max_count)
        return await self._pulled_with_gaps(mq, stream, offset, entries, messages, max_count)

    async def _read(
        self, mq: MessageQueue, stream: str, offset: int, count: int, timeout: float, what: str
    ) -> Any:
        """The raw entries of ``stream`` from ``offset`` on, up to ``count`` (one
        ``XRANGE``); when there are none, waits up to ``timeout`` seconds for some
        (``XREAD BLOCK``). On a retry queue, due retries are released into it first
        (and while waiting, by the time the next one is due)."""
        topic, queue_id = mq.topic, mq.queue_id
        release_keys: list[str] | None = None
        if topic.startswith(RETRY_PREFIX):
            group = topic[len(RETRY_PREFIX) :]
            release_keys = [
                self._delay_key(group, queue_id),
                self._seq_key(topic, queue_id),
                stream,
                self._bad_delay_key(group, queue_id),
                self._times_key(topic, queue_id),
                self._floors_key(topic, queue_id),
            ]
        deadline = time.monotonic() + timeout if timeout > 0 else 0.0
        start = b"%d-0" % (offset + 1)
        connection = self._connection
        while True:
            wait_ms = -1
            if release_keys is not None:
                wait_ms = await self._release_retries(mq, release_keys, what)
            entries = await connection.call(
                what, lambda: connection.execute("XRANGE", stream, start, "+", "COUNT", count)
            )
            if entries or not timeout:
                return entries
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return entries
            block = min(remaining, _MAX_BLOCK)
            if wait_ms >= 0:
                block = min(block, max(wait_ms, 1) / 1000)
            wait = functools.partial(self._wait_for_entries, stream, offset, count, block)
            entries = await connection.call(what, wait)
            if entries:
                return entries

    async def _release_retries(self, mq: MessageQueue, keys: list[str], what: str) -> int:
        """Move the due retries of a retry queue into its stream (the release script);
        returns how many ms until the next one is due (-1: none waits)."""
        release = functools.partial(
            self._release_script, keys=keys, args=[_RELEASE_BATCH, *self._retention_args]
        )
        released = await self._connection.call(what, release)
        if int(released[1]):
            self._trimmed_live(mq, int(released[1]), int(released[2]))
        if len(released) > 3:
            self._moved_bad_retries(keys, released[3:])
        return int(released[0])

    async def _pulled_with_gaps(
        self,
        mq: MessageQueue,
        stream: str,
        offset: int,
        entries: Sequence[Any],
        messages: list[Message],
        max_count: int,
    ) -> PullResult:
        """:meth:`pull` when the messages read are not consecutive from ``offset``:
        entries were deleted (``XDEL``, ``MAXLEN``), or one is foreign. The counter
        tells: every entry the broker wrote is below it."""
        topic, queue_id = mq.topic, mq.queue_id
        max_offset = await self._counter(mq, f"pulling {mq} at {offset}")
        if messages[-1].queue_offset + 1 > max_offset:
            return await self._pull_entry_by_entry(
                mq, stream, entries, max_count, max_offset=max_offset
            )
        first = messages[0].queue_offset
        if first > offset and await self._first_stored(mq, stream) >= first:
            # Not a hole (XDEL) after stored entries: the head of the stream up to
            # ``first`` was trimmed (retention): the consumer decides.
            self._keep(topic, queue_id, first, messages, max_offset)
            return PullResult(
                messages=[], next_offset=first, max_offset=max_offset, offset_moved=True
            )
        return self._serve(topic, queue_id, messages, max_offset, max_count)

    async def _pulled_nothing(
        self, mq: MessageQueue, stream: str, offset: int, what: str
    ) -> PullResult:
        """:meth:`pull` when ``stream`` has no entry from ``offset`` on: caught up, or
        trimmed past ``offset`` (then the result moves the offset to the end)."""
        connection = self._connection
        max_offset = await self._counter(mq, what)
        start = b"%d-0" % (offset + 1)
        if offset < max_offset and not await connection.call(
            what, lambda: connection.execute("XRANGE", stream, start, "+", "COUNT", 1)
        ):
            # Sent below the counter (read after the XRANGE: a send in between would
            # show now) but no longer stored: trimmed up to the end.
            return PullResult(
                messages=[], next_offset=max_offset, max_offset=max_offset, offset_moved=True
            )
        return PullResult(messages=[], next_offset=min(offset, max_offset), max_offset=max_offset)

    async def _counter(self, mq: MessageQueue, what: str) -> int:
        """The queue's counter: one past the last offset the broker wrote to it."""
        connection = self._connection
        seq = self._seq_key(mq.topic, mq.queue_id)
        return int(await connection.call(what, lambda: connection.execute("GET", seq)) or 0)

    async def _pull_entry_by_entry(
        self,
        mq: MessageQueue,
        stream: str,
        entries: Sequence[Any],
        max_count: int,
        *,
        max_offset: int | None = None,
    ) -> PullResult:
        """:meth:`pull` when an entry did not decode: the entries one at a time.

        Every message up to the first foreign entry (one the broker did not write, or
        past the queue's counter) is returned, and every poison entry among them as
        :class:`UndecodableEntry` (or, with ``poison_entries="stop"``, the pull stops
        at the first). A pull that starts at the entry it stops at raises
        :class:`SourceError` (not retriable) naming the stream and the entry, its
        field names and sizes, not its values."""
        topic, queue_id = mq.topic, mq.queue_id
        if max_offset is None:
            max_offset = await self._counter(mq, f"pulling {mq}")
        messages: list[Message] = []
        undecodable: list[UndecodableEntry] = []
        stop: SourceError | None = None
        for entry in entries:
            if len(messages) + len(undecodable) >= max_count:
                break
            entry_id, raw = entry
            try:
                message = _decode_one(topic, queue_id, entry)
            except _ForeignEntry as exc:
                stop = _foreign_error(stream, exc)
                break
            except Exception as exc:
                poison = self._undecodable(mq, stream, entry_id, raw, exc)
                if self.poison_entries == "stop":
                    stop = SourceError(
                        f"stream {stream}: entry {entry_id.decode()}"
                        f" at offset {poison.offset} of {mq} cannot be decoded"
                        f"{_field_sizes(raw)}: {poison.error}; stopped there"
                        " (poison_entries='stop'; 'dead-letter' moves it to the group's DLQ)",
                        retriable=False,
                    )
                    break
                undecodable.append(poison)
                continue
            if message.queue_offset >= max_offset:
                stop = _foreign_error(
                    stream,
                    _ForeignEntry(entry_id, raw),
                    f"past the queue's last offset {max_offset}",
                )
                break
            messages.append(message)
        if not messages and not undecodable:
            assert stop is not None
            raise stop
        last = max(
            messages[-1].queue_offset if messages else -1,
            undecodable[-1].offset if undecodable else -1,
        )
        return PullResult(
            messages=messages,
            next_offset=last + 1,
            max_offset=max_offset,
            undecodable=undecodable,
        )

    @staticmethod
    def _undecodable(
        mq: MessageQueue, stream: str, entry_id: bytes, raw: Sequence[bytes], exc: Exception
    ) -> UndecodableEntry:
        offset = _entry_offset(entry_id)
        error = f"{type(exc).__name__}: {exc}"[:1000]
        properties = {
            PROPERTY_DECODE_ERROR: error,
            PROPERTY_POISON_STREAM: stream,
            PROPERTY_POISON_ENTRY_ID: entry_id.decode(),
        }
        return UndecodableEntry(
            offset=offset,
            error=error,
            message=_poison_message(mq.topic, mq.queue_id, offset, raw, properties),
            fields=tuple(zip(raw[::2], raw[1::2], strict=False)),
        )

    def _moved_bad_retries(self, keys: Sequence[str], members: Sequence[Any]) -> None:
        """Log (once each: the script moved them out of the delay set) and count the
        members of a delay set that were not packed messages."""
        for member in members:
            raw = member if isinstance(member, bytes) else str(member).encode()
            self._bad_retries += 1
            logger.warning(
                "%s holds a member that is not a retry the broker wrote (%d bytes, not"
                " <len>:<bytes> field pairs); moved it to %s, the retries behind it go on",
                keys[0],
                len(raw),
                keys[3],
            )

    async def _first_stored(self, mq: MessageQueue, stream: str) -> int:
        """The offset of the first entry of ``stream`` (-1: none, or not ours)."""
        first = await self._connection.call(
            f"pulling {mq}",
            functools.partial(self._connection.execute, "XRANGE", stream, "-", "+", "COUNT", 1),
        )
        if not first:
            return -1
        raw = first[0][0]
        try:
            return _entry_offset(raw if isinstance(raw, bytes) else str(raw).encode())
        except (_ForeignEntry, ValueError):
            return -1

    def _keep(
        self, topic: str, queue_id: int, offset: int, messages: list[Message], max_offset: int
    ) -> None:
        """Buffer ``messages`` (from ``offset`` on) for the next pull from ``offset``."""
        buffered = self._buffered
        if len(buffered) >= _MAX_BUFFERED:
            del buffered[next(iter(buffered))]  # the oldest
        buffered[topic, queue_id, offset] = (messages, max_offset)

    def _serve(
        self,
        topic: str,
        queue_id: int,
        messages: list[Message],
        max_offset: int,
        max_count: int,
    ) -> PullResult:
        """The first ``max_count`` of ``messages``; keeps the rest for the next pull."""
        if len(messages) > max_count:
            rest = messages[max_count:]
            messages = messages[:max_count]
            next_offset = messages[-1].queue_offset + 1
            buffered = self._buffered
            if len(buffered) >= _MAX_BUFFERED:
                del buffered[next(iter(buffered))]  # the oldest
            buffered[topic, queue_id, next_offset] = (rest, max_offset)
            return PullResult(messages=messages, next_offset=next_offset, max_offset=max_offset)
        return PullResult(
            messages=messages,
            next_offset=messages[-1].queue_offset + 1,
            max_offset=max_offset,
        )

    async def _wait_for_entries(
        self, stream: str, offset: int, count: int, block: float
    ) -> list[Any]:
        """``XREAD BLOCK``: the entries from ``offset`` on once there are any (raw)."""
        block_ms = max(1, int(block * 1000))
        reply = await self._connection.execute(
            "XREAD",
            "COUNT",
            count,
            "BLOCK",
            block_ms,
            "STREAMS",
            stream,
            b"%d-0" % offset,
            keys=(5,),
        )
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3: a map of stream -> entries
            return list(next(iter(reply.values())))
        return list(reply[0][1])

    async def max_offset(self, mq: MessageQueue) -> int:
        """The offset the next message of ``mq`` will get (for an attached stream: one
        past its last entry ever written, ``XINFO STREAM``'s ``last-generated-id``)."""
        attached = self._attached.get(mq.topic)
        if attached is not None:
            return await self._attached_end(mq, attached.stream_keys[mq.queue_id])
        if mq.topic.startswith(RETRY_PREFIX):
            # Release due retries first, as the embedded broker does.
            await self.pull(mq, 2**62, 1)
        value = await self._retrying(
            f"reading the max offset of {mq}",
            lambda: self._connection.execute("GET", self._seq_key(mq.topic, mq.queue_id)),
        )
        return int(value or 0)

    async def min_offset(self, mq: MessageQueue) -> int:
        """The offset of the first entry still stored, or, when there is none, the
        offset the next message will get.

        The first entry and the counter are read in one Lua script: read one after the
        other, a queue seen empty could be reported at a counter that messages sent
        in between already moved on, and a consumer starting there (a queue without
        committed progress) would skip them.
        """
        attached = self._attached.get(mq.topic)
        if attached is not None:
            key = attached.stream_keys[mq.queue_id]
            first = await self._retrying(
                f"reading the min offset of {mq}",
                lambda: self._connection.execute("XRANGE", key, "-", "+", "COUNT", 1),
            )
            if first:
                return self._attached_offset_of(key, first[0][0])
            return await self._attached_end(mq, key)
        if mq.topic.startswith(RETRY_PREFIX):
            await self.pull(mq, 2**62, 1)  # release due retries first, as max_offset does
        stream = self._stream_key(mq.topic, mq.queue_id)
        seq = self._seq_key(mq.topic, mq.queue_id)

        first, counter = await self._retrying(
            f"reading the min offset of {mq}",
            lambda: self._min_offset_script(keys=[stream, seq]),
        )
        if first:
            entry_id: Any = first[0][0]
            raw_id = entry_id if isinstance(entry_id, bytes) else entry_id.encode()
            try:
                offset = _entry_offset(raw_id)
            except _ForeignEntry as exc:
                raise _foreign_error(stream, exc) from None
            if offset >= int(counter or 0):
                raise _foreign_error(
                    stream, _ForeignEntry(raw_id), f"past the queue's last offset {counter}"
                )
            return offset
        return int(counter or 0)

    async def offset_for_timestamp(self, mq: MessageQueue, timestamp: float) -> int:
        """The offset of the first message of ``mq`` born at or after ``timestamp``
        (seconds since the epoch), or the max offset when there is none.

        An attached stream's entry ids are times: one ``XRANGE`` from
        ``<timestamp in ms>-0``. The broker's own queues store the born time (the
        producer's clock) in every entry: a binary search over offsets, in one Lua
        script (``OFFSET_FOR_TIME_LUA``), as the embedded broker searches its born
        times.
        """
        ms = max(math.ceil(timestamp * 1000), 0)
        attached = self._attached.get(mq.topic)
        if attached is not None:
            key = attached.stream_keys[mq.queue_id]
            first = await self._retrying(
                f"finding the offset of {mq} at {timestamp}",
                functools.partial(
                    self._connection.execute, "XRANGE", key, b"%d-0" % ms, "+", "COUNT", 1
                ),
            )
            if first:
                return self._attached_offset_of(key, first[0][0])
            return await self.max_offset(mq)
        keys = [self._stream_key(mq.topic, mq.queue_id), self._seq_key(mq.topic, mq.queue_id)]
        return int(
            await self._retrying(
                f"finding the offset of {mq} at {timestamp}",
                lambda: self._offset_for_time_script(keys=keys, args=[ms]),
            )
        )

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
        properties = origin_properties(message)
        # RocketMQ: the retry is a new stored copy (a new offsetMsgId) of the same
        # message (its msgId, the producer's UNIQ_KEY, is copied over).
        retried = attrs.evolve(
            message, reconsume_times=message.reconsume_times + 1, offset_msg_id=self._next_id()
        )
        packed = _pack(_message_fields(retried, properties))
        delay_ms = round(retry_delay_seconds(message.reconsume_times, delay_level) * 1000)
        # gray traffic is retried through the retry topic's gray queue (gray release)
        key = self._delay_key(group, 1 if properties.get(PROPERTY_GRAY) == "true" else 0)
        await self._retrying(
            f"sending {message.msg_id} back to {retry_topic(group)}",
            lambda: self._delay_script(keys=[key], args=[delay_ms, packed]),
        )
        return SendBackResult.RETRY

    async def hold_offsets(self, group: str, offsets: Mapping[MessageQueue, int]) -> None:
        """Record ``group``'s committed offsets of these queues: retention keeps every
        entry from there on while the record is live (``StreamRetention.group_ttl``,
        renewed by each call), unless a queue reaches its hard max length. Attached
        topics are skipped (never trimmed)."""
        ttl = round((self.retention.group_ttl if self.retention else 600.0) * 1000)
        for mq, offset in offsets.items():
            if mq.topic in self._attached:
                continue
            key = self._floors_key(mq.topic, mq.queue_id)
            await self._connection.call(
                f"recording the committed offset of {mq}",
                functools.partial(self._floor_script, keys=[key], args=[group, offset, ttl]),
            )

    async def send_to_dlq(self, group: str, message: Message) -> None:
        copy = attrs.evolve(message, offset_msg_id=self._next_id())
        await self._append(dlq_topic(group), 0, [_message_fields(copy, origin_properties(message))])

    async def send_undecodable_to_dlq(self, group: str, entry: UndecodableEntry) -> None:
        """The poison entry's message, with its raw fields kept in the dead-letter
        entry as ``raw:<name>`` fields (``XRANGE`` shows them; a pull ignores them)."""
        message = entry.message
        copy = attrs.evolve(message, offset_msg_id=self._next_id())
        fields = _message_fields(copy, origin_properties(message))
        for name, value in entry.fields:
            fields += [b"raw:" + name, value]
        await self._append(dlq_topic(group), 0, [fields])

    # -- streams written by other applications ---------------------------------------------

    async def attach_stream(
        self,
        topic: str,
        stream_keys: Sequence[str] | str,
        *,
        body_field: str = "body",
        decode: EntryDecoder | None = None,
    ) -> list[MessageQueue]:
        """Consume existing streams, written by other applications with plain ``XADD``,
        as the queues of ``topic``: one stream per queue, in the order given.

        Nothing is written to Redis (no topic entry, no Lua producer); the streams may
        not exist yet (a WARNING names those that do not: a misspelt key consumes
        nothing), and a WARNING names a stream whose last entry has no ``body_field``
        (the default decoder would give empty bodies). Every process of a consumer
        group attaches the same streams in the same order before its consumer starts;
        consumer groups, queue locks, fencing and the offset store work as for the
        broker's own topics.

        - **Offsets** come from the entry ids: ``<ms>-<seq>`` is offset
          ``ms * 2**19 + seq``, ordered as the ids and never shared by two entries (an
          id whose sequence part reaches 2**19 makes pulls raise
          :class:`~stagedconsumer.SourceError` naming it). Offsets are sparse: a pull
          resumes after the last finished entry, staged consumption counts stage
          offsets in messages, and the concurrent mode's span limit counts messages.
        - **Messages**: ``decode(entry_id, fields)`` returns the content as an
          :class:`~stagedconsumer.OutgoingMessage`; by default
          (``default_entry_decoder(body_field)``) ``body_field`` is the body and every
          other field a property. The message id is the entry id, the born time the
          id's milliseconds.
        - **Lag**: :meth:`max_offset` is one past the stream's last entry ever written
          (``XINFO STREAM``), so max offset minus committed offset is an id distance;
          :meth:`entries_after` counts the entries.

        ``send`` to an attached topic raises :class:`~stagedconsumer.ConfigurationError`
        (the other applications write these streams). Failed messages go through the
        group's retry queue as usual. Returns the topic's queues.
        """
        keys = self._check_attach(topic, stream_keys, body_field, decode)
        missing, lacking = await self._inspect_streams(keys, body_field if decode is None else None)
        # Warnings, not errors: a stream may be created after its consumer starts, and
        # entries of one stream may differ; but either is most often a typo.
        if missing:
            logger.warning(
                "attach_stream(%r): no stream %s exists (yet); attached anyway: its queue"
                " gets messages once something writes there (check the key for a typo)",
                topic,
                ", ".join(missing),
            )
        if lacking:
            logger.warning(
                "attach_stream(%r): the last entry of %s has no field %r: such entries"
                " are consumed with an empty body and every field as a property (give the"
                " body's field name as body_field=..., or a decode=...)",
                topic,
                "; ".join(lacking),
                body_field,
            )
        self._attached[topic] = _Attached(keys, decode or default_entry_decoder(body_field))
        return [MessageQueue(topic, i) for i in range(len(keys))]

    def _check_attach(
        self,
        topic: object,
        stream_keys: Sequence[str] | str,
        body_field: object,
        decode: object,
    ) -> tuple[str, ...]:
        """The stream keys of :meth:`attach_stream`'s arguments, checked (raises
        :class:`~stagedconsumer.ConfigurationError`)."""
        if not topic or not isinstance(topic, str):
            raise ConfigurationError(f"topic must be a non-empty string, got {topic!r}")
        if _is_system(topic):
            raise ConfigurationError(f"topic {topic!r} uses a reserved prefix")
        keys = (stream_keys,) if isinstance(stream_keys, str) else tuple(stream_keys)
        if not keys or not all(isinstance(key, str) and key for key in keys):
            raise ConfigurationError(
                f"stream_keys must be one or more stream key strings, got {stream_keys!r}"
            )
        if len(set(keys)) != len(keys):
            raise ConfigurationError(f"stream_keys repeat a key: {keys!r}")
        if not isinstance(body_field, str) or not body_field:
            raise ConfigurationError(f"body_field must be a non-empty string, got {body_field!r}")
        if decode is not None and not callable(decode):
            raise ConfigurationError(f"decode must be callable, got {decode!r}")
        if topic in self._topic_cache:
            raise ConfigurationError(f"topic {topic!r} is one of the broker's own topics")
        previous = self._attached.get(topic)
        if previous is not None and previous.stream_keys != keys:
            raise ConfigurationError(
                f"topic {topic!r} is attached to {list(previous.stream_keys)} already"
            )
        return keys

    async def _inspect_streams(
        self, keys: Sequence[str], body_field: str | None
    ) -> tuple[list[str], list[str]]:
        """The keys among ``keys`` that do not exist, and (with ``body_field``) those
        whose last entry lacks that field, described with its field names; raises
        :class:`~stagedconsumer.ConfigurationError` for a key that is not a stream."""
        execute = self._connection.execute
        missing: list[str] = []
        lacking: list[str] = []
        for key in keys:
            kind = await self._retrying(
                f"checking stream {key}", functools.partial(execute, "TYPE", key)
            )
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind not in ("stream", "none"):
                raise ConfigurationError(f"key {key!r} is a {kind}, not a stream")
            if kind == "none":
                missing.append(key)
            elif body_field is not None:
                last = await self._retrying(
                    f"reading the last entry of stream {key}",
                    functools.partial(execute, "XREVRANGE", key, "+", "-", "COUNT", 1),
                )
                names = [bytes(name) for name in (last[0][1][::2] if last else ())]
                if names and body_field.encode() not in names:
                    fields = ", ".join(repr(n.decode(errors="replace")) for n in names)
                    lacking.append(f"{key} (fields {fields})")
        return missing, lacking

    def _check_not_attached(self, topic: str) -> None:
        if topic in self._attached:
            raise ConfigurationError(
                f"topic {topic!r} is attached to streams other applications write"
                " (attach_stream): write to them with XADD, not through the broker"
            )

    @staticmethod
    def _attached_offset_error(stream: str, exc: _ForeignEntry) -> SourceError:
        return SourceError(
            f"stream {stream}: entry {exc.entry_id.decode()} has a sequence part of"
            " 2**19 or more, which attached streams cannot map to an offset",
            retriable=False,
        )

    def _attached_offset_of(self, stream: str, entry_id: bytes) -> int:
        try:
            return _attached_offset(entry_id)
        except _ForeignEntry as exc:
            raise self._attached_offset_error(stream, exc) from None

    async def _attached_end(self, mq: MessageQueue, key: str) -> int:
        """One past the offset of the last entry ever written to ``key`` (0: none)."""
        execute = self._connection.execute

        async def last_id() -> Any:
            if not await execute("EXISTS", key):
                return b"0-0"
            info = await execute("XINFO", "STREAM", key)
            if isinstance(info, dict):  # RESP3
                return info.get(b"last-generated-id", b"0-0")
            fields = dict(zip(info[::2], info[1::2], strict=False))
            return fields.get(b"last-generated-id", b"0-0")

        entry_id = await self._retrying(f"reading the max offset of {mq}", last_id)
        raw = entry_id if isinstance(entry_id, bytes) else str(entry_id).encode()
        if raw == b"0-0":
            return 0
        return self._attached_offset_of(key, raw) + 1

    async def entries_after(self, mq: MessageQueue, offset: int, limit: int = 100_000) -> int:
        """How many entries of ``mq`` are at ``offset`` or later, counted up to
        ``limit``: the lag of a consumer whose committed offset is ``offset``, in
        messages (on the broker's own topics ``max_offset - offset``, no counting)."""
        attached = self._attached.get(mq.topic)
        if attached is None:
            return max(await self.max_offset(mq) - offset, 0)
        key = attached.stream_keys[mq.queue_id]
        execute = self._connection.execute
        start = _attached_id(max(offset, 0))
        count = 0
        while count < limit:
            batch = min(1000, limit - count)
            entries = await self._retrying(
                f"counting entries of {mq}",
                functools.partial(execute, "XRANGE", key, start, "+", "COUNT", batch),
            )
            count += len(entries)
            if len(entries) < batch:
                break
            start = _attached_id(self._attached_offset_of(key, entries[-1][0]) + 1)
        return count

    async def _pull_attached(
        self, mq: MessageQueue, attached: _Attached, offset: int, max_count: int, timeout: float
    ) -> PullResult:
        """:meth:`pull` on an attached stream: ``XRANGE`` from the entry id of
        ``offset``, ``XREAD BLOCK`` to long poll."""
        topic, queue_id = mq.topic, mq.queue_id
        key = attached.stream_keys[queue_id]
        what = f"pulling {mq} ({key}) at {offset}"
        count = max(max_count, self.read_ahead)
        connection = self._connection
        execute = connection.execute
        start = _attached_id(offset)
        entries = await connection.call(
            what, functools.partial(execute, "XRANGE", key, start, "+", "COUNT", count)
        )
        if not entries and timeout > 0:
            deadline = time.monotonic() + timeout
            after = _attached_id(offset - 1) if offset > 0 else b"0-0"
            while not entries:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                block_ms = max(1, int(min(remaining, _MAX_BLOCK) * 1000))
                reply = await connection.call(
                    what,
                    functools.partial(
                        execute, "XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", key, after,
                        keys=(5,),
                    ),
                )  # fmt: skip
                if reply:
                    if isinstance(reply, dict):  # RESP3: a map of stream -> entries
                        entries = list(next(iter(reply.values())))
                    else:
                        entries = list(reply[0][1])
        if not entries:
            return PullResult(messages=[], next_offset=offset, max_offset=offset)
        try:
            messages = _decode_attached(topic, queue_id, entries, attached.decode)
        except _ForeignEntry as exc:
            raise self._attached_offset_error(key, exc) from None
        except Exception as exc:
            raise SourceError(
                f"{what}: the decoder failed on an entry: {exc!r}", retriable=False
            ) from exc
        end = messages[-1].queue_offset + 1
        return self._serve(topic, queue_id, messages, end, max_count)

    # -- inspection ---------------------------------------------------------------------------

    async def messages(self, topic: str, queue_id: int = 0) -> list[Message]:
        """Every stored message of one queue (for tests and tools)."""
        result: list[Message] = []
        offset = 0
        while True:
            pulled = await self.pull(MessageQueue(topic, queue_id), offset, 1000)
            result.extend(pulled.messages)
            if not pulled.messages and not pulled.undecodable:
                return result
            offset = pulled.next_offset

    async def delayed_count(self, group: str) -> int:
        """Retries of ``group`` not yet due (normal and gray)."""
        total = 0
        for queue_id in range(RETRY_QUEUE_COUNT):
            key = self._delay_key(group, queue_id)
            total += int(
                await self._retrying(
                    "counting delayed retries",
                    functools.partial(self._connection.execute, "ZCARD", key),
                )
            )
        return total

    def statistics(self) -> RedisBrokerStatistics:
        """A snapshot of the broker's counters (see :class:`RedisBrokerStatistics`)."""
        return RedisBrokerStatistics(
            namespace=self.namespace,
            topics=dict(self._topic_cache),
            connection_errors=self.connection_errors,
            forced_trims=self._forced_trims,
            bad_retries=self._bad_retries,
        )

    async def delete_namespace(self) -> int:
        """Delete every key of this broker's namespace (tests, tools). Returns how many."""
        deleted = 0
        execute = self._connection.execute
        for key in await self._connection.scan_keys(f"{self.namespace}:*"):
            deleted += int(await execute("DEL", key))
        self._topic_cache.clear()
        self._buffered.clear()
        return deleted
