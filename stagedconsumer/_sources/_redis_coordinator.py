"""RedisCoordinator: group membership and queue locks in Redis, for RedisBroker groups.

Keys and scripts: see ``_redis_scripts`` (``members``, ``lock`` and ``epoch`` keys;
``HEARTBEAT_LUA``, ``LOCK_LUA``, ``UNLOCK_LUA``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import attrs

from .._core import TakeoverBackoff
from .._message import MessageQueue
from ._group import GroupCoordinator, GroupOptions
from ._redis_connection import RedisConnection, RedisScript
from ._redis_scripts import HEARTBEAT_LUA, LOCK_LUA, UNLOCK_LUA

__all__ = ("RedisCoordinator", "RedisCoordinatorStatistics")

logger = logging.getLogger("stagedconsumer.redis")


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

    :meth:`RedisBroker.group_coordinator
    <stagedconsumer.RedisBroker.group_coordinator>` makes it on the broker's
    :class:`~._redis_connection.RedisConnection`: one connection pool, and connection
    errors counted with the broker's.

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

    def __init__(
        self, connection: RedisConnection, options: GroupOptions, *, namespace: str
    ) -> None:
        self._connection = connection
        self._options = options
        self._namespace = namespace
        self._members: dict[tuple[str, str], _MemberState] = {}
        self._heartbeat_script = RedisScript(connection, HEARTBEAT_LUA)
        self._lock_script = RedisScript(connection, LOCK_LUA)
        self._unlock_script = RedisScript(connection, UNLOCK_LUA)

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

    def _lock_key(self, group: str, mq: MessageQueue) -> str:
        return f"{self._namespace}:lock:{{{group}}}:{mq.topic}:{mq.queue_id}"

    def _epoch_key(self, group: str, mq: MessageQueue) -> str:
        return f"{self._namespace}:epoch:{{{group}}}:{mq.topic}:{mq.queue_id}"

    def _members_key(self, group: str) -> str:
        return f"{self._namespace}:members:{{{group}}}"

    async def heartbeat(self, group: str, client_id: str) -> list[str]:
        ttl_ms = round(self._options.effective_member_ttl * 1000)
        key = self._members_key(group)
        reply = await self._connection.call(
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
        await self._connection.call(
            f"{client_id} leaving {group}",
            lambda: self._connection.execute("ZREM", key, client_id),
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
        reply = await self._connection.call(
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
        await self._connection.call(
            f"unlocking {len(queues)} queue(s) of {group}",
            lambda: self._unlock_script(keys=keys, args=[client_id]),
        )

    async def lock_owner(self, group: str, mq: MessageQueue) -> str | None:
        """Who holds the lock of ``mq`` now (for tools and tests)."""
        key = self._lock_key(group, mq)
        owner = await self._connection.call(
            f"reading the lock of {mq}", lambda: self._connection.execute("HGET", key, "owner")
        )
        return owner.decode() if isinstance(owner, bytes) else owner

    async def lock_expires_in(self, group: str, mq: MessageQueue) -> float | None:
        """Seconds until the lock of ``mq`` expires unless its owner renews it
        (``None``: nobody holds it). For tools: a member killed without leaving
        keeps its queues until then."""
        key = self._lock_key(group, mq)
        ms = await self._connection.call(
            f"reading the expiry of the lock of {mq}",
            lambda: self._connection.execute("PTTL", key),
        )
        return int(ms) / 1000 if int(ms) >= 0 else None
