"""Backoff arithmetic (sans-I/O): every retry loop of the project waits by these.

:class:`Backoff` is one exponential schedule (``base``, doubling, capped); the shell
asks it how long to wait after a failure and resets it after a success.
:class:`TakeoverBackoff` keeps one per queue for takeovers that keep being given up.
Nothing here reads a clock: times are passed in.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from .._message import MessageQueue

__all__ = ("Backoff", "TakeoverBackoff", "TakeoverBackoffStatistics")


@attrs.define(eq=False)
class Backoff:
    """Exponential backoff: the ``n``-th failure in a row waits
    ``min(cap, base * factor ** (n - 1))``; :meth:`reset` after a success.

    >>> b = Backoff(1.0, 5.0)
    >>> [b.failed() for _ in range(5)]
    [1.0, 2.0, 4.0, 5.0, 5.0]
    >>> b.reset(); b.failed()
    1.0
    """

    base: float
    cap: float
    factor: float = 2.0
    failures: int = 0
    """Failures in a row so far."""
    last_delay: float = 0.0
    """The delay :meth:`failed` returned last (0 after :meth:`reset`)."""

    def __attrs_post_init__(self) -> None:
        if not self.base > 0:
            raise ValueError(f"base must be > 0, got {self.base!r}")
        self.cap = max(self.cap, self.base)

    def failed(self) -> float:
        """Count one more failure; returns how long to wait before the next attempt."""
        exponent = min(self.failures, 64)  # no float overflow after many failures
        self.failures += 1
        self.last_delay = min(self.cap, self.base * self.factor**exponent)
        return self.last_delay

    def reset(self) -> None:
        """A success: the next failure waits ``base`` again."""
        self.failures = 0
        self.last_delay = 0.0


@attrs.frozen(kw_only=True)
class TakeoverBackoffStatistics:
    """A snapshot of a :class:`TakeoverBackoff`."""

    aborted: int
    """Takeovers given up so far (a lock released before it was ever renewed)."""
    backing_off: Mapping[MessageQueue, float]
    """Queues not tried again before this time (the caller's clock)."""


@attrs.define(eq=False)
class _Attempts:
    backoff: Backoff
    not_before: float = 0.0
    reported: bool = False


class TakeoverBackoff:
    """When to try again to take a queue whose takeovers keep being given up.

    A member locks a queue, then claims the queue's row in the offset store with the
    lock's epoch. When the claim is refused (the store holds a higher fence, written
    by another coordination domain or under a clock far ahead) or fails, the member
    releases the lock at once. Retried every round, that repeats forever and every
    retry moves the queue's epoch on. This keeps, per queue, how many takeovers in a
    row ended that way and holds the next attempt back: ``base``, then twice as long
    after every further one, up to ``cap``. A renewal (a takeover that held) resets
    it. After ``report_after`` in a row, :meth:`aborted` says to report it once.

    Sans-I/O: ``now`` is always an argument; nothing here reads a clock or logs.
    """

    def __init__(self, *, base: float, cap: float, report_after: int = 3) -> None:
        self.base = base
        self.cap = max(cap, base)
        self.report_after = report_after
        self._queues: dict[MessageQueue, _Attempts] = {}
        self._aborted = 0

    def may_try(self, mq: MessageQueue, now: float) -> bool:
        """Whether a takeover of ``mq`` may be attempted at ``now``."""
        attempts = self._queues.get(mq)
        return attempts is None or now >= attempts.not_before

    def aborted(self, mq: MessageQueue, now: float) -> bool:
        """A takeover of ``mq`` was given up at ``now``; returns whether to report
        it (once, when ``report_after`` takeovers in a row were given up)."""
        self._aborted += 1
        attempts = self._queues.get(mq)
        if attempts is None:
            attempts = self._queues[mq] = _Attempts(Backoff(self.base, self.cap))
        attempts.not_before = now + attempts.backoff.failed()
        if attempts.backoff.failures >= self.report_after and not attempts.reported:
            attempts.reported = True
            return True
        return False

    def retry_delay(self, mq: MessageQueue) -> float:
        """Seconds between the last given-up takeover of ``mq`` and the next try."""
        attempts = self._queues.get(mq)
        if attempts is None:
            return 0.0
        return attempts.backoff.last_delay

    def held(self, mq: MessageQueue) -> None:
        """A takeover of ``mq`` held (its lock was renewed): forget its failures."""
        self._queues.pop(mq, None)

    def statistics(self) -> TakeoverBackoffStatistics:
        return TakeoverBackoffStatistics(
            aborted=self._aborted,
            backing_off={mq: a.not_before for mq, a in self._queues.items()},
        )
