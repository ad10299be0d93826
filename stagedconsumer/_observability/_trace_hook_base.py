"""What the consume and send trace hooks share: their dispatcher and sink, and how
they clean a field."""

from __future__ import annotations

import anyio

from ._trace_codec import CONTENT_SPLITOR, FIELD_SPLITOR, RMQ_SYS_TRACE_TOPIC
from ._trace_dispatcher import AsyncTraceDispatcher, TraceDispatcherStatistics
from ._trace_sinks import SourceTraceSink, TraceSink

__all__ = ("DispatchingTraceHook", "clean_field")

_S = CONTENT_SPLITOR
_E = FIELD_SPLITOR


def clean_field(text: str) -> str:
    """``text`` without the record separators (fast when there are none, the normal
    case): a field must not split its record."""
    if _S in text or _E in text:
        return text.replace(_S, "").replace(_E, "")
    return text


class DispatchingTraceHook:
    """A trace hook's records go through an :class:`AsyncTraceDispatcher` to a
    :class:`TraceSink` (default: the trace topic of the source it runs on), which is
    flushed for at most ``shutdown_timeout`` seconds when the hook is closed."""

    def __init__(
        self,
        sink: TraceSink | None,
        *,
        trace_topic: str = RMQ_SYS_TRACE_TOPIC,
        queue_size: int = 2048,
        batch_num: int = 10,
        flush_interval: float = 5.0,
        region_id: str,
        shutdown_timeout: float = 5.0,
    ) -> None:
        self.dispatcher = AsyncTraceDispatcher(
            sink if sink is not None else SourceTraceSink(),
            trace_topic=trace_topic,
            queue_size=queue_size,
            batch_num=batch_num,
            flush_interval=flush_interval,
        )
        self.region_id = region_id
        self.shutdown_timeout = shutdown_timeout

    def statistics(self) -> TraceDispatcherStatistics:
        return self.dispatcher.statistics()

    @property
    def records_dropped(self) -> int:
        """Trace contexts dropped on a full dispatcher queue."""
        return self.dispatcher.statistics().dropped

    async def aclose(self) -> None:
        await self.dispatcher.aclose(self.shutdown_timeout)
        # Its flush waited for the sink already: a sink still busy now is stuck.
        with anyio.move_on_after(self.shutdown_timeout):
            await self.dispatcher.sink.aclose()
