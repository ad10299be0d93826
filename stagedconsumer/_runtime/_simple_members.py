"""A SimpleConsumer's membership in its group: presence (heartbeats), the group's
settings check on join, and gray release (RIP-72): which queues a member receives
from while gray and normal members are live."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc
import sniffio

from .._message import MessageQueue
from .._sources._gray import gray_ratio_of, split_gray
from .._sources._pop import PopBackend

__all__ = ("MEMBER_TTL", "Detached", "Membership", "gray_queues")

logger = logging.getLogger("stagedconsumer")

MEMBER_TTL = 30.0
"""Seconds a member stays live without a heartbeat (a killed member's presence
lasts this long)."""
HEARTBEAT = 10.0
"""Seconds between two heartbeats of a member."""


def gray_queues(
    members: Collection[str],
    me: str,
    ratio: float,
    queues: Sequence[MessageQueue],
) -> frozenset[tuple[str, int]] | None:
    """The ``(topic, queue id)``s member ``me`` receives from (``None``: all).

    A gray member takes the gray queues and a normal member the normal ones while
    members of both kinds are live; with one kind only, every queue (gray traffic is
    never stranded). When gray members disagree on the ratio the largest wins, as
    in :class:`~stagedconsumer.AllocateMessageQueueByGray`."""
    ratios = [gray_ratio_of(m) for m in {*members, me}]
    gray_ratios = [r for r in ratios if r is not None]
    if not gray_ratios or len(gray_ratios) == len(ratios):
        return None
    split = split_gray(queues, max([ratio, *gray_ratios]))
    side = split.gray if gray_ratio_of(me) is not None else split.normal
    return frozenset((mq.topic, mq.queue_id) for mq in side)


class Detached:
    """A task outside the caller's task tree (asyncio: a task of the loop; trio: a
    system task), so that an object started in one task may be closed from any other
    without a task group spanning its lifetime: for a cheap timer. ``func`` must not
    raise (on trio a system task's error would end the run)."""

    def __init__(self, func: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._done = anyio.Event()
        self._cancel: Callable[[], object]
        if sniffio.current_async_library() == "trio":
            import trio

            scope = trio.CancelScope()
            self._cancel = scope.cancel

            async def run() -> None:
                try:
                    with scope:
                        await func()
                finally:
                    self._done.set()

            trio.lowlevel.spawn_system_task(run)
        else:
            import asyncio

            task = asyncio.get_running_loop().create_task(func())
            # (done also when cancelled before it ran)
            task.add_done_callback(lambda _: self._done.set())
            self._cancel = task.cancel
            self._task = task  # (a strong reference: the loop keeps weak ones)

    async def aclose(self) -> None:
        """Cancel the task and wait until it ended."""
        self._cancel()
        with anyio.CancelScope(shield=True):
            await self._done.wait()


class Membership:
    """One consumer's presence in its pop group, and the queues gray release leaves it."""

    def __init__(self, backend: PopBackend, member: str, gray_switch: bool, ratio: float) -> None:
        self.backend = backend
        self.member = member
        self.gray_switch = gray_switch
        self.ratio = ratio
        self.heartbeat = HEARTBEAT
        self.members: list[str] = [member]
        self._queues: dict[str, list[MessageQueue]] = {}
        self._next_beat = 0.0
        self.allowed: frozenset[tuple[str, int]] | None = None
        """The queues to receive from (``None``: every subscribed one)."""

    async def join(self) -> None:
        """Register (raises :class:`ConfigurationError` when the group's live members
        use other settings)."""
        self.members = await self.backend.join(self.member, MEMBER_TTL)
        self._next_beat = anyio.current_time() + self.heartbeat
        self._update()

    def beat_due(self) -> bool:
        """Whether a heartbeat is due (:meth:`run` beats on time; a receive beats too
        when that task is late)."""
        return anyio.current_time() >= self._next_beat

    async def beat(self) -> None:
        """Refresh this member's presence and the view of the group."""
        self._next_beat = anyio.current_time() + self.heartbeat
        try:
            self.members = await self.backend.heartbeat(self.member, MEMBER_TTL)
        except Exception as exc:  # the broker is down: try again at the next beat
            logger.warning("SimpleConsumer %s: heartbeat failed: %s", self.member, exc)
            return
        self._update()

    def set_queues(self, queues: Mapping[str, list[MessageQueue]]) -> None:
        """The subscribed topics' queues (for the gray split)."""
        self._queues = dict(queues)
        self._update()

    def _update(self) -> None:
        if not self.gray_switch:
            return
        queues = [mq for mqs in self._queues.values() for mq in mqs]
        self.allowed = gray_queues(self.members, self.member, self.ratio, queues)

    def refresh(self) -> frozenset[tuple[str, int]] | None:
        """The queues to receive from now (in process: from the live members as they
        are; on Redis: as of the last heartbeat)."""
        if self.gray_switch:
            live = self.backend.live_members()
            if live is not None and live != self.members:
                self.members = live
                self._update()
        return self.allowed

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Heartbeat until cancelled: a member's presence (which the group's settings
        check and gray release rely on) must not depend on how often it receives."""
        task_status.started()
        while True:
            await anyio.sleep(max(0.0, self._next_beat - anyio.current_time()))
            if self.beat_due():
                await self.beat()

    def start_beating(self) -> Detached:
        """:meth:`run` in a detached task (the consumer may be closed from any task)."""
        return Detached(self.run)

    async def leave(self) -> None:
        try:
            with anyio.fail_after(5):
                await self.backend.leave(self.member)
        except Exception as exc:  # presence expires by itself
            logger.warning("SimpleConsumer %s: leaving the group failed: %s", self.member, exc)
