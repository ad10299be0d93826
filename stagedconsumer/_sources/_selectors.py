"""Queue selectors: which queue of a topic a producer sends a message to.

After RocketMQ's ``MessageQueueSelector`` (``select(mqs, msg, arg)``). Messages that
must stay in order (all events of one order, one account) are sent with the same
``arg`` through :class:`SelectMessageQueueByHash`, so they land in one queue, where
orderly and staged consumers keep their order.
"""

from __future__ import annotations

import abc
import random
import zlib
from collections.abc import Sequence

from .._exceptions import ConfigurationError
from .._message import MessageQueue, OutgoingMessage

__all__ = (
    "MessageQueueSelector",
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
