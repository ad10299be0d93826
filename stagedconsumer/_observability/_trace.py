"""Message trace after RocketMQ 4.x (``org.apache.rocketmq.client.trace``).

Every handler call produces two trace contexts: ``SubBefore`` when the handler
starts and ``SubAfter`` when the batch was settled, paired by a shared request id.
Both hold one bean per message. Contexts are encoded in RocketMQ's wire format
(fields joined by U+0001, each record ended by U+0002, RocketMQ's field order), so
a RocketMQ trace decoder reads them; our additions (stage index, barrier wait,
cached time, queue position, attempt, settlement) are appended after RocketMQ's
fields, where its decoder ignores them.

Field order written here (``*``: our additions)::

    SubBefore: type, timeStamp, regionId, groupName, requestId, msgId, retryTimes, keys,
               *stageIndex, *barrierWaitMs, *cachedTimeStamp, *topic, *queueId,
               *queueOffset, *attempt, *strategyId, *stageGroupId
    SubAfter:  type, requestId, msgId, costTime, isSuccess, keys, contextCode,
               timeStamp, groupName, *stageIndex, *settlement, *attempt

:class:`AsyncTraceDispatcher` batches contexts off the hot path (RocketMQ's
``AsyncTraceDispatcher`` after apache/rocketmq PR #8430: a bounded queue of 2048,
batches of 10, at most 20, a flush every 5 s) and writes them to a
:class:`TraceSink`: the trace topic of the source (``RMQ_SYS_TRACE_TOPIC``, keyed by
message id and business keys) or a JSON-lines file. Unlike RocketMQ, records
dropped on a full queue are counted in :meth:`AsyncTraceDispatcher.statistics` and
in the consumer's statistics, not only logged.

A retried message (concurrent mode: a new message in the retry queue) is traced
under the id of its first delivery (property ``ORIGIN_MESSAGE_ID``), as RocketMQ
traces retries under the message's unique key.
"""

from __future__ import annotations

import abc
import enum
import inspect
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs

from .._exceptions import ConfigurationError, UnknownTopicError
from .._message import Message
from .._sources._memory import MemoryBroker
from .._sources._source import PROPERTY_ORIGIN_MESSAGE_ID, MessageSource
from ._hooks import ConsumeMessageContext, ConsumeMessageHook, ConsumeReturnType, SettleOutcome
from ._traceparent import without_current_span

if TYPE_CHECKING:
    from ._view import ConsumerView

__all__ = (
    "CONTENT_SPLITOR",
    "FIELD_SPLITOR",
    "RMQ_SYS_TRACE_TOPIC",
    "AsyncTraceDispatcher",
    "ConsumeMessageTraceHook",
    "FileTraceSink",
    "SourceTraceSink",
    "TraceBean",
    "TraceContext",
    "TraceDispatcherStatistics",
    "TraceMessage",
    "TraceSink",
    "TraceType",
    "decode_trace_data",
    "encode_trace_context",
    "query_message_trace",
    "read_trace_file",
    "trace_messages_of",
)

logger = logging.getLogger("stagedconsumer.trace")

CONTENT_SPLITOR = "\u0001"
"""Separates the fields of one record (RocketMQ's ``TraceConstants.CONTENT_SPLITOR``)."""
FIELD_SPLITOR = "\u0002"
"""Ends a record (RocketMQ's ``TraceConstants.FIELD_SPLITOR``)."""
RMQ_SYS_TRACE_TOPIC = "RMQ_SYS_TRACE_TOPIC"
"""RocketMQ's default trace topic (``TopicValidator.RMQ_SYS_TRACE_TOPIC``)."""
DEFAULT_REGION = "DefaultRegion"
PROPERTY_TRACE_SWITCH = "TRACE_ON"
"""A message whose property ``TRACE_ON`` is ``"false"`` is not traced."""
PROPERTY_MSG_REGION = "MSG_REGION"
KEY_SEPARATOR = " "
"""Separates the business keys of one bean (RocketMQ's ``MessageConst.KEY_SEPARATOR``)."""
MAX_MSG_SIZE = 128_000
"""Characters of encoded records per trace message (RocketMQ's ``maxMsgSize``)."""

_LOG_EVERY = 10.0

Encoder = Callable[[Any], tuple[str, Sequence[str]]]
"""Turns a queued item into its encoded records and index keys (see
:meth:`AsyncTraceDispatcher.append_deferred`)."""
_Entry = tuple[Encoder | None, Any]


class TraceType(enum.Enum):
    """RocketMQ's ``TraceType`` (this library writes ``SubBefore`` and ``SubAfter``)."""

    Pub = "Pub"
    Recall = "Recall"
    SubBefore = "SubBefore"
    SubAfter = "SubAfter"
    EndTransaction = "EndTransaction"


@attrs.define(kw_only=True)
class TraceBean:
    """One message of a trace context (RocketMQ's ``TraceBean`` plus our fields)."""

    msg_id: str = ""
    topic: str = ""
    tags: str = ""
    keys: str = ""
    """Business keys joined by a space."""
    store_host: str = ""
    body_length: int = 0
    retry_times: int = 0
    msg_type: int = 0
    offset_msg_id: str = ""
    client_host: str = ""
    # Our additions.
    barrier_wait_ms: int | None = None
    cached_timestamp: int | None = None
    """When the consumer cached the message (ms since the epoch)."""
    queue_id: int | None = None
    queue_offset: int | None = None


@attrs.define(kw_only=True)
class TraceContext:
    """One trace record group (RocketMQ's ``TraceContext`` plus our fields).

    ``timestamp`` is in milliseconds since the epoch: the handler start for
    ``SubBefore``, the handler end for ``SubAfter``. ``cost_time`` is RocketMQ's
    per-message average, ``handler time / batch size`` in ms.
    """

    trace_type: TraceType
    timestamp: int = 0
    region_id: str = ""
    region_name: str = ""
    group_name: str = ""
    cost_time: int = 0
    success: bool = True
    request_id: str = ""
    context_code: int = 0
    beans: list[TraceBean] = attrs.Factory(list)
    # Our additions.
    stage_index: int | None = None
    attempt: int | None = None
    strategy_id: str = ""
    stage_group_id: str = ""
    settlement: str = ""
    """``SubAfter`` only: ``""`` (finished), ``"retry"``, ``"suspend"`` or ``"dlq"``."""


def _clean(value: object) -> str:
    """A field value without separators (RocketMQ does not escape; we drop them)."""
    text = str(value)
    if CONTENT_SPLITOR in text or FIELD_SPLITOR in text:
        text = text.replace(CONTENT_SPLITOR, "").replace(FIELD_SPLITOR, "")
    return text


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)


def _bool(value: bool) -> str:
    return "true" if value else "false"


def encode_trace_context(ctx: TraceContext) -> str:
    """Encode ``ctx`` as RocketMQ's ``TraceDataEncoder.encoderFromContextBean`` does:
    one record per bean for ``SubBefore``/``SubAfter``, plus our appended fields."""
    out: list[str] = []
    j = CONTENT_SPLITOR.join
    if ctx.trace_type is TraceType.SubBefore:
        for bean in ctx.beans:
            fields = [
                "SubBefore",
                ctx.timestamp,
                ctx.region_id,
                ctx.group_name,
                ctx.request_id,
                bean.msg_id,
                bean.retry_times,
                bean.keys,
                _opt(ctx.stage_index),
                _opt(bean.barrier_wait_ms),
                _opt(bean.cached_timestamp),
                bean.topic,
                _opt(bean.queue_id),
                _opt(bean.queue_offset),
                _opt(ctx.attempt),
                ctx.strategy_id,
                ctx.stage_group_id,
            ]
            out.append(j(_clean(f) for f in fields) + FIELD_SPLITOR)
    elif ctx.trace_type is TraceType.SubAfter:
        for bean in ctx.beans:
            fields = [
                "SubAfter",
                ctx.request_id,
                bean.msg_id,
                ctx.cost_time,
                _bool(ctx.success),
                bean.keys,
                ctx.context_code,
                ctx.timestamp,
                ctx.group_name,
                _opt(ctx.stage_index),
                ctx.settlement,
                _opt(ctx.attempt),
            ]
            out.append(j(_clean(f) for f in fields) + FIELD_SPLITOR)
    elif ctx.trace_type is TraceType.Pub:
        for bean in ctx.beans:
            fields = [
                "Pub",
                ctx.timestamp,
                ctx.region_id,
                ctx.group_name,
                bean.topic,
                bean.msg_id,
                bean.tags,
                bean.keys,
                bean.store_host,
                bean.body_length,
                ctx.cost_time,
                bean.msg_type,
                bean.offset_msg_id,
                _bool(ctx.success),
            ]
            out.append(j(_clean(f) for f in fields) + FIELD_SPLITOR)
    else:
        raise ValueError(f"encoding {ctx.trace_type.value} records is not supported")
    return "".join(out)


def _int(value: str, default: int = 0) -> int:
    try:
        return int(value)
    except ValueError:
        return default


def _opt_int(fields: list[str], index: int) -> int | None:
    if len(fields) <= index or fields[index] == "":
        return None
    try:
        return int(fields[index])
    except ValueError:
        return None


def _get(fields: list[str], index: int) -> str:
    return fields[index] if len(fields) > index else ""


def decode_trace_data(data: str) -> list[TraceContext]:
    """Decode a trace message body (RocketMQ's ``decoderFromTraceDataString``).

    Returns one context per record, each with one bean. ``Pub``, ``SubBefore`` and
    ``SubAfter`` records are decoded (RocketMQ's compatibility rules for short and
    long ``Pub``/``SubAfter`` records included); other record types are skipped.
    """
    contexts: list[TraceContext] = []
    for record in data.split(FIELD_SPLITOR):
        if not record:
            continue
        f = record.split(CONTENT_SPLITOR)
        kind = f[0]
        if kind == "SubBefore" and len(f) >= 8:
            contexts.append(
                TraceContext(
                    trace_type=TraceType.SubBefore,
                    timestamp=_int(f[1]),
                    region_id=f[2],
                    group_name=f[3],
                    request_id=f[4],
                    stage_index=_opt_int(f, 8),
                    attempt=_opt_int(f, 14),
                    strategy_id=_get(f, 15),
                    stage_group_id=_get(f, 16),
                    beans=[
                        TraceBean(
                            msg_id=f[5],
                            retry_times=_int(f[6]),
                            keys=f[7],
                            barrier_wait_ms=_opt_int(f, 9),
                            cached_timestamp=_opt_int(f, 10),
                            topic=_get(f, 11),
                            queue_id=_opt_int(f, 12),
                            queue_offset=_opt_int(f, 13),
                        )
                    ],
                )
            )
        elif kind == "SubAfter" and len(f) >= 6:
            contexts.append(
                TraceContext(
                    trace_type=TraceType.SubAfter,
                    request_id=f[1],
                    cost_time=_int(f[3]),
                    success=f[4] == "true",
                    context_code=_int(f[6]) if len(f) >= 7 else 0,
                    timestamp=_int(f[7]) if len(f) >= 9 else 0,
                    group_name=f[8] if len(f) >= 9 else "",
                    stage_index=_opt_int(f, 9),
                    settlement=_get(f, 10),
                    attempt=_opt_int(f, 11),
                    beans=[TraceBean(msg_id=f[2], keys=f[5])],
                )
            )
        elif kind == "Pub" and len(f) >= 13:
            bean = TraceBean(
                topic=f[4],
                msg_id=f[5],
                tags=f[6],
                keys=f[7],
                store_host=f[8],
                body_length=_int(f[9]),
                msg_type=_int(f[11]),
            )
            if len(f) == 13:  # old format: no offsetMsgId, [12] is success
                success = f[12] == "true"
            else:
                bean.offset_msg_id = f[12]
                success = f[13] == "true"
                if len(f) >= 15:
                    bean.client_host = f[14]
            contexts.append(
                TraceContext(
                    trace_type=TraceType.Pub,
                    timestamp=_int(f[1]),
                    region_id=f[2],
                    group_name=f[3],
                    cost_time=_int(f[10]),
                    success=success,
                    beans=[bean],
                )
            )
    return contexts


def trace_keys(contexts: Iterable[TraceContext]) -> list[str]:
    """Keys of a trace message: every bean's message id and business keys
    (RocketMQ's ``TraceTransferBean.transKey``), in first-seen order."""
    keys: dict[str, None] = {}
    for ctx in contexts:
        for bean in ctx.beans:
            if bean.msg_id:
                keys[bean.msg_id] = None
            for key in bean.keys.split(KEY_SEPARATOR):
                if key:
                    keys[key] = None
    return list(keys)


# -- sinks ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TraceMessage:
    """One stored trace message: encoded records and the keys it is indexed by."""

    topic: str
    keys: tuple[str, ...]
    body: str

    @classmethod
    def from_message(cls, message: Message) -> TraceMessage:
        return cls(topic=message.topic, keys=message.keys, body=message.body.decode("utf-8"))

    def to_json(self) -> str:
        return json.dumps({"topic": self.topic, "keys": list(self.keys), "body": self.body})

    @classmethod
    def from_json(cls, line: str) -> TraceMessage:
        data = json.loads(line)
        return cls(topic=str(data["topic"]), keys=tuple(data["keys"]), body=str(data["body"]))


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

    async def prepare(self, consumer: ConsumerView) -> None:  # noqa: B027 - optional
        """Called when the consumer starts, before any write. The default does nothing."""

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

    The source needs a producer method ``send(topic, body, *, keys=...)``, sync (as
    :class:`~stagedconsumer.MemoryBroker` has: batches are then written inline) or
    async (written by the dispatcher's task). A missing trace topic is created with
    one queue through the source's ``create_topic`` (sync or async), as RocketMQ's
    broker creates it with one queue. With ``source=None`` the consumer's source is
    used.
    """

    def __init__(self, source: MessageSource | None = None) -> None:
        self.source = source
        self._sync_send = False
        # The embedded broker's own trace path (same stored message as send(), without
        # a traceparent), unless a subclass changed send().
        self._send_trace: Callable[[str, bytes, tuple[str, ...]], Message] | None = None

    async def prepare(self, consumer: ConsumerView) -> None:
        if self.source is None:
            self.source = consumer.source
        send = getattr(self.source, "send", None)
        if not callable(send):
            raise ConfigurationError(
                f"{type(self.source).__name__} has no send(); message trace needs a source"
                " it can write the trace topic to, or a FileTraceSink"
            )
        self._sync_send = not inspect.iscoroutinefunction(send)
        source = self.source
        if isinstance(source, MemoryBroker) and type(source).send is MemoryBroker.send:
            self._send_trace = source._send_trace

    def write_nowait(self, message: TraceMessage) -> bool:
        """Sends at once when the source's ``send`` is synchronous (the embedded
        broker appends to memory)."""
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


@attrs.frozen(kw_only=True)
class TraceDispatcherStatistics:
    """A snapshot of an :class:`AsyncTraceDispatcher`."""

    queued: int
    """Contexts waiting to be written."""
    appended: int
    """Contexts accepted since creation."""
    dropped: int
    """Contexts dropped because the queue was full (RocketMQ only logs these)."""
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
        self.sink = sink
        self.trace_topic = trace_topic
        self.queue_size = queue_size
        self.batch_num = min(batch_num, 20)
        self.flush_interval = flush_interval
        self.max_msg_size = max_msg_size
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
            self._dropped += 1
            now = time.monotonic()
            if now - self._last_drop_log >= _LOG_EVERY:
                self._last_drop_log = now
                logger.warning(
                    "trace buffer full (%d contexts): dropped %d so far",
                    self.queue_size,
                    self._dropped,
                )
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
                last_flush = anyio.current_time()

    async def flush(self) -> None:
        """Write everything queued now."""
        await self._write_batches(everything=True)

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
            return [(len(parts), self._message(parts, all_keys))]
        out: list[tuple[int, TraceMessage]] = []
        parts = []
        keys: list[str] = []
        size = 0
        for data, data_keys in encoded:
            parts.append(data)
            keys.extend(data_keys)
            size += len(data)
            if size >= self.max_msg_size:
                out.append((len(parts), self._message(parts, keys)))
                parts, keys, size = [], [], 0
        if parts:
            out.append((len(parts), self._message(parts, keys)))
        return out

    def _message(self, parts: list[str], keys: list[str]) -> TraceMessage:
        """One trace message, keyed by each distinct key once, in first-seen order."""
        return TraceMessage(
            topic=self.trace_topic, keys=tuple(dict.fromkeys(keys)), body="".join(parts)
        )

    def _send_nowait(self, batch: list[_Entry]) -> bool:
        """Write ``batch`` through the sink's synchronous path; ``False`` (with the
        batch put back in front of the queue) when the sink declined."""
        encoded = self._encode(batch)
        for i, (count, message) in enumerate(self._messages(encoded)):
            try:
                written = self.sink.write_nowait(message)
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
        return TraceDispatcherStatistics(
            queued=len(self._queue),
            appended=self._appended,
            dropped=self._dropped,
            written=self._written,
            messages=self._messages_written,
            write_errors=self._write_errors,
            lost=self._lost,
        )


# -- the hook ------------------------------------------------------------------------------

_PROPS_KEY = "stagedconsumer.trace.before"
_SETTLEMENT_ORDER = (SettleOutcome.DLQ, SettleOutcome.RETRY, SettleOutcome.SUSPEND)
_CODES: dict[ConsumeReturnType | None, int] = {None: 0, **{t: t.value for t in ConsumeReturnType}}
_SUCCESS = ConsumeReturnType.SUCCESS


_S = CONTENT_SPLITOR
_E = FIELD_SPLITOR
_HEX2 = tuple(f"{i:02X}" for i in range(256))


def _c(text: str) -> str:
    """``text`` without separators (fast when there are none, the normal case)."""
    if _S in text or _E in text:
        return text.replace(_S, "").replace(_E, "")
    return text


def _trace_id(message: Message) -> str:
    return message.properties.get(PROPERTY_ORIGIN_MESSAGE_ID) or message.msg_id


class ConsumeMessageTraceHook(ConsumeMessageHook):
    """Message trace: ``SubBefore``/``SubAfter`` records of every handler call.

    RocketMQ's ``ConsumeMessageTraceHookImpl``; enable it with::

        consumer.register_consume_message_hook(ConsumeMessageTraceHook())  # trace topic
        consumer.register_consume_message_hook(
            ConsumeMessageTraceHook(FileTraceSink("trace.jsonl"))  # or a file
        )

    The default sink is :class:`SourceTraceSink` on the consumer's source (trace
    topic ``trace_topic``, default ``RMQ_SYS_TRACE_TOPIC``). The dispatcher task
    runs in the consumer's task group and is flushed when the consumer stops (for
    at most ``shutdown_timeout`` seconds, default 5).
    Messages with property ``TRACE_ON=false`` are not traced.

    The hook methods only queue the hook context (one ``deque.append`` each); its
    records are encoded when their batch is written, so the queue holds up to
    ``queue_size`` contexts, with their messages, until then. A call whose
    ``SubBefore`` was dropped on a full queue still gets its ``SubAfter`` (with a
    request id of its own) if that one fits.
    """

    def __init__(
        self,
        sink: TraceSink | None = None,
        *,
        trace_topic: str = RMQ_SYS_TRACE_TOPIC,
        queue_size: int = 2048,
        batch_num: int = 10,
        flush_interval: float = 5.0,
        region_id: str = DEFAULT_REGION,
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
        self._props_key = f"{_PROPS_KEY}.{id(self):x}"  # several trace hooks may share a call
        self._request_prefix = f"{os.getpid():08X}{id(self) & 0xFFFFFFFF:08X}"
        # Request ids are the prefix and a 16-digit hex sequence number; the first 14
        # digits change every 256 calls (see _next_request_id).
        self._request_seq = 0
        self._request_head = ""
        # Bound once: the hook methods queue them with every call.
        self._before_encoder: Encoder = self._encode_before
        self._after_encoder: Encoder = self._encode_after
        # Encoded fields that repeat from call to call, per (region, group, stage key).
        self._static: dict[tuple[object, ...], tuple[str, str, str]] = {}
        self._topic = ""  # the topic of the last one-message call, and its encoded text
        self._topic_text = ""

    @property
    def hook_name(self) -> str:
        return "ConsumeMessageTraceHook"

    def statistics(self) -> TraceDispatcherStatistics:
        return self.dispatcher.statistics()

    @property
    def records_dropped(self) -> int:
        """Trace contexts dropped on a full dispatcher queue."""
        return self.dispatcher.statistics().dropped

    # The hot path (the two hook methods) only queues the hook context: the records
    # are encoded when their batch is written (AsyncTraceDispatcher.append_deferred),
    # by _encode_before / _encode_after, straight from the context (the layout of
    # encode_trace_context, which the tests hold them to; building TraceBean and
    # TraceContext objects per message would cost more than a fast handler call).
    # Both encoders read only fields that are final when they are queued.

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        messages = context.messages
        if len(messages) == 1:
            props = messages[0].properties
            if props and props.get(PROPERTY_TRACE_SWITCH) == "false":
                return
        else:
            for message in messages:
                props = message.properties
                if not props or props.get(PROPERTY_TRACE_SWITCH) != "false":
                    break
            else:
                return  # no message of the call is traced
        context.props[self._props_key] = None  # traced; filled in by _encode_before
        self.dispatcher.append_deferred(self._before_encoder, context)

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        if self._props_key in context.props:
            self.dispatcher.append_deferred(self._after_encoder, context)

    def _next_request_id(self) -> str:
        """``f"{prefix}{seq:016X}"``, with the last two digits from a table."""
        seq = self._request_seq
        self._request_seq = seq + 1
        low = seq & 0xFF
        if not low:
            self._request_head = f"{self._request_prefix}{seq >> 8:014X}"
        return self._request_head + _HEX2[low]

    def _encode_before(self, context: ConsumeMessageContext) -> tuple[str, Sequence[str]]:
        """The ``SubBefore`` records of a call and its index keys; keeps what its
        ``SubAfter`` records share with them in ``context.props``:
        ``(request_id, keys, group_stage, msg_id, key_text, beans)``, where ``beans``
        is ``None`` for a call of one message (``msg_id``/``key_text`` are its bean)
        and the list of ``(msg_id, key_text)`` otherwise."""
        messages = context.messages
        if len(messages) != 1:
            return self._encode_before_many(context)
        # One message (the usual call): one record, built in one f-string.
        message = messages[0]
        props = message.properties
        msg_id = message.msg_id
        region = ""
        if props:
            # Traced: a call is queued only when one of its messages is traced.
            region = props.get(PROPERTY_MSG_REGION, "")
            msg_id = props.get(PROPERTY_ORIGIN_MESSAGE_ID) or msg_id
        if _S in msg_id or _E in msg_id:
            msg_id = _c(msg_id)
        stage = context.stage_index
        static = self._static.get(
            (region, context.consumer_group, context.strategy_id, context.group_id, stage)
        ) or self._static_text(context, region)
        topic = message.topic
        if topic is not self._topic:
            self._topic = topic
            self._topic_text = _c(topic)
        keys: tuple[str, ...]
        if message.keys:
            key_text = _c(KEY_SEPARATOR.join(message.keys))
            keys = (msg_id, *key_text.split(KEY_SEPARATOR))
        else:
            key_text = ""
            keys = (msg_id,)
        wall = context.wall_offset
        opened = context.runnable_at
        cached = context.cached_times[0]
        request_id = self._next_request_id()
        context.props[self._props_key] = (request_id, keys, static[2], msg_id, key_text, None)
        return (
            f"SubBefore{_S}{round((context.start_time + wall) * 1000)}{static[0]}{request_id}"
            f"{_S}{msg_id}{_S}{message.reconsume_times}{_S}{key_text}{_S}{stage}"
            f"{_S}{round((opened - cached) * 1000) if opened > cached else 0}"
            f"{_S}{round((cached + wall) * 1000)}{_S}{self._topic_text}{_S}{message.queue_id}"
            f"{_S}{message.queue_offset}{_S}{context.attempt}{static[1]}"
        ), keys

    def _static_text(self, context: ConsumeMessageContext, region: str) -> tuple[str, str, str]:
        """Encoded fields that repeat from call to call: the part of ``SubBefore``
        after its timestamp up to the request id, its tail after the attempt, and the
        part of ``SubAfter`` after its timestamp up to the settlement."""
        group = context.consumer_group
        stage = context.stage_index
        static_key = (region, group, context.strategy_id, context.group_id, stage)
        static = self._static.get(static_key)
        if static is None:
            if len(self._static) >= 4096:  # group ids may be per key: stay bounded
                self._static.clear()
            static = self._static[static_key] = (
                f"{_S}{_c(region or self.region_id)}{_S}{_c(group)}{_S}",
                f"{_S}{_c(context.strategy_id or '')}{_S}{_c(context.group_id or '')}{_E}",
                f"{_S}{_c(group)}{_S}{stage}{_S}",
            )
        return static

    def _encode_before_many(self, context: ConsumeMessageContext) -> tuple[str, list[str]]:
        """:meth:`_encode_before` of a call of several messages."""
        messages = context.messages
        region = ""
        for message in messages:
            props = message.properties
            if props and props.get(PROPERTY_TRACE_SWITCH) != "false":
                region = props.get(PROPERTY_MSG_REGION, "")
                break
        stage = context.stage_index
        static = self._static_text(context, region)
        wall = context.wall_offset
        opened = context.runnable_at
        request_id = self._next_request_id()
        head = f"SubBefore{_S}{round((context.start_time + wall) * 1000)}{static[0]}{request_id}"
        tail = f"{_S}{context.attempt}{static[1]}"
        topic = ""
        topic_text = ""
        beans: list[tuple[str, str]] = []
        records: list[str] = []
        keys: list[str] = []
        for message, cached in zip(messages, context.cached_times):  # noqa: B905
            props = message.properties
            msg_id = message.msg_id
            if props:
                if props.get(PROPERTY_TRACE_SWITCH) == "false":
                    continue
                msg_id = props.get(PROPERTY_ORIGIN_MESSAGE_ID) or msg_id
            if _S in msg_id or _E in msg_id:
                msg_id = _c(msg_id)
            if message.topic is not topic:
                topic = message.topic
                topic_text = _c(topic)
            if message.keys:
                key_text = _c(KEY_SEPARATOR.join(message.keys))
                keys.append(msg_id)
                keys.extend(key_text.split(KEY_SEPARATOR))
            else:
                key_text = ""
                keys.append(msg_id)
            records.append(
                f"{head}{_S}{msg_id}{_S}{message.reconsume_times}{_S}{key_text}{_S}{stage}"
                f"{_S}{round((opened - cached) * 1000) if opened > cached else 0}"
                f"{_S}{round((cached + wall) * 1000)}{_S}{topic_text}{_S}{message.queue_id}"
                f"{_S}{message.queue_offset}{tail}"
            )
            beans.append((msg_id, key_text))
        context.props[self._props_key] = (request_id, keys, static[2], "", "", beans)
        return "".join(records), keys

    def _encode_after(self, context: ConsumeMessageContext) -> tuple[str, Sequence[str]]:
        """The ``SubAfter`` records of a call and its index keys."""
        before = context.props.get(self._props_key)
        if before is None:  # its SubBefore was dropped: share the same request id
            self._encode_before(context)
            before = context.props[self._props_key]
        request_id, keys, group_stage, msg_id, key_text, beans = before
        settled = context.settled
        settlement = ""
        if settled:
            for outcome in _SETTLEMENT_ORDER:
                if outcome in settled:
                    settlement = outcome.value
                    break
        end = context.end_time
        # RocketMQ's per-message average: int(max(0, handler ms) / max(1, batch size)).
        took = end - context.start_time
        count = len(context.messages)
        if not took > 0.0:
            cost = 0
        elif count > 1:
            cost = int(took * 1000 / count)
        else:
            cost = int(took * 1000)
        success = "true" if context.success else "false"
        status = context.status
        # (Hashing an enum member runs Python code: skip it for the usual status.)
        code = 0 if status is _SUCCESS else _CODES[status]
        if beans is None:
            return (
                f"SubAfter{_S}{request_id}{_S}{msg_id}{_S}{cost}{_S}{success}{_S}{key_text}"
                f"{_S}{code}{_S}{round((end + context.wall_offset) * 1000)}"
                f"{group_stage}{settlement}{_S}{context.attempt}{_E}"
            ), keys
        tail = (
            f"{_S}{code}{_S}{round((end + context.wall_offset) * 1000)}"
            f"{group_stage}{settlement}{_S}{context.attempt}{_E}"
        )
        head = f"SubAfter{_S}{request_id}{_S}"
        data = "".join(
            [
                f"{head}{msg_id}{_S}{cost}{_S}{success}{_S}{key_text}{tail}"
                for msg_id, key_text in beans
            ]
        )
        return data, keys

    async def run(
        self,
        consumer: ConsumerView,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        await self.dispatcher.sink.prepare(consumer)
        await self.dispatcher.run(task_status=task_status)

    async def aclose(self) -> None:
        await self.dispatcher.aclose(self.shutdown_timeout)
        await self.dispatcher.sink.aclose()


# -- reading traces back -------------------------------------------------------------


def read_trace_file(path: str | os.PathLike[str]) -> Iterator[TraceMessage]:
    """The trace messages of a :class:`FileTraceSink` file (blank lines skipped)."""
    with Path(path).open(encoding="utf-8") as file:
        for line in file:
            if line.strip():
                yield TraceMessage.from_json(line)


def trace_messages_of(source: Any, topic: str = RMQ_SYS_TRACE_TOPIC) -> Iterator[TraceMessage]:
    """The trace messages stored in ``topic`` of a :class:`~stagedconsumer.MemoryBroker`."""
    try:
        count = source.statistics().topics.get(topic, 0)
    except AttributeError as exc:
        raise ConfigurationError(
            f"cannot read trace messages from {type(source).__name__}"
        ) from exc
    for queue_id in range(count):
        for message in source.messages(topic, queue_id):
            yield TraceMessage.from_message(message)


def query_message_trace(messages: Iterable[TraceMessage], key: str) -> list[TraceContext]:
    """The trace contexts of the message whose id or business key is ``key``.

    Uses the key index first (a trace message is keyed by every message id and
    business key it holds), then keeps only records of matching beans, as
    RocketMQ's ``TraceView`` does for ids; matching by business key is our
    addition. Returned in the order stored.
    """
    found: list[TraceContext] = []
    for message in messages:
        if key not in message.keys:
            continue
        for ctx in decode_trace_data(message.body):
            bean = ctx.beans[0]
            if bean.msg_id == key or key in bean.keys.split(KEY_SEPARATOR):
                found.append(ctx)
    return found
