"""Effects: what a core call changed that the shell must act on (sans-I/O).

Every call of the core that changes a queue (:class:`~._dispatcher.Dispatcher`'s
``put_messages``, ``finish``, ``settle``, ``untake``, ``handle_timer``,
``set_lease``, and the :class:`~._process_queue.ProcessQueue` methods under them)
returns an ``Effects`` value: a bit set of the flags below. The shell applies it in
one place (wake a worker, resume a pull, wake progress waiters, re-arm the timer,
report a held assignment) instead of re-deriving those outcomes wherever it calls
the core.

The flags are plain ``int`` bits, not an ``enum.Flag``: combining enum flags runs
Python code on every call of the hot path, ints combine in C.
"""

from __future__ import annotations

from typing import Final

__all__ = (
    "COMMITTED",
    "DRAINED",
    "HELD",
    "NOTHING",
    "READY",
    "ROOM",
    "TIMER",
    "Effects",
    "describe_effects",
)

Effects = int
"""A bit set of the flags of this module."""

NOTHING: Final[Effects] = 0
READY: Final[Effects] = 1
"""A batch became ready to be taken: wake a worker."""
ROOM: Final[Effects] = 2
"""A queue whose pulling paused for flow control (see
:meth:`~._process_queue.ProcessQueue.should_pause_pull`) is back under its
thresholds: resume pulling it."""
COMMITTED: Final[Effects] = 4
"""The committed consume offset of the queue advanced to the offset the shell asked
to hear of (``ProcessQueue.notify_offset``, the lowest offset someone waits for) or
past it: wake whoever waits. Asking for it is what makes it reported, so a consumer
nobody waits on pays nothing for it."""
TIMER: Final[Effects] = 8
"""The dispatcher's timer (:meth:`~._dispatcher.Dispatcher.get_timer`) moved
earlier: re-arm it."""
HELD: Final[Effects] = 16
"""Assigning a pulled message to its stage failed (a stage callback of the listener
raised or returned a bad value): the queue holds that message and everything after
it until the assignment is retried (see ``ProcessQueue.assignment_error``)."""
DRAINED: Final[Effects] = 32
"""A dropped (released) queue has no batch left in a handler: whoever drains it can
go on (suspended batches do not count; they are never handed out again)."""

_NAMES: Final = (
    (READY, "READY"),
    (ROOM, "ROOM"),
    (COMMITTED, "COMMITTED"),
    (TIMER, "TIMER"),
    (HELD, "HELD"),
    (DRAINED, "DRAINED"),
)


def describe_effects(effects: Effects) -> str:
    """``"READY|COMMITTED"``: the flags of ``effects`` by name (for logs and tests).

    >>> describe_effects(READY | COMMITTED)
    'READY|COMMITTED'
    >>> describe_effects(NOTHING)
    'NOTHING'
    """
    names = [name for flag, name in _NAMES if effects & flag]
    return "|".join(names) if names else "NOTHING"
