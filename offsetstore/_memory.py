"""MemoryOffsetStore: a store whose durable part is a second in-memory table."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from ._abc import StageOffsetStore
from ._exceptions import AlreadyFinishedError, StoreFencedError
from ._types import MessageQueue, QueueProgress, merge_marks

_T = TypeVar("_T")

__all__ = ("MemoryOffsetStore",)


class MemoryOffsetStore(StageOffsetStore):
    """Keeps persisted progress in memory: for tests and for the embedded broker.

    It behaves like a durable store (reads from the store see only what was
    persisted, consume offsets persist increase-only) but forgets everything when the
    process ends. Share one instance between consumers to simulate a restart.

    :meth:`transact` works in process: ``fn`` is called on the event loop (with
    ``None`` for a connection) between the fence check and the writing of the marks,
    with no await in between, so it is atomic with them as long as ``fn`` itself
    changes nothing when it raises.
    """

    def __init__(self) -> None:
        super().__init__()
        self._stored: dict[tuple[str, MessageQueue], QueueProgress] = {}
        self._fences: dict[tuple[str, MessageQueue], int] = {}
        self._marks: dict[tuple[str, MessageQueue], set[int]] = {}
        self.transactions = 0
        """Number of committed :meth:`transact` calls (for tests)."""
        self.write_count = 0
        """Number of successful :meth:`persist_all` transactions (for tests)."""

    def _with_marks(self, group: str, mq: MessageQueue) -> QueueProgress | None:
        progress = self._stored.get((group, mq))
        marks = self._marks.get((group, mq))
        return merge_marks(progress, marks) if marks else progress

    async def _read_stored(self, group: str, mq: MessageQueue) -> QueueProgress | None:
        return self._with_marks(group, mq)

    def _fold(self, group: str, mqs: Iterable[MessageQueue]) -> None:
        """Drop the marks below each queue's stored consume offset."""
        for mq in mqs:
            marks = self._marks.get((group, mq))
            stored = self._stored.get((group, mq))
            if not marks or stored is None or stored.consume_offset is None:
                continue
            below = stored.consume_offset
            marks.difference_update([offset for offset in marks if offset < below])
            if not marks:
                del self._marks[(group, mq)]

    async def transact(
        self,
        group: str,
        mq: MessageQueue,
        offsets: Sequence[int],
        fn: Callable[[Any], _T],
        *,
        fence: int | None = None,
    ) -> _T:
        key = (group, mq)
        if fence is not None and self._fences.get(key, 0) > fence:
            raise StoreFencedError(
                f"group {group!r}: {mq} was claimed with fencing token"
                f" {self._fences[key]} > {fence}: this member lost the queue, its"
                " transaction was not committed",
                queues=(mq,),
            )
        marks = self._marks.get(key, set())
        stored = self._stored.get(key)
        done = {
            offset
            for offset in offsets
            if offset in marks
            or (
                stored is not None
                and stored.consume_offset is not None
                and (
                    offset < stored.consume_offset
                    or any(first <= offset <= last for first, last in stored.finished)
                )
            )
        }
        if done:
            raise AlreadyFinishedError(
                f"group {group!r}: {mq} offsets {sorted(done)} already finished: their"
                " effects were committed before",
                offsets=done,
            )
        result = fn(None)
        self._marks.setdefault(key, set()).update(offsets)
        self.transactions += 1
        return result

    async def _write_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress]
    ) -> None:
        for mq, value in progress.items():
            current = self._stored.get((group, mq))
            if (
                current is not None
                and current.consume_offset is not None
                and (value.consume_offset is None or value.consume_offset < current.consume_offset)
            ):
                continue
            self._stored[(group, mq)] = value
        self._fold(group, progress)
        self.write_count += 1

    async def _claim_stored(self, group: str, mq: MessageQueue, fence: int) -> QueueProgress | None:
        current = self._fences.get((group, mq), 0)
        if current > fence:
            raise StoreFencedError(
                f"group {group!r}: {mq} was claimed with fencing token {current} > {fence}",
                queues=(mq,),
            )
        self._fences[(group, mq)] = fence
        return self._with_marks(group, mq)

    async def _write_fenced(
        self,
        group: str,
        progress: Mapping[MessageQueue, QueueProgress],
        fences: Mapping[MessageQueue, int],
    ) -> set[MessageQueue]:
        fenced = {mq for mq in progress if self._fences.get((group, mq), 0) > fences[mq]}
        await self._write_stored(
            group, {mq: value for mq, value in progress.items() if mq not in fenced}
        )
        return fenced

    async def _overwrite_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress | None]
    ) -> None:
        for mq, value in progress.items():
            self._marks.pop((group, mq), None)  # an operator's reset: reprocess
            if value is None:
                self._stored.pop((group, mq), None)
                self._fences.pop((group, mq), None)
            else:
                self._stored[(group, mq)] = value

    async def _list_stored(
        self, group: str, topic: str | None
    ) -> dict[MessageQueue, QueueProgress]:
        result: dict[MessageQueue, QueueProgress] = {}
        keys = {*self._stored, *self._marks}
        for g, mq in sorted(keys, key=lambda key: key[1]):
            if g == group and (topic is None or mq.topic == topic):
                progress = self._with_marks(group, mq)
                assert progress is not None
                result[mq] = progress
        return result
