"""PushConsumer behaviour: configuration errors, failures, retries, DLQ, shutdown."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from trio.testing import MockClock

from offsetstore import MemoryOffsetStore, ReadOffsetType
from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
    ConsumerOptions,
    ConsumerStateError,
    ConsumeStagedConcurrentlyContext,
    InvalidStageDefinitionError,
    ListenerTypeError,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    MessageQueue,
    PushConsumer,
    UnknownTopicError,
)

pytestmark = pytest.mark.anyio

VIRTUAL = pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-virtual")


def broker_with(messages: int, queues: int = 1, topic: str = "t") -> MemoryBroker:
    broker = MemoryBroker()
    broker.create_topic(topic, queues)
    for i in range(messages):
        broker.send(topic, str(i).encode(), queue_id=i % queues)
    return broker


class Concurrent(MessageListenerConcurrently):
    def __init__(self, fail: Any = None, result: Any = None) -> None:
        self.seen: list[Message] = []
        self.fail = fail or (lambda m: False)
        self.result = result

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> Any:
        self.seen.extend(msgs)
        if any(self.fail(m) for m in msgs):
            raise RuntimeError("boom")
        return self.result


class Orderly(MessageListenerOrderly):
    def __init__(self, fail: Any = None, cost: float = 0.0) -> None:
        self.seen: list[tuple[int, int, float]] = []
        self.fail = fail or (lambda m: False)
        self.cost = cost

    async def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> Any:
        for m in msgs:
            self.seen.append((m.queue_offset, m.reconsume_times, anyio.current_time()))
        await anyio.sleep(self.cost)
        if any(self.fail(m) for m in msgs):
            return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        return None


class Staged(MessageListenerStagedConcurrently):
    def __init__(self, stages: Sequence[int], fail: Any = None, cost: float = 0.0) -> None:
        self.stages = stages
        self.events: list[tuple[str, int, int, int, float]] = []
        self.fail = fail or (lambda m: False)
        self.cost = cost
        self.batches: list[tuple[int, list[int]]] = []

    def get_stage_definitions(self) -> Sequence[int]:
        return self.stages

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        self.batches.append((context.stage_index, [m.queue_offset for m in msgs]))
        for m in msgs:
            self.events.append(
                (
                    "start",
                    m.queue_offset,
                    context.stage_index,
                    m.reconsume_times,
                    anyio.current_time(),
                )
            )
        await anyio.sleep(self.cost)
        if any(self.fail(m) for m in msgs):
            context.suspend_current_queue_time_millis = 50
            raise ValueError("stage handler failed")
        for m in msgs:
            self.events.append(
                (
                    "end",
                    m.queue_offset,
                    context.stage_index,
                    m.reconsume_times,
                    anyio.current_time(),
                )
            )


async def consume(consumer: PushConsumer, topic: str = "t", timeout: float = 60) -> None:
    consumer.subscribe(topic)
    async with consumer:
        await consumer.wait_caught_up(timeout=timeout)


# -- configuration errors ----------------------------------------------------------


def test_listener_of_wrong_kind() -> None:
    class NotAListener:
        async def consume_message(self, msgs: Any, context: Any) -> None: ...

    with pytest.raises(ListenerTypeError, match="NotAListener"):
        PushConsumer("g", MemoryBroker(), NotAListener())  # type: ignore[arg-type]


def test_listener_class_instead_of_an_instance_says_pass_an_instance() -> None:
    with pytest.raises(ListenerTypeError, match=r"pass an instance, Concurrent\(\.\.\.\)"):
        PushConsumer("g", MemoryBroker(), Concurrent)  # type: ignore[arg-type]

    class NotAListener:
        pass

    with pytest.raises(ListenerTypeError, match="got the class NotAListener"):
        PushConsumer("g", MemoryBroker(), NotAListener)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [5, None, "consume"])
def test_consume_message_that_is_not_callable_is_caught_at_construction(value: object) -> None:
    # as written in a class body: ``consume_message = 5``
    broken = type("Broken", (MessageListenerConcurrently,), {"consume_message": value})
    with pytest.raises(ListenerTypeError, match=r"Broken\.consume_message must be a method"):
        PushConsumer("g", MemoryBroker(), broken())


@pytest.mark.parametrize(
    ("stages", "fragment"),
    [
        ([10, 0], r"\[1\] must be a positive int, got 0"),
        ([-1], "positive"),
        ([1.5], "must be an int"),
        ([True], "must be an int"),
        ("10", "sequence"),
    ],
)
def test_bad_stage_definitions_are_named(stages: Any, fragment: str) -> None:
    with pytest.raises(InvalidStageDefinitionError, match=fragment):
        PushConsumer("g", MemoryBroker(), Staged(stages))


def test_bad_group_source_and_options() -> None:
    with pytest.raises(ConfigurationError, match="group"):
        PushConsumer("", MemoryBroker(), Concurrent())
    with pytest.raises(ConfigurationError, match="MessageSource"):
        PushConsumer("g", object(), Concurrent())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="ConsumerOptions"):
        PushConsumer("g", MemoryBroker(), Concurrent(), options={"consume_thread_max": 2})  # type: ignore[arg-type]


def test_unknown_topic_fails_at_subscribe() -> None:
    consumer = PushConsumer("g", broker_with(1), Concurrent())
    with pytest.raises(UnknownTopicError, match="nope"):
        consumer.subscribe("nope")


async def test_unknown_topic_fails_at_start_when_the_source_cannot_tell_earlier() -> None:
    class Opaque(MemoryBroker):
        # MessageSource.topic_exists may answer None (cannot tell); MemoryBroker narrows
        # it to bool, and this broker widens it back on purpose
        def topic_exists(self, topic: str) -> None:  # type: ignore[override]
            return None

    broker = Opaque()
    consumer = PushConsumer("g", broker, Concurrent())
    consumer.subscribe("nope")
    with pytest.raises(UnknownTopicError, match="nope"):
        async with consumer:
            pass


async def test_lifecycle_errors() -> None:
    consumer = PushConsumer("g", broker_with(0), Concurrent())
    with pytest.raises(ConsumerStateError, match="subscribe"):
        async with consumer:
            pass
    consumer.subscribe("t")
    with pytest.raises(ConsumerStateError):
        await consumer.wait_caught_up()
    async with consumer:
        with pytest.raises(ConsumerStateError):
            consumer.subscribe("t")
    with pytest.raises(ConsumerStateError, match="once"):
        async with consumer:
            pass


# -- consuming -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["concurrent", "orderly", "staged"])
async def test_sync_handlers_run_in_worker_threads(kind: str) -> None:
    main = threading.get_ident()
    threads: set[int] = set()
    offsets: list[int] = []

    def handler(msgs: Sequence[Message], context: Any) -> None:
        threads.add(threading.get_ident())
        offsets.extend(m.queue_offset for m in msgs)

    listener: Any
    if kind == "concurrent":
        listener = type(
            "L", (MessageListenerConcurrently,), {"consume_message": lambda s, m, c: handler(m, c)}
        )()
    elif kind == "orderly":
        listener = type(
            "L", (MessageListenerOrderly,), {"consume_message": lambda s, m, c: handler(m, c)}
        )()
    else:
        listener = type(
            "L",
            (MessageListenerStagedConcurrently,),
            {
                "consume_message": lambda s, m, c: handler(m, c),
                "get_stage_definitions": lambda s: [2, 3],
            },
        )()
    await consume(PushConsumer("g", broker_with(20, 2), listener))
    assert sorted(offsets) == sorted(list(range(10)) * 2)
    assert main not in threads


async def test_batches_respect_size_and_stage() -> None:
    listener = Staged([3, 5])
    options = ConsumerOptions(consume_message_batch_max_size=4)
    await consume(PushConsumer("g", broker_with(12), listener, options=options))
    assert all(len(offsets) <= 4 for _, offsets in listener.batches)
    stage_of = {0: range(3), 1: range(3, 8), -1: range(8, 12)}
    for stage, offsets in listener.batches:
        assert all(o in stage_of[stage] for o in offsets), (stage, offsets)
    assert sorted(o for _, offs in listener.batches for o in offs) == list(range(12))


async def test_tag_filter_skips_other_tags_and_commits_past_them() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for i in range(10):
        broker.send("t", b"x", tags="a" if i % 3 == 0 else "b" if i % 3 == 1 else "c")
    listener = Concurrent()
    consumer = PushConsumer("g", broker, listener)
    consumer.subscribe("t", "a || c")
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
        assert consumer.statistics().committed_offsets[MessageQueue("t", 0)] == 10
    assert sorted(m.queue_offset for m in listener.seen) == [0, 2, 3, 5, 6, 8, 9]


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_orderly_failure_suspends_the_queue_and_retries_in_order() -> None:
    listener = Orderly(fail=lambda m: m.queue_offset == 3 and m.reconsume_times < 2, cost=1)
    consumer = PushConsumer("g", broker_with(6), listener)
    await consume(consumer)
    offsets = [(o, r) for o, r, _ in listener.seen]
    assert offsets == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (3, 2), (4, 0), (5, 0)]
    times = {(o, r): t for o, r, t in listener.seen}
    # suspend_current_queue_time_millis defaults to 1000: 1 s cost + 1 s pause
    assert times[(3, 1)] - times[(3, 0)] == pytest.approx(2.0)
    stats = consumer.statistics()
    assert stats.consumed_ok == 6
    assert stats.consumed_failed == 2


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_staged_failure_holds_back_the_next_stage() -> None:
    listener = Staged([3, 3], fail=lambda m: m.queue_offset == 1 and m.reconsume_times < 3, cost=1)
    await consume(PushConsumer("g", broker_with(8), listener))
    ends = {o: t for kind, o, _, _, t in listener.events if kind == "end"}
    starts = [(o, t) for kind, o, _, _, t in listener.events if kind == "start"]
    stage0_done = max(ends[o] for o in range(3))
    assert all(t >= stage0_done for o, t in starts if o >= 3)
    retried = [r for kind, o, _, r, _ in listener.events if kind == "start" and o == 1]
    assert retried == [0, 1, 2, 3]
    assert sorted(ends) == list(range(8))


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_staged_dead_letters_after_max_reconsume_times_and_moves_on() -> None:
    broker = broker_with(6)
    listener = Staged([2, 2], fail=lambda m: m.queue_offset == 2)
    options = ConsumerOptions(max_reconsume_times=2)
    consumer = PushConsumer("g", broker, listener, options=options)
    await consume(consumer)
    (dead,) = broker.messages("%DLQ%g")
    assert dead.queue_offset == 0
    assert dead.body == b"2"
    assert dead.reconsume_times == 2
    ends = sorted(o for kind, o, *_ in listener.events if kind == "end")
    assert ends == [0, 1, 3, 4, 5]
    assert consumer.statistics().dead_lettered == 1


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_concurrent_failure_goes_through_the_retry_queue_then_dlq() -> None:
    broker = broker_with(3)
    listener = Concurrent(fail=lambda m: m.body == b"1")
    options = ConsumerOptions(max_reconsume_times=2)
    consumer = PushConsumer("g", broker, listener, options=options)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
        with anyio.fail_after(600):
            while not broker.messages("%DLQ%g"):
                await anyio.sleep(1)
        stats = consumer.statistics()
    tries = [m for m in listener.seen if m.body == b"1"]
    assert [m.reconsume_times for m in tries] == [0, 1, 2]
    assert all(m.topic == "t" for m in tries)
    assert stats.sent_back == 2
    assert stats.dead_lettered == 1
    assert stats.consumed_ok == 2
    (dead,) = broker.messages("%DLQ%g")
    assert dead.body == b"1"


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_a_retried_message_has_its_topic_and_the_retry_queue_s_position() -> None:
    """What the Message docstring and the README say of a retried message (RocketMQ's
    behaviour): topic restored, queue id and offset of the retry queue, which is the
    context's message queue; the same msg_id (RocketMQ's getMsgId(), the producer's
    UNIQ_KEY), also in ORIGIN_MESSAGE_ID, and a new offset_msg_id."""
    broker = broker_with(4, queues=2)  # b"3" is t#1 at offset 1
    seen: list[tuple[Message, MessageQueue]] = []

    class FailOnce(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            seen.extend((m, context.message_queue) for m in msgs)
            if any(m.body == b"3" and m.reconsume_times == 0 for m in msgs):
                context.delay_level_when_next_consume = 1
                raise ValueError("once")

    consumer = PushConsumer("g", broker, FailOnce())
    consumer.subscribe("t")
    async with consumer:
        with anyio.fail_after(600):
            while len(seen) < 5:
                await anyio.sleep(1)
        await consumer.wait_caught_up(timeout=10)
    (first, first_mq), (retried, retried_mq) = [(m, q) for m, q in seen if m.body == b"3"]
    assert (first.topic, first.queue_id, first.queue_offset) == ("t", 1, 1)
    assert first_mq == MessageQueue("t", 1)
    assert (retried.topic, retried.queue_id, retried.queue_offset) == ("t", 0, 0)
    assert retried_mq == MessageQueue("%RETRY%g", 0)
    assert retried.reconsume_times == 1
    assert retried.msg_id == first.msg_id
    assert retried.offset_msg_id != first.offset_msg_id == first.msg_id
    assert retried.properties["ORIGIN_MESSAGE_ID"] == first.msg_id
    assert retried.properties["RETRY_TOPIC"] == "t"
    assert "RETRY_TOPIC" not in first.properties


async def test_concurrent_ack_index_sends_back_the_rest() -> None:
    class Partial(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> Any:
            context.ack_index = 0
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

    broker = broker_with(4)
    options = ConsumerOptions(consume_message_batch_max_size=4)
    consumer = PushConsumer("g", broker, Partial(), options=options)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
        stats = consumer.statistics()
    assert stats.consumed_ok == 1
    assert stats.sent_back == 3


async def test_unexpected_return_value_counts_as_failure() -> None:
    listener = Concurrent(result="yes")
    broker = broker_with(1)
    consumer = PushConsumer("g", broker, listener)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
        assert consumer.statistics().sent_back == 1


async def test_handler_errors_never_stop_the_consumer() -> None:
    listener = Concurrent(fail=lambda m: True)
    consumer = PushConsumer("g", broker_with(50, 4), listener)
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
        stats = consumer.statistics()
    assert stats.consumed_failed == 50
    assert stats.sent_back == 50


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_reset_hook_restarts_stages_at_a_boundary() -> None:
    calls: list[int] = []

    class Campaigns(Staged):
        def reset_current_stage_offset_if_need(self, topic: str, current: int) -> int:
            calls.append(current)
            return 0 if current >= 5 else current  # a new campaign after 5 messages

    listener = Campaigns([2, 3])
    await consume(PushConsumer("g", broker_with(12), listener))
    stages = {o: s for kind, o, s, _, _ in listener.events if kind == "end"}
    assert [stages[o] for o in range(12)] == [0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0]
    assert calls[:4] == [0, 2, 5, 2]


# -- progress, shutdown ------------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_graceful_shutdown_drains_in_flight_and_persists() -> None:
    store = MemoryOffsetStore()
    broker = broker_with(10)
    listener = Orderly(cost=5)
    consumer = PushConsumer("g", broker, listener, offset_store=store)
    consumer.subscribe("t")
    async with consumer:
        with anyio.fail_after(100):
            while len(listener.seen) < 3:
                await anyio.sleep(0.5)
    # the third message was in flight when we left the block: it finished
    assert [o for o, _, _ in listener.seen] == [0, 1, 2]
    progress = await store.read_progress("g", MessageQueue("t", 0), ReadOffsetType.READ_FROM_STORE)
    assert progress is not None
    assert progress.consume_offset == 3

    listener2 = Orderly()
    await consume(PushConsumer("g", broker, listener2, offset_store=store))
    assert [o for o, _, _ in listener2.seen] == list(range(3, 10))


async def test_consumers_given_no_store_share_one_per_broker() -> None:
    """As a RocketMQ broker keeps its groups' offsets: a consumer given no store
    resumes where an earlier member of its group on the same broker committed; other
    groups and other brokers start afresh."""
    broker = broker_with(10, queues=2)
    first = Concurrent()
    await consume(PushConsumer("g", broker, first))
    assert len(first.seen) == 10

    again, other_group = Concurrent(), Concurrent()
    await consume(PushConsumer("g", broker, again))
    await consume(PushConsumer("other", broker, other_group))
    assert again.seen == []
    assert len(other_group.seen) == 10

    other_broker = broker_with(10, queues=2)
    elsewhere = Concurrent()
    await consume(PushConsumer("g", other_broker, elsewhere))
    assert len(elsewhere.seen) == 10
    consumer = PushConsumer("g", broker, Concurrent())
    assert consumer.offset_store is PushConsumer("h", broker, Concurrent()).offset_store
    assert consumer.offset_store is not PushConsumer("g", other_broker, Concurrent()).offset_store


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_shutdown_timeout_cancels_handlers_and_keeps_their_messages() -> None:
    store = MemoryOffsetStore()
    broker = broker_with(3)
    listener = Orderly(cost=1000)
    options = ConsumerOptions(shutdown_timeout=2)
    consumer = PushConsumer("g", broker, listener, offset_store=store, options=options)
    consumer.subscribe("t")
    start = anyio.current_time()
    async with consumer:
        await anyio.sleep(1)
    assert anyio.current_time() - start == pytest.approx(3)
    assert await store.read_offset("g", MessageQueue("t", 0), ReadOffsetType.READ_FROM_STORE) in (
        None,
        0,
    )
    again = Orderly()
    await consume(PushConsumer("g", broker, again, offset_store=store))
    assert [o for o, _, _ in again.seen] == [0, 1, 2]


NO_WATCHDOG = ConsumerOptions(event_loop_block_threshold=None)
"""For tests spanning minutes of virtual time: the loop watchdog reports nothing there
(the loop's clock stands still while the loop works), and its beat every 0.1 s would
be nearly all of their work."""


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_progress_is_persisted_on_the_interval() -> None:
    store = MemoryOffsetStore()
    options = ConsumerOptions(persist_consumer_offset_interval=5)
    consumer = PushConsumer(
        "g", broker_with(4, 2), Concurrent(), offset_store=store, options=options
    )
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up()
        assert store.write_count == 0
        await anyio.sleep(5.5)
        assert store.write_count == 1
        stored = await store.list_progress("g", "t")
        assert {mq.queue_id: p.consume_offset for mq, p in stored.items()} == {0: 2, 1: 2}


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_wait_caught_up_times_out_saying_what_is_behind() -> None:
    consumer = PushConsumer("g", broker_with(3), Orderly(cost=100), options=NO_WATCHDOG)
    consumer.subscribe("t")
    async with consumer:
        with pytest.raises(TimeoutError) as info:
            await consumer.wait_caught_up(timeout=150)
        assert str(info.value) == (
            "not caught up after 150 s: 1 of 1 queue(s) behind the max offsets of the call:"
            " t#0 at committed offset 1 of 3 (1 in handlers, 1 cached)"
        )
        consumer.pause("t")
        with pytest.raises(
            TimeoutError, match=r"t#0 at committed offset 2 of 3 \(1 cached, paused\)"
        ):
            await consumer.wait_caught_up(timeout=100)


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_wait_caught_up_without_timeout_waits_as_long_as_a_queue_is_paused() -> None:
    listener = Orderly(cost=1)
    consumer = PushConsumer("g", broker_with(3), listener, options=NO_WATCHDOG)
    consumer.subscribe("t")
    consumer.pause("t")
    async with consumer:
        returned_at: list[float] = []

        async def wait() -> None:
            await consumer.wait_caught_up()
            returned_at.append(anyio.current_time())

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.sleep(600)  # ten minutes on, still waiting: the queue is paused
            assert returned_at == []
            resumed_at = anyio.current_time()
            consumer.resume("t")
    assert len(listener.seen) == 3
    assert returned_at == [pytest.approx(resumed_at + 3)]  # caught up 3 x 1 s after resuming


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_a_timeout_names_ten_queues_behind_and_counts_the_rest() -> None:
    consumer = PushConsumer("g", broker_with(24, 12), Orderly(cost=100))
    consumer.subscribe("t")
    consumer.pause("t")  # nothing is pulled
    async with consumer:
        with pytest.raises(TimeoutError) as info:
            await consumer.wait_caught_up(timeout=1)
    message = str(info.value)
    assert "12 of 12 queue(s) behind" in message
    assert "; t#9 at committed offset 0 of 2 (paused, not pulled yet); " in message
    assert "t#10" not in message
    assert message.endswith("; 2 more, 4 offset(s) behind in all")


async def test_statistics_snapshot() -> None:
    consumer = PushConsumer("g", broker_with(20, 2), Staged([5]))
    consumer.subscribe("t")
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
        stats = consumer.statistics()
    assert stats.group == "g"
    assert stats.mode == "staged"
    assert stats.consumed_ok == 20
    assert stats.in_flight == 0
    assert stats.cached_count == 0
    assert stats.pending_count == 0
    assert set(stats.queues) == {MessageQueue("t", 0), MessageQueue("t", 1)}
    assert stats.committed_offsets == {MessageQueue("t", 0): 10, MessageQueue("t", 1): 10}
    q0 = stats.queues[MessageQueue("t", 0)]
    assert dict(q0.stage_offsets) == {next(iter(q0.stage_offsets)): 10}
    with pytest.raises(AttributeError):
        stats.consumed_ok = 1  # type: ignore[misc]


@pytest.mark.parametrize("anyio_backend", [VIRTUAL])
async def test_flow_control_bounds_the_cache() -> None:
    peak = 0

    class Watch(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            nonlocal peak
            stats = consumer.statistics().queues[context.message_queue]
            peak = max(peak, stats.cached_count + stats.pending_count)
            await anyio.sleep(0.01)

    options = ConsumerOptions(pull_threshold_for_queue=50, pull_batch_size=32)
    consumer = PushConsumer("g", broker_with(2000), Watch(), options=options)
    await consume(consumer, timeout=1000)
    assert 20 <= peak < 50 + 32
