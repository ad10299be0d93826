"""PushConsumer: the facade that wires the services of a consumer and owns their tasks.

How a message flows (see ``architecture.md``)::

    GroupMembership / assign_queue -> QueueTable.load (progress) -> PullService
    pull loop -> Dispatcher.put_messages -> WorkerPool worker: take, ConsumeService
    context, hooks, handler, success or ConsumeService.settle_failure ->
    Dispatcher.finish / settle -> Signals.apply(effects) -> ProgressCommitter
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Iterable, Mapping
from types import TracebackType

import anyio
import anyio.abc

from offsetstore import MemoryOffsetStore, OffsetStoreError, StageKey, StageOffsetStore

from .._core import ConsumeMode, Dispatcher, ProcessQueue
from .._exceptions import ConfigurationError, ConsumerStateError, UnknownTopicError
from .._filter import TagFilter
from .._listeners import MessageListener, MessageQueueListener
from .._message import MessageQueue
from .._observability._hooks import ConsumeMessageHook
from .._observability._view import ConsumerStatistics
from .._options import ConsumerOptions
from .._sources._gray import AllocateMessageQueueByGray, gray_member_id
from .._sources._group import (
    AllocateMessageQueueAveragely,
    GroupCoordinator,
    mode_member_id,
    new_client_id,
)
from .._sources._source import MessageSource, retry_topic
from ._commit import ProgressCommitter, retry_store
from ._hooks import HookRunner
from ._membership import GroupMembership
from ._pull import PullService
from ._queues import QueueTable
from ._services import ConsumeService
from ._shapes import check_client, check_hook, check_queue_listener
from ._signals import Signals
from ._state import ConsumerState, QueueState
from ._transact import Transactor
from ._watchdog import LoopWatchdog
from ._workers import WORKER_BATCH_LOCAL, WORKER_CALL_LOCAL, WORKER_CODES, WorkerPool

__all__ = ("PushConsumer",)

logger = logging.getLogger("stagedconsumer")


_default_stores: weakref.WeakKeyDictionary[MessageSource, MemoryOffsetStore] = (
    weakref.WeakKeyDictionary()
)


async def adopt_unscoped(store: StageOffsetStore, group: str) -> None:
    """Give the store's source the progress of ``group`` stored without a source
    (before schema version 4), logged once, by the member that took it."""
    adopted = await store.adopt_unscoped_progress(group)
    if adopted:
        logger.warning(
            "group %s: adopted the stored progress of %d queue(s), kept without a source"
            " (offset store schema before version 4), as the progress of source %s;"
            " consumers of other sources will not see it",
            group,
            adopted,
            store.source,
        )


def default_offset_store(source: MessageSource) -> StageOffsetStore:
    """The store of consumers given none: the source's own (Kafka's commits), else
    one per source object, so that the members of a group on one embedded broker hand
    queues over at the committed offsets."""
    own = source.default_offset_store()
    if own is not None:
        return own
    store = _default_stores.get(source)
    if store is None:
        store = _default_stores[source] = MemoryOffsetStore()
    return store


def _coordinator_of(source: MessageSource, options: ConsumerOptions) -> GroupCoordinator | None:
    """The source's group coordinator, checked against the options (gray release
    cannot split queues a broker allocates itself)."""
    coordinator = source.group_coordinator()
    if (
        coordinator is not None
        and getattr(coordinator.options.allocate_strategy, "external", False)
        and options.enable_gray_switch
    ):
        raise ConfigurationError(
            f"{type(source).__name__} allocates queues itself (Kafka's assignor):"
            " gray release (enable_gray_switch) cannot split them"
        )
    return coordinator


class PushConsumer:
    """Pulls the subscribed topics from a source and pushes messages to a listener.

    The listener's kind picks the mode: :class:`MessageListenerConcurrently`
    (no order), :class:`MessageListenerOrderly` (one batch at a time per queue, in
    offset order) or :class:`MessageListenerStagedConcurrently` (concurrent inside a
    stage, stage ``k + 1`` of a stage key only after all of stage ``k`` finished).
    Ordering holds within a queue; queues never block each other.

    Use it as an async context manager: ``async with consumer:`` starts pulling and
    consuming; leaving the block stops pulling, lets in-flight handler calls finish
    (up to ``options.shutdown_timeout``; calls still running then are abandoned and
    their messages delivered again), and persists progress. Progress (consume offset
    and stage offsets of every queue) goes to ``offset_store`` (default: a
    :class:`~offsetstore.MemoryOffsetStore` per source object, shared by every
    consumer of that source in this process, as a RocketMQ broker keeps its groups'
    offsets) every ``options.persist_consumer_offset_interval`` seconds and on
    shutdown; a consumer started on the same store resumes from it, with identical
    stage assignment. Members of a group in several processes need one durable store
    (:class:`~offsetstore.SqlOffsetStore`); without one, a consumer of such a source
    (``RedisBroker``) warns when it starts.
    Delivery is at-least-once: nothing committed is ever unfinished.

    Errors: an exception raised inside ``async with consumer:`` comes out as itself;
    a failure that stops the consumer (an offset store that cannot be written, say)
    cancels the body, and after the shutdown is raised as itself. Only several
    failures at once come out as an :class:`ExceptionGroup`. Failures of handlers
    never stop the consumer (the batch is retried); failures of the source and
    retriable ones of the store are retried with backoff.
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
        options = check_client(
            group,
            source,
            options,
            ConsumerOptions,
            consumer=True,
            hint=" (use ConsumerOptions(**values) or ConsumerOptions.from_mapping())",
        )
        self.group = group
        """The consumer group: members of one group share the queues and the progress."""
        self.source = source
        """The broker it pulls from (``MemoryBroker``, ``RedisBroker``, any
        ``MessageSource``)."""
        self.listener = listener
        """The listener whose ``consume_message`` handles the messages; its class picks
        the mode."""
        self.options = options
        """The ``ConsumerOptions`` it runs with."""
        self.offset_store: StageOffsetStore = (
            offset_store if offset_store is not None else default_offset_store(source)
        )
        """Where its progress is committed (the default store of its source when none
        was given), bound to the source's ``source_id()`` (``StoreConfigurationError``
        for a store of another source)."""
        self.offset_store.bind_source(source.source_id())
        self._default_store = offset_store is None and source.default_offset_store() is None
        self._state = ConsumerState(group=group, mode="")
        self._service = ConsumeService.for_listener(listener, group, source, self._state, options)
        self._state.mode = self._service.mode.value
        self.client_id = mode_member_id(new_client_id(), self._service.mode.value)
        """This consumer's identity among the members of its group: ``host@pid@random``
        and its consume mode (``@mode[staged]``); a gray member's ends with
        ``@gray[<gray_queue_ratio>]``."""
        if options.enable_gray_switch and options.gray_tag:
            self.client_id = gray_member_id(self.client_id, options.gray_queue_ratio)
        self._coordinator = _coordinator_of(source, options)
        self._subscriptions: dict[str, TagFilter] = {}
        self._known_queues: frozenset[MessageQueue] | None = None
        """Every queue of the subscribed topics (retry ones included), once started."""
        self._hook_list: list[ConsumeMessageHook] = []
        self._hooks: HookRunner | None = None
        self._membership: GroupMembership | None = None
        self._workers: WorkerPool | None = None
        self._watchdog: LoopWatchdog | None = None
        self._pulls: PullService | None = None
        self._committer: ProgressCommitter | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._body: anyio.CancelScope | None = None
        self._shutdown_scope: anyio.CancelScope | None = None
        self._cut_short = False
        self._dispatcher = Dispatcher(
            assignment_retry_delay=options.suspend_current_queue_time_millis / 1000,
            record_times=False,
        )
        self._signals = Signals(self._state, self._dispatcher, self._on_room)
        self._queues = QueueTable(
            state=self._state,
            source=source,
            store=self.offset_store,
            service=self._service,
            dispatcher=self._dispatcher,
            signals=self._signals,
            options=options,
        )

    # -- configuration ---------------------------------------------------------------

    @property
    def mode(self) -> ConsumeMode:
        """The consumption mode its listener picked: concurrent, orderly or staged."""
        return self._service.mode

    def register_consume_message_hook(self, hook: ConsumeMessageHook) -> None:
        """Run ``hook`` around every handler call (see :class:`ConsumeMessageHook`).

        Call before starting. Message trace and OpenTelemetry are hooks:
        :class:`ConsumeMessageTraceHook`, ``stagedconsumer.otel.OpenTelemetryHook``.
        Its ``consume_message_before``, ``consume_message_after`` and
        ``messages_pulled`` are called synchronously with the context: one that is
        ``async def`` or cannot take the context raises :class:`ListenerTypeError`.
        """
        if self._state.started:
            raise ConsumerStateError(
                "register_consume_message_hook() must be called before the consumer starts"
            )
        if not isinstance(hook, ConsumeMessageHook):
            raise ConfigurationError(
                f"hook must be a ConsumeMessageHook, got {type(hook).__name__}"
            )
        check_hook(
            hook,
            ConsumeMessageHook,
            ("consume_message_before", "consume_message_after", "messages_pulled"),
        )
        self._hook_list.append(hook)

    def register_message_queue_listener(self, listener: MessageQueueListener) -> None:
        """Tell ``listener`` when queues are assigned here or taken away (see
        :class:`MessageQueueListener`). Call before starting. Raises
        :class:`ListenerTypeError` when a method it overrides cannot be awaited as
        ``on_queues_assigned(queues)`` / ``on_queues_revoked(queues)`` (a plain
        ``def``, a generator, a wrong signature)."""
        if self._state.started:
            raise ConsumerStateError(
                "register_message_queue_listener() must be called before the consumer starts"
            )
        if not isinstance(listener, MessageQueueListener):
            raise ConfigurationError(
                f"listener must be a MessageQueueListener, got {type(listener).__name__}"
            )
        check_queue_listener(listener)
        self._queues.listeners.append(listener)

    def subscribe(self, topic: str, expression: str = "*") -> None:
        """Consume ``topic``, only messages whose tag matches ``expression``.

        ``expression`` is ``"*"`` (everything) or ``"tag1 || tag2"`` (RocketMQ's tag
        grammar; anything else, such as ``"a && b"`` or a tag with a space, raises
        :class:`ConfigurationError`). Call before starting. An unknown topic raises
        :class:`UnknownTopicError` here when the source can tell at once (the embedded
        broker can), otherwise on start.
        """
        if self._state.started:
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
        state = self._state
        if state.started:
            raise ConsumerStateError("a PushConsumer can be started only once")
        if not self._subscriptions:
            raise ConsumerStateError("subscribe() to at least one topic before starting")
        state.started = True
        # Everything that can fail on bad input (store, topics, progress) happens
        # before the task group exists, so the error surfaces as itself.
        try:
            subscribed, loaded = await self._start_up()
        except BaseException:
            state.closed = True
            raise
        self._wire(subscribed)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            if self._hooks is not None:
                for hook in self._hooks.services():
                    await tg.start(hook.run, self)
            assert self._pulls is not None
            assert self._workers is not None
            if self._watchdog is not None:  # first: it watches everything after it
                await tg.start(self._watchdog.run)
            await tg.start(self._pulls.run)
            await self._queues.assigned([queue.mq for queue in loaded])
            for queue in loaded:
                self._queues.start(queue)
            await tg.start(self._workers.run)
            tg.start_soon(self._signals.run_timer)
            assert self._committer is not None
            tg.start_soon(self._committer.run)
            if self._membership is not None:
                await tg.start(self._membership.run)
        except BaseException:
            tg.cancel_scope.cancel()
            state.closed = True
            await tg.__aexit__(None, None, None)
            raise
        # The body of ``async with`` runs in this scope: a failure that stops the
        # consumer cancels the body alone, so the shutdown can still drain.
        self._body = anyio.CancelScope()
        self._body.__enter__()
        state.on_failure = self._body.cancel
        if state.failure is not None:  # it failed while starting (a handler's sys.exit())
            self._body.cancel()
        return self

    async def _start_up(self) -> tuple[dict[MessageQueue, TagFilter], list[QueueState]]:
        """Load the store, list the subscribed queues and (without a group) load
        their progress, waiting up to ``start_timeout`` for an unreachable store."""

        if self._default_store and self.source.groups_span_processes:
            logger.warning(
                "group %s: no offset_store given, so progress is kept in this process"
                " only: it is lost when the process ends and not seen by the group's"
                " members in other processes, which then consume again what this one"
                " finished. Pass offset_store=SqlOffsetStore(...) shared by the group.",
                self.group,
            )

        async def start() -> tuple[dict[MessageQueue, TagFilter], list[QueueState]]:
            await self.offset_store.load()
            await adopt_unscoped(self.offset_store, self.group)
            subscribed = await self._resolve_queues()
            if self._coordinator is not None:  # queues come once their locks are held
                return subscribed, []
            return subscribed, [await self._queues.load(mq, f) for mq, f in subscribed.items()]

        return await retry_store(start, group=self.group, timeout=self.options.start_timeout)

    async def _resolve_queues(self) -> dict[MessageQueue, TagFilter]:
        queues: dict[MessageQueue, TagFilter] = {}
        for topic, tag_filter in self._subscriptions.items():
            queues.update((mq, tag_filter) for mq in await self.source.get_queues(topic))
        if self._service.retry_queues:
            everything = TagFilter.parse("*")
            retry = await self.source.get_queues(retry_topic(self.group))
            queues.update((mq, everything) for mq in retry)
        return queues

    def _wire(self, subscribed: dict[MessageQueue, TagFilter]) -> None:
        """Build the services (once the consumer starts: hooks are known then)."""
        self._known_queues = frozenset(subscribed)
        _wire_services(self, subscribed)

    def _on_room(self, pq: ProcessQueue) -> None:
        if self._pulls is not None:
            self._pulls.room(pq)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg, body = self._tg, self._body
        assert tg is not None
        assert body is not None
        # True when the cancellation that ended the body was ours (a failure that
        # stops the consumer), which the scope swallows.
        swallowed = bool(body.__exit__(exc_type, exc, tb))
        failures: list[BaseException] = []
        try:
            with anyio.CancelScope(shield=True) as self._shutdown_scope:
                if self._cut_short:
                    self._shutdown_scope.cancel()
                try:
                    await self._shutdown()
                except Exception as error:  # a failed shutdown step must not hide the rest
                    logger.exception("group %s: shutdown failed", self.group)
                    self._state.fail(error)
        finally:  # also when a second Ctrl-C cut the shutdown short: stop everything now
            self._state.closed = True
            tg.cancel_scope.cancel()
            try:
                await tg.__aexit__(None, None, None)
            except BaseExceptionGroup as group:
                failures.extend(group.exceptions)
        if self._state.failure is not None:
            failures.insert(0, self._state.failure)
        if exc is not None and not swallowed:
            if not failures:
                return None  # the body's exception comes out as itself
            failures.insert(0, exc)
        if not failures:
            return True if swallowed else None
        if len(failures) == 1:
            raise failures[0]
        raise BaseExceptionGroup(f"consumer group {self.group!r} failed", failures)

    def _cut_shutdown_short(self) -> None:
        """Stop draining now (blocking code's second Ctrl-C; call on the event loop).

        The shutdown that leaving ``async with`` runs, now or once it starts, is
        cancelled: handler calls still in flight are abandoned, and nothing more is
        committed or flushed (their messages are delivered again: at-least-once).
        In async code a second Ctrl-C does the same by ending the event loop.
        """
        self._cut_short = True
        if self._shutdown_scope is not None:
            self._shutdown_scope.cancel()

    async def _shutdown(self) -> None:
        """Stop rebalancing, stop pulling, drain workers (bounded), stop the commit
        loop, commit, leave the group, close hooks."""
        state = self._state
        state.stopping = True
        if self._membership is not None:
            self._membership.stop()
        if self._pulls is not None:
            self._pulls.stop_all()
        if self._workers is not None:
            await self._workers.drain(self.options.shutdown_timeout, self._queues)
        assert self._committer is not None
        try:
            with anyio.fail_after(self.options.shutdown_timeout):
                await self._committer.commit(list(self._queues))
        except Exception as error:
            logger.exception(
                "group %s: could not persist progress on shutdown; the next owner of its"
                " queues resumes from the last committed progress",
                self.group,
            )
            if isinstance(error, OffsetStoreError) and not error.retriable:
                state.fail(error)
        else:
            await self._queues.revoked(self._queues.sorted())
        if self._membership is not None:
            # Hand the locks back also when the commit failed: keeping them would only
            # hold the queues from the next owner until they expire (lock_ttl); it
            # resumes from the last committed progress either way, and this member's
            # later commits would be refused by the fence.
            await self._membership.leave()
        if self._hooks is not None:
            await self._hooks.aclose()

    async def assign_queue(self, mq: MessageQueue, expression: str = "*") -> None:
        """Start consuming ``mq`` (of a subscribed topic) from its committed progress."""
        if self._tg is None or self._state.closed:
            raise ConsumerStateError("assign_queue() needs a running consumer")
        if mq in self._queues:
            return
        queue = await self._queues.load(mq, TagFilter.parse(expression))
        await self._queues.assigned([mq])
        self._queues.start(queue)

    async def release_queue(self, mq: MessageQueue) -> None:
        """Stop consuming ``mq``: stop pulling, let its in-flight handlers finish,
        persist its progress and forget it."""
        if mq in self._queues:
            await self._queues.release(mq)
            await self._queues.revoked([mq])

    def pause(self, targets: MessageQueue | str | Iterable[MessageQueue | str]) -> None:
        """Pause queues, or whole topics by name (Kafka's ``pause``): their pulling
        stops and no new handler call starts; calls already running finish and
        commit as usual; nothing is lost. A paused topic's queues assigned later
        start paused, and so does a paused queue: a queue of a subscribed topic that
        another member of the group holds now can be paused here. ``targets`` is one
        queue or topic name, or an iterable of them. ``statistics().paused_queues``
        lists the paused queues assigned here.

        Raises :class:`ConfigurationError` (a ``ValueError``), pausing nothing, for a
        topic this consumer is not subscribed to (its retry topic, ``%RETRY%<group>``,
        counts in concurrent mode) or a queue of one, and, once the consumer runs, for
        a queue its topic does not have: subscribe before pausing.
        """
        self._queues.pause(self._checked_targets("pause", targets))

    def resume(self, targets: MessageQueue | str | Iterable[MessageQueue | str]) -> None:
        """Undo :meth:`pause` for these queues or topics (one, or an iterable of them);
        raises :class:`ConfigurationError` as :meth:`pause` does. A queue runs when
        neither it nor its topic is paused: resuming a queue does not undo a pause of
        its topic, nor resuming a topic a pause of one of its queues."""
        self._queues.resume(self._checked_targets("resume", targets))

    def _checked_targets(
        self, method: str, targets: MessageQueue | str | Iterable[MessageQueue | str]
    ) -> list[MessageQueue | str]:
        """``targets`` as a list, each checked against the subscribed topics and, once
        they are known (the consumer runs), their queues."""
        listed = [targets] if isinstance(targets, (str, MessageQueue)) else list(targets)
        topics = list(self._subscriptions)
        if self._service.retry_queues:
            topics.append(retry_topic(self.group))
        for target in listed:
            if not isinstance(target, (str, MessageQueue)):
                raise ConfigurationError(
                    f"{method}() takes MessageQueues and topic names, got {target!r}"
                )
            topic = target if isinstance(target, str) else target.topic
            if topic not in topics:
                what = (
                    f"this consumer is not subscribed to topic {topic!r}"
                    if isinstance(target, str)
                    else f"{target} is a queue of topic {topic!r}, which this consumer is not"
                    " subscribed to"
                )
                raise ConfigurationError(
                    f"{method}(): {what} (its topics: {', '.join(map(repr, topics)) or 'none yet'})"
                )
            known = self._known_queues
            if isinstance(target, MessageQueue) and known is not None and target not in known:
                count = sum(1 for mq in known if mq.topic == topic)
                raise ConfigurationError(
                    f"{method}(): {target} is not a queue of topic {topic!r}, which has"
                    f" {count} queue(s)"
                )
        return listed

    async def seek(
        self, mq: MessageQueue, offset: int, *, stage_offsets: Mapping[StageKey, int] | None = None
    ) -> None:
        """Move a running consumer's queue ``mq`` to ``offset`` (RocketMQ's ``seek``):
        its cached messages are dropped and its handler calls in flight finish (their
        outcome no longer moves the offset); the new progress, ``offset`` with
        ``stage_offsets`` (default: none, so every stage key starts over at its first
        stage from ``offset``), is committed at once, backwards too, and the queue is
        pulled from there.

        ``offset`` must be an int in the queue's [min, max] offsets and
        ``stage_offsets`` a mapping of :class:`~offsetstore.StageKey` to int >= 0
        whose strategy ids, for a staged listener, are among its strategies (the keys
        of ``get_stage_definition_strategies()``; ``"default"`` for a listener with
        only ``get_stage_definitions()``); anything else raises
        :class:`ConfigurationError` (a ``ValueError``) naming the bad entry before
        the queue is touched: it goes on as it was. (Other listeners have no stage
        keys: their ``stage_offsets`` are stored as given, unused.)"""
        if not self._state.started or self._state.closed:
            raise ConsumerStateError("seek() needs a running consumer")
        await self._queues.seek(mq, offset, stage_offsets)

    async def wait_caught_up(self, timeout: float | None = None) -> None:
        """Wait until every message available at call time has finished.

        "Available" means below each assigned queue's max offset at the moment of the
        call (retry queues included). Raises ``TimeoutError`` after ``timeout`` seconds,
        saying which queues are behind: each one's committed offset and the max offset
        it must reach, and how many of its messages are in handlers, waiting to be
        retried, cached or held, whether it is paused, and how far it was pulled.
        In concurrent mode a message handed to the retry queue counts as finished
        here; its retry is a new message.

        Paused queues are waited for too: a queue (or topic) paused with
        :meth:`pause` while it is behind holds the wait until it is resumed and has
        caught up, so without ``timeout`` this waits forever if it is never resumed
        (pass a ``timeout``, or resume first). A queue released from this consumer
        meanwhile no longer counts.
        """
        if not self._state.started or self._state.closed:
            raise ConsumerStateError("wait_caught_up() needs a running consumer")
        if timeout is not None and (math.isnan(timeout) or timeout < 0):
            raise ValueError(f"timeout must be None or >= 0, got {timeout!r}")
        targets = {queue.pq: await self.source.max_offset(queue.mq) for queue in self._queues}
        total = len(targets)
        with anyio.move_on_after(timeout):
            while True:
                _drop_caught_up(targets)
                if not targets:
                    return
                await self._signals.wait_for(targets)
        _drop_caught_up(targets)
        if not targets:  # caught up as the deadline passed
            return
        assert timeout is not None  # only a deadline ends the loop without returning
        raise TimeoutError(_not_caught_up(targets, total, timeout))

    # -- inspection ----------------------------------------------------------------------------

    @property
    def assigned_queues(self) -> list[MessageQueue]:
        """The queues this consumer owns now, sorted (in a group, its share)."""
        return self._queues.sorted()

    def statistics(self) -> ConsumerStatistics:
        """A frozen snapshot of counters and per-queue state."""
        return self._queues.statistics(self._hooks, self._hook_list)


def _drop_caught_up(targets: dict[ProcessQueue, int]) -> None:
    for pq, target in list(targets.items()):
        if pq.dropped or pq.committed_offset >= target:
            del targets[pq]


_QUEUES_NAMED = 10
"""How many queues a ``wait_caught_up`` timeout describes one by one."""


def _not_caught_up(targets: Mapping[ProcessQueue, int], total: int, timeout: float) -> str:
    """Why ``wait_caught_up`` timed out: the queues still behind their targets, from
    counters their process queues keep anyway."""
    behind = sorted(targets.items(), key=lambda item: item[0].message_queue)
    described = []
    for pq, target in behind[:_QUEUES_NAMED]:
        waiting = pq.pending_count - pq.in_handlers
        counts = [
            (pq.in_handlers, "in handlers"),
            (waiting, "waiting to be retried"),
            (pq.cached_count, "cached"),
            (pq.held_count, "held by a failed stage assignment"),
        ]
        notes = [f"{count} {what}" for count, what in counts if count]
        if pq.paused:
            notes.append("paused")
        if pq.highest_offset < pq.committed_offset:
            notes.append("not pulled yet")
        elif pq.highest_offset + 1 < target:
            notes.append(f"pulled up to offset {pq.highest_offset}")
        where = f"{pq.message_queue} at committed offset {pq.committed_offset} of {target}"
        described.append(f"{where} ({', '.join(notes)})" if notes else where)
    if len(behind) > _QUEUES_NAMED:
        rest = behind[_QUEUES_NAMED:]
        short = sum(target - pq.committed_offset for pq, target in rest)
        described.append(f"{len(rest)} more, {short} offset(s) behind in all")
    return (
        f"not caught up after {timeout:g} s: {len(behind)} of {total} queue(s) behind"
        f" the max offsets of the call: {'; '.join(described)}"
    )


def _wire_services(consumer: PushConsumer, subscribed: dict[MessageQueue, TagFilter]) -> None:
    """Build the services of ``consumer`` (when it starts: its hooks are known then)."""
    state, options = consumer._state, consumer.options
    if consumer._hook_list:
        consumer._hooks = HookRunner(consumer._hook_list)
        consumer._dispatcher.record_times = True
    if consumer._coordinator is not None:
        consumer._membership = _membership(consumer, consumer._coordinator, subscribed)
    membership = consumer._membership
    consumer._committer = consumer._queues.committer = ProgressCommitter(
        state=state,
        store=consumer.offset_store,
        queues=consumer._queues,
        interval=options.persist_consumer_offset_interval,
        fences=membership.ownership.fences if membership is not None else None,
        on_fenced=membership.on_fenced if membership is not None else None,
        hold=functools.partial(consumer.source.hold_offsets, consumer.group)
        if type(consumer.source).hold_offsets is not MessageSource.hold_offsets
        else None,
        max_ranges=options.sparse_progress_max_ranges,
    )
    consumer._service.transactor = Transactor(
        state=state,
        store=consumer.offset_store,
        fence_of=membership.ownership.epoch if membership is not None else None,
        service=consumer._service,
    )
    consumer._pulls = consumer._queues.pulls = PullService(
        state=state,
        source=consumer.source,
        dispatcher=consumer._dispatcher,
        signals=consumer._signals,
        options=options,
        hooks=consumer._hooks,
        past_end=consumer._queues.on_past_end,
        offset_moved=consumer._queues.on_offset_moved,
    )
    consumer._workers = WorkerPool(
        state=state,
        dispatcher=consumer._dispatcher,
        service=consumer._service,
        signals=consumer._signals,
        consume=consumer.listener.consume_message,  # type: ignore[attr-defined]
        workers=options.consume_thread_max,
        batch_size=options.consume_message_batch_max_size,
        hooks=consumer._hooks,
        leased=membership is not None,
    )
    threshold = options.event_loop_block_threshold
    if threshold is not None:
        consume = consumer.listener.consume_message  # type: ignore[attr-defined]
        consumer._watchdog = LoopWatchdog(
            group=consumer.group,
            threshold=threshold,
            worker_codes=WORKER_CODES,
            batch_local=WORKER_BATCH_LOCAL,
            call_local=WORKER_CALL_LOCAL,
            handler_code=getattr(getattr(consume, "__func__", consume), "__code__", None),
        )


def _membership(
    consumer: PushConsumer,
    coordinator: GroupCoordinator,
    subscribed: dict[MessageQueue, TagFilter],
) -> GroupMembership:
    """The group membership of ``consumer``, whose source coordinates a group."""
    state, options = consumer._state, consumer.options
    strategy = coordinator.options.allocate_strategy
    # The default allocation is gray-aware even with the switch off: while no member
    # is gray it is the same average split, and once a gray member joins it agrees
    # with the gray members' (an average split over everyone would leave queues
    # that neither side allocates to itself without an owner).
    if (
        not isinstance(strategy, AllocateMessageQueueByGray)
        and not getattr(strategy, "external", False)
        and (options.enable_gray_switch or type(strategy) is AllocateMessageQueueAveragely)
    ):
        strategy = AllocateMessageQueueByGray(options.gray_queue_ratio)
    membership = GroupMembership(
        strategy=strategy,
        coordinator=coordinator,
        state=state,
        client_id=consumer.client_id,
        store=consumer.offset_store,
        queues=consumer._queues,
        dispatcher=consumer._dispatcher,
        subscribed=subscribed,
    )
    if options.enable_gray_switch:
        consumer._service.gray_queue = membership.is_gray
    return membership
