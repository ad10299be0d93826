"""PullService: one pull loop per assigned queue, with flow control."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.abc
import attrs

from .._core import Backoff, Dispatcher, ProcessQueue
from .._exceptions import SourceError, SourcePermissionError
from .._message import Message, MessageQueue
from .._observability._hooks import PullContext
from .._options import ConsumerOptions
from .._sources._source import (
    PROPERTY_RETRY_TOPIC,
    MessageSource,
    PullResult,
    UndecodableEntry,
    dlq_topic,
)
from ._hooks import HookRunner, loop_clock, loop_wall_offset
from ._signals import Signals
from ._state import ConsumerState, QueueState

__all__ = ("PullService",)

logger = logging.getLogger("stagedconsumer")

_MAX_PULL_BACKOFF = 30.0


def _restore_retry_topic(message: Message) -> Message:
    origin = message.properties.get(PROPERTY_RETRY_TOPIC)
    if origin is None:
        return message
    return attrs.evolve(message, topic=origin)


class PullService:
    """Pulls every assigned queue into its process queue.

    Ordering guarantee: each queue is pulled by one loop, in offset order; the loop
    pauses while its queue is over the flow-control thresholds (RocketMQ's: 1000
    messages, 100 MiB, span 2000 in concurrent mode) and resumes when a finished
    batch brings it back under them (the ``ROOM`` effect). A failed pull is retried
    after ``pull_time_delay_when_exception``, doubling up to 30 s. The max offset of
    a queue that is not pulled (paused, or over the thresholds) is asked of the
    source every ``persist_consumer_offset_interval`` (one task for all of them), so
    its lag stays true.
    """

    def __init__(
        self,
        *,
        state: ConsumerState,
        source: MessageSource,
        dispatcher: Dispatcher,
        signals: Signals,
        options: ConsumerOptions,
        hooks: HookRunner | None,
        past_end: Callable[[QueueState, int, int], Awaitable[int]] | None = None,
        offset_moved: Callable[[QueueState, int, PullResult], Awaitable[int]] | None = None,
    ) -> None:
        self.offset_moved = offset_moved
        """Called when a pull finds its offset no longer stored (``offset_moved``):
        returns the offset to go on from."""
        self.state = state
        self.past_end = past_end
        """Called when a pull finds the queue's end below the loop's offset (the
        broker lost messages): returns the offset to go on from."""
        self.source = source
        self.dispatcher = dispatcher
        self.signals = signals
        self.options = options
        self.hooks = hooks
        self._paused: dict[ProcessQueue, QueueState] = {}
        """Queues whose pull loop waits for room (flow control)."""
        self._user_paused: dict[ProcessQueue, QueueState] = {}
        """Queues whose pull loop waits for :meth:`PushConsumer.resume`."""
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Host the pull loops until cancelled (see :meth:`stop_all`)."""
        with anyio.CancelScope() as scope:
            self._scope = scope
            async with anyio.create_task_group() as pulls:
                self._tg = pulls
                task_status.started()
                await self._refresh_idle()  # until cancelled

    def start(self, state: QueueState) -> None:
        """Start pulling ``state``'s queue from its committed offset."""
        assert self._tg is not None
        self._tg.start_soon(self._pull_loop, state)

    def stop(self, state: QueueState) -> None:
        """Stop pulling ``state``'s queue."""
        if state.pull_scope is not None:
            state.pull_scope.cancel()
        self._paused.pop(state.pq, None)
        self._user_paused.pop(state.pq, None)

    def stop_all(self) -> None:
        self._scope.cancel()

    def unpaused(self, state: QueueState) -> None:
        """``state``'s queue was resumed: let its pull loop go on."""
        if state.unpaused is not None:
            state.unpaused.set()

    def room(self, pq: ProcessQueue) -> None:
        """``pq`` is back under its flow-control thresholds: resume its pull loop."""
        state = self._paused.pop(pq, None)
        if state is not None and state.room is not None:
            state.room.set()

    async def _refresh_max_offset(self, state: QueueState) -> None:
        """Ask the source for the max offset of ``state``'s queue, which is not pulled
        (its pulls would report it); a failure waits for the next refresh."""
        try:
            state.pq.max_offset = await self.source.max_offset(state.mq)
        except SourceError as exc:
            logger.debug(
                "group %s: max offset of %s (not pulled) unknown: %s",
                self.state.group,
                state.mq,
                exc,
            )

    async def _refresh_idle(self) -> None:
        """Every ``persist_consumer_offset_interval``: the max offset of every queue
        that is not pulled (paused, or over its flow-control thresholds), so that its
        lag stays true. One task for all queues: the pull loops' waits stay plain
        event waits, and a queue being pulled costs nothing here."""
        interval = self.options.persist_consumer_offset_interval
        while True:
            await anyio.sleep(interval)
            for state in [*self._paused.values(), *self._user_paused.values()]:
                await self._refresh_max_offset(state)

    async def _dead_letter(self, mq: MessageQueue, entries: Sequence[UndecodableEntry]) -> None:
        """Send the poison entries a pull returned to the group's dead-letter queue,
        each logged (ERROR) and counted once: after this the pull loop moves past
        them. Raises :class:`SourceError` when one could not be stored (the pull is
        repeated; those already stored may be stored again)."""
        group = self.state.group
        for entry in entries:
            await self.source.send_undecodable_to_dlq(group, entry)
            self.state.undecodable_entries += 1
            logger.error(
                "group %s: the entry at offset %d of %s cannot be decoded (%s); moved it to"
                " %s with its fields as stored (properties DECODE_ERROR, POISON_STREAM,"
                " POISON_ENTRY_ID) and went on",
                group,
                entry.offset,
                mq,
                entry.error,
                dlq_topic(group),
            )

    async def _pull_loop(self, state: QueueState) -> None:
        source, dispatcher, apply = self.source, self.dispatcher, self.signals.apply
        mq, pq = state.mq, state.pq
        offset = pq.committed_offset
        options = self.options
        batch_size, long_poll = options.pull_batch_size, options.pull_long_polling_timeout
        backoff = Backoff(options.pull_time_delay_when_exception, _MAX_PULL_BACKOFF)
        accept_all, tag_filter = state.filter.accepts_all, state.filter
        hooks = self.hooks
        clock = loop_clock()
        started = 0.0
        with anyio.CancelScope() as scope:
            state.pull_scope = scope
            while not pq.dropped:
                if pq.paused:  # PushConsumer.pause(): no pulling until resumed
                    await self._wait_unpaused(state)
                    continue
                if pq.should_pause_pull():
                    state.room = anyio.Event()
                    self._paused[pq] = state
                    await state.room.wait()
                    continue
                if hooks is not None:
                    started = clock()
                try:
                    result = await source.pull(mq, offset, batch_size, timeout=long_poll)
                except SourceError as exc:
                    if not await self._pull_failed(mq, offset, exc, backoff):
                        return
                    continue
                if backoff.failures:
                    backoff.reset()
                pq.max_offset = result.max_offset
                messages = result.messages
                undecodable = result.undecodable
                if undecodable and not await self._put_undecodable(state, result, backoff):
                    continue  # pulled again after a while
                if messages:
                    highest = messages[-1].queue_offset
                    if undecodable and undecodable[-1].offset > highest:
                        highest = undecodable[-1].offset
                    if state.is_retry:
                        messages = [_restore_retry_topic(m) for m in messages]
                    elif not accept_all:
                        messages = [m for m in messages if tag_filter(m)]
                    now = clock()
                    effects = dispatcher.put_messages(pq, messages, highest_offset=highest, now=now)
                    if effects:
                        apply(pq, effects)
                    if hooks is not None and hooks.wants_pull and messages:
                        self._pulled(hooks, mq, messages, started, now, result, clock)
                elif result.offset_moved and self.offset_moved is not None:
                    # The source no longer stores ``offset`` (retention trimmed it):
                    # never go on silently.
                    offset = await self.offset_moved(state, offset, result)
                    continue
                elif result.next_offset < offset and self.past_end is not None:
                    # Past the queue's end (OFFSET_OVERFLOW_BADLY): never follow the
                    # source back silently, the process queue would drop what comes.
                    offset = await self.past_end(state, offset, result.next_offset)
                    continue
                offset = result.next_offset

    async def _wait_unpaused(self, state: QueueState) -> None:
        """The pull loop of ``state``'s queue waits for :meth:`unpaused`."""
        pq = state.pq
        state.unpaused = anyio.Event()
        self._user_paused[pq] = state
        try:
            if pq.max_offset is None:  # never pulled: its lag at once
                await self._refresh_max_offset(state)
            await state.unpaused.wait()
        finally:
            self._user_paused.pop(pq, None)

    async def _pull_failed(
        self, mq: MessageQueue, offset: int, exc: SourceError, backoff: Backoff
    ) -> bool:
        """A pull of ``mq`` failed: wait before the next one (``backoff``) and return
        True, or stop the consumer and return False (permission refused for good)."""
        self.state.pull_errors += 1
        if isinstance(exc, SourcePermissionError):
            logger.error(
                "group %s: pull of %s refused for good (%s); stopping the consumer",
                self.state.group,
                mq,
                exc,
            )
            self.state.fail(exc)
            return False
        delay = backoff.failed()
        logger.warning(
            "group %s: pull of %s at offset %d failed (%s); retrying in %.1f s",
            self.state.group,
            mq,
            offset,
            exc,
            delay,
        )
        await anyio.sleep(delay)
        return True

    async def _put_undecodable(
        self, state: QueueState, result: PullResult, backoff: Backoff
    ) -> bool:
        """Move the undecodable entries of a pull to the dead-letter queue; when the
        pull had nothing else, move the queue past them. False (after waiting, the
        pull to be repeated) if they could not be moved."""
        mq, pq = state.mq, state.pq
        undecodable = result.undecodable
        try:
            await self._dead_letter(mq, undecodable)
        except SourceError as exc:
            self.state.pull_errors += 1
            delay = backoff.failed()
            logger.warning(
                "group %s: moving undecodable entries of %s to %s failed (%s);"
                " pulling again in %.1f s",
                self.state.group,
                mq,
                dlq_topic(self.state.group),
                exc,
                delay,
            )
            await anyio.sleep(delay)
            return False
        if not result.messages:
            effects = self.dispatcher.put_messages(
                pq, (), highest_offset=undecodable[-1].offset, now=loop_clock()()
            )
            if effects:
                self.signals.apply(pq, effects)
        return True

    def _pulled(
        self,
        hooks: HookRunner,
        mq: MessageQueue,
        messages: Sequence[Message],
        started: float,
        now: float,
        result: PullResult,
        clock: Callable[[], float],
    ) -> None:
        hooks.pulled(
            PullContext(
                consumer_group=self.state.group,
                message_queue=mq,
                messages=messages,
                start_time=started,
                end_time=now,
                wall_offset=loop_wall_offset(clock),
                max_offset=result.max_offset,
            )
        )
