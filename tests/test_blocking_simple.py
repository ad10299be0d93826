"""BlockingSimpleConsumer: SimpleConsumer from synchronous code, with worker threads."""

from __future__ import annotations

import threading

import pytest
from anyio.from_thread import start_blocking_portal

from stagedconsumer import (
    ConsumerStateError,
    InvalidReceiptHandleError,
    MemoryBroker,
    ReceivedMessage,
    SimpleConsumer,
    WrongThreadError,
)
from stagedconsumer.blocking import BlockingProducer, BlockingSimpleConsumer


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_worker_threads_share_one_blocking_consumer(backend: str) -> None:
    broker = MemoryBroker()
    broker.create_topic("jobs", 4)
    for i in range(40):
        broker.send("jobs", b"%d" % i)
    consumer = SimpleConsumer("g", broker, subscriptions={"jobs": "*"}, await_duration=0)
    done: list[bytes] = []
    lock = threading.Lock()

    def work(running: BlockingSimpleConsumer) -> None:
        while batch := running.receive(3, 60):
            for message in batch:
                with lock:
                    done.append(message.body)
                running.ack(message)

    with BlockingSimpleConsumer(consumer, backend=backend) as running:
        threads = [threading.Thread(target=work, args=(running,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert running.receive(10, 60) == []
    assert sorted(done) == sorted(b"%d" % i for i in range(40))


def test_blocking_calls_errors_and_a_shared_portal() -> None:
    broker = MemoryBroker()
    broker.create_topic("jobs", 1)
    consumer = SimpleConsumer("g", broker, subscriptions={"jobs": "*"}, await_duration=5)
    running = BlockingSimpleConsumer(consumer)
    with pytest.raises(ConsumerStateError, match="with"):
        running.receive(1, 10)
    with (
        start_blocking_portal() as portal,
        BlockingSimpleConsumer(consumer, portal=portal) as running,
        BlockingProducer(broker, portal=portal) as producer,
    ):
        producer.send("jobs", b"x")
        (m,) = running.receive(1, 10)
        assert isinstance(m, ReceivedMessage)
        running.change_invisible_duration(m, 30)
        running.ack_batch([m])
        with pytest.raises(InvalidReceiptHandleError):
            running.ack(m)
        with pytest.raises(WrongThreadError):
            portal.call(running.receive, 1, 10)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ack_async_rides_on_the_next_receive(backend: str) -> None:
    clock = _Clock()
    broker = MemoryBroker(clock=clock)
    broker.create_topic("jobs", 1)
    for i in range(4):
        broker.send("jobs", b"%d" % i)
    consumer = SimpleConsumer("g", broker, subscriptions={"jobs": "*"}, await_duration=0)
    running = BlockingSimpleConsumer(consumer, backend=backend)
    with pytest.raises(ConsumerStateError, match="with"):
        running.ack_async(None)  # type: ignore[arg-type]
    with running:
        first = running.receive(2, 10)
        futures = [running.ack_async(m) for m in first]
        assert [f.message for f in futures] == first
        assert not any(f.done() for f in futures)  # queued: nothing sent yet
        second = running.receive(2, 10)  # sends them
        assert all(f.done() and f.exception() is None for f in futures)
        for f in futures:
            f.result()
        # result() sends the acks queued when no receive came
        late = running.ack_async(second[0])
        late.result()
        assert late.done()
        # an ack after the invisible duration: refused, in the future's result
        clock.now += 10
        expired = running.ack_async(second[1])
        with pytest.raises(InvalidReceiptHandleError):
            expired.result()
        assert isinstance(expired.exception(), InvalidReceiptHandleError)
        (again,) = running.receive(4, 10)
        assert again.body == second[1].body
        assert again.delivery_attempt == 2
        pending = running.ack_async(again)
    # leaving the block sends the acks still queued
    assert pending.done()
    assert pending.exception() is None
    assert sorted(m.body for m in [*first, *second]) == [b"0", b"1", b"2", b"3"]
