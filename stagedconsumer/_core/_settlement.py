"""Settlement: how the messages of a failed handler call end up (sans-I/O).

A consume service judges a failed handler call and decides, per message, whether it
succeeded after all (a concurrent handler acknowledged part of its batch), went to
the group's retry queue, went to the dead-letter queue, or stays pending to be
retried here later. It says so in one :class:`Settlement`, which
:meth:`~._dispatcher.Dispatcher.settle` applies in one call.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

from .._message import Message

__all__ = ("SettleOutcome", "Settlement", "split_exhausted")


class SettleOutcome(enum.Enum):
    """What happened to the messages of a failed handler call."""

    RETRY = "retry"
    """Handed to the group's retry queue (concurrent mode)."""
    SUSPEND = "suspend"
    """Held back and retried locally (orderly and staged mode, or a failed send-back)."""
    DLQ = "dlq"
    """Moved to the group's dead-letter queue."""


@attrs.frozen(kw_only=True)
class Settlement:
    """The fate of every message of one failed batch.

    ``succeeded``, ``retried`` and ``dead`` are finished (the committed offset may
    move past them); ``suspended`` stay pending in the batch, which is handed to a
    handler again at ``retry_at`` (loop clock). Every message of the batch is in
    exactly one of the four.
    """

    succeeded: Sequence[Message] = ()
    """Acknowledged by the handler although the call failed (concurrent mode)."""
    retried: Sequence[Message] = ()
    """Handed to the group's retry queue: finished here, a new message there."""
    dead: Sequence[Message] = ()
    """Moved to the dead-letter queue: finished."""
    suspended: Sequence[Message] = ()
    """Retried locally at ``retry_at``."""
    retry_at: float = 0.0

    @property
    def finished(self) -> list[Message]:
        """The messages that leave the queue: succeeded, retried or dead."""
        return [*self.succeeded, *self.retried, *self.dead]

    @property
    def outcomes(self) -> Mapping[SettleOutcome, list[Message]]:
        """The failed messages by outcome (for consume hooks); empty outcomes left out."""
        out: dict[SettleOutcome, list[Message]] = {}
        for outcome, messages in (
            (SettleOutcome.RETRY, self.retried),
            (SettleOutcome.DLQ, self.dead),
            (SettleOutcome.SUSPEND, self.suspended),
        ):
            if messages:
                out[outcome] = list(messages)
        return out


def split_exhausted(
    messages: Sequence[Message], max_reconsume_times: int | None
) -> tuple[list[Message], list[Message]]:
    """Orderly and staged modes: the messages of a failed batch that are retried here
    (suspended) and those that used up ``max_reconsume_times`` attempts and go to the
    dead-letter queue (none when it is ``None``: unlimited), each in batch order."""
    if max_reconsume_times is None:
        return list(messages), []
    suspended: list[Message] = []
    exhausted: list[Message] = []
    for message in messages:
        if message.reconsume_times < max_reconsume_times:
            suspended.append(message)
        else:
            exhausted.append(message)
    return suspended, exhausted
