"""A RuleBasedStateMachine drives ProcessQueues (through the Dispatcher) against a model.

The model is deliberately naive: a dict of messages with their state (cached,
pending, finished), the stage each must get (computed by walking the stage key's
messages one at a time), and the epoch (run of one stage) it belongs to. After every
step the machine checks the contract of design.md section 3:

- committed offset = lowest unfinished offset, or highest-seen + 1; monotone;
- committed stage offsets = stage counter of each key at the committed offset, and a
  fresh ProcessQueue started from (committed offset, committed stage offsets) and fed
  the remaining messages assigns every message the same stage (restart rule);
- staged: no message of a later epoch of a stage key is taken while an earlier one is
  unfinished; a message whose strategy id none of the definitions has (a typo) holds
  its queue: it and every later message are not assigned, taken or committed past,
  and ``assignment_error`` names it;
- orderly: at most one batch pending per queue, batches in offset order;
- key-ordered: at most one batch pending per key, in offset order per key, and the
  queue keeps a lane only for keys with messages cached or pending;
- a paused or dropped queue hands out nothing, and an unpaused one goes on;
- every message is taken once (retries of a suspended batch are the same batch),
  counts, bytes, span and flow control exact, suspended batches never double-count;
- a batch given back (``untake``) is as if it had never been taken: its messages
  are cached again at the head of their lane (a retry is a retry again), taken
  again in the same order, with no attempt counted;
- liveness: whenever the model says a batch may be taken, ``take`` returns one.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from stagedconsumer import Message, MessageQueue
from stagedconsumer._core import (
    DRAINED,
    READY,
    TAIL_STAGE,
    Batch,
    ConsumeMode,
    Dispatcher,
    EraseStatus,
    FlowControl,
    ProcessQueue,
    StageDefinition,
    StageKey,
    StagePlan,
)
from stagedconsumer.testing import stage_of

from ..strategies import stage_sizes

TOPIC = "t"
STRATEGY_OF_TAG = {"s1": "s1", "s2": "s2", "none": None, "unknown": "no-such-strategy"}


def is_stage_start(sizes: tuple[int, ...], offset: int) -> bool:
    """The first offset of a stage (or of the tail), by the kit's naive stage model."""
    return offset == 0 or stage_of(sizes, offset - 1) != stage_of(sizes, offset)


@attrs.define
class Config:
    mode: ConsumeMode
    definitions: dict[str, tuple[int, ...]]
    use_strategies: bool
    use_groups: bool
    reset_kind: str | None  # None, "zero" (always 0), "cycle" (0 once past 4)
    flow: FlowControl
    typos: bool = False
    """Messages may carry the tag "unknown", whose strategy id no definition has."""

    def tags(self) -> list[str]:
        """Tags to draw from: "unknown" rarely, so that a queue runs a while first."""
        tags = sorted(tag for tag in STRATEGY_OF_TAG if tag != "unknown")
        return tags * 4 + ["unknown"] if self.typos else tags

    def holds(self, message: Message) -> bool:
        """Staged: the strategy of ``message`` is an id none of the definitions has."""
        if self.mode is not ConsumeMode.STAGED or not self.use_strategies:
            return False
        strategy = STRATEGY_OF_TAG[message.keys[0]]
        return strategy is not None and strategy not in self.definitions

    def reset(self, topic: str, current: int) -> int:
        assert topic == TOPIC
        if self.reset_kind == "zero":
            return 0
        assert self.reset_kind == "cycle"
        return 0 if current >= 4 else current

    def plan(self) -> StagePlan | None:
        if self.mode is not ConsumeMode.STAGED:
            return None
        return StagePlan(
            definitions={k: StageDefinition.of(v) for k, v in self.definitions.items()},
            compute_strategy=(
                (lambda m: STRATEGY_OF_TAG[m.keys[0]]) if self.use_strategies else None
            ),
            compute_group=(lambda m: m.keys[1] or None) if self.use_groups else None,
            reset=self.reset if self.reset_kind is not None else None,
        )

    def message_key(self, message: Message) -> str | None:
        """Key-ordered mode: a message's key (its second key; "" means none)."""
        return message.keys[1] or None

    def key_of(self, message: Message) -> StageKey | str:
        """The lane: a StageKey, "direct" (staged, no strategy; key-ordered, no key),
        "key:<k>" (key-ordered) or "main"."""
        if self.mode is ConsumeMode.KEY_ORDERED:
            key = self.message_key(message)
            return "direct" if key is None else f"key:{key}"
        if self.mode is not ConsumeMode.STAGED:
            return "main"
        strategy = STRATEGY_OF_TAG[message.keys[0]] if self.use_strategies else "default"
        if strategy is None:
            return "direct"
        assert strategy in self.definitions, "a held message has no lane"
        group = (message.keys[1] or None) if self.use_groups else None
        return StageKey(strategy, group)


@attrs.define(eq=False)
class MMsg:
    message: Message
    lane: StageKey | str
    stage: int
    stage_offset: int
    epoch: int
    state: str = "cached"  # cached -> pending -> finished
    size: int = 0


@attrs.define(eq=False)
class MQueue:
    """Model of one ProcessQueue."""

    pq: ProcessQueue
    start: int
    initial_stage_offsets: dict[StageKey, int]
    highest: int
    msgs: dict[int, MMsg] = attrs.Factory(dict)
    held: list[Message] = attrs.Factory(list)
    """Messages from the first one with an unknown strategy on: never assigned."""
    counters: dict[StageKey, int] = attrs.Factory(dict)
    last_epoch: dict[StageKey, tuple[int, int]] = attrs.Factory(dict)  # key -> (stage, epoch)
    last_committed: int = 0

    def unfinished(self) -> list[MMsg]:
        return [m for m in self.msgs.values() if m.state != "finished"]

    def cached_of(self, lane: StageKey | str) -> list[MMsg]:
        return sorted(
            (m for m in self.msgs.values() if m.lane == lane and m.state == "cached"),
            key=lambda m: m.message.queue_offset,
        )


@attrs.define(eq=False)
class MBatch:
    batch: Batch
    queue: MQueue
    lane: StageKey | str
    msgs: list[MMsg]
    state: str = "running"  # running | suspended | retry
    retry_at: float = 0.0
    attempt: int = 1
    given_back: bool = False
    """A retry taken and given back (untake): its next take is no new attempt."""


class ProcessQueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dispatcher = Dispatcher()
        self.queues: list[MQueue] = []
        self.batches: list[MBatch] = []
        self.now = 0.0
        self.epoch_seq = 0
        self.config: Config

    # -- set-up ----------------------------------------------------------------

    @initialize(
        mode=st.sampled_from(list(ConsumeMode)),
        sizes1=stage_sizes(max_size=4),
        sizes2=stage_sizes(max_size=4),
        use_strategies=st.booleans(),
        use_groups=st.booleans(),
        reset_kind=st.sampled_from([None, None, "zero", "cycle"]),
        count=st.integers(1, 30),
        size_bytes=st.integers(1, 80),
        max_span=st.none() | st.integers(1, 30),
        queue_count=st.integers(1, 2),
        start=st.integers(0, 5),
        initial_stage=st.integers(0, 6),
        typos=st.booleans(),
    )
    def setup(
        self,
        mode: ConsumeMode,
        sizes1: list[int],
        sizes2: list[int],
        use_strategies: bool,
        use_groups: bool,
        reset_kind: str | None,
        count: int,
        size_bytes: int,
        max_span: int | None,
        queue_count: int,
        start: int,
        initial_stage: int,
        typos: bool,
    ) -> None:
        self.config = Config(
            mode=mode,
            definitions={"default": tuple(sizes1)}
            if not use_strategies
            else {"s1": tuple(sizes1), "s2": tuple(sizes2)},
            use_strategies=use_strategies,
            use_groups=use_groups,
            reset_kind=reset_kind,
            flow=FlowControl(count=count, size_bytes=size_bytes, max_span=max_span),
            typos=typos,
        )
        for queue_id in range(queue_count):
            initial: dict[StageKey, int] = {}
            if mode is ConsumeMode.STAGED and initial_stage:
                first = "s1" if use_strategies else "default"
                initial[StageKey(first, None)] = initial_stage
            pq = self.new_pq(queue_id, start, initial)
            self.queues.append(
                MQueue(
                    pq,
                    start,
                    dict(initial),
                    start - 1,
                    counters=dict(initial),
                    last_committed=start,
                )
            )

    def new_pq(self, queue_id: int, start: int, stage_offsets: dict[StageKey, int]) -> ProcessQueue:
        return ProcessQueue(
            MessageQueue(TOPIC, queue_id),
            self.config.mode,
            start_offset=start,
            stage_offsets=stage_offsets,
            plan=self.config.plan(),
            flow_control=self.config.flow,
            key_of=self.config.message_key if self.config.mode is ConsumeMode.KEY_ORDERED else None,
        )

    # -- model helpers -----------------------------------------------------------

    def assign(self, q: MQueue, message: Message) -> MMsg:
        """Naive stage assignment: walk the stage key one message at a time."""
        lane = self.config.key_of(message)
        size = len(message.body)
        if not isinstance(lane, StageKey):
            return MMsg(message, lane, TAIL_STAGE, -1, 0, size=size)
        sizes = self.config.definitions[lane.strategy_id]
        offset = q.counters.get(lane, 0)
        reset = False
        if self.config.reset_kind is not None and (
            offset >= sum(sizes) or is_stage_start(sizes, offset)
        ):
            wanted = max(0, self.config.reset(TOPIC, offset))
            if wanted != offset:
                offset, reset = wanted, True
        stage = stage_of(sizes, offset)
        last = q.last_epoch.get(lane)
        if last is None or reset or last[0] != stage:
            self.epoch_seq += 1
            last = q.last_epoch[lane] = (stage, self.epoch_seq)
        q.counters[lane] = offset + 1
        return MMsg(message, lane, stage, offset, last[1], size=size)

    def may_take(self, q: MQueue, m: MMsg) -> bool:
        """May the cached message ``m`` be taken now (ignoring FIFO order)?"""
        if self.config.mode is ConsumeMode.ORDERLY:
            return not any(x.state == "pending" for x in q.msgs.values())
        if self.config.mode is ConsumeMode.KEY_ORDERED and m.lane != "direct":
            return not any(x.state == "pending" and x.lane == m.lane for x in q.msgs.values())
        if isinstance(m.lane, StageKey):
            return all(
                x.state == "finished"
                for x in q.msgs.values()
                if x.lane == m.lane and x.epoch < m.epoch
            )
        return True

    def takeable(self, q: MQueue) -> bool:
        if q.pq.dropped or q.pq.paused:
            return False
        if any(b.state == "retry" and b.queue is q for b in self.batches):
            return True
        lanes = {m.lane for m in q.msgs.values() if m.state == "cached"}
        return any(self.may_take(q, q.cached_of(lane)[0]) for lane in lanes)

    # -- rules -----------------------------------------------------------------------

    @rule(
        data=st.data(),
        n=st.integers(0, 6),
        filtered=st.lists(st.booleans(), min_size=6, max_size=6),
        duplicate=st.booleans(),
    )
    def put(self, data: st.DataObject, n: int, filtered: list[bool], duplicate: bool) -> None:
        q = data.draw(st.sampled_from(self.queues))
        messages: list[Message] = []
        if duplicate and q.msgs:
            # a repeated pull of something already seen must be ignored
            messages.append(data.draw(st.sampled_from([m.message for m in q.msgs.values()])))
        last = q.highest
        for i in range(n):
            offset = q.highest + 1 + i
            last = offset
            if filtered[i]:
                continue
            tag = data.draw(st.sampled_from(self.config.tags()))
            group = data.draw(st.sampled_from(["", "g1", "g2"]))
            body = b"x" * data.draw(st.integers(0, 9))
            messages.append(
                Message(
                    topic=TOPIC,
                    queue_id=q.pq.message_queue.queue_id,
                    queue_offset=offset,
                    body=body,
                    keys=(tag, group),
                )
            )
        self.dispatcher.put_messages(q.pq, messages, highest_offset=last if n else None)
        for message in messages:
            if message.queue_offset <= q.highest:
                continue
            if q.held or self.config.holds(message):
                q.held.append(message)  # the queue stops at the first unknown strategy
            else:
                q.msgs[message.queue_offset] = self.assign(q, message)
        q.highest = max(q.highest, last)

    @rule(data=st.data(), max_count=st.integers(1, 5), direct=st.booleans())
    def take(self, data: st.DataObject, max_count: int, direct: bool) -> None:
        if direct:  # pausing and leases are the dispatcher's: a direct take ignores them
            unpaused: list[MQueue | None] = [q for q in self.queues if not q.pq.paused]
            q = data.draw(st.sampled_from(unpaused or [None]))
            if q is None:
                return
            batch = q.pq.try_take_messages(max_count)
            expected_work = self.takeable(q)
        else:
            batch = self.dispatcher.take(max_count)
            expected_work = any(self.takeable(q) for q in self.queues)
        if batch is None:
            assert not expected_work, "a batch may run now but take() returned None"
            return
        self.check_taken(batch, max_count)

    @rule(max_count=st.integers(1, 5))
    def drain(self, max_count: int) -> None:
        """Take until nothing is ready: liveness across the whole dispatcher."""
        while (batch := self.dispatcher.take(max_count)) is not None:
            self.check_taken(batch, max_count)
        assert not any(self.takeable(q) for q in self.queues)

    @rule(data=st.data())
    def take_singly_then_finish_one(self, data: st.DataObject) -> None:
        """Take one message at a time until nothing may be taken, finish one of those
        batches, and take again: every message of a stage taken, some not finished,
        the stage barrier's case (which random takes and finishes reach rarely)."""
        taken: list[MBatch] = []
        while (batch := self.dispatcher.take(1)) is not None:
            self.check_taken(batch, 1)
            b = next(b for b in self.batches if b.batch is batch)
            if b not in taken:
                taken.append(b)
        if not taken:
            return
        b = data.draw(st.sampled_from(taken))
        self.dispatcher.finish(b.batch, EraseStatus.SUCCESS)
        for m in b.msgs:
            m.state = "finished"
        self.batches.remove(b)
        batch = self.dispatcher.take(1)
        if batch is None:
            assert not any(self.takeable(q) for q in self.queues)
            return
        self.check_taken(batch, 1)

    def check_taken(self, batch: Batch, max_count: int) -> None:
        q = next(q for q in self.queues if q.pq is batch.process_queue)
        assert not q.pq.paused, "a batch of a paused queue was handed out"
        retried = next((b for b in self.batches if b.batch is batch), None)
        if retried is not None:
            assert retried.state == "retry", f"batch taken again while {retried.state}"
            retried.state = "running"
            again = 0 if retried.given_back else 1  # given back: taken as it was
            retried.given_back = False
            retried.attempt += again
            assert batch.attempt == retried.attempt
            assert [m.queue_offset for m in batch.messages] == [
                m.message.queue_offset for m in retried.msgs
            ]
            for mm, message in zip(retried.msgs, batch.messages, strict=True):
                assert message.reconsume_times == mm.message.reconsume_times + again
                mm.message = message
            return
        assert not any(b.state == "retry" and b.queue is q for b in self.batches), (
            "a new batch was taken before a resumed retry of the same queue"
        )
        assert 1 <= len(batch) <= max_count
        offsets = [m.queue_offset for m in batch.messages]
        mms = [q.msgs[o] for o in offsets]
        for mm, message in zip(mms, batch.messages, strict=True):
            assert mm.state == "cached", f"offset {mm.message.queue_offset} taken twice"
            assert message is mm.message or message == mm.message
        lane = mms[0].lane
        assert all(m.lane == lane for m in mms), "a batch mixes stage keys"
        assert all(m.epoch == mms[0].epoch for m in mms), "a batch crosses a stage boundary"
        # FIFO: the batch is the head of the lane's cached messages, in offset order
        head = q.cached_of(lane)[: len(mms)]
        assert [m.message.queue_offset for m in head] == offsets
        for m in mms:
            assert self.may_take(q, m), (
                f"offset {m.message.queue_offset} (stage {m.stage}) taken while an earlier"
                " stage of its key (or, orderly, an earlier batch) is unfinished"
            )
        assert batch.stage_index == mms[0].stage
        if isinstance(lane, StageKey):
            assert (batch.strategy_id, batch.group_id) == (lane.strategy_id, lane.group_id)
        elif lane == "direct":
            assert batch.strategy_id is None
        assert batch.attempt == 1
        for m in mms:
            m.state = "pending"
        self.batches.append(MBatch(batch, q, lane, mms))

    def running(self) -> list[MBatch]:
        return [b for b in self.batches if b.state == "running"]

    @precondition(lambda self: any(b.state == "running" for b in self.batches))
    @rule(data=st.data(), status=st.sampled_from(list(EraseStatus)))
    def finish(self, data: st.DataObject, status: EraseStatus) -> None:
        b = data.draw(st.sampled_from(self.running()))
        self.dispatcher.finish(b.batch, status)
        for m in b.msgs:
            m.state = "finished"
        self.batches.remove(b)

    @precondition(lambda self: any(b.state == "running" for b in self.batches))
    @rule(data=st.data(), status=st.sampled_from(list(EraseStatus)))
    def finish_some(self, data: st.DataObject, status: EraseStatus) -> None:
        b = data.draw(st.sampled_from(self.running()))
        chosen = data.draw(
            st.lists(st.sampled_from(b.msgs), min_size=1, max_size=len(b.msgs), unique=True)
        )
        self.dispatcher.finish_some(b.batch, [m.message for m in chosen], status)
        for m in chosen:
            m.state = "finished"
            b.msgs.remove(m)
        assert [m.queue_offset for m in b.batch.messages] == [
            m.message.queue_offset for m in b.msgs
        ]
        if not b.msgs:
            self.batches.remove(b)

    @precondition(lambda self: any(b.state == "running" for b in self.batches))
    @rule(data=st.data())
    def untake(self, data: st.DataObject) -> None:
        """Give a batch back (its handler never ran): its messages are cached again,
        or, a retry, it is a retry again; nothing counts as an attempt."""
        b = data.draw(st.sampled_from(self.running()))
        effects = self.dispatcher.untake(b.batch)
        dropped = b.queue.pq.dropped
        assert bool(effects & READY) == (not dropped)
        if b.batch.attempt == 1:
            for m in b.msgs:
                m.state = "cached"
            self.batches.remove(b)
        else:
            b.state = "dead" if dropped else "retry"
            b.given_back = True
        if dropped:
            assert bool(effects & DRAINED) == (b.queue.pq.in_handlers == 0)

    @precondition(lambda self: any(b.state == "running" for b in self.batches))
    @rule(data=st.data(), max_count=st.integers(0, 5))
    def take_ahead_and_give_back(self, data: st.DataObject, max_count: int) -> None:
        """A run takes the next messages of its lane and stage ahead of its calls
        (``take_more``), then gives back those it did not call (``untake_rest``):
        they are cached again, first in line, as if never taken."""
        b = data.draw(st.sampled_from(self.running()))
        q = b.queue
        before = len(b.batch.messages)
        expected: list[MMsg] = []
        if not (q.pq.paused or q.pq.dropped or b.batch.attempt != 1):
            epoch = b.msgs[0].epoch
            expected = [m for m in q.cached_of(b.lane) if m.epoch == epoch][:max_count]
        got = q.pq.take_more(b.batch, max_count)
        assert got == len(expected)
        assert [m.queue_offset for m in b.batch.messages[before:]] == [
            m.message.queue_offset for m in expected
        ]
        for m in expected:
            m.state = "pending"
        b.msgs += expected
        keep = data.draw(st.integers(before, len(b.msgs)))
        q.pq.untake_rest(b.batch, keep)
        for m in b.msgs[keep:]:
            m.state = "cached"
        del b.msgs[keep:]
        assert [m.queue_offset for m in b.batch.messages] == [
            m.message.queue_offset for m in b.msgs
        ]

    @precondition(lambda self: any(b.state == "running" for b in self.batches))
    @rule(data=st.data(), delay=st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    def suspend(self, data: st.DataObject, delay: float) -> None:
        b = data.draw(st.sampled_from(self.running()))
        self.dispatcher.suspend(b.batch, self.now + delay)
        b.state = "suspended"
        b.retry_at = self.now + delay

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def advance(self, dt: float) -> None:
        suspended = [b for b in self.batches if b.state == "suspended"]
        expected_timer = min((b.retry_at for b in suspended), default=None)
        assert self.dispatcher.get_timer() == expected_timer
        self.now += dt
        self.dispatcher.handle_timer(self.now)
        for b in suspended:
            if b.retry_at <= self.now:
                # a released queue never takes its retries back (they are pulled again)
                b.state = "dead" if b.queue.pq.dropped else "retry"

    @precondition(lambda self: any(not q.pq.dropped for q in self.queues))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """Release a queue: nothing more is taken from it; running batches may finish."""
        q = data.draw(st.sampled_from([q for q in self.queues if not q.pq.dropped]))
        q.pq.drop()
        for b in self.batches:
            if b.queue is q and b.state == "retry":
                b.state = "dead"
        assert q.pq.statistics().dropped
        assert not q.pq.has_ready()

    @rule(data=st.data())
    def pause(self, data: st.DataObject) -> None:
        """Pause a queue: nothing more is taken from it until it is unpaused."""
        q = data.draw(st.sampled_from(self.queues))
        self.dispatcher.pause(q.pq)
        assert q.pq.paused

    @precondition(lambda self: any(q.pq.paused for q in self.queues))
    @rule(data=st.data())
    def unpause(self, data: st.DataObject) -> None:
        q = data.draw(st.sampled_from([q for q in self.queues if q.pq.paused]))
        effects = self.dispatcher.unpause(q.pq)
        assert not q.pq.paused
        if self.takeable(q) and not q.pq.in_ready:
            raise AssertionError("an unpaused queue with work ready was not made ready")
        del effects

    @rule(data=st.data())
    def restart_assigns_same_stages(self, data: st.DataObject) -> None:
        """A ProcessQueue started from committed progress assigns the same stages."""
        q = data.draw(st.sampled_from(self.queues))
        committed = q.pq.committed_offset
        fresh = self.new_pq(
            q.pq.message_queue.queue_id, committed, dict(q.pq.committed_stage_offsets)
        )
        rest = [q.msgs[o].message for o in sorted(q.msgs) if o >= committed]
        fresh.put_messages(
            rest + q.held, highest_offset=q.highest if q.highest >= committed else None
        )
        seen: dict[int, int] = {}
        while True:
            batch = fresh.try_take_messages(3)
            if batch is None:
                break
            for message in batch.messages:
                assert message.queue_offset not in seen
                seen[message.queue_offset] = batch.stage_index
            fresh.erase_messages(batch, EraseStatus.SUCCESS)
        assert seen == {m.queue_offset: q.msgs[m.queue_offset].stage for m in rest}
        assert fresh.held_count == len(q.held)
        assert fresh.committed_offset == (q.held[0].queue_offset if q.held else q.highest + 1)

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def committed_offset_is_lowest_unfinished(self) -> None:
        for q in self.queues:
            unfinished = [m.message.queue_offset for m in q.unfinished()]
            unfinished += [m.queue_offset for m in q.held[:1]]
            expected = min(unfinished, default=q.highest + 1)
            committed = q.pq.committed_offset
            assert committed == expected
            assert committed >= q.last_committed, "committed offset moved backwards"
            q.last_committed = committed

    @invariant()
    def committed_stage_offsets_are_the_counters_at_the_committed_offset(self) -> None:
        for q in self.queues:
            committed = q.pq.committed_offset
            expected = dict(q.initial_stage_offsets)
            for offset in sorted(q.msgs):
                m = q.msgs[offset]
                if offset < committed and isinstance(m.lane, StageKey):
                    expected[m.lane] = m.stage_offset + 1
            assert dict(q.pq.committed_stage_offsets) == expected
            if self.config.reset_kind is None:
                # no reset: the stage offset counts the key's messages before it
                for key, value in expected.items():
                    before = sum(1 for o, m in q.msgs.items() if o < committed and m.lane == key)
                    assert value == q.initial_stage_offsets.get(key, 0) + before

    @invariant()
    def counts_bytes_span_and_flow_control_are_exact(self) -> None:
        flow = self.config.flow
        for q in self.queues:
            stats = q.pq.statistics()
            cached = [m for m in q.msgs.values() if m.state == "cached"]
            pending = [m for m in q.msgs.values() if m.state == "pending"]
            suspended = sum(
                len(b.msgs) for b in self.batches if b.queue is q and b.state != "running"
            )
            assert stats.cached_count == len(cached)
            assert stats.pending_count == len(pending)
            assert stats.suspended_count == suspended
            unfinished_bytes = sum(m.size for m in cached + pending)
            assert stats.cached_bytes == unfinished_bytes
            assert stats.held_count == len(q.held)
            held_bytes = sum(len(m.body) for m in q.held)
            assert stats.highest_offset == q.highest
            lowest = min((m.message.queue_offset for m in cached + pending), default=None)
            # counted in messages (sparse offsets span what is held, not id distance);
            # held messages count only when nothing is cached or pending
            span = (
                max(0, len(q.held) - 1)
                if lowest is None
                else sum(1 for m in q.msgs.values() if m.message.queue_offset >= lowest) - 1
            )
            assert stats.span == span
            full = (
                len(cached) + len(pending) + len(q.held) >= flow.count
                or unfinished_bytes + held_bytes >= flow.size_bytes
                or (flow.max_span is not None and span >= flow.max_span)
            )
            assert q.pq.is_cache_full() == full
            assert stats.committed_offset == q.pq.committed_offset

    @invariant()
    def an_unknown_strategy_holds_its_queue_and_says_why(self) -> None:
        for q in self.queues:
            failure = q.pq.assignment_error
            if not q.held:
                assert failure is None
                continue
            assert failure is not None
            assert failure.message.queue_offset == q.held[0].queue_offset
            assert failure.callback == "compute_strategy"
            assert failure.exception is None
            assert repr(STRATEGY_OF_TAG["unknown"]) in failure.detail
            for strategy in self.config.definitions:
                assert repr(strategy) in failure.detail
            assert "or None" in failure.detail

    @invariant()
    def orderly_has_at_most_one_batch_pending(self) -> None:
        if self.config.mode is ConsumeMode.ORDERLY:
            for q in self.queues:
                assert sum(1 for b in self.batches if b.queue is q) <= 1

    @invariant()
    def key_ordered_runs_one_batch_per_key_and_keeps_only_live_keys(self) -> None:
        if self.config.mode is not ConsumeMode.KEY_ORDERED:
            return
        for q in self.queues:
            pending_lanes = [b.lane for b in self.batches if b.queue is q and b.lane != "direct"]
            assert len(pending_lanes) == len(set(pending_lanes)), "two batches of one key"
            live = {m.lane for m in q.msgs.values() if m.state != "finished" and m.lane != "direct"}
            if not q.pq.dropped:
                assert q.pq.key_count == len(live), "a lane kept for a key with nothing left"

    @invariant()
    def timers_match_suspended_batches(self) -> None:
        assert self.dispatcher.suspended_count() == sum(
            1 for b in self.batches if b.state == "suspended"
        )


ProcessQueueMachine.TestCase.settings = settings(
    max_examples=3 * settings().max_examples,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestProcessQueue = pytest.mark.slow(ProcessQueueMachine.TestCase)


class StagedProcessQueueMachine(ProcessQueueMachine):
    """The same machine and model, on the case the general one reaches only now and
    then: staged mode, one queue, one stage key, stages of two to four messages, so
    that a stage's messages are taken by several batches, some of them still pending
    when the others finish (the stage barrier's case: a stage with nothing cached
    but something unfinished must keep the next one closed)."""

    @initialize(sizes=st.lists(st.sampled_from([2, 2, 3]), min_size=2, max_size=3))
    def setup(self, sizes: list[int]) -> None:
        ProcessQueueMachine.setup(
            self,
            mode=ConsumeMode.STAGED,
            sizes1=sizes,
            sizes2=sizes,
            use_strategies=False,  # one stage key: every message in one lane
            use_groups=False,
            reset_kind=None,
            count=30,
            size_bytes=1000,
            max_span=None,
            queue_count=1,
            start=0,
            initial_stage=0,
            typos=False,
        )

    # Only the rules of the barrier's case: messages arrive, are taken one or two at
    # a time, and finish, whole batches or some of their messages (plain methods of
    # the same names take the other rules out of this machine).
    @rule(data=st.data(), max_count=st.sampled_from([1, 1, 2]), direct=st.booleans())
    def take(self, data: st.DataObject, max_count: int, direct: bool) -> None:
        ProcessQueueMachine.take(self, data, max_count, direct)

    def drain(self) -> None:
        raise AssertionError("not a rule here")

    def untake(self) -> None:
        raise AssertionError("not a rule here")

    def take_ahead_and_give_back(self) -> None:
        raise AssertionError("not a rule here")

    def suspend(self) -> None:
        raise AssertionError("not a rule here")

    def drop(self) -> None:
        raise AssertionError("not a rule here")

    def pause(self) -> None:
        raise AssertionError("not a rule here")

    def unpause(self) -> None:
        raise AssertionError("not a rule here")

    def restart_assigns_same_stages(self) -> None:
        raise AssertionError("not a rule here")


StagedProcessQueueMachine.TestCase.settings = settings(
    max_examples=settings().max_examples,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStagedProcessQueue = pytest.mark.slow(StagedProcessQueueMachine.TestCase)
