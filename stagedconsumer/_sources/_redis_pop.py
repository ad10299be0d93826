"""Pop consumption on Redis: Redis Streams consumer groups, driven by two Lua scripts.

Key layout, per queue of a subscribed topic and consumer group (``<tag>`` is the
queue stream's hash tag, ``<topic>:<queue_id>`` for the broker's own topics, the
stream key for an attached stream without one, so that every key of a queue is in
its stream's Cluster slot)::

    <stream>                              stream  the queue; the consumer group <group>
                                                  on it: its last-delivered id is the
                                                  group's cursor, its pending entries
                                                  list (PEL) the messages in flight, each
                                                  entry's delivery counter the delivery
                                                  attempt
    ns:pop:inv:{<tag>}:<group>            zset    entry id -> the end of its invisible
                                                  duration (ms, the Redis server's clock)
    ns:pop:lock:{<tag>}:<group>           hash    FIFO: message group -> its head entry
    ns:pop:wait:{<tag>}:<group>           zset    FIFO: entries behind a head, members
                                                  ``<message group>\\0<padded id>``
    ns:pop:ready:{<tag>}:<group>          list    FIFO: heads released by an ack,
                                                  ``<id> <message group>``

:data:`RECEIVE_LUA` does a whole receive on the server, atomically, for one or more
queues: entries whose invisible time passed are claimed again (``XCLAIM`` with the
delivery counter one higher; those whose attempts are used up are handed to the
client to dead-letter), then FIFO heads released by acks, then new entries
(``XREADGROUP ... >``). :data:`SETTLE_LUA` acks (``XACK``, and for a FIFO head
releases the next entry of its message group) or changes the invisible time, after
checking that the caller's delivery still holds the entry (same delivery counter,
invisible time not passed).
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs

from .._exceptions import ConfigurationError, SourceError
from .._filter import TagFilter
from .._message import Message
from ._pop import (
    InvalidReceiptHandleError,
    PopBackend,
    PopSettings,
    ReceivedMessage,
    received,
    received_first,
)
from ._redis_codec import EntryDecoder, _decode_attached, _decode_entries, _ForeignEntry
from ._redis_connection import RedisScript

if TYPE_CHECKING:
    from ._redis_broker import RedisBroker

__all__ = ("MEMBERS_LUA", "RECEIVE_LUA", "SETTLE_LUA", "RedisPopBackend")

_COMMON_LUA = """
local group = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function pad(id)
  local ms, sq = string.match(id, '^(%d+)%-(%d+)$')
  return string.rep('0', 20 - #ms) .. ms .. '-' .. string.rep('0', 20 - #sq) .. sq
end
local function unpad(p)
  local ms, sq = string.match(p, '^0*(%d-)%-0*(%d-)$')
  if ms == '' then ms = '0' end
  if sq == '' then sq = '0' end
  return ms .. '-' .. sq
end
-- a FIFO head is done: the next entry of its message group becomes ready
local function release(LOCK, WAIT, READY, mg, id)
  if redis.call('HGET', LOCK, mg) ~= id then return end
  local nxt = redis.call('ZRANGEBYLEX', WAIT, '(' .. mg .. '\\0', '(' .. mg .. '\\1',
                         'LIMIT', 0, 1)[1]
  if nxt then
    redis.call('ZREM', WAIT, nxt)
    local nid = unpad(string.sub(nxt, #mg + 2))
    redis.call('HSET', LOCK, mg, nid)
    redis.call('RPUSH', READY, nid .. ' ' .. mg)
  else
    redis.call('HDEL', LOCK, mg)
  end
end
"""

_SETTLE_FUNCTION_LUA = """
-- settle the deliveries of queue q (KEYS from q * per) whose receipt handles are in
-- the list records: ack them (change < 0) or move their invisible time to
-- change ms from now; the entries not done go to codes as (index, code) pairs,
-- indexes counted from seen; returns seen + the number of entries
local function settle(q, per, records, change, seen, codes)
  local S, INV = KEYS[q*per+1], KEYS[q*per+2]
  local LOCK, WAIT, READY = KEYS[q*per+3], KEYS[q*per+4], KEYS[q*per+5]
  local ids, atts, mgs = {}, {}, {}
  for _, record in ipairs(records) do
    local id, att, mg = string.match(record, '^(%S+) (%d+) ?(.*)$')
    ids[#ids + 1] = id
    atts[#atts + 1] = tonumber(att)
    mgs[#mgs + 1] = mg
  end
  if #ids == 0 then return seen end
  local scores = redis.call('ZMSCORE', INV, unpack(ids))
  local done = {}
  local deadlines = {}
  for i, id in ipairs(ids) do
    local p = redis.call('XPENDING', S, group, id, id, 1)[1]
    local score = scores[i]
    local code = 1
    if not p or tonumber(p[4]) ~= atts[i] or not score then
      code = -1
    elseif tonumber(score) <= now then
      code = -2
    elseif change >= 0 then
      deadlines[#deadlines + 1] = now + change
      deadlines[#deadlines + 1] = id
    else
      done[#done + 1] = id
      if mgs[i] ~= '' then release(LOCK, WAIT, READY, mgs[i], id) end
    end
    if code ~= 1 then
      codes[#codes + 1] = seen + i - 1
      codes[#codes + 1] = code
    end
  end
  if #done > 0 then
    redis.call('XACK', S, group, unpack(done))
    redis.call('ZREM', INV, unpack(done))
  end
  if #deadlines > 0 then redis.call('ZADD', INV, unpack(deadlines)) end
  return seen + #ids
end
"""
_COMMON_LUA += _SETTLE_FUNCTION_LUA

RECEIVE_LUA = (
    _COMMON_LUA
    + """
local consumer = ARGV[2]
local want = tonumber(ARGV[3])
local inv_ms = tonumber(ARGV[4])
local max_att = tonumber(ARGV[5])
local fifo = ARGV[6] == '1'
local gprop = ARGV[7]
local per = 2
if fifo then per = 5 end
local nq = #KEYS / per
local specs = {}
for spec in string.gmatch(ARGV[9] .. '\\r', '([^\\r]*)\\r') do specs[#specs + 1] = spec end
-- acks queued by the client, sent with this receive
local acked = {}
if ARGV[10] ~= '' then
  -- a queue's index, then the receipt handles of its acks (which have a space)
  local per_q, at = {}, nil
  for token in string.gmatch(ARGV[10], '[^%z]+') do
    if string.find(token, ' ', 1, true) then
      at[#at + 1] = token
    else
      at = {}
      per_q[tonumber(token) + 1] = at
    end
  end
  local seen = 0
  for q = 0, nq - 1 do
    if per_q[q + 1] then seen = settle(q, per, per_q[q + 1], -1, seen, acked) end
  end
end
local out = {}
local got = 0
local function field(f, name)
  for i = 1, #f, 2 do if f[i] == name then return f[i + 1] end end
  return nil
end
-- a delivery's receipt handle: what the settle script reads back
local function handle(id, att, mg)
  if mg then return id .. ' ' .. att .. ' ' .. mg end
  return id .. ' ' .. att
end
local function message_group(f, attached)
  if not fifo then return false end
  if attached then
    if gprop == '' then return false end
    return field(f, gprop) or false
  end
  if gprop == '' then
    local k = field(f, 'k')
    if not k then return false end
    local first = cjson.decode(k)[1]
    if type(first) ~= 'string' then return false end
    return first
  end
  local p = field(f, 'p')
  if not p then return false end
  local v = cjson.decode(p)[gprop]
  if type(v) ~= 'string' then return false end
  return v
end
for q = 0, nq - 1 do
  if got >= want then break end
  local S, INV = KEYS[q*per+1], KEYS[q*per+2]
  local LOCK, WAIT, READY = KEYS[q*per+3], KEYS[q*per+4], KEYS[q*per+5]
  local attached = string.sub(ARGV[8], q + 1, q + 1) == '1'
  local tags = nil
  if specs[q + 1] ~= '' then
    tags = {}
    for tag in string.gmatch(specs[q + 1], '[^\\n]+') do tags[tag] = true end
  end
  -- 1. entries whose invisible time passed
  local due = redis.call('ZRANGEBYSCORE', INV, '-inf', now, 'LIMIT', 0, want - got)
  for _, id in ipairs(due) do
    local p = redis.call('XPENDING', S, group, id, id, 1)[1]
    if not p then
      redis.call('ZREM', INV, id)
    else
      local att = tonumber(p[4])
      local e = redis.call('XCLAIM', S, group, consumer, 0, id, 'RETRYCOUNT', att + 1)[1]
      if not e then
        redis.call('ZREM', INV, id)
        redis.call('XACK', S, group, id)
      else
        redis.call('ZADD', INV, now + inv_ms, id)
        local kind = 1
        if att >= max_att then kind = 2 end
        local mg = message_group(e[2], attached)
        out[#out + 1] = {kind, q, id, att + 1, mg, e[2], handle(id, att + 1, mg)}
        got = got + 1
      end
    end
  end
  -- 2. FIFO heads released by acks
  while fifo and got < want do
    local item = redis.call('LPOP', READY)
    if not item then break end
    local id, mg = string.match(item, '^(%S+) (.*)$')
    local e = redis.call('XCLAIM', S, group, consumer, 0, id, 'RETRYCOUNT', 1)[1]
    if e then
      redis.call('ZADD', INV, now + inv_ms, id)
      out[#out + 1] = {1, q, id, 1, mg, e[2], handle(id, 1, mg)}
      got = got + 1
    else
      redis.call('XACK', S, group, id)
      release(LOCK, WAIT, READY, mg, id)
    end
  end
  -- 3. entries never delivered
  local rounds = 0
  while got < want and rounds < 8 do
    rounds = rounds + 1
    local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', want - got,
                         'STREAMS', S, '>')
    if not r or not r[1] or #r[1][2] == 0 then break end
    local deadlines = {}
    local rejected = {}
    local deadline = now + inv_ms
    for _, e in ipairs(r[1][2]) do
      local id, f = e[1], e[2]
      local ok = true
      if tags then
        local tag = field(f, 'g')
        ok = tag ~= nil and tags[tag] ~= nil
      end
      if not ok then
        rejected[#rejected + 1] = id
      else
        local mg = message_group(f, attached)
        if mg and redis.call('HSETNX', LOCK, mg, id) == 0 then
          redis.call('ZADD', WAIT, 0, mg .. '\\0' .. pad(id))
        else
          deadlines[#deadlines + 1] = deadline
          deadlines[#deadlines + 1] = id
          out[#out + 1] = {3, q, id, 1, mg, f, handle(id, 1, mg)}
          got = got + 1
        end
      end
    end
    if #deadlines > 0 then redis.call('ZADD', INV, unpack(deadlines)) end
    if #rejected > 0 then redis.call('XACK', S, group, unpack(rejected)) end
  end
end
if got > 0 then return {out, -1, {}, acked} end
-- nothing: when the next invisible time ends, and where each stream ends
local wait = -1
local last = {}
for q = 0, nq - 1 do
  local first = redis.call('ZRANGE', KEYS[q*per+2], 0, 0, 'WITHSCORES')
  if first[2] then
    local w = math.max(tonumber(first[2]) - now, 0)
    if wait < 0 or w < wait then wait = w end
  end
  if fifo and redis.call('LLEN', KEYS[q*per+5]) > 0 then wait = 0 end
  local top = redis.call('XREVRANGE', KEYS[q*per+1], '+', '-', 'COUNT', 1)[1]
  if top then last[q + 1] = top[1] else last[q + 1] = '0-0' end
end
return {out, wait, last, acked}
"""
)
"""One receive over one or more queues (KEYS: per queue its stream and ``inv``, and
for a FIFO group ``lock``, ``wait``, ``ready``: few arguments to encode per call).
ARGV: group, consumer, max messages, invisible ms, max delivery attempts, ``1`` for
FIFO, the message group property (``''``: the first key), a ``1`` or ``0`` per queue
(an attached stream or not), then per queue its accepted tags (newline-separated;
``''``: all), the queues' separated by CR, then the acks to make first (``''``:
none): for each queue that has some its index, then their receipt handles, all
separated by NUL bytes.
Returns ``{records}`` where a record is ``{kind, queue index, entry id, attempt,
message group or nil, fields, receipt handle}``
(the handle is what :data:`SETTLE_LUA` reads: ``<id> <attempt>[ <message group>]``;
kind 1: deliver, 2:
attempts used up, dead-letter it, 3: deliver, first delivery: those of a queue are in
offset order), or when nothing was received ``{{}, ms until the
next invisible time ends (-1: none), {last entry id per stream}}``; a fourth element,
the acks not done as :data:`SETTLE_LUA` returns them."""

SETTLE_LUA = (
    _COMMON_LUA
    + """
local change = tonumber(ARGV[2])
local per = tonumber(ARGV[3])
local codes = {}
local seen = 0
for q = 0, #KEYS / per - 1 do
  local records = {}
  for record in string.gmatch(ARGV[4 + q], '[^%z]+') do records[#records + 1] = record end
  seen = settle(q, per, records, change, seen, codes)
end
return codes
"""
)
"""Ack entries of one or more queues (ARGV[2] ``-1``) or change their invisible time
to ARGV[2] ms from now. KEYS: per queue its stream and ``inv``, and with ARGV[3]
``5`` (FIFO) ``lock``, ``wait``, ``ready`` too. ARGV: group, that, keys per queue
(2 or 5), then per queue its entries in one string (one encoding
for many): their receipt handles, ``<id> <delivery attempt>[ <message group>]``,
separated by NUL bytes. Returns the entries not done, as pairs: the entry's index
(0-based, counting the queues' entries one queue after the other) and its code, -1
not held by that delivery (acked, received again, dead-lettered), -2 invisible time
passed (an empty list: all done)."""

MEMBERS_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local MEMBERS, SETTINGS = KEYS[1], KEYS[2]
local member, ttl, settings, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
redis.call('ZREMRANGEBYSCORE', MEMBERS, '-inf', now)
if mode == 'leave' then
  redis.call('ZREM', MEMBERS, member)
  return {1, {}}
end
if mode == 'join' then
  local current = redis.call('GET', SETTINGS)
  if current and current ~= settings and redis.call('ZCARD', MEMBERS) > 0 then
    return {0, current, redis.call('ZRANGE', MEMBERS, 0, -1)}
  end
  redis.call('SET', SETTINGS, settings)
end
redis.call('ZADD', MEMBERS, now + ttl, member)
redis.call('PEXPIRE', MEMBERS, ttl * 2)
return {1, redis.call('ZRANGE', MEMBERS, 0, -1)}
"""
"""A member of a pop group joins (checks the group's settings: refused with ``{0,
the settings in use, live members}`` while live members use others), heartbeats or
leaves. KEYS: the members sorted set (member -> presence expiry, ms, server clock),
the group's settings. ARGV: member, ttl ms, settings, ``join`` / ``beat`` /
``leave``. Returns ``{1, live members}``."""

_HASH_TAG = re.compile(r"\{([^}]+)\}")
_MAX_BLOCK = 5.0
_FIFO_POLL = 0.5
"""FIFO: a wait for messages looks at the heads released by acks of other
consumers this often at least (nothing in Redis wakes a blocked read for them)."""
_CLUSTER_POLL = 0.25


def _slot_tag(stream_key: str) -> str:
    """What goes between the braces of a key that must share ``stream_key``'s slot."""
    match = _HASH_TAG.search(stream_key)
    return match.group(1) if match else stream_key


@attrs.frozen
class _PopQueue:
    topic: str
    queue_id: int
    keys: tuple[str, str, str, str, str]
    decode: EntryDecoder | None
    """The decoder of an attached stream; ``None`` for the broker's own topics."""

    @property
    def stream(self) -> str:
        return self.keys[0]


_QUEUE_KEY = operator.attrgetter("topic", "queue_id")
_HANDLE = operator.attrgetter("receipt_handle")
_GROUP = operator.attrgetter("consumer_group")
_RECORD_HANDLE = operator.itemgetter(6)
_KIND_QUEUE = operator.itemgetter(0, 1)
_ENTRY = operator.itemgetter(2, 5)
"""A receive record's entry: ``(id, fields)``."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisPopBackend(PopBackend):
    """Receive, ack and invisibility of one group on a :class:`RedisBroker`."""

    def __init__(self, broker: RedisBroker, settings: PopSettings) -> None:
        self.broker = broker
        self.settings = settings
        connection = broker._connection
        self._receive_script = RedisScript(connection, RECEIVE_LUA)
        self._settle_script = RedisScript(connection, SETTLE_LUA)
        self._members_script = RedisScript(connection, MEMBERS_LUA)
        tag = f"pop:{settings.group}"
        self._member_keys = (
            f"{broker.namespace}:pop:members:{{{tag}}}",
            f"{broker.namespace}:pop:settings:{{{tag}}}",
        )
        self._topics: dict[str, list[_PopQueue]] = {}
        self._by_queue: dict[tuple[str, int], _PopQueue] = {}
        self._rotation = itertools.count()

    async def _queues(self, topic: str) -> list[_PopQueue]:
        queues = self._topics.get(topic)
        if queues is not None:
            return queues
        broker = self.broker
        attached = broker._attached.get(topic)
        group = self.settings.group
        ns = broker.namespace
        queues = []
        for queue_id in range(await broker.queue_count(topic)):
            if attached is not None:
                stream = attached.stream_keys[queue_id]
            else:
                stream = broker._stream_key(topic, queue_id)
            tag = _slot_tag(stream)
            keys = (
                stream,
                f"{ns}:pop:inv:{{{tag}}}:{group}",
                f"{ns}:pop:lock:{{{tag}}}:{group}",
                f"{ns}:pop:wait:{{{tag}}}:{group}",
                f"{ns}:pop:ready:{{{tag}}}:{group}",
            )
            queue = _PopQueue(topic, queue_id, keys, attached.decode if attached else None)
            queues.append(queue)
        execute = broker._connection.execute
        for queue in queues:
            try:
                await broker._connection.call(
                    f"creating consumer group {group!r} on {queue.stream}",
                    functools.partial(
                        execute, "XGROUP", "CREATE", queue.stream, group, "0", "MKSTREAM",
                        keys=(2,),
                    ),
                )  # fmt: skip
            except SourceError as exc:
                if "BUSYGROUP" not in str(exc) and "already exists" not in str(exc):
                    raise
        for queue in queues:
            self._by_queue[topic, queue.queue_id] = queue
        self._topics[topic] = queues
        return queues

    async def start(self, topics: Mapping[str, TagFilter]) -> None:
        for topic in topics:
            await self._queues(topic)

    def _settings_text(self) -> str:
        s = self.settings
        return (
            f"max_delivery_attempts={s.max_delivery_attempts} fifo={s.fifo}"
            f" message_group_property={s.message_group_property or ''}"
        )

    async def _members(self, member: str, ttl: float, mode: str) -> list[str]:
        args = [member, max(1, round(ttl * 1000)), self._settings_text(), mode]
        connection = self.broker._connection
        reply = await connection.call(
            f"{mode} of pop group {self.settings.group!r}",
            lambda: self._members_script(keys=self._member_keys, args=args),
        )
        if int(reply[0]) == 1:
            return [_text(m) for m in reply[1]]
        members = ", ".join(_text(m) for m in reply[2])
        raise ConfigurationError(
            f"consumer group {self.settings.group!r} is consumed on Redis with other pop"
            f" settings ({_text(reply[1])}) by live members ({members}); this consumer has"
            f" {self._settings_text()}. Every SimpleConsumer of a group must use the same"
            " max_delivery_attempts, fifo and message_group_property (the group's settings"
            " can change once none of its consumers runs)"
        )

    async def join(self, member: str, ttl: float) -> list[str]:
        return await self._members(member, ttl, "join")

    async def heartbeat(self, member: str, ttl: float) -> list[str]:
        return await self._members(member, ttl, "beat")

    async def leave(self, member: str) -> None:
        await self._members(member, 0, "leave")

    @property
    def merges_acks(self) -> bool:
        """Whether :meth:`ack_and_receive` sends acks within the receive's script (not
        on a Cluster, whose scripts see one slot)."""
        return not self.broker.cluster

    async def receive(
        self,
        consumer: str,
        subscriptions: Mapping[str, TagFilter],
        max_num: int,
        invisible_duration: float,
        timeout: float,
        allowed: Collection[tuple[str, int]] | None = None,
    ) -> list[ReceivedMessage]:
        return (
            await self.ack_and_receive(
                (), consumer, subscriptions, max_num, invisible_duration, timeout, allowed
            )
        )[1]

    async def ack_and_receive(
        self,
        acks: Sequence[ReceivedMessage],
        consumer: str,
        subscriptions: Mapping[str, TagFilter],
        max_num: int,
        invisible_duration: float,
        timeout: float,
        allowed: Collection[tuple[str, int]] | None = None,
    ) -> tuple[list[ReceivedMessage], list[ReceivedMessage]]:
        """Ack ``acks`` within the first receive script when every one is of a queue it
        reads (else in a call of their own first), then receive. Returns the acks
        refused and the messages received."""
        queues: list[tuple[_PopQueue, TagFilter]] = []
        for topic, accepts in subscriptions.items():
            queues.extend(
                (queue, accepts)
                for queue in await self._queues(topic)
                if allowed is None or (topic, queue.queue_id) in allowed
            )
        plan = None
        refused: list[ReceivedMessage] = []
        if queues:
            start = next(self._rotation) % len(queues)
            queues = queues[start:] + queues[:start]
            if acks and self.merges_acks:
                plan = self._ack_plan(acks, queues)
        if acks and plan is None:
            refused = await self.ack_many(acks)
        if not queues:
            return refused, []
        batches = [[q] for q in queues] if self.broker.cluster else [queues]
        deadline = time.monotonic() + timeout
        inv_ms = max(1, round(invisible_duration * 1000))
        regrouped = [False]
        while True:
            out, spent, wait_ms, last_ids, codes = await self._round(
                consumer, batches, max_num, inv_ms, plan, regrouped
            )
            if plan is not None:
                flat = plan[1]
                refused = [acks[i] for i in sorted(flat[int(n)] for n in codes[::2])]
                plan = None
            if out:
                return refused, out
            if spent or not last_ids:
                # dead letters moved, or only entries an attached stream's filter
                # rejected: look again at once
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return refused, out
            await self._wait(last_ids, remaining, wait_ms)

    def _ack_plan(
        self, acks: Sequence[ReceivedMessage], batch: Sequence[tuple[_PopQueue, TagFilter]]
    ) -> tuple[str, list[int]] | None:
        """The receive script's acks of ``batch``'s queues (see :data:`RECEIVE_LUA`),
        and the acks' indexes in the script's order; ``None`` when one is of a queue
        not in ``batch``."""
        if set(map(type, acks)) != {ReceivedMessage} or set(map(_GROUP, acks)) != {
            self.settings.group
        }:
            for message in acks:
                self._check(message, "ack")
        index = {(q.topic, q.queue_id): i for i, (q, _) in enumerate(batch)}
        found = list(map(index.get, map(_QUEUE_KEY, acks)))
        if None in found:
            return None
        at_of = cast("list[int]", found)
        order = sorted(range(len(acks)), key=at_of.__getitem__)  # stable: in order per queue
        parts: list[str] = []
        for at, run in itertools.groupby(order, at_of.__getitem__):
            parts.append(str(at))
            parts.extend(map(_HANDLE, map(acks.__getitem__, run)))
        return "\0".join(parts), order

    async def _round(
        self,
        consumer: str,
        batches: Sequence[Sequence[tuple[_PopQueue, TagFilter]]],
        max_num: int,
        inv_ms: int,
        plan: tuple[str, list[int]] | None,
        regrouped: list[bool],
    ) -> tuple[list[ReceivedMessage], bool, int, list[tuple[str, Any]], Sequence[Any]]:
        """One receive script per batch: the messages, whether any was dead-lettered,
        the ms until the next invisible time ends, the streams' last ids (to wait on)
        and the codes of the acks sent with the first script (``plan``)."""
        out: list[ReceivedMessage] = []
        spent = False
        wait_ms = -1
        last_ids: list[tuple[str, Any]] = []
        codes: Sequence[Any] = ()
        packed = None if plan is None else plan[0]
        for batch in batches:
            if len(out) >= max_num:
                break
            try:
                reply = await self._run_receive(consumer, batch, max_num - len(out), inv_ms, packed)
            except SourceError as exc:
                text = str(exc)  # coredis drops the error code, keeps the message
                if ("NOGROUP" not in text and "or consumer group" not in text) or regrouped[0]:
                    raise
                # the consumer group is gone (a Redis restart without persistence, an
                # XGROUP DESTROY): create it again, from the oldest entry (acks sent
                # with the failed script were not made: its settle part ran first)
                regrouped[0] = True
                for topic in {queue.topic for queue, _ in batch}:
                    self._topics.pop(topic, None)
                    await self._queues(topic)
                reply = await self._run_receive(consumer, batch, max_num - len(out), inv_ms, packed)
            if packed is not None:
                codes, packed = reply[3], None
            records = reply[0]
            if records:
                spent |= await self._take(batch, records, out)
            else:
                if reply[1] is not None and int(reply[1]) >= 0:
                    wait = int(reply[1])
                    wait_ms = wait if wait_ms < 0 else min(wait, wait_ms)
                last_ids.extend(
                    (q.stream, last) for (q, _), last in zip(batch, reply[2], strict=True)
                )
        return out, spent, wait_ms, last_ids, codes

    async def _run_receive(
        self,
        consumer: str,
        batch: Sequence[tuple[_PopQueue, TagFilter]],
        want: int,
        inv_ms: int,
        acks: str | None = None,
    ) -> Any:
        settings = self.settings
        keys: list[str] = []
        args: list[Any] = [
            settings.group,
            consumer,
            want,
            inv_ms,
            settings.max_delivery_attempts,
            1 if settings.fifo else 0,
            settings.message_group_property or "",
        ]
        per = 5 if settings.fifo else 2
        flags = []
        specs = []
        for queue, accepts in batch:
            keys.extend(queue.keys[:per])
            attached = queue.decode is not None
            flags.append("1" if attached else "0")
            specs.append("" if attached or accepts.tags is None else "\n".join(accepts.tags))
        args.append("".join(flags))
        args.append("\r".join(specs))
        args.append(acks or "")
        connection = self.broker._connection
        return await connection.call(
            f"receiving from {', '.join(q.stream for q, _ in batch)}",
            lambda: self._receive_script(keys=keys, args=args),
        )

    async def _take(
        self,
        batch: Sequence[tuple[_PopQueue, TagFilter]],
        records: Sequence[Any],
        out: list[ReceivedMessage],
    ) -> bool:
        """Decode ``records`` into ``out``; dead-letter the spent ones and ack those an
        attached stream's filter rejects. Returns whether any was spent."""
        group = self.settings.group
        spent = False
        rejected: list[ReceivedMessage] = []
        fresh: list[Any] = []
        """Consecutive first deliveries of one queue (in offset order): decoded at once."""

        def take_fresh() -> None:
            queue, accepts = batch[int(fresh[0][1])]
            messages = self._decode(queue, list(map(_ENTRY, fresh)))
            filtered = queue.decode is not None and not accepts.accepts_all
            if not filtered and not self.settings.fifo:
                out.extend(received_first(messages, list(map(_RECORD_HANDLE, fresh)), group))
                fresh.clear()
                return
            for record, message in zip(fresh, messages, strict=True):
                mg = record[4]
                delivered = received(
                    message,
                    attempt=1,
                    receipt_handle=record[6].decode(),
                    message_group=None if mg is None else mg.decode(),
                    group=group,
                )
                if filtered and not accepts(message):
                    rejected.append(delivered)
                else:
                    out.append(delivered)
            fresh.clear()

        for (kind, _), run in itertools.groupby(records, _KIND_QUEUE):
            if kind == 3:  # first deliveries of one queue, in offset order
                fresh.extend(run)
                take_fresh()
                continue
            for record in run:
                spent |= await self._take_again(batch, record, out, rejected)
        if rejected:
            await self.ack_many(rejected)
        return spent

    async def _take_again(
        self,
        batch: Sequence[tuple[_PopQueue, TagFilter]],
        record: Sequence[Any],
        out: list[ReceivedMessage],
        rejected: list[ReceivedMessage],
    ) -> bool:
        """A record of a delivery after the first (or a FIFO head released by an ack):
        into ``out``, or ``rejected`` (an attached stream's filter), or dead-lettered
        (attempts used up: returns True)."""
        kind, index, entry_id, attempt, message_group, fields, handle = record
        queue, accepts = batch[int(index)]
        (message,) = self._decode(queue, [(entry_id, fields)])
        attempt = int(attempt)
        group = self.settings.group
        delivered = received(
            message,
            attempt=attempt,
            receipt_handle=_text(handle),
            message_group=None if message_group is None else _text(message_group),
            group=group,
        )
        if int(kind) == 2:
            last = self.settings.dead_letter(
                attrs.evolve(message, reconsume_times=attempt - 2), len(self._topics[queue.topic])
            )
            await self.broker.send_to_dlq(group, last)
            await self._settle(delivered, -1, "dead-lettering")
            return True
        if queue.decode is not None and not accepts(message):
            rejected.append(delivered)
        else:
            out.append(delivered)
        return False

    def _decode(self, queue: _PopQueue, entries: list[tuple[bytes, Any]]) -> list[Message]:
        """Entries of one queue as messages (several at once only in offset order)."""
        try:
            if queue.decode is not None:
                return _decode_attached(queue.topic, queue.queue_id, entries, queue.decode)
            return _decode_entries(queue.topic, queue.queue_id, entries)
        except _ForeignEntry as exc:
            raise SourceError(
                f"stream {queue.stream} holds an entry the broker cannot read: {exc}",
                retriable=False,
            ) from None

    async def _wait(self, last_ids: list[tuple[str, Any]], remaining: float, wait_ms: int) -> None:
        """Block until a stream gets an entry, an invisible time ends, or ``remaining``
        seconds pass (FIFO: at most ``_FIFO_POLL``)."""
        block = min(remaining, _MAX_BLOCK)
        if wait_ms >= 0:
            block = min(block, max(wait_ms, 1) / 1000)
        if self.settings.fifo:
            block = min(block, _FIFO_POLL)
        if self.broker.cluster:
            # one slot per command: watch one stream at a time
            block = min(block, _CLUSTER_POLL)
            last_ids = last_ids[next(self._rotation) % len(last_ids) :][:1]
        connection = self.broker._connection
        streams = [s for s, _ in last_ids]
        ids = [i for _, i in last_ids]
        block_ms = max(1, int(block * 1000))
        await connection.call(
            "waiting for messages",
            functools.partial(
                connection.execute, "XREAD", "COUNT", 1, "BLOCK", block_ms, "STREAMS",
                *streams, *ids, keys=(5,),
            ),
        )  # fmt: skip

    async def _settle(self, message: ReceivedMessage, change_ms: int, what: str) -> int:
        code = (await self._settle_many([message], change_ms, what))[0]
        return code

    async def _settle_many(
        self, messages: Sequence[ReceivedMessage], change_ms: int, what: str
    ) -> list[int]:
        """Settle ``messages`` (any queues): one script call (on a Cluster, one per
        queue). Returns their codes, in order (see :data:`SETTLE_LUA`: 1 done)."""
        keys_of = list(map(_QUEUE_KEY, messages))
        if keys_of.count(keys_of[0]) == len(keys_of):  # one queue
            positions: list[tuple[tuple[str, int], list[int]]] = [
                (keys_of[0], list(range(len(messages))))
            ]
        else:  # by queue, in order within each (a stable sort)
            order = sorted(range(len(messages)), key=keys_of.__getitem__)
            positions = [
                (key, list(at)) for key, at in itertools.groupby(order, keys_of.__getitem__)
            ]
        codes = [1] * len(messages)
        known = []
        for key, at in positions:
            queue = self._by_queue.get(key)
            if queue is None:
                for i in at:
                    codes[i] = -1
            else:
                known.append((queue, at))
        batches = [[q] for q in known] if self.broker.cluster else [known]
        per = 5 if self.settings.fifo else 2
        connection = self.broker._connection
        for batch in batches:
            if not batch:
                continue
            keys: list[str] = []
            args: list[Any] = [self.settings.group, change_ms, per]
            for queue, at in batch:
                keys.extend(queue.keys[:per])
                args.append("\0".join(map(_HANDLE, map(messages.__getitem__, at))))
            reply = await connection.call(
                f"{what} on {', '.join(q.stream for q, _ in batch)}",
                functools.partial(self._settle_script, keys=keys, args=args),
            )
            if reply:
                flat = [i for _, at in batch for i in at]
                for index, code in zip(reply[::2], reply[1::2], strict=True):
                    codes[flat[int(index)]] = int(code)
        return codes

    def _check(self, message: ReceivedMessage, what: str) -> None:
        if not isinstance(message, ReceivedMessage):
            raise InvalidReceiptHandleError(
                f"{what} needs a message returned by receive(), got {type(message).__name__}"
            )
        if message.consumer_group != self.settings.group:
            raise InvalidReceiptHandleError(
                f"{what} of message {message.msg_id} refused: it was received by group"
                f" {message.consumer_group!r}, not {self.settings.group!r}"
            )

    @staticmethod
    def _refused(message: ReceivedMessage, code: int, what: str) -> InvalidReceiptHandleError:
        described = f"message {message.msg_id} (delivery attempt {message.delivery_attempt})"
        if code == -2:
            return InvalidReceiptHandleError(
                f"{what} of {described} refused: its invisible duration passed, the receipt"
                " handle is expired (the message is visible again and will be delivered"
                " again)"
            )
        return InvalidReceiptHandleError(
            f"{what} of {described} refused: the group {message.consumer_group!r} no longer"
            " has it in flight under this receipt handle (acked already, received again"
            " after its invisible duration passed, or dead-lettered)"
        )

    async def ack(self, message: ReceivedMessage) -> None:
        self._check(message, "ack")
        code = await self._settle(message, -1, f"acking {message.msg_id}")
        if code != 1:
            raise self._refused(message, code, "ack")

    async def ack_many(self, messages: Sequence[ReceivedMessage]) -> list[ReceivedMessage]:
        """Ack ``messages`` (one script call, on a Cluster one per queue); returns
        those refused."""
        group = self.settings.group
        for message in messages:
            if type(message) is not ReceivedMessage or message.consumer_group != group:
                self._check(message, "ack")
        codes = await self._settle_many(messages, -1, "acking")
        if codes.count(1) == len(codes):
            return []
        return [m for m, code in zip(messages, codes, strict=True) if code != 1]

    async def change_invisible_duration(self, message: ReceivedMessage, duration: float) -> None:
        self._check(message, "change_invisible_duration")
        code = await self._settle(
            message,
            max(0, round(duration * 1000)),
            f"changing the invisible time of {message.msg_id}",
        )
        if code != 1:
            raise self._refused(message, code, "change_invisible_duration")
