"""RedisBroker: topics of queues on Redis Streams, and consumer groups across processes.

Key layout (``ns`` is the namespace, ``sc`` by default)::

    ns:topics                      hash   topic -> queue count
    ns:q:<topic>:<queue_id>        stream the queue's log
    ns:seq:<topic>:<queue_id>      string the number of messages ever sent to the queue
    ns:delay:<group>               zset   retries not yet due (score: due time, ms)
    ns:members:<group>             zset   live members (score: expiry, ms)
    ns:lock:<group>:<topic>:<qid>  hash   owner, epoch; expires (PEXPIRE) unless renewed
    ns:epoch:<group>:<topic>:<qid> string last epoch handed out for that queue

Queue offsets are stream entry ids: the message at offset ``n`` has the explicit id
``<n + 1>-0`` (Redis refuses ``0-0``). A Lua script takes ``INCRBY`` on the queue's
``seq`` counter and ``XADD``s with the ids it got, atomically, so concurrent
producers get consecutive offsets without gaps and a pull by offset is an
``XRANGE`` from ``<offset + 1>-0``; ``seq`` is the queue's max offset.

Entry fields: ``i`` message id, ``b`` body, ``t`` born timestamp (ms since the
epoch), and only when set: ``k`` keys (JSON list), ``g`` tags, ``p`` properties (JSON
object), ``r`` reconsume times.

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
import json
import logging
import os
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import Any, TypeVar

import anyio
import attrs
import sniffio

from .._core import TakeoverBackoff, retry_delay_seconds
from .._exceptions import ConfigurationError, SourceClosedError, SourceError, UnknownTopicError
from .._message import (
    EMPTY_PROPERTIES,
    Message,
    MessageQueue,
    _new_message,
    _set_body,
    _set_born_timestamp,
    _set_keys,
    _set_msg_id,
    _set_properties,
    _set_queue_id,
    _set_queue_offset,
    _set_reconsume_times,
    _set_tags,
    _set_topic,
)
from .._observability._traceparent import with_traceparent
from ._group import GroupCoordinator, GroupOptions
from ._source import (
    DLQ_PREFIX,
    RETRY_PREFIX,
    MessageSource,
    PullResult,
    SendBackResult,
    dlq_topic,
    is_spent,
    origin_properties,
    retry_topic,
)

try:
    import redis.asyncio as aioredis
    import redis.exceptions as redis_exc
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("RedisBroker needs redis-py: pip install 'stagedconsumer[redis]'") from exc

__all__ = ("RedisBroker", "RedisBrokerStatistics", "RedisCoordinator", "RedisCoordinatorStatistics")


@attrs.frozen(kw_only=True)
class RedisBrokerStatistics:
    """A snapshot of a :class:`RedisBroker`."""

    namespace: str
    topics: Mapping[str, int]
    """Queue count of the topics this broker has used."""
    connection_errors: int
    """Redis calls that failed on the connection (each retried or reported)."""


logger = logging.getLogger("stagedconsumer.redis")

_T = TypeVar("_T")
_MAX_BLOCK = 5.0
"""Longest single ``XREAD BLOCK`` (seconds); longer long polls loop, so a blocked
read never outlives the socket timeout."""
_RELEASE_BATCH = 256
_MAX_BUFFERED = 1024
"""Read-ahead buffers kept at most (one per queue and offset a pull will continue
from); past this the oldest is dropped (a stale one is left by a consumer that moved
elsewhere: reset, stopped, or lost the queue)."""

# KEYS: seq, stream. ARGV: n, then per message: field count, fields and values.
# Returns the offset of the first message.
_SEND_LUA = """
local n = tonumber(ARGV[1])
local last = redis.call('INCRBY', KEYS[1], n)
local first = last - n
local i = 2
for m = 1, n do
  local nf = tonumber(ARGV[i])
  local args = {}
  for f = 1, nf do args[f] = ARGV[i + f] end
  redis.call('XADD', KEYS[2], (first + m) .. '-0', unpack(args))
  i = i + nf + 1
end
return first
"""

# Unpack '<len>:<bytes>' pairs into a flat field list.
_UNPACK_LUA = """
local function unpack_fields(s)
  local out = {}
  local pos = 1
  local len_s = #s
  while pos <= len_s do
    local colon = string.find(s, ':', pos, true)
    local len = tonumber(string.sub(s, pos, colon - 1))
    out[#out + 1] = string.sub(s, colon + 1, colon + len)
    pos = colon + 1 + len
  end
  return out
end
local function release_due(zset, seq, stream, limit)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local due = redis.call('ZRANGEBYSCORE', zset, '-inf', now, 'LIMIT', 0, limit)
  for _, member in ipairs(due) do
    local off = redis.call('INCR', seq)
    redis.call('XADD', stream, off .. '-0', unpack(unpack_fields(member)))
    redis.call('ZREM', zset, member)
  end
  local nxt = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
  if nxt[2] then return tonumber(nxt[2]) - now end
  return -1
end
"""

# KEYS: delay zset, seq, stream. ARGV: limit. Returns ms until the next retry is due
# (-1: none left).
_RELEASE_LUA = (
    _UNPACK_LUA
    + """
return release_due(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[1]))
"""
)

# KEYS: zset. ARGV: delay ms, packed message.
_DELAY_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[2])
return now
"""

# KEYS: members zset. ARGV: client id, ttl ms. Returns live members.
_HEARTBEAT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) end
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[2]) * 4, 60000))
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""

# KEYS: lock1, epoch1, lock2, epoch2, ... ARGV: client id, ttl ms.
# Epochs are max(previous + 1, server time in ms): strictly increasing per queue, and
# still increasing after Redis lost its data (a restart without persistence), so a
# fence stored in the database never blocks a new owner forever.
_LOCK_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #KEYS, 2 do
  local lock, ek = KEYS[i], KEYS[i + 1]
  local owner = redis.call('HGET', lock, 'owner')
  if owner == ARGV[1] then
    redis.call('PEXPIRE', lock, ARGV[2])
    out[#out + 1] = tonumber(redis.call('HGET', lock, 'epoch'))
  elseif not owner then
    local prev = tonumber(redis.call('GET', ek) or '0')
    local epoch = math.max(prev + 1, now)
    redis.call('SET', ek, string.format('%d', epoch))
    redis.call('HSET', lock, 'owner', ARGV[1], 'epoch', string.format('%d', epoch))
    redis.call('PEXPIRE', lock, ARGV[2])
    out[#out + 1] = epoch
  else
    out[#out + 1] = 0
  end
end
return out
"""

# KEYS: locks. ARGV: client id.
_UNLOCK_LUA = """
local n = 0
for _, lock in ipairs(KEYS) do
  if redis.call('HGET', lock, 'owner') == ARGV[1] then
    redis.call('DEL', lock)
    n = n + 1
  end
end
return n
"""

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    redis_exc.ConnectionError,
    redis_exc.TimeoutError,
    redis_exc.BusyLoadingError,
    redis_exc.TryAgainError,
    redis_exc.ReadOnlyError,
    OSError,
)


def _pack(fields: Sequence[bytes]) -> bytes:
    return b"".join(b"%d:%s" % (len(value), value) for value in fields)


def _unpack(data: bytes) -> list[bytes]:
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        colon = data.index(b":", pos)
        length = int(data[pos:colon])
        out.append(data[colon + 1 : colon + 1 + length])
        pos = colon + 1 + length
    return out


def _encode_fields(
    msg_id: str,
    body: bytes,
    born_ms: int,
    keys: tuple[str, ...],
    tags: str | None,
    properties: Mapping[str, str] | None,
    reconsume_times: int,
) -> list[bytes]:
    fields = [b"i", msg_id.encode(), b"b", body, b"t", b"%d" % born_ms]
    if keys:
        fields += [b"k", json.dumps(list(keys)).encode()]
    if tags is not None:
        fields += [b"g", tags.encode()]
    if properties:
        fields += [b"p", json.dumps(dict(properties), sort_keys=True).encode()]
    if reconsume_times:
        fields += [b"r", b"%d" % reconsume_times]
    return fields


def _message_fields(message: Message, properties: Mapping[str, str]) -> list[bytes]:
    return _encode_fields(
        message.msg_id,
        message.body,
        round(message.born_timestamp * 1000),
        message.keys,
        message.tags,
        properties,
        message.reconsume_times,
    )


def _entry_offset(entry_id: bytes) -> int:
    return int(entry_id[:-2]) - 1


def _decode_entries(topic: str, queue_id: int, entries: Sequence[Any]) -> list[Message]:
    """Raw ``XRANGE`` entries (``[id, [field, value, ...]]``) as :class:`Message` objects.

    The hot path of every pull: messages are built through the slots' setters, without
    attrs' ``__init__`` and its converters (the fields are ours, already in their stored
    form). Entry ids are ``<offset + 1>-0``; when the first and last id span exactly the
    number of entries (always, unless some were deleted) the offsets are counted instead
    of parsed from every id. Entries with only the three fields every message has
    (``i``, ``b``, ``t``, written in that order) skip the field lookup.
    """
    if not entries:
        return []
    first = _entry_offset(entries[0][0])
    consecutive = _entry_offset(entries[-1][0]) - first == len(entries) - 1
    out: list[Message] = []
    append = out.append
    new = _new_message
    empty = EMPTY_PROPERTIES
    offset = first
    for entry_id, raw in entries:
        message = new(Message)
        _set_topic(message, topic)
        _set_queue_id(message, queue_id)
        _set_queue_offset(message, offset if consecutive else _entry_offset(entry_id))
        if len(raw) == 6 and raw[0] == b"i" and raw[2] == b"b" and raw[4] == b"t":
            _set_body(message, raw[3])
            _set_keys(message, ())
            _set_tags(message, None)
            _set_properties(message, empty)
            _set_msg_id(message, raw[1].decode())
            _set_born_timestamp(message, int(raw[5]) / 1000)
            _set_reconsume_times(message, 0)
        else:
            _set_fields(message, raw)
        append(message)
        offset += 1
    return out


def _set_fields(message: Message, raw: Sequence[bytes]) -> None:
    """The general case of :func:`_decode_entries`: optional fields present."""
    fields = dict(zip(raw[::2], raw[1::2], strict=True))
    keys: tuple[str, ...] = ()
    tags: str | None = None
    properties: Mapping[str, str] = EMPTY_PROPERTIES
    if (k := fields.get(b"k")) is not None:
        keys = tuple(json.loads(k))
    if (g := fields.get(b"g")) is not None:
        tags = g.decode()
    if (p := fields.get(b"p")) is not None:
        properties = MappingProxyType(json.loads(p)) or EMPTY_PROPERTIES
    r = fields.get(b"r")
    _set_body(message, fields.get(b"b", b""))
    _set_keys(message, keys)
    _set_tags(message, tags)
    _set_properties(message, properties)
    _set_msg_id(message, fields.get(b"i", b"").decode())
    _set_born_timestamp(message, int(fields.get(b"t", b"0")) / 1000)
    _set_reconsume_times(message, int(r) if r is not None else 0)


def _raw_reply(response: Any, **options: Any) -> Any:
    return response


def _is_system(topic: str) -> bool:
    return topic.startswith((RETRY_PREFIX, DLQ_PREFIX))


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

    Runs on asyncio only (redis-py's asyncio client), not on trio.

    :meth:`group_coordinator` provides membership and queue locks for consumer
    groups spread over several processes, with ``group_options``.

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

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "sc",
        group_options: GroupOptions | None = None,
        send_timeout: float = 30.0,
        socket_timeout: float = 10.0,
        read_ahead: int = 128,
    ) -> None:
        if not namespace or not isinstance(namespace, str):
            raise ConfigurationError(f"namespace must be a non-empty string, got {namespace!r}")
        if not send_timeout > 0:
            raise ConfigurationError(f"send_timeout must be positive, got {send_timeout!r}")
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ConfigurationError(f"read_ahead must be an int >= 0, got {read_ahead!r}")
        self.read_ahead = read_ahead
        """Entries read per ``XRANGE`` at least (see :meth:`pull`); 0: only what a
        pull asks for."""
        self._buffered: dict[tuple[str, int, int], tuple[list[Message], int]] = {}
        self.url = url
        self.namespace = namespace
        self.send_timeout = send_timeout
        try:
            client = aioredis.Redis.from_url(
                url,
                decode_responses=False,
                socket_timeout=socket_timeout,
                socket_connect_timeout=min(socket_timeout, 5.0),
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
        except ValueError as exc:
            raise ConfigurationError(f"malformed Redis URL {url!r}: {exc}") from exc
        self._redis = client
        self._send_script = client.register_script(_SEND_LUA)
        self._release_script = client.register_script(_RELEASE_LUA)
        # Raw XRANGE replies ([id, [field, value, ...]]): _decode_entries reads them positionally.
        client.set_response_callback("XRANGE", _raw_reply)
        client.set_response_callback("XREAD", _raw_reply)
        self._delay_script = client.register_script(_DELAY_LUA)
        self._topic_cache: dict[str, int] = {}
        self._round_robin: dict[str, itertools.count[int]] = {}
        self._id_prefix = f"{os.getpid():08X}{id(self) & 0xFFFFFFFF:08X}"
        self._id_seq = itertools.count()
        self._coordinator = RedisCoordinator(self, group_options or GroupOptions())
        self._closed = False
        self.connection_errors = 0
        self._on_asyncio = False
        """Redis calls that failed on the connection (each retried or reported)."""

    # -- keys ----------------------------------------------------------------------------

    def _stream_key(self, topic: str, queue_id: int) -> str:
        return f"{self.namespace}:q:{topic}:{queue_id}"

    def _seq_key(self, topic: str, queue_id: int) -> str:
        return f"{self.namespace}:seq:{topic}:{queue_id}"

    def _delay_key(self, group: str) -> str:
        return f"{self.namespace}:delay:{group}"

    @property
    def _topics_key(self) -> str:
        return f"{self.namespace}:topics"

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> RedisBroker:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (when the broker created the client)."""
        if self._closed:
            return
        self._closed = True
        self._buffered.clear()
        await self._redis.aclose()

    @property
    def redis(self) -> aioredis.Redis:
        """The redis-py asyncio client (for tools and tests)."""
        return self._redis

    def group_coordinator(self) -> RedisCoordinator:
        return self._coordinator

    # -- error handling --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SourceClosedError("the RedisBroker is closed")

    async def _once(self, what: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """One Redis call; connection trouble becomes ``SourceError(retriable=True)``."""
        self._check_open()
        if not self._on_asyncio:
            library = sniffio.current_async_library()
            if library != "asyncio":
                raise ConfigurationError(
                    f"RedisBroker runs on asyncio only (redis-py's asyncio client), not {library}"
                )
            self._on_asyncio = True
        try:
            return await call()
        except _CONNECTION_ERRORS as exc:
            self.connection_errors += 1
            # Redis may have restarted without its data: offsets could be reused.
            self._buffered.clear()
            raise SourceError(f"{what}: Redis at {self.url} unreachable: {exc}") from exc
        except redis_exc.RedisError as exc:
            raise SourceError(f"{what}: Redis error: {exc}", retriable=False) from exc

    async def _retrying(self, what: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """Retry a call on connection loss with exponential backoff, up to ``send_timeout``."""
        deadline = time.monotonic() + self.send_timeout
        delay = 0.05
        while True:
            try:
                return await self._once(what, call)
            except SourceError as exc:
                if not exc.retriable or time.monotonic() + delay > deadline:
                    raise
                logger.warning("%s failed (%s); retrying in %.2f s", what, exc, delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, 2.0)

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

        async def create() -> Any:
            await self._redis.hsetnx(key, topic, queue_count)
            return await self._redis.hget(key, topic)

        stored = int(await self._retrying(f"creating topic {topic!r}", create))
        if stored != queue_count:
            raise ConfigurationError(
                f"topic {topic!r} exists with {stored} queues, not {queue_count}"
            )
        self._topic_cache[topic] = queue_count
        return [MessageQueue(topic, i) for i in range(queue_count)]

    async def queue_count(self, topic: str) -> int:
        """The number of queues of ``topic`` (1 for retry and DLQ topics)."""
        if _is_system(topic):
            return 1
        cached = self._topic_cache.get(topic)
        if cached is not None:
            return cached
        value = await self._retrying(
            f"reading topic {topic!r}", lambda: self._redis.hget(self._topics_key, topic)
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
        if isinstance(queue_id, bool) or not 0 <= queue_id < count:
            raise ConfigurationError(
                f"queue_id {queue_id} out of range for topic {topic!r} with {count} queues"
            )
        return queue_id

    async def _append(self, topic: str, queue_id: int, encoded: Sequence[list[bytes]]) -> int:
        args: list[bytes | int] = [len(encoded)]
        for fields in encoded:
            args.append(len(fields))
            args.extend(fields)
        keys = [self._seq_key(topic, queue_id), self._stream_key(topic, queue_id)]
        first = await self._retrying(
            f"sending to {topic}#{queue_id}", lambda: self._send_script(keys=keys, args=args)
        )
        return int(first)

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
        """
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise TypeError(f"body must be bytes, got {type(body).__name__}")
        if _is_system(topic):
            raise ConfigurationError(f"cannot send to system topic {topic!r}")
        properties = with_traceparent(properties)
        key_tuple = (keys,) if isinstance(keys, str) else tuple(keys)
        qid = await self._pick_queue(topic, key_tuple, queue_id)
        msg_id = self._next_id()
        born = time.time()
        body = bytes(body)
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
        count = await self.queue_count(topic)
        pending: dict[int, list[list[bytes]]] = {}
        total = 0
        for body in bodies:
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
        stream = self._stream_key(topic, queue_id)
        seq = self._seq_key(topic, queue_id)
        release_keys: list[str] | None = None
        if topic.startswith(RETRY_PREFIX):
            release_keys = [self._delay_key(topic[len(RETRY_PREFIX) :]), seq, stream]
        deadline = time.monotonic() + timeout if timeout > 0 else 0.0
        what = f"pulling {mq} at {offset}"
        start = b"%d-0" % (offset + 1)
        count = max(max_count, self.read_ahead)
        redis = self._redis
        while True:
            wait_ms = -1
            if release_keys is not None:
                release = functools.partial(
                    self._release_script, keys=release_keys, args=[_RELEASE_BATCH]
                )
                wait_ms = int(await self._once(what, release))
            entries = await self._once(
                what,
                lambda: redis.execute_command(  # type: ignore[no-untyped-call]
                    "XRANGE", stream, start, "+", "COUNT", count
                ),
            )
            if entries or not timeout:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            block = min(remaining, _MAX_BLOCK)
            if wait_ms >= 0:
                block = min(block, max(wait_ms, 1) / 1000)
            wait = functools.partial(self._wait_for_entries, stream, offset, count, block)
            entries = await self._once(what, wait)
            if entries:
                break
        if entries:
            messages = _decode_entries(topic, queue_id, entries)
            end = messages[-1].queue_offset + 1
            if len(messages) >= count or messages[0].queue_offset == offset:
                # A full read: ``end`` is a lower bound of the max offset. A short
                # one from ``offset`` on: offsets are consecutive, so nothing exists
                # past the last one returned.
                return self._serve(topic, queue_id, messages, end, max_count)
            max_offset = int(await self._once(what, lambda: redis.get(seq)) or 0)
            return self._serve(topic, queue_id, messages, max(max_offset, end), max_count)
        max_offset = int(await self._once(what, lambda: redis.get(seq)) or 0)
        return PullResult(messages=[], next_offset=min(offset, max_offset), max_offset=max_offset)

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
        reply = await self._redis.execute_command(  # type: ignore[no-untyped-call]
            "XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", stream, b"%d-0" % offset
        )
        if not reply:
            return []
        if isinstance(reply, dict):  # RESP3: a map of stream -> entries
            return list(next(iter(reply.values())))
        return list(reply[0][1])

    async def max_offset(self, mq: MessageQueue) -> int:
        if mq.topic.startswith(RETRY_PREFIX):
            # Release due retries first, as the embedded broker does.
            await self.pull(mq, 2**62, 1)
        value = await self._retrying(
            f"reading the max offset of {mq}",
            lambda: self._redis.get(self._seq_key(mq.topic, mq.queue_id)),
        )
        return int(value or 0)

    async def min_offset(self, mq: MessageQueue) -> int:
        stream = self._stream_key(mq.topic, mq.queue_id)
        first = await self._retrying(
            f"reading the min offset of {mq}",
            lambda: self._redis.xrange(stream, "-", "+", count=1),
        )
        if first:
            entry_id: Any = first[0][0]
            return (
                int(
                    str(entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[
                        0
                    ]
                )
                - 1
            )
        return await self.max_offset(mq)

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
        retried = attrs.evolve(
            message, reconsume_times=message.reconsume_times + 1, msg_id=self._next_id()
        )
        packed = _pack(_message_fields(retried, properties))
        delay_ms = round(retry_delay_seconds(message.reconsume_times, delay_level) * 1000)
        key = self._delay_key(group)
        await self._retrying(
            f"sending {message.msg_id} back to {retry_topic(group)}",
            lambda: self._delay_script(keys=[key], args=[delay_ms, packed]),
        )
        return SendBackResult.RETRY

    async def send_to_dlq(self, group: str, message: Message) -> None:
        fields = _message_fields(message, origin_properties(message))
        await self._append(dlq_topic(group), 0, [fields])

    # -- inspection ---------------------------------------------------------------------------

    async def messages(self, topic: str, queue_id: int = 0) -> list[Message]:
        """Every stored message of one queue (for tests and tools)."""
        result: list[Message] = []
        offset = 0
        while True:
            pulled = await self.pull(MessageQueue(topic, queue_id), offset, 1000)
            result.extend(pulled.messages)
            if not pulled.messages:
                return result
            offset = pulled.next_offset

    async def delayed_count(self, group: str) -> int:
        """Retries of ``group`` not yet due."""
        return int(
            await self._retrying(
                "counting delayed retries", lambda: self._redis.zcard(self._delay_key(group))
            )
        )

    def statistics(self) -> RedisBrokerStatistics:
        return RedisBrokerStatistics(
            namespace=self.namespace,
            topics=dict(self._topic_cache),
            connection_errors=self.connection_errors,
        )

    async def delete_namespace(self) -> int:
        """Delete every key of this broker's namespace (tests, tools). Returns how many."""
        deleted = 0
        async for key in self._redis.scan_iter(match=f"{self.namespace}:*", count=1000):
            deleted += int(await self._redis.delete(key))
        self._topic_cache.clear()
        self._buffered.clear()
        return deleted


@attrs.frozen(kw_only=True)
class RedisCoordinatorStatistics:
    """A snapshot of a :class:`RedisCoordinator`."""

    locks: int
    """Queue locks its members hold (as of their last lock or renewal)."""
    aborted_takeovers: int
    """Locks released before their first renewal: takeovers given up (a claim the
    offset store refused, or one that failed)."""
    backing_off: frozenset[MessageQueue]
    """Queues whose next takeover is held back after takeovers given up in a row."""


@attrs.define(eq=False)
class _MemberState:
    """What one member (group, client id) locked through this coordinator."""

    backoff: TakeoverBackoff
    epochs: dict[MessageQueue, int] = attrs.Factory(dict)
    """Queues it may hold, with their epoch (0: asked for, reply not seen)."""
    fresh: set[MessageQueue] = attrs.Factory(set)
    """Queues acquired and not renewed since."""


class RedisCoordinator(GroupCoordinator):
    """Group membership and queue locks in Redis (see :class:`GroupCoordinator`).

    Members are a sorted set scored by expiry; a queue lock is a hash (owner, epoch)
    with ``PEXPIRE``; epochs come from a per-queue counter that never goes back, and
    are at least the Redis server time in ms when handed out, so they keep growing
    even after Redis lost its data in a restart. All times are the server's clock.

    Per member, it remembers the locks handed out, so that:

    - :meth:`leave` releases every lock the member still holds, including one taken
      while it was shutting down (a takeover cut short), instead of leaving it to
      expire;
    - a lock released before its first renewal counts as a takeover given up (the
      consumer releases a queue at once when the offset store refuses its claim);
      the next attempt on that queue waits, longer after each one in a row
      (:class:`~stagedconsumer._core.TakeoverBackoff`: one rebalance tick,
      doubling, up to ``lock_ttl``), and the third in a row is logged as an error.
      Without this a claim refused for good (a fence from a clock far ahead) would be
      retried every round forever.
    """

    def __init__(self, broker: RedisBroker, options: GroupOptions) -> None:
        self._broker = broker
        self._options = options
        self._members: dict[tuple[str, str], _MemberState] = {}
        client = broker.redis
        self._heartbeat_script = client.register_script(_HEARTBEAT_LUA)
        self._lock_script = client.register_script(_LOCK_LUA)
        self._unlock_script = client.register_script(_UNLOCK_LUA)

    def _member(self, group: str, client_id: str) -> _MemberState:
        state = self._members.get((group, client_id))
        if state is None:
            backoff = TakeoverBackoff(base=self._options.tick, cap=self._options.lock_ttl)
            state = self._members[group, client_id] = _MemberState(backoff=backoff)
        return state

    def statistics(self) -> RedisCoordinatorStatistics:
        states = self._members.values()
        now = time.monotonic()
        return RedisCoordinatorStatistics(
            locks=sum(1 for state in states for epoch in state.epochs.values() if epoch),
            aborted_takeovers=sum(state.backoff.statistics().aborted for state in states),
            backing_off=frozenset(
                mq
                for state in states
                for mq, until in state.backoff.statistics().backing_off.items()
                if until > now
            ),
        )

    @property
    def options(self) -> GroupOptions:
        return self._options

    def _ns(self) -> str:
        return self._broker.namespace

    def _lock_key(self, group: str, mq: MessageQueue) -> str:
        return f"{self._ns()}:lock:{group}:{mq.topic}:{mq.queue_id}"

    def _epoch_key(self, group: str, mq: MessageQueue) -> str:
        return f"{self._ns()}:epoch:{group}:{mq.topic}:{mq.queue_id}"

    def _members_key(self, group: str) -> str:
        return f"{self._ns()}:members:{group}"

    async def heartbeat(self, group: str, client_id: str) -> list[str]:
        ttl_ms = round(self._options.effective_member_ttl * 1000)
        key = self._members_key(group)
        reply = await self._broker._once(
            f"heartbeat of {client_id} in {group}",
            lambda: self._heartbeat_script(keys=[key], args=[client_id, ttl_ms]),
        )
        return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in reply)

    async def members(self, group: str) -> list[str]:
        """The live members of ``group`` (without registering anyone)."""
        return await self.heartbeat(group, "")

    async def leave(self, group: str, client_id: str) -> None:
        """Release every lock ``client_id`` still holds in ``group``, then leave it."""
        state = self._members.get((group, client_id))
        if state is not None and state.epochs:
            await self._unlock(group, client_id, list(state.epochs))
            state.epochs.clear()
        self._members.pop((group, client_id), None)
        key = self._members_key(group)
        await self._broker._once(
            f"{client_id} leaving {group}", lambda: self._broker.redis.zrem(key, client_id)
        )

    async def lock(
        self, group: str, client_id: str, queues: Sequence[MessageQueue]
    ) -> Mapping[MessageQueue, int]:
        state = self._member(group, client_id)
        now = time.monotonic()
        epochs = state.epochs
        asked = [
            mq
            for mq in dict.fromkeys(queues)  # once each, in order
            if epochs.get(mq) or state.backoff.may_try(mq, now)
        ]
        if not asked:
            return {}
        keys: list[str] = []
        for mq in asked:
            keys += [self._lock_key(group, mq), self._epoch_key(group, mq)]
            epochs.setdefault(mq, 0)  # a call cut short may still have taken it
        ttl_ms = round(self._options.lock_ttl * 1000)
        reply = await self._broker._once(
            f"locking {len(asked)} queue(s) of {group}",
            lambda: self._lock_script(keys=keys, args=[client_id, ttl_ms]),
        )
        locked: dict[MessageQueue, int] = {}
        for mq, value in zip(asked, reply, strict=True):
            epoch = int(value)
            if not epoch:
                epochs.pop(mq, None)
                state.fresh.discard(mq)
                continue
            if epochs.get(mq) == epoch:  # renewed: the takeover held
                if mq in state.fresh:
                    state.fresh.discard(mq)
                    state.backoff.held(mq)
            else:
                state.fresh.add(mq)
            epochs[mq] = locked[mq] = epoch
        return locked

    async def unlock(self, group: str, client_id: str, queues: Sequence[MessageQueue]) -> None:
        if not queues:
            return
        state = self._member(group, client_id)
        now = time.monotonic()
        for mq in queues:
            state.epochs.pop(mq, None)
            if mq in state.fresh:  # released before its first renewal: given up
                state.fresh.discard(mq)
                if state.backoff.aborted(mq, now):
                    logger.error(
                        "group %s: %s gave up taking %s %d times in a row (its claim in the"
                        " offset store was refused or failed); trying again every %.0f s at"
                        " most",
                        group,
                        client_id,
                        mq,
                        state.backoff.report_after,
                        state.backoff.retry_delay(mq),
                    )
        await self._unlock(group, client_id, queues)

    async def _unlock(self, group: str, client_id: str, queues: Sequence[MessageQueue]) -> None:
        keys = [self._lock_key(group, mq) for mq in queues]
        await self._broker._once(
            f"unlocking {len(queues)} queue(s) of {group}",
            lambda: self._unlock_script(keys=keys, args=[client_id]),
        )

    async def lock_owner(self, group: str, mq: MessageQueue) -> str | None:
        """Who holds the lock of ``mq`` now (for tools and tests)."""
        key = self._lock_key(group, mq)
        owner = await self._broker._once(
            f"reading the lock of {mq}", lambda: self._broker.redis.hget(key, "owner")
        )
        return owner.decode() if isinstance(owner, bytes) else owner
