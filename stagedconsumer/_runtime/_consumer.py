"""PushConsumer: the anyio runtime of concurrent, orderly and staged consumption."""

from __future__ import annotations

import inspect
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import attrs

from offsetstore import (
    MemoryOffsetStore,
    OffsetStoreError,
    QueueProgress,
    StageOffsetStore,
    StoreFencedError,
)

from .._core import (
    Batch,
    ConsumeMode,
    Dispatcher,
    EraseStatus,
    FlowControl,
    ProcessQueue,
    StageDefinition,
    StagePlan,
    clamp_suspend_millis,
)
from .._exceptions import (
    ConfigurationError,
    ConsumerStateError,
    ListenerTypeError,
    SourceError,
    UnknownTopicError,
)
from .._filter import TagFilter
from .._listeners import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
    ConsumeStagedConcurrentlyContext,
    MessageListener,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    _concurrently_context,
    _orderly_context,
    _staged_context,
)
from .._message import Message, MessageQueue
from .._observability._hooks import (
    ConsumeMessageContext,
    ConsumeMessageHook,
    ConsumeReturnType,
    PullContext,
    SettleOutcome,
)
from .._observability._view import ConsumerStatistics
from .._options import ConsumerOptions
from .._sources._group import GroupCoordinator, new_client_id
from .._sources._source import (
    PROPERTY_RETRY_TOPIC,
    RETRY_PREFIX,
    MessageSource,
    SendBackResult,
    retry_topic,
)
from ._hooks import HookRunner, loop_clock, loop_wall_offset

__all__ = ("ConsumerStatistics", "PushConsumer")

logger = logging.getLogger("stagedconsumer")

_SEND_BACK_FAILED_DELAY = 5.0
"""Seconds before a message that could not be handed to the retry queue is retried
locally (RocketMQ's value)."""
_MAX_PULL_BACKOFF = 30.0
_MAX_PERSIST_BACKOFF = 60.0
_LOCK_RETRY_INTERVAL = 1.0
"""Seconds between attempts to lock a queue allocated here but still locked by its
previous owner (which is draining it, or dead until its lock expires)."""
_CHECKPOINT_EVERY = 64
"""Batches a worker runs back to back before it yields to other tasks."""
_CONSUME_SUCCESS = ConsumeConcurrentlyStatus.CONSUME_SUCCESS
_ORDERLY_SUCCESS = ConsumeOrderlyStatus.SUCCESS
_SUCCESS = EraseStatus.SUCCESS


@attrs.define(eq=False)
class _QueueState:
    mq: MessageQueue
    pq: ProcessQueue
    filter: TagFilter
    is_retry: bool
    pull_scope: anyio.CancelScope | None = None
    space: anyio.Event | None = None
    persisted: QueueProgress | None = None


def _overrides(listener: object, base: type, name: str) -> bool:
    return getattr(type(listener), name) is not getattr(base, name)


def _build_plan(listener: MessageListenerStagedConcurrently) -> StagePlan:
    strategies = listener.get_stage_definition_strategies()
    if not isinstance(strategies, Mapping):
        raise ConfigurationError(
            "get_stage_definition_strategies() must return a mapping of strategy id to"
            f" stage sizes, got {type(strategies).__name__}"
        )
    definitions = {
        str(strategy): StageDefinition.of(sizes, name=f"stage definitions of {strategy!r}")
        for strategy, sizes in strategies.items()
    }
    base = MessageListenerStagedConcurrently
    reset: Callable[[str, int], int] | None = None
    if _overrides(listener, base, "reset_current_stage_offset_if_need"):
        reset = listener.reset_current_stage_offset_if_need
    return StagePlan(
        definitions=definitions,
        compute_strategy=listener.compute_strategy
        if _overrides(listener, base, "compute_strategy")
        else None,
        compute_group=listener.compute_group
        if _overrides(listener, base, "compute_group")
        else None,
        reset=reset,
    )


class PushConsumer:
    """Pulls the subscribed topics from a source and pushes messages to a listener.

    The listener's kind picks the mode: :class:`MessageListenerConcurrently`
    (no order), :class:`MessageListenerOrderly` (one batch at a time per queue, in
    offset order) or :class:`MessageListenerStagedConcurrently` (concurrent inside a
    stage, stage ``k + 1`` of a stage key only after all of stage ``k`` finished).
    Ordering holds within a queue; queues never block each other.

    Use it as an async context manager: ``async with consumer:`` starts pulling and
    consuming; leaving the block stops pulling, lets in-flight handler calls finish
    (up to ``options.shutdown_timeout``), and persists progress. Progress (consume
    offset and stage offsets of every queue) goes to ``offset_store`` (default: a
    :class:`~offsetstore.MemoryOffsetStore`) every
    ``options.persist_consumer_offset_interval`` seconds and on shutdown; a consumer
    started on the same store resumes from it, with identical stage assignment.
    Delivery is at-least-once: nothing committed is ever unfinished.
    """

    def __init__(
        self,
        group: str,
        source: MessageSource,
        listener: MessageListener,
        *,
        offset_store: StageOffsetStore | None = None,
        options: ConsumerOptions | None = None,
    ) -> None:
        if not isinstance(group, str) or not group or group.startswith(("%", " ")):
            raise ConfigurationError(f"group must be a non-empty name, got {group!r}")
        if not isinstance(source, MessageSource):
            raise ConfigurationError(f"source must be a MessageSource, got {type(source).__name__}")
        if options is None:
            options = ConsumerOptions()
        elif not isinstance(options, ConsumerOptions):
            raise ConfigurationError(
                f"options must be ConsumerOptions, got {type(options).__name__}"
                " (use ConsumerOptions(**values) or ConsumerOptions.from_mapping())"
            )
        self._plan: StagePlan | None = None
        if isinstance(listener, MessageListenerStagedConcurrently):
            self._mode = ConsumeMode.STAGED
            self._plan = _build_plan(listener)
        elif isinstance(listener, MessageListenerOrderly):
            self._mode = ConsumeMode.ORDERLY
        elif isinstance(listener, MessageListenerConcurrently):
            self._mode = ConsumeMode.CONCURRENT
        else:
            raise ListenerTypeError(
                "listener must be a MessageListenerConcurrently, MessageListenerOrderly or"
                f" MessageListenerStagedConcurrently, got {type(listener).__name__}"
            )
        self._mode_name: str = self._mode.value  # read by hook contexts, once per call
        self.group = group
        self.source = source
        self.listener = listener
        self.options = options
        self.offset_store: StageOffsetStore = (
            offset_store if offset_store is not None else MemoryOffsetStore()
        )
        self._consume: Callable[..., Any] = listener.consume_message
        self._is_async = inspect.iscoroutinefunction(self._consume)
        concurrent = self._mode is ConsumeMode.CONCURRENT
        self._max_reconsume = options.effective_max_reconsume_times(concurrent=concurrent)
        self._suspend_ms = options.suspend_current_queue_time_millis
        self._subscriptions: dict[str, TagFilter] = {}
        self._states: dict[MessageQueue, _QueueState] = {}
        self._dispatcher = Dispatcher()
        self._flow = FlowControl(
            count=options.pull_threshold_for_queue,
            size_bytes=options.pull_threshold_size_for_queue,
            max_span=options.consume_concurrently_max_span if concurrent else None,
        )
        # Idle workers wait on their own event; work wakes one of them, and a worker
        # that takes a batch while more is ready wakes the next (a cascade, not a herd).
        self._idle: deque[anyio.Event] = deque()
        self._timer_event: anyio.Event | None = None
        self._progress_event: anyio.Event | None = None
        # Offsets that waiters wait for queues to commit: the lowest target per queue
        # (-1: wake on any finished batch of that queue).
        self._waiters: list[dict[ProcessQueue, int]] = []
        self._watched: dict[ProcessQueue, int] = {}
        self._paused: dict[ProcessQueue, _QueueState] = {}
        self._thread_limiter: anyio.CapacityLimiter | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._pull_tg: anyio.abc.TaskGroup | None = None
        self._workers_scope: anyio.CancelScope | None = None
        self._workers_done: anyio.Event | None = None
        self._started = False
        self._stopping = False
        self._closed = False
        # Counters.
        self._consumed_ok = 0
        self._consumed_failed = 0
        self._sent_back = 0
        self._dead_lettered = 0
        self._in_flight = 0
        self._pull_errors = 0
        self._commit_errors = 0
        self._commits = 0
        # Consumer groups across processes (only when the source coordinates them).
        self._coordinator: GroupCoordinator | None = source.group_coordinator()
        self.client_id = new_client_id()
        """This consumer's identity among the members of its group."""
        self._group_queues: dict[MessageQueue, TagFilter] = {}
        self._fences: dict[MessageQueue, int] = {}
        self._lock_valid_until: dict[MessageQueue, float] = {}
        self._releasing: set[MessageQueue] = set()
        self._draining: set[MessageQueue] = set()
        """Queues released gracefully: their locks stay renewed until committed."""
        self._lost: set[MessageQueue] = set()
        self._rebalance_scope: anyio.CancelScope | None = None
        self._hook_list: list[ConsumeMessageHook] = []
        self._hooks: HookRunner | None = None

    # -- configuration ---------------------------------------------------------------

    @property
    def mode(self) -> ConsumeMode:
        return self._mode

    def register_consume_message_hook(self, hook: ConsumeMessageHook) -> None:
        """Run ``hook`` around every handler call (see :class:`ConsumeMessageHook`).

        Call before starting. Message trace and OpenTelemetry are hooks:
        :class:`ConsumeMessageTraceHook`, ``stagedconsumer.otel.OpenTelemetryHook``.
        """
        if self._started:
            raise ConsumerStateError(
                "register_consume_message_hook() must be called before the consumer starts"
            )
        if not isinstance(hook, ConsumeMessageHook):
            raise ConfigurationError(
                f"hook must be a ConsumeMessageHook, got {type(hook).__name__}"
            )
        self._hook_list.append(hook)

    def subscribe(self, topic: str, expression: str = "*") -> None:
        """Consume ``topic``, only messages whose tag matches ``expression``.

        ``expression`` is ``"*"`` (everything) or ``"tag1 || tag2"``. Call before
        starting. An unknown topic raises :class:`UnknownTopicError` here when the
        source can tell at once (the embedded broker can), otherwise on start.
        """
        if self._started:
            raise ConsumerStateError("subscribe() must be called before the consumer starts")
        if not isinstance(topic, str) or not topic:
            raise ConfigurationError(f"topic must be a non-empty string, got {topic!r}")
        if topic.startswith("%"):
            raise ConfigurationError(f"cannot subscribe to system topic {topic!r}")
        tag_filter = TagFilter.parse(expression)
        if self.source.topic_exists(topic) is False:
            raise UnknownTopicError(
                f"topic {topic!r} does not exist in {type(self.source).__name__}"
            )
        self._subscriptions[topic] = tag_filter

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> PushConsumer:
        if self._started:
            raise ConsumerStateError("a PushConsumer can be started only once")
        if not self._subscriptions:
            raise ConsumerStateError("subscribe() to at least one topic before starting")
        self._started = True
        self._thread_limiter = anyio.CapacityLimiter(self.options.consume_thread_max)
        # Everything that can fail on bad input (store, topics, progress) happens
        # before the task group exists, so the error surfaces as itself.
        try:
            await self.offset_store.load()
            if self._coordinator is None:
                states = [
                    await self._load_queue(mq, tag_filter)
                    for mq, tag_filter in await self._resolve_queues()
                ]
            else:  # queues come from the rebalance loop, once their locks are held
                states = []
                self._group_queues = dict(await self._resolve_queues())
        except BaseException:
            self._closed = True
            raise
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            if self._hook_list:
                self._hooks = HookRunner(self._hook_list)
                for hook in self._hooks.services():
                    await tg.start(hook.run, self)
            self._pull_tg = await tg.start(self._run_pull_loops)
            for state in states:
                self._start_queue(state)
            self._workers_done = anyio.Event()
            await tg.start(self._run_workers)
            tg.start_soon(self._timer_loop)
            tg.start_soon(self._persist_loop)
            if self._coordinator is not None:
                await tg.start(self._rebalance_loop)
        except BaseException:
            tg.cancel_scope.cancel()
            self._closed = True
            await tg.__aexit__(*sys.exc_info())
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg = self._tg
        assert tg is not None
        with anyio.CancelScope(shield=True):
            try:
                await self._shutdown()
            except Exception:
                logger.exception("group %s: shutdown failed", self.group)
        self._closed = True
        tg.cancel_scope.cancel()
        return await tg.__aexit__(exc_type, exc, tb)

    async def _shutdown(self) -> None:
        self._stopping = True
        if self._rebalance_scope is not None:
            self._rebalance_scope.cancel()
        for state in list(self._states.values()):
            if state.pull_scope is not None:
                state.pull_scope.cancel()
        self._wake_all_workers()
        if self._workers_done is not None:
            with anyio.move_on_after(self.options.shutdown_timeout) as scope:
                await self._workers_done.wait()
            if scope.cancelled_caught:
                logger.warning(
                    "group %s: handlers still running after %.1f s; cancelling them (their"
                    " messages stay uncommitted and will be consumed again)",
                    self.group,
                    self.options.shutdown_timeout,
                )
                if self._workers_scope is not None:
                    self._workers_scope.cancel()
                await self._workers_done.wait()
        try:
            with anyio.fail_after(self.options.shutdown_timeout):
                await self._persist(list(self._states.values()))
        except Exception:
            logger.exception("group %s: could not persist progress on shutdown", self.group)
        else:
            if self._coordinator is not None:
                await self._leave_group()
        if self._hooks is not None:
            await self._hooks.aclose()

    async def _resolve_queues(self) -> list[tuple[MessageQueue, TagFilter]]:
        queues: list[tuple[MessageQueue, TagFilter]] = []
        for topic, tag_filter in self._subscriptions.items():
            queues.extend((mq, tag_filter) for mq in await self.source.get_queues(topic))
        if self._mode is ConsumeMode.CONCURRENT:
            everything = TagFilter.parse("*")
            retry = await self.source.get_queues(retry_topic(self.group))
            queues.extend((mq, everything) for mq in retry)
        return queues

    async def _load_queue(self, mq: MessageQueue, tag_filter: TagFilter) -> _QueueState:
        """Build the state of ``mq`` from its committed progress."""
        progress = await self.offset_store.read_progress(self.group, mq)
        if progress is None or progress.consume_offset is None:
            start = await self.source.min_offset(mq)
            stage_offsets: Mapping[Any, int] = progress.stage_offsets if progress else {}
        else:
            start = progress.consume_offset
            stage_offsets = progress.stage_offsets
        is_retry = mq.topic.startswith(RETRY_PREFIX)
        pq = ProcessQueue(
            mq,
            ConsumeMode.CONCURRENT if is_retry else self._mode,
            start_offset=start,
            stage_offsets=stage_offsets,
            plan=None if is_retry else self._plan,
            flow_control=self._flow,
        )
        state = _QueueState(mq, pq, tag_filter, is_retry)
        state.persisted = QueueProgress(consume_offset=start, stage_offsets=stage_offsets)
        return state

    def _start_queue(self, state: _QueueState) -> None:
        self._states[state.mq] = state
        assert self._pull_tg is not None
        self._pull_tg.start_soon(self._pull_loop, state, state.pq.committed_offset)

    async def assign_queue(self, mq: MessageQueue, expression: str = "*") -> None:
        """Start consuming ``mq`` (of a subscribed topic) from its committed progress."""
        if self._tg is None or self._closed:
            raise ConsumerStateError("assign_queue() needs a running consumer")
        if mq in self._states:
            return
        self._start_queue(await self._load_queue(mq, TagFilter.parse(expression)))

    async def release_queue(self, mq: MessageQueue) -> None:
        """Stop consuming ``mq``: stop pulling, let its in-flight handlers finish,
        persist its progress and forget it."""
        state = self._states.get(mq)
        if state is None:
            return
        if state.pull_scope is not None:
            state.pull_scope.cancel()
        state.pq.drop()
        pq = state.pq
        with anyio.move_on_after(self.options.shutdown_timeout):
            while pq.pending_count - pq.statistics().suspended_count > 0:
                await self._wait_for({pq: -1})
        await self._persist([state])
        self.offset_store.remove_offset(self.group, mq)
        self._states.pop(mq, None)
        self._paused.pop(state.pq, None)

    # -- consumer groups across processes ----------------------------------------------------
    #
    # With a coordinator (RedisBroker), a consumer is one member of its group: the
    # rebalance loop heartbeats, allocates the group's queues among the live members,
    # renews the locks of its queues and acquires the locks of queues allocated to it.
    # A queue is consumed only while its lock is held:
    #
    #   acquire: lock (epoch e) -> claim the store row with fence e (later writes with
    #            an older token are refused) -> load progress -> start pulling
    #   release: stop pulling -> drain in-flight handlers -> commit with fence e ->
    #            unlock
    #   lost:    the lock was not renewed in time (local_lock_ttl after the renewal
    #            request was sent, before the server expires it), or a commit came
    #            back fenced -> release at once; its commit is refused if the new
    #            owner already claimed the queue.

    async def _rebalance_loop(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        coordinator = self._coordinator
        assert coordinator is not None
        options = coordinator.options
        started = False
        with anyio.CancelScope() as scope:
            self._rebalance_scope = scope
            async with anyio.create_task_group() as releases:
                while not self._stopping:
                    pending = False
                    try:
                        pending = await self._rebalance_once(coordinator, releases)
                    except (SourceError, OffsetStoreError, OSError) as exc:
                        logger.warning(
                            "group %s: rebalance of %s failed (%s); retrying",
                            self.group,
                            self.client_id,
                            exc,
                        )
                    self._release_expired(releases)
                    if not started:
                        started = True
                        task_status.started()
                    delay = options.tick
                    if pending:
                        delay = min(delay, _LOCK_RETRY_INTERVAL)
                    soonest = min(self._lock_valid_until.values(), default=None)
                    if soonest is not None:
                        delay = min(delay, max(0.01, soonest - anyio.current_time()))
                    await anyio.sleep(delay)

    async def _rebalance_once(
        self, coordinator: GroupCoordinator, releases: anyio.abc.TaskGroup
    ) -> bool:
        """One round: heartbeat, allocate, release, renew and acquire. Returns whether
        a queue allocated here is still locked by another member."""
        options = coordinator.options
        limit = options.lock_renew_interval
        with anyio.fail_after(limit):
            members = await coordinator.heartbeat(self.group, self.client_id)
        if self.client_id not in members:
            members = sorted([*members, self.client_id])
        queues = sorted(self._group_queues)
        mine = set(options.allocate_strategy.allocate(self.group, self.client_id, queues, members))
        held = set(self._fences) - self._releasing
        for mq in sorted(held - mine):
            self._start_release(releases, mq, lost=False)
        keep = held & mine
        wanted = sorted(keep | (mine - held - self._releasing))
        draining = sorted(self._draining & set(self._fences))
        sent = anyio.current_time()
        with anyio.fail_after(limit):
            locked = await coordinator.lock(self.group, self.client_id, wanted + draining)
        for mq in keep:
            if mq in locked and locked[mq] == self._fences.get(mq):
                self._lock_valid_until[mq] = sent + options.local_lock_ttl
            elif mq not in self._releasing:
                logger.warning(
                    "group %s: %s lost the lock of %s; releasing it", self.group, self.client_id, mq
                )
                self._start_release(releases, mq, lost=True)
        pending = False
        for mq in wanted:
            if mq in keep or self._stopping:
                continue
            epoch = locked.get(mq)
            if epoch is None:
                pending = True
                continue
            await self._take_queue(coordinator, mq, epoch, sent + options.local_lock_ttl)
        return pending

    async def _take_queue(
        self, coordinator: GroupCoordinator, mq: MessageQueue, epoch: int, valid_until: float
    ) -> None:
        try:
            await self.offset_store.claim(self.group, mq, epoch)
            state = await self._load_queue(mq, self._group_queues[mq])
        except (SourceError, OffsetStoreError, OSError) as exc:
            logger.warning(
                "group %s: could not take over %s (%s); unlocking it", self.group, mq, exc
            )
            with anyio.move_on_after(coordinator.options.lock_renew_interval):
                await coordinator.unlock(self.group, self.client_id, [mq])
            return
        if self._stopping:  # shut down mid-takeover: hand the lock back now
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(coordinator.options.lock_renew_interval),
            ):
                try:
                    await coordinator.unlock(self.group, self.client_id, [mq])
                except Exception as exc:  # best effort: the lock also expires
                    logger.warning("group %s: could not unlock %s (%s)", self.group, mq, exc)
            return
        self._fences[mq] = epoch
        self._lock_valid_until[mq] = valid_until
        self._lost.discard(mq)
        self._start_queue(state)
        logger.info(
            "group %s: %s took %s at offset %d (epoch %d)",
            self.group,
            self.client_id,
            mq,
            state.pq.committed_offset,
            epoch,
        )

    def _release_expired(self, releases: anyio.abc.TaskGroup) -> None:
        now = anyio.current_time()
        for mq, until in list(self._lock_valid_until.items()):
            if now >= until and mq not in self._releasing:
                logger.warning(
                    "group %s: the lock of %s was not renewed in time; releasing it",
                    self.group,
                    mq,
                )
                self._start_release(releases, mq, lost=True)
        for mq in list(self._lost):
            if mq in self._fences and mq not in self._releasing:
                self._start_release(releases, mq, lost=True)

    def _start_release(
        self, releases: anyio.abc.TaskGroup, mq: MessageQueue, *, lost: bool
    ) -> None:
        self._releasing.add(mq)
        if not lost:
            self._draining.add(mq)
        self._lock_valid_until.pop(mq, None)
        releases.start_soon(self._release_owned, mq, lost)

    async def _release_owned(self, mq: MessageQueue, lost: bool) -> None:
        """Drain ``mq``, commit its progress (fenced), then unlock it."""
        coordinator = self._coordinator
        assert coordinator is not None
        committed = False
        try:
            try:
                await self.release_queue(mq)
                committed = mq not in self._lost
            except (OffsetStoreError, OSError) as exc:
                logger.warning(
                    "group %s: could not commit %s on release (%s); its lock will expire",
                    self.group,
                    mq,
                    exc,
                )
                state = self._states.pop(mq, None)
                if state is not None:
                    self._paused.pop(state.pq, None)
                self.offset_store.remove_offset(self.group, mq)
            self._fences.pop(mq, None)
            self._lost.discard(mq)
            if committed:
                try:
                    with anyio.fail_after(coordinator.options.lock_renew_interval):
                        await coordinator.unlock(self.group, self.client_id, [mq])
                except (SourceError, TimeoutError) as exc:
                    logger.warning("group %s: unlocking %s failed (%s)", self.group, mq, exc)
            logger.info(
                "group %s: %s released %s%s",
                self.group,
                self.client_id,
                mq,
                " (lock lost)" if lost else "",
            )
        finally:
            self._releasing.discard(mq)
            self._draining.discard(mq)

    async def _persist_fenced(self, changed: Sequence[tuple[_QueueState, QueueProgress]]) -> None:
        fences = {
            state.mq: self._fences[state.mq] for state, _ in changed if state.mq in self._fences
        }
        fenced: frozenset[MessageQueue] = frozenset()
        try:
            await self.offset_store.persist_fenced(self.group, fences)
        except StoreFencedError as exc:
            fenced = exc.queues
            logger.warning(
                "group %s: %s; releasing %s without committing",
                self.group,
                exc,
                ", ".join(map(str, sorted(fenced))),
            )
            self._lost.update(fenced)
        self._commits += 1
        for state, progress in changed:
            if state.mq in fences and state.mq not in fenced:
                state.persisted = progress

    async def _leave_group(self) -> None:
        """Unlock every held queue (progress already committed) and leave the group."""
        coordinator = self._coordinator
        assert coordinator is not None
        held = sorted(mq for mq in self._fences if mq not in self._lost)
        try:
            with anyio.fail_after(coordinator.options.lock_renew_interval):
                await coordinator.unlock(self.group, self.client_id, held)
                await coordinator.leave(self.group, self.client_id)
        except (SourceError, TimeoutError) as exc:
            logger.warning(
                "group %s: %s could not leave cleanly (%s); its locks will expire",
                self.group,
                self.client_id,
                exc,
            )
        self._fences.clear()
        self._lock_valid_until.clear()

    # -- signalling ------------------------------------------------------------------------

    def _wake_workers(self) -> None:
        """Wake one idle worker (it wakes the next if more work is ready)."""
        if self._idle:
            self._idle.popleft().set()

    def _wake_all_workers(self) -> None:
        idle, self._idle = self._idle, deque()
        for event in idle:
            event.set()

    def _signal_progress(self) -> None:
        event = self._progress_event
        if event is not None:
            self._progress_event = None
            event.set()

    def _check_watched(self, pq: ProcessQueue) -> None:
        target = self._watched.get(pq)
        if target is not None and pq.committed_offset >= target:
            self._signal_progress()

    def _rewatch(self) -> None:
        watched: dict[ProcessQueue, int] = {}
        for waiter in self._waiters:
            for pq, target in waiter.items():
                current = watched.get(pq)
                if current is None or target < current:
                    watched[pq] = target
        self._watched = watched

    async def _wait_for(self, targets: dict[ProcessQueue, int]) -> None:
        """Wait until a batch of a watched queue finishes with the queue's committed
        offset at or past its target (one wake-up; the caller re-checks)."""
        self._waiters.append(targets)
        self._rewatch()
        try:
            if self._progress_event is None:
                self._progress_event = anyio.Event()
            await self._progress_event.wait()
        finally:
            self._waiters.remove(targets)
            self._rewatch()

    # -- pulling ---------------------------------------------------------------------------

    async def _run_pull_loops(
        self, *, task_status: anyio.abc.TaskStatus[anyio.abc.TaskGroup] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with anyio.create_task_group() as pulls:
            task_status.started(pulls)
            await anyio.sleep_forever()

    async def _pull_loop(self, state: _QueueState, offset: int) -> None:
        source = self.source
        mq = state.mq
        pq = state.pq
        dispatcher = self._dispatcher
        batch_size = self.options.pull_batch_size
        long_poll = self.options.pull_long_polling_timeout
        base_delay = self.options.pull_time_delay_when_exception
        delay = base_delay
        accept_all = state.filter.accepts_all
        tag_filter = state.filter
        hooks = self._hooks
        clock = loop_clock()
        started = 0.0
        with anyio.CancelScope() as scope:
            state.pull_scope = scope
            while not pq.dropped:
                if pq.is_cache_full():
                    state.space = anyio.Event()
                    self._paused[pq] = state
                    await state.space.wait()
                    continue
                if hooks is not None:
                    started = clock()
                try:
                    result = await source.pull(mq, offset, batch_size, timeout=long_poll)
                except SourceError as exc:
                    self._pull_errors += 1
                    logger.warning(
                        "group %s: pull of %s at offset %d failed (%s); retrying in %.1f s",
                        self.group,
                        mq,
                        offset,
                        exc,
                        delay,
                    )
                    await anyio.sleep(delay)
                    delay = min(delay * 2, _MAX_PULL_BACKOFF)
                    continue
                delay = base_delay
                messages = result.messages
                if messages:
                    highest = messages[-1].queue_offset
                    if state.is_retry:
                        messages = [_restore_retry_topic(m) for m in messages]
                    elif not accept_all:
                        messages = [m for m in messages if tag_filter(m)]
                    if hooks is None:
                        if dispatcher.put_messages(pq, messages, highest_offset=highest):
                            self._wake_workers()
                    else:
                        now = clock()
                        if dispatcher.put_messages(pq, messages, highest_offset=highest, now=now):
                            self._wake_workers()
                        if hooks.wants_pull and messages:
                            hooks.pulled(
                                PullContext(
                                    consumer_group=self.group,
                                    message_queue=mq,
                                    messages=messages,
                                    start_time=started,
                                    end_time=now,
                                    wall_offset=loop_wall_offset(clock),
                                    max_offset=result.max_offset,
                                )
                            )
                    if self._watched:
                        self._check_watched(pq)
                offset = result.next_offset

    def _check_space(self, pq: ProcessQueue) -> None:
        state = self._paused.get(pq)
        if state is not None and not pq.is_cache_full():
            del self._paused[pq]
            if state.space is not None:
                state.space.set()

    # -- consuming -------------------------------------------------------------------------

    async def _run_workers(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with anyio.CancelScope() as scope:
                self._workers_scope = scope
                async with anyio.create_task_group() as workers:
                    for _ in range(self.options.consume_thread_max):
                        workers.start_soon(self._worker)
                    task_status.started()
        finally:
            assert self._workers_done is not None
            self._workers_done.set()

    async def _worker(self) -> None:
        """Take batches and run the listener on them until the consumer stops.

        The success path is inlined here (no extra coroutine per batch); failures go
        to :meth:`_concurrently_failed` / :meth:`_orderly_failed`.
        """
        dispatcher = self._dispatcher
        take = dispatcher.take
        finish = dispatcher.finish
        has_ready = dispatcher.has_ready
        batch_max = self.options.consume_message_batch_max_size
        idle = self._idle
        consume = self._consume
        is_async = self._is_async
        call_sync = self._call_sync
        concurrent = ConsumeMode.CONCURRENT
        staged = self._plan is not None
        suspend_ms = self._suspend_ms
        hooks = self._hooks
        hook_ctx: ConsumeMessageContext | None = None
        clock = loop_clock() if hooks is not None else anyio.current_time
        concurrently_context = _concurrently_context
        orderly_context = _orderly_context
        staged_context = _staged_context
        streak = 0
        while not self._stopping:
            batch = take(batch_max)
            if batch is None:
                streak = 0
                event = anyio.Event()
                idle.append(event)
                try:
                    await event.wait()
                finally:
                    if not event.is_set():
                        idle.remove(event)
                continue
            if idle and has_ready():
                idle.popleft().set()
            pq = batch.process_queue
            mq = pq.message_queue
            is_concurrent = pq.mode is concurrent
            context: Any
            if is_concurrent:
                context = concurrently_context(mq)
            elif staged:
                context = staged_context(
                    mq, batch.stage_index, batch.strategy_id, batch.group_id, suspend_ms
                )
            else:
                context = orderly_context(mq, suspend_ms)
            messages = batch.messages
            error: Exception | None = None
            result: Any = None
            if hooks is not None:
                hook_ctx = self._hook_context(batch, mq, clock)
                hooks.before(hook_ctx)
            self._in_flight += 1
            try:
                if is_async:
                    result = await consume(messages, context)
                else:
                    result = await call_sync(messages, context)
            except Exception as exc:  # a failing handler never stops the consumer
                error = exc
            finally:
                self._in_flight -= 1
            if hook_ctx is not None:
                hook_ctx.end_time = clock()
            if (
                error is None
                and (
                    result is None
                    or (result is _CONSUME_SUCCESS if is_concurrent else result is _ORDERLY_SUCCESS)
                )
                and (not is_concurrent or context.ack_index >= len(messages) - 1)
            ):
                self._consumed_ok += len(messages)
                if hook_ctx is None:
                    finish(batch, _SUCCESS)  # this worker takes what it freed
                else:
                    hook_ctx.success = True
                    finish(batch, _SUCCESS, hook_ctx.end_time)
            elif is_concurrent:
                await self._concurrently_failed(batch, mq, context, error, result, hook_ctx)
            else:
                await self._orderly_failed(batch, mq, context, error, result, hook_ctx)
            if hook_ctx is not None:
                self._hooks_after(hook_ctx, error, result)
                hook_ctx = None
            if self._paused:
                self._check_space(pq)
            watched = self._watched
            if watched:
                target = watched.get(pq)
                if target is not None and pq.committed_offset >= target:
                    self._signal_progress()
            streak += 1
            if streak >= _CHECKPOINT_EVERY:
                streak = 0
                await anyio.lowlevel.checkpoint()

    def _hook_context(
        self, batch: Batch, mq: MessageQueue, clock: Callable[[], float]
    ) -> ConsumeMessageContext:
        start = clock()
        messages = batch.messages
        return ConsumeMessageContext._of_call(  # positional: once per handler call
            self.group,
            mq,
            messages,
            self._mode_name,
            batch.stage_index,
            batch.strategy_id,
            batch.group_id,
            messages[0].reconsume_times + 1,
            batch.cached_times,
            batch.runnable_at,
            start,
            time.time() - start,
        )

    def _hooks_after(
        self, hook_ctx: ConsumeMessageContext, error: Exception | None, result: object
    ) -> None:
        assert self._hooks is not None
        hook_ctx.exception = error
        hook_ctx.result = result
        if hook_ctx.success:
            hook_ctx.status = ConsumeReturnType.SUCCESS
        elif error is not None:
            hook_ctx.status = ConsumeReturnType.EXCEPTION
        else:
            hook_ctx.status = ConsumeReturnType.FAILED
        self._hooks.after(hook_ctx)

    async def _call_sync(self, messages: Sequence[Message], context: Any) -> Any:
        assert self._thread_limiter is not None
        result = await anyio.to_thread.run_sync(
            self._consume, messages, context, limiter=self._thread_limiter
        )
        if inspect.isawaitable(result):  # a plain def that returned an awaitable
            result = await result
        return result

    async def _concurrently_failed(
        self,
        batch: Batch,
        mq: MessageQueue,
        context: ConsumeConcurrentlyContext,
        error: Exception | None,
        result: object,
        hook_ctx: ConsumeMessageContext | None = None,
    ) -> None:
        messages = batch.messages
        if error is None and (result is None or result is _CONSUME_SUCCESS):
            ack = max(-1, context.ack_index)
            failed = list(messages[ack + 1 :])
            self._consumed_ok += ack + 1
        else:
            if error is not None:
                logger.warning(
                    "group %s: handler failed on %d message(s) of %s; sending them back",
                    self.group,
                    len(messages),
                    mq,
                    exc_info=error,
                )
            elif result is not ConsumeConcurrentlyStatus.RECONSUME_LATER:
                logger.warning(
                    "group %s: handler returned %r, treated as RECONSUME_LATER", self.group, result
                )
            failed = list(messages)
        self._consumed_failed += len(failed)
        keep: list[Message] = []
        retried: list[Message] = []
        dead: list[Message] = []
        limit = self._max_reconsume if self._max_reconsume is not None else 2**31 - 1
        for message in failed:
            try:
                where = await self.source.send_back(
                    self.group,
                    message,
                    delay_level=context.delay_level_when_next_consume,
                    max_reconsume_times=limit,
                )
            except SourceError as exc:
                logger.warning(
                    "group %s: could not send %s back (%s); retrying it here in %.0f s",
                    self.group,
                    message.msg_id,
                    exc,
                    _SEND_BACK_FAILED_DELAY,
                )
                keep.append(message)
                continue
            if where is SendBackResult.DLQ:
                self._dead_lettered += 1
                dead.append(message)
            else:
                self._sent_back += 1
                retried.append(message)
        now: float | None = None
        if hook_ctx is not None:
            now = anyio.current_time()
            settled = hook_ctx.settled
            for outcome, listed in (
                (SettleOutcome.RETRY, retried),
                (SettleOutcome.DLQ, dead),
                (SettleOutcome.SUSPEND, keep),
            ):
                if listed:
                    settled[outcome] = listed
        dispatcher = self._dispatcher
        if not keep:
            if dispatcher.finish(batch, EraseStatus.SENT_BACK, now):
                self._wake_workers()
            return
        kept = {id(m) for m in keep}
        done = [m for m in messages if id(m) not in kept]
        if done and dispatcher.finish_some(batch, done, EraseStatus.SENT_BACK, now):
            self._wake_workers()
        self._suspend(batch, anyio.current_time() + _SEND_BACK_FAILED_DELAY)

    async def _orderly_failed(
        self,
        batch: Batch,
        mq: MessageQueue,
        context: ConsumeOrderlyContext | ConsumeStagedConcurrentlyContext,
        error: Exception | None,
        result: object,
        hook_ctx: ConsumeMessageContext | None = None,
    ) -> None:
        messages = batch.messages
        if error is not None:
            logger.warning(
                "group %s: handler failed on %d message(s) of %s (attempt %d); suspending",
                self.group,
                len(messages),
                mq,
                batch.attempt,
                exc_info=error,
            )
        elif result is not ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT:
            logger.warning(
                "group %s: handler returned %r, treated as SUSPEND_CURRENT_QUEUE_A_MOMENT",
                self.group,
                result,
            )
        self._consumed_failed += len(messages)
        limit = self._max_reconsume
        spent: list[Message] = []
        if limit is not None:
            spent = [m for m in messages if m.reconsume_times >= limit]
        moved: list[Message] = []
        for message in spent:
            try:
                await self.source.send_to_dlq(self.group, message)
            except SourceError as exc:
                logger.warning(
                    "group %s: could not move %s to the DLQ (%s); retrying it",
                    self.group,
                    message.msg_id,
                    exc,
                )
                continue
            moved.append(message)
        self._dead_lettered += len(moved)
        now: float | None = None
        if hook_ctx is not None:
            now = anyio.current_time()
            if moved:
                hook_ctx.settled[SettleOutcome.DLQ] = moved
            if len(moved) < len(messages):
                moved_ids = {id(m) for m in moved}
                hook_ctx.settled[SettleOutcome.SUSPEND] = [
                    m for m in messages if id(m) not in moved_ids
                ]
        dispatcher = self._dispatcher
        if moved and len(moved) == len(messages):
            if dispatcher.finish(batch, EraseStatus.DEAD_LETTER, now):
                self._wake_workers()
            return
        if moved and dispatcher.finish_some(batch, moved, EraseStatus.DEAD_LETTER, now):
            self._wake_workers()
        delay_ms = clamp_suspend_millis(context.suspend_current_queue_time_millis)
        self._suspend(batch, anyio.current_time() + delay_ms / 1000)

    def _suspend(self, batch: Batch, retry_at: float) -> None:
        dispatcher = self._dispatcher
        before = dispatcher.get_timer()
        dispatcher.suspend(batch, retry_at)
        if before is None or retry_at < before:
            event = self._timer_event
            if event is not None:
                self._timer_event = None
                event.set()

    async def _timer_loop(self) -> None:
        dispatcher = self._dispatcher
        while True:
            deadline = dispatcher.get_timer()
            event = self._timer_event = anyio.Event()
            if deadline is None:
                await event.wait()
            else:
                delay = deadline - anyio.current_time()
                if delay > 0:
                    with anyio.move_on_after(delay):
                        await event.wait()
            if dispatcher.handle_timer(anyio.current_time()):
                self._wake_workers()

    # -- progress ----------------------------------------------------------------------------

    def _progress_of(self, state: _QueueState) -> QueueProgress:
        pq = state.pq
        return QueueProgress(
            consume_offset=pq.committed_offset, stage_offsets=pq.committed_stage_offsets
        )

    async def _persist(self, states: Sequence[_QueueState]) -> None:
        store = self.offset_store
        changed: list[tuple[_QueueState, QueueProgress]] = []
        for state in states:
            persisted = state.persisted
            # Stage offsets move only when the committed offset does, so comparing
            # the offset alone finds every change (cheap with thousands of queues).
            if persisted is not None and persisted.consume_offset == state.pq.committed_offset:
                continue
            progress = self._progress_of(state)
            if progress != persisted:
                store.update_progress(self.group, state.mq, progress)
                changed.append((state, progress))
        if not changed:
            return
        if self._coordinator is not None:
            await self._persist_fenced(changed)
            return
        await store.persist_all(self.group, [state.mq for state, _ in changed])
        self._commits += 1
        for state, progress in changed:
            state.persisted = progress

    async def _persist_loop(self) -> None:
        interval = self.options.persist_consumer_offset_interval
        delay = interval
        while True:
            await anyio.sleep(delay)
            try:
                await self._persist(list(self._states.values()))
            except (OffsetStoreError, OSError) as exc:
                self._commit_errors += 1
                delay = min(max(delay, interval) * 2, _MAX_PERSIST_BACKOFF)
                logger.warning(
                    "group %s: persisting progress failed (%s); retrying in %.1f s",
                    self.group,
                    exc,
                    delay,
                )
            else:
                delay = interval

    async def wait_caught_up(self, timeout: float | None = None) -> None:
        """Wait until every message available at call time has finished.

        "Available" means below each assigned queue's max offset at the moment of the
        call (retry queues included). Raises ``TimeoutError`` after ``timeout`` seconds.
        In concurrent mode a message handed to the retry queue counts as finished
        here; its retry is a new message.
        """
        if not self._started or self._closed:
            raise ConsumerStateError("wait_caught_up() needs a running consumer")
        targets: dict[ProcessQueue, int] = {}
        for mq, state in list(self._states.items()):
            targets[state.pq] = await self.source.max_offset(mq)
        with anyio.fail_after(timeout):
            while True:
                for pq, target in list(targets.items()):
                    if pq.dropped or pq.committed_offset >= target:
                        del targets[pq]
                if not targets:
                    return
                await self._wait_for(targets)

    # -- inspection ----------------------------------------------------------------------------

    @property
    def assigned_queues(self) -> Sequence[MessageQueue]:
        return sorted(self._states, key=lambda mq: (mq.topic, mq.queue_id))

    def statistics(self) -> ConsumerStatistics:
        """A frozen snapshot of counters and per-queue state."""
        return ConsumerStatistics(
            group=self.group,
            mode=self._mode.value,
            consumed_ok=self._consumed_ok,
            consumed_failed=self._consumed_failed,
            sent_back=self._sent_back,
            dead_lettered=self._dead_lettered,
            in_flight=self._in_flight,
            pull_errors=self._pull_errors,
            commit_errors=self._commit_errors,
            commits=self._commits,
            hook_errors=self._hooks.errors if self._hooks is not None else 0,
            trace_records_dropped=sum(hook.records_dropped for hook in self._hook_list),
            queues={
                mq: state.pq.statistics()
                for mq, state in sorted(
                    self._states.items(), key=lambda item: (item[0].topic, item[0].queue_id)
                )
            },
        )


def _restore_retry_topic(message: Message) -> Message:
    origin = message.properties.get(PROPERTY_RETRY_TOPIC)
    if origin is None:
        return message
    return attrs.evolve(message, topic=origin)
