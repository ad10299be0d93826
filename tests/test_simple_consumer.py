"""SimpleConsumer (pop consumption) on the embedded broker, on asyncio and trio.

Invisible durations are measured on a manual clock given to the broker, so these
tests advance time by assignment instead of sleeping.
"""

from __future__ import annotations

import pickle

import anyio
import pytest

from stagedconsumer import (
    ConfigurationError,
    ConsumeMessageContext,
    ConsumeMessageHook,
    ConsumeMessageTraceHook,
    ConsumeReturnType,
    ConsumerStateError,
    InvalidOptionError,
    InvalidReceiptHandleError,
    MemoryBroker,
    ReceivedMessage,
    SimpleConsumer,
    SimpleConsumerOptions,
    TraceType,
    UnknownTopicError,
    decode_trace_data,
    trace_messages_of,
)
from stagedconsumer._sources._source import PROPERTY_ORIGIN_MESSAGE_ID, PROPERTY_RETRY_TOPIC

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def broker(clock: Clock) -> MemoryBroker:
    broker = MemoryBroker(clock=clock)
    broker.create_topic("jobs", 2)
    return broker


def consumer(
    broker: MemoryBroker, group: str = "g", expression: str = "*", **options: object
) -> SimpleConsumer:
    return SimpleConsumer(
        group,
        broker,
        subscriptions={"jobs": expression},
        await_duration=0,
        options=SimpleConsumerOptions(**options),  # type: ignore[arg-type]
    )


async def test_receive_returns_each_message_once_until_acked(broker: MemoryBroker) -> None:
    sent = [broker.send("jobs", b"%d" % i) for i in range(5)]
    async with consumer(broker) as c:
        first = await c.receive(3, 30)
        rest = await c.receive(10, 30)
        assert len(first) == 3
        assert sorted(m.msg_id for m in first + rest) == sorted(m.msg_id for m in sent)
        assert all(isinstance(m, ReceivedMessage) and m.delivery_attempt == 1 for m in first)
        assert await c.receive(10, 30) == []
        for m in first + rest:
            await c.ack(m)
        assert await c.receive(10, 30) == []


async def test_unacked_message_comes_back_after_its_invisible_time(
    broker: MemoryBroker, clock: Clock
) -> None:
    sent = broker.send("jobs", b"x")
    async with consumer(broker) as c:
        (m,) = await c.receive(1, 10)
        clock.now += 9.9
        assert await c.receive(1, 10) == []
        clock.now += 0.1
        (again,) = await c.receive(1, 10)
        assert again.msg_id == sent.msg_id
        assert again.delivery_attempt == 2
        assert again.reconsume_times == 1
        with pytest.raises(InvalidReceiptHandleError, match="no longer has it in flight"):
            await c.ack(m)  # the first delivery lost it
        await c.ack(again)


async def test_ack_after_the_invisible_time_is_refused_as_expired(
    broker: MemoryBroker, clock: Clock
) -> None:
    broker.send("jobs", b"x")
    async with consumer(broker) as c:
        (m,) = await c.receive(1, 10)
        clock.now += 10
        with pytest.raises(InvalidReceiptHandleError, match="expired"):
            await c.ack(m)
        (again,) = await c.receive(1, 10)
        assert again.delivery_attempt == 2


async def test_second_ack_is_refused(broker: MemoryBroker) -> None:
    broker.send("jobs", b"x")
    async with consumer(broker) as c:
        (m,) = await c.receive(1, 10)
        await c.ack(m)
        with pytest.raises(InvalidReceiptHandleError):
            await c.ack(m)


async def test_change_invisible_duration_extends_and_nacks(
    broker: MemoryBroker, clock: Clock
) -> None:
    broker.send("jobs", b"x")
    async with consumer(broker) as c:
        (m,) = await c.receive(1, 10)
        clock.now += 8
        await c.change_invisible_duration(m, 30)
        clock.now += 20  # past the first duration, within the new one
        assert await c.receive(1, 10) == []
        await c.change_invisible_duration(m, 0)  # a nack: visible again now
        (again,) = await c.receive(1, 10)
        assert again.delivery_attempt == 2
        with pytest.raises(InvalidReceiptHandleError):
            await c.change_invisible_duration(m, 10)
        await c.ack(again)


async def test_dead_letter_after_max_delivery_attempts(broker: MemoryBroker, clock: Clock) -> None:
    sent = broker.send("jobs", b"x", keys=["k"], properties={"p": "v"})
    async with consumer(broker, max_delivery_attempts=3) as c:
        attempts = []
        for _ in range(3):
            (m,) = await c.receive(1, 5)
            attempts.append(m.delivery_attempt)
            clock.now += 5
        assert attempts == [1, 2, 3]
        assert await c.receive(1, 5) == []
        (dead,) = broker.messages("%DLQ%g")
        assert dead.msg_id == sent.msg_id
        assert dead.body == b"x"
        assert dead.keys == ("k",)
        # the record a push consumer's dead letter has
        assert dead.properties[PROPERTY_RETRY_TOPIC] == "jobs"
        assert dead.properties[PROPERTY_ORIGIN_MESSAGE_ID] == sent.msg_id
        assert dead.properties["p"] == "v"
        assert dead.reconsume_times == 2
        with pytest.raises(InvalidReceiptHandleError):
            await c.ack(m)


async def test_tag_filter(broker: MemoryBroker) -> None:
    for tag in ("a", "b", "c", None):
        broker.send("jobs", tag.encode() if tag else b"-", tags=tag)
    async with consumer(broker, expression="a || c") as c:
        got = await c.receive(10, 10)
        assert sorted(m.tags or "" for m in got) == ["a", "c"]


async def test_groups_are_independent_and_consumers_of_a_group_share(
    broker: MemoryBroker,
) -> None:
    for i in range(4):
        broker.send("jobs", b"%d" % i)
    async with consumer(broker) as a, consumer(broker) as b, consumer(broker, "other") as o:
        got_a = await a.receive(2, 10)
        got_b = await b.receive(10, 10)
        assert len(got_a) == 2
        assert len(got_b) == 2
        assert {m.msg_id for m in got_a}.isdisjoint(m.msg_id for m in got_b)
        assert len(await o.receive(10, 10)) == 4
        # a consumer of the group may ack what another received (the group holds it)
        await a.ack(got_b[0])


async def test_fifo_message_group_waits_for_the_ack_of_the_one_before(
    broker: MemoryBroker, clock: Clock
) -> None:
    for i in range(3):
        broker.send("jobs", b"a%d" % i, keys=["A"])
        broker.send("jobs", b"b%d" % i, keys=["B"])
    broker.send("jobs", b"free")  # no key: no group, not ordered
    async with consumer(broker, fifo=True) as c1, consumer(broker, fifo=True) as c2:
        first = await c1.receive(10, 10)
        assert sorted(m.body for m in first) == [b"a0", b"b0", b"free"]
        assert await c2.receive(10, 10) == []
        a0 = next(m for m in first if m.body == b"a0")
        assert a0.message_group == "A"
        await c1.ack(a0)
        (a1,) = await c2.receive(10, 10)
        assert a1.body == b"a1"
        clock.now += 10  # a1 not acked: it comes back before a2
        again = await c1.receive(10, 10)
        assert sorted(m.body for m in again) == [b"a1", b"b0", b"free"]


async def test_fifo_by_property_and_dead_letter_releases_the_group(
    broker: MemoryBroker, clock: Clock
) -> None:
    for i in range(2):
        broker.send("jobs", b"%d" % i, properties={"order": "o1"}, queue_id=0)
    c = consumer(broker, fifo=True, message_group_property="order", max_delivery_attempts=1)
    async with c:
        (m0,) = await c.receive(10, 5)
        assert m0.body == b"0"
        assert m0.message_group == "o1"
        clock.now += 5
        (m1,) = await c.receive(10, 5)  # m0 dead-lettered: m1 is next
        assert m1.body == b"1"
        assert [m.body for m in broker.messages("%DLQ%g")] == [b"0"]


async def test_receive_waits_up_to_await_duration_for_a_message() -> None:
    broker = MemoryBroker()
    broker.create_topic("jobs", 4)
    c = SimpleConsumer("g", broker, subscriptions={"jobs": "*"}, await_duration=60)
    async with c, anyio.create_task_group() as tg:
        got: list[ReceivedMessage] = []

        async def receive() -> None:
            got.extend(await c.receive(4, 10))

        tg.start_soon(receive)
        await anyio.wait_all_tasks_blocked()
        assert got == []
        broker.send("jobs", b"late", queue_id=3)
    assert [m.body for m in got] == [b"late"]


async def test_ack_batch_acks_the_held_and_names_the_refused(
    broker: MemoryBroker, clock: Clock
) -> None:
    for i in range(3):
        broker.send("jobs", b"%d" % i)
    async with consumer(broker) as c:
        got = await c.receive(10, 10)
        await c.ack(got[0])
        with pytest.raises(InvalidReceiptHandleError) as info:
            await c.ack_batch(got)
        assert info.value.refused == [got[0]]
        clock.now += 100
        assert await c.receive(10, 10) == []


async def test_errors_of_use(broker: MemoryBroker) -> None:
    c = consumer(broker)
    with pytest.raises(ConsumerStateError, match="not started"):
        await c.receive(1, 10)
    async with c:
        with pytest.raises(ConfigurationError, match="max_message_num"):
            await c.receive(0, 10)
        with pytest.raises(ConfigurationError, match="invisible_duration"):
            await c.receive(1, 0)
        with pytest.raises(ConfigurationError, match="invisible_duration"):
            await c.receive(1, 13 * 3600)
        with pytest.raises(ConfigurationError, match="other pop settings"):
            async with consumer(broker, fifo=True):
                pass
    with pytest.raises(ConsumerStateError, match="closed"):
        await c.receive(1, 10)
    async with consumer(broker, fifo=True):  # nobody runs the group: settings may change
        pass
    with pytest.raises(UnknownTopicError):
        SimpleConsumer("g", broker, subscriptions={"nope": "*"})
    with pytest.raises(ConfigurationError, match="tag expression"):
        SimpleConsumer("g", broker, subscriptions={"jobs": "a && b"})
    with pytest.raises(InvalidOptionError):
        SimpleConsumerOptions(max_delivery_attempts=0)
    with pytest.raises(InvalidOptionError, match="fifo"):
        SimpleConsumerOptions(message_group_property="order")


class Recorder(ConsumeMessageHook):
    def __init__(self) -> None:
        self.before: list[ConsumeMessageContext] = []
        self.after: list[ConsumeMessageContext] = []

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        self.before.append(context)

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        self.after.append(context)


async def test_hooks_see_each_delivery_from_receive_to_settlement(
    broker: MemoryBroker, clock: Clock
) -> None:
    for i in range(3):
        broker.send("jobs", b"%d" % i, queue_id=0)
    c = consumer(broker)
    hook = Recorder()
    c.register_consume_message_hook(hook)
    async with c:
        m0, m1, m2 = await c.receive(3, 10)
        assert [ctx.messages[0].body for ctx in hook.before] == [b"0", b"1", b"2"]
        assert all(ctx.mode == "pop" and ctx.attempt == 1 for ctx in hook.before)
        await c.ack(m0)
        await c.change_invisible_duration(m1, 0)
        clock.now += 10
        with pytest.raises(InvalidReceiptHandleError):
            await c.ack(m2)
        assert c.statistics().consumed_ok == 1
        assert c.statistics().consumed_failed == 2
    statuses = [(ctx.messages[0].body, ctx.status, ctx.success) for ctx in hook.after]
    assert statuses == [
        (b"0", ConsumeReturnType.SUCCESS, True),
        (b"1", ConsumeReturnType.FAILED, False),
        (b"2", ConsumeReturnType.TIME_OUT, False),
    ]
    assert isinstance(hook.after[2].exception, InvalidReceiptHandleError)
    with pytest.raises(ConsumerStateError):
        c.register_consume_message_hook(Recorder())


async def test_message_trace_records_a_sub_before_and_after_per_delivery() -> None:
    broker = MemoryBroker()
    broker.create_topic("jobs", 1)
    sent = broker.send("jobs", b"x", keys=["order-7"])
    c = SimpleConsumer("g", broker, subscriptions={"jobs": "*"}, await_duration=0)
    c.register_consume_message_hook(ConsumeMessageTraceHook())
    async with c:
        (m,) = await c.receive(1, 10)
        await c.ack(m)
    records = [
        record
        for message in trace_messages_of(broker)
        for record in decode_trace_data(message.body)
    ]
    kinds = [r.trace_type for r in records if r.beans[0].msg_id == sent.msg_id]
    assert kinds == [TraceType.SubBefore, TraceType.SubAfter]


async def test_closing_ends_a_waiting_receive() -> None:
    broker = MemoryBroker()
    broker.create_topic("jobs", 1)
    c = SimpleConsumer("g", broker, subscriptions={"jobs": "*"}, await_duration=3600)
    errors: list[BaseException] = []
    async with c, anyio.create_task_group() as tg:

        async def receive() -> None:
            try:
                await c.receive(1, 10)
            except ConsumerStateError as exc:
                errors.append(exc)

        tg.start_soon(receive)
        await anyio.wait_all_tasks_blocked()
        await c.aclose()
    assert len(errors) == 1
    assert "closed while receive() waited" in str(errors[0])


def test_received_messages_pickle_with_their_delivery() -> None:
    broker = MemoryBroker()
    broker.create_topic("jobs", 1)
    broker.send("jobs", b"x", keys=["k"])

    async def main() -> ReceivedMessage:
        async with consumer(broker, fifo=True) as c:
            (m,) = await c.receive(1, 10)
            return m

    m = anyio.run(main)
    copy = pickle.loads(pickle.dumps(m))
    assert type(copy) is ReceivedMessage
    assert copy == m
    assert (copy.receipt_handle, copy.message_group, copy.consumer_group) == (
        m.receipt_handle,
        "k",
        "g",
    )


async def test_ack_async_sends_the_queued_acks_with_the_next_receive(broker: MemoryBroker) -> None:
    for i in range(4):
        broker.send("jobs", b"%d" % i)
    async with consumer(broker) as c:
        got = await c.receive(4, 30)
        futures = [c.ack_async(m) for m in got]
        assert not any(f.done() for f in futures)  # queued, not sent
        assert c.statistics().consumed_ok == 0
        assert await c.receive(4, 30) == []  # sends them first
        assert all(f.done() and f.exception() is None for f in futures)
        assert c.statistics().consumed_ok == 4
        for f in futures:
            await f
        with pytest.raises(InvalidReceiptHandleError):
            await c.ack(got[0])  # acked already


async def test_awaiting_an_ack_future_sends_and_reports_a_refusal(
    broker: MemoryBroker, clock: Clock
) -> None:
    broker.send("jobs", b"a")
    broker.send("jobs", b"b")
    async with consumer(broker) as c:
        a, b = await c.receive(2, 10)
        await c.change_invisible_duration(b, 20)
        clock.now += 10  # a's invisible time passed, b's not
        fa, fb = c.ack_async(a), c.ack_async(b)
        with pytest.raises(InvalidReceiptHandleError, match="refused"):
            await fa
        assert fb.done()
        await fb  # acked in the same round trip
        assert isinstance(fa.exception(), InvalidReceiptHandleError)
        (again,) = await c.receive(2, 10)
        assert again.msg_id == a.msg_id


async def test_closing_sends_the_queued_acks(broker: MemoryBroker) -> None:
    broker.send("jobs", b"x")
    async with consumer(broker) as c:
        (m,) = await c.receive(1, 30)
        future = c.ack_async(m)
    assert future.done()
    await future
    async with consumer(broker) as c:
        assert await c.receive(1, 30) == []
