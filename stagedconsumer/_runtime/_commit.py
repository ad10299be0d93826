"""ProgressCommitter: writes the progress of the assigned queues to the offset store."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import TypeVar

import anyio

from offsetstore import OffsetStoreError, QueueProgress, StageOffsetStore, StoreFencedError

from .._core import Backoff
from .._message import MessageQueue
from ._state import ConsumerState, QueueState

__all__ = ("ProgressCommitter", "retry_store")

logger = logging.getLogger("stagedconsumer")

_MAX_COMMIT_BACKOFF = 60.0
_T = TypeVar("_T")


async def retry_store(action: Callable[[], Awaitable[_T]], *, group: str, timeout: float) -> _T:
    """``await action()``, retried with backoff (0.5 s doubling to 5 s) while it fails
    with a retriable store error, for up to ``timeout`` seconds; each failed attempt
    is logged. A non-retriable error, or the last one, propagates."""
    deadline = anyio.current_time() + timeout
    backoff = Backoff(0.5, 5.0)
    while True:
        try:
            return await action()
        except OffsetStoreError as exc:
            remaining = deadline - anyio.current_time()
            if not exc.retriable or remaining <= 0:
                raise
            delay = min(backoff.failed(), remaining)
            logger.warning(
                "group %s: offset store unavailable at start (%s); retrying in %.1f s"
                " (start_timeout %.0f s)",
                group,
                exc,
                delay,
                timeout,
            )
            await anyio.sleep(delay)


class ProgressCommitter:
    """Commits the progress (consume offset and stage offsets, as one unit) of every
    queue whose committed offset moved, every ``interval`` seconds and when asked.

    In a consumer group (``fences`` given), each queue is written with its lock's
    epoch as fencing token (a queue without one, lost meanwhile, is not written);
    queues the store refuses (a newer owner claimed them) are handed to
    ``on_fenced`` with the fences refused, and not marked persisted.

    Failures: a retriable store error (or ``OSError``) is counted, logged and retried
    with backoff (``2 * interval`` doubling up to 60 s) while consumption goes on; a
    non-retriable one (a read-only database, say) stops the consumer through
    :meth:`ConsumerState.fail`: it drains and raises it from ``async with``.
    """

    def __init__(
        self,
        *,
        state: ConsumerState,
        store: StageOffsetStore,
        queues: Iterable[QueueState],
        interval: float,
        fences: Callable[[], Mapping[MessageQueue, int]] | None = None,
        on_fenced: Callable[[Mapping[MessageQueue, int]], None] | None = None,
        hold: Callable[[Mapping[MessageQueue, int]], Awaitable[None]] | None = None,
        max_ranges: int = 128,
    ) -> None:
        self.hold = hold
        """Told the committed offsets of every held queue after each periodic commit
        (the source's retention keeps what they have not passed)."""
        self.max_ranges = max_ranges
        self.state = state
        self.store = store
        self.queues = queues
        self.interval = interval
        self.fences = fences
        self.on_fenced = on_fenced

    async def run(self) -> None:
        """Commit every ``interval`` until cancelled."""
        backoff = Backoff(2 * self.interval, _MAX_COMMIT_BACKOFF)
        delay = self.interval
        while True:
            await anyio.sleep(delay)
            try:
                await self.commit(list(self.queues))
            except (OffsetStoreError, OSError) as exc:
                if isinstance(exc, OffsetStoreError) and not exc.retriable:
                    self.state.commit_errors += 1
                    logger.error(
                        "group %s: persisting progress failed for good (%s); stopping the consumer",
                        self.state.group,
                        exc,
                    )
                    self.state.fail(exc)
                    return
                self.state.commit_errors += 1
                delay = backoff.failed()
                logger.warning(
                    "group %s: persisting progress failed (%s); retrying in %.1f s",
                    self.state.group,
                    exc,
                    delay,
                )
            else:
                backoff.reset()
                delay = self.interval
                if self.hold is not None:
                    await self._hold()

    async def hold_one(self, state: QueueState) -> None:
        """Tell the source where ``state``'s queue starts, as soon as it is loaded (a
        failure is logged; the periodic report follows)."""
        if self.hold is None:
            return
        try:
            await self.hold({state.mq: state.pq.committed_offset})
        except Exception as exc:
            logger.warning(
                "group %s: telling the source the committed offset of %s failed (%s)",
                self.state.group,
                state.mq,
                exc,
            )

    async def _hold(self) -> None:
        """Tell the source the stored offsets of every held queue (a failure is logged
        and waits for the next interval: retention then keeps a group's entries for
        ``group_ttl`` after its last report)."""
        assert self.hold is not None
        offsets: dict[MessageQueue, int] = {}
        for state in list(self.queues):
            persisted = state.persisted
            if persisted is not None and persisted.consume_offset is not None:
                offsets[state.mq] = persisted.consume_offset
            else:
                offsets[state.mq] = state.pq.committed_offset
        if not offsets:
            return
        try:
            await self.hold(offsets)
        except Exception as exc:  # never stops consuming; retried next interval
            logger.warning(
                "group %s: telling the source the committed offsets failed (%s)",
                self.state.group,
                exc,
            )

    async def commit(
        self, states: Sequence[QueueState], fences: Mapping[MessageQueue, int] | None = None
    ) -> frozenset[MessageQueue]:
        """Write the progress of ``states`` that changed since it was last written.

        In a group, each with its fence from ``fences`` (default: the held queues'
        fences). Returns the queues whose write the store refused as fenced."""
        store = self.store
        group = self.state.group
        changed: list[tuple[QueueState, QueueProgress]] = []
        max_ranges = self.max_ranges
        for state in states:
            persisted = state.persisted
            pq = state.pq
            # Stage offsets move only when the committed offset does, and the finished
            # messages above it only grow while it stays, so comparing the offset and
            # their number finds every change (cheap with thousands of queues).
            finished_count = pq.finished_above
            if (
                persisted is not None
                and persisted.consume_offset == pq.committed_offset
                and state.finished_count == finished_count
            ):
                continue
            state.finished_count = finished_count
            if finished_count and max_ranges:
                ranges, cut = pq.finished_ranges(max_ranges)
                if cut:
                    self.state.sparse_progress_truncated += 1
            else:
                ranges = ()
                if finished_count:
                    self.state.sparse_progress_truncated += 1
            progress = QueueProgress(
                consume_offset=pq.committed_offset,
                stage_offsets=pq.committed_stage_offsets,
                finished=ranges,
            )
            if progress != persisted:
                store.update_progress(group, state.mq, progress)
                changed.append((state, progress))
        if not changed:
            return frozenset()
        fenced: frozenset[MessageQueue] = frozenset()
        if self.fences is None:
            await store.persist_all(group, [state.mq for state, _ in changed])
            written: Collection[MessageQueue] = [state.mq for state, _ in changed]
        else:
            written, fenced = await self._commit_fenced(
                changed, self.fences() if fences is None else fences
            )
        self.state.commits += 1
        for state, progress in changed:
            if state.mq in written:
                state.persisted = progress
        return fenced

    async def _commit_fenced(
        self,
        changed: Sequence[tuple[QueueState, QueueProgress]],
        held: Mapping[MessageQueue, int],
    ) -> tuple[set[MessageQueue], frozenset[MessageQueue]]:
        fences = {state.mq: held[state.mq] for state, _ in changed if state.mq in held}
        fenced: frozenset[MessageQueue] = frozenset()
        if not fences:
            return set(), fenced
        try:
            await self.store.persist_fenced(self.state.group, fences)
        except StoreFencedError as exc:
            fenced = exc.queues
            logger.warning(
                "group %s: %s; releasing %s without committing",
                self.state.group,
                exc,
                ", ".join(map(str, sorted(fenced))),
            )
            if self.on_fenced is not None:
                self.on_fenced({mq: fences[mq] for mq in fenced if mq in fences})
        return set(fences) - fenced, fenced
