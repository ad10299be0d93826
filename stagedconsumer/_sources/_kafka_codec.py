"""How the Kafka broker maps messages and names onto Kafka records and topics.

A record's key is the message's first key; its headers carry the tags (``TAGS``),
further keys (``KEYS``, a JSON list), the reconsume count of a retried message
(``RECONSUME_TIMES``), when a retried message is due (``DELAY_UNTIL``, ms since the
epoch) and every property under its own name. A record's timestamp is the message's
born time; its message id is ``<topic>-<partition>@<offset>`` (Kafka has none). A
record with a null value (a tombstone) is a message with an empty body and the
property ``TOMBSTONE=true``.

Progress goes into the offset commit: the committed offset is the consume offset, the
commit's metadata string the stage offsets (:func:`encode_metadata`).

Pure functions; nothing here talks to Kafka.
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from offsetstore import QueueProgress, StageKey
from offsetstore._types import decode_finished, encode_finished

from .._message import EMPTY_PROPERTIES, Message, OutgoingMessage, _MessageFields
from ._source import (
    DLQ_PREFIX,
    PROPERTY_DECODE_ERROR,
    PROPERTY_ORIGIN_MESSAGE_ID,
    PROPERTY_POISON_ENTRY_ID,
    PROPERTY_POISON_STREAM,
    PROPERTY_RETRY_TOPIC,
    PROPERTY_TOMBSTONE,
    RETRY_PREFIX,
    UndecodableEntry,
)

__all__ = (
    "HEADER_DELAY_UNTIL",
    "HEADER_KEYS",
    "HEADER_RECONSUME_TIMES",
    "HEADER_TAGS",
    "METADATA_LIMIT",
    "decode_metadata",
    "decode_records",
    "encode_headers",
    "decode_progress",
    "encode_metadata",
    "encode_progress",
    "poison_entry",
)

HEADER_TAGS = "TAGS"
HEADER_KEYS = "KEYS"
HEADER_RECONSUME_TIMES = "RECONSUME_TIMES"
HEADER_DELAY_UNTIL = "DELAY_UNTIL"
_RESERVED = frozenset({HEADER_TAGS, HEADER_KEYS, HEADER_RECONSUME_TIMES, HEADER_DELAY_UNTIL})

METADATA_LIMIT = 4096
"""Kafka's default ``offset.metadata.max.bytes``: a commit with longer metadata is
refused by the broker."""

_METADATA_JSON = "sc1:"
_METADATA_ZLIB = "sc1z:"
_PROGRESS_TEXT = "sc2:"
_PROGRESS_ZLIB = "sc2z:"

_LEGAL = re.compile(r"[^A-Za-z0-9._-]")


def _legal(name: str) -> str:
    return _LEGAL.sub("_", name)


class TopicNames:
    """The Kafka topic of each topic name the consumer sees, and back.

    Topics keep their names. Kafka topic names allow only ``[A-Za-z0-9._-]``, so a
    group's retry topic ``%RETRY%<group>`` is ``<retry_prefix><group>`` and its
    dead-letter topic ``%DLQ%<group>`` is ``<dlq_prefix><group>`` (other characters
    of the group name become ``_``).
    """

    def __init__(self, retry_prefix: str, dlq_prefix: str) -> None:
        self.retry_prefix = retry_prefix
        self.dlq_prefix = dlq_prefix
        self._back: dict[str, str] = {}

    def kafka(self, topic: str) -> str:
        if topic.startswith(RETRY_PREFIX):
            name = self.retry_prefix + _legal(topic[len(RETRY_PREFIX) :])
        elif topic.startswith(DLQ_PREFIX):
            name = self.dlq_prefix + _legal(topic[len(DLQ_PREFIX) :])
        else:
            return topic
        self._back[name] = topic
        return name

    def ours(self, kafka_topic: str) -> str:
        return self._back.get(kafka_topic, kafka_topic)


def encode_headers(
    message: OutgoingMessage | Message,
    properties: Mapping[str, str],
    *,
    reconsume_times: int = 0,
    delay_until_ms: int | None = None,
) -> tuple[bytes | None, list[tuple[str, bytes]]]:
    """The record key and headers of ``message`` with ``properties``."""
    keys = message.keys
    key = keys[0].encode() if keys else None
    headers = [(name, value.encode()) for name, value in properties.items()]
    if message.tags is not None:
        headers.append((HEADER_TAGS, message.tags.encode()))
    if len(keys) > 1:
        headers.append((HEADER_KEYS, json.dumps(list(keys)).encode()))
    if reconsume_times:
        headers.append((HEADER_RECONSUME_TIMES, b"%d" % reconsume_times))
    if delay_until_ms is not None:
        headers.append((HEADER_DELAY_UNTIL, b"%d" % delay_until_ms))
    return key, headers


def delay_until_ms(record: Any) -> int | None:
    """When a retried record is due (``DELAY_UNTIL``), or ``None``."""
    for name, value in record.headers or ():
        if name == HEADER_DELAY_UNTIL:
            return int(value)
    return None


_KEYS: dict[bytes, tuple[str]] = {}
"""The ``keys`` tuple of each record key seen lately, shared by the messages of that
key: one allocation (and one object for the garbage collector to track) less per
message. Cleared when it passes ``_KEYS_MAX`` keys."""
_KEYS_MAX = 8192


def decode_records(
    topic: str,
    partition: int,
    kafka_topic: str,
    records: Iterable[Any],
    bad: list[tuple[Any, Exception]] | None = None,
) -> list[Message]:
    """``records`` (aiokafka ``ConsumerRecord``\\ s of one partition) as messages of
    queue ``topic#partition``. Records of a retry topic get back the topic they were
    first sent to (``RETRY_TOPIC``). Built as ``_MessageFields`` made ``Message``\\ s
    (see there): the hot path of every pull. A record whose reserved headers cannot
    be read (``KEYS`` not a JSON list of strings, ``RECONSUME_TIMES`` not an int:
    a poison record) is left out and added to ``bad`` with the error."""
    out: list[Message] = []
    append = out.append
    is_retry = topic.startswith(RETRY_PREFIX)
    prefix = f"{kafka_topic}-{partition}@"
    empty = EMPTY_PROPERTIES
    keys_of = _KEYS
    if len(keys_of) > _KEYS_MAX:
        keys_of.clear()
    for record in records:
        m = _MessageFields()
        offset = record.offset
        m.topic = topic
        m.queue_id = partition
        m.queue_offset = offset
        value = record.value
        m.body = b"" if value is None else value  # (None: a tombstone, marked below)
        key = record.key
        if key is None:
            m.keys = ()
        else:
            keys = keys_of.get(key)
            if keys is None:
                keys = keys_of[key] = (key.decode("utf-8", "replace"),)
            m.keys = keys
        m.tags = None
        m.reconsume_times = 0
        m.msg_id = m.offset_msg_id = prefix + str(offset)
        timestamp = record.timestamp
        m.born_timestamp = 0.0 if timestamp is None else timestamp / 1000
        headers = record.headers
        if headers:
            try:
                _set_headers(m, headers, is_retry)
            except (ValueError, TypeError) as exc:
                if bad is None:
                    raise
                bad.append((record, exc))
                continue
        else:
            m.properties = empty
        if value is None:
            m.properties = MappingProxyType({**m.properties, PROPERTY_TOMBSTONE: "true"})
        m.__class__ = Message
        append(m)  # type: ignore[arg-type]
    return out


def _set_headers(m: _MessageFields, headers: Sequence[tuple[str, bytes]], is_retry: bool) -> None:
    properties: dict[str, str] = {}
    for name, raw in headers:
        text = raw.decode("utf-8", "replace") if raw is not None else ""
        if name in _RESERVED:
            if name == HEADER_TAGS:
                m.tags = text
            elif name == HEADER_KEYS:
                keys = json.loads(text)
                if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                    raise ValueError(f"header KEYS is not a JSON list of strings: {text[:100]!r}")
                m.keys = tuple(keys)
            elif name == HEADER_RECONSUME_TIMES:
                m.reconsume_times = int(text)
        else:
            properties[name] = text
    m.properties = MappingProxyType(properties) if properties else EMPTY_PROPERTIES
    if is_retry and PROPERTY_RETRY_TOPIC in properties:
        m.topic = properties[PROPERTY_RETRY_TOPIC]
    origin = properties.get(PROPERTY_ORIGIN_MESSAGE_ID)
    if origin:  # a retry or dead-letter copy keeps its message's id (offsetMsgId: this record)
        m.msg_id = origin


def poison_entry(
    topic: str, partition: int, kafka_topic: str, record: Any, exc: Exception
) -> UndecodableEntry:
    """The :class:`UndecodableEntry` of a poison record: its body and key as stored,
    ``DECODE_ERROR``, ``POISON_STREAM`` (the Kafka topic) and ``POISON_ENTRY_ID``
    (``<partition>@<offset>``); its headers as stored in ``fields``."""
    error = f"{type(exc).__name__}: {exc}"[:1000]
    offset = record.offset
    key = record.key
    message = Message(
        topic=topic,
        queue_id=partition,
        queue_offset=offset,
        body=record.value or b"",
        keys=() if key is None else (key.decode("utf-8", "replace"),),
        properties={
            PROPERTY_DECODE_ERROR: error,
            PROPERTY_POISON_STREAM: kafka_topic,
            PROPERTY_POISON_ENTRY_ID: f"{partition}@{offset}",
            **({PROPERTY_TOMBSTONE: "true"} if record.value is None else {}),
        },
        msg_id=f"{kafka_topic}-{partition}@{offset}",
        born_timestamp=(record.timestamp or 0) / 1000,
    )
    fields = tuple((name.encode(), value or b"") for name, value in record.headers or ())
    return UndecodableEntry(offset=offset, error=error, message=message, fields=fields)


def _key_text(key: StageKey) -> str:
    return key.strategy_id if key.group_id is None else f"{key.strategy_id}\x1f{key.group_id}"


def _key_of(text: str) -> StageKey:
    strategy_id, sep, group_id = text.partition("\x1f")
    return StageKey(strategy_id, group_id if sep else None)


def encode_metadata(
    stage_offsets: Mapping[StageKey, int], limit: int = METADATA_LIMIT
) -> tuple[str, int]:
    """The commit metadata string of ``stage_offsets`` and how many stage keys did
    not fit in ``limit`` bytes and were left out.

    JSON (``sc1:{...}``); when longer than ``limit``, zlib-compressed and base64
    (``sc1z:...``); when still too long, the stage keys with the lowest stage offsets
    are left out until it fits (they restart from 0 on the next owner: stage
    assignment for them is not kept)."""
    if not stage_offsets:
        return _METADATA_JSON + "{}", 0
    items = sorted(
        ((_key_text(key), offset) for key, offset in stage_offsets.items()),
        key=lambda item: (-item[1], item[0]),
    )
    dropped = 0
    while True:
        text = _METADATA_JSON + json.dumps(dict(items), separators=(",", ":"))
        if len(text.encode()) <= limit:
            return text, dropped
        packed = _METADATA_ZLIB + base64.b64encode(
            zlib.compress(text[len(_METADATA_JSON) :].encode(), 9)
        ).decode("ascii")
        if len(packed) <= limit:
            return packed, dropped
        # drop enough keys at once to fit in a few rounds (proportionally to the overrun)
        cut = max(1, len(items) - len(items) * limit // len(packed))
        items = items[: len(items) - cut]
        dropped += cut
        if not items:
            return "", dropped


def _stage_json(stage_offsets: Mapping[StageKey, int]) -> str:
    items = sorted((_key_text(key), offset) for key, offset in stage_offsets.items())
    return json.dumps(dict(items), separators=(",", ":"))


def _packed(payload: str, limit: int) -> str | None:
    """``sc2:<payload>``, or compressed ``sc2z:...``, whichever fits ``limit`` bytes."""
    text = _PROGRESS_TEXT + payload
    if len(text.encode()) <= limit:
        return text
    packed = _PROGRESS_ZLIB + base64.b64encode(zlib.compress(payload.encode(), 9)).decode("ascii")
    return packed if len(packed) <= limit else None


def encode_progress(progress: QueueProgress, limit: int = METADATA_LIMIT) -> tuple[str, int, int]:
    """The commit metadata of ``progress`` (its stage offsets and, sparse progress,
    its finished ranges above the consume offset), the stage keys and the finished
    ranges left out to fit ``limit`` bytes.

    Without finished ranges: :func:`encode_metadata`. With them:
    ``sc2:<ranges>;<stage offsets JSON>``, the ranges as the SQL store writes them
    (``gap+length``, comma separated), zlib-compressed and base64 (``sc2z:``) when
    longer than ``limit``. When even compressed it does not fit, the highest ranges
    are left out first (their messages come again: at-least-once), then, with no
    range left, stage keys as :func:`encode_metadata` leaves them out."""
    ranges = list(progress.finished)
    if ranges and progress.consume_offset is not None:
        stages = _stage_json(progress.stage_offsets)
        keep = len(ranges)
        while keep:
            finished = encode_finished(progress.consume_offset, ranges[:keep])
            text = _packed(f"{finished};{stages}", limit)
            if text is not None:
                return text, 0, len(ranges) - keep
            # cut in proportion to the overrun, at least one range a round
            size = len(_PROGRESS_TEXT) + len(finished or "") + 1 + len(stages)
            keep = min(keep - 1, keep * limit // max(size, 1))
    text, dropped = encode_metadata(progress.stage_offsets, limit)
    return text, dropped, len(ranges)


def decode_progress(
    consume_offset: int, metadata: str | None
) -> tuple[dict[StageKey, int], tuple[tuple[int, int], ...]]:
    """The stage offsets and finished ranges in a commit's metadata (none of either
    for anything this project did not write)."""
    if not metadata or not metadata.startswith((_PROGRESS_TEXT, _PROGRESS_ZLIB)):
        return decode_metadata(metadata), ()
    try:
        if metadata.startswith(_PROGRESS_TEXT):
            payload = metadata[len(_PROGRESS_TEXT) :]
        else:
            raw = base64.b64decode(metadata[len(_PROGRESS_ZLIB) :])
            payload = zlib.decompress(raw).decode()
        finished_text, sep, stages = payload.partition(";")
        if not sep:
            return {}, ()
        finished = decode_finished(consume_offset, finished_text)
    except (ValueError, TypeError, zlib.error):
        return {}, ()
    return decode_metadata(_METADATA_JSON + stages), finished


def decode_metadata(metadata: str | None) -> dict[StageKey, int]:
    """The stage offsets in a commit's metadata string (empty for anything else: a
    commit made by another Kafka client)."""
    if not metadata:
        return {}
    try:
        if metadata.startswith(_METADATA_JSON):
            raw = metadata[len(_METADATA_JSON) :]
        elif metadata.startswith(_METADATA_ZLIB):
            raw = zlib.decompress(base64.b64decode(metadata[len(_METADATA_ZLIB) :])).decode()
        else:
            return {}
        loaded = json.loads(raw)
    except (ValueError, zlib.error):
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {
        _key_of(text): offset
        for text, offset in loaded.items()
        if type(offset) is int and offset >= 0
    }
