"""Gray (canary) release, after RocketMQ's RIP-72: gray queues and gray-aware allocation.

Of each topic's queues, sorted by queue id, the **last** ``ceil(n * ratio)`` are
*gray*, the others *normal* (:func:`split_gray`). A producer sends gray traffic to
gray queues (:class:`~stagedconsumer.SelectMessageQueueByGray`); gray members of
the consumer group consume the gray queues, normal members the normal ones
(:class:`AllocateMessageQueueByGray`).

A member's gray flag and ratio travel with its membership: a gray member's id ends
with ``@gray[<ratio>]`` (RIP-72's client id marker), so every member sees who is
gray from the member list alone, on every coordinator. Changing a member's
``gray_tag`` therefore needs a restart of that member (a new member id).

A retry topic (``%RETRY%<group>``) is split differently: with two queues or more,
its last queue is gray whatever the ratio (it only has to keep gray retries apart
from normal ones); with one queue nothing of it is gray.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence

import attrs

from .._exceptions import ConfigurationError
from .._message import MessageQueue
from ._group import AllocateMessageQueueAveragely, AllocateMessageQueueStrategy
from ._source import RETRY_PREFIX

__all__ = (
    "PROPERTY_GRAY",
    "AllocateMessageQueueByGray",
    "GraySplit",
    "GrayStatistics",
    "check_gray_ratio",
    "gray_member_id",
    "gray_ratio_of",
    "is_gray_queue",
    "split_gray",
)

logger = logging.getLogger("stagedconsumer")

PROPERTY_GRAY = "GRAY"
"""Property set to ``"true"`` on a message handed back (retry or dead-letter queue)
by a consumer that took it from a gray queue: its retry goes to a gray retry queue
and the dead-letter record keeps that it was gray traffic."""

_MARKER = re.compile(r"@gray\[([^\]]*)\]$")


def check_gray_ratio(ratio: object, name: str = "gray_queue_ratio") -> float:
    """``ratio`` as a float in (0, 1], or :class:`~stagedconsumer.ConfigurationError`."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ConfigurationError(f"{name} must be a number in (0, 1], got {ratio!r}")
    if not 0 < ratio <= 1:
        raise ConfigurationError(f"{name} must be in (0, 1], got {ratio!r}")
    return float(ratio)


def gray_member_id(client_id: str, ratio: float) -> str:
    """``client_id`` marked as a gray member with ``ratio`` (``...@gray[0.1]``)."""
    return f"{client_id}@gray[{check_gray_ratio(ratio)!r}]"


def gray_ratio_of(member: str) -> float | None:
    """The ratio in a gray member's id, ``None`` for a normal member. A marker whose
    ratio does not parse or is out of (0, 1] counts as gray with RIP-72's 0.1."""
    match = _MARKER.search(member)
    if match is None:
        return None
    try:
        return check_gray_ratio(float(match.group(1)))
    except (ValueError, ConfigurationError):
        return 0.1


def is_gray_queue(topic: str, queue_id: int, queue_count: int, ratio: float) -> bool:
    """Whether queue ``queue_id`` of ``topic``'s ``queue_count`` (ids ``0..n-1``) is
    gray with ``ratio`` (as :func:`split_gray` splits them)."""
    return queue_id >= queue_count - _gray_count(topic, queue_count, ratio)


@attrs.frozen(kw_only=True)
class GraySplit:
    """Queues split into normal and gray, each sorted (topics in order, then ids)."""

    normal: tuple[MessageQueue, ...]
    gray: tuple[MessageQueue, ...]


def _gray_count(topic: str, n: int, ratio: float) -> int:
    if topic.startswith(RETRY_PREFIX):
        return 1 if n >= 2 else 0
    return min(n, math.ceil(n * ratio - 1e-9))


def split_gray(queues: Sequence[MessageQueue], ratio: float) -> GraySplit:
    """Per topic, the last ``ceil(n * ratio)`` queues (sorted by id) are gray.

    Retry topics: their last queue is gray when they have two queues or more."""
    by_topic: dict[str, list[MessageQueue]] = {}
    for mq in sorted(set(queues)):
        by_topic.setdefault(mq.topic, []).append(mq)
    normal: list[MessageQueue] = []
    gray: list[MessageQueue] = []
    for topic, mqs in by_topic.items():
        cut = len(mqs) - _gray_count(topic, len(mqs), ratio)
        normal += mqs[:cut]
        gray += mqs[cut:]
    return GraySplit(normal=tuple(normal), gray=tuple(gray))


@attrs.frozen(kw_only=True)
class GrayStatistics:
    """A snapshot of an :class:`AllocateMessageQueueByGray`."""

    ratio_disagreements: int
    """Allocations that saw gray members with different ratios (each distinct set of
    ratios is also logged once as a warning)."""
    last_ratios: tuple[float, ...]
    """The distinct ratios of the gray members in the last allocation, sorted."""


class AllocateMessageQueueByGray(AllocateMessageQueueStrategy):
    """RIP-72's ``AllocateMessageQueueByGray``, with its holes closed.

    - Gray members (ids marked ``@gray[ratio]``) share the gray queues of
      :func:`split_gray` averagely, normal members share the normal queues.
    - While no gray member is alive, every member shares **all** queues, gray ones
      included, so gray traffic is never stranded; while no normal member is alive,
      the gray members share all queues.
    - The ratio is the **largest** ratio among the gray members (its gray queues
      include those of every smaller ratio, so gray traffic sent with any of the
      members' ratios reaches a gray member); members that disagree are reported.
      ``default_ratio`` is used only to say which queues are gray while no gray
      member is alive (:meth:`gray_queues`).
    - Retry topics are split too (their last queue is gray), so gray retries stay
      with gray members; RIP-72 shared retry queues among all members.

    Pure and deterministic like every strategy: the result depends on the
    arguments alone (the disagreement counter is reporting only).
    """

    name = "gray"
    """A name for the strategy (RocketMQ's ``getName()``)."""

    def __init__(self, default_ratio: float = 0.1) -> None:
        self.default_ratio = check_gray_ratio(default_ratio, "default_ratio")
        """The gray share of queues assumed while no member says its own."""
        self._averagely = AllocateMessageQueueAveragely()
        self._disagreements = 0
        self._reported: set[tuple[float, ...]] = set()
        self._last_ratios: tuple[float, ...] = ()

    def ratio(self, members: Sequence[str]) -> float | None:
        """The ratio the gray members of ``members`` imply (``None``: none is gray)."""
        ratios = {r for r in map(gray_ratio_of, members) if r is not None}
        return max(ratios) if ratios else None

    def gray_queues(
        self, queues: Sequence[MessageQueue], members: Sequence[str]
    ) -> tuple[MessageQueue, ...]:
        """The gray queues among ``queues`` for these members (with
        ``default_ratio`` while none of them is gray)."""
        ratio = self.ratio(members)
        return split_gray(queues, ratio if ratio is not None else self.default_ratio).gray

    def allocate(
        self,
        group: str,
        current_id: str,
        queues: Sequence[MessageQueue],
        members: Sequence[str],
    ) -> list[MessageQueue]:
        if current_id not in members:
            return []
        ratios = tuple(sorted({r for r in map(gray_ratio_of, members) if r is not None}))
        self._last_ratios = ratios
        if len(ratios) > 1:
            self._disagreements += 1
            if ratios not in self._reported:
                self._reported.add(ratios)
                logger.warning(
                    "group %s: gray members disagree on gray_queue_ratio (%s); using the"
                    " largest, %s",
                    group,
                    ", ".join(map(repr, ratios)),
                    ratios[-1],
                )
        gray_members = [m for m in members if gray_ratio_of(m) is not None]
        normal_members = [m for m in members if gray_ratio_of(m) is None]
        if not gray_members or not normal_members:  # fallback: nothing stranded
            return self._averagely.allocate(group, current_id, queues, members)
        split = split_gray(queues, ratios[-1])
        if current_id in gray_members:
            return self._averagely.allocate(group, current_id, split.gray, gray_members)
        return self._averagely.allocate(group, current_id, split.normal, normal_members)

    def statistics(self) -> GrayStatistics:
        """A snapshot: ratio disagreements seen and the last ratios members gave."""
        return GrayStatistics(
            ratio_disagreements=self._disagreements, last_ratios=self._last_ratios
        )
