"""SimpleWorker: a SimpleConsumer's receive loop, with a handler per message and a
graceful stop (what ``stagedconsumer run`` runs for a SimpleConsumer)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from types import TracebackType

import anyio
import anyio.abc

from .._exceptions import ConfigurationError, ConsumerStateError
from .._sources._pop import InvalidReceiptHandleError, ReceivedMessage
from ._simple import MAX_INVISIBLE_DURATION, MAX_MESSAGE_NUM, SimpleConsumer
from ._threads import ThreadRunner

__all__ = ("SimpleWorker",)

logger = logging.getLogger("stagedconsumer")

Handler = Callable[[ReceivedMessage], Awaitable[object]] | Callable[[ReceivedMessage], object]

_RETRY_FIRST = 0.2
_RETRY_MAX = 5.0


def _is_async(handler: object) -> bool:
    call = getattr(handler, "__call__", None)  # noqa: B004 (a callable object's own method)
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)


def _seconds(name: str, value: object, low: float, high: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low < value <= high
    ):
        raise ConfigurationError(
            f"{name} must be a number of seconds, more than {low:g} and at most {high:g},"
            f" got {value!r}"
        )
    return float(value)


def _count(name: str, value: object, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ConfigurationError(f"{name} must be an int in [1, {high}], got {value!r}")
    return value


class SimpleWorker:
    """Runs ``handler`` on each message a :class:`SimpleConsumer` receives, acks it
    when the handler returns, and stops gracefully: the receive loop you would write,
    with the shutdown you would rather not.

    ``async with SimpleWorker(consumer, handler):`` starts the consumer (unless it runs
    already; then it is left running on exit) and a loop that receives up to
    ``batch`` messages at a time, each invisible to the group for
    ``invisible_duration`` seconds, while fewer than ``concurrency`` handler calls
    run. ``handler(message)`` is an ``async def`` (run on the event loop) or a plain
    ``def`` (run in a daemon worker thread); when it returns, the message is acked. When it
    raises, the exception is logged and the message is not acked: it is delivered
    again after its invisible duration, its ``delivery_attempt`` one higher, and
    dead-lettered after ``options.max_delivery_attempts``. A handler that needs longer
    than ``invisible_duration`` calls ``consumer.change_invisible_duration(message,
    seconds)``, or the message is delivered again while it runs.

    Leaving the ``async with`` block (``stagedconsumer run`` does on SIGTERM) stops
    receiving, lets the handler calls in flight finish and ack within
    ``shutdown_timeout`` seconds, then cancels those still running and hands their
    messages back to the group (``change_invisible_duration(message, 0)``: another
    consumer receives them at once), and closes the consumer if the worker started
    it. A plain ``def`` handler still running then cannot be stopped: its thread
    runs on, and its message, handed back, may be handled twice (delivery is
    at-least-once). A receive cancelled mid-way may have taken messages this worker
    never saw: they come back after ``invisible_duration``, as do the messages of a
    process that is killed.
    """

    def __init__(
        self,
        consumer: SimpleConsumer,
        handler: Handler,
        *,
        concurrency: int = 16,
        batch: int = 16,
        invisible_duration: float = 60.0,
        shutdown_timeout: float = 30.0,
    ) -> None:
        if not isinstance(consumer, SimpleConsumer):
            raise ConfigurationError(
                f"consumer must be a SimpleConsumer, got {type(consumer).__name__}"
            )
        if not callable(handler):
            raise ConfigurationError(f"handler must be callable, got {type(handler).__name__}")
        self.consumer = consumer
        """The consumer it receives from."""
        self.handler = handler
        """Called once per received message; acked when it returns."""
        self.concurrency = _count("concurrency", concurrency, 10_000)
        """Handler calls running at once, at most."""
        self.batch = _count("batch", batch, MAX_MESSAGE_NUM)
        """Messages one receive asks for, at most (fewer when fewer slots are free)."""
        self.invisible_duration = _seconds(
            "invisible_duration", invisible_duration, 0, MAX_INVISIBLE_DURATION
        )
        """How long a received message stays invisible to the group (RocketMQ's
        ``invisibleDuration``): a handler call must finish and ack within it."""
        self.shutdown_timeout = _seconds("shutdown_timeout", shutdown_timeout, 0, math.inf)
        """Seconds leaving waits for the handler calls in flight."""
        self.acked = 0
        """Messages handled and acked."""
        self.failed = 0
        """Handler calls that raised, and acks refused or failed: those messages come
        back after their invisible duration."""
        self.handed_back = 0
        """Messages whose handler call was cancelled at shutdown, handed back."""
        self._is_async = _is_async(handler)
        self._threads = ThreadRunner(self.concurrency)
        """Daemon threads for a plain ``def`` handler: one still running at exit does
        not keep the process alive."""
        self._in_flight: dict[int, ReceivedMessage] = {}
        self._receive_error: str | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        # made on entering: the worker may be built before the event loop runs
        self._receive_scope: anyio.CancelScope
        self._handlers_scope: anyio.CancelScope
        self._done: anyio.Event
        self._entered = False
        self._stopping = False
        self._closed = False

    # -- what the run and its probes see -------------------------------------------

    @property
    def in_flight(self) -> list[ReceivedMessage]:
        """The messages received and not yet settled (their handler call runs)."""
        return list(self._in_flight.values())

    @property
    def running(self) -> bool:
        """Started and not leaving."""
        return self._entered and not self._stopping

    @property
    def receive_error(self) -> str | None:
        """Why the last receive failed (it is retried with backoff), or ``None``."""
        return self._receive_error

    # -- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> SimpleWorker:
        if self._entered:
            raise ConsumerStateError("a SimpleWorker runs once")
        self._entered = True
        self._receive_scope = anyio.CancelScope()
        self._handlers_scope = anyio.CancelScope()
        self._done = anyio.Event()
        stack = contextlib.AsyncExitStack()
        try:
            if not self.consumer._started:
                await stack.enter_async_context(self.consumer)
            tg = await stack.enter_async_context(anyio.create_task_group())
            tg.start_soon(self._run)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop receiving, drain within ``shutdown_timeout``, hand back the rest,
        close the consumer if the worker started it (see the class)."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        self._stopping = True
        started = anyio.current_time()
        in_flight = len(self._in_flight)
        self._receive_scope.cancel()
        # shielded: leaving is graceful even inside a cancelled scope
        with anyio.move_on_after(self.shutdown_timeout, shield=True):
            await self._done.wait()
        abandoned = 0
        if not self._done.is_set():
            abandoned = len(self._in_flight)
            logger.warning(
                "SimpleWorker %s: %d handler call(s) still running after shutdown_timeout="
                "%g s: cancelling them and handing their messages back",
                self.consumer.group,
                abandoned,
                self.shutdown_timeout,
                extra={"group": self.consumer.group, "abandoned_calls": abandoned},
            )
            self._handlers_scope.cancel()
        with anyio.CancelScope(shield=True):
            await self._done.wait()
        await stack.aclose()  # the loop's task group, then the consumer if started here
        self._threads.close()
        self._closed = True
        logger.info(
            "SimpleWorker %s (%s) left in %.2f s: %d handler call(s) were in flight, %d"
            " cancelled and handed back; %d acked, %d failed in all",
            self.consumer.group,
            self.consumer.client_id,
            anyio.current_time() - started,
            in_flight,
            abandoned,
            self.acked,
            self.failed,
            extra={
                "group": self.consumer.group,
                "client_id": self.consumer.client_id,
                "abandoned_calls": abandoned,
            },
        )

    # -- the loop ------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            with self._handlers_scope:
                async with anyio.create_task_group() as handlers:
                    slots = anyio.Semaphore(self.concurrency)
                    with self._receive_scope:
                        await self._receive_loop(handlers, slots)
        finally:
            self._done.set()

    async def _receive_loop(self, handlers: anyio.abc.TaskGroup, slots: anyio.Semaphore) -> None:
        delay = _RETRY_FIRST
        while True:
            await slots.acquire()
            wanted = 1
            while wanted < self.batch and slots.value > 0:
                slots.acquire_nowait()
                wanted += 1
            try:
                messages = await self.consumer.receive(wanted, self.invisible_duration)
            except ConsumerStateError:
                if self._stopping or self.consumer._closed:
                    return
                raise
            except ConfigurationError:
                raise
            except Exception as exc:
                for _ in range(wanted):
                    slots.release()
                self._receive_error = f"{type(exc).__name__}: {exc}"
                logger.warning(
                    "SimpleWorker %s: receive failed (%s); retrying in %.1f s",
                    self.consumer.group,
                    self._receive_error,
                    delay,
                    extra={"group": self.consumer.group},
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)
                continue
            self._receive_error = None
            delay = _RETRY_FIRST
            for _ in range(wanted - len(messages)):
                slots.release()
            for message in messages:
                self._in_flight[id(message)] = message
                handlers.start_soon(self._handle, message, slots)

    async def _handle(self, message: ReceivedMessage, slots: anyio.Semaphore) -> None:
        try:
            try:
                if self._is_async:
                    await self.handler(message)  # type: ignore[misc]
                else:
                    await self._threads.run_sync(self.handler, message)
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    await self._settle(message, hand_back=True)
                raise
            except Exception:
                self.failed += 1
                logger.exception(
                    "SimpleWorker %s: the handler raised on %s (delivery %d): not acked; it"
                    " is delivered again after its invisible duration (%g s)",
                    self.consumer.group,
                    message.msg_id,
                    message.delivery_attempt,
                    self.invisible_duration,
                    extra={"group": self.consumer.group, "msg_id": message.msg_id},
                )
                return
            with anyio.CancelScope(shield=True):
                await self._settle(message, hand_back=False)
        finally:
            self._in_flight.pop(id(message), None)
            slots.release()

    async def _settle(self, message: ReceivedMessage, *, hand_back: bool) -> None:
        what = "hand-back" if hand_back else "ack"
        try:
            if hand_back:
                await self.consumer.change_invisible_duration(message, 0)
                self.handed_back += 1
            else:
                # acks of calls that end while one is on its way go together
                await self.consumer.ack_async(message)
                self.acked += 1
        except InvalidReceiptHandleError:
            self.failed += 1
            logger.warning(
                "SimpleWorker %s: %s of %s refused: its invisible duration (%g s) passed"
                " (it is delivered again, perhaps was already)",
                self.consumer.group,
                what,
                message.msg_id,
                self.invisible_duration,
                extra={"group": self.consumer.group, "msg_id": message.msg_id},
            )
        except Exception:
            self.failed += 1
            logger.exception(
                "SimpleWorker %s: %s of %s failed: it is delivered again after its"
                " invisible duration",
                self.consumer.group,
                what,
                message.msg_id,
                extra={"group": self.consumer.group, "msg_id": message.msg_id},
            )
