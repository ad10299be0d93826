"""run_virtual: the real PushConsumer, in virtual time, with failures and crashes.

The consumer runs on trio with ``trio.testing.MockClock(autojump_threshold=0)``: when
every task waits, the clock jumps to the next deadline, so handler costs
(``anyio.sleep``), suspend times, retry delays and commit intervals take no wall
time and every timing is exact. The broker is a :class:`MemoryBroker`, the store a
:class:`MemoryOffsetStore`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
import attrs

from offsetstore import MemoryOffsetStore, QueueProgress, StoreUnavailableError

from .._listeners import (
    ConsumeConcurrentlyStatus,
    ConsumeOrderlyStatus,
    MessageListener,
    MessageListenerConcurrently,
    is_async_callable,
)
from .._message import Message, MessageQueue
from .._options import ConsumerOptions
from .._runtime._consumer import PushConsumer
from .._runtime._shapes import check_listener
from .._sources._memory import MemoryBroker
from ._log import CallLog, RecordingListener, origin_id, wrapper_type
from ._strategies import FailureKind, FailureSchedule, MessageSpec

__all__ = ("InjectedFailure", "VirtualRun", "default_seed", "run_virtual", "set_default_seed")

_default_seed: int | None = None


def set_default_seed(seed: int | None) -> None:
    """The scheduling seed :func:`run_virtual` uses when given none (the pytest
    plugin's ``--stagedconsumer-seed`` sets it)."""
    global _default_seed
    _default_seed = seed


def default_seed() -> int | None:
    return _default_seed


class InjectedFailure(Exception):
    """Raised by a handler call that a :class:`FailureSchedule` fails."""


class _QuietInjectedFailures(logging.Filter):
    """Drops the consumer's report of a scheduled failure (planned, and there may be
    thousands in a property test); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], InjectedFailure))


@attrs.frozen(kw_only=True)
class VirtualRun:
    """What :func:`run_virtual` observed."""

    log: CallLog
    """Every handler call the consumer made, in order (a ``CallLog``)."""
    sent: tuple[Message, ...]
    """The messages as the broker stored them (queue ids and offsets), in ``messages`` order."""
    makespan: float
    """Virtual seconds from the first handler call's start to the last one's end."""
    wall_seconds: float
    """Wall-clock time the run took."""
    crashes: int
    """How many crash points were reached (each followed by a restart)."""
    completed: bool
    """Every sent message finished before ``timeout`` (virtual seconds)."""
    broker: MemoryBroker
    """The ``MemoryBroker`` the run sent to and consumed from."""
    store: MemoryOffsetStore
    """The ``MemoryOffsetStore`` holding the run's committed progress."""
    crash_progress: tuple[Mapping[MessageQueue, QueueProgress], ...] = ()
    """For each crash, the progress the store held when it came (what the restart
    resumed from): consume offsets, stage offsets, finished ranges and marks."""

    @property
    def wall_ms_per_1000_messages(self) -> float:
        """Wall milliseconds the run took per thousand messages sent."""
        return self.wall_seconds * 1000 * 1000 / max(1, len(self.sent))


class _Broker(MemoryBroker):
    """Records every message it moves to a dead-letter queue in the log."""

    def __init__(self, log: CallLog) -> None:
        super().__init__()
        self.call_log = log

    async def send_to_dlq(self, group: str, message: Message) -> None:
        await super().send_to_dlq(group, message)
        self.call_log.record_dead_letter(message, anyio.current_time())


_T = TypeVar("_T")


class _CrashableStore(MemoryOffsetStore):
    """Once ``crashed``, writes vanish: a dead process persists nothing (and its
    transactions fail)."""

    crashed = False

    async def transact(
        self,
        group: str,
        mq: MessageQueue,
        offsets: Sequence[int],
        fn: Callable[[Any], _T],
        *,
        fence: int | None = None,
    ) -> _T:
        if self.crashed:
            raise StoreUnavailableError("the process crashed")
        return await super().transact(group, mq, offsets, fn, fence=fence)

    async def _write_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress]
    ) -> None:
        if not self.crashed:
            await super()._write_stored(group, progress)

    def restart(self, group: str, queues: Iterable[MessageQueue]) -> None:
        """A new process: only what was persisted survives."""
        for mq in queues:
            self.remove_offset(group, mq)
        self.crashed = False


class _Hold:
    """One thread call's hold on the clock (see :class:`_ClockGate`)."""

    __slots__ = ("done", "held")

    def __init__(self) -> None:
        self.held = False
        self.done = False


class _ClockGate:
    """Keeps the mock clock from jumping while a plain ``def`` handler computes.

    With no handler thread in flight the clock stands still and jumps to the next
    deadline whenever every task waits (``rate=0, autojump_threshold=0``). While one
    or more threads compute, every task may be waiting on them, and a jumping clock
    would race from deadline to deadline (to the consume timeout, the run's timeout)
    in a moment of wall time; so the clock then runs at wall speed and does not jump
    (``rate=1, autojump_threshold=inf``): a thread's call takes as long in virtual
    time as it blocks, and ``consume_timeout`` measures it. Each call holds the clock
    once (a :class:`_Hold`), so an abandoned call that goes on cannot unbalance the
    count. The methods run in the event loop, except :meth:`current_hold`.
    """

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.computing = 0
        self._limiter: anyio.CapacityLimiter | None = None
        self._local = threading.local()

    def _hold(self, hold: _Hold) -> None:
        if hold.held or hold.done:
            return
        hold.held = True
        self.computing += 1
        if self.computing == 1:
            self.clock.autojump_threshold = math.inf
            self.clock.rate = 1.0

    def _release(self, hold: _Hold) -> None:
        if not hold.held:
            return
        hold.held = False
        self.computing -= 1
        if self.computing == 0:
            self.clock.rate = 0.0
            self.clock.autojump_threshold = 0.0

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        """No bound of its own: the consumer's worker tasks bound the calls in flight."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(math.inf)
        return self._limiter

    def current_hold(self) -> _Hold | None:
        """In a handler thread: the hold of the call it runs."""
        hold: _Hold | None = getattr(self._local, "hold", None)
        return hold

    async def run_in_thread(self, func: Callable[..., Any], *args: Any) -> Any:
        """``func(*args)`` in a worker thread, holding the clock; cancelling the caller
        abandons the call (its thread finishes it unobserved, no longer holding the
        clock), as the consumer's own thread runner does."""
        hold = _Hold()

        def call() -> Any:
            self._local.hold = hold
            try:
                return func(*args)
            finally:
                self._local.hold = None

        self._hold(hold)
        try:
            return await anyio.to_thread.run_sync(
                call, abandon_on_cancel=True, limiter=self.limiter
            )
        finally:
            hold.done = True
            self._release(hold)

    async def sleep(self, seconds: float, hold: _Hold | None) -> None:
        """A virtual sleep taken from a handler thread (a scheduled cost): the thread
        waits on the loop meanwhile, so its call lets go of the clock."""
        if hold is None:
            await anyio.sleep(seconds)
            return
        self._release(hold)
        try:
            await anyio.sleep(seconds)
        finally:
            self._hold(hold)  # not once the call was abandoned (done)


class _Threaded(MessageListener):
    """Runs a plain ``def`` handler in a worker thread through :class:`_ClockGate`:
    to the consumer an ``async def`` handler (it awaits the thread), so a consume
    timeout cancels the await and abandons the thread's call, as it does for the
    consumer's own threads."""

    def __init__(self, inner: MessageListener, gate: _ClockGate) -> None:
        self.inner = inner
        self.gate = gate
        ordering = getattr(inner, "ordering", None)
        if ordering is not None:
            self.ordering = ordering

    async def _consume_sync(self, msgs: Sequence[Message], context: Any) -> Any:
        # wrapper_type installs this for a sync ``inner``: an async function on purpose.
        return await self.gate.run_in_thread(
            self.inner.consume_message,  # type: ignore[attr-defined]
            msgs,
            context,
        )

    _consume_async = _consume_sync  # never installed: only sync handlers are wrapped


class _Faulty(MessageListener):
    """Adds a cost (virtual sleep) to each call and fails the scheduled attempts."""

    def __init__(
        self,
        inner: MessageListener,
        index: dict[str, int],
        failures: FailureSchedule,
        cost: Callable[[Message], float] | None,
        gate: _ClockGate,
    ) -> None:
        self.inner = inner
        self.index = index
        self.failures = failures
        self.cost = cost
        self.gate = gate
        self.failure_status: object = (
            ConsumeConcurrentlyStatus.RECONSUME_LATER
            if isinstance(inner, MessageListenerConcurrently)
            else ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        )
        ordering = getattr(inner, "ordering", None)
        if ordering is not None:
            self.ordering = ordering

    def _planned(self, msgs: Sequence[Message]) -> tuple[float, FailureKind | None]:
        cost = max((self.cost(m) for m in msgs), default=0.0) if self.cost is not None else 0.0
        kind = None
        for m in msgs:
            index = self.index.get(origin_id(m))
            if index is not None:
                kind = self.failures.kind(index, m.reconsume_times + 1)
                if kind is not None:
                    break
        return cost, kind

    def _fail(self, kind: FailureKind, msgs: Sequence[Message]) -> object:
        if kind is FailureKind.RAISE:
            first = msgs[0]
            raise InjectedFailure(
                f"scheduled failure of {first.topic}:{first.queue_id}@{first.queue_offset}"
                f" attempt {first.reconsume_times + 1}"
            )
        return self.failure_status

    async def _consume_async(self, msgs: Sequence[Message], context: Any) -> Any:
        cost, kind = self._planned(msgs)
        if cost > 0:
            await anyio.sleep(cost)
        if kind is not None:
            return self._fail(kind, msgs)
        return await self.inner.consume_message(msgs, context)  # type: ignore[attr-defined]

    def _consume_sync(self, msgs: Sequence[Message], context: Any) -> Any:
        cost, kind = self._planned(msgs)
        if cost > 0:
            anyio.from_thread.run(self.gate.sleep, cost, self.gate.current_hold())
        if kind is not None:
            return self._fail(kind, msgs)
        return self.inner.consume_message(msgs, context)  # type: ignore[attr-defined]


def _cost_function(
    costs: Sequence[float] | Callable[[Message], float] | None, index: dict[str, int]
) -> Callable[[Message], float] | None:
    if costs is None or callable(costs):
        return costs
    cycle = tuple(float(c) for c in costs)
    if not cycle:
        return None
    if any(c < 0 or math.isnan(c) for c in cycle):
        raise ValueError(f"handler costs must be >= 0, got {cycle}")

    def cost(message: Message) -> float:
        return cycle[index.get(origin_id(message), 0) % len(cycle)]

    return cost


def _seed_scheduler(seed: int) -> None:
    """Seed trio's scheduler (it reverses or shuffles each batch of runnable tasks at
    random): the same seed gives the same interleaving."""
    from trio._core import _run

    generator = getattr(_run, "_r", None)
    if generator is not None:
        generator.seed(seed)


def run_virtual(
    listener: MessageListener,
    messages: Sequence[MessageSpec],
    *,
    options: ConsumerOptions | None = None,
    failures: FailureSchedule | None = None,
    costs: Sequence[float] | Callable[[Message], float] | None = None,
    crash_at: Iterable[int] = (),
    queues: int | None = None,
    group: str = "group",
    expression: str = "*",
    seed: int | None = None,
    timeout: float = 3600.0,
) -> VirtualRun:
    """Send ``messages`` to a fresh :class:`MemoryBroker` and consume them with the
    real :class:`PushConsumer` in virtual time, until every message finished.

    - ``listener``: yours, of any kind; it is wrapped in a :class:`RecordingListener`
      (pass one to use its log) and, with ``failures`` or ``costs``, in a wrapper that
      sleeps the call's cost (the largest of its messages') and fails the scheduled
      attempts without calling your handler (the consumer's log records of those
      :class:`InjectedFailure` exceptions are filtered out during the run).
    - ``costs``: seconds per message, a sequence cycled by message index, or a function.
    - ``crash_at``: crash points, each a number of handler calls ended (over all runs):
      right after the ``n``-th call ends the consumer dies (calls in flight are
      cancelled, nothing more is committed, in-memory progress is lost) and a new one
      starts from what the store persisted, with the same listener instance.
    - ``queues``: queues per topic (default: one more than the largest ``queue_id``).
    - ``seed``: seeds trio's scheduler, so one seed gives one interleaving (default:
      :func:`default_seed`; ``None`` leaves it alone, and inside ``@given`` hypothesis
      seeds it per example).
    - ``timeout``: virtual seconds; a run that has not finished by then (a message that
      fails forever) stops and comes back with ``completed=False``.

    The event-loop watchdog (``event_loop_block_threshold``) is turned off: it
    reports nothing in virtual time and costs a thread per consumer. Plain ``def``
    handlers run in worker threads as usual; while one computes, the clock stops
    jumping and runs at wall speed (a call takes as long in virtual time as it
    blocks), so ``consume_timeout`` times out a call that blocks longer, and a short
    one is not timed out in no time. Scheduled ``costs`` stay virtual. Virtual time is
    exact for ``async def`` handlers; with ``def`` ones it also holds the wall time
    their threads compute.

    Returns a :class:`VirtualRun` with the log, the messages as sent and the makespan.
    """
    try:
        import trio
        import trio.testing
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "run_virtual() needs trio, of the 'testing' extra: pip install"
            " 'stagedconsumer[testing]'",
            name=exc.name,
        ) from exc

    messages = list(messages)
    for i, spec in enumerate(messages):
        if not isinstance(spec, MessageSpec):
            raise TypeError(
                "run_virtual(): messages must be MessageSpec values (MessageSpec(topic=...,"
                " queue_id=..., body=...), or drawn from the messages() strategy), got"
                f" {type(spec).__name__} {spec!r} at index {i}"
            )
    crash_at = list(crash_at)
    for point in crash_at:
        if isinstance(point, bool) or not isinstance(point, int) or point < 1:
            raise ValueError(
                "run_virtual(): crash_at points count ended handler calls (a crash right"
                f" after the n-th), each an int >= 1; got {point!r}, which no run reaches"
            )
    if options is None:
        options = ConsumerOptions()
    if options.event_loop_block_threshold is not None:
        # The watchdog reports nothing in virtual time (the loop is never late on its
        # own clock) and starts a thread per consumer: off, for speed.
        options = attrs.evolve(options, event_loop_block_threshold=None)
    log = CallLog()
    inner = listener
    if isinstance(listener, RecordingListener):
        log, inner = listener.log, listener.inner
    check_listener(inner)  # here: the wrappers below take (*args)
    broker = _Broker(log)
    topics: dict[str, int] = {}
    for spec in messages:
        top = spec.queue_id if spec.queue_id is not None else 0
        topics[spec.topic] = max(topics.get(spec.topic, 1), top + 1)
    if not topics:
        topics["topic"] = 1
    for topic, needed in topics.items():
        count = needed if queues is None else queues
        if count < needed:
            raise ValueError(f"topic {topic!r} needs {needed} queues, queues={queues}")
        broker.create_topic(topic, count)
    sent = tuple(
        broker.send(
            spec.topic,
            spec.body,
            keys=spec.keys,
            tags=spec.tags,
            properties=spec.properties,
            queue_id=spec.queue_id,
        )
        for spec in messages
    )
    index = {m.msg_id: i for i, m in enumerate(sent)}
    clock = trio.testing.MockClock(autojump_threshold=0)
    gate = _ClockGate(clock)
    cost = _cost_function(costs, index)
    if failures is not None or cost is not None:
        faulty_type = wrapper_type(_Faulty, inner)
        inner = faulty_type(inner, index, failures or FailureSchedule(), cost, gate)
    if not is_async_callable(getattr(inner, "consume_message", None)):
        inner = wrapper_type(_Threaded, inner)(inner, gate)
    recorder = RecordingListener(inner, log)
    store = _CrashableStore()
    points = sorted(crash_at)
    wanted = set(index)
    state = {"crashes": 0, "completed": False}
    crash_progress: list[Mapping[MessageQueue, QueueProgress]] = []

    async def main() -> None:
        ended = 0
        deadline = anyio.current_time() + timeout
        while True:
            crash = anyio.Event()
            target = points[0] if points else None

            consumer = PushConsumer(group, broker, recorder, offset_store=store, options=options)
            for topic in topics:
                consumer.subscribe(topic, expression)

            def on_end(
                call: object,
                target: int | None = target,
                crash: anyio.Event = crash,
                consumer: PushConsumer = consumer,
            ) -> None:
                # The process dies here, synchronously: nothing is persisted from now
                # on and the shutdown is skipped. (Calls ending at the same virtual
                # instant, past their last checkpoint, may still end.)
                nonlocal ended
                ended += 1
                if target is not None and ended >= target and not crash.is_set():
                    store.crashed = True
                    consumer._cut_shutdown_short()
                    crash.set()

            log.on_end.append(on_end)
            try:
                async with consumer, anyio.create_task_group() as tg:

                    async def finish(consumer: PushConsumer = consumer) -> None:
                        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                            await consumer.wait_caught_up()
                            while not wanted <= log.finish_seqs().keys():
                                await anyio.sleep(1.0)
                                await consumer.wait_caught_up()
                            state["completed"] = True
                        if not state["completed"]:
                            consumer._cut_shutdown_short()
                        tg.cancel_scope.cancel()

                    async def die(crash: anyio.Event = crash) -> None:
                        await crash.wait()
                        tg.cancel_scope.cancel()

                    tg.start_soon(finish)
                    tg.start_soon(die)
            finally:
                log.on_end.remove(on_end)
            if not crash.is_set():
                return
            points.pop(0)
            state["crashes"] += 1
            crash_progress.append(await store.list_progress(group))
            if state["completed"]:
                return
            log.run += 1
            all_queues = [
                MessageQueue(topic, q)
                for topic, count in broker.statistics().topics.items()
                for q in range(count)
            ]
            store.restart(group, all_queues)

    chosen = seed if seed is not None else _default_seed
    if chosen is not None:
        _seed_scheduler(chosen)
    quiet = _QuietInjectedFailures()
    logger = logging.getLogger("stagedconsumer")
    logger.addFilter(quiet)
    began = time.perf_counter()
    try:
        trio.run(main, clock=clock)
    finally:
        wall = time.perf_counter() - began
        logger.removeFilter(quiet)
    ended_calls = [c for c in log.calls if c.ended]
    makespan = (
        max(c.end for c in ended_calls) - min(c.start for c in log.calls) if ended_calls else 0.0
    )
    return VirtualRun(
        log=log,
        sent=sent,
        makespan=makespan,
        wall_seconds=wall,
        crashes=int(state["crashes"]),
        completed=bool(state["completed"]),
        broker=broker,
        store=store,
        crash_progress=tuple(crash_progress),
    )
