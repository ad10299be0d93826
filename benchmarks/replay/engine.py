"""The core engine: a discrete-event replay over the sans-I/O core, no event loop.

It drives the same :class:`~stagedconsumer._core.Dispatcher` and
:class:`~stagedconsumer._core.ProcessQueue` objects as
:class:`~stagedconsumer.PushConsumer`, built by the same consume service
(flow control, stage plan from the same listener), and replays what the consumer's
tasks do around them as plain functions: the pull loops (pull batches, flow control,
long polls, the embedded broker's retry queue and its delays), the workers (take,
handler cost, success or settlement, the hand-over of ready work to idle workers),
the dispatcher's timer and the progress committer's beat. A heap of
``(deadline, sequence)`` holds what waits for a time, a first-in first-out run queue
what is runnable now; time jumps to the next deadline when nothing is runnable, as
trio's ``MockClock(autojump_threshold=0)`` does, with the same floating-point
arithmetic (``deadline = now + delay``; ``now = now + (deadline - now)``).

The result is the schedule of the runtime engine run with
:func:`~benchmarks.replay.runner.deterministic_trio` (tasks runnable at the same
instant run in the order they became runnable, equal deadlines expire in the order
they were set): the same handler calls with the same start and end times, which
``tests/benchmarks/test_engines.py`` checks for equality. What the consume services
do on a failure (``settle_failure`` is a coroutine that reads the loop's clock) is
mirrored here with the core's :class:`~stagedconsumer._core.Settlement`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import pandas as pd

from stagedconsumer import MemoryBroker, Message, MessageQueue
from stagedconsumer._core import (
    HELD,
    READY,
    ROOM,
    TIMER,
    Batch,
    Dispatcher,
    EraseStatus,
    ProcessQueue,
    Settlement,
    clamp_suspend_millis,
    retry_delay_seconds,
    split_exhausted,
)
from stagedconsumer._message import (
    EMPTY_PROPERTIES,
    _new_message,
    _set_body,
    _set_born_timestamp,
    _set_keys,
    _set_msg_id,
    _set_offset_msg_id,
    _set_properties,
    _set_queue_id,
    _set_queue_offset,
    _set_reconsume_times,
    _set_tags,
    _set_topic,
)
from stagedconsumer._runtime._services import ConsumeService
from stagedconsumer._runtime._state import ConsumerState
from stagedconsumer._sources._source import is_spent, retry_topic

from .runner import (
    TOPIC,
    CallLog,
    ReplayConfig,
    _listener,
    _opt_str,
    collector_paused,
    handler_costs,
)

__all__ = ("Prepared", "simulate")

_SUCCESS = EraseStatus.SUCCESS
_SENT_BACK = EraseStatus.SENT_BACK
_NOT_READY = ~READY
_CHECKPOINT_EVERY = 64
"""The worker loop's yield after this many batches back to back (``_workers.py``)."""


class _Timer:
    """A deadline that may be abandoned (its cancel scope exited first): ``live``
    until it fires or is abandoned; ``arg`` is what it concerns."""

    __slots__ = ("arg", "live")

    def __init__(self, arg: Any) -> None:
        self.arg = arg
        self.live = True


class _Log:
    """One queue of the embedded broker: its messages and the pull waiting on it."""

    __slots__ = ("messages", "waiter")

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.waiter: _Pull | None = None


class _Pull:
    """The pull loop of one queue (``PullService._pull_loop`` with
    ``MemoryBroker.pull``)."""

    __slots__ = ("inner", "log", "offset", "outer", "pq", "retry")

    def __init__(self, pq: ProcessQueue, log: _Log, retry: bool) -> None:
        self.pq = pq
        self.log = log
        self.retry = retry
        self.offset = pq.committed_offset
        self.outer: _Timer | None = None
        """The long poll's deadline while the pull waits for messages."""
        self.inner: _Timer | None = None
        """The wait for the next delayed retry message (retry queue only)."""


class Prepared:
    """A consumer instance's messages as the broker stores them, built once for
    every mode: queue ``q`` of the replay's topic holds the messages of the
    ``q``-th ``qid``, in publishing order (publish time, then queue order, as the
    runtime replay sends them); stored messages are immutable, so modes share them."""

    def __init__(self, messages: pd.DataFrame) -> None:
        with collector_paused():
            self._build(messages)

    def _build(self, messages: pd.DataFrame) -> None:
        qids = sorted(set(messages["qid"].tolist()))
        local = {qid: i for i, qid in enumerate(qids)}
        queue_of = messages["qid"].map(local).tolist()
        keys = [_opt_str(v) for v in messages["key"].tolist()]
        tags = [_opt_str(v) for v in messages["strategy"].tolist()]
        publish = messages["publish_us"].tolist()
        n = len(queue_of)
        self.queues = max(1, len(qids))
        order = self.order = sorted(range(n), key=publish.__getitem__)
        self.publish_at = [publish[i] for i in order]
        self.backlog = all(p == 0 for p in publish)
        # Message(topic=..., ...) through its slots' setters (as the broker's trace
        # writer builds them; the values are already in stored form), one field at a
        # time over all messages in publishing order, with map's loop in C
        queues = [queue_of[i] for i in order]
        counts = [0] * self.queues
        offsets = []
        for queue in queues:  # the offset in its queue's log: publishing order
            offsets.append(counts[queue])
            counts[queue] += 1
        built = [_new_message(Message) for _ in range(n)]
        set_all: list[tuple[Callable[[Message, Any], None], Iterable[Any]]] = [
            (_set_topic, itertools.repeat(TOPIC)),
            (_set_queue_id, queues),
            (_set_queue_offset, offsets),
            (_set_body, [b"%d" % i for i in order]),
            (_set_keys, [() if keys[i] is None else (keys[i],) for i in order]),
            (_set_tags, [tags[i] for i in order]),
            (_set_properties, itertools.repeat(EMPTY_PROPERTIES)),
            (_set_msg_id, itertools.repeat("")),
            (_set_offset_msg_id, itertools.repeat("")),
            (_set_born_timestamp, itertools.repeat(0.0)),
            (_set_reconsume_times, itertools.repeat(0)),
        ]
        for setter, values in set_all:
            deque(map(setter, built, values), maxlen=0)
        self.backlog_logs: list[list[Message]] = [[] for _ in range(self.queues)]
        logs = self.backlog_logs
        for message, queue in zip(built, queues, strict=True):
            logs[queue].append(message)
        stored: list[Message | None] = [None] * n
        for position, i in enumerate(order):
            stored[i] = built[position]
        self.stored: list[Message] = stored  # type: ignore[assignment]


class _Sim:
    """One consumer instance replayed in one mode."""

    def __init__(
        self,
        messages: pd.DataFrame,
        mode: str,
        config: ReplayConfig,
        prepared: Prepared | None = None,
    ) -> None:
        options = config.options()
        self.options = options
        self.concurrent = mode == "concurrent"
        limit = options.effective_max_reconsume_times(concurrent=self.concurrent)
        n = len(messages)
        self.log = CallLog(
            handler_costs(messages),
            messages["fail_attempts"].to_numpy().tolist(),
            limit,
            n,
        )
        self.limit = limit
        self.stage_reported = mode == "staged"
        group = f"replay-{mode}"
        self.group = group
        state = ConsumerState(group=group, mode=mode)
        service = ConsumeService.for_listener(
            _listener(mode, None, config),  # type: ignore[arg-type]
            group,
            MemoryBroker(),
            state,
            options,
        )
        self.service = service
        self.dispatcher = Dispatcher(
            assignment_retry_delay=options.suspend_current_queue_time_millis / 1000,
            record_times=False,
        )
        self.suspend_delay = clamp_suspend_millis(options.suspend_current_queue_time_millis) / 1000
        self.now = 0.0
        self.heap: list[tuple[float, int, Any, Any]] = []
        self.seq = itertools.count()
        self.runq: deque[tuple[Callable[[Any], None], Any]] = deque()
        self.idle: deque[int] = deque()
        self.done = n == 0

        prep = prepared if prepared is not None else Prepared(messages)
        self.prepared = prep
        self.logs = [_Log() for _ in range(prep.queues)]
        self.order = prep.order
        self.publish_at = prep.publish_at
        self.backlog = prep.backlog
        if self.backlog:  # published before the consumer starts: the logs are shared
            for log, stored in zip(self.logs, prep.backlog_logs, strict=True):
                log.messages = stored
        self.pulls: list[_Pull] = []
        for qid in range(len(self.logs)):
            mq = MessageQueue(TOPIC, qid)
            pq = service.new_process_queue(mq, 0, {})
            self.pulls.append(_Pull(pq, self.logs[qid], retry=False))
        self.retry_log: _Log | None = None
        self.delayed: list[tuple[float, int, Message]] = []
        self.batch_size = options.consume_message_batch_max_size
        calls = self.log
        self.costs, self.fails = calls.costs, calls.fails
        self.rec_index, self.rec_attempt = calls.index.append, calls.attempt.append
        self.rec_stage, self.rec_start = calls.call_stage.append, calls.call_start.append
        self.rec_end, self.rec_ok = calls.call_end.append, calls.call_ok.append
        self.rec_size = calls.call_size.append
        # at batch size 1 every call has one message (a suspended batch is retried
        # whole): record only what the failure schedule does not imply
        self.single = calls.single = self.batch_size == 1
        self.record_attempts = any(self.fails)
        dispatcher = self.dispatcher
        self.take, self.has_ready, self.finish = (
            dispatcher.take,
            dispatcher.has_ready,
            dispatcher.finish,
        )
        if service.retry_queues:
            self.retry_log = _Log()
            mq = MessageQueue(retry_topic(group), 0)
            self.pulls.append(_Pull(service.new_process_queue(mq, 0, {}), self.retry_log, True))
        self.paused: dict[ProcessQueue, _Pull] = {}
        threads = options.consume_thread_max
        self.streak = [0] * threads
        self.timer_waiting = False
        """The timer task waits on its event (a TIMER effect wakes it)."""
        self.timer_deadline: _Timer | None = None

    # -- scheduling -----------------------------------------------------------------

    def at(self, deadline: float, fn: Callable[[Any], None], arg: Any) -> None:
        heapq.heappush(self.heap, (deadline, next(self.seq), fn, arg))

    def run(self) -> CallLog:
        runq, heap, pop = self.runq, self.heap, heapq.heappop
        self.startup()
        while True:
            while runq:
                fn, arg = runq.popleft()
                fn(arg)
            if self.done:
                return self.log
            while heap:  # trio skips the deadlines of scopes that exited
                head = heap[0][3]
                if type(head) is _Timer and not head.live:
                    pop(heap)
                    continue
                break
            if not heap:
                raise RuntimeError(
                    f"replay stalled at {self.now} s with {self.log.remaining} messages left"
                )
            now = self.now
            jump = heap[0][0] - now
            if jump > 0:
                now = self.now = now + jump
            if heap[0][0] > now:  # the jump fell short by rounding: trio jumps again
                continue
            entry = pop(heap)
            if (not heap or heap[0][0] > now) and type(entry[3]) is not _Timer:
                entry[2](entry[3])  # alone at this instant: run it at once
                continue
            heapq.heappush(heap, entry)
            while heap and heap[0][0] <= now:
                _, _, fn, arg = pop(heap)
                if type(arg) is _Timer:
                    if arg.live:
                        arg.live = False
                        runq.append((fn, arg))
                else:
                    runq.append((fn, arg))

    def startup(self) -> None:
        """``PushConsumer.__aenter__``: the pull loops start, then the worker pool,
        then the timer and committer tasks (and the replay's producer)."""
        runq = self.runq
        for pull in self.pulls:
            runq.append((self.pull_loop, pull))
        runq.append((self.start_workers, None))

    def start_workers(self, _: None) -> None:
        for w in range(len(self.streak)):
            self.runq.append((self.work, w))
        self.runq.append((self.main_started, None))

    def main_started(self, _: None) -> None:
        self.runq.append((self.timer_task, None))
        self.runq.append((self.commit_task, None))
        if not self.backlog:
            self.runq.append((self.produce, 0))

    # -- producer and broker ---------------------------------------------------------

    def send(self, index: int) -> None:
        """``MemoryBroker.send`` of message ``index`` to its queue."""
        message = self.prepared.stored[index]
        log = self.logs[message.queue_id]
        log.messages.append(message)
        self.wake(log)

    def wake(self, log: _Log) -> None:
        """The queue got messages: resume the pull waiting on it, unless a deadline
        already ended its wait."""
        pull = log.waiter
        if pull is None:
            return
        log.waiter = None
        outer, inner = pull.outer, pull.inner
        if outer is None or not outer.live or (inner is not None and not inner.live):
            return
        if inner is not None:
            inner.live = False
            pull.inner = None
        self.runq.append((self.pull_resume, pull))

    def produce(self, position: int) -> None:
        """The replay's producer: sleeps until each message's publish time."""
        order, publish_at = self.order, self.publish_at
        while position < len(order):
            due = publish_at[position] / 1e6
            now = self.now
            if due > now:
                self.at(now + (due - now), self.produce, position)
                return
            self.send(order[position])
            position += 1

    def release_due(self) -> float | None:
        """``MemoryBroker._release_due``: due retry messages into the retry queue."""
        delayed = self.delayed
        if not delayed:
            return None
        log = self.retry_log
        assert log is not None
        now = self.now
        while delayed and delayed[0][0] <= now:
            _, _, message = heapq.heappop(delayed)
            log.messages.append(attrs.evolve(message, queue_offset=len(log.messages)))
        return delayed[0][0] if delayed else None

    # -- pull loops ------------------------------------------------------------------

    def pull_loop(self, pull: _Pull) -> None:
        """From the top of the pull loop until it waits (for room or messages)."""
        pq = pull.pq
        log = pull.log
        messages = log.messages
        while True:
            if pq.should_pause_pull():
                self.paused[pq] = pull
                return
            if pull.retry:
                self.release_due()
            offset = pull.offset
            if offset >= len(messages):
                pull.outer = timer = _Timer(pull)
                self.at(
                    self.now + self.options.pull_long_polling_timeout, self.pull_timed_out, timer
                )
                if not self.pull_wait(pull):
                    return
            self.pulled(pull)

    def pull_wait(self, pull: _Pull) -> bool:
        """The broker's wait loop; ``True`` when messages came without waiting."""
        messages = pull.log.messages
        while pull.offset >= len(messages):
            wait = None
            if pull.retry:
                due = self.release_due()
                if pull.offset < len(messages):
                    break
                if due is not None:
                    wait = max(0.0, due - self.now)
            pull.log.waiter = pull
            if wait is not None:
                pull.inner = timer = _Timer(pull)
                self.at(self.now + wait, self.pull_inner_expired, timer)
            return False
        assert pull.outer is not None
        pull.outer.live = False
        pull.outer = None
        return True

    def pulled(self, pull: _Pull) -> None:
        """The pull returned: cache its messages, go on from the next offset."""
        messages = pull.log.messages
        offset = pull.offset
        batch = messages[offset : offset + self.options.pull_batch_size]
        pq = pull.pq
        pq.max_offset = len(messages)
        if batch:
            highest = batch[-1].queue_offset
            if pull.retry:  # the retry topic's messages carry their origin topic
                batch = [attrs.evolve(m, topic=TOPIC) for m in batch]
            effects = self.dispatcher.put_messages(pq, batch, highest_offset=highest, now=self.now)
            if effects:
                self.apply(pq, effects)
            pull.offset = offset + len(batch)

    def pull_inner_expired(self, timer: _Timer) -> None:
        """The wait for the next delayed retry message ended."""
        pull: _Pull = timer.arg
        if pull.inner is not timer:
            return
        pull.inner = None
        if pull.log.waiter is pull:
            pull.log.waiter = None
        outer = pull.outer
        if outer is not None and not outer.live:  # both expired: the long poll's scope wins
            self.pull_timed_out(outer)
            return
        self.pull_resume(pull)

    def pull_resume(self, pull: _Pull) -> None:
        """The pull's wait ended (messages came, or the retry wait expired)."""
        if not self.pull_wait(pull):
            return
        self.pulled(pull)
        self.pull_loop(pull)

    def pull_timed_out(self, timer: _Timer) -> None:
        """The long poll ended with nothing (or what arrived meanwhile)."""
        pull: _Pull = timer.arg
        if pull.outer is not timer:
            return
        pull.outer = None
        if pull.log.waiter is pull:
            pull.log.waiter = None
        if pull.inner is not None:
            pull.inner.live = False
            pull.inner = None
        self.pulled(pull)
        self.pull_loop(pull)

    # -- effects -----------------------------------------------------------------------

    def apply(self, pq: ProcessQueue | None, effects: int) -> None:
        """``Signals.apply``."""
        if effects & READY and self.idle:
            self.runq.append((self.work, self.idle.popleft()))
        if effects & TIMER and self.timer_waiting:
            deadline = self.timer_deadline
            if deadline is None or deadline.live:  # not woken by its deadline already
                self.timer_waiting = False
                if deadline is not None:
                    deadline.live = False
                    self.timer_deadline = None
                self.runq.append((self.timer_task, None))
        if effects & ROOM and pq is not None:
            pull = self.paused.pop(pq, None)
            if pull is not None:
                self.runq.append((self.pull_loop, pull))
        if effects & HELD:  # pragma: no cover - the replay's stage callbacks never fail
            raise RuntimeError("a stage assignment failed in the replay")

    # -- timer and committer -------------------------------------------------------------

    def timer_task(self, _: Any) -> None:
        """``Signals.run_timer`` from the top of its loop (after a wake-up)."""
        dispatcher = self.dispatcher
        while True:
            effects = dispatcher.handle_timer(self.now)
            if effects:
                self.apply(None, effects & ~TIMER)
            deadline = dispatcher.get_timer()
            self.timer_waiting = True
            if deadline is None:
                return
            delay = deadline - self.now
            if delay > 0:
                self.timer_deadline = timer = _Timer(None)
                self.at(self.now + delay, self.timer_expired, timer)
                return
            self.timer_waiting = False

    def timer_expired(self, timer: _Timer) -> None:
        if self.timer_deadline is not timer:
            return
        self.timer_deadline = None
        self.timer_waiting = False
        self.timer_task(None)

    def commit_task(self, _: Any) -> None:
        """The progress committer's beat: only its deadlines matter here."""
        self.at(self.now + self.options.persist_consumer_offset_interval, self.commit_task, None)

    # -- workers ---------------------------------------------------------------------------

    def work(self, w: int) -> None:
        """A worker at the top of its loop: take a batch and start the handler."""
        batch = self.take(self.batch_size)
        if batch is None:
            self.streak[w] = 0
            self.idle.append(w)
            return
        idle = self.idle
        if idle and self.has_ready():
            self.runq.append((self.work, idle.popleft()))
        now = self.now
        messages = batch.messages
        if len(messages) == 1:
            index = int(messages[0].body)
            cost = self.costs[index]
        else:
            index = -1
            costs = self.costs
            cost = sum([costs[int(m.body)] for m in messages])
        call = (w, batch, index, now)
        if cost == 0:  # anyio.sleep(0) is a checkpoint
            self.runq.append((self.handled, call))
        else:
            heapq.heappush(self.heap, (now + cost, next(self.seq), self.handled, call))

    def handled(self, call: tuple[int, Batch, int, float]) -> None:
        """The handler call of worker ``w`` returned (``_Recorder.handle`` and the
        rest of the worker loop's iteration); ``index``: the message's when the batch
        has one, else -1; ``start``: when the call started."""
        w, batch, index, start = call
        log = self.log
        if index < 0:
            messages = batch.messages
            failed = log.record(
                [int(m.body) for m in messages],
                [m.reconsume_times for m in messages],
                batch.stage_index if self.stage_reported else None,
                start,
                self.now,
            )
        else:  # CallLog.record for one message, inlined
            attempt = batch.messages[0].reconsume_times
            failed = attempt < self.fails[index]
            self.rec_index(index)
            if self.single:  # the outcome and size follow from the failure schedule
                if self.record_attempts:
                    self.rec_attempt(attempt)
                if self.stage_reported:
                    self.rec_stage(batch.stage_index)
                self.rec_start(start)
                self.rec_end(self.now)
            else:
                self.rec_attempt(attempt)
                self.rec_stage(batch.stage_index if self.stage_reported else None)
                self.rec_start(start)
                self.rec_end(self.now)
                self.rec_ok(not failed)
                self.rec_size(1)
            if not failed or (self.limit is not None and attempt >= self.limit):
                log.remaining -= 1  # succeeded, or dead-lettered
        if log.remaining <= 0:
            self.done = True
        if not failed:
            effects = self.finish(batch, _SUCCESS)
            if effects > READY:
                self.apply(batch.process_queue, effects & _NOT_READY)
        else:
            self.settle(batch)
        streak = self.streak[w] + 1
        if streak >= _CHECKPOINT_EVERY:
            self.streak[w] = 0
            self.runq.append((self.work, w))
            return
        self.streak[w] = streak
        self.work(w)

    def settle(self, batch: Batch) -> None:
        """The consume service's ``settle_failure`` and the worker's ``_settle``, with
        the embedded broker's ``send_back`` (whose I/O always succeeds here): the same
        rules through the same functions (``is_spent``, ``retry_delay_seconds``,
        ``split_exhausted``, ``clamp_suspend_millis``), on the engine's clock."""
        messages = batch.messages
        limit = self.limit
        now = self.now
        if self.concurrent:
            retried: list[Message] = []
            dead: list[Message] = []
            spent = limit if limit is not None else 2**31 - 1
            for message in messages:
                if is_spent(message, delay_level=0, max_reconsume_times=spent):
                    dead.append(message)
                    continue
                due = now + retry_delay_seconds(message.reconsume_times, 0)
                heapq.heappush(
                    self.delayed,
                    (
                        due,
                        next(self.seq),
                        attrs.evolve(
                            message,
                            reconsume_times=message.reconsume_times + 1,
                            topic=retry_topic(self.group),
                            queue_id=0,
                        ),
                    ),
                )
                retried.append(message)
                assert self.retry_log is not None
                self.wake(self.retry_log)
            settlement = Settlement(retried=retried, dead=dead)
        else:
            suspended, dead = split_exhausted(messages, limit)
            settlement = Settlement(
                dead=dead,
                suspended=suspended,
                retry_at=now + self.suspend_delay if suspended else 0.0,
            )
        self.apply(batch.process_queue, self.dispatcher.settle(batch, settlement))


def simulate(
    messages: pd.DataFrame, mode: str, config: ReplayConfig, prepared: Prepared | None = None
) -> CallLog:
    """Replay one consumer instance's messages (sorted by ``qid`` and ``offset``) in
    ``mode`` and return its handler calls; ``prepared``: ``Prepared(messages)``,
    to share between the modes of the same messages."""
    return _Sim(messages, mode, config, prepared).run()
