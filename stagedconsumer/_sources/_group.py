"""Consumer groups across processes: queue allocation and the coordinator interface.

A source that serves several consumer processes (``RedisBroker``) exposes a
:class:`GroupCoordinator`: members register with heartbeats that expire, and each
queue is held by at most one member at a time through a lock with an expiry. Every
lock acquisition gets a new **epoch**, strictly greater than every earlier epoch of
that queue; the consumer commits progress with the epoch as a fencing token, so a
member that lost its lock (paused, partitioned, killed and late) cannot overwrite
progress written by the queue's next owner.

Allocation is a pure function (:class:`AllocateMessageQueueStrategy`) of the sorted
queues and the sorted live members: every member computes the same assignment from
the same view, and a queue it wants but another member still locks is retried until
that member releases it or its lock expires.

The embedded ``MemoryBroker`` coordinates the consumers of a group inside its
process (``MemoryCoordinator``), through the same interface. Sources without group
coordination return ``None`` from
:meth:`~stagedconsumer.MessageSource.group_coordinator`: one consumer owns every
queue.
"""

from __future__ import annotations

import abc
import bisect
import hashlib
import math
import os
import re
import socket
import uuid
from collections.abc import Mapping, Sequence

import anyio
import attrs

from .._exceptions import ConfigurationError
from .._message import MessageQueue

__all__ = (
    "AllocateMessageQueueAveragely",
    "AllocateMessageQueueByConsistentHash",
    "AllocateMessageQueueStrategy",
    "GroupCoordinator",
    "GroupOptions",
    "member_mode",
    "mode_member_id",
    "new_client_id",
)


class AllocateMessageQueueStrategy(abc.ABC):
    """Decides which queues a member of a consumer group consumes.

    Implementations must be pure and deterministic: the result depends only on the
    arguments, so every member computes the same assignment from the same view.
    Every queue goes to exactly one member.
    """

    name: str = "custom"
    """A name for the strategy (RocketMQ's ``getName()``); every member of a group
    must use the same strategy, which is not checked."""

    @abc.abstractmethod
    def allocate(
        self,
        group: str,
        current_id: str,
        queues: Sequence[MessageQueue],
        members: Sequence[str],
    ) -> list[MessageQueue]:
        """The queues of ``current_id`` among ``queues`` (sorted) and ``members`` (sorted)."""


class AllocateMessageQueueAveragely(AllocateMessageQueueStrategy):
    """RocketMQ's default: contiguous blocks of sorted queues, sizes differing by at most 1.

    With 8 queues and 3 members: members get queues 0-2, 3-5 and 6-7.
    """

    name = "averagely"
    """A name for the strategy (RocketMQ's ``getName()``)."""

    def allocate(
        self,
        group: str,
        current_id: str,
        queues: Sequence[MessageQueue],
        members: Sequence[str],
    ) -> list[MessageQueue]:
        if current_id not in members or not queues:
            return []
        index = list(members).index(current_id)
        n_queues, n_members = len(queues), len(members)
        mod = n_queues % n_members
        if n_queues <= n_members:
            average = 1
        elif mod > 0 and index < mod:
            average = n_queues // n_members + 1
        else:
            average = n_queues // n_members
        start = index * average if mod > 0 and index < mod else index * average + mod
        count = min(average, n_queues - start)
        return list(queues[start : start + max(0, count)])


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.md5(text.encode(), usedforsecurity=False).digest()[:8], "big")


class AllocateMessageQueueByConsistentHash(AllocateMessageQueueStrategy):
    """Consistent hashing (RocketMQ's ``AllocateMessageQueueConsistentHash``).

    Each member owns ``virtual_nodes`` points on a ring (MD5); a queue goes to the
    member owning the first point at or after the queue's hash. When a member joins
    or leaves, only the queues next to its points move (about ``1/members`` of them),
    at the price of a less even spread than :class:`AllocateMessageQueueAveragely`.
    """

    name = "consistent-hash"
    """A name for the strategy (RocketMQ's ``getName()``)."""

    def __init__(self, virtual_nodes: int = 10) -> None:
        if isinstance(virtual_nodes, bool) or not isinstance(virtual_nodes, int):
            raise ConfigurationError(f"virtual_nodes must be an int, got {virtual_nodes!r}")
        if virtual_nodes < 1:
            raise ConfigurationError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.virtual_nodes = virtual_nodes
        """Points per member on the hash ring."""

    def allocate(
        self,
        group: str,
        current_id: str,
        queues: Sequence[MessageQueue],
        members: Sequence[str],
    ) -> list[MessageQueue]:
        if current_id not in members:
            return []
        ring = sorted(
            (_hash(f"{member}#{i}"), member)
            for member in members
            for i in range(self.virtual_nodes)
        )
        points = [point for point, _ in ring]
        result = []
        for mq in queues:
            index = bisect.bisect_left(points, _hash(str(mq)))
            if ring[index % len(ring)][1] == current_id:
                result.append(mq)
        return result


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"{attribute.name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigurationError(f"{attribute.name} must be finite, got {value!r}")


@attrs.frozen(kw_only=True)
class GroupOptions:
    """How members of a consumer group coordinate (RocketMQ's values by default).

    - ``lock_ttl``: a queue lock expires this many seconds after its last renewal
      (RocketMQ's broker: 60 s). A killed member's queues move after at most this.
    - ``lock_renew_interval``: how often a member renews its locks (RocketMQ: 20 s).
      The member itself treats a lock as lost ``lock_ttl / 2`` after the renewal
      request was sent (RocketMQ's client: 30 s), well before the server expires it.
    - ``rebalance_interval``: how often a member heartbeats and recomputes its queues.
    - ``member_ttl``: a member that has not heartbeated for this long is dropped from
      the allocation (default ``3 * rebalance_interval``).
    - ``allocate_strategy``: :class:`AllocateMessageQueueAveragely` by default.
    """

    lock_ttl: float = attrs.field(default=60.0, validator=_positive)
    """Seconds a queue lock lives after its last renewal (RocketMQ: 60 s)."""
    lock_renew_interval: float = attrs.field(default=20.0, validator=_positive)
    """Seconds between lock renewals (RocketMQ: 20 s); below ``lock_ttl / 2``."""
    rebalance_interval: float = attrs.field(default=20.0, validator=_positive)
    """Seconds between heartbeats and queue reallocations."""
    member_ttl: float | None = attrs.field(default=None)
    """Seconds without a heartbeat before a member is dropped (``None``: ``3 *
    rebalance_interval``)."""
    allocate_strategy: AllocateMessageQueueStrategy = attrs.field(
        factory=AllocateMessageQueueAveragely
    )
    """How queues are split among members (every member must use the same)."""

    def __attrs_post_init__(self) -> None:
        if self.lock_renew_interval >= self.lock_ttl / 2:
            raise ConfigurationError(
                f"lock_renew_interval ({self.lock_renew_interval}) must be below lock_ttl / 2"
                f" ({self.lock_ttl / 2}): a member considers its lock lost after lock_ttl / 2"
            )
        if self.member_ttl is not None:
            _positive(self, attrs.fields(GroupOptions).member_ttl, self.member_ttl)  # type: ignore[arg-type]
        if not isinstance(self.allocate_strategy, AllocateMessageQueueStrategy):
            raise ConfigurationError(
                "allocate_strategy must be an AllocateMessageQueueStrategy, got"
                f" {type(self.allocate_strategy).__name__}"
            )

    @property
    def effective_member_ttl(self) -> float:
        """``member_ttl``, or ``3 * rebalance_interval`` when it is ``None``."""
        return self.member_ttl if self.member_ttl is not None else 3 * self.rebalance_interval

    @property
    def local_lock_ttl(self) -> float:
        """How long after sending a renewal a member still trusts its lock."""
        return self.lock_ttl / 2

    @property
    def tick(self) -> float:
        """Period of the rebalance loop: it also renews locks."""
        return min(self.rebalance_interval, self.lock_renew_interval)


def new_client_id() -> str:
    """``host@pid@random``: unique per consumer instance."""
    return f"{socket.gethostname()}@{os.getpid()}@{uuid.uuid4().hex[:8]}"


_MODE_MARKER = re.compile(r"@mode\[([a-z_]+)\]")


def mode_member_id(client_id: str, mode: str) -> str:
    """``client_id`` marked with the consume mode of its listener (``...@mode[staged]``),
    so that the members of a group see each other's (they must agree)."""
    return f"{client_id}@mode[{mode}]"


def member_mode(member: str) -> str | None:
    """The consume mode in a member's id, ``None`` when it has none (an older version)."""
    match = _MODE_MARKER.search(member)
    return None if match is None else match.group(1)


class GroupCoordinator(abc.ABC):
    """Membership and queue locks of consumer groups, shared by their processes.

    Ordering guarantee: at most one member holds the lock of a queue at any moment
    as seen by the coordinator; epochs of successive holders of a queue strictly
    increase. A member's own view can lag (it learns of an expiry late), which is
    why progress is committed with the epoch as a fencing token.
    """

    @property
    @abc.abstractmethod
    def options(self) -> GroupOptions:
        """The group settings (lock expiry, renewal, allocation strategy)."""

    @abc.abstractmethod
    async def heartbeat(self, group: str, client_id: str) -> list[str]:
        """Register or refresh ``client_id``; returns the live members, sorted."""

    @abc.abstractmethod
    async def leave(self, group: str, client_id: str) -> None:
        """Remove ``client_id`` from the group now (graceful shutdown)."""

    @abc.abstractmethod
    async def lock(
        self, group: str, client_id: str, queues: Sequence[MessageQueue]
    ) -> Mapping[MessageQueue, int]:
        """Acquire or renew the locks of ``queues``; returns the epoch of each lock
        ``client_id`` holds afterwards (queues locked by others are missing)."""

    @abc.abstractmethod
    async def unlock(self, group: str, client_id: str, queues: Sequence[MessageQueue]) -> None:
        """Release the locks ``client_id`` holds on ``queues`` (others stay as they are)."""

    async def wait_changed(self, group: str, client_id: str, timeout: float) -> None:
        """Wait up to ``timeout`` seconds, returning early when the coordinator knows
        that ``group`` changed since ``client_id``'s last :meth:`heartbeat` (a member
        joined or left, a lock was released), so the member rebalances at once. The
        default just sleeps ``timeout``."""
        del group, client_id
        await anyio.sleep(timeout)
