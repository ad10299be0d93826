"""FileTraceSink: a writer thread that keeps up with a busy consumer, writes in order,
flushes on close, and drops (counted) only when the file does not keep up."""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumeMessageTraceHook,
    ConsumerOptions,
    FileTraceSink,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    PushConsumer,
    TraceSinkFull,
)
from stagedconsumer._observability._trace_codec import (
    TraceBean,
    TraceContext,
    TraceMessage,
    TraceType,
    decode_trace_data,
    encode_trace_context,
)
from stagedconsumer._observability._trace_dispatcher import AsyncTraceDispatcher
from stagedconsumer._observability._trace_query import read_trace_file

pytestmark = pytest.mark.anyio


def ctx(n: int) -> TraceContext:
    return TraceContext(
        trace_type=TraceType.SubBefore,
        timestamp=n,
        request_id=f"R{n}",
        beans=[TraceBean(msg_id=f"M{n}", keys=f"K{n}")],
    )


def msg_ids(path: Path) -> list[str]:
    return [c.beans[0].msg_id for m in read_trace_file(path) for c in decode_trace_data(m.body)]


class Noop(MessageListenerConcurrently):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        return None


@pytest.mark.slow
async def test_a_busy_consumer_gets_every_record_written(tmp_path: Path) -> None:
    # 6,000 no-op calls (12,000 contexts) as fast as the consumer goes: more than the
    # hook's queue of 2,048, less than what the sink buffers for its thread, so
    # nothing may be dropped whatever the disk's pace.
    count = 6000
    broker = MemoryBroker()
    broker.create_topic("t", 4)
    for i in range(count):
        broker.send("t", b"x", keys=[f"k{i}"], queue_id=i % 4)
    path = tmp_path / "trace.jsonl"
    hook = ConsumeMessageTraceHook(FileTraceSink(path))
    consumer = PushConsumer("g", broker, Noop(), options=ConsumerOptions(consume_thread_max=20))
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=60)
    stats = hook.statistics()
    assert (stats.dropped, stats.lost, stats.write_errors) == (0, 0, 0)
    assert (stats.appended, stats.written, stats.queued) == (2 * count, 2 * count, 0)
    assert consumer.statistics().trace_records_dropped == 0
    contexts = [c for m in read_trace_file(path) for c in decode_trace_data(m.body)]
    per_message = Counter((c.beans[0].msg_id, c.trace_type) for c in contexts)
    assert len(per_message) == 2 * count
    assert set(per_message.values()) == {1}
    # Batches of 10 contexts per trace message, as RocketMQ's dispatcher writes them.
    assert {len(decode_trace_data(m.body)) for m in read_trace_file(path)} == {10}


async def test_records_are_written_in_order_across_wakeups_and_flushes(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    sink = FileTraceSink(path, batch_size=30)
    dispatcher = AsyncTraceDispatcher(sink, batch_num=10)
    for i in range(1000):
        assert dispatcher.append(ctx(i))
        if i == 500:
            await dispatcher.flush()
            assert msg_ids(path) == [f"M{n}" for n in range(501)]
    await dispatcher.flush()
    await sink.aclose()
    assert msg_ids(path) == [f"M{n}" for n in range(1000)]
    # Each line is exactly what the reference encoder makes, as RocketMQ decodes it.
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 101  # 99 batches of 10, and the two flushes: 1 and 9
    first = json.loads(lines[0])
    assert first["body"] == "".join(encode_trace_context(ctx(n)) for n in range(10))
    keys = [key for n in range(10) for key in (f"M{n}", f"K{n}")]
    assert lines[0] == json.dumps(
        {"topic": "RMQ_SYS_TRACE_TOPIC", "keys": keys, "body": first["body"]}
    )


async def test_what_is_queued_is_written_by_flush_and_by_close(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    sink = FileTraceSink(path)  # batch_size 256: these few never wake the thread alone
    dispatcher = AsyncTraceDispatcher(sink, batch_num=10)
    for i in range(25):
        dispatcher.append(ctx(i))
    await dispatcher.flush()  # the last 5 contexts too, and waits for the file
    assert msg_ids(path) == [f"M{n}" for n in range(25)]
    for i in range(25, 45):
        dispatcher.append(ctx(i))  # two full batches, handed to the sink
    await sink.aclose()
    assert msg_ids(path) == [f"M{n}" for n in range(45)]
    stats = dispatcher.statistics()
    assert (stats.appended, stats.written, stats.dropped, stats.messages) == (45, 45, 0, 5)
    # Closed: a later write starts the thread again.
    dispatcher.append(ctx(45))
    await dispatcher.flush()
    await sink.aclose()
    assert msg_ids(path)[-1] == "M45"


async def test_a_hook_flushes_its_file_when_the_consumer_stops(tmp_path: Path) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for _ in range(3):
        broker.send("t", b"x")
    path = tmp_path / "trace.jsonl"
    hook = ConsumeMessageTraceHook(FileTraceSink(path), flush_interval=3600)
    consumer = PushConsumer("g", broker, Noop())
    consumer.subscribe("t")
    consumer.register_consume_message_hook(hook)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)
    assert len(msg_ids(path)) == 6  # 3 SubBefore, 3 SubAfter: less than a batch


async def test_a_file_that_does_not_keep_up_drops_and_counts(tmp_path: Path) -> None:
    # A FIFO nobody reads yet: the writer thread blocks opening it, as on a stalled
    # disk, and the sink's buffer of 100 contexts fills up.
    fifo = tmp_path / "stalled"
    os.mkfifo(fifo)
    sink = FileTraceSink(fifo, queue_size=100, batch_size=10)
    dispatcher = AsyncTraceDispatcher(sink, batch_num=10)
    assert all(dispatcher.append(ctx(i)) for i in range(300))  # the hook's queue takes them
    stats = dispatcher.statistics()
    assert (stats.appended, stats.written, stats.dropped, stats.queued) == (300, 100, 200, 0)
    with pytest.raises(TraceSinkFull, match="100 trace contexts wait for"):
        sink.write_nowait(TraceMessage(topic="t", keys=(), body="x"))

    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()  # the disk catches up
    await sink.aclose()
    await anyio.to_thread.run_sync(reader.join)
    text = received[0].decode()
    ids = [
        c.beans[0].msg_id
        for line in text.splitlines()
        for c in decode_trace_data(json.loads(line)["body"])
    ]
    assert ids == [f"M{n}" for n in range(100)]  # the first ones, in order
    stats = dispatcher.statistics()
    assert (stats.written, stats.dropped, stats.lost) == (100, 200, 0)


async def test_a_failed_write_is_counted_lost_and_the_next_batch_tries_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "missing" / "trace.jsonl"
    sink = FileTraceSink(path)
    dispatcher = AsyncTraceDispatcher(sink, batch_num=10)
    for i in range(20):
        dispatcher.append(ctx(i))
    await dispatcher.flush()
    stats = dispatcher.statistics()
    assert (stats.write_errors, stats.lost, stats.written) == (1, 20, 0)
    path.parent.mkdir()
    for i in range(20, 30):
        dispatcher.append(ctx(i))
    await dispatcher.flush()
    await sink.aclose()
    assert msg_ids(path) == [f"M{n}" for n in range(20, 30)]
    stats = dispatcher.statistics()
    assert (stats.write_errors, stats.lost, stats.written) == (1, 20, 10)


def test_sizes_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="queue_size"):
        FileTraceSink(tmp_path / "t", queue_size=0)
    with pytest.raises(ConfigurationError, match="batch_size"):
        FileTraceSink(tmp_path / "t", batch_size=0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_writes_its_own_records_with_a_thread_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    sink = FileTraceSink(path)
    dispatcher = AsyncTraceDispatcher(sink, batch_num=10)
    for i in range(10):
        dispatcher.append(ctx(i))  # the parent's writer thread runs, a message queued
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread does not exist here
        code = 1
        try:
            for i in range(100, 110):
                dispatcher.append(ctx(i))

            async def close() -> bool:
                with anyio.move_on_after(60):  # a failure, not a hang, if it never closes
                    await sink.aclose()
                    return True
                return False

            code = 0 if anyio.run(close) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    anyio.run(sink.aclose)
    # Each record once: the parent's by the parent, the child's by the child.
    assert sorted(msg_ids(path)) == sorted([f"M{n}" for n in [*range(10), *range(100, 110)]])
