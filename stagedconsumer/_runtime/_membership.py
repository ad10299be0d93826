"""GroupMembership: one member of a consumer group spread over processes.

With a coordinator (``RedisBroker``), a consumer consumes a queue only while it
holds the queue's lock. Each round the member heartbeats, allocates the group's
queues among the live members, and renews and acquires locks; the sans-I/O
:class:`~stagedconsumer._core.QueueOwnership` keeps where each queue stands and
decides what to do::

    acquire: lock (epoch e) -> claim the store row with fence e (later writes with
             an older token are refused) -> load progress -> start pulling
    release: stop pulling -> drain in-flight handlers -> commit with fence e -> unlock
    lost:    the lease ended (local_lock_ttl after the last renewal request was
             sent) or a commit came back fenced -> release at once, no commit; its
             commit would be refused if the new owner already claimed the queue.

A queue's batches are handed to handlers only while its lease lasts (the
dispatcher checks the lease deadline before every batch, and a plain ``def``
handler's thread checks it again right before the call, giving the batch back
uncalled if it ended), so a member paused longer than its lease (SIGSTOP, a long GC
pause) starts no handler on a queue it may have lost, even before it notices.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import anyio
import anyio.abc

from offsetstore import OffsetStoreError, StageOffsetStore

from .._core import Dispatcher, Lost, QueueOwnership
from .._exceptions import SourceError, SourcePermissionError
from .._filter import TagFilter
from .._message import MessageQueue
from .._sources._gray import AllocateMessageQueueByGray, gray_ratio_of
from .._sources._group import AllocateMessageQueueStrategy, GroupCoordinator, member_mode
from ._queues import QueueTable
from ._state import ConsumerState

__all__ = ("GroupMembership",)

logger = logging.getLogger("stagedconsumer")

_LOCK_RETRY_INTERVAL = 1.0
"""Seconds between attempts to lock a queue allocated here but still locked by its
previous owner (which is draining it, or dead until its lock expires)."""
_ERRORS = (SourceError, OffsetStoreError, OSError, TimeoutError)


class GroupMembership:
    """Membership, allocation and queue locks of one consumer in its group."""

    def __init__(
        self,
        *,
        coordinator: GroupCoordinator,
        state: ConsumerState,
        client_id: str,
        store: StageOffsetStore,
        queues: QueueTable,
        dispatcher: Dispatcher,
        subscribed: Mapping[MessageQueue, TagFilter],
        strategy: AllocateMessageQueueStrategy | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.options = coordinator.options
        self.state = state
        self.group = state.group
        self.client_id = client_id
        self.store = store
        self.queues = queues
        self.dispatcher = dispatcher
        self.subscribed = dict(subscribed)
        self.strategy = strategy if strategy is not None else self.options.allocate_strategy
        """How this member allocates (the coordinator's strategy unless gray release
        is on)."""
        self._gray: frozenset[MessageQueue] = frozenset()
        self._warned_gray = False
        self._mode = member_mode(client_id)
        self._warned_modes: frozenset[str] = frozenset()
        self.ownership = QueueOwnership()
        self._coordinating = anyio.Lock()
        """Held around each round's plan and lock request and around every unlock: a
        round must not renew (and so re-acquire) a lock that a release or a failed
        takeover is handing back, and a queue is forgotten only once its unlock is
        done."""
        self._scope: anyio.CancelScope | None = None
        self._tasks: anyio.abc.TaskGroup | None = None

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Rebalance every ``tick`` (sooner while a wanted queue is still locked by
        another member, or when a lease ends) until :meth:`stop`."""
        options = self.options
        ownership = self.ownership
        started = False
        with anyio.CancelScope() as scope:
            self._scope = scope
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                while not self.state.stopping:
                    pending = False
                    try:
                        pending = await self._round()
                    except _ERRORS as exc:
                        if isinstance(exc, SourcePermissionError):
                            logger.error(
                                "group %s: rebalance of %s refused for good (%s);"
                                " stopping the consumer",
                                self.group,
                                self.client_id,
                                exc,
                            )
                            self.state.fail(exc)
                            return
                        logger.warning(
                            "group %s: rebalance of %s failed (%s); retrying",
                            self.group,
                            self.client_id,
                            exc,
                        )
                    self._on_lost(ownership.expired(anyio.current_time()))
                    if not started:
                        started = True
                        task_status.started()
                    delay = options.tick
                    if pending:
                        delay = min(delay, _LOCK_RETRY_INTERVAL)
                    timer = ownership.get_timer()
                    if timer is not None:
                        delay = min(delay, max(0.01, timer - anyio.current_time()))
                    await self.coordinator.wait_changed(self.group, self.client_id, delay)

    def stop(self) -> None:
        """Stop rebalancing (releases under way are cancelled with it)."""
        if self._scope is not None:
            self._scope.cancel()

    async def _round(self) -> bool:
        """Heartbeat, allocate, release, renew and acquire. Returns whether a queue
        allocated here is still locked by another member."""
        coordinator = self.coordinator
        options = self.options
        ownership = self.ownership
        with anyio.fail_after(options.lock_renew_interval):
            members = await coordinator.heartbeat(self.group, self.client_id)
        if self.client_id not in members:
            members = sorted([*members, self.client_id])
        self._check_modes(members)
        queues = sorted(self.subscribed)
        if isinstance(self.strategy, AllocateMessageQueueByGray):
            self._gray = frozenset(self.strategy.gray_queues(queues, members))
        elif not self._warned_gray and any(gray_ratio_of(m) is not None for m in members):
            self._warned_gray = True
            logger.warning(
                "group %s: gray members joined (%s), but this member allocates with %s,"
                " which does not know gray members: some queues may be allocated by"
                " nobody. Turn enable_gray_switch on on every member of the group.",
                self.group,
                ", ".join(m for m in members if gray_ratio_of(m) is not None),
                type(self.strategy).__name__,
            )
        mine = self.strategy.allocate(self.group, self.client_id, queues, members)
        async with self._coordinating:
            plan = ownership.plan(mine)
            for mq in plan.release:
                self._start_release(mq)
            sent = anyio.current_time()
            with anyio.fail_after(options.lock_renew_interval):
                granted = await coordinator.lock(self.group, self.client_id, list(plan.lock))
            outcome = ownership.locked(granted, sent, options.local_lock_ttl)
        self._on_lost(outcome.lost)
        for queue in self.queues:  # renewed leases: batches may be handed out longer
            deadline = ownership.deadline(queue.mq)
            if deadline is not None:
                # READY when the lease had lapsed with work held back (skipped by a
                # take, or a batch given back uncalled): wake a worker for it.
                effects = self.dispatcher.set_lease(queue.pq, deadline)
                if effects:
                    self.queues.signals.apply(queue.pq, effects)
        await self._take(outcome.take)
        return outcome.pending

    async def _take(self, take: Sequence[tuple[MessageQueue, int]]) -> None:
        """Claim and load the queues granted this round, tell the queue listeners
        once about all of them, then start them."""
        ownership = self.ownership
        loaded = []
        for mq, epoch in take:
            try:
                await self.store.claim(self.group, mq, epoch)
                queue = await self.queues.load(mq, self.subscribed[mq])
            except _ERRORS as exc:
                logger.warning(
                    "group %s: could not take over %s (%s); unlocking it", self.group, mq, exc
                )
                async with self._coordinating:
                    if ownership.take_failed(mq, epoch):
                        await self._unlock([mq])
                continue
            loaded.append((mq, epoch, queue))
        if not loaded:
            return
        # before taken(): no await between it and start
        await self.queues.assigned([mq for mq, _, _ in loaded])
        for mq, epoch, queue in loaded:
            if self.state.stopping:  # shut down mid-takeover: hand the lock back now
                await self.queues.revoked([mq])
                self.store.remove_offset(self.group, mq)
                with anyio.CancelScope(shield=True):
                    async with self._coordinating:
                        if ownership.take_failed(mq, epoch):
                            await self._unlock([mq])
                continue
            if not ownership.taken(mq, epoch):  # lost meanwhile: its release is under way
                await self.queues.revoked([mq])
                self.store.remove_offset(self.group, mq)
                continue
            deadline = ownership.deadline(mq)
            assert deadline is not None
            queue.pq.set_lease(deadline)
            self.queues.start(queue)
            logger.info(
                "group %s: %s took %s at offset %d (epoch %d)",
                self.group,
                self.client_id,
                mq,
                queue.pq.committed_offset,
                epoch,
            )

    def _check_modes(self, members: Sequence[str]) -> None:
        """Say loudly (an ERROR, once per set of members) when live members of the group
        consume in another mode than this one. Not refused: a deployment that changes
        a group's mode runs both for a while. But each member consumes the queues
        allocated to it its own way, so while they disagree the group's ordering is
        the weakest of their modes'."""
        mine = self._mode
        if mine is None:
            return
        others = frozenset(
            m for m in members if (mode := member_mode(m)) is not None and mode != mine
        )
        if not others or others <= self._warned_modes:
            return
        self._warned_modes |= others
        logger.error(
            "group %s: members consume in another mode than this %s member %s: %s. The"
            " members of a group must agree on the mode (the listener's kind): each"
            " consumes the queues allocated to it its own way, so the group keeps only"
            " the weakest order of their modes. Give the other listener its own group,"
            " unless this is a deployment changing the group's mode",
            self.group,
            mine,
            self.client_id,
            ", ".join(f"{m} ({member_mode(m)})" for m in sorted(others)),
        )

    def is_gray(self, mq: MessageQueue) -> bool:
        """Whether ``mq`` is a gray queue as of the last rebalance (gray release)."""
        return mq in self._gray

    def on_fenced(self, refused: Mapping[MessageQueue, int]) -> None:
        """Commits with these fences were refused (the committer's callback)."""
        self._on_lost(self.ownership.fenced(refused))

    def _on_lost(self, lost: Lost) -> None:
        for mq in lost.queues:
            logger.warning(
                "group %s: %s lost the lock of %s (lease ended or a commit was fenced);"
                " releasing it without committing",
                self.group,
                self.client_id,
                mq,
            )
            queue = self.queues.states.get(mq)
            if queue is not None:
                queue.pq.drop()  # at once: no batch of it goes to a handler any more
        for mq in lost.release:
            self._start_release(mq)

    def _start_release(self, mq: MessageQueue) -> None:
        queue = self.queues.states.get(mq)
        if queue is not None:
            queue.pq.drop()
        assert self._tasks is not None
        self._tasks.start_soon(self._release, mq)

    async def _release(self, mq: MessageQueue) -> None:
        """Drain ``mq``, commit its progress with its epoch as fence, then unlock it.

        A queue whose lease ended is committed too: if another member claimed it
        meanwhile, the store refuses the stale fence; if not, what finished here is
        kept and fewer messages come again. Unlocking deletes the lock only if this
        member still owns it."""
        ownership = self.ownership
        epoch = ownership.epoch(mq)
        forgotten = False
        try:
            try:
                kept = await self.queues.release(
                    mq, fences={mq: epoch} if epoch is not None else {}
                )
            except (OffsetStoreError, OSError) as exc:
                logger.warning(
                    "group %s: could not commit %s on release (%s); its lock will expire",
                    self.group,
                    mq,
                    exc,
                )
                kept = False
            await self.queues.revoked([mq])  # drained and committed; still locked
            if kept:
                # Forgotten together with the unlock: a round in between would renew
                # the lock (still DRAINING here), that is take it anew once unlocked,
                # and keep it from the member the queue was released to until it
                # expires.
                async with self._coordinating:
                    await self._unlock([mq])
                    ownership.released(mq)
                    forgotten = True
            logger.info(
                "group %s: %s released %s%s",
                self.group,
                self.client_id,
                mq,
                "" if kept else " (not committed: lock lost)",
            )
        finally:
            if not forgotten:
                ownership.released(mq)

    async def _unlock(self, queues: Sequence[MessageQueue]) -> None:
        try:
            with anyio.fail_after(self.options.lock_renew_interval):
                await self.coordinator.unlock(self.group, self.client_id, queues)
        except (SourceError, TimeoutError) as exc:  # best effort: the lock also expires
            logger.warning(
                "group %s: unlocking %s failed (%s)", self.group, ", ".join(map(str, queues)), exc
            )

    async def leave(self) -> None:
        """Hand back every lock still held (progress already committed) and leave the
        group."""
        held = self.ownership.leave()
        try:
            with anyio.fail_after(self.options.lock_renew_interval):
                await self.coordinator.unlock(self.group, self.client_id, held)
                await self.coordinator.leave(self.group, self.client_id)
        except (SourceError, TimeoutError) as exc:
            logger.warning(
                "group %s: %s could not leave cleanly (%s); its locks will expire",
                self.group,
                self.client_id,
                exc,
            )
