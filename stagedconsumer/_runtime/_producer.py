"""Producer: sends messages to the topics of a source, with queue selectors, retries on
another queue, a per-call deadline and send hooks.

The send path, after RocketMQ's ``DefaultMQProducerImpl.sendDefaultImpl``: check the
messages, find the topic's queues, choose a queue (``queue_id``, a selector, the first
key's hash, or round-robin), append, and on a retriable failure try again (on the next
queue, unless the caller chose the queue) until ``retry_times_when_send_failed`` is
used up or the deadline ``send_msg_timeout`` passes.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType

import anyio
import anyio.abc

from .._core import Backoff
from .._exceptions import (
    ConfigurationError,
    InvalidMessageError,
    ProducerStateError,
    SendTimeoutError,
    SourceError,
)
from .._message import MessageQueue, OutgoingMessage, SendResult
from .._observability._send_hooks import ProducerStatistics, SendMessageContext, SendMessageHook
from .._options import ProducerOptions
from .._sources._selectors import MessageQueueSelector, stable_hash
from .._sources._source import MessageSource
from ._hooks import SendHookRunner, loop_clock
from ._shapes import check_client, check_hook

__all__ = ("Producer",)

logger = logging.getLogger("stagedconsumer.producer")

_RETRY_BACKOFF = (0.05, 1.0)
"""Seconds before the first retry of a send, doubling up to the second."""


class Producer:
    """Sends messages to the topics of ``source``.

    Use it as an async context manager: ``async with Producer(broker) as producer:``
    starts the background work of its send hooks (a trace dispatcher, say) and leaving
    the block flushes and stops it. Runs on asyncio and trio, wherever the source does.

    Ordering guarantee: messages sent to one queue, one call after another, are
    stored in the order of the calls (and a batch in its order, at consecutive
    offsets); nothing is ordered across queues. To keep related messages in order,
    send them to one queue: the same first key (the default choice hashes it), the
    same ``arg`` with :class:`SelectMessageQueueByHash`, or a ``queue_id``.

    Delivery: at-least-once. An attempt whose reply was lost is retried and may store
    the message twice; a call that raised stored nothing, or stored duplicates of a
    message that is also stored.
    """

    def __init__(
        self,
        source: MessageSource,
        *,
        group: str = "DEFAULT_PRODUCER",
        options: ProducerOptions | None = None,
    ) -> None:
        options = check_client(group, source, options, ProducerOptions, consumer=False)
        self.source = source
        """The broker it sends to."""
        self.group = group
        """The producer group, reported to hooks and in message trace."""
        self.options = options
        """The ``ProducerOptions`` it runs with."""
        self._hook_list: list[SendMessageHook] = []
        self._hooks = SendHookRunner(())
        self._round_robin: dict[str, itertools.count[int]] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._started = False
        self._closed = False
        self._sent = 0
        self._send_calls = 0
        self._send_errors = 0
        self._retries = 0
        self._timeouts = 0

    def register_send_message_hook(self, hook: SendMessageHook) -> None:
        """Run ``hook`` around every send (see :class:`SendMessageHook`). Call before
        the producer starts; message trace (``Pub`` records) is such a hook:
        :class:`SendMessageTraceHook`. Its ``send_message_before`` and
        ``send_message_after`` are called synchronously with the context: one that is
        ``async def`` or cannot take the context raises :class:`ListenerTypeError`."""
        if self._started:
            raise ProducerStateError(
                "register_send_message_hook() must be called before the producer starts"
            )
        if not isinstance(hook, SendMessageHook):
            raise ConfigurationError(f"hook must be a SendMessageHook, got {type(hook).__name__}")
        check_hook(hook, SendMessageHook, ("send_message_before", "send_message_after"))
        self._hook_list.append(hook)

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Producer:
        if self._started:
            raise ProducerStateError("a Producer can be started only once")
        self._started = True
        self._hooks = SendHookRunner(self._hook_list)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            for hook in self._hooks.services():
                await tg.start(hook.run, self)
        except BaseException:
            tg.cancel_scope.cancel()
            self._closed = True
            await tg.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tg = self._tg
        assert tg is not None
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                await self._hooks.aclose()  # flush (bounded by each hook)
        finally:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)

    # -- sending -----------------------------------------------------------------------

    async def send(
        self,
        topic: str,
        body: bytes,
        *,
        keys: Sequence[str] | str = (),
        tags: str | None = None,
        properties: Mapping[str, str] | None = None,
        selector: MessageQueueSelector | None = None,
        arg: object = None,
        queue_id: int | None = None,
    ) -> SendResult:
        """Send one message to a queue of ``topic``; returns where it was stored.

        The queue: ``queue_id`` if given, else ``selector.select(queues, message,
        arg)``, else the hash of the first key, else round-robin. Raises
        :class:`InvalidMessageError` for a bad message (before sending anything),
        :class:`UnknownTopicError`, :class:`SendTimeoutError` after
        ``send_msg_timeout``, or the source's non-retriable :class:`SourceError`.
        """
        message = OutgoingMessage.of(body, keys=keys, tags=tags, properties=properties)
        results = await self._send(topic, [message], selector, arg, queue_id)
        return results[0]

    async def send_batch(
        self,
        topic: str,
        messages: Iterable[OutgoingMessage | bytes],
        *,
        selector: MessageQueueSelector | None = None,
        arg: object = None,
        queue_id: int | None = None,
    ) -> list[SendResult]:
        """Send several messages to one queue of ``topic`` in one call, stored at
        consecutive offsets in the given order; returns a result per message.

        ``messages`` are :class:`OutgoingMessage` (``OutgoingMessage.of(body, keys=...)``)
        or plain bodies. The queue is chosen as for :meth:`send`, from the first
        message; ``max_message_size`` bounds the bodies' total."""
        if isinstance(messages, (bytes, bytearray, memoryview, str)):
            raise InvalidMessageError("messages must be an iterable of messages or bodies")
        batch = [
            m.copy() if isinstance(m, OutgoingMessage) else OutgoingMessage.of(m) for m in messages
        ]
        if not batch:
            raise InvalidMessageError("send_batch() needs at least one message")
        for m in batch:  # checked as send() checks (a caller may build them by hand)
            OutgoingMessage.of(m.body, keys=m.keys, tags=m.tags, properties=m.properties)
        return await self._send(topic, batch, selector, arg, queue_id)

    async def _send(
        self,
        topic: str,
        messages: list[OutgoingMessage],
        selector: MessageQueueSelector | None,
        arg: object,
        queue_id: int | None,
    ) -> list[SendResult]:
        if not self._started or self._closed:
            raise ProducerStateError("send() needs a running producer: use `async with producer:`")
        if not isinstance(topic, str) or not topic:
            raise InvalidMessageError(f"topic must be a non-empty string, got {topic!r}")
        if topic.startswith("%"):
            raise InvalidMessageError(f"cannot send to system topic {topic!r}")
        size = sum(len(m.body) for m in messages)
        if size > self.options.max_message_size:
            raise InvalidMessageError(
                f"message body of {size} bytes is over max_message_size"
                f" ({self.options.max_message_size})"
            )
        if queue_id is not None and (
            isinstance(queue_id, bool) or not isinstance(queue_id, int) or queue_id < 0
        ):
            raise InvalidMessageError(f"queue_id must be an int >= 0, got {queue_id!r}")
        if selector is not None and not isinstance(selector, MessageQueueSelector):
            raise ConfigurationError(
                f"selector must be a MessageQueueSelector, got {type(selector).__name__}"
            )
        if arg is not None and selector is None:
            raise ConfigurationError(
                f"arg={arg!r} is handed to a selector's select(), but no selector= is given:"
                " it would be ignored (for gray traffic: selector=SelectMessageQueueByGray(),"
                " arg=True)"
            )
        clock = loop_clock()
        start = clock()
        context = SendMessageContext(
            producer_group=self.group,
            topic=topic,
            messages=messages,
            start_time=start,
            wall_offset=time.time() - start,
        )
        hooks = self._hooks
        if hooks.hooks:
            hooks.before(context)
        try:
            results = await self._attempts(context, selector, arg, queue_id)
        except BaseException as exc:
            self._send_errors += 1
            context.exception = exc
            raise
        else:
            self._send_calls += 1
            self._sent += len(results)
            context.results = results
            return results
        finally:
            context.end_time = clock()
            if hooks.hooks:
                hooks.after(context)

    async def _attempts(
        self,
        context: SendMessageContext,
        selector: MessageQueueSelector | None,
        arg: object,
        queue_id: int | None,
    ) -> list[SendResult]:
        """Choose the queue and append, retrying within the deadline."""
        options = self.options
        last: SourceError | None = None
        with anyio.move_on_after(options.send_msg_timeout) as deadline:
            queues = _in_order(await self.source.get_queues(context.topic))
            index = self._first_queue(
                context.topic, queues, context.messages[0], selector, arg, queue_id
            )
            pinned = selector is not None or queue_id is not None
            backoff = Backoff(*_RETRY_BACKOFF)
            while True:
                mq = context.message_queue = queues[index]
                context.attempts += 1
                try:
                    stored = await self.source.append(mq, context.messages)
                except SourceError as exc:
                    if not exc.retriable or context.attempts > options.retry_times_when_send_failed:
                        raise
                    last = exc
                    self._retries += 1
                    delay = backoff.failed()
                    logger.warning(
                        "producer %s: sending to %s failed (%s); retrying on %s in %.2f s",
                        self.group,
                        mq,
                        exc,
                        "the same queue" if pinned else "the next queue",
                        delay,
                    )
                    await anyio.sleep(delay)
                    if not pinned:
                        index = (index + 1) % len(queues)
                    continue
                return [SendResult.of(message) for message in stored]
        assert deadline.cancelled_caught
        self._timeouts += 1
        raise SendTimeoutError(
            f"sending to {context.topic!r} did not succeed within send_msg_timeout"
            f" ({options.send_msg_timeout} s, {context.attempts} attempt(s))"
        ) from last

    def _first_queue(
        self,
        topic: str,
        queues: Sequence[MessageQueue],
        message: OutgoingMessage,
        selector: MessageQueueSelector | None,
        arg: object,
        queue_id: int | None,
    ) -> int:
        if not queues:
            raise SourceError(f"topic {topic!r} has no queues", retriable=False)
        if queue_id is not None:
            if queue_id >= len(queues):
                raise InvalidMessageError(
                    f"queue_id {queue_id} out of range for topic {topic!r} with"
                    f" {len(queues)} queues"
                )
            return queue_id
        if selector is not None:
            chosen = selector.select(queues, message, arg)
            try:
                return list(queues).index(chosen)
            except ValueError:
                raise ConfigurationError(
                    f"{type(selector).__name__}.select() returned {chosen!r}, not one of the"
                    f" {len(queues)} queues of {topic!r}"
                ) from None
        if message.keys:
            return stable_hash(message.keys[0]) % len(queues)
        counter = self._round_robin.get(topic)
        if counter is None:
            counter = self._round_robin[topic] = itertools.count()
        return next(counter) % len(queues)

    # -- inspection --------------------------------------------------------------------

    def statistics(self) -> ProducerStatistics:
        """A frozen snapshot of the producer's counters."""
        return ProducerStatistics(
            group=self.group,
            sent=self._sent,
            send_calls=self._send_calls,
            send_errors=self._send_errors,
            retries=self._retries,
            timeouts=self._timeouts,
            hook_errors=self._hooks.errors,
            trace_records_dropped=sum(hook.records_dropped for hook in self._hook_list),
        )


def _in_order(queues: Sequence[MessageQueue]) -> Sequence[MessageQueue]:
    """A topic's queues by queue id (sources list them in order, as a rule: then as
    they are, without comparing ``MessageQueue`` objects, which costs microseconds)."""
    ids = [mq.queue_id for mq in queues]
    if ids == sorted(ids):
        return queues
    return sorted(queues, key=_QUEUE_ID)


_QUEUE_ID = operator.attrgetter("queue_id")
