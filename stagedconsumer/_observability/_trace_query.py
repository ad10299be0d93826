"""Reading message trace back: from a :class:`~._trace_sinks.FileTraceSink` file or
the trace topic of a source, and the records of one message."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .._exceptions import ConfigurationError, UnknownTopicError
from .._message import MessageQueue
from .._sources._source import MessageSource
from ._trace_codec import (
    KEY_SEPARATOR,
    RMQ_SYS_TRACE_TOPIC,
    TraceContext,
    TraceMessage,
    decode_trace_data,
)

__all__ = ("query_message_trace", "read_trace_file", "read_trace_topic", "trace_messages_of")

_PULL_BATCH = 1000


def read_trace_file(path: str | os.PathLike[str]) -> Iterator[TraceMessage]:
    """The trace messages of a :class:`FileTraceSink` file (blank lines skipped).

    A line that is not a trace message as the sink writes it (a JSON object with
    ``topic``, ``keys`` and ``body``) raises :class:`~stagedconsumer.ConfigurationError`
    naming the file and the line."""
    with Path(path).open(encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                yield TraceMessage.from_json(line)
            except (ValueError, KeyError, TypeError) as exc:
                shown = line.strip()
                if len(shown) > 60:
                    shown = shown[:57] + "..."
                raise ConfigurationError(
                    f"{os.fspath(path)}, line {number}: not a trace record written by"
                    f" FileTraceSink (a JSON object with topic, keys and body): {shown!r}"
                ) from exc


def trace_messages_of(source: Any, topic: str = RMQ_SYS_TRACE_TOPIC) -> Iterator[TraceMessage]:
    """The trace messages stored in ``topic`` of a :class:`~stagedconsumer.MemoryBroker`,
    read without waiting (a source whose ``messages()`` is synchronous).

    Any other source, :class:`~stagedconsumer.RedisBroker` included, is read with
    ``await`` :func:`read_trace_topic`; it raises
    :class:`~stagedconsumer.ConfigurationError` here, saying so.
    """
    messages = getattr(source, "messages", None)
    statistics = getattr(source, "statistics", None)
    if (
        messages is None
        or statistics is None
        or inspect.iscoroutinefunction(messages)
        or inspect.iscoroutinefunction(statistics)
    ):
        raise ConfigurationError(
            f"{type(source).__name__} cannot be read without waiting:"
            f" use `await read_trace_topic(source)`"
        )
    count = statistics().topics.get(topic, 0)
    return _stored(source, topic, count)


def _stored(source: Any, topic: str, count: int) -> Iterator[TraceMessage]:
    for queue_id in range(count):
        for message in source.messages(topic, queue_id):
            yield TraceMessage.from_message(message)


async def read_trace_topic(
    source: MessageSource, topic: str = RMQ_SYS_TRACE_TOPIC
) -> list[TraceMessage]:
    """The trace messages stored in ``topic`` of any source (the embedded broker,
    :class:`~stagedconsumer.RedisBroker`, ...), read through the
    :class:`~stagedconsumer.MessageSource` interface: every queue from its min to
    its max offset, queue by queue, in offset order. An absent topic has none.

    Reads the whole topic into memory (RocketMQ looks trace messages up in the
    broker's key index; our sources have none): for a large trace topic, prefer a
    :class:`~stagedconsumer.FileTraceSink`, or a trace topic per period.
    """
    try:
        queues = await source.get_queues(topic)
    except UnknownTopicError:
        return []
    found: list[TraceMessage] = []
    for mq in sorted(queues):
        await _read_queue(source, mq, found)
    return found


async def _read_queue(source: MessageSource, mq: MessageQueue, into: list[TraceMessage]) -> None:
    offset = await source.min_offset(mq)
    end = await source.max_offset(mq)
    while offset < end:
        pulled = await source.pull(mq, offset, _PULL_BATCH)
        if not pulled.messages and pulled.next_offset <= offset:
            return  # nothing more (the max offset was read before a trim)
        into.extend(TraceMessage.from_message(m) for m in pulled.messages if m.queue_offset < end)
        offset = pulled.next_offset


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
