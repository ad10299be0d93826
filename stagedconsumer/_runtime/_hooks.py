"""Consume hook plumbing of the runtime: failure isolation and the loop clock."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import anyio
import sniffio

from .._observability._hooks import ConsumeMessageContext, ConsumeMessageHook, PullContext

__all__ = ("HookRunner", "loop_clock", "loop_wall_offset")

logger = logging.getLogger("stagedconsumer.hooks")

_LOG_EVERY = 10.0
"""Seconds between two log records of the same failing hook method."""


def _overrides(hook: ConsumeMessageHook, name: str) -> bool:
    return getattr(type(hook), name) is not getattr(ConsumeMessageHook, name)


class HookRunner:
    """Calls the hooks of one consumer, isolating their failures (shell helper)."""

    __slots__ = ("_last_logged", "_suppressed", "errors", "hooks", "pull_hooks", "wants_pull")

    def __init__(self, hooks: Sequence[ConsumeMessageHook]) -> None:
        self.hooks = tuple(hooks)
        self.pull_hooks = tuple(h for h in self.hooks if _overrides(h, "messages_pulled"))
        self.wants_pull = bool(self.pull_hooks)
        self.errors = 0
        self._last_logged: dict[tuple[int, str], float] = {}
        self._suppressed: dict[tuple[int, str], int] = {}

    def services(self) -> tuple[ConsumeMessageHook, ...]:
        """Hooks with background work (:meth:`ConsumeMessageHook.run` overridden)."""
        return tuple(h for h in self.hooks if _overrides(h, "run"))

    def failed(self, hook: ConsumeMessageHook, method: str, exc: BaseException) -> None:
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
            "consume hook %s failed in %s (ignored; %d similar failure(s) not logged)",
            name,
            method,
            suppressed,
            exc_info=exc,
        )

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

    async def aclose(self) -> None:
        for hook in self.hooks:
            try:
                await hook.aclose()
            except Exception as exc:
                self.failed(hook, "aclose", exc)


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


def loop_wall_offset(clock: Callable[[], float] = anyio.current_time) -> float:
    """Seconds to add to a time of ``clock`` (the loop's) to get seconds since the epoch."""
    return time.time() - clock()
