"""The send trace hook: a ``Pub`` record for every message a producer stored
(RocketMQ's ``SendMessageTraceHookImpl``).

Its encoder writes the layout of :func:`~._trace_codec.encode_trace_context` straight
from the send context (``tests/trace/test_send_trace_fast_path.py`` holds it to it
byte for byte), when the dispatcher writes the batch, not in the sending task.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from .._message import SendStatus
from ._send_hooks import SendMessageContext, SendMessageHook
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
    from ._send_hooks import ProducerView

__all__ = ("NORMAL_MSG", "SendMessageTraceHook")

NORMAL_MSG = 0
"""RocketMQ's ``MessageType.Normal_Msg`` ordinal, the ``msgType`` of every ``Pub``
record written here."""

_S = CONTENT_SPLITOR
_E = FIELD_SPLITOR
_SEND_OK = SendStatus.SEND_OK


_c = clean_field


class SendMessageTraceHook(DispatchingTraceHook, SendMessageHook):
    """Message trace of a producer: a ``Pub`` record for every message it stored.

    RocketMQ's ``SendMessageTraceHookImpl``; enable it with::

        producer.register_send_message_hook(SendMessageTraceHook())  # trace topic
        producer.register_send_message_hook(
            SendMessageTraceHook(FileTraceSink("trace.jsonl"))  # or a file
        )

    Records go through an :class:`AsyncTraceDispatcher` to the sink, as the consume
    side's :class:`ConsumeMessageTraceHook` does (same defaults): the trace topic of
    the producer's source (``trace_topic``, default ``RMQ_SYS_TRACE_TOPIC``, keyed by
    message id and business keys) or a :class:`FileTraceSink`. The dispatcher task
    runs in the producer's task group and is flushed when the producer stops (for at
    most ``shutdown_timeout`` seconds, default 5). ``stagedconsumer trace`` shows the
    ``Pub`` row above the message's consume attempts.

    What is written, as RocketMQ does:

    - Only sends that stored their messages: a call that raised (timeout,
      non-retriable failure) writes nothing, as RocketMQ writes no ``Pub`` without a
      ``SendResult`` (such failures are counted in
      :attr:`ProducerStatistics.send_errors`). ``isSuccess`` is
      ``status is SendStatus.SEND_OK``, per message.
    - Not the sends to the trace topic itself (a topic starting with
      ``trace_topic``), nor messages with property ``TRACE_ON=false``. RocketMQ
      skips a send when its broker has trace off (the broker stamps ``TRACE_ON`` on
      every message, and consumers skip ``TRACE_ON=false``); our brokers stamp
      nothing, so the property decides for both sides.

    The fields, in RocketMQ's order: ``timeStamp`` is when the send call started
    (ms), ``regionId`` the message's ``MSG_REGION`` property or ``region_id``
    (``DefaultRegion``), ``groupName`` the producer group, ``storeHost`` the
    source's :meth:`~stagedconsumer.MessageSource.store_host` (``embedded`` for the
    embedded broker, ``host:port`` of the Redis server for a ``RedisBroker``),
    ``costTime`` the send call's time in ms (retries included; each message of a
    batch gets the call's time, as RocketMQ's one record of a batch does),
    ``msgType`` ``0`` (``Normal_Msg``: RocketMQ's producer writes it for every send
    but delayed and transactional ones, which this producer does not make; selector
    sends included), ``offsetMsgId`` where the source stored the message,
    ``queueId:queueOffset`` (RocketMQ: the broker's id of the stored copy, made of
    its address and commit-log offset; our brokers' id of a stored copy,
    ``Message.offset_msg_id``, is the ``msgId`` itself for the copy a send stores,
    so the record gives where it is instead). Then
    ``clientHost`` (``client_host``, default this host's name), and ours: queue id,
    queue offset, send attempts. A batch gets one record per message (RocketMQ
    writes one for the whole batch, with the joined ids).

    The hook method only queues the send context (one ``deque.append``); its records
    are encoded when their batch is written. Ordering guarantee: records are written
    in the order the sends returned, a batch's in its order; a sink shared with
    other hooks interleaves their records.
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
        store_host: str | None = None,
        client_host: str | None = None,
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
        self.store_host = store_host
        """``storeHost`` of the records; ``None``: the producer's source's
        :meth:`~stagedconsumer.MessageSource.store_host`, read when the producer
        starts."""
        self.client_host = client_host if client_host is not None else socket.gethostname()
        """The ``clientHost`` of the ``Pub`` records."""
        self._encoder: Encoder = self._encode
        # Encoded text that repeats from call to call: (region, group, topic) -> the
        # fields from regionId to topic.
        self._static: dict[tuple[str, str, str], str] = {}

    @property
    def hook_name(self) -> str:
        return "SendMessageTraceHook"

    def send_message_before(self, context: SendMessageContext) -> None:
        """Nothing: everything a ``Pub`` record holds is known after the send."""

    def send_message_after(self, context: SendMessageContext) -> None:
        if context.exception is not None or not context.results:
            return  # RocketMQ: no SendResult, no Pub record
        if context.topic.startswith(self.dispatcher.trace_topic):
            return
        for message in context.messages:
            props = message.properties
            if not props or props.get(PROPERTY_TRACE_SWITCH) != "false":
                break
        else:
            return  # no message of the call is traced
        self.dispatcher.append_deferred(self._encoder, context)

    def _encode(self, context: SendMessageContext) -> tuple[str, list[str]]:
        """The ``Pub`` records of a send call and its index keys."""
        took = context.end_time - context.start_time
        cost = int(took * 1000) if took > 0.0 else 0
        head = f"Pub{_S}{round((context.start_time + context.wall_offset) * 1000)}{_S}"
        middle = f"{_S}{_c(self.store_host or '')}{_S}"
        cost_type = f"{_S}{cost}{_S}{NORMAL_MSG}{_S}"
        attempts = context.attempts
        client = f"{_S}{_c(self.client_host)}{_S}"
        group = context.producer_group
        topic = context.topic
        records: list[str] = []
        keys: list[str] = []
        for message, result in zip(context.messages, context.results):  # noqa: B905
            props = message.properties
            region = ""
            if props:
                if props.get(PROPERTY_TRACE_SWITCH) == "false":
                    continue
                region = props.get(PROPERTY_MSG_REGION, "")
            static = self._static.get((region, group, topic)) or self._static_text(
                region, group, topic
            )
            msg_id = result.msg_id
            if _S in msg_id or _E in msg_id:
                msg_id = _c(msg_id)
            keys.append(msg_id)
            if message.keys:
                key_text = _c(KEY_SEPARATOR.join(message.keys))
                keys.extend(k for k in key_text.split(KEY_SEPARATOR) if k)
            else:
                key_text = ""
            tags = message.tags
            queue_id = result.message_queue.queue_id
            offset = result.queue_offset
            records.append(
                f"{head}{static}{msg_id}{_S}{_c(tags) if tags else ''}{_S}{key_text}"
                f"{middle}{len(message.body)}{cost_type}{queue_id}:{offset}"
                f"{_S}{'true' if result.status is _SEND_OK else 'false'}"
                f"{client}{queue_id}{_S}{offset}{_S}{attempts}{_E}"
            )
        return "".join(records), keys

    def _static_text(self, region: str, group: str, topic: str) -> str:
        """The encoded fields from ``regionId`` to ``topic``, and the separator after."""
        if len(self._static) >= 4096:  # regions come from messages: stay bounded
            self._static.clear()
        text = self._static[region, group, topic] = (
            f"{_c(region or self.region_id)}{_S}{_c(group)}{_S}{_c(topic)}{_S}"
        )
        return text

    async def run(
        self,
        producer: ProducerView,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        if self.store_host is None:
            self.store_host = producer.source.store_host()
        await self.dispatcher.sink.prepare(producer)
        await self.dispatcher.run(task_status=task_status)
