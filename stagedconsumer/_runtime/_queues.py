"""QueueTable: the queues a consumer holds, how one is loaded, started and released."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import anyio

from offsetstore import QueueProgress, StageOffsetStore

from .._filter import TagFilter
from .._message import MessageQueue
from .._sources._source import RETRY_PREFIX, MessageSource
from ._commit import ProgressCommitter
from ._pull import PullService
from ._services import ConsumeService
from ._signals import Signals
from ._state import QueueState

__all__ = ("QueueTable",)

logger = logging.getLogger("stagedconsumer")


class QueueTable:
    """The assigned queues of one consumer, by message queue.

    A queue is *loaded* from its committed progress (consume offset and stage
    offsets, as one unit), *started* (its pull loop runs) and *released*: pulling
    stops, nothing more is handed out, handler calls in flight finish (bounded), its
    progress is committed and it is forgotten.
    """

    def __init__(
        self,
        *,
        group: str,
        source: MessageSource,
        store: StageOffsetStore,
        service: ConsumeService,
        signals: Signals,
        drain_timeout: float,
    ) -> None:
        self.group = group
        self.source = source
        self.store = store
        self.service = service
        self.signals = signals
        self.drain_timeout = drain_timeout
        self.states: dict[MessageQueue, QueueState] = {}
        self.pulls: PullService | None = None
        self.committer: ProgressCommitter | None = None

    def __iter__(self) -> Iterator[QueueState]:
        return iter(list(self.states.values()))

    def __contains__(self, mq: object) -> bool:
        return mq in self.states

    def sorted(self) -> list[MessageQueue]:
        return sorted(self.states, key=lambda mq: (mq.topic, mq.queue_id))

    async def load(self, mq: MessageQueue, tag_filter: TagFilter) -> QueueState:
        """Build the state of ``mq`` from its committed progress."""
        progress = await self.store.read_progress(self.group, mq)
        stage_offsets: Mapping[Any, int]
        if progress is None or progress.consume_offset is None:
            start = await self.source.min_offset(mq)
            stage_offsets = progress.stage_offsets if progress else {}
        else:
            start = progress.consume_offset
            stage_offsets = progress.stage_offsets
        is_retry = mq.topic.startswith(RETRY_PREFIX)
        if is_retry:  # retry queues are consumed concurrently, whatever the mode
            pq = self.service.new_process_queue(mq, start, {})
        else:
            pq = self.service.new_process_queue(mq, start, stage_offsets)
        state = QueueState(mq, pq, tag_filter, is_retry)
        if progress is not None and progress.consume_offset is not None:
            state.persisted = QueueProgress(consume_offset=start, stage_offsets=stage_offsets)
        # else: nothing stored yet; the first commit stores where consumption started,
        # so that the queue's next owner resumes there instead of asking the source.
        return state

    def start(self, state: QueueState) -> None:
        """Consume ``state``'s queue: register it and start its pull loop."""
        assert self.pulls is not None
        self.states[state.mq] = state
        self.pulls.start(state)

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

    def forget(self, mq: MessageQueue) -> None:
        state = self.states.pop(mq, None)
        if state is not None and self.pulls is not None:
            self.pulls.stop(state)
            state.pq.drop()
        self.store.remove_offset(self.group, mq)
