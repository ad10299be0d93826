"""MemoryOffsetStore: a store whose durable part is a second in-memory table."""

from __future__ import annotations

from collections.abc import Mapping

from ._abc import StageOffsetStore
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

    async def _overwrite_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress | None]
    ) -> None:
        for mq, value in progress.items():
            if value is None:
                self._stored.pop((group, mq), None)
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
