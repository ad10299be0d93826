"""Pop consumption on the embedded broker: the state of a consumer group, in process.

Per queue of a subscribed topic the group keeps a cursor (the next offset never
delivered), the messages in flight (offset -> deadline and delivery attempt, with a
heap of deadlines), and for FIFO groups the lock of each message group (the offset
of its head, in flight or ready), the messages waiting behind a head, and the heads
released by an ack (``ready``). Every consumer of the group on the broker shares it,
as consumers in several processes share a group's state on Redis. Times are the
broker's clock (by default the event loop's, so virtual-time tests see virtual
invisible durations).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import weakref
from collections import deque
from collections.abc import Collection, Mapping

import anyio
import attrs

from .._exceptions import ConfigurationError
from .._filter import TagFilter
from .._message import Message
from ._memory import MemoryBroker
from ._pop import (
    InvalidReceiptHandleError,
    PopBackend,
    PopSettings,
    ReceivedMessage,
    message_group_of,
    received,
)

__all__ = ("MemoryPopBackend", "memory_pop_backend")


class _Flight:
    __slots__ = ("attempt", "deadline", "message_group")

    def __init__(self, deadline: float, attempt: int, message_group: str | None) -> None:
        self.deadline = deadline
        self.attempt = attempt
        self.message_group = message_group


class _QueueState:
    __slots__ = ("cursor", "due", "inflight", "locks", "ready", "waiting")

    def __init__(self) -> None:
        self.cursor = 0
        self.inflight: dict[int, _Flight] = {}
        self.due: list[tuple[float, int, int]] = []
        """Heap of ``(deadline, offset, attempt)``; stale entries are skipped."""
        self.locks: dict[str, int] = {}
        self.waiting: dict[str, deque[int]] = {}
        self.ready: deque[int] = deque()

    def next_due(self) -> float | None:
        due, inflight = self.due, self.inflight
        while due:
            deadline, offset, attempt = due[0]
            flight = inflight.get(offset)
            if flight is not None and flight.attempt == attempt and flight.deadline == deadline:
                return deadline
            heapq.heappop(due)
        return None


_backends: weakref.WeakKeyDictionary[MemoryBroker, dict[str, MemoryPopBackend]] = (
    weakref.WeakKeyDictionary()
)


def memory_pop_backend(broker: MemoryBroker, settings: PopSettings) -> MemoryPopBackend:
    """The shared state of ``settings.group`` on ``broker`` (made on first use)."""
    groups = _backends.setdefault(broker, {})
    backend = groups.get(settings.group)
    if backend is None:
        backend = groups[settings.group] = MemoryPopBackend(broker, settings)
    elif backend.settings != settings:
        if backend.live_members():
            raise ConfigurationError(
                f"consumer group {settings.group!r} is used on this broker with other pop"
                f" settings ({backend.settings}) by running consumers; every consumer of a"
                " group must use the same max_delivery_attempts, fifo and"
                " message_group_property (they may change once none of them runs)"
            )
        backend.settings = settings  # nobody runs the group: its state stays
    return backend


class MemoryPopBackend(PopBackend):
    """Receive, ack and invisibility of one group on a :class:`MemoryBroker`."""

    def __init__(self, broker: MemoryBroker, settings: PopSettings) -> None:
        self.broker = broker
        self.settings = settings
        self._queues: dict[tuple[str, int], _QueueState] = {}
        self._waiters: list[anyio.Event] = []
        self._rotation = itertools.count()
        self._members: dict[str, None] = {}
        """Live members (gray release), in joining order: in process, a member is live
        from its start to its close (no presence to expire)."""

    async def join(self, member: str, ttl: float) -> list[str]:
        del ttl
        self._members[member] = None
        return self.live_members()

    async def leave(self, member: str) -> None:
        self._members.pop(member, None)

    def live_members(self) -> list[str]:
        return list(self._members)

    def _state(self, topic: str, queue_id: int) -> _QueueState:
        state = self._queues.get((topic, queue_id))
        if state is None:
            state = self._queues[topic, queue_id] = _QueueState()
        return state

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.set()

    async def receive(
        self,
        consumer: str,
        subscriptions: Mapping[str, TagFilter],
        max_num: int,
        invisible_duration: float,
        timeout: float,
        queues: Collection[tuple[str, int]] | None = None,
    ) -> list[ReceivedMessage]:
        del consumer
        broker = self.broker
        end = broker._now() + timeout
        while True:
            keys = self._subscribed(subscriptions, queues)
            out = await self._take(keys, subscriptions, max_num, invisible_duration)
            now = broker._now()
            if out or now >= end:
                return out
            wait = end - now
            for key in keys:
                due = self._state(*key).next_due()
                if due is not None:
                    wait = min(wait, max(due - now, 0.0))
            await self._wait(keys, wait)

    def _subscribed(
        self, subscriptions: Mapping[str, TagFilter], allowed: Collection[tuple[str, int]] | None
    ) -> list[tuple[str, int]]:
        queues = self.broker._topics
        return [
            (topic, queue_id)
            for topic in subscriptions
            for queue_id in range(len(queues.get(topic, ())))
            if allowed is None or (topic, queue_id) in allowed
        ]

    async def _wait(self, keys: list[tuple[str, int]], wait: float) -> None:
        """Until a message is sent to a subscribed queue, the group's state changes
        (an ack released a FIFO head, an invisible duration was shortened), or
        ``wait`` seconds passed."""
        event = anyio.Event()
        thread = threading.get_ident()
        queues = [self.broker._queues_of(topic)[queue_id] for topic, queue_id in keys]
        for queue in queues:
            queue.thread = thread
            queue.waiters.append(event)
        self._waiters.append(event)
        try:
            with anyio.move_on_after(wait):
                await event.wait()
        finally:
            for queue in queues:
                if event in queue.waiters:
                    queue.waiters.remove(event)
            if event in self._waiters:
                self._waiters.remove(event)

    async def _take(
        self,
        keys: list[tuple[str, int]],
        subscriptions: Mapping[str, TagFilter],
        max_num: int,
        invisible_duration: float,
    ) -> list[ReceivedMessage]:
        broker = self.broker
        if not keys:
            return []
        start = next(self._rotation) % len(keys)
        out: list[ReceivedMessage] = []
        settings = self.settings
        fifo = settings.fifo
        for key in keys[start:] + keys[:start]:
            if len(out) >= max_num:
                break
            topic, queue_id = key
            log = broker._queues_of(topic)[queue_id].log
            state = self._state(topic, queue_id)
            accepts = subscriptions[topic]
            now = broker._now()
            # 1. messages whose invisible duration passed: again, or dead-lettered
            due, inflight = state.due, state.inflight
            while due and due[0][0] <= now and len(out) < max_num:
                deadline, offset, attempt = heapq.heappop(due)
                flight = inflight.get(offset)
                if flight is None or flight.attempt != attempt or flight.deadline != deadline:
                    continue
                if attempt >= settings.max_delivery_attempts:
                    del inflight[offset]
                    spent = settings.dead_letter(
                        attrs.evolve(log[offset], reconsume_times=attempt - 1),
                        len(broker._queues_of(topic)),
                    )
                    await broker.send_to_dlq(settings.group, spent)
                    self._release(state, flight.message_group, offset)
                    now = broker._now()
                    continue
                out.append(self._deliver(state, log[offset], attempt + 1, flight.message_group,
                                         now + invisible_duration))  # fmt: skip
            # 2. FIFO heads released by an ack
            while state.ready and len(out) < max_num:
                offset = state.ready.popleft()
                message = log[offset]
                group = message_group_of(message, settings.message_group_property)
                out.append(self._deliver(state, message, 1, group, now + invisible_duration))
            # 3. messages never delivered
            while state.cursor < len(log) and len(out) < max_num:
                message = log[state.cursor]
                state.cursor += 1
                if not accepts(message):
                    continue
                group = None
                if fifo:
                    group = message_group_of(message, settings.message_group_property)
                    if group is not None:
                        if group in state.locks:
                            state.waiting.setdefault(group, deque()).append(message.queue_offset)
                            continue
                        state.locks[group] = message.queue_offset
                out.append(self._deliver(state, message, 1, group, now + invisible_duration))
        return out

    def _deliver(
        self,
        state: _QueueState,
        message: Message,
        attempt: int,
        group: str | None,
        deadline: float,
    ) -> ReceivedMessage:
        offset = message.queue_offset
        state.inflight[offset] = _Flight(deadline, attempt, group)
        heapq.heappush(state.due, (deadline, offset, attempt))
        return received(
            message,
            attempt=attempt,
            receipt_handle=f"{offset}:{attempt}",
            message_group=group,
            group=self.settings.group,
        )

    def _release(self, state: _QueueState, group: str | None, offset: int) -> None:
        """A FIFO head is done: the next message of its group becomes ready."""
        if group is None or state.locks.get(group) != offset:
            return
        waiting = state.waiting.get(group)
        if waiting:
            following = waiting.popleft()
            if not waiting:
                del state.waiting[group]
            state.locks[group] = following
            state.ready.append(following)
            self._wake()
        else:
            del state.locks[group]

    def _holding(self, message: ReceivedMessage, what: str) -> tuple[_QueueState, _Flight]:
        if not isinstance(message, ReceivedMessage):
            raise InvalidReceiptHandleError(
                f"{what} needs a message returned by receive(), got {type(message).__name__}"
            )
        state = self._queues.get((message.topic, message.queue_id))
        flight = None if state is None else state.inflight.get(message.queue_offset)
        described = f"message {message.msg_id} (delivery attempt {message.delivery_attempt})"
        if (
            state is None
            or flight is None
            or flight.attempt != message.delivery_attempt
            or message.consumer_group != self.settings.group
        ):
            raise InvalidReceiptHandleError(
                f"{what} of {described} refused: the group {self.settings.group!r} no longer"
                " has it in flight under this receipt handle (acked already, received again"
                " after its invisible duration passed, or dead-lettered)"
            )
        if flight.deadline <= self.broker._now():
            raise InvalidReceiptHandleError(
                f"{what} of {described} refused: its invisible duration passed, the receipt"
                " handle is expired (the message is visible again and will be delivered"
                " again)"
            )
        return state, flight

    async def ack(self, message: ReceivedMessage) -> None:
        state, flight = self._holding(message, "ack")
        del state.inflight[message.queue_offset]
        self._release(state, flight.message_group, message.queue_offset)

    async def change_invisible_duration(self, message: ReceivedMessage, duration: float) -> None:
        state, flight = self._holding(message, "change_invisible_duration")
        flight.deadline = self.broker._now() + duration
        heapq.heappush(state.due, (flight.deadline, message.queue_offset, flight.attempt))
        self._wake()
