"""SimpleConsumer: RocketMQ 5's pop consumption (receive, ack, invisible duration)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import attrs

from .._exceptions import ConfigurationError, ConsumerStateError, InvalidOptionError
from .._filter import TagFilter
from .._sources._group import new_client_id
from .._sources._pop import (
    InvalidReceiptHandleError,
    PopBackend,
    PopSettings,
    ReceivedMessage,
    pop_backend,
)
from .._sources._source import MessageSource

__all__ = ("SimpleConsumer", "SimpleConsumerOptions")

MAX_INVISIBLE_DURATION = 12 * 3600.0
"""RocketMQ's longest invisible duration (12 hours)."""
MAX_MESSAGE_NUM = 1024


def _attempts(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise InvalidOptionError(f"{attribute.name} must be an int in [1, 1000], got {value!r}")


def _bool(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{attribute.name} must be a bool, got {value!r}")


def _optional_name(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidOptionError(f"{attribute.name} must be a property name or None, got {value!r}")


@attrs.frozen(kw_only=True)
class SimpleConsumerOptions:
    """Tunables of a :class:`SimpleConsumer` (RocketMQ 5's names and defaults).

    They describe the consumer *group*: every consumer of a group must use the same
    values (on the embedded broker a consumer with other values raises
    :class:`~stagedconsumer.ConfigurationError`).
    """

    max_delivery_attempts: int = attrs.field(default=16, validator=_attempts)
    """Deliveries of a message to the group before it goes to the dead-letter queue
    ``%DLQ%<group>`` (RocketMQ's ``maxDeliveryAttempts``, 16): a message not acked
    within the invisible duration of its last attempt is dead-lettered instead of
    delivered again."""
    fifo: bool = attrs.field(default=False, validator=_bool)
    """FIFO consumption (RocketMQ 5's FIFO group): messages of one message group are
    received one at a time, in queue order; the next is received (by any consumer of
    the group) only after the previous was acked or dead-lettered."""
    message_group_property: str | None = attrs.field(default=None, validator=_optional_name)
    """With ``fifo``: the property naming a message's group; ``None`` (the default):
    its first key. A message without one is not ordered. Messages of a group must be
    in one queue (a producer sending with the group as first key does that)."""

    def __attrs_post_init__(self) -> None:
        if self.message_group_property is not None and not self.fifo:
            raise InvalidOptionError("message_group_property is used only with fifo=True")


def _check_duration(name: str, value: object, *, allow_zero: bool = False) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
        or value > MAX_INVISIBLE_DURATION
    ):
        low = "0" if allow_zero else "more than 0"
        raise ConfigurationError(
            f"{name} must be a number of seconds, {low} and at most"
            f" {MAX_INVISIBLE_DURATION:g} (12 hours), got {value!r}"
        )
    return float(value)


class SimpleConsumer:
    """Receives messages on demand and acks them: RocketMQ 5's ``SimpleConsumer``
    (pop consumption).

    ``await consumer.receive(max_message_num, invisible_duration)`` returns up to
    ``max_message_num`` messages of the subscribed topics, waiting up to
    ``await_duration`` seconds for at least one. Each is invisible to the group for
    ``invisible_duration`` seconds: :meth:`ack` it when done, or
    :meth:`change_invisible_duration` to take longer. A message not acked in time is
    delivered again (to any consumer of the group), its
    :attr:`~ReceivedMessage.delivery_attempt` one higher; after
    ``options.max_delivery_attempts`` (16) it goes to the group's dead-letter queue
    ``%DLQ%<group>``, stored as the push consumer stores a dead letter. An ack after
    the invisible duration passed raises :class:`InvalidReceiptHandleError`.

    The broker keeps the group's state (no offsets, queue locks or rebalance in the
    client): consumers of one group, in one process or many (``RedisBroker``), share
    the subscribed topics' messages. Delivery is at-least-once.

    ``subscriptions`` maps topics to tag expressions (``"*"``, ``"TagA || TagB"``);
    every consumer of a group subscribes the same way (a message a consumer's filter
    rejects is skipped for the group). Use it as ``async with consumer:``.
    """

    def __init__(
        self,
        group: str,
        source: MessageSource,
        *,
        subscriptions: Mapping[str, str | None] | None = None,
        await_duration: float = 30.0,
        options: SimpleConsumerOptions | None = None,
    ) -> None:
        if not isinstance(group, str) or not group or group.startswith(("%", " ")):
            raise ConfigurationError(f"group must be a non-empty name, got {group!r}")
        if not isinstance(source, MessageSource):
            raise ConfigurationError(f"source must be a MessageSource, got {type(source).__name__}")
        if options is None:
            options = SimpleConsumerOptions()
        elif not isinstance(options, SimpleConsumerOptions):
            raise ConfigurationError(
                f"options must be SimpleConsumerOptions, got {type(options).__name__}"
            )
        self.group = group
        self.source = source
        self.options = options
        self.await_duration = _check_duration("await_duration", await_duration, allow_zero=True)
        """Seconds :meth:`receive` waits for a message at most (RocketMQ's
        ``awaitDuration``)."""
        self.client_id = new_client_id()
        """This consumer's name in the group (Redis: its consumer name)."""
        self._subscriptions: dict[str, TagFilter] = {}
        for topic, expression in (subscriptions or {}).items():
            self._subscribe(topic, expression)
        self._backend: PopBackend | None = None
        self._started = False
        self._closed = False

    @property
    def consumer_group(self) -> str:
        """RocketMQ's ``getConsumerGroup()``."""
        return self.group

    @property
    def subscriptions(self) -> dict[str, str]:
        """Topic -> tag expression (RocketMQ's ``getSubscriptionExpressions()``)."""
        return {topic: f.expression for topic, f in self._subscriptions.items()}

    def _subscribe(self, topic: str, expression: str | None) -> None:
        if not isinstance(topic, str) or not topic:
            raise ConfigurationError(f"topic must be a non-empty string, got {topic!r}")
        if topic.startswith("%"):
            raise ConfigurationError(f"cannot subscribe to system topic {topic!r}")
        if self.source.topic_exists(topic) is False:
            from .._exceptions import UnknownTopicError

            raise UnknownTopicError(f"topic {topic!r} does not exist")
        self._subscriptions[topic] = TagFilter.parse(expression)

    async def subscribe(self, topic: str, expression: str | None = "*") -> None:
        """Add (or change) a subscription, also while running."""
        self._subscribe(topic, expression)
        if self._backend is not None:
            await self._backend.start({topic: self._subscriptions[topic]})

    def unsubscribe(self, topic: str) -> None:
        """Stop receiving ``topic``'s messages (those received stay ackable)."""
        self._subscriptions.pop(topic, None)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            raise ConsumerStateError("the SimpleConsumer was started already")
        settings = PopSettings(
            group=self.group,
            max_delivery_attempts=self.options.max_delivery_attempts,
            fifo=self.options.fifo,
            message_group_property=self.options.message_group_property,
        )
        backend = pop_backend(self.source, settings)
        for topic in self._subscriptions:
            await self.source.get_queues(topic)  # UnknownTopicError
        await backend.start(dict(self._subscriptions))
        self._backend = backend
        self._started = True

    async def aclose(self) -> None:
        """Stop: :meth:`receive` raises from now on. Messages received and not acked
        come back after their invisible duration."""
        self._closed = True

    async def __aenter__(self) -> SimpleConsumer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _running(self, method: str) -> PopBackend:
        backend = self._backend
        if backend is None or self._closed:
            state = "closed" if self._closed else "not started"
            raise ConsumerStateError(
                f"{method}() needs a running SimpleConsumer (it is {state}): use"
                " `async with consumer:`"
            )
        return backend

    # -- RocketMQ 5's operations ---------------------------------------------------------

    async def receive(
        self, max_message_num: int, invisible_duration: float
    ) -> list[ReceivedMessage]:
        """Up to ``max_message_num`` messages, each invisible to the group for
        ``invisible_duration`` seconds; waits up to ``await_duration`` for at least
        one (an empty list when none came)."""
        backend = self._running("receive")
        if (
            isinstance(max_message_num, bool)
            or not isinstance(max_message_num, int)
            or not 1 <= max_message_num <= MAX_MESSAGE_NUM
        ):
            raise ConfigurationError(
                f"max_message_num must be an int in [1, {MAX_MESSAGE_NUM}], got {max_message_num!r}"
            )
        invisible = _check_duration("invisible_duration", invisible_duration)
        if not self._subscriptions:
            raise ConsumerStateError("receive() needs a subscription (subscriptions={topic: '*'})")
        return await backend.receive(
            self.client_id, self._subscriptions, max_message_num, invisible, self.await_duration
        )

    async def ack(self, message: ReceivedMessage) -> None:
        """Finish ``message``: it is never delivered to the group again.

        Raises :class:`InvalidReceiptHandleError` when this delivery no longer holds
        the message: its invisible duration passed (it is visible again, maybe
        received by another consumer already), it was acked, or dead-lettered."""
        await self._running("ack").ack(message)

    async def ack_batch(self, messages: Sequence[ReceivedMessage]) -> None:
        """Ack several messages at once: one round trip per queue on Redis (RocketMQ
        5's ack request carries many entries too). Every message still held is
        acked; then, if any was refused, raises :class:`InvalidReceiptHandleError`
        with them in its ``refused`` attribute."""
        backend = self._running("ack_batch")
        if not messages:
            return
        refused = await backend.ack_many(list(messages))
        if refused:
            error = InvalidReceiptHandleError(
                f"ack of {len(refused)} of {len(messages)} messages refused (their invisible"
                " duration passed, or they were acked, received again or dead-lettered):"
                f" {', '.join(m.msg_id for m in refused[:10])}"
                + (" ..." if len(refused) > 10 else "")
            )
            error.refused = refused
            raise error

    async def change_invisible_duration(
        self, message: ReceivedMessage, invisible_duration: float
    ) -> None:
        """Make ``message`` invisible for ``invisible_duration`` seconds from now (to
        take longer than the receive asked for, or to have it back sooner: 0 hands
        it back at once, a nack). The message stays ackable while invisible; the
        same errors as :meth:`ack`."""
        duration = _check_duration("invisible_duration", invisible_duration, allow_zero=True)
        await self._running("change_invisible_duration").change_invisible_duration(
            message, duration
        )
