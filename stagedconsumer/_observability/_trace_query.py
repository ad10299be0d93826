"""Reading message trace back: from a :class:`~._trace_sinks.FileTraceSink` file or
the trace topic of the embedded broker, and the records of one message."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .._exceptions import ConfigurationError
from ._trace_codec import (
    KEY_SEPARATOR,
    RMQ_SYS_TRACE_TOPIC,
    TraceContext,
    TraceMessage,
    decode_trace_data,
)

__all__ = ("query_message_trace", "read_trace_file", "trace_messages_of")


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
