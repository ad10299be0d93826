"""The blocking API: a :class:`Producer` and a :class:`PushConsumer` driven from
synchronous code, each running on an event loop in another thread through anyio's
:class:`~anyio.from_thread.BlockingPortal` (RocketMQ 5's sync API waits on the async
one the same way).

How it is built: a blocking object hosts its async object (``async with producer:``
or ``async with consumer:``) in one task of the portal, from ``__enter__`` to
``__exit__`` (as ``BlockingPortal.wrap_async_context_manager`` does, plus what that
lacks: Ctrl-C while starting or stopping, a consumer that stops on its own, calls in
flight from other threads when the block is left). Each blocking call is one more
task of the portal, which the calling thread waits for; its exception comes out as
itself.

The portal is the caller's (``portal=``: one event loop thread for several objects)
or the object's own, started on ``__enter__`` and stopped on ``__exit__`` (with
``backend`` and ``backend_options``, as ``anyio.run`` takes them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import anyio
import anyio.from_thread
from anyio.from_thread import BlockingPortal

from offsetstore import StageKey

from .._exceptions import (
    ConfigurationError,
    ConsumerStateError,
    ProducerStateError,
    StagedConsumerError,
    WrongThreadError,
)
from .._message import MessageQueue, OutgoingMessage, SendResult
from .._observability._send_hooks import ProducerStatistics, SendMessageHook
from .._observability._view import ConsumerStatistics
from .._options import ProducerOptions
from .._sources._selectors import MessageQueueSelector
from .._sources._source import MessageSource
from ._consumer import PushConsumer
from ._producer import Producer

__all__ = ("BlockingConsumer", "BlockingProducer")

logger = logging.getLogger("stagedconsumer.blocking")

_T = TypeVar("_T")
_CM = TypeVar("_CM", bound=AbstractAsyncContextManager[Any])

BACKENDS = ("asyncio", "trio")

# Which portal each source is used on by a running blocking object: a source lives on
# one event loop (the embedded broker's waiters, redis-py's connections), so two
# objects with their own portals must not share one. Keyed by id(): the objects hold
# their source while it is registered.
_sources_lock = threading.Lock()
_sources: dict[int, tuple[BlockingPortal, int]] = {}


def _claim_source(source: MessageSource, portal: BlockingPortal, what: str) -> None:
    with _sources_lock:
        held = _sources.get(id(source))
        if held is not None and held[0] is not portal:
            raise ConfigurationError(
                f"this {type(source).__name__} is already used by a blocking producer or"
                f" consumer on another event loop thread, and a source lives on one event"
                f" loop: run the {what} on the same portal (portal=other.portal, or one"
                " anyio.from_thread.start_blocking_portal() passed to both)"
            )
        _sources[id(source)] = (portal, 1 if held is None else held[1] + 1)


def _release_source(source: MessageSource) -> None:
    with _sources_lock:
        portal, count = _sources[id(source)]
        if count == 1:
            del _sources[id(source)]
        else:
            _sources[id(source)] = (portal, count - 1)


class _LoopThread:
    """The portal an object runs on: the caller's, or its own (started by :meth:`open`,
    stopped by :meth:`close`)."""

    def __init__(
        self,
        portal: BlockingPortal | None,
        backend: str | None,
        backend_options: Mapping[str, Any] | None,
    ) -> None:
        if portal is not None:
            if not isinstance(portal, BlockingPortal):
                raise ConfigurationError(
                    f"portal must be an anyio BlockingPortal, got {type(portal).__name__}"
                )
            if backend is not None or backend_options is not None:
                raise ConfigurationError(
                    "backend and backend_options choose the event loop of an object's own"
                    " portal: pass them or portal=, not both"
                )
        else:
            if backend is None:
                backend = "asyncio"
            if backend not in BACKENDS:
                raise ConfigurationError(f"backend must be one of {BACKENDS}, got {backend!r}")
            if backend_options is not None and not isinstance(backend_options, Mapping):
                raise ConfigurationError(
                    f"backend_options must be a mapping, got {type(backend_options).__name__}"
                )
        self.given = portal
        self.backend = backend
        self.backend_options = dict(backend_options) if backend_options is not None else None
        self.portal: BlockingPortal | None = None
        self.thread: int | None = None
        """The event loop's thread (where blocking calls would wait forever)."""
        self._own: AbstractContextManager[BlockingPortal] | None = None

    def open(self) -> BlockingPortal:
        if self.given is not None:
            portal = self.given
        else:
            assert self.backend is not None
            own = anyio.from_thread.start_blocking_portal(self.backend, self.backend_options)
            portal = own.__enter__()
            self._own = own
        self.portal = portal
        try:
            self.thread = portal.call(threading.get_ident)
        except BaseException:
            self.close()
            raise
        return portal

    def close(self) -> None:
        """Stop the own portal: tasks still on it (objects that borrowed it) are
        cancelled, and the loop's thread is joined."""
        own, self._own = self._own, None
        if own is None:
            return
        portal = self.portal
        assert portal is not None
        with contextlib.suppress(RuntimeError):  # already stopped (its event loop ended)
            portal.call(portal.stop, True)
        own.__exit__(None, None, None)


def _event_loop_of_this_thread() -> str | None:
    """``"asyncio"`` or ``"trio"`` when that event loop runs in this thread (asked of
    the loops, whose state is per thread: a worker thread of theirs has none, though
    context variables such as sniffio's are copied into it), else ``None``."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            return "trio"
    return None


def check_no_event_loop(method: str, what: str) -> None:
    """Raise :class:`WrongThreadError` when an event loop runs in this thread: a
    blocking call there stops that loop, and everything on it, until it returns."""
    library = _event_loop_of_this_thread()
    if library is None:
        return
    raise WrongThreadError(
        f"{method}() blocks its thread until the call is done, and was called from a"
        f" thread running a {library} event loop, which would stall meanwhile: in async"
        f" code use the async {what} (await its method), or run the blocking call in a"
        " worker thread (anyio.to_thread.run_sync)"
    )


class _Host(Generic[_CM]):
    """Runs the async context manager ``cm`` (a producer, a consumer) in a task of a
    portal, from :meth:`start` to :meth:`stop`, and blocking calls on it in between.

    Loop side, in the host task: enter ``cm``, wait until asked to leave (or until
    ``cm`` cancels the wait itself: a consumer's failure), end the calls in flight
    (cancelled, or waited for), exit ``cm`` with the body's exception. What ``cm``'s
    exit raises is returned to the calling thread, not raised in the portal, whose
    task group it would otherwise end.
    """

    def __init__(
        self,
        cm: _CM,
        source: MessageSource,
        loop: _LoopThread,
        *,
        what: str,
        error: type[StagedConsumerError],
        cancel_calls: bool,
        cut_short: Callable[[], None] | None = None,
    ) -> None:
        self.cm = cm
        self.source = source
        self.loop = loop
        self.what = what
        self.error = error
        self.cancel_calls = cancel_calls
        self.cut_short = cut_short
        self.future: concurrent.futures.Future[BaseException | None] | None = None
        self.started = False
        """Whether ``cm`` started (even if it stopped since)."""
        self.left = False
        self.stop_errors: list[BaseException] = []
        """Errors calls raised because ``cm`` stopped on its own (their thread's body
        ends with one; leaving then raises what stopped ``cm`` instead)."""
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._body: BaseException | None = None
        # loop side
        self._accepting = False
        self._leaving = False
        self._leave: anyio.Event | None = None
        self._calls: set[anyio.CancelScope] = set()
        self._idle: anyio.Event | None = None

    # -- loop side -----------------------------------------------------------------------

    async def _run(self) -> BaseException | None:
        self._leave = anyio.Event()
        try:
            await self.cm.__aenter__()
        except BaseException as exc:
            self._started.set_exception(exc)
            raise
        self._accepting = True
        self._started.set_result(None)
        body: BaseException | None = None
        try:
            await self._leave.wait()
            body = self._body
        except BaseException as exc:  # cancelled: cm stopped itself, or the portal stops
            body = exc
        self._accepting = False
        if self.cancel_calls:
            for scope in self._calls:
                scope.cancel()
        else:
            with anyio.CancelScope(shield=True):
                while self._calls:
                    self._idle = anyio.Event()
                    await self._idle.wait()
        tb = body.__traceback__ if body is not None else None
        try:
            suppressed = await self.cm.__aexit__(type(body) if body else None, body, tb)
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                raise  # this task was cancelled (the portal stops): let it end
            if exc is body and body is self._body:
                return None  # the calling thread's own exception, raised there
            return exc
        if body is not None and body is not self._body and not suppressed:
            raise body  # a cancellation cm let through
        return None

    def _request_leave(self) -> None:
        self._leaving = True
        self._accepting = False
        assert self._leave is not None
        self._leave.set()

    async def _guarded(self, call: Callable[[], Awaitable[_T]]) -> _T:
        if self._accepting:
            with anyio.CancelScope() as scope:
                self._calls.add(scope)
                try:
                    return await call()
                finally:
                    self._calls.discard(scope)
                    if not self._calls and self._idle is not None:
                        self._idle.set()
            # cancelled by _run: the block is being left, or cm stopped on its own
        if self._leaving:
            raise self.error(f"the {self.what} stopped: its with block is being left")
        error = self.error(
            f"the {self.what} stopped; leaving its with block raises what stopped it"
        )
        self.stop_errors.append(error)
        raise error

    # -- calling thread ------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.future is not None and not self.future.done()

    def start(self) -> None:
        portal = self.loop.open()
        try:
            _claim_source(self.source, portal, self.what)
            try:
                self.future = portal.start_task_soon(self._run)
                try:
                    self._started.result()
                except BaseException:
                    if not self._started.done():  # Ctrl-C while it starts: stop it
                        self.future.cancel()
                    else:  # it failed to start: its task ends at once
                        concurrent.futures.wait([self.future])
                    raise
                self.started = True
            except BaseException:
                _release_source(self.source)
                raise
        except BaseException:
            self.loop.close()
            raise

    def stop(self, exc: BaseException | None) -> None:
        """Leave: ``cm``'s exit runs with ``exc``; raises what it raised."""
        if not self.started or self.left:
            raise self.error(f"the {self.what} is not running: nothing to leave")
        self.left = True
        try:
            error = self._leave_cm(exc)
        finally:
            _release_source(self.source)
            self.loop.close()
        if error is not None:
            raise error

    def _leave_cm(self, exc: BaseException | None) -> BaseException | None:
        future = self.future
        assert future is not None
        stopped_under_us = exc is not None and any(exc is e for e in self.stop_errors)
        self._body = None if stopped_under_us else exc
        try:
            self._soon(self._request_leave)
            concurrent.futures.wait([future])
        except BaseException:  # Ctrl-C while it stops: stop at once
            self._interrupted()
            raise
        if future.cancelled():
            return self.error(
                f"the {self.what} was stopped with its event loop before its with block"
                " was left (the object that started the portal was left first)"
            )
        return future.exception() or future.result()

    def _interrupted(self) -> None:
        if self.cut_short is not None:
            logger.warning(
                "interrupted while the %s stops: stopping at once (handler calls in"
                " flight are abandoned; what was not committed is delivered again)",
                self.what,
            )
        try:
            self._soon(self._request_leave)
            if self.cut_short is not None:
                self._soon(self.cut_short)
            assert self.future is not None
            concurrent.futures.wait([self.future])
        except BaseException:  # interrupted again: stop waiting
            pass

    def _soon(self, func: Callable[[], object]) -> None:
        """Run ``func`` on the event loop without waiting for it."""
        portal = self.loop.portal
        assert portal is not None
        with contextlib.suppress(RuntimeError):  # the portal stopped (the host task too)
            portal.start_task_soon(func)

    def check_thread(self, method: str) -> None:
        if threading.get_ident() == self.loop.thread:
            raise WrongThreadError(
                f"{method}() blocks until its event loop has done the call, and was called"
                f" from that event loop's thread (an async handler, say), where it would"
                f" wait forever: await the async {self.what}'s method instead"
            )
        check_no_event_loop(method, self.what)

    def call(self, method: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """``await call()`` on the event loop; the calling thread waits for it."""
        portal = self.loop.portal
        if not self.started or portal is None:
            raise self.error(f"{method}() needs a running {self.what}: use it in a with block")
        if self.left:
            raise self.error(f"{method}() needs a running {self.what}: its with block was left")
        self.check_thread(method)
        try:
            future = portal.start_task_soon(self._guarded, call)
        except RuntimeError as exc:
            raise self.error(f"the {self.what}'s event loop is not running") from exc
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise self.error(f"the {self.what}'s event loop was stopped") from None
        except BaseException:  # Ctrl-C while waiting: cancel the call, as async code would
            future.cancel()
            raise

    def call_sync(self, func: Callable[[], _T]) -> _T:
        """``func()`` on the event loop while ``cm`` runs (its state is the loop's),
        directly when it does not (or from the loop's own thread)."""
        portal = self.loop.portal
        if not self.running or portal is None or threading.get_ident() == self.loop.thread:
            return func()
        try:
            return portal.call(func)
        except RuntimeError:  # the portal stopped meanwhile: nothing runs there any more
            return func()


class _Blocking(Generic[_CM]):
    """What the blocking wrappers share: the event loop thread, the host of the async
    object they run, the portal while it runs, leaving the block, and blocking calls."""

    _noun = "consumer"
    """What the wrapper runs, in error messages."""
    _what = "consumer"
    """What the wrapper runs, as :class:`_Host` names it."""
    _error: type[StagedConsumerError] = ConsumerStateError
    _host: _Host[_CM] | None
    _loop: _LoopThread

    def _init_loop(
        self,
        portal: BlockingPortal | None,
        backend: str | None,
        backend_options: Mapping[str, Any] | None,
    ) -> None:
        self._loop = _LoopThread(portal, backend, backend_options)
        self._host = None

    @property
    def portal(self) -> BlockingPortal:
        """The portal it runs on (while it runs): pass it to the objects that must
        share its event loop, or ``portal.call(...)`` what must run there."""
        if self._loop.portal is None or self._host is None or not self._host.running:
            raise self._error(f"the {self._noun} is not running: use it in a with block")
        return self._loop.portal

    def _start(
        self,
        cm: _CM,
        source: MessageSource,
        *,
        cancel_calls: bool,
        cut_short: Callable[[], None] | None = None,
    ) -> None:
        """Enter the block: start ``cm`` on the loop (once)."""
        if self._host is not None:
            raise self._error(f"a {type(self).__name__} can be started only once")
        self._host = _Host(
            cm,
            source,
            self._loop,
            what=self._what,
            error=self._error,
            cancel_calls=cancel_calls,
            cut_short=cut_short,
        )
        self._host.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._host is not None
        self._host.stop(exc)

    def _call(self, method: str, call: Callable[[], Awaitable[_T]]) -> _T:
        if self._host is None:
            raise self._error(
                f"{method}() needs a running {self._noun}: use `with {type(self).__name__}(...)`"
            )
        return self._host.call(method, call)


class BlockingProducer(_Blocking[Producer]):
    """A :class:`~stagedconsumer.Producer` for synchronous code: ``send`` blocks until
    the message is stored and returns its :class:`~stagedconsumer.SendResult`.

    ::

        with BlockingProducer(broker, group="orders") as producer:
            result = producer.send("orders", b"...", keys=["order-1"])

    The producer runs on an event loop in another thread, through an anyio
    :class:`~anyio.from_thread.BlockingPortal`: ``portal`` when given (share one with
    the consumer of the same :class:`~stagedconsumer.MemoryBroker`, which lives on one
    event loop), else a portal of its own, started when the block is entered on
    ``backend`` (``"asyncio"``, the default, or ``"trio"``) with ``backend_options``
    (as :func:`anyio.run` takes them) and stopped when it is left.
    :class:`~stagedconsumer.RedisBroker` needs asyncio.

    Threads: ``send``, ``send_batch`` and ``statistics`` may be called from any thread
    (plain ``def`` handlers of a consumer included), at once, except the event loop's
    own: there (an ``async def`` handler on the same portal) they raise
    :class:`~stagedconsumer.WrongThreadError`; await ``producer.producer.send(...)``
    instead. Enter and leave the block in one thread.

    Ordering guarantee: that of :class:`~stagedconsumer.Producer`. A call returns once
    the message is stored, so calls made one after another (in one thread, or
    ordered by the caller) are stored in that order when they go to one queue;
    calls running at once from several threads are not ordered with each other.

    Errors come out as themselves (:class:`~stagedconsumer.SendTimeoutError`,
    :class:`~stagedconsumer.InvalidMessageError`, ...). Each call is bounded by
    ``options.send_msg_timeout`` (3 s), enforced on the event loop, where the
    attempt in flight can be cancelled, so there is no second timeout here. Ctrl-C
    while a call waits cancels it (the message may or may not be stored, as for any
    interrupted send). Leaving the block waits for the calls in flight from other
    threads, then flushes the send hooks; calls made after that raise
    :class:`~stagedconsumer.ProducerStateError`.
    """

    _noun = _what = "producer"
    _error = ProducerStateError

    def __init__(
        self,
        source: MessageSource,
        *,
        group: str = "DEFAULT_PRODUCER",
        options: ProducerOptions | None = None,
        portal: BlockingPortal | None = None,
        backend: str | None = None,
        backend_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.producer = Producer(source, group=group, options=options)
        """The async producer (for ``async def`` code on the same event loop)."""
        self._init_loop(portal, backend, backend_options)

    def register_send_message_hook(self, hook: SendMessageHook) -> None:
        """Run ``hook`` around every send (see :class:`~stagedconsumer.SendMessageHook`);
        before the block is entered. Hooks run on the event loop's thread."""
        self.producer.register_send_message_hook(hook)

    def __enter__(self) -> Self:
        if self._host is None:
            check_no_event_loop("BlockingProducer.__enter__", "producer")
        self._start(self.producer, self.producer.source, cancel_calls=False)
        return self

    def send(
        self,
        topic: str,
        body: bytes,
        *,
        keys: Sequence[str] | str = (),
        tags: str | None = None,
        properties: Mapping[str, str] | None = None,
        selector: MessageQueueSelector | None = None,
        arg: object = None,
        queue_id: int | None = None,
    ) -> SendResult:
        """:meth:`Producer.send <stagedconsumer.Producer.send>`, blocking: sends one
        message and returns where it was stored."""
        return self._call(
            "send",
            functools.partial(
                self.producer.send,
                topic,
                body,
                keys=keys,
                tags=tags,
                properties=properties,
                selector=selector,
                arg=arg,
                queue_id=queue_id,
            ),
        )

    def send_batch(
        self,
        topic: str,
        messages: Iterable[OutgoingMessage | bytes],
        *,
        selector: MessageQueueSelector | None = None,
        arg: object = None,
        queue_id: int | None = None,
    ) -> list[SendResult]:
        """:meth:`Producer.send_batch <stagedconsumer.Producer.send_batch>`, blocking:
        several messages to one queue, at consecutive offsets in the given order.
        ``messages`` is read in the calling thread."""
        if not isinstance(messages, (bytes, bytearray, memoryview, str)):
            messages = list(messages)  # a generator must not run on the event loop
        return self._call(
            "send_batch",
            functools.partial(
                self.producer.send_batch,
                topic,
                messages,
                selector=selector,
                arg=arg,
                queue_id=queue_id,
            ),
        )

    def statistics(self) -> ProducerStatistics:
        """A frozen snapshot of the producer's counters (taken on its event loop while
        it runs)."""
        if self._host is None:
            return self.producer.statistics()
        return self._host.call_sync(self.producer.statistics)


class BlockingConsumer(_Blocking[PushConsumer]):
    """Runs a :class:`~stagedconsumer.PushConsumer` from synchronous code: entering
    the block starts it on an event loop in another thread, leaving it stops it.

    ::

        consumer = PushConsumer("rewards", broker, Rewards())
        consumer.subscribe("orders")
        with BlockingConsumer(consumer) as running:
            running.wait_caught_up(timeout=60)

    Configure the consumer (``subscribe``, hooks, ...) before entering. The event loop
    is ``portal``'s when given (share one with a producer of the same
    :class:`~stagedconsumer.MemoryBroker`, which lives on one event loop), else a
    portal of the consumer's own on ``backend`` (``"asyncio"``, the default, or
    ``"trio"``) with ``backend_options``, stopped when the block is left.

    Handlers run as with ``async with consumer:``: ``async def`` ones as tasks on the
    event loop's thread, plain ``def`` ones in daemon worker threads, never in the
    calling thread. Ordering guarantees are the consumer's (per queue, by mode).

    Leaving the block stops the consumer as leaving ``async with consumer:`` does:
    stop pulling, let handler calls in flight finish (up to
    ``options.shutdown_timeout``; calls still running then are abandoned and
    delivered again), persist progress. Calls still waiting in other threads then
    raise :class:`~stagedconsumer.ConsumerStateError`. Errors: an exception of the block comes out
    as itself. A failure that stops the consumer on its own (an offset store that
    cannot be written, say) makes the calls waiting on it (and any later call) raise
    :class:`~stagedconsumer.ConsumerStateError`, and leaving the block raises the
    failure itself (as ``async with`` does; with an exception of the block beside
    it, both come out in an :class:`ExceptionGroup`).

    Ctrl-C: in the block (the main thread waiting in a call, or in
    :meth:`wait_stopped`, or sleeping) it raises ``KeyboardInterrupt`` there, which
    cancels the call it interrupted and leaves the block: the consumer drains as
    above, then ``KeyboardInterrupt`` goes on. A Ctrl-C while the block is being
    left (draining) stops at once: handler calls in flight are abandoned and nothing
    more is committed, so their messages are delivered again.

    Threads: the methods may be called from any thread except the event loop's own
    (where they would wait for themselves: :class:`~stagedconsumer.WrongThreadError`;
    await the consumer's methods there). Enter and leave the block in one thread.
    """

    def __init__(
        self,
        consumer: PushConsumer,
        *,
        portal: BlockingPortal | None = None,
        backend: str | None = None,
        backend_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(consumer, PushConsumer):
            raise ConfigurationError(
                f"consumer must be a PushConsumer, got {type(consumer).__name__}"
            )
        self.consumer = consumer
        """The async consumer (configure it before entering the block)."""
        self._init_loop(portal, backend, backend_options)

    @property
    def running(self) -> bool:
        """Whether the consumer runs (entered, not left, not stopped by a failure)."""
        return self._host is not None and self._host.running

    def __enter__(self) -> Self:
        if self._host is None:
            check_no_event_loop("BlockingConsumer.__enter__", "consumer (PushConsumer)")
        self._start(
            self.consumer,
            self.consumer.source,
            cancel_calls=True,
            cut_short=self.consumer._cut_shutdown_short,
        )
        return self

    def wait_caught_up(self, timeout: float | None = None) -> None:
        """:meth:`PushConsumer.wait_caught_up <stagedconsumer.PushConsumer.wait_caught_up>`,
        blocking: returns once every message available at call time has finished;
        ``TimeoutError`` after ``timeout`` seconds, naming the queues still behind.
        A paused queue that is behind holds it until resumed: without ``timeout``
        this blocks forever if the queue is never resumed."""
        self._call("wait_caught_up", functools.partial(self.consumer.wait_caught_up, timeout))

    def pause(self, targets: MessageQueue | str | Iterable[MessageQueue | str]) -> None:
        """:meth:`PushConsumer.pause <stagedconsumer.PushConsumer.pause>` (queues, or
        topics by name), done on the event loop while the consumer runs."""
        self._sync(lambda: self.consumer.pause(targets))

    def resume(self, targets: MessageQueue | str | Iterable[MessageQueue | str]) -> None:
        """:meth:`PushConsumer.resume <stagedconsumer.PushConsumer.resume>`, done on
        the event loop while the consumer runs."""
        self._sync(lambda: self.consumer.resume(targets))

    def seek(
        self, mq: MessageQueue, offset: int, *, stage_offsets: Mapping[StageKey, int] | None = None
    ) -> None:
        """:meth:`PushConsumer.seek <stagedconsumer.PushConsumer.seek>`, blocking until
        the new position is committed."""
        self._call(
            "seek", functools.partial(self.consumer.seek, mq, offset, stage_offsets=stage_offsets)
        )

    def wait_stopped(self, timeout: float | None = None) -> None:
        """Block until the consumer stops on its own (a failure, raised on leaving
        the block); ``TimeoutError`` after ``timeout`` seconds. The main thread of a
        service waits here until Ctrl-C."""
        host = self._host
        if host is None or host.future is None or not host.started:
            raise ConsumerStateError("wait_stopped() needs a running consumer: use a with block")
        host.check_thread("wait_stopped")
        done, _ = concurrent.futures.wait([host.future], timeout)
        if not done:
            raise TimeoutError(f"the consumer still runs after {timeout} s")

    def statistics(self) -> ConsumerStatistics:
        """A frozen snapshot of counters and per-queue state (taken on the event loop
        while the consumer runs)."""
        return self._sync(self.consumer.statistics)

    @property
    def assigned_queues(self) -> list[MessageQueue]:
        """The queues the consumer holds now, sorted."""
        return self._sync(lambda: self.consumer.assigned_queues)

    def _sync(self, func: Callable[[], _T]) -> _T:
        """``func()`` on the event loop while the consumer runs, here before it does."""
        if self._host is None:
            return func()
        return self._host.call_sync(func)
