"""QueueTable: the queues a consumer holds, how one is loaded, started and released."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import anyio

from offsetstore import QueueProgress, StageKey, StageOffsetStore

from .._core import Dispatcher
from .._exceptions import ConfigurationError, ConsumerStateError, SourceError
from .._filter import TagFilter
from .._listeners import MessageQueueListener
from .._message import MessageQueue
from .._observability._hooks import ConsumeMessageHook
from .._observability._view import ConsumerStatistics
from .._options import ConsumeFromWhere, ConsumerOptions
from .._sources._source import RETRY_PREFIX, MessageSource, PullResult
from ._commit import ProgressCommitter
from ._hooks import HookRunner
from ._pull import PullService
from ._services import ConsumeService
from ._signals import Signals
from ._state import ConsumerState, QueueState

__all__ = ("QueueTable",)

logger = logging.getLogger("stagedconsumer")


class QueueTable:
    """The assigned queues of one consumer, by message queue.

    A queue is *loaded* from its committed progress (consume offset and stage
    offsets, as one unit; without progress, from where ``consume_from_where`` says),
    *started* (its pull loop runs) and *released*: pulling stops, nothing more is
    handed out, handler calls in flight finish (bounded), its progress is committed
    and it is forgotten. Queues (or whole topics) can be *paused*, which holds their
    pulling and their next batches, also for queues assigned later. Message queue
    listeners hear of every assignment and revocation.
    """

    def __init__(
        self,
        *,
        state: ConsumerState,
        source: MessageSource,
        store: StageOffsetStore,
        service: ConsumeService,
        dispatcher: Dispatcher,
        signals: Signals,
        options: ConsumerOptions,
    ) -> None:
        self.state = state
        self.group = state.group
        self.source = source
        self.store = store
        self.service = service
        self.dispatcher = dispatcher
        self.signals = signals
        self.options = options
        self.drain_timeout = options.shutdown_timeout
        self.states: dict[MessageQueue, QueueState] = {}
        self.pulls: PullService | None = None
        self.committer: ProgressCommitter | None = None
        self.listeners: list[MessageQueueListener] = []
        self.paused_queues: set[MessageQueue] = set()
        self.paused_topics: set[str] = set()

    def __iter__(self) -> Iterator[QueueState]:
        return iter(list(self.states.values()))

    def __contains__(self, mq: object) -> bool:
        return mq in self.states

    def sorted(self) -> list[MessageQueue]:
        return sorted(self.states, key=lambda mq: (mq.topic, mq.queue_id))

    async def load(self, mq: MessageQueue, tag_filter: TagFilter) -> QueueState:
        """Build the state of ``mq`` from its committed progress.

        A committed consume offset beyond the queue's max offset (the store was
        reused with another broker, or the broker lost its messages) is corrected
        as RocketMQ does: see :meth:`correct_past_end`."""
        progress = await self.store.read_progress(self.group, mq)
        stage_offsets: Mapping[Any, int]
        finished: tuple[tuple[int, int], ...] = ()
        if progress is None or progress.consume_offset is None:
            start = await self._start_without_progress(mq)
            stage_offsets = progress.stage_offsets if progress else {}
            # marks of transactions committed before any progress was
            finished = progress.finished if progress else ()
        else:
            start = progress.consume_offset
            stage_offsets = progress.stage_offsets
            finished = progress.finished
            max_offset = await self.source.max_offset(mq)
            if start > max_offset:
                progress = await self.correct_past_end(mq, start, max_offset, stage_offsets)
                assert progress.consume_offset is not None
                start = progress.consume_offset
                finished = ()
        is_retry = mq.topic.startswith(RETRY_PREFIX)
        if is_retry:  # retry queues are consumed concurrently, whatever the mode
            pq = self.service.new_process_queue(mq, start, {}, finished)
        else:
            pq = self.service.new_process_queue(mq, start, stage_offsets, finished)
        state = QueueState(mq, pq, tag_filter, is_retry)
        if progress is not None and progress.consume_offset is None and finished:
            state.finished_count = -1  # the first commit records the marks as ranges
        if progress is not None and progress.consume_offset is not None:
            state.persisted = QueueProgress(
                consume_offset=start, stage_offsets=stage_offsets, finished=finished
            )
            state.finished_count = -1  # the first commit writes them as the queue sees them
        # else: nothing stored yet; the first commit stores where consumption started,
        # so that the queue's next owner resumes there instead of asking the source.
        if self.committer is not None:
            await self.committer.hold_one(state)  # retention keeps it from here on
        return state

    async def _start_without_progress(self, mq: MessageQueue) -> int:
        where = self.options.consume_from_where
        if mq.topic.startswith(RETRY_PREFIX) or where is ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET:
            return await self.source.min_offset(mq)
        if where is ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET:
            return await self.source.max_offset(mq)
        timestamp = self.options.consume_timestamp
        assert timestamp is not None  # checked by ConsumerOptions
        return await self.source.offset_for_timestamp(mq, timestamp)

    async def correct_past_end(
        self,
        mq: MessageQueue,
        offset: int,
        max_offset: int,
        stage_offsets: Mapping[Any, int],
    ) -> QueueProgress:
        """Move the committed progress of ``mq`` from ``offset``, beyond the queue's
        end ``max_offset`` (the queue lost its messages or was recreated: a flushed
        Redis, an embedded broker refilled with less), to where
        ``consume_from_where`` says, and store it (an overwrite: the store's
        increase-only commits could not move it back). Logged (WARNING, naming the
        queue, the offset and the end) and counted (``offsets_beyond_end``).

        The policy, as Kafka's ``auto.offset.reset`` for an offset out of range and
        RocketMQ's broker correction (a pull beyond the max offset of a queue that
        starts at 0 goes on from its start, else from its max offset):
        ``CONSUME_FROM_FIRST_OFFSET`` (the default) and retry queues from the
        queue's first offset: every message of the recreated queue is new to this
        group, none is skipped; ``CONSUME_FROM_LAST_OFFSET`` from the end (what
        is sent from then on); ``CONSUME_FROM_TIMESTAMP`` from the first message born
        at ``consume_timestamp`` or later. Stage offsets are kept (stages go on
        counting, as after ``stagedconsumer offsets reset --to-offset``)."""
        where = self.options.consume_from_where
        is_retry = mq.topic.startswith(RETRY_PREFIX)
        target = await self._go_on_at(mq, is_retry, None, max_offset, fallback=max_offset)
        self.state.offsets_beyond_end += 1
        logger.warning(
            "group %s: committed consume offset %d of %s is beyond the queue's end (max"
            " offset %d): the queue lost its messages or was recreated (a flushed Redis,"
            " a broker refilled with less); going on from offset %d (%s) and storing it",
            self.group,
            offset,
            mq,
            max_offset,
            target,
            "retry queue" if is_retry else where.name,
        )
        progress = QueueProgress(consume_offset=target, stage_offsets=stage_offsets)
        await self.store.reset_progress(self.group, {mq: progress})
        return progress

    async def _go_on_at(
        self,
        mq: MessageQueue,
        is_retry: bool,
        first: int | None,
        end: int,
        *,
        fallback: int,
    ) -> int:
        """Where ``consume_from_where`` says a queue whose position is lost goes on,
        within ``[first, end]``: ``CONSUME_FROM_FIRST_OFFSET`` (and retry queues) at
        ``first`` (the queue's first offset; ``None``: ask the source),
        ``CONSUME_FROM_LAST_OFFSET`` at ``end``, ``CONSUME_FROM_TIMESTAMP`` at
        the first message born at ``consume_timestamp`` or later; at ``fallback`` when
        the source cannot say (logged)."""
        where = self.options.consume_from_where
        try:
            if not is_retry and where is ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET:
                return end
            if first is None:
                first = min(await self.source.min_offset(mq), end)
            if is_retry or where is ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET:
                return first
            timestamp = self.options.consume_timestamp
            assert timestamp is not None  # checked by ConsumerOptions
            return min(max(await self.source.offset_for_timestamp(mq, timestamp), first), end)
        except SourceError as exc:
            logger.warning(
                "group %s: finding where %s goes on failed (%s); from offset %d",
                self.group,
                mq,
                exc,
                fallback,
            )
            return fallback

    async def on_past_end(self, state: QueueState, offset: int, max_offset: int) -> int:
        """The pull loop of ``state`` found its ``offset`` beyond the queue's
        ``max_offset`` while running (the broker lost messages): where to pull next.

        When every message before ``offset`` has finished, the queue moves as at
        load (see :meth:`correct_past_end`); while some are
        unfinished it stays (pulling from lower offsets would skip the messages
        sent there) and the check repeats on the next empty pull."""
        pq = state.pq
        if pq.unfinished_count or pq.dropped:
            return offset
        progress = await self.correct_past_end(
            state.mq, offset, max_offset, pq.committed_stage_offsets
        )
        assert progress.consume_offset is not None
        pq.move_to(progress.consume_offset)
        state.persisted = progress
        return progress.consume_offset

    async def on_offset_moved(self, state: QueueState, offset: int, result: PullResult) -> int:
        """The pull loop of ``state`` found ``offset`` no longer stored: the source's
        retention removed the entries up to ``result.next_offset`` (the first one
        stored) before this group consumed them. Logged (WARNING) and counted
        (``trimmed_offsets``); the queue goes on where ``consume_from_where`` says,
        as for a queue without progress, but never before the first stored offset:
        ``CONSUME_FROM_FIRST_OFFSET`` (and retry queues) from the first stored,
        ``CONSUME_FROM_LAST_OFFSET`` from the max offset, ``CONSUME_FROM_TIMESTAMP``
        from the first message born at ``consume_timestamp`` or later."""
        mq = state.mq
        first, max_offset = result.next_offset, result.max_offset
        where = self.options.consume_from_where
        end = max(max_offset, first)
        target = await self._go_on_at(mq, state.is_retry, first, end, fallback=first)
        self.state.trimmed_offsets += 1
        logger.warning(
            "group %s: offset %d of %s is no longer stored: the broker removed its entries"
            " up to offset %d (retention: max age or length reached) before this group"
            " consumed them, %d messages; going on from offset %d (%s)",
            self.group,
            offset,
            mq,
            first,
            first - offset,
            target,
            "retry queue" if state.is_retry else where.name,
        )
        pq = state.pq
        if not pq.unfinished_count and not pq.dropped and target > pq.committed_offset:
            pq.move_to(target)  # committed (increasing) by the next commit
        return target

    def start(self, state: QueueState) -> None:
        """Consume ``state``'s queue: register it and start its pull loop (paused if
        the queue or its topic is paused)."""
        assert self.pulls is not None
        self.states[state.mq] = state
        if state.mq in self.paused_queues or state.mq.topic in self.paused_topics:
            self.dispatcher.pause(state.pq)
        self.pulls.start(state)

    # -- pausing ---------------------------------------------------------------------

    def pause(self, targets: Iterable[MessageQueue | str]) -> None:
        """Pause queues and topics (a topic: every queue of it, also those assigned
        later): no more pulling, no new handler call; calls running finish."""
        for target in targets:
            if isinstance(target, str):
                self.paused_topics.add(target)
            else:
                self.paused_queues.add(target)
        for queue in self:
            if self._is_paused(queue.mq):
                self.dispatcher.pause(queue.pq)

    def resume(self, targets: Iterable[MessageQueue | str]) -> None:
        """Undo :meth:`pause` for these queues and topics."""
        for target in targets:
            if isinstance(target, str):
                self.paused_topics.discard(target)
            else:
                self.paused_queues.discard(target)
        for queue in self:
            if queue.pq.paused and not self._is_paused(queue.mq):
                self.signals.apply(queue.pq, self.dispatcher.unpause(queue.pq))
                assert self.pulls is not None
                self.pulls.unpaused(queue)

    def _is_paused(self, mq: MessageQueue) -> bool:
        return mq in self.paused_queues or mq.topic in self.paused_topics

    # -- listeners -------------------------------------------------------------------

    async def assigned(self, queues: Sequence[MessageQueue]) -> None:
        """Tell the message queue listeners (failures logged and counted)."""
        await self._tell("on_queues_assigned", queues)

    async def revoked(self, queues: Sequence[MessageQueue]) -> None:
        await self._tell("on_queues_revoked", queues)

    async def _tell(self, method: str, queues: Sequence[MessageQueue]) -> None:
        if not queues or not self.listeners:
            return
        ordered = sorted(queues)
        for listener in self.listeners:
            try:
                await getattr(listener, method)(ordered)
            except Exception as exc:
                self.state.listener_errors += 1
                logger.error(
                    "group %s: message queue listener %s failed in %s (ignored)",
                    self.group,
                    type(listener).__name__,
                    method,
                    exc_info=exc,
                )

    # -- seeking ---------------------------------------------------------------------

    async def seek(
        self,
        mq: MessageQueue,
        offset: int,
        stage_offsets: Mapping[StageKey, int] | None = None,
    ) -> None:
        """Move ``mq`` to ``offset``: its cached messages are dropped, handler calls
        in flight finish (at most ``drain_timeout``; their outcome no longer moves
        anything), the progress becomes ``offset`` with ``stage_offsets`` (default:
        none, every stage key starts at its first stage there) and is committed,
        backwards too, and the queue is pulled again from there.

        Everything is checked before the queue is touched: a bad ``offset`` or
        ``stage_offsets`` entry raises :class:`ConfigurationError` and the queue
        goes on as it was (nothing dropped, nothing stored). In staged mode that
        includes a stage key whose strategy id is not one of the listener's
        (its offset would be stored and never used)."""
        try:  # QueueProgress checks the entries, as every store write does
            stages = QueueProgress(consume_offset=None, stage_offsets=stage_offsets).stage_offsets
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"seek(): bad stage_offsets for {mq}: {exc}") from None
        plan = self.service.plan
        if plan is not None:  # staged mode: other modes keep stage offsets as given
            unknown = sorted({key.strategy_id for key in stages} - set(plan.definitions))
            if unknown:
                known = ", ".join(repr(strategy) for strategy in sorted(plan.definitions))
                raise ConfigurationError(
                    f"seek(): bad stage_offsets for {mq}: unknown strategy id(s)"
                    f" {', '.join(repr(strategy) for strategy in unknown)}; the listener's"
                    f" strategies are {known or 'none'} (a stage offset of another strategy"
                    " would be stored and never used)"
                )
        state = self.states.get(mq)
        if state is None:
            raise ConsumerStateError(f"seek(): {mq} is not assigned to this consumer")
        low, high = await self.source.min_offset(mq), await self.source.max_offset(mq)
        if isinstance(offset, bool) or not isinstance(offset, int) or not low <= offset <= high:
            raise ConfigurationError(
                f"seek(): offset must be an int in [{low}, {high}] for {mq}, got {offset!r}"
            )
        progress = QueueProgress(consume_offset=offset, stage_offsets=stages)
        assert self.pulls is not None
        self.pulls.stop(state)
        state.pq.drop()
        with anyio.move_on_after(self.drain_timeout):
            while state.pq.in_handlers > 0:
                await self.signals.wait_for({state.pq: -1})
        self.forget(mq)
        await self.store.reset_progress(self.group, {mq: progress})
        fresh = await self.load(mq, state.filter)
        fresh.persisted = progress
        self.start(fresh)

    async def release(
        self, mq: MessageQueue, *, fences: Mapping[MessageQueue, int] | None = None
    ) -> bool:
        """Stop consuming ``mq``: stop pulling, let its handler calls finish (at most
        ``drain_timeout``), commit its progress (in a group, with its fence from
        ``fences``) and forget it. Returns ``False`` when the store refused the
        commit as fenced (a newer owner took the queue). A failed commit propagates,
        after the queue was forgotten."""
        state = self.states.get(mq)
        if state is None:
            return True
        assert self.pulls is not None
        assert self.committer is not None
        self.pulls.stop(state)
        pq = state.pq
        pq.drop()
        try:
            with anyio.move_on_after(self.drain_timeout):
                while pq.in_handlers > 0:
                    await self.signals.wait_for({pq: -1})
            refused = await self.committer.commit([state], fences)
        finally:
            self.forget(mq)
        return mq not in refused

    def statistics(
        self, hooks: HookRunner | None, hook_list: Sequence[ConsumeMessageHook]
    ) -> ConsumerStatistics:
        """A frozen snapshot of the consumer: its counters and every queue's state."""
        state = self.state
        return ConsumerStatistics(
            group=self.group,
            mode=state.mode,
            consumed_ok=state.consumed_ok,
            consumed_failed=state.consumed_failed,
            sent_back=state.sent_back,
            dead_lettered=state.dead_lettered,
            in_flight=state.in_flight,
            pull_errors=state.pull_errors,
            commit_errors=state.commit_errors,
            commits=state.commits,
            hook_errors=hooks.errors if hooks is not None else 0,
            invalid_returns=state.invalid_returns,
            trace_records_dropped=sum(hook.records_dropped for hook in hook_list),
            assignment_errors=state.assignment_errors,
            abandoned_calls=state.abandoned_calls,
            listener_errors=state.listener_errors,
            timed_out_calls=state.timed_out_calls,
            undecodable_entries=state.undecodable_entries,
            trimmed_offsets=state.trimmed_offsets,
            offsets_beyond_end=state.offsets_beyond_end,
            skipped_finished=state.skipped_released
            + sum(queue.pq.skipped_count for queue in self.states.values()),
            sparse_progress_truncated=state.sparse_progress_truncated,
            transactions=state.transactions,
            queues={mq: self.states[mq].pq.statistics() for mq in self.sorted()},
        )

    def forget(self, mq: MessageQueue) -> None:
        state = self.states.pop(mq, None)
        if state is not None:
            self.state.skipped_released += state.pq.skipped_count
        if state is not None and self.pulls is not None:
            self.pulls.stop(state)
            state.pq.drop()
        self.store.remove_offset(self.group, mq)
