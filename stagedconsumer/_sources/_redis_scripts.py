"""The Lua scripts of the Redis broker and coordinator, and the key layout they share.

Key layout (``ns`` is the namespace, ``sc`` by default)::

    ns:topics                          hash   topic -> queue count
    ns:q:{<topic>:<queue_id>}          stream the queue's log
    ns:seq:{<topic>:<queue_id>}        string the number of messages ever sent to the queue
    ns:times:{<topic>:<queue_id>}      list   retention checkpoints <counter>:<server ms>
    ns:floors:{<topic>:<queue_id>}     hash   group -> <committed offset>:<expiry ms>
    ns:delay:{%RETRY%<group>:0}        zset   retries not yet due (score: due time, ms)
    ns:delay-bad:{%RETRY%<group>:0}    list   members of the delay set that were no
                                              packed message (the last 1,000)
    ns:members:{<group>}               zset   live members (score: expiry, ms)
    ns:lock:{<group>}:<topic>:<qid>    hash   owner, epoch; expires (PEXPIRE) unless renewed
    ns:epoch:{<group>}:<topic>:<qid>   string last epoch handed out for that queue

The braces are Redis Cluster hash tags: every script touches one slot. A queue's
stream and counter share its tag (a group's retry queue and its ``delay`` set too),
a group's members, locks and epochs the group's.

Queue offsets are stream entry ids: the message at offset ``n`` has the explicit id
``<n + 1>-0`` (Redis refuses ``0-0``). :data:`SEND_LUA` reads the queue's ``seq``
counter, ``XADD``s with the next ids and sets the counter, atomically, so concurrent
producers get consecutive offsets without gaps and a pull by offset is an ``XRANGE``
from ``<offset + 1>-0``; ``seq`` is the queue's max offset. Only the broker writes
these streams: an entry written by anything else (a foreign entry) is refused by
:data:`SEND_LUA` and by pulls, naming it.

Every time a script works with (retry due times, member expiry, lock epochs) is the
Redis server's clock (``TIME``), never a client's.
"""

from __future__ import annotations

__all__ = (
    "DELAY_LUA",
    "FLOOR_LUA",
    "RETAIN_LUA",
    "MIN_OFFSET_LUA",
    "OFFSET_FOR_TIME_LUA",
    "HEARTBEAT_LUA",
    "LOCK_LUA",
    "RELEASE_LUA",
    "SEND_LUA",
    "UNLOCK_LUA",
    "UNPACK_LUA",
)

RETAIN_LUA = """
local function retain(stream, times, floors, counter, added, a)
  local max_len, max_age, hard_len, every = tonumber(a[1]), tonumber(a[2]), tonumber(a[3]),
    tonumber(a[4])
  if max_len <= 0 and max_age <= 0 and hard_len <= 0 then return {0, 0} end
  local due = math.floor(counter / every) ~= math.floor((counter - added) / every)
  local now = 0
  if max_age > 0 or due then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  if max_age > 0 then
    local last = redis.call('LINDEX', times, -1)
    local lt = last and tonumber(string.match(last, ':(%d+)$')) or 0
    if due or now - lt >= math.max(math.floor(max_age / 64), 1) then
      redis.call('RPUSH', times, counter .. ':' .. now)
      due = true
    end
  end
  if not due then return {0, 0} end
  local cut = 0
  if max_len > 0 then cut = counter - max_len end
  local aged_n = 0
  if max_age > 0 then
    local head = redis.call('LRANGE', times, 0, 1000)
    for i, item in ipairs(head) do
      local c, t = string.match(item, '^(%d+):(%d+)$')
      if c and tonumber(t) >= now - max_age then break end
      if c and tonumber(c) > cut then cut = tonumber(c) end
      aged_n = i
    end
  end
  local floor = nil
  local all = redis.call('HGETALL', floors)
  for i = 1, #all, 2 do
    local off, exp = string.match(all[i + 1], '^(%d+):(%d+)$')
    if not off or tonumber(exp) < now then
      redis.call('HDEL', floors, all[i])
    elseif not floor or tonumber(off) < floor then
      floor = tonumber(off)
    end
  end
  if floor and cut > floor then cut = floor end
  local forced = 0
  if hard_len > 0 and counter - hard_len > cut then
    if floor and counter - hard_len > floor then forced = counter - hard_len - floor end
    cut = counter - hard_len
  end
  if cut <= 0 then return {0, 0} end
  for i = 1, aged_n do
    local c = string.match(redis.call('LINDEX', times, 0) or '', '^(%d+):')
    if c and tonumber(c) > cut then break end
    redis.call('LPOP', times)
  end
  redis.call('XTRIM', stream, 'MINID', '~', (cut + 1) .. '-0')
  return {forced, cut}
end
"""
"""A library, not a script: ``retain(stream, times, floors, counter, added, args)``
trims a queue's stream after ``added`` entries were appended (``counter`` is its
``seq`` counter after them) to its retention, ``args``: max length, max age in ms,
hard max length, check every (0: no limit).

Cheap: the limits are checked only when the counter crossed a multiple of *check
every* (or, for the age, a 64th of the max age passed since the last check), and
the stream is trimmed with ``XTRIM MINID ~`` (Redis removes whole nodes only: up to
about 100 entries more are kept, never fewer). The age is the time the broker
stored the entries (the Redis server's clock): ``times`` is a list of
``<counter>:<ms>`` checkpoints, one per check, whose head says which offsets are
older than the max age. ``floors`` is a hash ``group -> <committed offset>:<expiry
ms>`` that consumers renew (``FLOOR_LUA``): the trim point never passes the lowest
committed offset of a live group (expired entries are dropped), unless the hard
max length is reached. Returns ``{entries past a live group's committed offset
trimmed because of the hard max length (approximate), the trim point}``.
"""

SEND_LUA = (
    RETAIN_LUA
    + """
local top = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
local first = tonumber(redis.call('GET', KEYS[1]) or '0')
if top then
  local ms, sq = string.match(top[1], '^(%d+)%-(%d+)$')
  if sq ~= '0' or tonumber(ms) > first then
    return redis.error_reply('FOREIGN stream ' .. KEYS[2] .. ' holds entry ' .. top[1]
      .. ' that the broker did not write (its last offset is ' .. first .. ')')
  end
end
local n = tonumber(ARGV[5])
local i = 6
for m = 1, n do
  local nf = tonumber(ARGV[i])
  local args = {}
  for f = 1, nf do args[f] = ARGV[i + f] end
  redis.call('XADD', KEYS[2], (first + m) .. '-0', unpack(args))
  i = i + nf + 1
end
redis.call('SET', KEYS[1], first + n)
local kept = retain(KEYS[2], KEYS[3], KEYS[4], first + n, n, ARGV)
return {first, kept[1], kept[2]}
"""
)
"""Append ``n`` messages to one queue with consecutive offsets, then apply the
queue's retention (:data:`RETAIN_LUA`).

KEYS: the queue's ``seq`` counter, its stream, its ``times`` list, its ``floors``
hash. ARGV: the retention (4 values, see :data:`RETAIN_LUA`), ``n``, then per
message its field count and its fields and values (see
:func:`._redis_codec._encode_fields`). Returns ``{offset of the first message
appended, entries a live group had not committed that the hard max length trimmed,
trim point}``.

The stream's last entry is checked first: an entry the broker did not write (an id
that is not ``<n>-0``, or past the counter: a plain ``XADD key *`` by another
application) makes the script fail with a ``FOREIGN`` error naming it, before
anything is written. The counter is set after the appends, so an ``XADD`` that fails
(a script error stops there; Redis does not roll back) never leaves it raised.
"""

FLOOR_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. (now + tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[3]) * 2, 60000))
return now
"""
"""Record a group's committed offset of a queue, which retention does not trim past
while it is live.

KEYS: the queue's ``floors`` hash. ARGV: the group, its committed offset, how long
the record stays live (ms, on the server's clock). Returns the server time (ms).
"""

MIN_OFFSET_LUA = """
return {redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1), redis.call('GET', KEYS[2]) or '0'}
"""
"""A queue's first entry and its counter, read atomically.

KEYS: the queue's stream, its ``seq`` counter. Returns ``{entries, counter}``: the
first entry (an empty list when there is none) and the counter (``'0'`` when unset).
"""

OFFSET_FOR_TIME_LUA = """
local ts = tonumber(ARGV[1])
local hi = tonumber(redis.call('GET', KEYS[2]) or '0')
local lo = 0
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
if first then lo = tonumber(string.match(first[1], '^(%d+)')) - 1 else return hi end
local function born(entry)
  local f = entry[2]
  for i = 1, #f, 2 do
    if f[i] == 't' then return tonumber(f[i + 1]) end
  end
  return 0
end
while lo < hi do
  local mid = math.floor((lo + hi) / 2)
  local e = redis.call('XRANGE', KEYS[1], (mid + 1) .. '-0', '+', 'COUNT', 1)[1]
  if not e then
    hi = mid
  else
    local off = tonumber(string.match(e[1], '^(%d+)')) - 1
    if born(e) >= ts then hi = mid else lo = off + 1 end
  end
end
return lo
"""
"""The offset of the first message of a queue born at or after a time.

KEYS: the queue's stream, its ``seq`` counter. ARGV: the time in ms since the epoch.
A binary search over offsets on the born time (``t`` field) of the first entry at or
after each probe; born times come from the producers' clocks, so the answer is exact
when they grow along the queue. Returns the counter when every message is older.
"""

UNPACK_LUA = """
local function unpack_fields(s)
  local out = {}
  local pos = 1
  local len_s = #s
  while pos <= len_s do
    local colon = string.find(s, ':', pos, true)
    if not colon then return nil end
    local len = tonumber(string.sub(s, pos, colon - 1))
    if not len or len < 0 or len % 1 ~= 0 or colon + len > len_s then return nil end
    out[#out + 1] = string.sub(s, colon + 1, colon + len)
    pos = colon + 1 + len
  end
  if #out == 0 or #out % 2 ~= 0 then return nil end
  return out
end
local function release_due(zset, seq, stream, bad, limit)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local due = redis.call('ZRANGEBYSCORE', zset, '-inf', now, 'LIMIT', 0, limit)
  local out = {-1}
  local off = nil
  local added = 0
  for _, member in ipairs(due) do
    local fields = unpack_fields(member)
    if fields then
      off = tonumber(redis.call('GET', seq) or '0') + 1
      redis.call('XADD', stream, off .. '-0', unpack(fields))
      redis.call('SET', seq, off)
      added = added + 1
    else
      redis.call('RPUSH', bad, member)
      redis.call('LTRIM', bad, -1000, -1)
      out[#out + 1] = member
    end
    redis.call('ZREM', zset, member)
  end
  local nxt = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
  if nxt[2] then out[1] = tonumber(nxt[2]) - now end
  return out, off, added
end
"""
"""A library, not a script: the Lua functions :data:`RELEASE_LUA` is built on.

``unpack_fields(s)`` turns a packed message (``<len>:<bytes>`` pairs, see
:func:`._redis_codec._pack`) back into a flat field list, or ``nil`` when ``s`` is
not one (a length that is not a number or runs past the end, an odd or empty field
list). ``release_due(zset, seq, stream, bad, limit)`` moves up to ``limit`` members
of ``zset`` that are due into ``stream`` with the next offsets of ``seq`` and
removes them from the set; a due member that does not unpack (written by something
else than the broker) is moved to the list ``bad`` instead (its last 1,000 kept), so
it never blocks the retries behind it. Returns ``{ms until the next member is due
(-1: none left), bad members moved...}``, the counter after the appends (``nil``:
none) and how many were appended.
"""

RELEASE_LUA = (
    UNPACK_LUA
    + RETAIN_LUA
    + """
local out, counter, added = release_due(KEYS[1], KEYS[2], KEYS[3], KEYS[4], tonumber(ARGV[1]))
local kept = {0, 0}
if counter then
  kept = retain(KEYS[3], KEYS[5], KEYS[6], counter, added, {ARGV[2], ARGV[3], ARGV[4], ARGV[5]})
end
table.insert(out, 2, kept[2])
table.insert(out, 2, kept[1])
return out
"""
)
"""Release the due retries of a group into its ``%RETRY%<group>`` queue.

KEYS: the group's ``delay`` zset, the retry queue's ``seq`` counter, its stream, the
``bad`` list that takes members that are not packed messages, the retry queue's
``times`` list and ``floors`` hash. ARGV: how many to release at most, then the
retention (4 values, see :data:`RETAIN_LUA`; the retry queue is trimmed as a topic's
queue). Returns ``{ms until the next retry is due (-1: none left), entries trimmed
past a live group's committed offset, trim point, bad members moved...}``. Atomic:
a retry is never lost between the set and the stream, and never appended twice.
"""

DELAY_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[2])
return now
"""
"""Schedule a retry.

KEYS: the group's ``delay`` zset. ARGV: the delay in ms, the packed message (see
:func:`._redis_codec._pack`). Returns the server time (ms) the delay counts from.
"""

HEARTBEAT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]) end
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[2]) * 4, 60000))
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""
"""Register a member's heartbeat and list the live members.

KEYS: the group's ``members`` zset. ARGV: the client id (empty: register nobody,
only list), the member ttl in ms. Drops expired members first; the set itself
expires after four ttls (at least a minute) without a heartbeat. Returns the live
members' client ids.
"""

LOCK_LUA = """
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
"""Take or renew queue locks.

KEYS: ``lock``, ``epoch`` key pairs, one pair per queue. ARGV: the client id, the
lock ttl in ms. Returns one epoch per queue, in order: the lock's epoch when the
client held it already (renewed), a new one when the lock was free (taken), 0 when
another client holds it. New epochs are ``max(previous + 1, server time in ms)``:
strictly increasing per queue, and still increasing after Redis lost its data (a
restart without persistence), so a fence stored in the database never blocks a new
owner forever.
"""

UNLOCK_LUA = """
local n = 0
for _, lock in ipairs(KEYS) do
  if redis.call('HGET', lock, 'owner') == ARGV[1] then
    redis.call('DEL', lock)
    n = n + 1
  end
end
return n
"""
"""Release queue locks the client holds.

KEYS: the ``lock`` keys. ARGV: the client id. Locks held by another client are left
alone. Returns how many were released.
"""
