"""Consumer control: where a new group starts, seek, pause and resume, message queue
listeners, lag, and key-ordered consumption."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offsetstore import MemoryOffsetStore, QueueProgress, ReadOffsetType, StageKey
from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumeFromWhere,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    InvalidOptionError,
    ListenerTypeError,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    MessageQueue,
    MessageQueueListener,
    Ordering,
    PushConsumer,
)

pytestmark = pytest.mark.anyio

Q0, Q1 = MessageQueue("t", 0), MessageQueue("t", 1)


def broker_with(per_queue: int, queues: int = 2) -> MemoryBroker:
    broker = MemoryBroker()
    broker.create_topic("t", queues)
    for q in range(queues):
        for i in range(per_queue):
            broker.send("t", f"{q}-{i}".encode(), queue_id=q)
    return broker


class Record(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        self.seen.extend((m.queue_id, m.queue_offset) for m in msgs)


# -- where a new group starts ------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET, list(range(6))),
        (ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET, [4, 5]),
        (ConsumeFromWhere.CONSUME_FROM_TIMESTAMP, [2, 3, 4, 5]),
    ],
)
async def test_a_new_group_starts_where_consume_from_where_says(
    where: ConsumeFromWhere, expected: list[int]
) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for _i in range(2):
        broker.send("t", b"old", queue_id=0)
    cut = time.time()
    for _i in range(2):
        broker.send("t", b"newer", queue_id=0)
    listener = Record()
    options = ConsumerOptions(
        consume_from_where=where,
        consume_timestamp=cut if where is ConsumeFromWhere.CONSUME_FROM_TIMESTAMP else None,
    )
    consumer = PushConsumer("g", broker, listener, options=options)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=5)
        for _ in range(2):
            broker.send("t", b"after start", queue_id=0)
        await consumer.wait_caught_up(timeout=5)
    assert sorted(o for _, o in listener.seen) == expected


async def test_committed_progress_wins_over_consume_from_where() -> None:
    broker = broker_with(4, queues=1)
    store = MemoryOffsetStore()
    store.update_progress("g", Q0, QueueProgress(consume_offset=1, stage_offsets={}))
    await store.persist("g", Q0)
    listener = Record()
    options = ConsumerOptions(consume_from_where=ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET)
    consumer = PushConsumer("g", broker, listener, offset_store=store, options=options)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=5)
    assert sorted(o for _, o in listener.seen) == [1, 2, 3]


def test_consume_from_timestamp_needs_a_timestamp() -> None:
    with pytest.raises(InvalidOptionError, match="consume_timestamp"):
        ConsumerOptions(consume_from_where=ConsumeFromWhere.CONSUME_FROM_TIMESTAMP)


@pytest.mark.parametrize(
    "where", [ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET, ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET]
)
def test_a_timestamp_without_consume_from_timestamp_is_refused(where: ConsumeFromWhere) -> None:
    """Not ignored (RocketMQ ignores it, but has a default for it; here it has none,
    so a timestamp given was meant to be used)."""
    with pytest.raises(InvalidOptionError) as info:
        ConsumerOptions(consume_from_where=where, consume_timestamp=1700000000.0)
    assert str(info.value) == (
        "consume_timestamp=1700000000.0 is used only by CONSUME_FROM_TIMESTAMP, but"
        f" consume_from_where is {where.name}: set"
        " consume_from_where=ConsumeFromWhere.CONSUME_FROM_TIMESTAMP to start from that"
        " time, or leave consume_timestamp out"
    )
    with pytest.raises(InvalidOptionError, match="CONSUME_FROM_TIMESTAMP"):
        ConsumerOptions(consume_timestamp=1700000000.0)  # the default consume_from_where


# -- seek ------------------------------------------------------------------------------


class Staged(MessageListenerStagedConcurrently):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def get_stage_definitions(self) -> Sequence[int]:
        return [2, 2]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        self.seen.extend((m.queue_id, m.queue_offset, context.stage_index) for m in msgs)


async def test_seek_backwards_replays_from_there_with_fresh_stages_and_commits_it() -> None:
    broker = broker_with(6, queues=1)
    store = MemoryOffsetStore()
    listener = Staged()
    consumer = PushConsumer("g", broker, listener, offset_store=store)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=5)
        assert [s for _, _, s in listener.seen] == [0, 0, 1, 1, -1, -1]
        listener.seen.clear()
        await consumer.seek(Q0, 3)
        assert (await store.read_offset("g", Q0)) == 3  # committed at once, backwards
        await consumer.wait_caught_up(timeout=5)
        # offsets 3.. again, and stages start over at the seek point
        assert sorted(listener.seen) == [(0, 3, 0), (0, 4, 0), (0, 5, 1)]
        listener.seen.clear()
        await consumer.seek(Q0, 4, stage_offsets={StageKey("default", None): 4})
        await consumer.wait_caught_up(timeout=5)
        assert sorted(listener.seen) == [(0, 4, -1), (0, 5, -1)]
        with pytest.raises(ConfigurationError, match="offset must be an int in"):
            await consumer.seek(Q0, 99)


@pytest.mark.parametrize(
    ("stage_offsets", "match"),
    [
        ({StageKey("default"): -1}, r"stage offset must be >= 0, got -1 for stage key 'default'"),
        (
            {"default": 25},
            r"stage offsets map StageKey to int: key 'default' is a str, not a StageKey"
            r" \(write StageKey\('default'\) for a strategy id\)",
        ),
        ({StageKey("default"): True}, r"stage offset must be an int, got True for stage key"),
        ([(StageKey("default"), 1)], r"stage offsets must be a mapping of StageKey to int"),
        (
            {StageKey("default"): 1, StageKey("vip", "shop-1"): 0, StageKey("bulk"): 0},
            r"unknown strategy id\(s\) 'bulk', 'vip'; the listener's strategies are"
            r" 'default' \(a stage offset of another strategy would be stored and never used\)",
        ),
    ],
)
async def test_seek_with_bad_stage_offsets_is_refused_before_the_queue_is_touched(
    stage_offsets: object, match: str
) -> None:
    """Once, a negative stage offset was stored by seek() and killed the pull loop,
    and the stored row could not be read back: every restart failed on it."""
    broker = broker_with(6, queues=1)
    store = MemoryOffsetStore()
    release = anyio.Event()

    class Gated(Staged):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
        ) -> None:
            await release.wait()
            await super().consume_message(msgs, context)

    listener = Gated()
    options = ConsumerOptions(persist_consumer_offset_interval=3600, shutdown_timeout=2)
    consumer = PushConsumer("g", broker, listener, offset_store=store, options=options)
    consumer.subscribe("t")
    async with consumer:
        with anyio.fail_after(5):
            while consumer.statistics().in_flight < 2:  # stage 0 in handlers, the rest cached
                await anyio.sleep(0.01)
        before = consumer.statistics().queues[Q0]
        with pytest.raises(
            ConfigurationError, match=f"seek\\(\\): bad stage_offsets for t#0: {match}"
        ):
            await consumer.seek(Q0, 0, stage_offsets=stage_offsets)  # type: ignore[arg-type]
        after = consumer.statistics().queues[Q0]
        assert not after.dropped
        assert after == before  # nothing dropped, nothing moved
        assert (after.cached_count, after.pending_count) == (4, 2)
        assert await store.read_progress("g", Q0, ReadOffsetType.READ_FROM_STORE) is None
        release.set()
        await consumer.wait_caught_up(timeout=5)
    assert sorted(listener.seen) == [
        (0, 0, 0),
        (0, 1, 0),
        (0, 2, 1),
        (0, 3, 1),
        (0, 4, -1),
        (0, 5, -1),
    ]
    assert await store.read_progress("g", Q0, ReadOffsetType.READ_FROM_STORE) == QueueProgress(
        consume_offset=6, stage_offsets={StageKey("default"): 6}
    )


class Strategies(MessageListenerStagedConcurrently):
    """Two strategies, by tag: ``vip`` messages one by one, the rest in stages of 2."""

    def get_stage_definitions(self) -> Sequence[int]:
        return [2]

    def get_stage_definition_strategies(self) -> dict[str, Sequence[int]]:
        return {"normal": [2], "vip": [1, 1]}

    def compute_strategy(self, msg: Message) -> str | None:
        return "vip" if msg.tags == "vip" else "normal"

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        pass


@pytest.mark.parametrize(
    ("make_listener", "strategies"),
    [(Staged, ["default"]), (Strategies, ["normal", "vip"])],
)
async def test_seek_takes_stage_keys_of_the_listeners_strategies_only(
    make_listener: Callable[[], MessageListenerStagedConcurrently], strategies: list[str]
) -> None:
    """A stage offset of a strategy the listener does not have (a typo, or the
    default strategy of a listener with named ones) would be stored and never used."""
    broker = broker_with(4, queues=1)
    store = MemoryOffsetStore()
    consumer = PushConsumer("g", broker, make_listener(), offset_store=store)
    consumer.subscribe("t")
    known = ", ".join(repr(strategy) for strategy in strategies)
    async with consumer:
        await consumer.wait_caught_up(timeout=5)
        before = await store.read_progress("g", Q0, ReadOffsetType.READ_FROM_STORE)
        with pytest.raises(
            ConfigurationError,
            match=f"unknown strategy id\\(s\\) 'vi'; the listener's strategies are {known} ",
        ):
            await consumer.seek(Q0, 1, stage_offsets={StageKey("vi", "shop-1"): 3})
        assert await store.read_progress("g", Q0, ReadOffsetType.READ_FROM_STORE) == before
        good = {StageKey(strategy, "shop-1"): 1 for strategy in strategies}
        await consumer.seek(Q0, 1, stage_offsets=good)
        assert await store.read_progress("g", Q0, ReadOffsetType.READ_FROM_STORE) == QueueProgress(
            consume_offset=1, stage_offsets=good
        )


async def test_seek_of_a_listener_without_stages_takes_any_stage_key() -> None:
    """Only a staged listener has strategies to check stage keys against; the others
    take stage_offsets as they always did."""
    broker = broker_with(4, queues=1)
    store = MemoryOffsetStore()
    consumer = PushConsumer("g", broker, Record(), offset_store=store)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=5)
        await consumer.seek(Q0, 1, stage_offsets={StageKey("anything"): 2})
        assert await store.read_offset("g", Q0) == 1


# -- pause and resume --------------------------------------------------------------------


async def test_pause_holds_a_queue_and_resume_lets_it_go_on() -> None:
    broker = broker_with(0)
    listener = Record()
    consumer = PushConsumer("g", broker, listener, options=ConsumerOptions())
    consumer.subscribe("t")
    async with consumer:
        consumer.pause([Q0])
        for _i in range(5):
            broker.send("t", b"x", queue_id=0)
            broker.send("t", b"y", queue_id=1)
        with anyio.fail_after(5):
            while len([1 for q, _ in listener.seen if q == 1]) < 5:
                await anyio.sleep(0.01)
        await anyio.sleep(0.05)
        assert [s for s in listener.seen if s[0] == 0] == []  # the paused queue waits
        stats = consumer.statistics()
        assert stats.paused_queues == [Q0]
        assert stats.queues[Q0].committed_offset == 0  # nothing committed past it
        consumer.resume(Q0)  # one queue as well as an iterable of them
        await consumer.wait_caught_up(timeout=5)
        assert sorted(o for q, o in listener.seen if q == 0) == list(range(5))
        assert consumer.statistics().paused_queues == []


async def test_pausing_a_topic_lets_running_calls_finish() -> None:
    broker = broker_with(3, queues=2)
    started = anyio.Event()
    release = anyio.Event()
    finished: list[int] = []

    class Slow(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            started.set()
            await release.wait()
            finished.extend(m.queue_offset for m in msgs)

    options = ConsumerOptions(consume_thread_max=1)
    consumer = PushConsumer("g", broker, Slow(), options=options)
    consumer.subscribe("t")
    async with consumer:
        await started.wait()
        consumer.pause("t")
        release.set()
        await anyio.sleep(0.05)
        assert len(finished) == 1  # the running call finished, no new one started
        assert consumer.statistics().paused_queues == [Q0, Q1]
        consumer.resume("t")
        await consumer.wait_caught_up(timeout=5)
    assert len(finished) == 6


async def test_pause_and_resume_refuse_what_the_consumer_does_not_consume() -> None:
    consumer = PushConsumer("g", broker_with(0), Record())
    consumer.subscribe("t")
    for call in (consumer.pause, consumer.resume):
        with pytest.raises(ValueError, match=r"not subscribed to topic 'tt' \(its topics: 't', "):
            call(["tt"])  # a typo
        with pytest.raises(
            ConfigurationError,
            match="u#0 is a queue of topic 'u', which this consumer is not subscribed to",
        ):
            call(MessageQueue("u", 0))
    consumer.pause("%RETRY%g")  # its retry topic is consumed too (concurrent mode)
    consumer.resume("%RETRY%g")
    async with consumer:
        with pytest.raises(
            ConfigurationError, match="t#9 is not a queue of topic 't', which has 2"
        ):
            consumer.resume([MessageQueue("t", 9)])
        with pytest.raises(ConfigurationError, match="'tt'"):
            consumer.pause([Q0, "tt"])
        assert consumer.statistics().paused_queues == []  # all or nothing
        # a queue held elsewhere (released here) can be paused: it comes back paused
        await consumer.release_queue(Q1)
        consumer.pause(Q1)
        await consumer.assign_queue(Q1)
        assert consumer.statistics().paused_queues == [Q1]
        consumer.resume([Q1])
        assert consumer.statistics().paused_queues == []


# -- listeners and lag -----------------------------------------------------------------


class Tell(MessageQueueListener):
    def __init__(self, store: MemoryOffsetStore, handled: list[tuple[int, int]]) -> None:
        self.store = store
        self.handled = handled
        self.events: list[tuple[str, list[MessageQueue], int]] = []

    async def on_queues_assigned(self, queues: Sequence[MessageQueue]) -> None:
        self.events.append(("assigned", list(queues), len(self.handled)))

    async def on_queues_revoked(self, queues: Sequence[MessageQueue]) -> None:
        committed = [await self.store.read_offset("g", mq) for mq in queues]
        self.events.append(("revoked", list(queues), sum(c or 0 for c in committed)))


class Broken(MessageQueueListener):
    async def on_queues_assigned(self, queues: Sequence[MessageQueue]) -> None:
        raise RuntimeError("listener bug")


async def test_queue_listeners_hear_assignment_before_work_and_revocation_after_commit() -> None:
    broker = broker_with(3)
    store = MemoryOffsetStore()
    listener = Record()
    tell = Tell(store, listener.seen)
    consumer = PushConsumer("g", broker, listener, offset_store=store)
    consumer.subscribe("t")
    consumer.register_message_queue_listener(Broken())
    consumer.register_message_queue_listener(tell)
    async with consumer:
        await consumer.wait_caught_up(timeout=5)
        await consumer.release_queue(Q1)
        stats = consumer.statistics()
    retry = [MessageQueue("%RETRY%g", 0), MessageQueue("%RETRY%g", 1)]  # normal, gray
    assert tell.events[0] == ("assigned", [*retry, Q0, Q1], 0)  # before any handler call
    assert tell.events[1] == ("revoked", [Q1], 3)  # its progress was committed first
    assert tell.events[2] == ("revoked", [*retry, Q0], 3)
    assert stats.listener_errors == 1


class PlainDef(MessageQueueListener):
    def on_queues_assigned(self, queues: Sequence[MessageQueue]) -> None:  # type: ignore[override]
        pass


class NoQueues(MessageQueueListener):
    async def on_queues_revoked(self) -> None:  # type: ignore[override]
        pass


@pytest.mark.parametrize(
    ("listener", "fragment"),
    [
        (
            PlainDef(),
            r"PlainDef\.on_queues_assigned is a plain def: the consumer awaits"
            r" on_queues_assigned\(queues\), which needs a coroutine; expected async def"
            r" on_queues_assigned\(self, queues\)",
        ),
        (
            NoQueues(),
            r"NoQueues\.on_queues_revoked\(self\) cannot be called as on_queues_revoked\(queues\)",
        ),
    ],
)
def test_a_queue_listener_of_the_wrong_shape_is_refused_when_registered(
    listener: MessageQueueListener, fragment: str
) -> None:
    consumer = PushConsumer("g", broker_with(1), Record())
    with pytest.raises(ListenerTypeError, match=fragment):
        consumer.register_message_queue_listener(listener)
    consumer.register_message_queue_listener(MessageQueueListener())  # the defaults: fine


async def test_statistics_report_lag_per_queue() -> None:
    broker = broker_with(4)
    release = anyio.Event()

    class Hold(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            if msgs[0].queue_id == 0:
                await release.wait()

    consumer = PushConsumer("g", broker, Hold())
    consumer.subscribe("t")
    async with consumer:
        with anyio.fail_after(5):
            while consumer.statistics().queues[Q1].committed_offset < 4:
                await anyio.sleep(0.01)
        stats = consumer.statistics()
        assert stats.queues[Q1].max_offset == 4
        assert stats.queues[Q1].lag == 0
        assert stats.queues[Q0].lag == 4
        assert stats.lag == 4
        release.set()
        await consumer.wait_caught_up(timeout=5)
        assert consumer.statistics().lag == 0


async def test_lag_of_paused_queues_follows_the_broker() -> None:
    """A paused queue is not pulled, so no pull reports its max offset: the consumer
    asks the broker every persist_consumer_offset_interval instead."""
    broker = broker_with(4)
    options = ConsumerOptions(persist_consumer_offset_interval=0.05)
    consumer = PushConsumer("g", broker, Record(), options=options)
    consumer.subscribe("t")
    consumer.pause(Q0)  # never pulled
    async with consumer:
        with anyio.fail_after(5):
            while consumer.statistics().queues[Q1].committed_offset < 4:
                await anyio.sleep(0.01)
            while consumer.statistics().queues[Q0].lag != 4:
                await anyio.sleep(0.01)
        assert consumer.statistics().lag == 4
        consumer.pause(Q1)  # pulled, then paused (its long poll may still deliver)
        for _ in range(3):
            broker.send("t", b"later", queue_id=1)
            broker.send("t", b"later", queue_id=0)
        with anyio.fail_after(5):
            while consumer.statistics().lag != 4 + 3 + 3:
                await anyio.sleep(0.01)
        stats = consumer.statistics()
        assert (stats.queues[Q0].lag, stats.queues[Q1].lag) == (7, 3)
        assert (stats.queues[Q0].max_offset, stats.queues[Q1].max_offset) == (7, 7)
        consumer.resume([Q0, Q1])
        await consumer.wait_caught_up(timeout=5)
        assert consumer.statistics().lag == 0


async def test_lag_of_a_queue_held_by_flow_control_follows_the_broker() -> None:
    broker = broker_with(4, queues=1)
    release = anyio.Event()

    class Hold(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            await release.wait()

    options = ConsumerOptions(
        persist_consumer_offset_interval=0.05, pull_threshold_for_queue=2, pull_batch_size=2
    )
    consumer = PushConsumer("g", broker, Hold(), options=options)
    consumer.subscribe("t")
    async with consumer:
        with anyio.fail_after(5):
            while consumer.statistics().in_flight < 2:
                await anyio.sleep(0.01)
        for _ in range(5):
            broker.send("t", b"later", queue_id=0)
        with anyio.fail_after(5):  # not pulled (2 unfinished), yet its lag is current
            while consumer.statistics().queues[Q0].lag != 9:
                await anyio.sleep(0.01)
        assert consumer.statistics().queues[Q0].cached_count == 0
        release.set()
        await consumer.wait_caught_up(timeout=5)


# -- key-ordered consumption -------------------------------------------------------------


class ByKey(MessageListenerOrderly):
    ordering = Ordering.BY_KEY

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, list[int], float, float]] = []
        self.running: set[str] = set()
        self.overlaps = 0

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        key = msgs[0].keys[0] if msgs[0].keys else None
        if key is not None:
            if key in self.running:
                self.overlaps += 1
            self.running.add(key)
        start = anyio.current_time()
        await anyio.sleep(0.001 * (len(key or "") % 3))
        if key is not None:
            self.running.discard(key)
        self.calls.append((key, [m.queue_offset for m in msgs], start, anyio.current_time()))


@settings(max_examples=25, deadline=None)
@given(
    keys=st.lists(st.sampled_from(["a", "bb", "ccc", "d", None]), min_size=1, max_size=40),
    batch=st.integers(1, 3),
)
def test_key_ordered_runs_one_call_per_key_in_offset_order_and_loses_nothing(
    keys: list[str | None], batch: int
) -> None:
    async def run() -> ByKey:
        broker = MemoryBroker()
        broker.create_topic("t", 1)
        for key in keys:
            broker.send("t", b"x", keys=() if key is None else (key,), queue_id=0)
        listener = ByKey()
        options = ConsumerOptions(consume_message_batch_max_size=batch, consume_thread_max=4)
        consumer = PushConsumer("g", broker, listener, options=options)
        consumer.subscribe("t")
        async with consumer:
            await consumer.wait_caught_up(timeout=10)
            stats = consumer.statistics()
        assert stats.queues[Q0].key_count == 0  # no key is kept once done
        assert dict(stats.queues[Q0].stage_offsets) == {}  # nothing per key committed
        return listener

    listener = anyio.run(run)
    assert listener.overlaps == 0
    handled = sorted(o for _, offsets, _, _ in listener.calls for o in offsets)
    assert handled == list(range(len(keys)))  # every message once
    for key in {k for k in keys if k is not None}:
        mine = [offsets for k, offsets, _, _ in listener.calls if k == key]
        flat = [o for offsets in mine for o in offsets]
        assert flat == sorted(flat)  # per key, offsets increase call after call
        assert flat == [i for i, k in enumerate(keys) if k == key]
        assert all(keys[o] == key for o in flat)  # a batch holds one key


async def test_key_ordered_runs_different_keys_concurrently_with_bounded_memory() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for i in range(2000):
        broker.send("t", b"x", keys=(f"key-{i}",), queue_id=0)  # every key distinct
    listener = ByKey()
    options = ConsumerOptions(pull_threshold_for_queue=100)
    consumer = PushConsumer("g", broker, listener, options=options)
    consumer.subscribe("t")
    peak = 0
    async with consumer:
        with anyio.fail_after(20):
            while consumer.statistics().consumed_ok < 2000:
                peak = max(peak, consumer.statistics().queues[Q0].key_count)
                await anyio.lowlevel.checkpoint()
    assert 1 < peak <= 100 + 32  # the flow-control threshold (+ one pull), not 2000
    assert listener.overlaps == 0
