"""Where message trace is written: :class:`TraceSink` and its two implementations,
the trace topic of a source (:class:`SourceTraceSink`) and a JSON-lines file
(:class:`FileTraceSink`).
"""

from __future__ import annotations

import abc
import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from .._exceptions import ConfigurationError, UnknownTopicError
from .._sources._source import MessageSource, TraceWriter
from ._trace_codec import TraceMessage
from ._traceparent import without_current_span

if TYPE_CHECKING:
    from ._send_hooks import ProducerView
    from ._view import ConsumerView

__all__ = ("FileTraceSink", "SourceTraceSink", "TraceSink")


class TraceSink(abc.ABC):
    """Where :class:`AsyncTraceDispatcher` writes trace messages.

    Ordering guarantee: :meth:`write` is called by one task at a time, in the
    order the dispatcher took the contexts from its queue.
    """

    @abc.abstractmethod
    async def write(self, message: TraceMessage) -> None:
        """Store one trace message; raise to report a failure (it is counted)."""

    def write_nowait(self, message: TraceMessage) -> bool:
        """Store one trace message without waiting, if the sink can; return ``False``
        to have it written by :meth:`write` from the dispatcher's task instead.

        Override only for sinks whose write is a cheap in-memory operation (the
        embedded broker): the dispatcher then writes full batches right where they
        fill up. The default declines.
        """
        del message
        return False

    async def prepare(self, owner: ConsumerView | ProducerView) -> None:  # noqa: B027 - optional
        """Called when the consumer or producer whose hook writes here starts, before
        any write. The default does nothing."""

    async def aclose(self) -> None:  # noqa: B027 - optional
        """Release resources. The default does nothing."""


class FileTraceSink(TraceSink):
    """Appends trace messages to a JSON-lines file, one message per line:
    ``{"topic": ..., "keys": [...], "body": "<RocketMQ-encoded records>"}``.

    ``stagedconsumer trace MSG_ID_OR_KEY --trace-file PATH`` reads it. Writes run in
    a worker thread and append whole lines, so several consumers of one process may
    share a file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def _append(self, line: str) -> None:
        with self.path.open("a", encoding="utf-8") as file:
            file.write(line + "\n")

    async def write(self, message: TraceMessage) -> None:
        await anyio.to_thread.run_sync(self._append, message.to_json())


class SourceTraceSink(TraceSink):
    """Sends trace messages to the trace topic of a source, keyed by message id and
    business keys, as RocketMQ's trace producer does.

    The source needs a producer method ``send(topic, body, *, keys=...)``, sync
    (batches are then written inline) or async (written by the dispatcher's task).
    A source whose :meth:`~stagedconsumer.MessageSource.trace_writer` returns a
    writer (:class:`~stagedconsumer.MemoryBroker`) gets its batches written inline
    through it instead. A missing trace topic is created with one queue through the
    source's ``create_topic`` (sync or async), as RocketMQ's broker creates it with
    one queue. With ``source=None`` the source of the consumer or producer whose
    hook writes here is used.
    """

    def __init__(self, source: MessageSource | None = None) -> None:
        self.source = source
        self._sync_send = False
        # The source's synchronous trace path (MessageSource.trace_writer), if it has one.
        self._send_trace: TraceWriter | None = None

    async def prepare(self, owner: ConsumerView | ProducerView) -> None:
        if self.source is None:
            self.source = owner.source
        send = getattr(self.source, "send", None)
        if not callable(send):
            raise ConfigurationError(
                f"{type(self.source).__name__} has no send(); message trace needs a source"
                " it can write the trace topic to, or a FileTraceSink"
            )
        self._send_trace = self.source.trace_writer()
        self._sync_send = self._send_trace is not None or not inspect.iscoroutinefunction(send)

    def write_nowait(self, message: TraceMessage) -> bool:
        """Sends at once when the source has a trace writer or its ``send`` is
        synchronous (the embedded broker appends to memory)."""
        if not self._sync_send:
            return False
        with without_current_span():
            try:
                self._call_send(message)
            except UnknownTopicError:
                self._create_topic(message.topic)
                self._call_send(message)
        return True

    async def write(self, message: TraceMessage) -> None:
        # A trace message is not created inside any consumer span: without this,
        # producers that inject the current span's traceparent (RedisBroker) would
        # give it whichever span the dispatcher's task inherited.
        with without_current_span():
            try:
                await _settle(self._call_send(message))
            except UnknownTopicError:
                await _settle(self._create_topic(message.topic))
                await _settle(self._call_send(message))

    def _call_send(self, message: TraceMessage) -> Any:
        if self._send_trace is not None:
            return self._send_trace(message.topic, message.body.encode("utf-8"), message.keys)
        send = getattr(self.source, "send", None)
        if send is None:
            raise ConfigurationError("SourceTraceSink used before prepare()")
        return send(message.topic, message.body.encode("utf-8"), keys=message.keys)

    def _create_topic(self, topic: str) -> Any:
        """Create the trace topic with one queue (sync or async ``create_topic``)."""
        create = getattr(self.source, "create_topic", None)
        if create is None:
            raise UnknownTopicError(
                f"trace topic {topic!r} does not exist and"
                f" {type(self.source).__name__} cannot create it"
            )
        return create(topic, 1)


async def _settle(result: Any) -> Any:
    """Await ``result`` if it is awaitable (sources may be sync or async)."""
    if inspect.isawaitable(result):
        return await result
    return result
