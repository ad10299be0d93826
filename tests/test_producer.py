"""Producer on the embedded broker: queue choice, selectors, retries on another queue,
the per-call deadline, checks of bad input, send hooks and statistics."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import anyio
import pytest

from stagedconsumer import (
    ConfigurationError,
    InvalidMessageError,
    InvalidOptionError,
    MemoryBroker,
    Message,
    MessageQueue,
    MessageQueueSelector,
    OutgoingMessage,
    Producer,
    ProducerOptions,
    ProducerStateError,
    SelectMessageQueueByHash,
    SelectMessageQueueByRandom,
    SendMessageContext,
    SendMessageHook,
    SendStatus,
    SendTimeoutError,
    SourceError,
    UnknownTopicError,
)

pytestmark = pytest.mark.anyio


def broker(queues: int = 4) -> MemoryBroker:
    b = MemoryBroker()
    b.create_topic("t", queues)
    return b


class FlakyBroker(MemoryBroker):
    """The embedded broker, with injected failures: ``failures[queue_id]`` appends to
    that queue fail first (retriable unless ``fatal``); ``stall`` makes appends hang."""

    def __init__(self, failures: dict[int, int], *, fatal: bool = False, stall: bool = False):
        super().__init__()
        self.failures = dict(failures)
        self.fatal = fatal
        self.stall = stall
        self.attempts: list[int] = []

    async def append(self, mq: MessageQueue, messages: Sequence[OutgoingMessage]) -> list[Message]:
        self.attempts.append(mq.queue_id)
        if self.stall:
            await anyio.sleep_forever()
        if self.failures.get(mq.queue_id, 0) > 0:
            self.failures[mq.queue_id] -= 1
            raise SourceError(f"injected failure on {mq}", retriable=not self.fatal)
        return await super().append(mq, messages)


async def test_send_stores_the_message_and_says_where() -> None:
    b = broker()
    async with Producer(b) as producer:
        result = await producer.send(
            "t", b"hello", keys=["order-1", "x"], tags="created", properties={"a": "b"}
        )
    assert result.status is SendStatus.SEND_OK
    stored = b.messages("t", result.message_queue.queue_id)[result.queue_offset]
    assert stored.msg_id == result.msg_id
    assert (stored.body, stored.keys, stored.tags) == (b"hello", ("order-1", "x"), "created")
    assert dict(stored.properties) == {"a": "b"}
    assert "traceparent" not in stored.properties  # nothing added without a hook


async def test_queue_choice_key_hash_round_robin_queue_id() -> None:
    b = broker(4)
    async with Producer(b) as producer:
        keyed = [await producer.send("t", b"x", keys="same-key") for _ in range(5)]
        # The producer picks the queue the brokers' own send would for the key.
        assert {r.message_queue for r in keyed} == {
            MessageQueue("t", b.send("t", b"probe", keys="same-key").queue_id)
        }
        spread = [(await producer.send("t", b"x")).message_queue.queue_id for _ in range(8)]
        assert sorted(spread) == [0, 0, 1, 1, 2, 2, 3, 3]
        pinned = await producer.send("t", b"x", queue_id=3, keys="same-key")
        assert pinned.message_queue == MessageQueue("t", 3)


async def test_selectors() -> None:
    b = broker(8)
    async with Producer(b) as producer:
        by_hash = SelectMessageQueueByHash()
        orders = {
            order: {
                (await producer.send("t", b"x", selector=by_hash, arg=order)).message_queue
                for _ in range(4)
            }
            for order in ("o-1", "o-2", 17)
        }
        assert all(len(queues) == 1 for queues in orders.values())  # one queue per arg
        with pytest.raises(ConfigurationError, match="needs an arg"):
            await producer.send("t", b"x", selector=by_hash)
        by_random = SelectMessageQueueByRandom(random.Random(1))
        spread = {
            (await producer.send("t", b"x", selector=by_random)).message_queue for _ in range(60)
        }
        assert len(spread) == 8

        class Wrong(MessageQueueSelector):
            def select(
                self, queues: Sequence[MessageQueue], message: OutgoingMessage, arg: object
            ) -> MessageQueue:
                return MessageQueue("other", 0)

        with pytest.raises(ConfigurationError, match="not one of the 8 queues"):
            await producer.send("t", b"x", selector=Wrong())


async def test_a_retriable_failure_is_retried_on_the_next_queue() -> None:
    b = FlakyBroker({1: 1, 2: 1})
    b.create_topic("t", 4)
    async with Producer(b) as producer:
        result = await producer.send("t", b"x", queue_id=None, keys=())  # round-robin: 0
        assert b.attempts == [0]
        assert result.message_queue.queue_id == 0
        result = await producer.send("t", b"x")  # round-robin: 1 fails, 2 fails, 3
        assert b.attempts[1:] == [1, 2, 3]
        assert result.message_queue.queue_id == 3
        stats = producer.statistics()
    assert (stats.retries, stats.sent, stats.send_errors) == (2, 2, 0)


async def test_a_chosen_queue_is_retried_itself_and_retries_are_bounded() -> None:
    b = FlakyBroker({2: 5})
    b.create_topic("t", 4)
    options = ProducerOptions(retry_times_when_send_failed=2)
    async with Producer(b, options=options) as producer:
        with pytest.raises(SourceError, match="injected"):
            await producer.send("t", b"x", queue_id=2)
        assert b.attempts == [2, 2, 2]  # 1 + 2 retries, all on the chosen queue
        assert producer.statistics().send_errors == 1


async def test_a_non_retriable_failure_is_not_retried() -> None:
    b = FlakyBroker({0: 1}, fatal=True)
    b.create_topic("t", 4)
    async with Producer(b) as producer:
        with pytest.raises(SourceError, match="injected"):
            await producer.send("t", b"x", queue_id=0)
    assert b.attempts == [0]


async def test_the_deadline_covers_the_whole_call() -> None:
    b = FlakyBroker({}, stall=True)
    b.create_topic("t", 2)
    options = ProducerOptions(send_msg_timeout=0.2)
    async with Producer(b, options=options) as producer:
        started = anyio.current_time()
        with pytest.raises(SendTimeoutError, match="send_msg_timeout"):
            await producer.send("t", b"x")
        took = anyio.current_time() - started
        assert took >= 0.2  # not before its deadline
        assert took < 20  # a stalled append never returns: only the deadline ended it
        assert producer.statistics().timeouts == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"body": "text"}, "body must be bytes"),
        ({"body": b"x", "keys": [1, 2]}, "keys must be strings"),
        ({"body": b"x", "keys": None}, "keys must be a string or a sequence"),
        ({"body": b"x", "tags": 5}, "tags must be a string"),
        ({"body": b"x", "properties": {"a": 1}}, "properties must map str to str"),
        ({"body": b"x", "properties": "x"}, "properties must be a mapping"),
        ({"body": b"x" * 11}, "over max_message_size"),
        ({"body": b"x", "queue_id": 9}, "out of range"),
        ({"body": b"x", "queue_id": -1}, "queue_id must be an int"),
    ],
)
async def test_bad_input_is_a_clear_error_and_sends_nothing(
    kwargs: dict[str, object], match: str
) -> None:
    b = broker(4)
    async with Producer(b, options=ProducerOptions(max_message_size=10)) as producer:
        with pytest.raises(InvalidMessageError, match=match):
            await producer.send("t", **kwargs)  # type: ignore[arg-type]
    assert b.statistics().messages == 0


async def test_unknown_topic_and_state_errors() -> None:
    b = broker()
    producer = Producer(b)
    with pytest.raises(ProducerStateError, match="async with"):
        await producer.send("t", b"x")
    async with producer:
        with pytest.raises(UnknownTopicError):
            await producer.send("nope", b"x")
        with pytest.raises(ProducerStateError):
            producer.register_send_message_hook(Recording())
    with pytest.raises(InvalidOptionError, match="unknown option"):
        ProducerOptions(send_timeout=1)  # type: ignore[call-arg]
    with pytest.raises(InvalidOptionError, match="finite"):
        ProducerOptions(send_msg_timeout=float("inf"))


async def test_send_batch_goes_to_one_queue_in_order() -> None:
    b = broker(4)
    async with Producer(b) as producer:
        results = await producer.send_batch(
            "t",
            [OutgoingMessage.of(b"a", keys="k"), b"b", OutgoingMessage.of(b"c", tags="x")],
        )
    assert len({r.message_queue for r in results}) == 1
    offsets = [r.queue_offset for r in results]
    assert offsets == list(range(offsets[0], offsets[0] + 3))
    queue = results[0].message_queue.queue_id
    assert [m.body for m in b.messages("t", queue)[offsets[0] :]] == [b"a", b"b", b"c"]


class Recording(SendMessageHook):
    def __init__(self) -> None:
        self.before: list[SendMessageContext] = []
        self.after: list[SendMessageContext] = []

    def send_message_before(self, context: SendMessageContext) -> None:
        context.messages[0].properties["stamped"] = "yes"
        self.before.append(context)

    def send_message_after(self, context: SendMessageContext) -> None:
        self.after.append(context)


class Broken(SendMessageHook):
    def send_message_before(self, context: SendMessageContext) -> None:
        raise RuntimeError("hook bug")

    def send_message_after(self, context: SendMessageContext) -> None:
        raise RuntimeError("hook bug")


async def test_send_hooks_see_each_call_may_stamp_it_and_failures_are_isolated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    b = FlakyBroker({0: 1})
    b.create_topic("t", 2)
    producer = Producer(b, group="pg")
    recording = Recording()
    producer.register_send_message_hook(Broken())
    producer.register_send_message_hook(recording)
    with caplog.at_level(logging.ERROR):
        async with producer:
            ok = await producer.send("t", b"x")  # queue 0 fails once, then queue 1
            with pytest.raises(UnknownTopicError):
                await producer.send("missing", b"x")
    first, failed = recording.after
    assert first is recording.before[0]
    assert (first.producer_group, first.topic, first.attempts) == ("pg", "t", 2)
    assert first.message_queue == ok.message_queue
    assert first.results == [ok]
    assert first.success
    assert first.end_time >= first.start_time
    assert ok.message is not None
    assert ok.message.properties["stamped"] == "yes"
    assert isinstance(failed.exception, UnknownTopicError)
    assert not failed.success
    stats = producer.statistics()
    assert stats.hook_errors == 4  # before and after of both calls
    assert sum("send hook Broken failed" in r.getMessage() for r in caplog.records) == 2


class ShuffledQueues(MemoryBroker):
    """Lists a topic's queues in a scrambled order."""

    async def get_queues(self, topic: str) -> Sequence[MessageQueue]:
        queues = list(await super().get_queues(topic))
        return [queues[i] for i in (2, 0, 3, 1)]


async def test_queues_listed_out_of_order_are_chosen_by_queue_id() -> None:
    from stagedconsumer._sources._selectors import stable_hash

    broker = ShuffledQueues()
    broker.create_topic("t", 4)
    async with Producer(broker) as producer:
        pinned = await producer.send("t", b"x", queue_id=1)
        keyed = await producer.send("t", b"x", keys=["order-7"])
        rotated = [(await producer.send("t", b"x")).message_queue.queue_id for _ in range(4)]
    assert pinned.message_queue == MessageQueue("t", 1)
    assert keyed.message_queue.queue_id == stable_hash("order-7") % 4
    assert rotated == [0, 1, 2, 3]
