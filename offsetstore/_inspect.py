"""Stored progress rows as they are, corrupt ones included, for operators.

A consumer refuses a row it cannot read (``corrupt progress row``); an operator needs
to see it and overwrite it. :class:`StoredRow` is one row of the progress table
decoded as far as it goes: what could be read, and what could not (``problems``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

import attrs

from ._types import MessageQueue, QueueProgress, StageKey, check_offset, decode_finished

__all__ = ("MAX_FENCE", "StoredRow", "fence_problem")

MAX_FENCE: Final = 2**53
"""No fencing token is above this: lock epochs are computed as Lua numbers (doubles)
in Redis, exact only up to 2**53, and are milliseconds of a clock besides."""

_FENCE_AHEAD_MS: Final = 24 * 3600 * 1000
"""A fence further ahead of this machine's clock is reported: lock epochs are at
least the server's clock in milliseconds and grow by one per claim beyond it, so no
epoch reaches such a fence before that time, and the queue stays blocked until then."""


def fence_problem(fence: int, *, now_ms: int | None = None) -> str | None:
    """Why a stored fence blocks its queue for good (or for long), or ``None``."""
    if fence < 0:
        return f"fence {fence} is negative"
    if fence > MAX_FENCE:
        return f"fence {fence} is above 2**53, no lock epoch ever reaches it"
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    if fence > now + _FENCE_AHEAD_MS:
        days = (fence - now) / 86_400_000
        return (
            f"fence {fence} is {days:,.0f} day(s) ahead of this machine's clock (lock"
            " epochs are milliseconds of the clock): the queue stays blocked until then"
        )
    return None


@attrs.frozen(kw_only=True)
class StoredRow:
    """One stored progress row, decoded as far as it goes.

    ``consume_offset`` and ``stage_offsets`` are the readable values (``None`` when
    that part cannot be read, the raw text is then in ``raw_consume_offset`` /
    ``raw_stage_offsets``); ``fence`` is the stored fencing token; ``problems`` says
    what is wrong with the row, empty for a sound one.
    """

    queue: MessageQueue
    consume_offset: int | None
    consume_offset_readable: bool
    stage_offsets: dict[StageKey, int] | None
    raw_consume_offset: object
    raw_stage_offsets: str
    fence: int
    problems: tuple[str, ...]
    finished: tuple[tuple[int, int], ...] = ()
    """Ranges of finished offsets above the consume offset (sparse progress and the
    finished marks of exactly-once effects), first and last offset of each."""
    source: str = ""
    """The source the row belongs to (``''``: stored without one, before schema
    version 4)."""

    @property
    def corrupt(self) -> bool:
        return bool(self.problems)

    @property
    def fence_corrupt(self) -> bool:
        return fence_problem(self.fence) is not None

    def progress(self) -> QueueProgress | None:
        """The row's progress, ``None`` when a part of it cannot be read."""
        if not self.consume_offset_readable or self.stage_offsets is None:
            return None
        return QueueProgress(
            consume_offset=self.consume_offset,
            stage_offsets=self.stage_offsets,
            finished=self.finished,
        )


def decode_row(
    mq: MessageQueue,
    consume_offset: object,
    stage_text: object,
    fence: object,
    decode_stages: Callable[[str], dict[StageKey, int]],
    finished_text: object = None,
) -> StoredRow:
    """A :class:`StoredRow` from the stored columns; ``decode_stages`` decodes the
    stage offsets' text (raising ``ValueError`` / ``TypeError`` on anything else)."""
    problems: list[str] = []
    readable = True
    consume: int | None = None
    if consume_offset is not None:
        try:
            consume = int(consume_offset)  # type: ignore[call-overload]
            check_offset("consume offset", consume)
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
            readable, consume = False, None
    stages: dict[StageKey, int] | None
    try:
        stages = decode_stages(stage_text)  # type: ignore[arg-type]  # checked there
    except (TypeError, ValueError) as exc:
        problems.append(f"stage offsets cannot be read: {exc}")
        stages = None
    finished: tuple[tuple[int, int], ...] = ()
    if finished_text is not None and readable:
        try:
            finished = decode_finished(consume, str(finished_text))
        except (TypeError, ValueError) as exc:
            problems.append(f"finished ranges cannot be read: {exc}")
    fence_value = int(fence)  # type: ignore[call-overload]
    problem = fence_problem(fence_value)
    if problem is not None:
        problems.append(problem)
    return StoredRow(
        queue=mq,
        consume_offset=consume,
        consume_offset_readable=readable,
        stage_offsets=stages,
        raw_consume_offset=consume_offset,
        raw_stage_offsets=str(stage_text),
        fence=fence_value,
        problems=tuple(problems),
        finished=finished,
    )
