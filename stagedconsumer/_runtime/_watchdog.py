"""LoopWatchdog: notices an event loop blocked by a handler and names the handler.

An ``async def`` handler runs on the event loop; one that calls blocking code
(``time.sleep``, blocking I/O, long CPU work) stops every queue of the consumer, and
everything else on the loop, for as long as it runs, without a word. The watchdog
says so, once per handler, with the queue and offsets it was handling and the line
it was blocked at.

How, at no cost per message: a task on the loop beats every ``threshold / 10``
seconds (loop clock); a daemon thread checks the beat every ``threshold / 8``.
When the beat is older than half the threshold, the loop is stuck in something, and
the thread takes that something from the loop thread's stack
(``sys._current_frames()``): the worker's frame gives the batch, the frame the
worker called gives the handler, the innermost frame the line. When the loop comes
back and the beat task finds it woke at least ``threshold`` late, it logs what the
thread saw. Both read the loop's own clock: in virtual time (trio's ``MockClock``)
that clock stands still while the loop works, so nothing is reported there.

A loop that is late because the machine is overloaded is not blocked: the whole
process waits for the CPU. The watching thread then wakes late as well, while a call
blocking the loop thread leaves it on time (sleeping or waiting for I/O releases the
GIL, and Python code yields it every 5 ms). So a block during which the watching
thread itself woke a quarter of the threshold late, and the loop thread used less
than half the threshold of CPU time (a computation that blocks uses it), is counted
(``starved``) and not reported.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import anyio
import anyio.abc
import attrs
import sniffio

__all__ = ("LoopWatchdog",)

logger = logging.getLogger("stagedconsumer")


def _loop_clock() -> Callable[[], float]:
    """The running loop's clock (what ``anyio.current_time()`` reads), as a function
    that other threads may call."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_clock().current_time
    import asyncio

    return asyncio.get_running_loop().time


@attrs.frozen
class _Suspect:
    """What the loop thread was running while the loop was blocked."""

    key: CodeType
    """The handler's code (or, outside a handler, the innermost function's): a block
    is reported once per key."""
    handler: str | None
    """The handler's qualified name when a worker was in it."""
    where: str
    """``file:line in function`` of the innermost frame."""
    batch: str | None
    """Queue and offsets of the batch the handler was running."""


class LoopWatchdog:
    """Reports an event loop blocked for ``threshold`` seconds or more, once per
    handler (or per function, outside handlers), with advice.

    ``worker_codes`` are the codes of the worker loops that call handlers,
    ``batch_local`` the name of their local holding the current batch and
    ``call_local`` of their local holding the messages of the call in progress.
    """

    def __init__(
        self,
        *,
        group: str,
        threshold: float,
        worker_codes: frozenset[CodeType],
        batch_local: str,
        call_local: str,
        handler_code: CodeType | None,
    ) -> None:
        self.group = group
        self.threshold = threshold
        self.worker_codes = worker_codes
        self.batch_local = batch_local
        self.call_local = call_local
        self.handler_code = handler_code
        self.blocks = 0
        """Blocks of ``threshold`` or more seen (each one, reported or not)."""
        self._reported: set[CodeType] = set()
        self._beat = 0.0
        self._seq = 0
        self._suspect: _Suspect | None = None
        self._starved_seq = -1
        """The beat (``_seq``) during which the watching thread itself woke late."""
        self.starved = 0
        """Blocks of ``threshold`` or more not reported: the loop thread was starved."""
        self._stop = threading.Event()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Beat until cancelled, with the sampling thread beside."""
        clock = _loop_clock()
        interval = self.threshold / 10
        loop_thread = threading.get_ident()
        self._beat = clock()
        thread = threading.Thread(
            target=self._watch,
            args=(clock, loop_thread),
            name=f"stagedconsumer watchdog ({self.group})",
            daemon=True,
        )
        thread.start()
        task_status.started()
        cpu = time.thread_time()
        try:
            while True:
                due = clock() + interval
                await anyio.sleep(interval)
                now = clock()
                suspect, self._suspect = self._suspect, None
                starved = self._starved_seq == self._seq
                self._beat = now
                self._seq += 1
                late = now - due
                used, cpu = -cpu, time.thread_time()
                used += cpu  # the loop thread's CPU time since the last beat
                if late < self.threshold:
                    continue
                if starved and used < self.threshold / 2:
                    # the machine, not a call, held the loop up: this thread woke late
                    # too, and the loop thread hardly ran
                    self.blocks += 1
                    self.starved += 1
                else:
                    self._blocked(late, suspect)
        finally:
            self._stop.set()
            thread.join()  # at once: the thread waits on the event

    def _watch(self, clock: Callable[[], float], loop_thread: int) -> None:
        poll = self.threshold / 8
        half = self.threshold / 2
        sampled = -1
        expected = time.monotonic() + poll
        while not self._stop.wait(poll):
            now = time.monotonic()
            lag, expected = now - expected, now + poll
            seq = self._seq
            if lag >= self.threshold / 4:
                # This thread woke late too: the whole process was starved of CPU
                # (a blocking call on the loop thread leaves it on time: sleeping or
                # waiting releases the GIL, Python code yields it every 5 ms).
                self._starved_seq = seq
            if seq == sampled or clock() - self._beat < half:
                continue
            frame = sys._current_frames().get(loop_thread)
            suspect = self._describe(frame) if frame is not None else None
            del frame
            if self._seq == seq:  # still blocked: what it saw is what blocks
                self._suspect = suspect
                sampled = seq

    def _describe(self, innermost: FrameType) -> _Suspect | None:
        if _waiting(innermost):
            return None  # the loop waits for events: late because the machine was busy
        frame: FrameType | None = innermost
        callee: FrameType | None = None
        workers = self.worker_codes
        while frame is not None and frame.f_code not in workers:
            callee = frame
            frame = frame.f_back
        code = innermost.f_code
        where = f"{code.co_filename}:{innermost.f_lineno} in {code.co_name}"
        if frame is None or callee is None:
            return _Suspect(key=code, handler=None, where=where, batch=None)
        local = frame.f_locals
        return _Suspect(
            key=callee.f_code,
            handler=callee.f_code.co_qualname,
            where=where,
            batch=_describe_batch(local.get(self.batch_local), local.get(self.call_local)),
        )

    def _blocked(self, seconds: float, suspect: _Suspect | None) -> None:
        self.blocks += 1
        if suspect is None or suspect.key in self._reported:
            # nothing seen blocking it (the process itself was starved, or the block
            # was too short to be seen), or already reported
            return
        self._reported.add(suspect.key)
        threshold = f"event_loop_block_threshold = {self.threshold:g} s"
        if suspect.handler is None:
            logger.warning(
                "group %s: the event loop was blocked for %.1f s, at %s; every queue waited"
                " meanwhile: code on the event loop must not block (logged once per"
                " function; %s)",
                self.group,
                seconds,
                suspect.where,
                threshold,
            )
        elif suspect.key is self.handler_code:
            logger.warning(
                "group %s: the event loop was blocked for %.1f s by the async def handler"
                " %s (%s), at %s; every queue waited meanwhile. An async def handler must"
                " not call blocking code (time.sleep, blocking I/O, long computations):"
                " await instead (anyio.sleep, an async client), or make consume_message a"
                " plain def, which runs in a worker thread (logged once per handler; %s)",
                self.group,
                seconds,
                suspect.handler,
                suspect.batch,
                suspect.where,
                threshold,
            )
        else:
            logger.warning(
                "group %s: the event loop was blocked for %.1f s in %s, called around the"
                " handler (%s), at %s; every queue waited meanwhile: code on the event"
                " loop must not block (logged once per function; %s)",
                self.group,
                seconds,
                suspect.handler,
                suspect.batch,
                suspect.where,
                threshold,
            )


def _waiting(frame: FrameType) -> bool:
    """Whether ``frame`` is the event loop waiting for I/O or a timer (asyncio's
    selector, trio's I/O manager)."""
    path = frame.f_code.co_filename.replace("\\", "/")
    return path.endswith("/selectors.py") or (
        "/trio/_core/_io_" in path and frame.f_code.co_name == "get_events"
    )


def _describe_batch(batch: Any, call: Any) -> str | None:
    try:
        messages = call if isinstance(call, list) and call else batch.messages
        mq = batch.process_queue.message_queue
        first, last = messages[0].queue_offset, messages[-1].queue_offset
    except (AttributeError, IndexError, TypeError):
        return None
    offsets = f"offset {first}" if first == last else f"offsets {first} to {last}"
    return f"queue {mq}, {offsets}"
