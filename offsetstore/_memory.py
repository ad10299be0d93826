"""MemoryOffsetStore: a store whose durable part is a second in-memory table."""

from __future__ import annotations

from collections.abc import Mapping

from ._abc import StageOffsetStore
from ._exceptions import StoreFencedError
from ._types import MessageQueue, QueueProgress

__all__ = ("MemoryOffsetStore",)


class MemoryOffsetStore(StageOffsetStore):
    """Keeps persisted progress in memory: for tests and for the embedded broker.

    It behaves like a durable store (reads from the store see only what was
    persisted, consume offsets persist increase-only) but forgets everything when the
    process ends. Share one instance between consumers to simulate a restart.
    """

    def __init__(self) -> None:
        super().__init__()
        self._stored: dict[tuple[str, MessageQueue], QueueProgress] = {}
        self._fences: dict[tuple[str, MessageQueue], int] = {}
        self.write_count = 0
        """Number of successful :meth:`persist_all` transactions (for tests)."""

    async def _read_stored(self, group: str, mq: MessageQueue) -> QueueProgress | None:
        return self._stored.get((group, mq))

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
        self.write_count += 1

    async def _claim_stored(self, group: str, mq: MessageQueue, fence: int) -> QueueProgress | None:
        current = self._fences.get((group, mq), 0)
        if current > fence:
            raise StoreFencedError(
                f"group {group!r}: {mq} was claimed with fencing token {current} > {fence}",
                queues=(mq,),
            )
        self._fences[(group, mq)] = fence
        return self._stored.get((group, mq))

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
            if value is None:
                self._stored.pop((group, mq), None)
                self._fences.pop((group, mq), None)
            else:
                self._stored[(group, mq)] = value

    async def _list_stored(
        self, group: str, topic: str | None
    ) -> dict[MessageQueue, QueueProgress]:
        return {
            mq: value
            for (g, mq), value in sorted(self._stored.items(), key=lambda item: item[0][1])
            if g == group and (topic is None or mq.topic == topic)
        }
