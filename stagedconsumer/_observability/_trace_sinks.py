"""Where message trace is written: :class:`TraceSink` and its two implementations,
the trace topic of a source (:class:`SourceTraceSink`) and a JSON-lines file
(:class:`FileTraceSink`).
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import logging
import os
import queue
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from .._exceptions import ConfigurationError, UnknownTopicError
from .._sources._source import MessageSource, TraceWriter
from ._trace_codec import FIELD_SPLITOR, TraceMessage
from ._traceparent import without_current_span

if TYPE_CHECKING:
    from ._send_hooks import ProducerView
    from ._view import ConsumerView

__all__ = ("FileTraceSink", "SourceTraceSink", "TraceSink", "TraceSinkFull")

logger = logging.getLogger("stagedconsumer.trace")

_LOG_EVERY = 10.0
_HANDOVER_TIMEOUT = 0.001


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
        fill up. The default declines. A sink that buffers may raise
        :class:`TraceSinkFull` instead when its buffer is full: the message's contexts
        are then counted as dropped.
        """
        del message
        return False

    async def flush(self) -> None:  # noqa: B027 - optional
        """Return once every message given to the sink so far is stored (or its
        failure counted). Called when the dispatcher flushes. The default does
        nothing: :meth:`write` stores before it returns."""

    def write_failures(self) -> tuple[int, int]:
        """``(failed writes, contexts lost in them)`` of messages the sink accepted
        and failed to store later, in the background (added to the dispatcher's
        ``write_errors`` and ``lost``). The default: none."""
        return 0, 0

    async def prepare(self, owner: ConsumerView | ProducerView) -> None:  # noqa: B027 - optional
        """Called when the consumer or producer whose hook writes here starts, before
        any write. The default does nothing."""

    async def aclose(self) -> None:  # noqa: B027 - optional
        """Release resources. The default does nothing."""


class TraceSinkFull(Exception):
    """Raised by :meth:`TraceSink.write_nowait` when the sink cannot take a trace
    message now (its buffer is full): the dispatcher counts the message's contexts as
    dropped, as when its own queue is full, and goes on."""


class FileTraceSink(TraceSink):
    """Appends trace messages to a JSON-lines file, one message per line:
    ``{"topic": ..., "keys": [...], "body": "<RocketMQ-encoded records>"}``.

    ``stagedconsumer trace MSG_ID_OR_KEY --trace-file PATH`` reads it.

    :meth:`write_nowait` (which the dispatcher calls right where a batch of contexts
    fills up) encodes the message's line (the JSON module's C string encoder) and
    appends the bytes to a list; a writer thread of its own, woken once the queued
    lines hold ``batch_size`` trace contexts (default 256), or when the dispatcher
    flushes (every ``flush_interval``, and when the consumer or producer stops), takes
    the whole list and writes it with one ``write`` call: whole lines appended to the
    file (opened once, in append mode), so several sinks, of one process or several,
    may share a file. The thread does no encoding: it holds the interpreter lock only
    to take the list and join it, and not while it writes, so a consumer that keeps
    the lock busy does not hold it back (a thread that encoded under the lock would
    have to win it back after every switch interval, and fell behind a busy no-op
    consumer). When ``queue_size`` contexts (default 16384) wait for the thread, the
    disk is not keeping up: further messages are dropped until it catches up, their
    contexts counted in the dispatcher's ``dropped`` (and the consumer's
    ``trace_records_dropped``). A write that fails (the disk full, the file not
    writable) loses its contexts, counted in the dispatcher's ``write_errors`` and
    ``lost`` and logged; the next batch opens the file again. Ordering guarantee:
    lines are written in the order the messages were given.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        queue_size: int = 16384,
        batch_size: int = 256,
    ) -> None:
        for name, value in (("queue_size", queue_size), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
        self.path = Path(path)
        """The file the JSON lines are appended to."""
        self.queue_size = queue_size
        """Trace contexts waiting for the writer thread, at most, before new ones are
        dropped."""
        self.batch_size = batch_size
        """Trace contexts whose lines are handed to the writer thread together."""
        self._write_errors = 0
        self._lost = 0
        self._last_error_log = -_LOG_EVERY
        self._reset()
        _FILE_SINKS.add(self)

    def _reset(self) -> None:
        """The state both threads share, fresh: guarded by ``_lock`` (``_done`` waits
        on it); ``_wake`` (a C-level queue: waiting and waking take no Python code)
        holds a token for each time the thread was woken."""
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._lines: list[bytes] = []  # encoded lines not taken by the thread yet
        self._line_contexts = 0  # contexts in them
        self._queued_contexts = 0  # contexts given and not written yet (taken or not)
        self._woken = False  # a token is in _wake that the thread has not acted on
        # write_nowait waits on _taken for the thread to take what it queued
        self._taken: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._handing_over = False
        self._given = 0  # messages given to the writer (queued), and written or lost
        self._finished = 0
        self._thread: threading.Thread | None = None
        self._stopping = False

    def _after_fork(self) -> None:
        """In a forked child: no writer thread there, and what the parent queued is
        the parent's to write."""
        self._reset()

    async def prepare(self, owner: ConsumerView | ProducerView) -> None:
        with self._lock:
            if self._thread is None:
                self._start()

    def write_nowait(self, message: TraceMessage) -> bool:
        """Queue ``message``'s line for the writer thread; raises
        :class:`TraceSinkFull` when ``queue_size`` contexts already wait for it.

        Each time the queued lines pass another ``batch_size`` contexts, the thread is
        woken and this call waits until it has taken them, for at most 1 ms: a thread
        waiting for the interpreter lock does not get it while this one takes it back
        after every short release (the event loop's ``epoll`` calls at full speed), so
        this call hands the lock over. At most ``queue_size / batch_size`` such waits
        time out while the disk stalls, before messages are dropped.
        """
        contexts = message.contexts or message.body.count(FIELD_SPLITOR) or 1
        line = (message.to_json() + "\n").encode()
        batch = self.batch_size
        with self._lock:
            if self._queued_contexts >= self.queue_size:
                raise TraceSinkFull(f"{self._queued_contexts} trace contexts wait for {self.path}")
            if self._thread is None:
                self._start()
            self._lines.append(line)
            self._given += 1
            self._queued_contexts += contexts
            before = self._line_contexts
            self._line_contexts = after = before + contexts
            if after < batch or before // batch == after // batch:
                return True
            wake = not self._woken
            self._woken = self._handing_over = True
        if wake:
            self._wake.put(None)
        try:
            self._taken.get(timeout=_HANDOVER_TIMEOUT)
        except queue.Empty:
            with self._lock:
                self._handing_over = False
        return True

    async def write(self, message: TraceMessage) -> None:
        self.write_nowait(message)

    async def flush(self) -> None:
        """Wait until every message given so far is written (or its write failed)."""
        with self._lock:
            target = self._given
            if self._finished >= target or self._thread is None:
                return
        self._wake.put(None)
        await anyio.to_thread.run_sync(self._wait_finished, target, abandon_on_cancel=True)

    async def aclose(self) -> None:
        """Write what is queued, then stop the writer thread (a later write starts
        another)."""
        await self.flush()
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._stopping = True
        self._wake.put(None)
        await anyio.to_thread.run_sync(thread.join, abandon_on_cancel=True)

    def write_failures(self) -> tuple[int, int]:
        with self._lock:
            return self._write_errors, self._lost

    def _wait_finished(self, target: int) -> None:
        with self._done:
            self._done.wait_for(lambda: self._finished >= target or self._thread is None)

    def _start(self) -> None:
        """Start the writer thread (called holding the lock). One runs at a time: only
        the thread itself clears ``_thread``, as it exits."""
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"stagedconsumer trace writer {self.path}", daemon=True
        )
        self._thread.start()

    def _take(self, *, everything: bool) -> tuple[list[bytes], int, bool]:
        """The lines queued (none unless a batch's worth is, without ``everything``),
        their contexts, and whether the thread should stop once they are written."""
        with self._lock:
            lines, contexts = self._lines, self._line_contexts
            if not everything and contexts < self.batch_size and not self._stopping:
                return [], 0, False
            self._lines = []
            self._line_contexts = 0
            self._woken = False
            if self._handing_over:
                self._handing_over = False
                self._taken.put(None)
            return lines, contexts, self._stopping

    def _run(self) -> None:
        """The writer thread: sleeps until woken, then writes everything queued (and
        again while a batch's worth queued up meanwhile)."""
        file: Any = None
        try:
            while True:
                self._wake.get()
                lines, contexts, stopping = self._take(everything=True)
                while lines:
                    file = self._write(file, lines, contexts)
                    lines, contexts, stopping = self._take(everything=False)
                if stopping:
                    return
        finally:
            if file is not None:
                file.close()
            with self._done:
                self._thread = None
                if self._lines:  # given after it last looked, or it died
                    self._start()
                    self._woken = True
                    self._wake.put(None)
                self._done.notify_all()

    def _write(self, file: Any, lines: list[bytes], contexts: int) -> Any:
        """Append ``lines``; returns the file, open (``None`` after a failure: the next
        batch opens it again)."""
        try:
            data = b"".join(lines)
            if file is None:
                file = self.path.open("ab", buffering=0)
            view = memoryview(data)
            while view:  # one write() call, unless the OS takes part of it
                view = view[file.write(view) :]
        except Exception as exc:  # counted and logged; the thread goes on
            if file is not None:
                with contextlib.suppress(OSError):
                    file.close()
            file = None
            with self._lock:
                self._write_errors += 1
                self._lost += contexts
            now = time.monotonic()
            if now - self._last_error_log >= _LOG_EVERY:
                self._last_error_log = now
                logger.warning(
                    "writing %d trace context(s) to %s failed (%d failures so far)",
                    contexts,
                    self.path,
                    self._write_errors,
                    exc_info=exc,
                )
        with self._done:
            self._queued_contexts -= contexts
            self._finished += len(lines)
            self._done.notify_all()
        return file


_FILE_SINKS: weakref.WeakSet[FileTraceSink] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for sink in list(_FILE_SINKS):
        sink._after_fork()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
        """The broker the trace messages are sent to (``None`` until prepared: the
        consumer's or producer's own)."""
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
