"""Consumer groups of the Kafka broker: Kafka's group protocol, progress in its commits.

Every member of a consumer group is a member of the Kafka consumer group of the same
name (an aiokafka consumer subscribed to the member's topics, its retry topic
included). Kafka's group coordinator assigns the partitions; the member's
:class:`~stagedconsumer._runtime._membership.GroupMembership` sees the assignment
through :class:`KafkaCoordinator`, which speaks the project's coordinator interface:

- ``allocate`` (the group options' strategy) answers the partitions Kafka assigned
  to this member;
- ``lock`` grants each of them with an epoch, new for every assignment of the
  partition to this member (the fencing token its commits carry);
- a rebalance calls the member's revocation callback *before* the member rejoins:
  the coordinator takes the revoked partitions away from the allocation, wakes the
  membership, which drains them and commits, and waits until each is unlocked (or
  the rebalance timeout nearly ran out) before letting the rebalance go on. A
  revoked partition is thus committed before anyone else is given it.

:class:`KafkaOffsetStore` writes progress as Kafka offset commits made by the member
that holds the partition: Kafka refuses them once the member's generation is over
(``ILLEGAL_GENERATION``, ``UNKNOWN_MEMBER_ID``), and the store refuses them once the
partition was revoked here, so a member that lost a partition cannot commit for it.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from offsetstore import (
    QueueProgress,
    StageOffsetStore,
    StoreCommitError,
    StoreFencedError,
    StoreUnavailableError,
)

from .._exceptions import SourceError
from .._message import MessageQueue
from ._group import AllocateMessageQueueStrategy, GroupCoordinator, GroupOptions
from ._kafka_codec import METADATA_LIMIT, decode_progress, encode_progress

if TYPE_CHECKING:
    from ._kafka_codec import TopicNames


class _Broker(Protocol):
    """What the group and the store use of a ``KafkaBroker`` (a protocol: the broker
    module imports this one)."""

    names: TopicNames
    bootstrap_servers: list[str]
    session_timeout: float
    heartbeat_interval: float
    rebalance_timeout: float
    metadata_limit: int
    metadata_overflows: int
    finished_overflows: int
    metadata_rejections: int
    _metadata_cap: int | None
    metadata_missing: int

    def _options(self, **extra: Any) -> dict[str, Any]: ...

    async def _clients(self) -> tuple[Any, Any, Any]: ...

    def _tp(self, mq: MessageQueue) -> Any: ...

    async def get_queues(self, topic: str) -> Sequence[MessageQueue]: ...

    def group_coordinator(self) -> KafkaCoordinator: ...

    async def aclose(self) -> None: ...


__all__ = ("KafkaCoordinator", "KafkaOffsetStore")

logger = logging.getLogger("stagedconsumer")

_NEVER_MS = 7 * 24 * 3600 * 1000
_REVOKE_MARGIN = 0.8
_LEASE_SHARE = 0.8
"""Share of the session timeout after Kafka's last confirmation that a member still
grants its partitions."""
"""Share of the rebalance timeout a revocation waits for its partitions to drain."""


class _Member:
    """One member of a Kafka consumer group: its aiokafka consumer and assignment."""

    def __init__(self, coordinator: KafkaCoordinator, group: str, client_id: str) -> None:
        self.coordinator = coordinator
        self.group = group
        self.client_id = client_id
        self.consumer: Any = None
        self.topics: frozenset[str] = frozenset()
        self.assigned: dict[MessageQueue, int] = {}
        """Partitions Kafka assigned here, with the epoch of that assignment."""
        self.revoking: dict[MessageQueue, int] = {}
        """Revoked partitions still draining (the revocation waits for them)."""
        self.granted: set[MessageQueue] = set()
        """Partitions the membership was granted (and has not unlocked)."""
        self.changed = anyio.Event()
        self.drained = anyio.Event()
        self.leaving = False
        self.alive_at = -math.inf
        """When Kafka last confirmed this membership (a heartbeat answered, or an
        assignment received), on the event loop's clock."""

    def notify(self) -> None:
        self.changed.set()

    def epoch(self, mq: MessageQueue) -> int | None:
        epoch = self.assigned.get(mq)
        return epoch if epoch is not None else self.revoking.get(mq)

    async def ensure_started(self) -> None:
        broker = self.coordinator.broker
        wanted = frozenset(broker.names.kafka(t) for t in self.coordinator.wanted(self))
        if not wanted or (self.consumer is not None and wanted == self.topics):
            return
        if self.consumer is None:
            from aiokafka import AIOKafkaConsumer

            self.consumer = AIOKafkaConsumer(
                **broker._options(
                    group_id=self.group,
                    client_id=self.client_id,
                    enable_auto_commit=False,
                    auto_offset_reset="earliest",
                    session_timeout_ms=int(broker.session_timeout * 1000),
                    heartbeat_interval_ms=int(broker.heartbeat_interval * 1000),
                    rebalance_timeout_ms=int(broker.rebalance_timeout * 1000),
                    # this consumer never polls (the broker's fetcher reads): aiokafka
                    # must not take it for a stuck one and leave the group
                    max_poll_interval_ms=_NEVER_MS,
                )
            )
            try:
                await self.consumer.start()
            except Exception as exc:
                consumer, self.consumer = self.consumer, None
                await consumer.stop()
                raise SourceError(f"Kafka: cannot join group {self.group!r}: {exc}") from exc
            self._watch_heartbeats()
        # subscribed once started: the join goes on in the background (subscribed
        # before, start() would wait for the first assignment)
        self.consumer.subscribe(sorted(wanted), listener=_Listener(self))
        self.topics = wanted

    def _watch_heartbeats(self) -> None:
        """Note every heartbeat Kafka answers (aiokafka keeps the time to itself):
        partitions are granted only while the membership is confirmed recently, so a
        member paused past its session (SIGSTOP, a long GC pause) hands out no batch
        of a partition Kafka may have given to another member meanwhile."""
        coordinator: Any = getattr(self.consumer, "_coordinator", None)
        heartbeat = getattr(coordinator, "_do_heartbeat", None)
        if heartbeat is None:  # another aiokafka: no lease beyond Kafka's own fencing
            self.alive_at = math.inf
            return

        async def watched() -> Any:
            ok = await heartbeat()
            if ok:
                self.alive_at = anyio.current_time()
            return ok

        coordinator._do_heartbeat = watched

    def alive(self) -> bool:
        lease = self.coordinator.broker.session_timeout * _LEASE_SHARE
        return anyio.current_time() - self.alive_at < lease

    async def on_revoked(self, tps: Sequence[Any]) -> None:
        names = self.coordinator.broker.names
        for tp in tps:
            mq = MessageQueue(names.ours(tp.topic), tp.partition)
            epoch = self.assigned.pop(mq, None)
            if epoch is not None and mq in self.granted:
                self.revoking[mq] = epoch
        if not self.revoking or self.leaving:
            self.revoking.clear()
            return
        logger.info(
            "group %s: %s: Kafka revokes %s; draining before the rebalance goes on",
            self.group,
            self.client_id,
            ", ".join(map(str, sorted(self.revoking))),
        )
        self.drained = anyio.Event()
        self.notify()
        with anyio.move_on_after(self.coordinator.broker.rebalance_timeout * _REVOKE_MARGIN):
            await self.drained.wait()
        if self.revoking:
            logger.warning(
                "group %s: %s: %s not drained in time; given up uncommitted",
                self.group,
                self.client_id,
                ", ".join(map(str, sorted(self.revoking))),
            )
            self.revoking.clear()

    async def on_assigned(self, tps: Sequence[Any]) -> None:
        names = self.coordinator.broker.names
        if tps:
            self.consumer.pause(*tps)  # the member does not fetch: the broker's fetcher does
        # The epoch of an assignment is the group generation it was made in: strictly
        # increasing over the partition's successive owners, in every process, so it
        # also fences a store shared by the group (SqlOffsetStore).
        self.alive_at = max(self.alive_at, anyio.current_time())
        generation = getattr(getattr(self.consumer, "_coordinator", None), "generation", None)
        for tp in tps:
            mq = MessageQueue(names.ours(tp.topic), tp.partition)
            if mq not in self.assigned:
                if isinstance(generation, int) and generation >= 0:
                    self.assigned[mq] = generation + 1  # Tansu starts at 0, Kafka at 1
                else:
                    self.assigned[mq] = next(self.coordinator.epochs)
        self.notify()

    def unlocked(self, queues: Sequence[MessageQueue]) -> None:
        for mq in queues:
            self.granted.discard(mq)
            self.revoking.pop(mq, None)
        if not self.revoking:
            self.drained.set()


class _Listener:
    """aiokafka's rebalance listener (a ``ConsumerRebalanceListener`` by duck typing:
    aiokafka checks for the class, so it is made from it on first use)."""

    def __new__(cls, member: _Member) -> Any:
        from aiokafka import ConsumerRebalanceListener

        class Listener(ConsumerRebalanceListener):  # type: ignore[misc]
            async def on_partitions_revoked(self, revoked: Any) -> None:
                await member.on_revoked(list(revoked))

            async def on_partitions_assigned(self, assigned: Any) -> None:
                await member.on_assigned(list(assigned))

        return Listener()


class _KafkaAssignment(AllocateMessageQueueStrategy):
    """The partitions Kafka's group coordinator assigned to the member (Kafka's
    assignor decides, not this strategy)."""

    name = "kafka"
    external = True
    """The allocation is made outside (by Kafka): the consumer must not replace this
    strategy (gray release cannot split Kafka's assignment)."""

    def __init__(self, coordinator: KafkaCoordinator) -> None:
        self.coordinator = coordinator

    def allocate(
        self,
        group: str,
        current_id: str,
        queues: Sequence[MessageQueue],
        members: Sequence[str],
    ) -> list[MessageQueue]:
        member = self.coordinator.member(group, current_id)
        self.coordinator.want(member, queues)
        return [mq for mq in queues if mq in member.assigned]


class KafkaCoordinator(GroupCoordinator):
    """Group membership through Kafka's consumer groups (see the module docs)."""

    def __init__(self, broker: _Broker) -> None:
        self.broker = broker
        # A grant is trusted for lock_ttl / 2 = the session timeout after it was made,
        # and renewed three times as often: a member that stops being confirmed by
        # Kafka stops handing out batches within about a session timeout.
        session = broker.session_timeout
        self._options = GroupOptions(
            lock_ttl=2 * session,
            lock_renew_interval=session / 3,
            rebalance_interval=session / 3,
            allocate_strategy=_KafkaAssignment(self),
        )
        self.epochs = itertools.count(1)
        self._members: dict[tuple[str, str], _Member] = {}
        self._wanted: dict[tuple[str, str], frozenset[str]] = {}

    @property
    def options(self) -> GroupOptions:
        return self._options

    def member(self, group: str, client_id: str) -> _Member:
        member = self._members.get((group, client_id))
        if member is None:
            member = self._members[(group, client_id)] = _Member(self, group, client_id)
        return member

    def want(self, member: _Member, queues: Sequence[MessageQueue]) -> None:
        self._wanted[(member.group, member.client_id)] = frozenset(mq.topic for mq in queues)

    def wanted(self, member: _Member) -> frozenset[str]:
        return self._wanted.get((member.group, member.client_id), frozenset())

    def by_epoch(self, group: str, mq: MessageQueue, epoch: int) -> _Member | None:
        """The member of ``group`` holding ``mq`` with ``epoch`` (``None``: nobody
        here does any more)."""
        for (g, _), member in self._members.items():
            if g == group and member.epoch(mq) == epoch:
                return member
        return None

    async def heartbeat(self, group: str, client_id: str) -> list[str]:
        """Kafka's member heartbeats in the background; only this member is known
        here (Kafka's assignor allocates)."""
        self.member(group, client_id)
        return [client_id]

    async def leave(self, group: str, client_id: str) -> None:
        member = self._members.pop((group, client_id), None)
        self._wanted.pop((group, client_id), None)
        if member is not None and member.consumer is not None:
            member.leaving = True
            member.drained.set()
            await member.consumer.stop()

    async def lock(
        self, group: str, client_id: str, queues: Sequence[MessageQueue]
    ) -> Mapping[MessageQueue, int]:
        member = self.member(group, client_id)
        await member.ensure_started()
        granted: dict[MessageQueue, int] = {}
        if not member.alive():  # Kafka has not confirmed the membership for too long
            return granted
        for mq in queues:
            epoch = member.epoch(mq)
            if epoch is not None:
                granted[mq] = epoch
                member.granted.add(mq)
        return granted

    async def unlock(self, group: str, client_id: str, queues: Sequence[MessageQueue]) -> None:
        member = self._members.get((group, client_id))
        if member is not None:
            member.unlocked(queues)

    async def wait_changed(self, group: str, client_id: str, timeout: float) -> None:
        member = self._members.get((group, client_id))
        if member is None:
            await anyio.sleep(timeout)
            return
        if member.revoking:  # a revocation waits: come round soon for what it waits on
            timeout = min(timeout, 0.1)
        with anyio.move_on_after(timeout):
            await member.changed.wait()
        if member.changed.is_set():
            member.changed = anyio.Event()

    async def aclose(self) -> None:
        for key in list(self._members):
            await self.leave(*key)


class KafkaOffsetStore(StageOffsetStore):
    """Progress in a Kafka consumer group's offset commits.

    The committed offset of a partition is its consume offset; the commit's metadata
    string holds its stage offsets and (sparse progress) the finished ranges above it
    (compressed when long; past ``KafkaBroker(metadata_limit=)`` the highest ranges,
    then the lowest stage keys, are left out and counted): all one commit, so always
    consistent. Kafka's tooling (``kafka-consumer-groups.sh --describe``) shows the
    group, its committed offsets and lag.

    Commits of a running group go through the member that holds the partition
    (fenced: see the module docs). Writes without a member (``offsets reset``, a
    group that is not running) commit as a standalone client, which Kafka accepts
    only while the group has no members.
    """

    def __init__(self, broker: _Broker, *, own_broker: bool = False) -> None:
        """``own_broker``: :meth:`aclose` closes ``broker`` too (a store made for a
        tool, on a broker of its own)."""
        super().__init__()
        self.broker = broker
        """The broker whose group commits hold the progress."""
        self._own_broker = own_broker
        self._warned_missing = False

    @property
    def url(self) -> str:
        """``kafka://`` and the bootstrap servers (no credentials)."""
        return "kafka://" + ",".join(self.broker.bootstrap_servers)

    async def aclose(self) -> None:
        if self._own_broker:
            await self.broker.aclose()

    def _encode(self, progress: QueueProgress) -> tuple[int, str] | None:
        if progress.consume_offset is None:
            return None
        broker = self.broker
        limit = broker.metadata_limit
        cap = broker._metadata_cap
        if cap is not None:  # the broker refused longer metadata
            if cap == 0:
                return progress.consume_offset, ""
            limit = min(limit, cap)
        metadata, dropped, cut = encode_progress(progress, limit)
        if dropped or cut:
            broker.metadata_overflows += dropped
            broker.finished_overflows += cut
            logger.warning(
                "Kafka commit metadata over %d bytes: %d finished ranges and %d stage keys"
                " left out",
                limit,
                cut,
                dropped,
            )
        return progress.consume_offset, metadata

    async def _commit(
        self,
        commit: Callable[[dict[Any, tuple[int, str]]], Awaitable[object]],
        progress: Mapping[Any, QueueProgress],
    ) -> None:
        """``commit`` the encoded ``progress`` (topic partition -> progress). When the
        broker refuses the metadata as too long (``OFFSET_METADATA_TOO_LARGE``:
        ``metadata_limit`` is above its ``offset.metadata.max.bytes``), lower the
        limit (Kafka's default 4096 first, then halves, down to no metadata),
        remember it for later commits, count it and commit again: finished ranges,
        then stage keys left out, as past ``metadata_limit``."""
        from aiokafka.errors import OffsetMetadataTooLargeError

        broker = self.broker
        while True:
            offsets = {}
            for tp, value in progress.items():
                encoded = self._encode(value)
                if encoded is not None:
                    offsets[tp] = encoded
            if not offsets:
                return
            try:
                await commit(offsets)
                return
            except OffsetMetadataTooLargeError:
                longest = max(len(metadata) for _, metadata in offsets.values())
                if longest == 0:
                    raise
                broker.metadata_rejections += 1
                limit = min(longest, broker.metadata_limit, broker._metadata_cap or longest)
                # Kafka's default first, then halves (each round lower: it ends)
                cap = METADATA_LIMIT if limit > METADATA_LIMIT else limit // 2
                broker._metadata_cap = cap if cap >= 16 else 0
                logger.warning(
                    "Kafka refused commit metadata of %d bytes as too large (the broker's"
                    " offset.metadata.max.bytes is below metadata_limit=%d): committing"
                    " with at most %d bytes from now on; counted in"
                    " statistics().metadata_rejections",
                    longest,
                    broker.metadata_limit,
                    broker._metadata_cap,
                )

    async def _fetch(self, group: str, mqs: Sequence[MessageQueue] | None) -> dict[Any, Any]:
        admin, _, _ = await self._clients()
        tps = None if mqs is None else [self.broker._tp(mq) for mq in mqs]
        try:
            return dict(await admin.list_consumer_group_offsets(group, partitions=tps))
        except Exception as exc:
            raise StoreUnavailableError(f"Kafka: cannot read offsets of {group!r}: {exc}") from exc

    async def _clients(self) -> tuple[Any, Any, Any]:
        try:
            return await self.broker._clients()
        except SourceError as exc:
            raise StoreUnavailableError(str(exc), retriable=exc.retriable) from exc

    def _progress(self, found: Any) -> QueueProgress | None:
        if found is None or found.offset is None or found.offset < 0:
            return None
        if not found.metadata:
            # every commit of this store carries metadata: none means another client
            # committed, or the broker does not keep commit metadata (Tansu 0.6)
            self.broker.metadata_missing += 1
            if not self._warned_missing:  # once per store: a broker that drops it drops all
                self._warned_missing = True
                logger.warning(
                    "Kafka commit at offset %s read back without metadata (made by another"
                    " client, or the broker keeps no commit metadata): resuming there with"
                    " no stage offsets or finished ranges; counted in"
                    " statistics().metadata_missing",
                    found.offset,
                )
        offset = int(found.offset)
        stage_offsets, finished = decode_progress(offset, found.metadata)
        try:
            return QueueProgress(
                consume_offset=offset, stage_offsets=stage_offsets, finished=finished
            )
        except (TypeError, ValueError):  # not what this store writes: the offset alone
            return QueueProgress(consume_offset=offset)

    async def _read_stored(self, group: str, mq: MessageQueue) -> QueueProgress | None:
        fetched = await self._fetch(group, [mq])
        return self._progress(fetched.get(self.broker._tp(mq)))

    async def _list_stored(
        self, group: str, topic: str | None
    ) -> dict[MessageQueue, QueueProgress]:
        mqs = None
        if topic is not None:  # named partitions (Tansu 0.6 cannot answer "all of them")
            try:
                mqs = list(await self.broker.get_queues(topic))
            except SourceError as exc:
                raise StoreUnavailableError(str(exc), retriable=exc.retriable) from exc
        fetched = await self._fetch(group, mqs)
        names = self.broker.names
        out: dict[MessageQueue, QueueProgress] = {}
        for tp, found in fetched.items():
            mq = MessageQueue(names.ours(tp.topic), tp.partition)
            progress = self._progress(found)
            if progress is not None and (topic is None or mq.topic == topic):
                out[mq] = progress
        return dict(sorted(out.items()))

    async def _claim_stored(self, group: str, mq: MessageQueue, fence: int) -> QueueProgress | None:
        coordinator = self.broker.group_coordinator()
        if coordinator.by_epoch(group, mq, fence) is None:
            raise StoreFencedError(
                f"group {group!r}: {mq} is no longer assigned here (epoch {fence})", queues=(mq,)
            )
        return await self._read_stored(group, mq)

    async def _write_fenced(
        self,
        group: str,
        progress: Mapping[MessageQueue, QueueProgress],
        fences: Mapping[MessageQueue, int],
    ) -> set[MessageQueue]:
        from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

        coordinator = self.broker.group_coordinator()
        fenced: set[MessageQueue] = set()
        batches: dict[int, tuple[Any, dict[Any, QueueProgress], list[MessageQueue]]] = {}
        for mq, value in progress.items():
            member = coordinator.by_epoch(group, mq, fences[mq])
            if member is None or member.consumer is None:
                fenced.add(mq)
                continue
            if value.consume_offset is None:
                continue
            _, values, mqs = batches.setdefault(id(member), (member, {}, []))
            values[self.broker._tp(mq)] = value
            mqs.append(mq)
        for member, values, mqs in batches.values():
            try:
                await self._commit(member.consumer.commit, values)
            except (CommitFailedError, IllegalStateError) as exc:
                logger.warning(
                    "group %s: Kafka refused the commit of %s (%s)",
                    group,
                    ", ".join(map(str, mqs)),
                    exc,
                )
                fenced.update(mqs)
            except KafkaError as exc:
                raise StoreCommitError(
                    f"Kafka: commit of group {group!r} failed: {exc}",
                    retriable=bool(getattr(exc, "retriable", True)),
                ) from exc
        return fenced

    async def _write_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress]
    ) -> None:
        await self._standalone_commit(group, progress)

    async def _overwrite_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress | None]
    ) -> None:
        if any(value is None for value in progress.values()):
            raise StoreCommitError(
                "KafkaOffsetStore cannot delete a committed offset; reset it to an offset",
                retriable=False,
            )
        await self._standalone_commit(
            group, {mq: value for mq, value in progress.items() if value is not None}
        )

    async def _standalone_commit(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress]
    ) -> None:
        from aiokafka import AIOKafkaConsumer
        from aiokafka.errors import CommitFailedError

        values = {
            self.broker._tp(mq): value
            for mq, value in progress.items()
            if value.consume_offset is not None
        }
        if not values:
            return
        await self._clients()
        consumer = AIOKafkaConsumer(
            **self.broker._options(group_id=group, enable_auto_commit=False)
        )
        try:
            await consumer.start()
            consumer.assign(list(values))
            await self._commit(consumer.commit, values)
        except CommitFailedError as exc:
            raise StoreCommitError(
                f"Kafka refused the commit: group {group!r} has members, and Kafka accepts"
                " its commits from them only; stop the group first",
                retriable=False,
            ) from exc
        except Exception as exc:
            raise StoreCommitError(
                f"Kafka: commit of group {group!r} failed (a running group accepts commits"
                f" from its members only): {exc}",
                retriable=False,
            ) from exc
        finally:
            await consumer.stop()
