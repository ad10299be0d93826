"""Retry arithmetic: RocketMQ's delay levels and the suspend-time clamp (sans-I/O)."""

from __future__ import annotations

__all__ = ("DELAY_LEVELS", "clamp_suspend_millis", "retry_delay_seconds")

# fmt: off
DELAY_LEVELS: tuple[float, ...] = (
    1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200,
)
# fmt: on
"""RocketMQ's message delay levels in seconds: 1s 5s 10s 30s 1m 2m 3m ... 1h 2h."""

SUSPEND_MILLIS_MIN = 10
SUSPEND_MILLIS_MAX = 30_000


def clamp_suspend_millis(millis: int) -> int:
    """Clamp a suspend time to RocketMQ's range [10, 30000] ms."""
    return max(SUSPEND_MILLIS_MIN, min(SUSPEND_MILLIS_MAX, millis))


def retry_delay_seconds(reconsume_times: int, delay_level: int = 0) -> float:
    """Delay before a message sent back to the retry queue becomes visible again.

    RocketMQ's broker uses level ``3 + reconsume_times`` when the consumer asks for
    level 0, so the first retry waits 10 s, the second 30 s, and so on, capped at
    the last level (2 h). A positive ``delay_level`` (1-based) is used as given.
    """
    level = delay_level if delay_level > 0 else 3 + reconsume_times
    level = max(1, min(level, len(DELAY_LEVELS)))
    return float(DELAY_LEVELS[level - 1])
