"""Replay of one consumer instance: the real PushConsumer over a MemoryBroker.

No Spark here: :func:`replay_consumer` takes the messages of one consumer instance
(a pandas DataFrame with the generation's columns) and returns its event log, one
row per message and handler attempt. Spark runs it per consumer instance
(:mod:`benchmarks.replay.spark`).

Virtual time (default): ``trio.run(..., clock=MockClock(autojump_threshold=0))``;
handlers simulate their cost with ``anyio.sleep``, so timings are exact and the
replay's wall time is the runtime's own overhead. Wall clock: the same on trio's
real clock (costs are really waited for).

Handlers fail by raising: a batch fails when any of its messages is still in its
failure schedule (``attempt < fail_attempts``, the attempt being the message's
``reconsume_times``); the whole batch's cost is spent on every attempt.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import anyio
import attrs
import numpy as np
import pandas as pd
import trio
import trio.testing

from stagedconsumer import (
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    MemoryBroker,
    Message,
    MessageListener,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    Ordering,
    PushConsumer,
)

from .workload import Workload

__all__ = (
    "ENGINES",
    "EVENT_COLUMNS",
    "CallLog",
    "HandlerFailed",
    "ReplayConfig",
    "deterministic_trio",
    "event_frame",
    "handler_costs",
    "replay_consumer",
)

EVENT_COLUMNS: tuple[str, ...] = (
    "mode",
    "consumer",
    "topic",
    "queue",
    "qid",
    "offset",
    "stage",
    "attempt",
    "batch",
    "start",
    "end",
    "ok",
    "dlq",
    "publish",
    "strategy",
    "grp",
    "expected_stage",
)
"""``stage``: the stage index the runtime reported (staged mode; null otherwise).
``batch``: the handler call's number within the replay. ``start``/``end``: seconds
since the consumer started. ``ok``: the call succeeded. ``dlq``: this failed attempt
sent the message to the dead-letter queue. ``publish`` (seconds), ``strategy``,
``grp`` and ``expected_stage`` (the contract's stage) are copied from the message so
that the analysis needs no join with the messages."""

TOPIC = "replay"


class HandlerFailed(Exception):
    """A simulated handler failure (from the failure schedule)."""


@attrs.frozen(kw_only=True)
class ReplayConfig:
    """What a replay task needs from the workload (small and picklable)."""

    threads: int
    batch_size: int
    pull_batch_size: int
    suspend_millis: int
    max_reconsume_times: int | None
    strategies: Mapping[str, tuple[int, ...]]
    group_by_key: bool
    key_ordered: bool = False
    """Orderly mode keeps the order per message key (``Ordering.BY_KEY``, the key
    the first of the message's keys) instead of per queue."""

    @classmethod
    def from_workload(cls, w: Workload) -> ReplayConfig:
        return cls(
            threads=w.threads,
            batch_size=w.batch_size,
            pull_batch_size=w.pull_batch_size,
            suspend_millis=w.failures.suspend_millis,
            max_reconsume_times=w.failures.max_reconsume_times,
            strategies=w.stages.all_strategies(),
            group_by_key=w.stages.group_by == "key",
        )

    def options(self) -> ConsumerOptions:
        return ConsumerOptions(
            consume_thread_max=self.threads,
            consume_message_batch_max_size=self.batch_size,
            pull_batch_size=self.pull_batch_size,
            suspend_current_queue_time_millis=self.suspend_millis,
            max_reconsume_times=self.max_reconsume_times,
            # wall-clock safety nets, idle in a replay: off, so that the scheduling is
            # the consumer's alone (their timers would only add virtual-time steps)
            consume_timeout=None,
            event_loop_block_threshold=None,
        )


def handler_costs(messages: pd.DataFrame) -> list[float]:
    """Each message's handler cost in seconds (``cost_us`` / 1e6), as both engines
    take it.

    A missing, NaN, infinite or negative cost is a :class:`ValueError` naming the
    first such message: neither engine can replay one (a NaN deadline never comes, so
    the replay would wait forever, and a negative one would end a call before it
    started).
    """
    costs = messages["cost_us"].to_numpy(dtype=np.float64, na_value=np.nan)
    bad = np.flatnonzero(~(np.isfinite(costs) & (costs >= 0)))
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"cost_us must be a finite number >= 0, got {costs[i]:g} for the message at qid"
            f" {messages['qid'].iloc[i]}, offset {messages['offset'].iloc[i]}"
            f" ({len(bad)} such message(s))"
        )
    return (costs / 1e6).tolist()  # type: ignore[no-any-return]


class CallLog:
    """Handler calls and the attempts they made, as both engines record them.

    Per handler call it keeps one entry (stage, start, end, ok, size) and per
    message only its index and attempt: :meth:`columns` expands them with numpy, so
    the recording costs little next to the replay's own work per message.
    ``remaining`` counts messages not yet finished for good (succeeded or
    dead-lettered); the replay ends when it reaches 0.
    """

    def __init__(
        self, costs: Sequence[float], fails: Sequence[int], limit: int | None, total: int
    ) -> None:
        self.costs = costs
        self.fails = fails
        self.limit = limit
        self.remaining = total
        self.t0 = 0.0
        self.index: list[int] = []
        self.attempt: list[int] = []
        self.call_stage: list[int | None] = []
        self.call_start: list[float] = []
        self.call_end: list[float] = []
        self.call_ok: list[bool] = []
        self.call_size: list[int] = []
        self.single = False
        """Every call had one message, and only ``index``, ``call_start`` and
        ``call_end`` are recorded per call, with ``attempt`` if any message has planned
        failures and ``call_stage`` if stages are reported (else all 0 and all
        ``None``): a call's outcome follows from the failure schedule (the core
        engine's fast path at batch size 1)."""

    def record(
        self, indexes: list[int], attempts: list[int], stage: int | None, start: float, end: float
    ) -> bool:
        """Record one handler call; returns whether it failed (failure schedule)."""
        fails = self.fails
        failed = any(a < fails[i] for a, i in zip(attempts, indexes, strict=True))
        self.index += indexes
        self.attempt += attempts
        self.call_stage.append(stage)
        self.call_start.append(start - self.t0)
        self.call_end.append(end - self.t0)
        self.call_ok.append(not failed)
        self.call_size.append(len(indexes))
        if not failed:
            self.remaining -= len(indexes)
        elif self.limit is not None:
            limit = self.limit
            self.remaining -= sum([1 for a in attempts if a >= limit])  # dead-lettered
        return failed

    def columns(self) -> dict[str, Any]:
        """Per attempt: index, stage, attempt, batch, start, end, ok, dlq (numpy)."""
        calls = len(self.call_start)
        if self.single:
            sizes = np.ones(calls, dtype=np.int64)
            index = np.asarray(self.index, dtype=np.int64)
            if len(self.attempt) == calls:
                attempt = np.asarray(self.attempt, dtype=np.int32)
            else:
                attempt = np.zeros(calls, dtype=np.int32)
            ok = attempt >= np.asarray(self.fails, dtype=np.int64).reshape(-1)[index]
        else:
            sizes = np.asarray(self.call_size, dtype=np.int64)
            attempt = np.asarray(self.attempt, dtype=np.int32)

        def per_message(values: Any, dtype: Any) -> Any:
            return np.repeat(np.asarray(values, dtype=dtype).reshape(calls), sizes)

        if not self.single:
            ok = per_message(self.call_ok, np.bool_)
        call_stage = self.call_stage
        if len(call_stage) < calls or all(s is None for s in call_stage):
            stage = pd.arrays.IntegerArray(np.zeros(len(ok), np.int32), np.ones(len(ok), np.bool_))
        else:
            values = np.fromiter(
                (-(2**31) if s is None else s for s in call_stage), dtype=np.int64, count=calls
            )
            per = np.repeat(values, sizes)
            stage = pd.arrays.IntegerArray(per.astype(np.int32), per == -(2**31))
        limit = self.limit
        dlq = ~ok & (attempt >= limit) if limit is not None else np.zeros(len(ok), np.bool_)
        return {
            "index": np.asarray(self.index, dtype=np.int64),
            "stage": stage,
            "attempt": attempt,
            "batch": per_message(np.arange(calls), np.int64),
            "start": per_message(self.call_start, np.float64),
            "end": per_message(self.call_end, np.float64),
            "ok": ok,
            "dlq": dlq,
        }


class _Recorder(CallLog):
    """Simulates handler costs and failures on the event loop's clock and records
    every attempt (the runtime engine)."""

    def __init__(
        self, costs: Sequence[float], fails: Sequence[int], limit: int | None, total: int
    ) -> None:
        super().__init__(costs, fails, limit, total)
        self.done = anyio.Event()
        if total == 0:
            self.done.set()

    async def handle(self, msgs: Sequence[Message], stage: int | None) -> None:
        costs = self.costs
        indexes = [int(m.body) for m in msgs]
        attempts = [m.reconsume_times for m in msgs]
        start = anyio.current_time()
        await anyio.sleep(sum([costs[i] for i in indexes]))
        end = anyio.current_time()
        failed = self.record(indexes, attempts, stage, start, end)
        if self.remaining <= 0:
            self.done.set()
        if failed:
            raise HandlerFailed("simulated failure (failure schedule)")


class _Orderly(MessageListenerOrderly):
    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        await self.recorder.handle(msgs, None)


class _KeyOrderly(_Orderly):
    ordering = Ordering.BY_KEY


class _Concurrent(MessageListenerConcurrently):
    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        await self.recorder.handle(msgs, None)


class _Staged(MessageListenerStagedConcurrently):
    def __init__(self, recorder: _Recorder | None, config: ReplayConfig) -> None:
        self.recorder = recorder
        self.strategies = {k: list(v) for k, v in config.strategies.items()}
        self.group_by_key = config.group_by_key

    def get_stage_definitions(self) -> Sequence[int]:
        return self.strategies["default"]

    def get_stage_definition_strategies(self) -> Mapping[str, Sequence[int]]:
        return self.strategies

    def compute_strategy(self, msg: Message) -> str | None:
        return msg.tags  # the generation's strategy column; None: no stage

    def compute_group(self, msg: Message) -> str | None:
        if self.group_by_key and msg.keys:
            return msg.keys[0]
        return None

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        assert self.recorder is not None
        await self.recorder.handle(msgs, context.stage_index)


def _opt_str(value: object) -> str | None:
    """A string cell, with pandas' missing values (None, NaN, NA) as None."""
    return value if isinstance(value, str) else None


def _listener(mode: str, recorder: _Recorder, config: ReplayConfig) -> MessageListener:
    if mode == "orderly":
        return _KeyOrderly(recorder) if config.key_ordered else _Orderly(recorder)
    if mode == "concurrent":
        return _Concurrent(recorder)
    if mode == "staged":
        return _Staged(recorder, config)
    raise ValueError(f"unknown mode {mode!r}")


async def _replay(messages: pd.DataFrame, mode: str, config: ReplayConfig) -> _Recorder:
    options = config.options()
    limit = options.effective_max_reconsume_times(concurrent=mode == "concurrent")
    recorder = _Recorder(
        handler_costs(messages),
        messages["fail_attempts"].to_numpy().tolist(),
        limit,
        len(messages),
    )
    qids = sorted(set(messages["qid"].tolist()))
    local = {qid: i for i, qid in enumerate(qids)}
    broker = MemoryBroker()
    broker.create_topic(TOPIC, max(1, len(qids)))
    rows = list(
        zip(
            messages["qid"].map(local).tolist(),
            [_opt_str(v) for v in messages["key"].tolist()],
            [_opt_str(v) for v in messages["strategy"].tolist()],
            messages["publish_us"].tolist(),
            strict=True,
        )
    )
    send = broker.send

    def publish(index: int) -> None:
        queue, key, strategy, _ = rows[index]
        send(
            TOPIC, b"%d" % index, keys=() if key is None else (key,), tags=strategy, queue_id=queue
        )

    backlog = all(row[3] == 0 for row in rows)
    if backlog:
        for index in range(len(rows)):
            publish(index)
    consumer = PushConsumer(
        f"replay-{mode}", broker, _listener(mode, recorder, config), options=options
    )
    consumer.subscribe(TOPIC)

    async def produce(t0: float) -> None:
        order = sorted(range(len(rows)), key=lambda i: rows[i][3])
        for index in order:
            due = t0 + rows[index][3] / 1e6
            now = anyio.current_time()
            if due > now:
                await anyio.sleep(due - now)
            publish(index)

    recorder.t0 = anyio.current_time()
    async with anyio.create_task_group() as tg, consumer:
        if not backlog:
            tg.start_soon(produce, recorder.t0)
        await recorder.done.wait()
    return recorder


ENGINES: tuple[str, ...] = ("core", "runtime")
"""``core``: the discrete-event engine (:mod:`benchmarks.replay.engine`) driving the
sans-I/O core; ``runtime``: the real PushConsumer on trio's MockClock (the reference)."""


class _FifoRandom(random.Random):
    """trio's scheduler reverses each batch of runnable tasks when ``random() < 0.5``:
    always reversing, then popping from the end, runs them first-in first-out."""

    def random(self) -> float:
        return 0.0


@contextlib.contextmanager
def deterministic_trio() -> Iterator[None]:
    """Make trio's scheduling a function of the program alone, for one replay.

    trio deliberately randomises the order of tasks that are runnable at the same
    moment (each batch is reversed with probability 1/2) and breaks ties between
    equal deadlines by the cancel scopes' memory addresses, so two replays of the
    same workload differ wherever two events fall on the same virtual instant (at
    time 0 with a backlog, with whole-millisecond costs). Here batches run
    first-in first-out and equal deadlines expire in the order they were set: the
    schedule the core engine reproduces exactly.
    """
    from trio._core import _run

    counter = itertools.count()

    def add(self: Any, deadline: float, cancel_scope: Any) -> None:
        heapq.heappush(self._heap, (deadline, next(counter), cancel_scope))
        self._active += 1

    saved = (_run._r, _run.Deadlines.add, _run._ALLOW_DETERMINISTIC_SCHEDULING)
    _run._r = _FifoRandom()
    _run.Deadlines.add = add  # type: ignore[method-assign]
    # importing hypothesis turns on trio's own test mode (batches sorted by task
    # creation, then shuffled): not first-in first-out either
    _run._ALLOW_DETERMINISTIC_SCHEDULING = False  # type: ignore[misc]
    try:
        yield
    finally:
        _run._r, _run.Deadlines.add, _run._ALLOW_DETERMINISTIC_SCHEDULING = saved  # type: ignore[method-assign, misc]


def replay_consumer(
    messages: pd.DataFrame,
    mode: str,
    config: ReplayConfig,
    *,
    wall_clock: bool = False,
    engine: str = "runtime",
    prepared: Any = None,
) -> pd.DataFrame:
    """Replay one consumer instance's messages in ``mode``; returns the event log.

    ``messages`` must be in queue order within each queue (it is sorted here by
    ``qid`` and ``offset``). ``engine``: one of :data:`ENGINES` (``core`` runs in
    virtual time only); ``prepared``: the core engine's
    :class:`~benchmarks.replay.engine.Prepared` of the same (sorted) messages, to
    build the stored messages once for several modes.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    messages = messages.sort_values(["qid", "offset"], kind="stable").reset_index(drop=True)
    if engine == "core" and wall_clock:
        raise ValueError("the core engine runs in virtual time only (no wall clock)")
    with collector_paused():
        if engine == "core":
            from .engine import simulate

            log = simulate(messages, mode, config, prepared)
        else:
            log = _run_runtime(messages, mode, config, wall_clock)
    return event_frame(messages, mode, log)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (and back on after, if it was).

    A replay builds and holds every message of the consumer instance (200,000 in
    `large`): the collector's passes over them cost ~15 % of the replay and about
    half of building the core engine's stored messages, and find little (measured:
    same peak memory), so they wait until the work is done.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _run_runtime(
    messages: pd.DataFrame, mode: str, config: ReplayConfig, wall_clock: bool
) -> CallLog:

    async def main() -> _Recorder:
        return await _replay(messages, mode, config)

    # Simulated failures are expected: the runtime's per-failure warning (with a
    # traceback) would cost more than the replay itself.
    runtime_logger = logging.getLogger("stagedconsumer")
    level = runtime_logger.level
    runtime_logger.setLevel(logging.ERROR)
    try:
        if wall_clock:
            recorder = trio.run(main)
        else:
            with deterministic_trio():
                recorder = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        runtime_logger.setLevel(level)
    return recorder


def event_frame(messages: pd.DataFrame, mode: str, log: CallLog) -> pd.DataFrame:
    """The event log (:data:`EVENT_COLUMNS`) of ``log``'s calls on ``messages``."""
    rec = log.columns()
    index = rec["index"]
    n = len(index)

    def take(column: str, dtype: Any) -> Any:
        return messages[column].to_numpy(dtype=dtype)[index]

    stage_col = messages["stage"]
    if isinstance(stage_col.dtype, pd.api.extensions.ExtensionDtype):
        expected = stage_col.array.take(index).astype("Int32")
    else:
        expected = pd.array(stage_col.to_numpy(dtype=object)[index], dtype="Int32")
    mode_col = np.empty(n, dtype=object)
    mode_col[:] = mode

    def objects(values: Any) -> pd.Series:
        return pd.Series(values, dtype=object, copy=False)

    out: dict[str, Any] = {
        "mode": objects(mode_col),
        "consumer": take("consumer", np.int32),
        "topic": take("topic", np.int32),
        "queue": take("queue", np.int32),
        "qid": take("qid", np.int32),
        "offset": take("offset", np.int64),
        "stage": rec["stage"],
        "attempt": rec["attempt"],
        "batch": rec["batch"],
        "start": rec["start"],
        "end": rec["end"],
        "ok": rec["ok"],
        "dlq": rec["dlq"],
        "publish": take("publish_us", np.float64) / 1e6,
        # object, not pandas 3's Arrow-backed str: Spark's Arrow writer wants plain arrays
        "strategy": objects(take("strategy", object)),
        "grp": objects(take("grp", object)),
        "expected_stage": expected,
    }
    return pd.DataFrame(out, columns=list(EVENT_COLUMNS), copy=False)
