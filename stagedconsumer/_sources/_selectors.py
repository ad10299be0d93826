"""Queue selectors: which queue of a topic a producer sends a message to.

After RocketMQ's ``MessageQueueSelector`` (``select(mqs, msg, arg)``). Messages that
must stay in order (all events of one order, one account) are sent with the same
``arg`` through :class:`SelectMessageQueueByHash`, so they land in one queue, where
orderly and staged consumers keep their order.
"""

from __future__ import annotations

import abc
import itertools
import random
import zlib
from collections.abc import Sequence

from .._exceptions import ConfigurationError
from .._message import MessageQueue, OutgoingMessage
from ._gray import check_gray_ratio, split_gray

__all__ = (
    "MessageQueueSelector",
    "SelectMessageQueueByGray",
    "SelectMessageQueueByHash",
    "SelectMessageQueueByRandom",
    "stable_hash",
)


def stable_hash(value: object) -> int:
    """A hash that is the same in every process (``hash(str)`` is salted per process):
    CRC-32 of ``str(value)``, as the brokers hash message keys."""
    text = value if isinstance(value, str) else str(value)
    return zlib.crc32(text.encode())


class MessageQueueSelector(abc.ABC):
    """Chooses the queue of a message among the queues of its topic.

    Implementations must return one of ``queues``; to keep messages in order, return
    the same queue for the same ``arg`` (and the same queue count).
    """

    @abc.abstractmethod
    def select(
        self, queues: Sequence[MessageQueue], message: OutgoingMessage, arg: object
    ) -> MessageQueue:
        """The queue for ``message`` (the first of a batch); ``arg`` is what the caller
        passed to ``send``, e.g. an order id. ``queues`` are sorted by queue id."""


class SelectMessageQueueByHash(MessageQueueSelector):
    """The queue at ``hash(arg) % len(queues)`` (RocketMQ's ``SelectMessageQueueByHash``),
    with a hash that is stable across processes: every message sent with the same
    ``arg`` goes to the same queue, from any producer process."""

    def select(
        self, queues: Sequence[MessageQueue], message: OutgoingMessage, arg: object
    ) -> MessageQueue:
        if arg is None:
            raise ConfigurationError(
                "SelectMessageQueueByHash needs an arg to hash: send(..., arg=order_id)"
            )
        return queues[stable_hash(arg) % len(queues)]


class SelectMessageQueueByRandom(MessageQueueSelector):
    """A queue chosen at random, evenly (RocketMQ's ``SelectMessageQueueByRandom``):
    no order between messages; ``arg`` is ignored."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    def select(
        self, queues: Sequence[MessageQueue], message: OutgoingMessage, arg: object
    ) -> MessageQueue:
        return queues[self._rng.randrange(len(queues))]


class SelectMessageQueueByGray(MessageQueueSelector):
    """Gray release (RIP-72's ``SelectMessageQueueByGray``): gray traffic to the gray
    queues, normal traffic to the normal ones, with the consumer's split rule (the
    last ``ceil(n * ratio)`` queues of the topic are gray; use the ratio of the gray
    consumers).

    A message is gray when ``arg`` is ``True``, or when ``gray_property`` is set and
    the message's property of that name equals ``gray_value`` (a traffic-lane tag,
    e.g. ``gray_property="lane", gray_value="canary"``; ``gray_value`` defaults to
    ``"true"``, and without ``gray_property`` it is refused, having nothing to be
    compared with). Within its side, a message
    with keys goes to the queue at the stable hash of its first key, so messages of
    one key stay in one queue and in order (RIP-72 picks a random queue, which
    breaks per-key order for orderly and staged consumers); messages without keys
    go round-robin. With ``ratio=1`` every queue is gray and normal traffic goes to
    them too; a topic of one queue has no normal queue either.
    """

    def __init__(
        self,
        ratio: float = 0.1,
        *,
        gray_property: str | None = None,
        gray_value: str | None = None,
    ) -> None:
        self.ratio = check_gray_ratio(ratio, "ratio")
        """The share of the topic's queues that are gray (the last ``ceil(n * ratio)``)."""
        if gray_property is not None and (not isinstance(gray_property, str) or not gray_property):
            raise ConfigurationError(
                f"gray_property must be a non-empty string or None, got {gray_property!r}"
            )
        if gray_value is not None and gray_property is None:
            raise ConfigurationError(
                f"gray_value={gray_value!r} is compared with the message property named by"
                " gray_property, which is not given: messages marked that way would go to"
                " the normal queues (pass gray_property=..., or arg=True to send()"
                " for gray traffic)"
            )
        if gray_value is None:
            gray_value = "true"
        if not isinstance(gray_value, str):
            raise ConfigurationError(f"gray_value must be a string, got {gray_value!r}")
        self.gray_property = gray_property
        """The message property that marks gray traffic (``None``: only ``arg=True``)."""
        self.gray_value = gray_value
        """The value of ``gray_property`` that marks a message gray."""
        self._next = {False: itertools.count(), True: itertools.count()}

    def is_gray(self, message: OutgoingMessage, arg: object) -> bool:
        """Whether ``message`` (sent with ``arg``) is gray traffic."""
        if arg is True:
            return True
        prop = self.gray_property
        return prop is not None and message.properties.get(prop) == self.gray_value

    def select(
        self, queues: Sequence[MessageQueue], message: OutgoingMessage, arg: object
    ) -> MessageQueue:
        split = split_gray(queues, self.ratio)
        gray = self.is_gray(message, arg)
        side = split.gray if gray else split.normal
        if not side:  # one queue, or ratio 1: the other side is all there is
            side = split.normal or split.gray
        if message.keys:
            return side[stable_hash(message.keys[0]) % len(side)]
        return side[next(self._next[gray]) % len(side)]
