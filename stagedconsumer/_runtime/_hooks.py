"""Hook plumbing of the runtime: failure isolation (consume and send hooks) and the
loop clock."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import anyio
import sniffio

from .._observability._hooks import (
    ConsumeMessageContext,
    ConsumeMessageHook,
    PullContext,
    SettleContext,
)
from .._observability._send_hooks import SendMessageContext, SendMessageHook
from ._shapes import overrides

__all__ = ("HookRunner", "SendHookRunner", "loop_clock", "loop_wall_offset", "thread_clock")

logger = logging.getLogger("stagedconsumer.hooks")

_LOG_EVERY = 10.0
"""Seconds between two log records of the same failing hook method."""


class _Isolation:
    """Counts the failures of hooks and logs them, at most once per 10 s per hook
    method (shell helper)."""

    __slots__ = ("_kind", "_last_logged", "_suppressed", "errors")

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self.errors = 0
        self._last_logged: dict[tuple[int, str], float] = {}
        self._suppressed: dict[tuple[int, str], int] = {}

    def failed(
        self, hook: ConsumeMessageHook | SendMessageHook, method: str, exc: BaseException
    ) -> None:
        """Count a hook failure and log it, at most once per 10 s per hook method."""
        self.errors += 1
        key = (id(hook), method)
        now = time.monotonic()
        last = self._last_logged.get(key)
        if last is not None and now - last < _LOG_EVERY:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last_logged[key] = now
        suppressed = self._suppressed.pop(key, 0)
        try:
            name = hook.hook_name
        except Exception:  # a broken hook_name must not hide the original failure
            name = type(hook).__name__
        logger.error(
            "%s hook %s failed in %s (ignored; %d similar failure(s) not logged)",
            self._kind,
            name,
            method,
            suppressed,
            exc_info=exc,
        )

    async def _close(self, hooks: Sequence[ConsumeMessageHook | SendMessageHook]) -> None:
        for hook in hooks:
            try:
                await hook.aclose()
            except Exception as exc:
                self.failed(hook, "aclose", exc)


class HookRunner(_Isolation):
    """Calls the consume hooks of one consumer, isolating their failures."""

    __slots__ = ("hooks", "pull_hooks", "settle_hooks", "wants_pull")

    def __init__(self, hooks: Sequence[ConsumeMessageHook]) -> None:
        super().__init__("consume")
        self.hooks = tuple(hooks)
        self.pull_hooks = tuple(
            h for h in self.hooks if overrides(h, ConsumeMessageHook, "messages_pulled")
        )
        self.wants_pull = bool(self.pull_hooks)
        self.settle_hooks = tuple(
            h for h in self.hooks if overrides(h, ConsumeMessageHook, "messages_settled")
        )

    def services(self) -> tuple[ConsumeMessageHook, ...]:
        """Hooks with background work (:meth:`ConsumeMessageHook.run` overridden)."""
        return tuple(h for h in self.hooks if overrides(h, ConsumeMessageHook, "run"))

    def before(self, context: ConsumeMessageContext) -> None:
        for hook in self.hooks:
            try:
                hook.consume_message_before(context)
            except Exception as exc:
                self.failed(hook, "consume_message_before", exc)

    def after(self, context: ConsumeMessageContext) -> None:
        for hook in self.hooks:
            try:
                hook.consume_message_after(context)
            except Exception as exc:
                self.failed(hook, "consume_message_after", exc)

    def pulled(self, context: PullContext) -> None:
        for hook in self.pull_hooks:
            try:
                hook.messages_pulled(context)
            except Exception as exc:
                self.failed(hook, "messages_pulled", exc)

    def settled(self, context: SettleContext) -> None:
        for hook in self.settle_hooks:
            try:
                hook.messages_settled(context)
            except Exception as exc:
                self.failed(hook, "messages_settled", exc)

    async def aclose(self) -> None:
        await self._close(self.hooks)


class SendHookRunner(_Isolation):
    """Calls the send hooks of one producer, isolating their failures."""

    __slots__ = ("hooks",)

    def __init__(self, hooks: Sequence[SendMessageHook]) -> None:
        super().__init__("send")
        self.hooks = tuple(hooks)

    def services(self) -> tuple[SendMessageHook, ...]:
        """Hooks with background work (:meth:`SendMessageHook.run` overridden)."""
        return tuple(h for h in self.hooks if overrides(h, SendMessageHook, "run"))

    def before(self, context: SendMessageContext) -> None:
        for hook in self.hooks:
            try:
                hook.send_message_before(context)
            except Exception as exc:
                self.failed(hook, "send_message_before", exc)

    def after(self, context: SendMessageContext) -> None:
        for hook in self.hooks:
            try:
                hook.send_message_after(context)
            except Exception as exc:
                self.failed(hook, "send_message_after", exc)

    async def aclose(self) -> None:
        await self._close(self.hooks)


def loop_clock() -> Callable[[], float]:
    """The running event loop's clock: the function ``anyio.current_time()`` ends up
    calling, without its per-call backend lookup (hooks read the clock several times
    per handler call). Call from inside the event loop."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return anyio.current_time
    if library == "asyncio":
        loop_time = asyncio.get_running_loop().time
        if loop_time.__func__ is asyncio.BaseEventLoop.time:  # type: ignore[attr-defined]
            return time.monotonic  # what it returns, without the Python-level call
        return loop_time
    if library == "trio":
        import trio

        return trio.current_time
    return anyio.current_time


def thread_clock() -> Callable[[], float]:
    """:func:`loop_clock`, as a function that other threads may call too (a plain
    ``def`` handler's thread reads the lease deadline against it). On trio that is the
    run's clock object (``trio.current_time()`` works only in the loop's thread); on
    asyncio the loop's ``time()``, ``time.monotonic`` for the standard loops. Call
    from inside the event loop."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return anyio.current_time
    if library == "trio":
        import trio

        return trio.lowlevel.current_clock().current_time
    return loop_clock()


def loop_wall_offset(clock: Callable[[], float] = anyio.current_time) -> float:
    """Seconds to add to a time of ``clock`` (the loop's) to get seconds since the epoch."""
    return time.time() - clock()
