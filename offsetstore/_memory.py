"""MemoryOffsetStore: a store whose durable part is a second in-memory table."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from ._abc import UNSCOPED, StageOffsetStore
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

    def __init__(self, *, source: str | None = None) -> None:
        super().__init__(source=source)
        # Keyed by (source, group, queue): see _key().
        self._stored: dict[tuple[str, str, MessageQueue], QueueProgress] = {}
        self._fences: dict[tuple[str, str, MessageQueue], int] = {}
        self._marks: dict[tuple[str, str, MessageQueue], set[int]] = {}
        self.transactions = 0
        """Number of committed :meth:`transact` calls (for tests)."""
        self.write_count = 0
        """Number of successful :meth:`persist_all` transactions (for tests)."""

    def _key(self, group: str, mq: MessageQueue) -> tuple[str, str, MessageQueue]:
        """The durable key of ``mq``'s progress: this store's source, group, queue."""
        return (self._scope_of(group), group, mq)

    async def _stored_sources(self, group: str) -> list[str]:
        tables: tuple[dict[Any, Any], ...] = (self._stored, self._marks)
        return sorted({k[0] for table in tables for k in table if k[1] == group})

    async def _adopt_stored(self, group: str) -> int:
        scope = self._scope_of(group)
        tables: tuple[dict[Any, Any], ...] = (self._stored, self._fences, self._marks)
        if any(k[0] == scope and k[1] == group for table in tables for k in table):
            return 0
        adopted: set[MessageQueue] = set()
        for table in tables:
            for key in [k for k in table if k[0] == UNSCOPED and k[1] == group]:
                table[(scope, group, key[2])] = table.pop(key)
                adopted.add(key[2])
        return len(adopted)

    def _with_marks(self, group: str, mq: MessageQueue) -> QueueProgress | None:
        progress = self._stored.get(self._key(group, mq))
        marks = self._marks.get(self._key(group, mq))
        return merge_marks(progress, marks) if marks else progress

    async def _read_stored(self, group: str, mq: MessageQueue) -> QueueProgress | None:
        return self._with_marks(group, mq)

    def _fold(self, group: str, mqs: Iterable[MessageQueue]) -> None:
        """Drop the marks below each queue's stored consume offset."""
        for mq in mqs:
            marks = self._marks.get(self._key(group, mq))
            stored = self._stored.get(self._key(group, mq))
            if not marks or stored is None or stored.consume_offset is None:
                continue
            below = stored.consume_offset
            marks.difference_update([offset for offset in marks if offset < below])
            if not marks:
                del self._marks[self._key(group, mq)]

    async def transact(
        self,
        group: str,
        mq: MessageQueue,
        offsets: Sequence[int],
        fn: Callable[[Any], _T],
        *,
        fence: int | None = None,
    ) -> _T:
        key = self._key(group, mq)
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
            current = self._stored.get(self._key(group, mq))
            if (
                current is not None
                and current.consume_offset is not None
                and (value.consume_offset is None or value.consume_offset < current.consume_offset)
            ):
                continue
            self._stored[self._key(group, mq)] = value
        self._fold(group, progress)
        self.write_count += 1

    async def _claim_stored(self, group: str, mq: MessageQueue, fence: int) -> QueueProgress | None:
        current = self._fences.get(self._key(group, mq), 0)
        if current > fence:
            raise StoreFencedError(
                f"group {group!r}: {mq} was claimed with fencing token {current} > {fence}",
                queues=(mq,),
            )
        self._fences[self._key(group, mq)] = fence
        return self._with_marks(group, mq)

    async def _write_fenced(
        self,
        group: str,
        progress: Mapping[MessageQueue, QueueProgress],
        fences: Mapping[MessageQueue, int],
    ) -> set[MessageQueue]:
        fenced = {mq for mq in progress if self._fences.get(self._key(group, mq), 0) > fences[mq]}
        await self._write_stored(
            group, {mq: value for mq, value in progress.items() if mq not in fenced}
        )
        return fenced

    async def _overwrite_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress | None]
    ) -> None:
        for mq, value in progress.items():
            self._marks.pop(self._key(group, mq), None)  # an operator's reset: reprocess
            if value is None:
                self._stored.pop(self._key(group, mq), None)
                self._fences.pop(self._key(group, mq), None)
            else:
                self._stored[self._key(group, mq)] = value

    async def _list_stored(
        self, group: str, topic: str | None
    ) -> dict[MessageQueue, QueueProgress]:
        result: dict[MessageQueue, QueueProgress] = {}
        keys = {*self._stored, *self._marks}
        for scope, g, mq in sorted(keys, key=lambda key: key[2]):
            if (
                scope == self._scope_of(group)
                and g == group
                and (topic is None or mq.topic == topic)
            ):
                progress = self._with_marks(group, mq)
                assert progress is not None
                result[mq] = progress
        return result
