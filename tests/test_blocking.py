"""The blocking API (``stagedconsumer.blocking``) on the embedded broker: plain sync
tests, each starting event loop threads of its own through anyio portals."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
import pytest
from anyio.from_thread import start_blocking_portal

from offsetstore import MemoryOffsetStore, StoreCommitError
from offsetstore._types import QueueProgress
from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumerStateError,
    ConsumeStagedConcurrentlyContext,
    InvalidMessageError,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    MessageQueue,
    OutgoingMessage,
    ProducerOptions,
    ProducerStateError,
    PushConsumer,
    SelectMessageQueueByHash,
    SendMessageContext,
    SendMessageHook,
    SendStatus,
    SendTimeoutError,
    UnknownTopicError,
    WrongThreadError,
)
from stagedconsumer.blocking import BlockingConsumer, BlockingProducer

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])


def broker_with(topic: str = "t", queues: int = 1) -> MemoryBroker:
    broker = MemoryBroker()
    broker.create_topic(topic, queues)
    return broker


class Stages(MessageListenerStagedConcurrently):
    """A plain ``def`` staged handler that records when each call ran, and where."""

    def __init__(self, stages: Sequence[int], cost: float = 0.0) -> None:
        self.stages = list(stages)
        self.cost = cost
        self.lock = threading.Lock()
        self.calls: list[tuple[int, int, float, float]] = []  # stage, offset, start, end
        self.threads: set[str] = set()

    def get_stage_definitions(self) -> Sequence[int]:
        return self.stages

    def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        start = time.monotonic()
        time.sleep(self.cost)
        end = time.monotonic()
        with self.lock:
            self.threads.add(threading.current_thread().name)
            self.calls.extend((context.stage_index, m.queue_offset, start, end) for m in msgs)


class Collect(MessageListenerConcurrently):
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def consume_message(self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext) -> None:
        self.bodies.extend(m.body for m in msgs)


def committed(store: MemoryOffsetStore, group: str, mq: MessageQueue) -> int | None:
    stored = store._stored.get(store._key(group, mq))
    return None if stored is None else stored.consume_offset


# -- producer and consumer on one portal --------------------------------------------------


@BACKENDS
def test_a_producer_and_a_staged_consumer_share_one_portal(backend: str) -> None:
    broker = broker_with()
    listener = Stages([4, 6], cost=0.01)
    store = MemoryOffsetStore()
    consumer = PushConsumer(
        "g", broker, listener, offset_store=store, options=ConsumerOptions(consume_thread_max=4)
    )
    consumer.subscribe("t")
    with (
        start_blocking_portal(backend) as portal,
        BlockingConsumer(consumer, portal=portal) as running,
        BlockingProducer(broker, portal=portal) as producer,
    ):
        results = [producer.send("t", f"m{i}".encode(), keys=["k"]) for i in range(14)]
        running.wait_caught_up(timeout=20)
        stats = running.statistics()
        assert running.assigned_queues == [MessageQueue("t", 0)]
        assert producer.statistics().sent == 14
    # sent in call order, one after another, to one queue: consecutive offsets
    assert [r.queue_offset for r in results] == list(range(14))
    assert all(r.status is SendStatus.SEND_OK for r in results)
    assert stats.consumed_ok == 14
    # the stage barrier held: every call of a stage ended before the next stage began
    by_stage: dict[int, list[tuple[float, float]]] = {}
    for stage, _, start, end in listener.calls:
        by_stage.setdefault(stage, []).append((start, end))
    assert sorted(by_stage) == [-1, 0, 1]
    assert [len(by_stage[s]) for s in (0, 1, -1)] == [4, 6, 4]
    for earlier, later in ((0, 1), (1, -1)):
        assert max(e for _, e in by_stage[earlier]) <= min(s for s, _ in by_stage[later])
    # plain def handlers ran in worker threads, never in the calling thread
    assert threading.current_thread().name not in listener.threads
    # leaving persisted the progress
    assert committed(store, "g", MessageQueue("t", 0)) == 14


@BACKENDS
def test_a_consumer_on_its_own_portal_lends_it_to_a_producer(backend: str) -> None:
    broker = broker_with(queues=4)
    for i in range(3):  # a first backlog from the main thread, before anything starts
        broker.send("t", f"before {i}".encode(), queue_id=0)
    listener = Collect()
    consumer = PushConsumer("g", broker, listener)
    consumer.subscribe("t")
    with (
        BlockingConsumer(consumer, backend=backend) as running,
        BlockingProducer(broker, portal=running.portal) as producer,
    ):
        assert running.running
        batch = producer.send_batch(
            "t", (OutgoingMessage.of(f"b{i}".encode()) for i in range(3)), queue_id=2
        )
        by_hash = producer.send("t", b"h", selector=SelectMessageQueueByHash(), arg="order-7")
        running.wait_caught_up(timeout=10)
    # mypy keeps `running.running` narrowed to True by the assert in the block (it does
    # not see that leaving the block changes it) and would skip the rest as unreachable:
    # binding the name again drops that narrowing
    running = running
    assert not running.running
    assert [(r.message_queue.queue_id, r.queue_offset) for r in batch] == [(2, 0), (2, 1), (2, 2)]
    assert broker.messages("t", by_hash.message_queue.queue_id)[by_hash.queue_offset].body == b"h"
    assert sorted(listener.bodies) == sorted(
        [b"before 0", b"before 1", b"before 2", b"b0", b"b1", b"b2", b"h"]
    )
    # after leaving, the snapshots are read directly
    assert running.statistics().consumed_ok == 7
    assert producer.statistics().sent == 4
    with pytest.raises(ConsumerStateError):
        _ = running.portal


@BACKENDS
def test_pause_resume_and_seek_from_sync_code(backend: str) -> None:
    broker = broker_with(queues=2)
    store = MemoryOffsetStore()
    listener = Collect()
    consumer = PushConsumer("g", broker, listener, offset_store=store)
    consumer.subscribe("t")
    q0, q1 = MessageQueue("t", 0), MessageQueue("t", 1)
    with BlockingConsumer(consumer, backend=backend) as running:
        running.pause("t")
        assert set(running.statistics().paused_queues) == {q0, q1}
        with BlockingProducer(broker, portal=running.portal) as producer:
            for queue_id in (0, 1):
                producer.send("t", b"x%d" % queue_id, queue_id=queue_id)
            time.sleep(0.3)  # paused: nothing is consumed
            assert listener.bodies == []
        running.resume("t")
        running.wait_caught_up(timeout=10)
        assert sorted(listener.bodies) == [b"x0", b"x1"]
        assert not running.statistics().paused_queues
        running.seek(q0, 0)  # consume queue 0 again
        running.wait_caught_up(timeout=10)
        with pytest.raises(ConfigurationError, match="not subscribed to topic 'nope'"):
            running.pause("nope")
    assert sorted(listener.bodies) == [b"x0", b"x0", b"x1"]
    assert committed(store, "g", q0) == 1


def test_a_source_used_on_two_event_loops_is_refused() -> None:
    broker = broker_with()
    consumer = PushConsumer("g", broker, Collect())
    consumer.subscribe("t")
    with BlockingConsumer(consumer) as running:
        producer = BlockingProducer(broker)  # its own portal: another event loop
        with pytest.raises(ConfigurationError, match="same portal"):
            producer.__enter__()
        with BlockingProducer(broker, portal=running.portal) as shared:
            shared.send("t", b"x")
        running.wait_caught_up(timeout=10)
    with BlockingProducer(broker) as alone:  # nobody uses the broker any more
        alone.send("t", b"y")
    assert len(broker.messages("t")) == 2


# -- errors -------------------------------------------------------------------------------


class Stalling(MemoryBroker):
    async def append(self, mq: MessageQueue, messages: Sequence[OutgoingMessage]) -> list[Message]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


@BACKENDS
def test_exceptions_come_out_as_themselves(backend: str) -> None:
    broker = broker_with()
    with BlockingProducer(broker, backend=backend) as producer:
        with pytest.raises(UnknownTopicError) as unknown:
            producer.send("nope", b"x")
        assert type(unknown.value) is UnknownTopicError
        with pytest.raises(InvalidMessageError):
            producer.send("t", "not bytes")  # type: ignore[arg-type]
        with pytest.raises(InvalidMessageError):
            producer.send_batch("t", b"bytes, not messages")  # type: ignore[arg-type]
        producer.send("t", b"still fine")
    stalling = Stalling()
    stalling.create_topic("t", 1)
    options = ProducerOptions(send_msg_timeout=0.2)
    with BlockingProducer(stalling, options=options, backend=backend) as producer:
        started = time.monotonic()
        with pytest.raises(SendTimeoutError):
            producer.send("t", b"x")
        assert 0.2 <= time.monotonic() - started < 5
        assert producer.statistics().timeouts == 1
    consumer = PushConsumer("g", broker, Collect())
    consumer.subscribe("t")
    with BlockingConsumer(consumer, backend=backend) as running:
        with pytest.raises(ValueError, match="timeout"):
            running.wait_caught_up(timeout=-1)
        running.wait_caught_up(timeout=10)


def test_wait_caught_up_times_out_saying_what_is_behind() -> None:
    started, release = threading.Event(), threading.Event()

    class Held(MessageListenerConcurrently):
        def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            started.set()
            release.wait(10)

    broker = broker_with()
    broker.send("t", b"x")
    consumer = PushConsumer("g", broker, Held())
    consumer.subscribe("t")
    with BlockingConsumer(consumer) as running:
        try:
            assert started.wait(10)
            with pytest.raises(TimeoutError) as info:
                running.wait_caught_up(timeout=0.2)
        finally:
            release.set()
        running.wait_caught_up(timeout=10)
    assert str(info.value) == (
        "not caught up after 0.2 s: 1 of 3 queue(s) behind the max offsets of the call:"
        " t#0 at committed offset 0 of 1 (1 in handlers)"
    )


@BACKENDS
def test_an_exception_of_the_block_comes_out_as_itself_after_a_graceful_stop(
    backend: str,
) -> None:
    broker = broker_with()
    broker.send("t", b"x")
    store = MemoryOffsetStore()
    consumer = PushConsumer("g", broker, Collect(), offset_store=store)
    consumer.subscribe("t")
    with (  # noqa: PT012 - the block is what is tested
        pytest.raises(LookupError, match="mine"),
        BlockingConsumer(consumer, backend=backend) as running,
    ):
        running.wait_caught_up(timeout=10)
        raise LookupError("mine")
    assert committed(store, "g", MessageQueue("t", 0)) == 1


@BACKENDS
def test_keyboard_interrupt_in_the_block_drains_then_goes_on(backend: str) -> None:
    broker = broker_with()
    broker.send("t", b"x")
    gate = threading.Event()
    entered = threading.Event()

    class Slow(MessageListenerConcurrently):
        def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            entered.set()
            gate.wait(10)

    store = MemoryOffsetStore()
    consumer = PushConsumer("g", broker, Slow(), offset_store=store)
    consumer.subscribe("t")
    threading.Timer(0.3, gate.set).start()
    with pytest.raises(KeyboardInterrupt), BlockingConsumer(consumer, backend=backend):  # noqa: PT012
        assert entered.wait(10)
        raise KeyboardInterrupt  # as Ctrl-C would, in the main thread
    stats = consumer.statistics()
    assert (stats.consumed_ok, stats.abandoned_calls) == (1, 0)  # it waited for the handler
    assert committed(store, "g", MessageQueue("t", 0)) == 1


class BreakingStore(MemoryOffsetStore):
    """A store whose writes fail for good once ``broken`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False

    async def _write_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress]
    ) -> None:
        if self.broken:
            raise StoreCommitError("the disk is gone", retriable=False)
        await super()._write_stored(group, progress)


@BACKENDS
def test_a_failure_that_stops_the_consumer_ends_calls_and_is_raised_on_leaving(
    backend: str,
) -> None:
    broker = broker_with()
    store = BreakingStore()
    store.broken = True

    class Stuck(MessageListenerOrderly):
        """The first message succeeds after a while (its commit then fails for good);
        the second fails every time (retried locally, it never finishes)."""

        def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> None:
            time.sleep(0.3)
            if msgs[0].queue_offset > 0:
                raise RuntimeError("fails every time")

    options = ConsumerOptions(
        persist_consumer_offset_interval=0.05,
        suspend_current_queue_time_millis=50,
        shutdown_timeout=2,
    )
    consumer = PushConsumer("g", broker, Stuck(), offset_store=store, options=options)
    consumer.subscribe("t")
    stop_error: list[BaseException] = []
    with (  # noqa: PT012 - the block is what is tested
        pytest.raises(StoreCommitError, match="disk is gone"),
        BlockingConsumer(consumer, backend=backend) as running,
        BlockingProducer(broker, portal=running.portal) as producer,
    ):
        producer.send_batch("t", [b"ok", b"never"])
        started = time.monotonic()
        with pytest.raises(ConsumerStateError, match="stopped") as info:
            running.wait_caught_up(timeout=30)  # in flight when the failure stops it
        assert time.monotonic() - started < 10
        stop_error.append(info.value)
        running.wait_stopped(timeout=10)
        assert not running.running
        with pytest.raises(ConsumerStateError, match="stopped"):
            running.wait_caught_up()
        producer.send("t", b"z")  # the portal still runs: only the consumer stopped
        # the body ends with the error the stop caused: leaving raises the failure
        raise stop_error[0]
    assert "stopped" in str(stop_error[0])


def test_wait_stopped_times_out_while_it_runs() -> None:
    consumer = PushConsumer("g", broker_with(), Collect())
    consumer.subscribe("t")
    with BlockingConsumer(consumer) as running:
        with pytest.raises(TimeoutError):
            running.wait_stopped(timeout=0.05)
        assert running.running


def test_state_and_configuration_errors() -> None:
    broker = broker_with()
    producer = BlockingProducer(broker)
    with pytest.raises(ProducerStateError, match="running producer"):
        producer.send("t", b"x")
    with pytest.raises(ProducerStateError):
        _ = producer.portal
    assert producer.statistics().sent == 0
    with producer:
        with pytest.raises(ProducerStateError, match="before the producer starts"):
            producer.register_send_message_hook(Recording())
        with pytest.raises(ProducerStateError, match="only once"):
            producer.__enter__()
    with pytest.raises(ProducerStateError, match="was left"):
        producer.send("t", b"x")
    with pytest.raises(ConfigurationError, match="not both"), start_blocking_portal() as portal:
        BlockingProducer(broker, portal=portal, backend="trio")
    with pytest.raises(ConfigurationError, match="backend"):
        BlockingProducer(broker, backend="curio")
    with pytest.raises(ConfigurationError, match="BlockingPortal"):
        BlockingProducer(broker, portal=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="PushConsumer"):
        BlockingConsumer(object())  # type: ignore[arg-type]
    not_subscribed = BlockingConsumer(PushConsumer("g", broker, Collect()))
    with pytest.raises(ConsumerStateError, match="subscribe"):
        not_subscribed.__enter__()
    with pytest.raises(ConsumerStateError, match="running consumer"):
        not_subscribed.wait_caught_up()


# -- threads ------------------------------------------------------------------------------


@BACKENDS
def test_plain_def_handlers_send_through_the_blocking_producer(backend: str) -> None:
    broker = broker_with("in")
    broker.create_topic("out", 1)
    for i in range(5):
        broker.send("in", f"{i}".encode())

    class Forward(MessageListenerConcurrently):
        producer: BlockingProducer

        def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            for m in msgs:
                self.producer.send("out", m.body + b"!")

    forward = Forward()
    consumer = PushConsumer("g", broker, forward)
    consumer.subscribe("in")
    with (
        start_blocking_portal(backend) as portal,
        BlockingProducer(broker, portal=portal) as producer,
    ):
        forward.producer = producer  # set before the consumer starts
        with BlockingConsumer(consumer, portal=portal) as running:
            running.wait_caught_up(timeout=10)
    assert sorted(m.body for m in broker.messages("out")) == [f"{i}!".encode() for i in range(5)]


@BACKENDS
def test_a_blocking_call_from_the_event_loop_thread_is_refused(backend: str) -> None:
    broker = broker_with()
    broker.create_topic("out", 1)
    broker.send("t", b"x")
    errors: list[BaseException] = []

    class AsyncForward(MessageListenerConcurrently):
        producer: BlockingProducer

        async def consume_message(
            self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            try:
                self.producer.send("out", b"blocking")
            except WrongThreadError as exc:
                errors.append(exc)
            await self.producer.producer.send("out", b"awaited")  # the way in async code

    forward = AsyncForward()
    consumer = PushConsumer("g", broker, forward)
    consumer.subscribe("t")
    with (
        start_blocking_portal(backend) as portal,
        BlockingProducer(broker, portal=portal) as producer,
    ):
        forward.producer = producer  # before the consumer starts
        with BlockingConsumer(consumer, portal=portal) as running:
            running.wait_caught_up(timeout=10)
            # statistics() from the event loop's thread itself is read in place
            assert portal.call(producer.statistics).sent == 1
    assert len(errors) == 1
    assert "await" in str(errors[0])
    assert [m.body for m in broker.messages("out")] == [b"awaited"]


@BACKENDS
def test_memory_broker_send_from_another_thread_while_a_consumer_waits(backend: str) -> None:
    broker = broker_with()
    listener = Collect()
    # the sends below race with the pull on purpose: a wake-up they make the pull miss
    # costs one short long-polling round, not 15 s
    options = ConsumerOptions(pull_long_polling_timeout=0.1)
    consumer = PushConsumer("g", broker, listener, options=options)
    consumer.subscribe("t")
    stored = 0
    with BlockingConsumer(consumer, backend=backend) as running:
        deadline = time.monotonic() + 10
        with pytest.raises(WrongThreadError, match="portal"):  # noqa: PT012
            while time.monotonic() < deadline:  # until the pull waits on the queue
                broker.send("t", b"racy")
                stored += 1
                running.wait_caught_up(timeout=10)
                time.sleep(0.01)
        assert len(broker.messages("t")) == stored  # the refused one was not stored
        # the way that works: on the broker's event loop
        running.portal.call(lambda: broker.send("t", b"through the portal"))
        running.wait_caught_up(timeout=10)
    assert listener.bodies == [b"racy"] * stored + [b"through the portal"]


def test_leaving_waits_for_sends_in_flight_from_other_threads() -> None:
    appending = threading.Event()

    class Slow(MemoryBroker):
        async def append(
            self, mq: MessageQueue, messages: Sequence[OutgoingMessage]
        ) -> list[Message]:
            appending.set()
            await anyio.sleep(0.3)
            return await super().append(mq, messages)

    broker = Slow()
    broker.create_topic("t", 1)
    outcomes: list[object] = []
    with BlockingProducer(broker) as producer:

        def send() -> None:
            try:
                outcomes.append(producer.send("t", b"in flight").queue_offset)
            except Exception as exc:  # pragma: no cover - the failure the test looks for
                outcomes.append(exc)

        sender = threading.Thread(target=send)
        sender.start()
        assert appending.wait(10)  # leave while the send is in flight
    sender.join()
    assert outcomes == [0]
    assert len(broker.messages("t")) == 1
    with pytest.raises(ProducerStateError):
        producer.send("t", b"after")


def test_leaving_ends_consumer_calls_waiting_in_other_threads() -> None:
    broker = broker_with()
    broker.send("t", b"never finishes")

    class Failing(MessageListenerOrderly):
        def consume_message(self, msgs: Sequence[Message], context: ConsumeOrderlyContext) -> None:
            raise RuntimeError("fails every time")

    options = ConsumerOptions(suspend_current_queue_time_millis=50)
    consumer = PushConsumer("g", broker, Failing(), options=options)
    consumer.subscribe("t")
    outcomes: list[BaseException | None] = []
    with BlockingConsumer(consumer) as running:

        def wait() -> None:
            try:
                running.wait_caught_up(timeout=30)
                outcomes.append(None)
            except BaseException as exc:
                outcomes.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        host = running._host
        assert host is not None
        deadline = time.monotonic() + 10
        while not host._calls and time.monotonic() < deadline:  # until the call waits
            time.sleep(0.01)
    waiter.join(10)
    assert len(outcomes) == 1
    assert isinstance(outcomes[0], ConsumerStateError)
    assert "being left" in str(outcomes[0])


def test_leaving_the_portal_owner_first_stops_what_borrowed_it() -> None:
    broker = broker_with()
    consumer = PushConsumer("g", broker, Collect())
    consumer.subscribe("t")
    running = BlockingConsumer(consumer)
    running.__enter__()
    producer = BlockingProducer(broker, portal=running.portal)
    producer.__enter__()
    running.__exit__(None, None, None)  # stops its portal, and the producer with it
    with pytest.raises(ProducerStateError):
        producer.send("t", b"x")
    with pytest.raises(ProducerStateError, match="stopped with its event loop"):
        producer.__exit__(None, None, None)


# -- hooks --------------------------------------------------------------------------------


class Recording(SendMessageHook):
    def __init__(self) -> None:
        self.threads: list[str] = []
        self.topics: list[str] = []

    def send_message_before(self, context: SendMessageContext) -> None:
        self.threads.append(threading.current_thread().name)

    def send_message_after(self, context: SendMessageContext) -> None:
        self.topics.append(context.topic)


def test_send_hooks_run_on_the_event_loop() -> None:
    hook = Recording()
    producer = BlockingProducer(broker_with())
    producer.register_send_message_hook(hook)
    with producer:
        producer.send("t", b"x")
        producer.send_batch("t", [b"y", b"z"])
    assert hook.topics == ["t", "t"]
    assert threading.current_thread().name not in hook.threads


# -- Ctrl-C, for real ---------------------------------------------------------------------


def _start(backend: str, shutdown_timeout: float, handler_seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.blocking_sigint_worker",
            backend,
            str(shutdown_timeout),
            str(handler_seconds),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    return proc


def _interrupt(proc: subprocess.Popen[str], presses: int) -> tuple[str, str, float]:
    try:
        pressed = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if presses == 2:
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        return out, err, time.monotonic() - pressed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
@BACKENDS
def test_ctrl_c_in_the_block_stops_the_consumer_gracefully(backend: str) -> None:
    """The main thread waits in wait_stopped(); Ctrl-C lets the running handler (1.5 s
    more) finish and commits it, then KeyboardInterrupt ends the program."""
    proc = _start(backend, shutdown_timeout=20, handler_seconds=1.5)
    out, err, took = _interrupt(proc, presses=1)
    assert "KeyboardInterrupt" in err
    assert "left consumed_ok=1 abandoned=0 committed=1" in out, (out, err)
    assert 1.0 <= took < 10, f"exited {took:.2f} s after Ctrl-C"


@pytest.mark.slow
@BACKENDS
def test_a_second_ctrl_c_stops_at_once(backend: str) -> None:
    """A handler stuck for 60 s and a shutdown_timeout of 30 s: the first Ctrl-C starts
    the drain, the second abandons it; nothing is committed past the stuck message."""
    proc = _start(backend, shutdown_timeout=30, handler_seconds=60)
    out, err, took = _interrupt(proc, presses=2)
    assert "KeyboardInterrupt" in err
    assert "left consumed_ok=0" in out, (out, err)
    assert "committed=None" in out or "committed=0" in out, out
    assert took < 10, f"exited {took:.2f} s after the first Ctrl-C"
