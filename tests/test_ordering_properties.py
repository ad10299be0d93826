"""End-to-end property tests: try to break every ordering guarantee of the runtime.

Each scenario runs the real :class:`PushConsumer` on a :class:`MemoryBroker` with the
listener wrapped in ``stagedconsumer.testing.RecordingListener``, which logs every
handler call (queue, offsets, stage, stage key, attempt, time, a global event number);
``consumer.statistics()`` is sampled at every call's start and end and from a watcher
task. The checks work from that log against the kit's naive model of the contract
(``StagePlan``; design.md sections 2 and 3), with the kit's checkers where they apply
(``assert_staged``, ``assert_orderly``, ``assert_at_least_once``):

(a) no stage-k+1 (or tail) handler of a stage key starts before every stage-k message
    of that key finished (succeeded, or went to the DLQ); every message gets the stage
    the naive model gives it;
(b) orderly handlers of a queue never overlap and run in offset order;
(c) every message finishes exactly once, as success or DLQ, none lost (the DLQ topic
    holds exactly the messages whose last attempt failed at ``max_reconsume_times``);
(d) the committed offset (sampled, and every offset the store persisted) never passes
    an unfinished message, and only moves forward;
(e) ``[]`` behaves as concurrent, ``[1] * n`` as orderly for the first n messages;
(f) after a restart from committed progress, every message gets the stage it gets
    without the restart, and nothing committed is consumed again.

Scenarios run in virtual time on trio (``MockClock(autojump_threshold=0)``): handler
costs are ``anyio.sleep(cost)``, timings are exact. A subset also runs on asyncio in
real time with tiny costs.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from offsetstore import MemoryOffsetStore, QueueProgress, StoreCommitError
from stagedconsumer import (
    TAIL_STAGE,
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PullResult,
    PushConsumer,
    SendBackResult,
    SourceError,
)
from stagedconsumer._core import retry_delay_seconds
from stagedconsumer.testing import (
    Assignment,
    CallLog,
    HandlerCall,
    RecordingListener,
    StagePlan,
    assert_at_least_once,
    assert_orderly,
    assert_staged,
    origin_id,
    stage_of,
)

from .strategies import Scenario, degenerate_orderly_sizes, scenarios, stage_sizes

TOPIC = "t"
GROUP = "g"
ORIGIN_ID = "ORIGIN_MESSAGE_ID"

QueueOffset = tuple[int, int]


# -- the event log -------------------------------------------------------------------


@attrs.define(eq=False)
class Log:
    """The handler calls (a :class:`CallLog` filled by the :class:`RecordingListener`
    that :func:`consume` wraps every listener in) and, on the same event numbering,
    samples of the committed offsets and every offset the store persisted."""

    calls: CallLog = attrs.Factory(CallLog)
    running: int = 0
    max_running: int = 0
    ends: int = 0
    consumer: PushConsumer | None = None
    samples: list[tuple[int, int, dict[int, int]]] = attrs.Factory(list)
    """(event, run, committed offset per queue of TOPIC)."""
    writes: list[tuple[int, int, dict[int, int]]] = attrs.Factory(list)
    """Every consume offset the store persisted: (event, run, offset per queue)."""
    stop_after: int | None = None
    stop: anyio.Event | None = None
    poke: anyio.Event | None = None
    marks: list[tuple[int, anyio.Event]] = attrs.Factory(list)
    """Events to set once so many handler calls ended."""
    most_unfinished: dict[int, tuple[int, int]] = attrs.Factory(dict)
    """Per queue: the most unfinished (cached + pending) messages and the widest
    offset span seen in any sample."""
    lock: threading.Lock = attrs.Factory(threading.Lock)

    def __attrs_post_init__(self) -> None:
        self.calls.on_start.append(self._started)
        self.calls.on_end.append(self._ended)

    @property
    def attempts(self) -> list[HandlerCall]:
        return self.calls.calls

    @property
    def run(self) -> int:
        """The consumer incarnation new calls belong to (0, then 1 after a restart)."""
        return self.calls.run

    @run.setter
    def run(self, value: int) -> None:
        self.calls.run = value

    def next_seq(self) -> int:
        """A new event number (the handler calls' numbering)."""
        return self.calls.next_seq()

    def sample(self) -> None:
        consumer = self.consumer
        if consumer is None:
            return
        statistics = consumer.statistics()
        committed = statistics.committed_offsets
        for mq, queue in statistics.queues.items():
            if mq.topic == TOPIC:
                unfinished = queue.cached_count + queue.pending_count
                seen = self.most_unfinished.get(mq.queue_id, (0, 0))
                self.most_unfinished[mq.queue_id] = (
                    max(seen[0], unfinished),
                    max(seen[1], queue.span),
                )
        self.samples.append(
            (
                self.next_seq(),
                self.run,
                {mq.queue_id: c for mq, c in committed.items() if mq.topic == TOPIC},
            )
        )

    def _poke(self) -> None:
        if self.poke is not None:
            self.poke.set()

    def _started(self, call: HandlerCall) -> None:
        # (No check that every message of a call has reconsume_times attempt - 1: in
        # concurrent mode a batch of the retry queue mixes messages on their second
        # and third attempts; the kit's attempt is the first message's.)
        assert all(m.topic == TOPIC for m in call.messages)
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        if on_the_loop():
            self.sample()
            self._poke()

    def _ended(self, call: HandlerCall) -> None:
        with self.lock:
            self.running -= 1
            self.ends += 1
        if not on_the_loop():
            return  # a plain def handler's worker thread: no sampling, no stopping
        self.sample()
        if self.stop is not None and self.stop_after is not None and self.ends >= self.stop_after:
            self.stop.set()
        for after, event in self.marks:
            if self.ends >= after:
                event.set()
        self._poke()


def on_the_loop() -> bool:
    """Not in a plain ``def`` handler's worker thread (the loop runs in the main thread)."""
    return threading.current_thread() is threading.main_thread()


def queue_of(call: HandlerCall) -> int:
    return call.queue.queue_id


class RecordingStore(MemoryOffsetStore):
    """A MemoryOffsetStore that logs every persisted consume offset.

    ``fail_writes``: numbers of the write transactions that fail (before writing).
    """

    def __init__(self, log: Log, fail_writes: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.log = log
        self.fail_writes = fail_writes
        self.attempted_writes = 0

    async def _write_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress]
    ) -> None:
        attempt = self.attempted_writes
        self.attempted_writes += 1
        if attempt in self.fail_writes:
            raise StoreCommitError(f"planned failure of write #{attempt}", retriable=True)
        self.log.writes.append(
            (
                self.log.next_seq(),
                self.log.run,
                {
                    mq.queue_id: p.consume_offset
                    for mq, p in progress.items()
                    if mq.topic == TOPIC and p.consume_offset is not None
                },
            )
        )
        await super()._write_stored(group, progress)


# -- listeners -----------------------------------------------------------------------


@attrs.define(eq=False)
class Behaviour:
    """Costs and failures of the handler, shared by the three listener kinds."""

    scenario: Scenario
    log: Log
    unit: float
    slow: Mapping[QueueOffset, float] = attrs.Factory(dict)
    vary_suspend: bool = True
    """On failure, set ``context.suspend_current_queue_time_millis`` (see
    :func:`chosen_suspend`); off in real time, where 30 s would be real."""

    def on_failure(self, msgs: Sequence[Message], context: Any) -> ConsumeOrderlyStatus:
        if self.vary_suspend:
            chosen = chosen_suspend(msgs[0].queue_offset, msgs[0].reconsume_times)
            if chosen is not None:
                context.suspend_current_queue_time_millis = chosen
        return _fail_how(msgs)

    async def handle(self, msgs: Sequence[Message], context: Any) -> bool:
        """Sleep the batch's cost; True when the scenario fails this attempt.

        A call of cost 0 returns without suspending, as a fast handler does: the
        consumer then runs the next messages in the same worker (its runs)."""
        q = msgs[0].queue_id
        cost = max(
            self.slow.get((q, m.queue_offset), self.scenario.cost(q, m.queue_offset)) for m in msgs
        )
        if cost:
            await anyio.sleep(cost * self.unit)
        return any(self.scenario.fails(q, m.queue_offset, m.reconsume_times) for m in msgs)


class Boom(Exception):
    pass


SUSPEND_CHOICES = (None, 5, 10, 250, 40_000)


def chosen_suspend(offset: int, reconsume_times: int) -> int | None:
    """What a failing handler sets as its suspend time (None: leave the default)."""
    return SUSPEND_CHOICES[(offset + reconsume_times) % len(SUSPEND_CHOICES)]


def _fail_how(msgs: Sequence[Message]) -> ConsumeOrderlyStatus:
    """Failures alternate between raising and returning SUSPEND_CURRENT_QUEUE_A_MOMENT."""
    m = msgs[0]
    if (m.queue_offset + m.reconsume_times) % 2:
        raise Boom(f"planned failure of {m.queue_id}:{m.queue_offset}")
    return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT


class Staged(MessageListenerStagedConcurrently):
    def __init__(self, behaviour: Behaviour, sizes: Sequence[int]) -> None:
        self.behaviour = behaviour
        self.sizes = list(sizes)

    def get_stage_definitions(self) -> Sequence[int]:
        return self.sizes

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> ConsumeOrderlyStatus | None:
        if await self.behaviour.handle(msgs, context):
            return self.behaviour.on_failure(msgs, context)
        return None


class StagedKeyed(Staged):
    """Staged listener with strategies, groups and (optionally) a reset hook."""

    def __init__(
        self,
        behaviour: Behaviour,
        strategies: Mapping[str, Sequence[int]],
        strategy_of: Callable[[Message], str | None],
        group_of: Callable[[Message], str | None],
    ) -> None:
        super().__init__(behaviour, [])
        self.strategies = strategies
        self.strategy_of = strategy_of
        self.group_of = group_of

    def get_stage_definition_strategies(self) -> Mapping[str, Sequence[int]]:
        return self.strategies

    def compute_strategy(self, msg: Message) -> str | None:
        return self.strategy_of(msg)

    def compute_group(self, msg: Message) -> str | None:
        return self.group_of(msg)


class StagedWithReset(Staged):
    def __init__(
        self, behaviour: Behaviour, sizes: Sequence[int], reset: Callable[[int], int]
    ) -> None:
        super().__init__(behaviour, sizes)
        self.reset = reset
        self.reset_calls: list[int] = []

    def reset_current_stage_offset_if_need(self, topic: str, current: int) -> int:
        assert topic == TOPIC
        self.reset_calls.append(current)
        return self.reset(current)


class Orderly(MessageListenerOrderly):
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> ConsumeOrderlyStatus | None:
        if await self.behaviour.handle(msgs, context):
            return self.behaviour.on_failure(msgs, context)
        return None


class Concurrent(MessageListenerConcurrently):
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        if await self.behaviour.handle(msgs, context):
            raise Boom("concurrent listeners are only run without failures here")


# -- running -------------------------------------------------------------------------


class ScheduledBroker(MemoryBroker):
    """A MemoryBroker with messages still to be sent at their arrival times."""

    def __init__(self) -> None:
        # The default embedded broker: the group's one consumer takes every queue's
        # lock (groups of several members are tested in test_gray.py and
        # test_memory_groups.py).
        super().__init__()
        self.pending: list[tuple[int, int, int, tuple[str, ...], str | None]] = []
        """(arrival, queue, offset, keys, tag) of the messages :func:`consume` still sends."""
        self.sent: dict[QueueOffset, Message] = {}
        self.unit = 1.0
        self.log: Log | None = None

    async def send_to_dlq(self, group: str, message: Message) -> None:
        await super().send_to_dlq(group, message)
        if self.log is not None:
            self.log.calls.record_dead_letter(message, anyio.current_time())

    def send_one(self, q: int, o: int, keys: tuple[str, ...], tag: str | None = None) -> None:
        message = self.send(TOPIC, b"x" * (o % 3), keys=keys, tags=tag, queue_id=q)
        assert message.queue_offset == o
        self.sent[q, o] = message

    def sent_queues(self) -> list[int]:
        return sorted({q for q, _ in self.sent} | {q for _, q, _, _, _ in self.pending})

    async def produce(self) -> None:
        """Send the pending messages at their arrival times (virtual or scaled)."""
        started = anyio.current_time()
        pending, self.pending = sorted(self.pending), []
        for arrival, q, o, keys, tag in pending:
            delay = started + arrival * self.unit - anyio.current_time()
            if delay > 0:
                await anyio.sleep(delay)
            self.send_one(q, o, keys, tag)


def fill(
    broker: ScheduledBroker,
    scenario: Scenario,
    keys: Callable[[int, int], Sequence[str]] | None = None,
    *,
    unit: float = 1.0,
    tags: Callable[[int, int], str | None] | None = None,
) -> dict[QueueOffset, Message]:
    """Create the topic and send the messages due at time 0; :func:`consume` sends the
    rest at their arrival times. Returns the (growing) map of sent messages."""
    broker.create_topic(TOPIC, scenario.queue_count)
    broker.unit = unit
    for q, n in enumerate(scenario.counts):
        for o in range(n):
            arrival = scenario.arrival(q, o)
            message_keys = tuple(keys(q, o)) if keys else ()
            tag = tags(q, o) if tags else None
            if arrival == 0:
                broker.send_one(q, o, message_keys, tag)
            else:
                broker.pending.append((arrival, q, o, message_keys, tag))
    return broker.sent


def options_for(scenario: Scenario, **overrides: Any) -> ConsumerOptions:
    values: dict[str, Any] = {
        "consume_thread_max": scenario.workers,
        "consume_message_batch_max_size": scenario.batch_size,
        "max_reconsume_times": scenario.max_reconsume_times,
        "suspend_current_queue_time_millis": scenario.suspend_millis,
        "persist_consumer_offset_interval": 3.0,
        "pull_batch_size": scenario.pull_batch,
        "pull_threshold_for_queue": scenario.pull_threshold,
        # No loop watchdog: in virtual time it can report nothing (the loop's clock
        # stands still while the loop works), and its beat every 0.1 virtual seconds
        # would be most of the work of a run that spans minutes of virtual time.
        "event_loop_block_threshold": None,
    }
    values.update(overrides)
    return ConsumerOptions(**values)


async def consume(
    broker: MemoryBroker,
    listener: Any,
    log: Log,
    options: ConsumerOptions,
    store: MemoryOffsetStore,
    *,
    stop_after: int | None = None,
    until: Callable[[], bool] | None = None,
    midway: tuple[int, Callable[[PushConsumer], Awaitable[None]]] | None = None,
    expression: str = "*",
    timeout: float = 100_000,
) -> PushConsumer:
    """Run one consumer until caught up (or until ``stop_after`` handler calls ended).

    ``until``: also wait for this condition (checked every virtual second), for
    concurrent mode, where a message handed to the retry queue counts as caught up.
    ``midway = (n, action)``: run ``action(consumer)`` once ``n`` handler calls ended
    (unless everything is consumed before), then go on until caught up.
    """
    if isinstance(broker, ScheduledBroker):
        broker.log = log
    recorder = RecordingListener(listener, log.calls)
    consumer = PushConsumer(GROUP, broker, recorder, offset_store=store, options=options)
    consumer.subscribe(TOPIC, expression)
    log.stop = anyio.Event()
    log.stop_after = stop_after

    async def watch() -> None:
        while True:
            log.poke = anyio.Event()
            await log.poke.wait()
            await anyio.lowlevel.checkpoint()
            log.sample()

    async def in_the_middle(after: int, action: Callable[[PushConsumer], Awaitable[None]]) -> None:
        started = False
        marked = anyio.Event()
        log.marks.append((after, marked))
        async with anyio.create_task_group() as tg:

            async def when_marked() -> None:
                nonlocal started
                await marked.wait()
                started = True
                await action(consumer)
                tg.cancel_scope.cancel()

            async def when_done() -> None:
                await consumer.wait_caught_up(timeout=timeout)
                if not started:
                    tg.cancel_scope.cancel()

            tg.start_soon(when_marked)
            tg.start_soon(when_done)

    async def caught_up_early(scheduled: ScheduledBroker, queues: list[int], when: float) -> None:
        """wait_caught_up() called while messages still arrive returns only once every
        message available at call time finished."""
        await anyio.sleep(when)
        targets = {q: len(scheduled.messages(TOPIC, q)) for q in queues}
        await consumer.wait_caught_up(timeout=timeout)
        done = finish_seq(log, running_ok=True)
        for q, target in targets.items():
            for o in range(target):
                assert (q, o) in done, f"wait_caught_up() returned before {q}:{o} finished"

    async def caught_up() -> None:
        if isinstance(broker, ScheduledBroker) and broker.pending:
            queues = broker.sent_queues()
            halfway = max(p[0] for p in broker.pending) / 2 * broker.unit
            async with anyio.create_task_group() as tg:
                if not isinstance(listener, MessageListenerConcurrently):
                    # (concurrent mode: a message sent back counts as caught up, and
                    # its listeners here do not log to ``log``)
                    tg.start_soon(caught_up_early, broker, queues, halfway)
                tg.start_soon(broker.produce)
        if midway is not None:
            await in_the_middle(*midway)
        await consumer.wait_caught_up(timeout=timeout)
        if until is not None:
            with anyio.fail_after(timeout):
                while not until():
                    await anyio.sleep(1)
        assert log.stop is not None
        log.stop.set()

    async with consumer:
        log.consumer = consumer
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            tg.start_soon(caught_up)
            await log.stop.wait()
            tg.cancel_scope.cancel()
        log.sample()
    log.consumer = None
    log.sample()
    return consumer


def run_in_virtual_time(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run ``fn(*args)`` on trio in virtual time: sleeps take no wall time."""
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


def run_asyncio(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run ``fn(*args)`` on asyncio in real time."""
    return anyio.run(fn, *args, backend="asyncio")


# -- the model and the checks (stagedconsumer.testing) ---------------------------------


def plan_for(
    sent: Mapping[QueueOffset, Message],
    definitions: Mapping[str, Sequence[int]],
    strategy_of: Callable[[Message], str | None] = lambda m: "default",
    group_of: Callable[[Message], str | None] = lambda m: None,
    reset: Callable[[int], int] | None = None,
) -> StagePlan:
    """The contract's stage of every sent message (the kit's naive model)."""
    return StagePlan.from_definitions(
        definitions,
        sent.values(),
        strategy_of,
        group_of,
        None if reset is None else lambda topic, current: reset(current),
    )


def assignments_by_offset(plan: StagePlan) -> dict[QueueOffset, Assignment]:
    """The plan by queue and offset."""
    return {
        (m.queue_id, m.queue_offset): plan.assignments[ident] for ident, m in plan.messages.items()
    }


def per_message(log: Log) -> dict[QueueOffset, list[HandlerCall]]:
    out: dict[QueueOffset, list[HandlerCall]] = defaultdict(list)
    for call in log.attempts:
        for o in call.offsets:
            out[queue_of(call), o].append(call)
    return out


def by_offset(message: Message) -> QueueOffset:
    return (message.queue_id, message.queue_offset)


def finish_seq(log: Log, *, running_ok: bool = False) -> dict[QueueOffset, int]:
    """Event number of the first event that finished each message: the end of a
    successful call, or its move to the DLQ."""
    if not running_ok:
        assert all(call.ended for call in log.attempts), "a handler call never ended"
    return log.calls.finish_seqs(key=by_offset)


def check_exactly_once(
    log: Log, broker: MemoryBroker, sent: Mapping[QueueOffset, Message], limit: int | None
) -> None:
    """(c): each message finishes once (success or DLQ), retries are consecutive and
    never overlap, nothing runs after it finished (the kit's check); a message goes to
    the DLQ only after ``limit`` retries, and the DLQ topic holds exactly those."""
    assert_at_least_once(log.calls, sent.values(), exactly_once=True)
    attempts = per_message(log)
    dead = [by_offset(letter.message) for letter in log.calls.dead_letters]
    for key in dead:
        last = max(attempts[key], key=lambda c: c.start_seq)
        assert last.failed
        assert limit is not None, f"{key} dead-lettered with unlimited retries"
        assert last.attempt - 1 >= limit, f"{key} dead-lettered after {last.attempt - 1} retries"
    dlq_topic = f"%DLQ%{GROUP}"
    dlq = broker.messages(dlq_topic) if dlq_topic in broker.statistics().topics else ()
    in_dlq = [m.properties.get(ORIGIN_ID, m.msg_id) for m in dlq]
    expected = [sent[key].msg_id for key in dead]
    assert sorted(in_dlq) == sorted(expected), "the DLQ does not hold exactly the spent messages"


def check_committed(
    log: Log,
    counts: Sequence[int],
    limit: int | None,
    *,
    final: bool = True,
    filtered: frozenset[QueueOffset] = frozenset(),
) -> None:
    """(d): no sampled or persisted committed offset passes an unfinished message
    (``filtered`` messages are never consumed: the committed offset may pass them)."""
    done = finish_seq(log)
    done.update(dict.fromkeys(filtered, 0))
    for kind, records in (("sampled", log.samples), ("persisted", log.writes)):
        latest: dict[tuple[int, int], int] = {}
        for seq, run, offsets in records:
            for q, committed in offsets.items():
                assert committed <= counts[q]
                for o in range(committed):
                    assert done.get((q, o), math.inf) <= seq, (
                        f"{kind} committed offset {committed} of queue {q} passes unfinished"
                        f" offset {o} (at event {seq})"
                    )
                if kind == "sampled":
                    assert committed >= latest.get((run, q), 0), "committed offset went back"
                    latest[run, q] = committed
    if final:
        seq, _, offsets = log.samples[-1]
        assert offsets == dict(enumerate(counts)), "not everything committed at the end"


def check_flow_control(log: Log, scenario: Scenario, *, max_span: int | None = None) -> None:
    """Pulling stops at the thresholds: a queue never holds more than
    ``threshold - 1 + pull batch`` unfinished messages (a pull is checked before it is
    made), nor spans further (concurrent mode)."""
    assert log.most_unfinished, "no sample saw the queues"
    for q, (unfinished, span) in log.most_unfinished.items():
        assert unfinished <= scenario.pull_threshold - 1 + scenario.pull_batch, (
            f"queue {q} held {unfinished} unfinished messages"
        )
        if max_span is not None:
            assert span <= max_span - 1 + scenario.pull_batch, f"queue {q} spanned {span}"


def check_barrier(log: Log, plan: StagePlan) -> None:
    """(a): every message in the stage the plan gives it, no batch mixing stage keys or
    stages, no later stage of a key started before the earlier ones finished."""
    assert_staged(log.calls, plan)


def check_orderly(log: Log, queue: int, upto: int | None = None) -> None:
    """(b): handler calls of ``queue`` (below offset ``upto``) never overlap and run in
    offset order; only a failed batch is repeated (after a restart or a re-assignment,
    a queue may go back to its committed offset)."""
    assert_orderly(log.calls, queues=[MessageQueue(TOPIC, queue)], upto=upto)


def check_concurrency_bound(log: Log, workers: int) -> None:
    assert log.max_running <= workers
    events = sorted(
        [(a.start_seq, 1) for a in log.attempts] + [(a.end_seq, -1) for a in log.attempts]
    )
    running = 0
    for _, delta in events:
        running += delta
        assert running <= workers


# -- (a) (c) (d): staged, random everything ------------------------------------------


def check_retry_delays(log: Log, scenario: Scenario, *, vary: bool, exact: bool) -> None:
    """A failed batch is retried after its suspend time (clamped to [10, 30000] ms),
    never earlier; ``exact``: exactly then (a worker is always free)."""
    for key, tries in per_message(log).items():
        tries.sort(key=lambda a: a.start_seq)
        for failed, retry in itertools.pairwise(tries):
            millis = scenario.suspend_millis
            if vary:
                chosen = chosen_suspend(failed.offsets[0], (failed.attempt - 1))
                millis = millis if chosen is None else chosen
            due = failed.end + max(10, min(30_000, millis)) / 1000
            assert retry.start >= due - 1e-6, f"{key} retried too early"
            if exact:
                assert math.isclose(retry.start, due, abs_tol=1e-6), (
                    f"{key} retried at {retry.start}, due at {due}"
                )


def staged_run(scenario: Scenario, unit: float, runner: Callable[..., Any]) -> None:
    broker = ScheduledBroker()
    sent = fill(broker, scenario, unit=unit)
    log = Log()
    vary = runner is run_in_virtual_time
    listener = Staged(Behaviour(scenario, log, unit, vary_suspend=vary), scenario.sizes)
    store = RecordingStore(log)
    runner(lambda: consume(broker, listener, log, options_for(scenario), store))
    limit = scenario.max_reconsume_times
    model = plan_for(sent, {"default": scenario.sizes})
    check_exactly_once(log, broker, sent, limit)
    check_barrier(log, model)
    check_committed(log, scenario.counts, limit)
    check_concurrency_bound(log, scenario.workers)
    check_retry_delays(log, scenario, vary=vary, exact=False)
    if scenario.total:
        check_flow_control(log, scenario)
    if scenario.sizes and all(s == 1 for s in scenario.sizes):
        for q in range(scenario.queue_count):
            check_orderly(log, q, upto=len(scenario.sizes))


@pytest.mark.slow
@given(scenarios())
def test_staged_guarantees_virtual_time(scenario: Scenario) -> None:
    staged_run(scenario, 1.0, run_in_virtual_time)


@settings(max_examples=12)
@given(
    scenarios(max_messages=12, sizes=stage_sizes(max_size=4)).map(
        lambda s: attrs.evolve(s, suspend_millis=10)
    )
)
def test_staged_guarantees_asyncio(scenario: Scenario) -> None:
    staged_run(scenario, 0.0005, run_asyncio)


# -- (b): orderly ----------------------------------------------------------------------


def orderly_run(scenario: Scenario, unit: float, runner: Callable[..., Any]) -> Log:
    broker = ScheduledBroker()
    sent = fill(broker, scenario, unit=unit)
    log = Log()
    vary = runner is run_in_virtual_time
    listener = Orderly(Behaviour(scenario, log, unit, vary_suspend=vary))
    store = RecordingStore(log)
    runner(lambda: consume(broker, listener, log, options_for(scenario), store))
    limit = scenario.max_reconsume_times
    check_exactly_once(log, broker, sent, limit)
    check_committed(log, scenario.counts, limit)
    check_concurrency_bound(log, scenario.workers)
    # in virtual time, with a worker per queue, a due retry starts at once
    exact = vary and scenario.workers >= scenario.queue_count
    check_retry_delays(log, scenario, vary=vary, exact=exact)
    if scenario.total:
        check_flow_control(log, scenario)
    for q in range(scenario.queue_count):
        check_orderly(log, q)
    return log


@pytest.mark.slow
@given(scenarios())
def test_orderly_guarantees_virtual_time(scenario: Scenario) -> None:
    orderly_run(scenario, 1.0, run_in_virtual_time)


@settings(max_examples=8)
@given(scenarios(max_messages=12).map(lambda s: attrs.evolve(s, suspend_millis=10)))
def test_orderly_guarantees_asyncio(scenario: Scenario) -> None:
    orderly_run(scenario, 0.0005, run_asyncio)


# -- (e): degenerate definitions -----------------------------------------------------


def timings(log: Log) -> dict[QueueOffset, tuple[float, float]]:
    return {(queue_of(a), o): (a.start, a.end) for a in log.attempts for o in a.offsets}


@pytest.mark.slow
@given(scenarios(sizes=st.just([]), with_failures=False))
def test_empty_definition_behaves_as_concurrent(scenario: Scenario) -> None:
    logs: dict[str, Log] = {}
    for kind in ("staged", "concurrent"):
        broker = ScheduledBroker()
        sent = fill(broker, scenario)
        log = logs[kind] = Log()
        behaviour = Behaviour(scenario, log, 1.0)
        listener: Any = Staged(behaviour, []) if kind == "staged" else Concurrent(behaviour)
        run_in_virtual_time(
            consume, broker, listener, log, options_for(scenario), MemoryOffsetStore()
        )
        check_exactly_once(log, broker, sent, None)
        check_concurrency_bound(log, scenario.workers)
    staged, concurrent = logs["staged"], logs["concurrent"]
    assert all(a.stage_index == TAIL_STAGE for a in staged.attempts)
    if (
        min(scenario.costs) >= 1
        and scenario.batch_size == 1
        and set(scenario.gaps) == {0}
        and scenario.pull_threshold >= max(scenario.counts)
    ):
        # everything is pulled at time 0 and every call takes time: all workers busy
        expected = min(scenario.workers, scenario.total)
        assert staged.max_running == concurrent.max_running == expected, (
            "[] does not reach concurrent's concurrency"
        )
    if scenario.queue_count == 1 and scenario.batch_size == 1:
        # one queue, one message per call: the schedule is deterministic, and the same
        assert timings(staged) == timings(concurrent), "[] is scheduled differently"


@pytest.mark.slow
@given(scenarios(sizes=degenerate_orderly_sizes()))
def test_all_ones_behaves_as_orderly_for_the_first_n(scenario: Scenario) -> None:
    n = len(scenario.sizes)
    broker = ScheduledBroker()
    sent = fill(broker, scenario)
    log = Log()
    listener = Staged(Behaviour(scenario, log, 1.0), scenario.sizes)
    run_in_virtual_time(
        lambda: consume(broker, listener, log, options_for(scenario), RecordingStore(log))
    )
    limit = scenario.max_reconsume_times
    check_exactly_once(log, broker, sent, limit)
    check_barrier(log, plan_for(sent, {"default": scenario.sizes}))
    for q in range(scenario.queue_count):
        check_orderly(log, q, upto=n)
    for a in log.attempts:
        if a.offsets[0] < n:
            assert a.offsets == (a.offsets[0],), "a batch of [1]*n crossed a stage"


@pytest.mark.slow
@given(
    scenarios(sizes=degenerate_orderly_sizes(), max_queues=1, with_failures=False, batch=st.just(1))
)
def test_all_ones_has_orderly_timing_on_one_queue(scenario: Scenario) -> None:
    n = len(scenario.sizes)
    runs: dict[str, Log] = {}
    for kind in ("staged", "orderly"):
        broker = ScheduledBroker()
        fill(broker, scenario)
        log = runs[kind] = Log()
        behaviour = Behaviour(scenario, log, 1.0)
        listener: Any = (
            Staged(behaviour, scenario.sizes) if kind == "staged" else Orderly(behaviour)
        )
        run_in_virtual_time(
            consume, broker, listener, log, options_for(scenario), MemoryOffsetStore()
        )
    staged = {k: v for k, v in timings(runs["staged"]).items() if k[1] < n}
    orderly = {k: v for k, v in timings(runs["orderly"]).items() if k[1] < n}
    assert staged == orderly


# -- (f): restart from committed progress ----------------------------------------------


def forget_memory(store: MemoryOffsetStore, scenario: Scenario) -> None:
    """Drop the store's in-memory table, as a new process would start without it: the
    next consumer reads only what the first one managed to persist."""
    for q in range(scenario.queue_count):
        store.remove_offset(GROUP, MessageQueue(TOPIC, q))


RESETS: dict[str, Callable[[int], int] | None] = {
    "none": None,
    "cycle": lambda current: 0 if current >= 5 else current,
    "zero": lambda current: 0,
    "skip": lambda current: current + 2 if current in (0, 3) else current,
}


def restart_listener(scenario: Scenario, log: Log, reset: str) -> Staged:
    behaviour = Behaviour(scenario, log, 1.0)
    hook = RESETS[reset]
    if hook is None:
        return Staged(behaviour, scenario.sizes)
    return StagedWithReset(behaviour, scenario.sizes, hook)


@pytest.mark.slow
@given(
    scenarios(),
    st.integers(0, 40),
    st.sampled_from(sorted(RESETS)),
    st.sampled_from([0.5, 3.0, 1000.0]),
    st.sampled_from([30.0, 30.0, 0.5]),
    st.frozensets(st.integers(0, 8), max_size=4),
)
def test_restart_assigns_the_same_stages(
    scenario: Scenario,
    stop_after: int,
    reset: str,
    persist_interval: float,
    shutdown_timeout: float,
    fail_writes: frozenset[int],
) -> None:
    """(f), including handler calls cancelled by a short shutdown timeout (their
    messages stay uncommitted and are consumed again by the second consumer) and
    failed store writes (the second consumer resumes from older, consistent progress)."""
    scenario = attrs.evolve(scenario, gaps=(0,))  # every message sent before the first run
    limit = scenario.max_reconsume_times
    options = options_for(
        scenario,
        persist_consumer_offset_interval=persist_interval,
        shutdown_timeout=shutdown_timeout,
    )
    # uninterrupted
    broker = ScheduledBroker()
    sent = fill(broker, scenario)
    log = Log()
    run_in_virtual_time(
        lambda: consume(
            broker, restart_listener(scenario, log, reset), log, options, RecordingStore(log)
        )
    )
    model = plan_for(sent, {"default": scenario.sizes}, reset=RESETS[reset])
    check_barrier(log, model)
    expected = {(queue_of(a), o): a.stage_index for a in log.attempts for o in a.offsets}
    # interrupted after `stop_after` handler calls, then resumed by a second consumer
    broker = ScheduledBroker()
    fill(broker, scenario)
    log = Log()
    store = RecordingStore(log, fail_writes)

    async def twice() -> None:
        await consume(
            broker,
            restart_listener(scenario, log, reset),
            log,
            options,
            store,
            stop_after=stop_after,
        )
        log.run = 1
        forget_memory(store, scenario)
        await consume(broker, restart_listener(scenario, log, reset), log, options, store)

    run_in_virtual_time(twice)
    for a in log.attempts:
        for o in a.offsets:
            assert a.stage_index == expected[queue_of(a), o], (
                f"{queue_of(a)}:{o} got stage {a.stage_index} in run {a.run},"
                f" {expected[queue_of(a), o]} without the restart"
            )
    # nothing lost, nothing committed consumed again
    persisted = dict.fromkeys(range(scenario.queue_count), 0)
    for _, run, offsets in log.writes:
        if run == 0:
            for q, c in offsets.items():
                persisted[q] = max(persisted[q], c)
    for a in log.attempts:
        if a.run == 1:
            assert a.offsets[-1] >= persisted[queue_of(a)], "a committed message was consumed again"
    assert set(per_message(log)) == set(sent), "a message was lost across the restart"
    check_committed(log, scenario.counts, limit)


# -- groups, strategies and the reset hook -----------------------------------------


TAGS = ("s1", "s2", "none")
"""Strategy tags (a strategy id no definition has holds its queue instead: see
test_lifecycle.py and the core's state machine)."""
SLOW = 1000.0
"""Cost of the message that blocks its stage key (more than all other work together)."""


def keyed_strategy(message: Message) -> str | None:
    tag = message.keys[0]
    return {"s1": "s1", "s2": "s2", "none": None}[tag]


def keyed_group(message: Message) -> str | None:
    return message.keys[1] or None


@pytest.mark.slow
@given(
    scenarios(),
    stage_sizes(max_size=4),
    st.lists(
        st.tuples(st.sampled_from(TAGS), st.sampled_from(["", "a", "b"])), min_size=1, max_size=12
    ),
)
def test_groups_and_strategies_are_independent_stage_sequences(
    scenario: Scenario, sizes2: list[int], tags: list[tuple[str, str]]
) -> None:
    definitions = {"s1": list(scenario.sizes), "s2": sizes2}
    broker = ScheduledBroker()
    sent = fill(broker, scenario, keys=lambda q, o: tags[(q * 7 + o) % len(tags)])
    log = Log()
    listener = StagedKeyed(Behaviour(scenario, log, 1.0), definitions, keyed_strategy, keyed_group)
    run_in_virtual_time(
        lambda: consume(broker, listener, log, options_for(scenario), RecordingStore(log))
    )
    limit = scenario.max_reconsume_times
    model = plan_for(sent, definitions, keyed_strategy, keyed_group)
    check_exactly_once(log, broker, sent, limit)
    check_barrier(log, model)
    check_committed(log, scenario.counts, limit)
    check_concurrency_bound(log, scenario.workers)


@pytest.mark.slow
@settings(max_examples=30)
@given(
    scenarios(with_failures=False, max_queues=2, batch=st.just(1)),
    st.lists(
        st.tuples(st.sampled_from(TAGS), st.sampled_from(["", "a", "b"])), min_size=1, max_size=12
    ),
)
def test_a_blocked_stage_key_never_blocks_other_keys(
    scenario: Scenario, tags: list[tuple[str, str]]
) -> None:
    """One message per queue takes forever; only later stages of its own key wait."""
    # (flow control may legitimately stop pulling behind the slow message: not here)
    scenario = attrs.evolve(scenario, pull_threshold=1000)
    definitions = {"s1": list(scenario.sizes) or [1], "s2": [2, 1]}
    broker = ScheduledBroker()
    sent = fill(broker, scenario, keys=lambda q, o: tags[(q * 7 + o) % len(tags)])
    slow = {(q, 0): SLOW for q in range(scenario.queue_count) if scenario.counts[q]}
    log = Log()
    listener = StagedKeyed(
        Behaviour(scenario, log, 1.0, slow=slow), definitions, keyed_strategy, keyed_group
    )
    run_in_virtual_time(
        lambda: consume(
            broker,
            listener,
            log,
            options_for(
                scenario,
                consume_thread_max=len(slow) + scenario.workers,
                persist_consumer_offset_interval=SLOW,
                pull_long_polling_timeout=SLOW,
                consume_timeout=None,  # the slow call is slow, not hung: never timed out
            ),
            RecordingStore(log),
        )
    )
    plan = plan_for(sent, definitions, keyed_strategy, keyed_group)
    check_barrier(log, plan)
    model = assignments_by_offset(plan)
    for (q, o), assigned in model.items():
        if (q, 0) not in slow or o == 0:
            continue
        blocker = model[q, 0]
        blocked = (
            assigned.key is not None
            and assigned.key == blocker.key
            and assigned.epoch != blocker.epoch
        )
        (attempt,) = [a for a in log.attempts if queue_of(a) == q and o in a.offsets]
        if blocked:
            assert attempt.start >= SLOW
        else:
            assert attempt.end < SLOW, (
                f"{q}:{o} (key {assigned.key}) waited for the slow message of key {blocker.key}"
            )


@pytest.mark.slow
@given(scenarios(), st.sampled_from(sorted(set(RESETS) - {"none"})))
def test_reset_hook_applies_only_at_stage_boundaries(scenario: Scenario, reset: str) -> None:
    broker = ScheduledBroker()
    sent = fill(broker, scenario)
    log = Log()
    hook = RESETS[reset]
    assert hook is not None
    listener = StagedWithReset(Behaviour(scenario, log, 1.0), scenario.sizes, hook)
    run_in_virtual_time(
        lambda: consume(broker, listener, log, options_for(scenario), RecordingStore(log))
    )
    limit = scenario.max_reconsume_times
    sizes = scenario.sizes
    for current in listener.reset_calls:
        # the first offset of a stage, or in the tail (the kit's naive stage model)
        at_start = current == 0 or stage_of(sizes, current - 1) != stage_of(sizes, current)
        assert at_start or stage_of(sizes, current) == -1, f"hook consulted mid-stage at {current}"
    model = plan_for(sent, {"default": scenario.sizes}, reset=hook)
    check_exactly_once(log, broker, sent, limit)
    check_barrier(log, model)
    check_committed(log, scenario.counts, limit)


# -- speed sanity: staged makespan in virtual time ------------------------------------


def makespan(log: Log) -> float:
    return max(a.end for a in log.attempts) - min(a.start for a in log.attempts)


def constant(
    sizes: Sequence[int], messages: int | Sequence[int], workers: int, batch: int = 1
) -> Scenario:
    """Constant cost 1, every message in the broker up front, pulled in one go."""
    return Scenario(
        sizes=tuple(sizes),
        counts=(messages,) if isinstance(messages, int) else tuple(messages),
        costs=(1,),
        batch_size=batch,
        workers=workers,
        failures=frozenset(),
        max_reconsume_times=None,
        suspend_millis=1000,
        pull_batch=1024,
    )


def staged_makespan(scenario: Scenario, listener_kind: str = "staged") -> float:
    broker = ScheduledBroker()
    fill(broker, scenario)
    log = Log()
    behaviour = Behaviour(scenario, log, 1.0)
    listener: Any
    if listener_kind == "staged":
        listener = Staged(behaviour, scenario.sizes)
    elif listener_kind == "orderly":
        listener = Orderly(behaviour)
    else:
        listener = Concurrent(behaviour)
    run_in_virtual_time(consume, broker, listener, log, options_for(scenario), MemoryOffsetStore())
    return makespan(log) if log.attempts else 0


def test_rip22_example_takes_six_units_staged_and_100_orderly() -> None:
    scenario = constant([10, 20, 70], 100, 20)
    assert staged_makespan(scenario) == 6
    assert staged_makespan(scenario, "orderly") == 100
    assert staged_makespan(scenario, "concurrent") == 5


@pytest.mark.slow
@given(stage_sizes(max_size=12), st.integers(1, 60), st.integers(1, 12), st.integers(1, 5))
def test_staged_makespan_is_the_sum_of_stage_rounds(
    sizes: list[int], messages: int, workers: int, batch: int
) -> None:
    """Each stage takes ceil(batches / workers) rounds; batches fill up to the batch
    size but never cross a stage (RIP-22: 6 units for [10, 20, 70], 20 workers)."""
    queue = [
        Message(topic=TOPIC, queue_id=0, queue_offset=o, body=b"", msg_id=str(o))
        for o in range(messages)
    ]
    plan = plan_for({(0, m.queue_offset): m for m in queue}, {"default": sizes})
    per_stage: dict[int, int] = defaultdict(int)
    for m in queue:
        per_stage[plan.stage_of(m)] += 1
    bound = sum(math.ceil(math.ceil(count / batch) / workers) for count in per_stage.values())
    assert staged_makespan(constant(sizes, messages, workers, batch)) == bound


@pytest.mark.slow
@given(st.lists(st.integers(0, 30), min_size=1, max_size=4), st.integers(1, 5), st.integers(0, 4))
def test_orderly_queues_run_in_parallel_and_concurrent_fills_every_worker(
    counts: list[int], batch: int, spare: int
) -> None:
    """Orderly: one batch at a time per queue, queues in parallel when there are
    enough workers (makespan = the longest queue). Concurrent: list scheduling of
    equal calls (makespan = ceil(batches / workers))."""
    workers = len(counts) + spare
    orderly = staged_makespan(constant([], counts, workers, batch), "orderly")
    assert orderly == max(math.ceil(n / batch) for n in counts)
    batches = sum(math.ceil(n / batch) for n in counts)
    concurrent = staged_makespan(constant([], counts, workers, batch), "concurrent")
    assert concurrent == math.ceil(batches / workers)


# -- concurrent mode: failures go through the retry queue ---------------------------


class ConcurrentWithRetries(MessageListenerConcurrently):
    """Records each call by original message (retries come from ``%RETRY%<group>``)."""

    def __init__(self, scenario: Scenario, sent: Mapping[QueueOffset, Message]) -> None:
        self.scenario = scenario
        self.sent = sent  # grows while messages arrive
        self.origin: dict[str, QueueOffset] = {}
        self.calls: list[tuple[QueueOffset, int, bool, float, float]] = []
        """(original queue and offset, reconsume_times, failed, start, end)."""

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        if len(self.origin) < len(self.sent):
            self.origin = {m.msg_id: key for key, m in self.sent.items()}
        keys = [self.origin[m.properties.get(ORIGIN_ID, m.msg_id)] for m in msgs]
        assert all(m.topic == TOPIC for m in msgs), "retry topic not restored"
        start = anyio.current_time()
        await anyio.sleep(max(self.scenario.cost(q, o) for q, o in keys))
        failed = any(
            self.scenario.fails(q, o, m.reconsume_times)
            for (q, o), m in zip(keys, msgs, strict=True)
        )
        end = anyio.current_time()
        ack = len(msgs) - 1
        first, rt = keys[0][1], msgs[0].reconsume_times
        if not failed and len(msgs) > 1 and (first + rt) % 2 == 0:
            # partial success: messages after ack_index go back as failed
            ack = min(len(msgs) - 2, (first + rt) % 3 - 1)
            context.ack_index = ack
        for i, (key, m) in enumerate(zip(keys, msgs, strict=True)):
            self.calls.append((key, m.reconsume_times, failed or i > ack, start, end))
        if failed:
            raise Boom("planned failure")


class FlakyBroker(ScheduledBroker):
    """Fails the n-th call of pull (of TOPIC), send_back and send_to_dlq as planned."""

    def __init__(self, failures: Mapping[str, frozenset[int]]) -> None:
        super().__init__()
        self.failures = failures
        self.calls: dict[str, int] = defaultdict(int)

    def _maybe_fail(self, what: str) -> None:
        n = self.calls[what]
        self.calls[what] += 1
        if n in self.failures.get(what, frozenset()):
            raise SourceError(f"planned {what} failure #{n}")

    async def pull(
        self, mq: MessageQueue, offset: int, max_count: int, *, timeout: float = 0.0
    ) -> PullResult:
        if mq.topic == TOPIC:
            self._maybe_fail("pull")
        return await super().pull(mq, offset, max_count, timeout=timeout)

    async def send_back(
        self, group: str, message: Message, *, delay_level: int = 0, max_reconsume_times: int = 16
    ) -> SendBackResult:
        self._maybe_fail("send_back")
        return await super().send_back(
            group, message, delay_level=delay_level, max_reconsume_times=max_reconsume_times
        )

    async def send_to_dlq(self, group: str, message: Message) -> None:
        self._maybe_fail("dlq")
        await super().send_to_dlq(group, message)


source_failures = st.fixed_dictionaries(
    {
        "pull": st.frozensets(st.integers(0, 30), max_size=5),
        "send_back": st.frozensets(st.integers(0, 8), max_size=3),
        "dlq": st.frozensets(st.integers(0, 4), max_size=3),
    }
)


@pytest.mark.slow
@given(scenarios(), st.sampled_from(["staged", "orderly"]), source_failures)
def test_source_failures_do_not_break_guarantees(
    scenario: Scenario, mode: str, failures: Mapping[str, frozenset[int]]
) -> None:
    """Failed pulls and failed moves to the DLQ are retried; every guarantee holds."""
    broker = FlakyBroker(failures)
    sent = fill(broker, scenario)
    log = Log()
    behaviour = Behaviour(scenario, log, 1.0)
    listener: Any = Staged(behaviour, scenario.sizes) if mode == "staged" else Orderly(behaviour)
    run_in_virtual_time(consume, broker, listener, log, options_for(scenario), RecordingStore(log))
    limit = scenario.max_reconsume_times
    check_exactly_once(log, broker, sent, limit)
    check_committed(log, scenario.counts, limit)
    check_concurrency_bound(log, scenario.workers)
    if mode == "staged":
        check_barrier(log, plan_for(sent, {"default": scenario.sizes}))
    else:
        for q in range(scenario.queue_count):
            check_orderly(log, q)


@pytest.mark.slow
@given(scenarios(max_messages=15), source_failures, st.sampled_from([2000, 1, 3, 6]))
def test_concurrent_failures_retry_with_delay_then_dead_letter(
    scenario: Scenario, failures: Mapping[str, frozenset[int]], max_span: int
) -> None:
    """(c) for concurrent mode: every message finishes once, as success or DLQ, after
    retries through the retry queue that each wait RocketMQ's delay for its level (or
    5 s locally when the source could not take it back)."""
    broker = FlakyBroker(failures)
    sent = fill(broker, scenario)
    limit = scenario.max_reconsume_times
    effective = 16 if limit is None else limit
    log = Log()
    listener = ConcurrentWithRetries(scenario, sent)

    def all_final() -> bool:
        final = {k for k, _, failed, _, _ in listener.calls if not failed}
        final |= {listener.origin[origin_id(d.message)] for d in log.calls.dead_letters}
        return len(final) == scenario.total and not broker.pending

    run_in_virtual_time(
        functools.partial(
            consume,
            broker,
            listener,
            log,
            options_for(scenario, consume_concurrently_max_span=max_span),
            RecordingStore(log),
            until=all_final,
        )
    )
    calls: dict[QueueOffset, list[tuple[int, bool, float, float]]] = defaultdict(list)
    for key, rt, failed, start, end in listener.calls:
        calls[key].append((rt, failed, start, end))
    assert set(calls) == set(sent), "a message was never consumed"
    dead: dict[QueueOffset, int] = defaultdict(int)
    for letter in log.calls.dead_letters:
        dead[listener.origin[origin_id(letter.message)]] += 1
    flaky = bool(failures["send_back"] or failures["dlq"])
    for key, tries in calls.items():
        tries.sort(key=lambda t: t[2])
        assert [t[0] for t in tries] == list(range(len(tries))), f"{key}: {tries}"
        assert all(t[1] for t in tries[:-1]), f"{key} consumed again after success"
        rt, failed, _, _ = tries[-1]
        assert (0 if failed else 1) + dead[key] == 1, f"{key} did not finish exactly once"
        if failed:
            assert rt >= effective, f"{key} dead-lettered after {rt} retries"
        for (rt0, _, _, end0), (_, _, start1, _) in itertools.pairwise(tries):
            delay = retry_delay_seconds(rt0)
            if flaky:
                delay = min(delay, 5.0)  # kept and retried locally when send_back failed
            assert start1 >= end0 + delay, f"{key} retried too early"
    dlq_topic = f"%DLQ%{GROUP}"
    dlq = broker.messages(dlq_topic) if dlq_topic in broker.statistics().topics else ()
    expected = [sent[key].msg_id for key, n in dead.items() if n]
    assert sorted(m.properties.get(ORIGIN_ID, m.msg_id) for m in dlq) == sorted(expected)
    _, _, offsets = log.samples[-1]
    assert offsets == dict(enumerate(scenario.counts))
    if scenario.total:
        check_flow_control(log, scenario, max_span=max_span)


# -- releasing and re-assigning a queue (rebalance) -------------------------------------


@pytest.mark.slow
@given(
    scenarios(),
    st.sampled_from(["staged", "orderly"]),
    st.integers(0, 30),
    st.integers(0, 2),
    st.sampled_from(sorted(RESETS)),
)
def test_release_and_reassign_keeps_stages_and_loses_nothing(
    scenario: Scenario, mode: str, after: int, which: int, reset: str
) -> None:
    """Releasing a queue mid-run and assigning it again resumes from its committed
    progress: same stages as without it, nothing committed consumed again, no loss,
    and (orderly) no overlap with the handler calls of the released queue."""
    scenario = attrs.evolve(scenario, gaps=(0,))
    q = which % scenario.queue_count
    limit = scenario.max_reconsume_times

    def listener_for(log: Log) -> Any:
        if mode == "orderly":
            return Orderly(Behaviour(scenario, log, 1.0))
        return restart_listener(scenario, log, reset)

    broker = ScheduledBroker()
    sent = fill(broker, scenario)
    log = Log()
    run_in_virtual_time(
        consume, broker, listener_for(log), log, options_for(scenario), MemoryOffsetStore()
    )
    expected = {(queue_of(a), o): a.stage_index for a in log.attempts for o in a.offsets}

    broker = ScheduledBroker()
    sent = fill(broker, scenario)  # the same messages, with this broker's ids
    log = Log()
    store = RecordingStore(log)
    released: list[int] = []

    async def rebalance(consumer: PushConsumer) -> None:
        mq = MessageQueue(TOPIC, q)
        await consumer.release_queue(mq)
        assert mq not in consumer.statistics().queues
        released.append(log.next_seq())
        log.run = 1  # attempts after the release
        await consumer.assign_queue(mq)

    run_in_virtual_time(
        functools.partial(
            consume,
            broker,
            listener_for(log),
            log,
            options_for(scenario),
            store,
            midway=(after, rebalance),
        )
    )
    for a in log.attempts:
        for o in a.offsets:
            assert a.stage_index == expected[queue_of(a), o], f"{queue_of(a)}:{o} changed stage"
    assert set(per_message(log)) == set(sent), "a message was lost"
    if released:
        committed = max(
            (offsets.get(q, 0) for seq, _, offsets in log.writes if seq <= released[0]),
            default=0,
        )
        for a in log.attempts:
            if queue_of(a) == q and a.start_seq > released[0]:
                assert a.offsets[-1] >= committed, "a committed message was consumed again"
        for a in log.attempts:
            if queue_of(a) == q and a.start_seq <= released[0]:
                assert a.end_seq <= released[0], "release returned with a handler running"
    if mode == "orderly":
        for queue in range(scenario.queue_count):
            check_orderly(log, queue)
    else:
        check_barrier(log, plan_for(sent, {"default": scenario.sizes}, reset=RESETS[reset]))
    check_committed(log, scenario.counts, limit)


# -- tag filtering ------------------------------------------------------------------------


@pytest.mark.slow
@given(
    scenarios(),
    st.lists(st.sampled_from(["a", "b", None]), min_size=1, max_size=7),
    st.sampled_from(sorted(RESETS)),
    st.integers(0, 30),
)
def test_filtered_messages_take_no_stage_and_never_hold_back_the_commit(
    scenario: Scenario, tags: list[str | None], reset: str, stop_after: int
) -> None:
    """Messages the tag expression rejects are never consumed, count for no stage,
    and the committed offset moves past them; a restart assigns the same stages."""
    scenario = attrs.evolve(scenario, gaps=(0,))
    limit = scenario.max_reconsume_times

    def tag_of(q: int, o: int) -> str | None:
        return tags[(q * 5 + o) % len(tags)]

    broker = ScheduledBroker()
    sent = fill(broker, scenario, tags=tag_of)
    wanted = {k: m for k, m in sent.items() if m.tags == "a"}
    filtered = frozenset(sent) - frozenset(wanted)
    log = Log()
    options = options_for(scenario)
    run_in_virtual_time(
        functools.partial(
            consume,
            broker,
            restart_listener(scenario, log, reset),
            log,
            options,
            RecordingStore(log),
            expression="a",
        )
    )
    check_exactly_once(log, broker, wanted, limit)
    check_barrier(log, plan_for(wanted, {"default": scenario.sizes}, reset=RESETS[reset]))
    check_committed(log, scenario.counts, limit, filtered=filtered)
    expected = {(queue_of(a), o): a.stage_index for a in log.attempts for o in a.offsets}

    broker = ScheduledBroker()
    fill(broker, scenario, tags=tag_of)
    log = Log()
    store = RecordingStore(log)

    async def twice() -> None:
        listener = restart_listener(scenario, log, reset)
        await consume(broker, listener, log, options, store, stop_after=stop_after, expression="a")
        log.run = 1
        forget_memory(store, scenario)
        listener = restart_listener(scenario, log, reset)
        await consume(broker, listener, log, options, store, expression="a")

    run_in_virtual_time(twice)
    assert set(per_message(log)) == set(wanted)
    for a in log.attempts:
        for o in a.offsets:
            assert a.stage_index == expected[queue_of(a), o], (
                f"{queue_of(a)}:{o} changed stage on restart"
            )
    check_committed(log, scenario.counts, limit, filtered=filtered)


# -- sync handlers run in worker threads ---------------------------------------------


class SyncStaged(MessageListenerStagedConcurrently):
    """A plain ``def`` handler (run in worker threads; the recorder logs it there)."""

    def __init__(self, scenario: Scenario, unit: float) -> None:
        self.scenario = scenario
        self.unit = unit

    def get_stage_definitions(self) -> Sequence[int]:
        return list(self.scenario.sizes)

    def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> ConsumeOrderlyStatus | None:
        q = msgs[0].queue_id
        time.sleep(max(self.scenario.cost(q, m.queue_offset) for m in msgs) * self.unit)
        failed = any(self.scenario.fails(q, m.queue_offset, m.reconsume_times) for m in msgs)
        return _fail_how(msgs) if failed else None


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=10)
@given(scenarios(max_messages=12, sizes=stage_sizes(max_size=4)))
def test_sync_handlers_in_threads_keep_the_guarantees(backend: str, scenario: Scenario) -> None:
    """Plain ``def`` handlers run in worker threads: the barrier, the concurrency
    bound (shared with async handlers: consume_thread_max) and exactly-once hold."""
    scenario = attrs.evolve(scenario, suspend_millis=10, gaps=(0,))
    broker = ScheduledBroker()
    sent = fill(broker, scenario)
    log = Log()
    listener = SyncStaged(scenario, 0.0005)
    anyio.run(
        consume,
        broker,
        listener,
        log,
        options_for(scenario),
        RecordingStore(log),
        backend=backend,
    )
    limit = scenario.max_reconsume_times
    check_exactly_once(log, broker, sent, limit)
    check_barrier(log, plan_for(sent, {"default": scenario.sizes}))
    check_concurrency_bound(log, scenario.workers)
    check_committed(log, scenario.counts, limit)


@pytest.mark.slow
@given(
    scenarios(),
    stage_sizes(max_size=4),
    st.lists(
        st.tuples(st.sampled_from(TAGS), st.sampled_from(["", "a", "b"])), min_size=1, max_size=12
    ),
    st.integers(0, 40),
)
def test_restart_with_groups_and_strategies_assigns_the_same_stages(
    scenario: Scenario, sizes2: list[int], tags: list[tuple[str, str]], stop_after: int
) -> None:
    """(f) with several stage keys per queue: each key's committed stage offset is its
    counter at the queue's committed offset, so every key resumes where it was."""
    scenario = attrs.evolve(scenario, gaps=(0,))
    definitions = {"s1": list(scenario.sizes), "s2": sizes2}

    def keys(q: int, o: int) -> tuple[str, str]:
        return tags[(q * 7 + o) % len(tags)]

    def listener_for(log: Log) -> StagedKeyed:
        behaviour = Behaviour(scenario, log, 1.0)
        return StagedKeyed(behaviour, definitions, keyed_strategy, keyed_group)

    options = options_for(scenario, persist_consumer_offset_interval=2.0)
    broker = ScheduledBroker()
    sent = fill(broker, scenario, keys=keys)
    model = assignments_by_offset(plan_for(sent, definitions, keyed_strategy, keyed_group))
    broker2 = ScheduledBroker()
    fill(broker2, scenario, keys=keys)
    log = Log()
    store = RecordingStore(log)

    async def twice() -> None:
        await consume(broker2, listener_for(log), log, options, store, stop_after=stop_after)
        log.run = 1
        forget_memory(store, scenario)
        await consume(broker2, listener_for(log), log, options, store)

    run_in_virtual_time(twice)
    for a in log.attempts:
        for o in a.offsets:
            assert a.stage_index == model[queue_of(a), o].stage, (
                f"{queue_of(a)}:{o} got another stage"
            )
    assert set(per_message(log)) == set(sent), "a message was lost across the restart"
    check_committed(log, scenario.counts, scenario.max_reconsume_times)
