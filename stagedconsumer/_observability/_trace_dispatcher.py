"""Buffers message trace contexts off the hot path and writes them in batches.

:class:`AsyncTraceDispatcher` is RocketMQ's ``AsyncTraceDispatcher`` after
apache/rocketmq PR #8430: a bounded queue of 2048, batches of 10, at most 20, a flush
every 5 s, written to a :class:`~._trace_sinks.TraceSink`: the trace topic of the
source (``RMQ_SYS_TRACE_TOPIC``, keyed by message id and business keys) or a
JSON-lines file. Unlike RocketMQ, records dropped on a full queue are counted in
:meth:`AsyncTraceDispatcher.statistics` and in the consumer's statistics, not only
logged.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc
import attrs

from .._exceptions import ConfigurationError
from ._trace_codec import (
    MAX_MSG_SIZE,
    RMQ_SYS_TRACE_TOPIC,
    TraceContext,
    TraceMessage,
    encode_trace_context,
    trace_keys,
)
from ._trace_sinks import TraceSink, TraceSinkFull

__all__ = ("AsyncTraceDispatcher", "Encoder", "TraceDispatcherStatistics")

logger = logging.getLogger("stagedconsumer.trace")

_LOG_EVERY = 10.0

Encoder = Callable[[Any], tuple[str, Sequence[str]]]
"""Turns a queued item into its encoded records and index keys (see
:meth:`AsyncTraceDispatcher.append_deferred`)."""
_Entry = tuple[Encoder | None, Any]


@attrs.frozen(kw_only=True)
class TraceDispatcherStatistics:
    """A snapshot of an :class:`AsyncTraceDispatcher`."""

    queued: int
    """Contexts waiting to be written."""
    appended: int
    """Contexts accepted since creation."""
    dropped: int
    """Contexts dropped because the queue was full, or the sink's buffer
    (:class:`~._trace_sinks.TraceSinkFull`: a file whose disk does not keep up);
    RocketMQ only logs these."""
    written: int
    """Contexts written to the sink."""
    messages: int
    """Trace messages written to the sink."""
    write_errors: int
    """Failed sink writes."""
    lost: int
    """Contexts lost in failed writes."""


class AsyncTraceDispatcher:
    """Buffers trace contexts and writes them in batches from a background task.

    After RocketMQ's ``AsyncTraceDispatcher``: :meth:`append` never blocks; when
    the queue (``queue_size``, default 2048) is full the context is dropped and
    counted. The task started by :meth:`run` writes ``batch_num`` contexts
    (default 10, at most 20) per trace message as soon as that many are queued,
    and whatever is queued every ``flush_interval`` seconds (default 5). A trace
    message holds at most ``max_msg_size`` characters of records (128000);
    :meth:`flush` writes everything left (called when the consumer stops).
    Contexts queued with :meth:`append_deferred` are encoded when their batch is
    written, not when they are queued: the appender's cost is one ``deque.append``.
    Ordering guarantee: contexts are encoded and written in the order they were
    appended.
    """

    def __init__(
        self,
        sink: TraceSink,
        *,
        trace_topic: str = RMQ_SYS_TRACE_TOPIC,
        queue_size: int = 2048,
        batch_num: int = 10,
        flush_interval: float = 5.0,
        max_msg_size: int = MAX_MSG_SIZE,
    ) -> None:
        for name, value in (
            ("queue_size", queue_size),
            ("batch_num", batch_num),
            ("max_msg_size", max_msg_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
        if not flush_interval > 0:
            raise ConfigurationError(f"flush_interval must be > 0, got {flush_interval!r}")
        if not trace_topic:
            raise ConfigurationError("trace_topic must be a non-empty string")
        if not isinstance(sink, TraceSink):
            raise ConfigurationError(
                f"sink must be a TraceSink (FileTraceSink(path), or None for the trace"
                f" topic of the consumer's or producer's own source), got {type(sink).__name__}"
            )
        self.sink = sink
        """Where the trace messages go."""
        self.trace_topic = trace_topic
        """The topic the trace messages are sent to."""
        self.queue_size = queue_size
        """Contexts held at most before new ones are dropped."""
        self.batch_num = min(batch_num, 20)
        """Contexts per trace message at most (RocketMQ's cap: 20)."""
        self.flush_interval = flush_interval
        """Seconds a context waits at most before it is sent."""
        self.max_msg_size = max_msg_size
        """Bytes of a trace message's body at most."""
        self._queue: deque[_Entry] = deque()
        self._sync_sink = type(sink).write_nowait is not TraceSink.write_nowait
        self._wakeup: anyio.Event | None = None
        self._lock: anyio.Lock | None = None
        self._appended = 0
        self._dropped = 0
        self._written = 0
        self._messages_written = 0
        self._write_errors = 0
        self._lost = 0
        self._last_drop_log = -_LOG_EVERY
        self._last_error_log = -_LOG_EVERY

    def append(self, ctx: TraceContext) -> bool:
        """Queue ``ctx`` for writing; returns ``False`` (and counts it) when full."""
        return self.append_encoded(encode_trace_context(ctx), trace_keys([ctx]))

    def append_encoded(self, data: str, keys: Sequence[str]) -> bool:
        """Queue one context already encoded (``data``, with its index ``keys``).

        When the queue holds a full batch and the sink can write without waiting
        (:meth:`TraceSink.write_nowait`, e.g. the embedded broker's trace topic), the
        batch is written right here, so a fast consumer does not outrun the
        background task; otherwise the task is woken.
        """
        return self.append_deferred(None, (data, keys))

    def append_deferred(self, encode: Encoder | None, item: Any) -> bool:
        """Queue one context to be encoded when its batch is written:
        ``encode(item)`` returns its records and index keys (``encode=None``: ``item``
        is that pair already). Encoding is deferred so that the caller, a handler's
        hot path, pays one ``deque.append``; ``encode`` must not depend on state
        that changes after this call. An ``encode`` that raises loses the context
        (counted in ``lost`` and logged). Full queue: as :meth:`append_encoded`.
        """
        queue = self._queue
        if len(queue) >= self.queue_size:
            self._drop(1, f"{self.queue_size} contexts")
            return False
        queue.append((encode, item))
        self._appended += 1
        batch_num = self.batch_num
        if len(queue) >= batch_num:
            if self._sync_sink and (self._lock is None or not self._lock.locked()):
                while len(queue) >= batch_num and self._send_nowait(self._take(batch_num)):
                    pass
            if len(queue) >= batch_num and self._wakeup is not None:
                self._wakeup.set()
        return True

    def _drop(self, count: int, full: str) -> None:
        """Count ``count`` contexts dropped on a full buffer (``full`` says which)."""
        self._dropped += count
        now = time.monotonic()
        if now - self._last_drop_log >= _LOG_EVERY:
            self._last_drop_log = now
            logger.warning("trace buffer full (%s): dropped %d so far", full, self._dropped)

    def _take(self, count: int) -> list[_Entry]:
        queue = self._queue
        return [queue.popleft() for _ in range(min(count, len(queue)))]

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Write batches until cancelled (run it in the owner's task group)."""
        if self._lock is None:
            self._lock = anyio.Lock()
        self._wakeup = anyio.Event()
        task_status.started()
        last_flush = anyio.current_time()
        while True:
            if len(self._queue) < self.batch_num:
                deadline = last_flush + self.flush_interval
                with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                    await self._wakeup.wait()
                self._wakeup = anyio.Event()
            due = anyio.current_time() - last_flush >= self.flush_interval
            await self._write_batches(everything=due)
            if due:
                await self.sink.flush()
                last_flush = anyio.current_time()

    async def flush(self) -> None:
        """Write everything queued now, and wait until the sink has stored it
        (:meth:`TraceSink.flush`)."""
        await self._write_batches(everything=True)
        await self.sink.flush()

    async def aclose(self, timeout: float = 5.0) -> None:
        """Flush for at most ``timeout`` seconds (RocketMQ waits 5 s on shutdown);
        contexts still queued then are counted as lost."""
        with anyio.move_on_after(timeout):
            await self.flush()
        self._lost += len(self._queue)
        self._queue.clear()

    async def _write_batches(self, *, everything: bool) -> None:
        queue = self._queue
        if self._sync_sink and (self._lock is None or not self._lock.locked()):
            # No await in between: appenders cannot interleave, no lock needed (taking
            # one would yield, and appenders would find it held and not write inline).
            while len(queue) >= self.batch_num or (everything and queue):
                if not self._send_nowait(self._take(self.batch_num)):
                    break
            if not (len(queue) >= self.batch_num or (everything and queue)):
                return
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            while len(queue) >= self.batch_num or (everything and queue):
                batch = self._take(self.batch_num)
                if self._sync_sink and self._send_nowait(batch):
                    continue
                await self._send(batch)

    def _encode(self, batch: list[_Entry]) -> list[tuple[str, Sequence[str]]]:
        """Records and index keys of each context of ``batch`` (deferred ones encoded
        now; one whose encoder raises is lost, counted and logged)."""
        out: list[tuple[str, Sequence[str]]] = []
        for encode, item in batch:
            if encode is None:
                out.append(item)
                continue
            try:
                out.append(encode(item))
            except Exception as exc:  # an encoder bug must not stop the consumer
                self._lost += 1
                now = time.monotonic()
                if now - self._last_error_log >= _LOG_EVERY:
                    self._last_error_log = now
                    logger.error("encoding a trace context failed", exc_info=exc)
        return out

    def _messages(self, encoded: list[tuple[str, Sequence[str]]]) -> list[tuple[int, TraceMessage]]:
        """Encoded contexts as trace messages of at most ``max_msg_size`` characters,
        each with the number of contexts it holds (RocketMQ's ``AsyncDataSendTask``)."""
        if not encoded:
            return []
        parts = [data for data, _ in encoded]
        if sum(map(len, parts)) - len(parts[-1]) < self.max_msg_size:
            # One message (the usual case): the loop below would close none before the end.
            all_keys = [key for _, data_keys in encoded for key in data_keys]
            return [(len(parts), self._message(parts, all_keys, len(parts)))]
        out: list[tuple[int, TraceMessage]] = []
        parts = []
        keys: list[str] = []
        size = 0
        for data, data_keys in encoded:
            parts.append(data)
            keys.extend(data_keys)
            size += len(data)
            if size >= self.max_msg_size:
                out.append((len(parts), self._message(parts, keys, len(parts))))
                parts, keys, size = [], [], 0
        if parts:
            out.append((len(parts), self._message(parts, keys, len(parts))))
        return out

    def _message(self, parts: list[str], keys: list[str], contexts: int) -> TraceMessage:
        """One trace message, keyed by each distinct key once, in first-seen order."""
        return TraceMessage(
            topic=self.trace_topic,
            keys=tuple(dict.fromkeys(keys)),
            body="".join(parts),
            contexts=contexts,
        )

    def _send_nowait(self, batch: list[_Entry]) -> bool:
        """Write ``batch`` through the sink's synchronous path; ``False`` (with the
        batch put back in front of the queue) when the sink declined."""
        encoded = self._encode(batch)
        for i, (count, message) in enumerate(self._messages(encoded)):
            try:
                written = self.sink.write_nowait(message)
            except TraceSinkFull as exc:
                self._drop(count, str(exc))
                continue
            except Exception as exc:
                self._failed(count, exc)
                continue
            if not written:
                if i == 0:  # the sink writes asynchronously: leave it to the task
                    self._sync_sink = False
                    self._queue.extendleft((None, pair) for pair in reversed(encoded))
                    return False
                raise RuntimeError("a TraceSink must not decline write_nowait() halfway")
            self._written += count
            self._messages_written += 1
        return True

    async def _send(self, batch: list[_Entry]) -> None:
        for count, message in self._messages(self._encode(batch)):
            try:
                await self.sink.write(message)
            except TraceSinkFull as exc:
                self._drop(count, str(exc))
                continue
            except Exception as exc:
                self._failed(count, exc)
                continue
            self._written += count
            self._messages_written += 1

    def _failed(self, count: int, exc: Exception) -> None:
        self._write_errors += 1
        self._lost += count
        now = time.monotonic()
        if now - self._last_error_log >= _LOG_EVERY:
            self._last_error_log = now
            logger.warning(
                "writing %d trace context(s) to %s failed (%d failures so far)",
                count,
                self.trace_topic,
                self._write_errors,
                exc_info=exc,
            )

    def statistics(self) -> TraceDispatcherStatistics:
        """A snapshot: contexts queued, written, dropped and lost."""
        # A sink that stores in the background (FileTraceSink) reports its failures
        # later: their contexts were counted written when it took them.
        sink_errors, sink_lost = self.sink.write_failures()
        return TraceDispatcherStatistics(
            queued=len(self._queue),
            appended=self._appended,
            dropped=self._dropped,
            written=self._written - sink_lost,
            messages=self._messages_written,
            write_errors=self._write_errors + sink_errors,
            lost=self._lost + sink_lost,
        )
