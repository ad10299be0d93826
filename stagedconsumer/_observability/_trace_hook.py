"""The message trace hook: ``SubBefore``/``SubAfter`` records of every handler call
(RocketMQ's ``ConsumeMessageTraceHookImpl``).

Its encoders write the layout of :func:`~._trace_codec.encode_trace_context`
straight from the hook context (``tests/trace/test_trace_fast_path.py`` holds them
to it byte for byte). A retried message (concurrent mode: a new copy in the retry
queue) keeps its ``msg_id``, the id its records carry, as RocketMQ traces retries
under the message's unique key (property ``ORIGIN_MESSAGE_ID`` is read first, so a
retry stored while retries got a new ``msg_id`` is still traced under its first
delivery's); its record's queue position (``topic``, ``queueId``, ``queueOffset``) is where it
was pulled from, the retry queue ``%RETRY%<group>`` (the consumer gives the message
back its first topic, ``RETRY_TOPIC``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from .._sources._source import PROPERTY_ORIGIN_MESSAGE_ID
from ._hooks import ConsumeMessageContext, ConsumeMessageHook, ConsumeReturnType, SettleOutcome
from ._trace_codec import (
    CONTENT_SPLITOR,
    DEFAULT_REGION,
    FIELD_SPLITOR,
    KEY_SEPARATOR,
    PROPERTY_MSG_REGION,
    PROPERTY_TRACE_SWITCH,
    RMQ_SYS_TRACE_TOPIC,
)
from ._trace_dispatcher import Encoder
from ._trace_hook_base import DispatchingTraceHook, clean_field
from ._trace_sinks import TraceSink

if TYPE_CHECKING:
    from ._view import ConsumerView

__all__ = ("ConsumeMessageTraceHook",)

_PROPS_KEY = "stagedconsumer.trace.before"
_SETTLEMENT_ORDER = (SettleOutcome.DLQ, SettleOutcome.RETRY, SettleOutcome.SUSPEND)
_CODES: dict[ConsumeReturnType | None, int] = {None: 0, **{t: t.value for t in ConsumeReturnType}}
_SUCCESS = ConsumeReturnType.SUCCESS


_S = CONTENT_SPLITOR
_E = FIELD_SPLITOR
_HEX2 = tuple(f"{i:02X}" for i in range(256))


_c = clean_field


class ConsumeMessageTraceHook(DispatchingTraceHook, ConsumeMessageHook):
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
        super().__init__(
            sink,
            trace_topic=trace_topic,
            queue_size=queue_size,
            batch_num=batch_num,
            flush_interval=flush_interval,
            region_id=region_id,
            shutdown_timeout=shutdown_timeout,
        )
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
        topic = context.message_queue.topic  # %RETRY%<group> for a retried message
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
        topic_text = _c(context.message_queue.topic)
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
