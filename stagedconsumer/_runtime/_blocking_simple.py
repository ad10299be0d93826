"""BlockingSimpleConsumer: a :class:`SimpleConsumer` driven from synchronous code (the
blocking API's way: the consumer runs on an event loop in another thread, each call
waits for its task there)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Self

from anyio.from_thread import BlockingPortal

from .._exceptions import ConfigurationError
from .._sources._pop import ReceivedMessage
from ._blocking import _Blocking
from ._simple import AckFuture, SimpleConsumer

__all__ = ("BlockingAckFuture", "BlockingSimpleConsumer")


class BlockingAckFuture:
    """The outcome of :meth:`BlockingSimpleConsumer.ack_async`: :meth:`result` blocks
    until the ack was answered (sending the queued acks if they were not sent yet)
    and raises :class:`~stagedconsumer.InvalidReceiptHandleError` (or the broker's
    error) when it failed."""

    __slots__ = ("_future", "_owner")

    def __init__(self, owner: BlockingSimpleConsumer, future: AckFuture) -> None:
        self._owner = owner
        self._future = future

    @property
    def message(self) -> ReceivedMessage:
        """The message acked."""
        return self._future.message

    def done(self) -> bool:
        """Whether the ack was sent and its outcome is known (does not block)."""
        return self._future.done()

    def exception(self) -> BaseException | None:
        """The ack's error once :meth:`done` (``None``: acked, or not sent yet)."""
        return self._future.exception()

    def result(self) -> None:
        """Wait for the ack's outcome: ``None``, or its error raised. Sends the queued
        acks when they were not sent yet (as awaiting an
        :class:`~stagedconsumer.AckFuture` does)."""
        future = self._future
        if not future.done():
            self._owner._call("ack_async", future._wait)
        error = future.exception()
        if error is not None:
            raise error


class BlockingSimpleConsumer(_Blocking[SimpleConsumer]):
    """A :class:`~stagedconsumer.SimpleConsumer` for synchronous code: ``receive``,
    ``ack`` and ``change_invisible_duration`` block until done; ``ack_async`` queues
    an ack that goes with the next ``receive``.

    ::

        consumer = SimpleConsumer("workers", broker, subscriptions={"jobs": "*"})
        with BlockingSimpleConsumer(consumer) as running:
            for message in running.receive(16, invisible_duration=30):
                handle(message)
                running.ack(message)

    The consumer runs on ``portal``'s event loop when given (share one with a producer
    of the same :class:`~stagedconsumer.MemoryBroker`), else on a portal of its own
    (``backend``, ``backend_options``), started when the block is entered and stopped
    when it is left. Calls may come from any thread (a pool of worker threads sharing
    one consumer, say) except the event loop's own
    (:class:`~stagedconsumer.WrongThreadError`). Leaving the block cancels receives
    still waiting in other threads (they raise
    :class:`~stagedconsumer.ConsumerStateError`); messages received and not acked come
    back after their invisible duration. Ctrl-C while a call waits cancels it.
    """

    _what = "simple consumer"

    def __init__(
        self,
        consumer: SimpleConsumer,
        *,
        portal: BlockingPortal | None = None,
        backend: str | None = None,
        backend_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(consumer, SimpleConsumer):
            raise ConfigurationError(
                f"consumer must be a SimpleConsumer, got {type(consumer).__name__}"
            )
        self.consumer = consumer
        """The async consumer (for ``async def`` code on the same event loop)."""
        self._init_loop(portal, backend, backend_options)

    def __enter__(self) -> Self:
        self._start(self.consumer, self.consumer.source, cancel_calls=True)
        return self

    def receive(self, max_message_num: int, invisible_duration: float) -> list[ReceivedMessage]:
        """:meth:`SimpleConsumer.receive <stagedconsumer.SimpleConsumer.receive>`,
        blocking (up to the consumer's ``await_duration``)."""
        return self._call(
            "receive",
            functools.partial(self.consumer.receive, max_message_num, invisible_duration),
        )

    def ack(self, message: ReceivedMessage) -> None:
        """:meth:`SimpleConsumer.ack <stagedconsumer.SimpleConsumer.ack>`, blocking."""
        self._call("ack", functools.partial(self.consumer.ack, message))

    def ack_batch(self, messages: Sequence[ReceivedMessage]) -> None:
        """:meth:`SimpleConsumer.ack_batch <stagedconsumer.SimpleConsumer.ack_batch>`,
        blocking."""
        messages = list(messages)
        self._call("ack_batch", functools.partial(self.consumer.ack_batch, messages))

    def ack_async(self, message: ReceivedMessage) -> BlockingAckFuture:
        """:meth:`SimpleConsumer.ack_async <stagedconsumer.SimpleConsumer.ack_async>`
        (RocketMQ 5's ``ackAsync``): queue the ack and return at once, without a round
        trip to the broker. The queued acks go with the next :meth:`receive` of any
        thread (on Redis inside its script), or when the block is left, or when one of
        their futures' :meth:`~BlockingAckFuture.result` is called. Until they are
        sent the messages' invisible durations keep running."""
        host = self._host
        if host is None:
            raise self._error(
                f"ack_async() needs a running {self._noun}: use `with {type(self).__name__}(...)`"
            )
        # (in a tuple: the portal would await an awaitable result, sending the ack)
        (future,) = host.call_sync(lambda: (self.consumer.ack_async(message),))
        return BlockingAckFuture(self, future)

    def change_invisible_duration(
        self, message: ReceivedMessage, invisible_duration: float
    ) -> None:
        """:meth:`SimpleConsumer.change_invisible_duration
        <stagedconsumer.SimpleConsumer.change_invisible_duration>`, blocking."""
        self._call(
            "change_invisible_duration",
            functools.partial(self.consumer.change_invisible_duration, message, invisible_duration),
        )
