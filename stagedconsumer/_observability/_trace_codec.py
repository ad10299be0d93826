"""Message trace records in RocketMQ's format (``org.apache.rocketmq.client.trace``).

Every send of a producer produces a ``Pub`` context, with one bean per message sent.
Every handler call produces two trace contexts: ``SubBefore`` when the handler
starts and ``SubAfter`` when the batch was settled, paired by a shared request id.
Both hold one bean per message. Contexts are encoded in RocketMQ's wire format
(fields joined by U+0001, each record ended by U+0002, RocketMQ's field order), so
a RocketMQ trace decoder reads them; our additions (stage index, barrier wait,
cached time, queue position, attempt, settlement) are appended after RocketMQ's
fields, where its decoder ignores them.

Field order written here (``*``: our additions)::

    Pub:       type, timeStamp, regionId, groupName, topic, msgId, tags, keys,
               storeHost, bodyLength, costTime, msgType, offsetMsgId, isSuccess,
               clientHost, *queueId, *queueOffset, *attempt
    SubBefore: type, timeStamp, regionId, groupName, requestId, msgId, retryTimes, keys,
               *stageIndex, *barrierWaitMs, *cachedTimeStamp, *topic, *queueId,
               *queueOffset, *attempt, *strategyId, *stageGroupId
    SubAfter:  type, requestId, msgId, costTime, isSuccess, keys, contextCode,
               timeStamp, groupName, *stageIndex, *settlement, *attempt

The ``SubBefore`` queue position (``*topic``, ``*queueId``, ``*queueOffset``) is the
queue the message was pulled from: ``%RETRY%<group>`` for a message retried through
the retry queue (traced under its first delivery's ``msgId``).

A ``Pub`` record has RocketMQ's 14 fields, then ``clientHost``: RocketMQ's decoder
reads a 15th field (and only that one past the 14) as the bean's ``clientHost``
(a field of its older encoders), so it comes before our additions. One ``Pub``
record is written per message (RocketMQ writes one per send call; its batch is one
message there).

A :class:`TraceMessage` is what is stored: the encoded records of several contexts
and the keys (message ids and business keys) it is indexed by.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable

import attrs

from .._message import Message

__all__ = (
    "CONTENT_SPLITOR",
    "DEFAULT_REGION",
    "FIELD_SPLITOR",
    "KEY_SEPARATOR",
    "MAX_MSG_SIZE",
    "PROPERTY_MSG_REGION",
    "PROPERTY_TRACE_SWITCH",
    "RMQ_SYS_TRACE_TOPIC",
    "TraceBean",
    "TraceContext",
    "TraceMessage",
    "TraceType",
    "decode_trace_data",
    "encode_trace_context",
    "trace_keys",
)

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


class TraceType(enum.Enum):
    """RocketMQ's ``TraceType`` (this library writes ``Pub``, ``SubBefore`` and
    ``SubAfter``)."""

    Pub = "Pub"
    """A producer's send (one record per message sent)."""
    Recall = "Recall"
    """RocketMQ 5's recall of a scheduled message (never written here)."""
    SubBefore = "SubBefore"
    """A consumer call's start (one record per call, a bean per message)."""
    SubAfter = "SubAfter"
    """A consumer call's end, with its cost and settlement."""
    EndTransaction = "EndTransaction"
    """RocketMQ's transactional message end (never written here)."""


@attrs.define(kw_only=True)
class TraceBean:
    """One message of a trace context (RocketMQ's ``TraceBean`` plus our fields)."""

    msg_id: str = ""
    """The message id (RocketMQ's ``UNIQ_KEY``, stable across retries)."""
    topic: str = ""
    """The topic the message was sent to or pulled from."""
    tags: str = ""
    """The message's tag (``""`` when it has none)."""
    keys: str = ""
    """Business keys joined by a space."""
    store_host: str = ""
    """``Pub``: where the message was stored (see ``MessageSource.store_host``)."""
    body_length: int = 0
    """The body's size in bytes."""
    retry_times: int = 0
    """How many times the message was consumed before (``reconsume_times``)."""
    msg_type: int = 0
    """``Pub``: RocketMQ's ``MessageType`` ordinal (0 ``Normal_Msg``, 1
    ``Trans_Msg_Half``, 2 ``Trans_msg_Commit``, 3 ``Delay_Msg``, 4 ``Order_Msg``)."""
    offset_msg_id: str = ""
    """The id of the stored entry (RocketMQ's ``offsetMsgId``; a Redis entry id)."""
    client_host: str = ""
    """``Pub``: the producer's host."""
    # Our additions.
    barrier_wait_ms: int | None = None
    """``SubBefore``: how long the message waited at a stage barrier, in ms."""
    cached_timestamp: int | None = None
    """When the consumer cached the message (ms since the epoch)."""
    queue_id: int | None = None
    """``SubBefore``: the queue the message was pulled from; ``Pub``: the queue it
    was stored in (with ``queue_offset``)."""
    queue_offset: int | None = None
    """The message's offset in its queue."""


@attrs.define(kw_only=True)
class TraceContext:
    """One trace record group (RocketMQ's ``TraceContext`` plus our fields).

    ``timestamp`` is in milliseconds since the epoch: the handler start for
    ``SubBefore``, the handler end for ``SubAfter``, the start of the send call for
    ``Pub``. ``cost_time`` is RocketMQ's per-message average, ``handler time / batch
    size`` in ms, for ``SubAfter``; the send call's time in ms for ``Pub`` (retries
    included).
    """

    trace_type: TraceType
    """Which kind of record this is."""
    timestamp: int = 0
    """Milliseconds since the epoch (see the class docstring for which instant)."""
    region_id: str = ""
    """RocketMQ's region id (``""`` outside RocketMQ's cloud)."""
    region_name: str = ""
    """RocketMQ's region name."""
    group_name: str = ""
    """The consumer group (``Sub*``) or producer group (``Pub``)."""
    cost_time: int = 0
    """Milliseconds (see the class docstring)."""
    success: bool = True
    """Whether the send or the consumer call succeeded."""
    request_id: str = ""
    """Pairs a ``SubBefore`` with its ``SubAfter``."""
    context_code: int = 0
    """``SubAfter``: RocketMQ's ``ConsumeReturnType`` ordinal."""
    beans: list[TraceBean] = attrs.Factory(list)
    """One bean per message of the send or the call."""
    # Our additions.
    stage_index: int | None = None
    """Staged calls: the stage the messages ran in (``-1`` for the tail)."""
    attempt: int | None = None
    """``SubBefore``/``SubAfter``: the delivery attempt; ``Pub``: the send attempts
    the call made (1, plus one per retry)."""
    strategy_id: str = ""
    """Staged calls: the stage key's strategy."""
    stage_group_id: str = ""
    """Staged calls: the stage key's group."""
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
    one record per bean (RocketMQ encodes only the first bean of a ``Pub``
    context), plus our appended fields."""
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
                bean.client_host,
                _opt(bean.queue_id),
                _opt(bean.queue_offset),
                _opt(ctx.attempt),
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
                    bean.queue_id = _opt_int(f, 15)
                    bean.queue_offset = _opt_int(f, 16)
            contexts.append(
                TraceContext(
                    trace_type=TraceType.Pub,
                    timestamp=_int(f[1]),
                    region_id=f[2],
                    group_name=f[3],
                    cost_time=_int(f[10]),
                    success=success,
                    attempt=_opt_int(f, 17),
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


@attrs.frozen(kw_only=True)
class TraceMessage:
    """One stored trace message: encoded records and the keys it is indexed by."""

    topic: str
    """The trace topic (``RMQ_SYS_TRACE_TOPIC`` by default)."""
    keys: tuple[str, ...]
    """The keys a trace query finds it by: message ids and business keys."""
    body: str
    """The encoded records, in RocketMQ's format."""
    contexts: int = attrs.field(default=0, eq=False, repr=False)
    """How many trace contexts its records come from, when the dispatcher made it
    (0: not known); not stored."""

    @classmethod
    def from_message(cls, message: Message) -> TraceMessage:
        """The trace message stored as *message* in a trace topic."""
        return cls(topic=message.topic, keys=message.keys, body=message.body.decode("utf-8"))

    def to_json(self) -> str:
        """One JSON line, as `FileTraceSink` writes it."""
        return json.dumps({"topic": self.topic, "keys": list(self.keys), "body": self.body})

    @classmethod
    def from_json(cls, line: str) -> TraceMessage:
        """The trace message of a line `to_json` wrote."""
        data = json.loads(line)
        return cls(topic=str(data["topic"]), keys=tuple(data["keys"]), body=str(data["body"]))
