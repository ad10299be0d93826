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
