"""AsyncTraceDispatcher: bounded queue, batches, flush interval, drops and failures."""

from __future__ import annotations

import anyio
import pytest
from anyio.lowlevel import checkpoint

from stagedconsumer import ConfigurationError
from stagedconsumer._observability._trace_codec import (
    TraceBean,
    TraceContext,
    TraceMessage,
    TraceType,
    decode_trace_data,
)
from stagedconsumer._observability._trace_dispatcher import AsyncTraceDispatcher
from stagedconsumer._observability._trace_sinks import TraceSink

pytestmark = pytest.mark.anyio


class ListSink(TraceSink):
    def __init__(self) -> None:
        self.messages: list[TraceMessage] = []
        self.fail = False

    async def write(self, message: TraceMessage) -> None:
        await checkpoint()
        if self.fail:
            raise OSError("disk full")
        self.messages.append(message)


def ctx(n: int, keys: str = "") -> TraceContext:
    return TraceContext(
        trace_type=TraceType.SubBefore,
        timestamp=n,
        request_id=f"R{n}",
        beans=[TraceBean(msg_id=f"M{n}", keys=keys)],
    )


def ids(sink: ListSink) -> list[list[str]]:
    return [[c.beans[0].msg_id for c in decode_trace_data(m.body)] for m in sink.messages]


def test_full_queue_drops_and_counts() -> None:
    sink = ListSink()
    dispatcher = AsyncTraceDispatcher(sink, queue_size=4)
    accepted = [dispatcher.append(ctx(i)) for i in range(7)]
    assert accepted == [True] * 4 + [False] * 3
    stats = dispatcher.statistics()
    assert (stats.queued, stats.appended, stats.dropped) == (4, 4, 3)


def test_defaults_and_batch_limit() -> None:
    dispatcher = AsyncTraceDispatcher(ListSink())
    assert (dispatcher.queue_size, dispatcher.batch_num, dispatcher.flush_interval) == (
        2048,
        10,
        5.0,
    )
    assert dispatcher.trace_topic == "RMQ_SYS_TRACE_TOPIC"
    assert AsyncTraceDispatcher(ListSink(), batch_num=50).batch_num == 20
    with pytest.raises(ConfigurationError):
        AsyncTraceDispatcher(ListSink(), batch_num=0)
    with pytest.raises(ConfigurationError):
        AsyncTraceDispatcher(ListSink(), flush_interval=0)


async def test_writes_full_batches_at_once_and_the_rest_on_flush() -> None:
    sink = ListSink()
    dispatcher = AsyncTraceDispatcher(sink, batch_num=3, flush_interval=3600)
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        for i in range(7):
            dispatcher.append(ctx(i, keys=f"k{i}"))
        await anyio.wait_all_tasks_blocked()
        assert ids(sink) == [["M0", "M1", "M2"], ["M3", "M4", "M5"]]
        assert sink.messages[0].keys == ("M0", "k0", "M1", "k1", "M2", "k2")
        assert sink.messages[0].topic == "RMQ_SYS_TRACE_TOPIC"
        await dispatcher.flush()
        assert ids(sink)[-1] == ["M6"]
        tg.cancel_scope.cancel()
    stats = dispatcher.statistics()
    assert (stats.written, stats.messages, stats.queued) == (7, 3, 0)


async def test_flush_interval_writes_a_partial_batch() -> None:
    sink = ListSink()
    dispatcher = AsyncTraceDispatcher(sink, batch_num=10, flush_interval=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        dispatcher.append(ctx(1))
        with anyio.fail_after(5):
            while not sink.messages:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert ids(sink) == [["M1"]]


async def test_large_batches_are_split_at_max_msg_size() -> None:
    sink = ListSink()
    dispatcher = AsyncTraceDispatcher(sink, batch_num=4, max_msg_size=60)
    for i in range(4):
        dispatcher.append(ctx(i, keys="x" * 40))
    await dispatcher.flush()
    assert ids(sink) == [["M0"], ["M1"], ["M2"], ["M3"]]


async def test_write_failures_are_counted_not_raised() -> None:
    sink = ListSink()
    sink.fail = True
    dispatcher = AsyncTraceDispatcher(sink, batch_num=2)
    for i in range(3):
        dispatcher.append(ctx(i))
    await dispatcher.flush()
    stats = dispatcher.statistics()
    assert (stats.write_errors, stats.lost, stats.written) == (2, 3, 0)


async def test_aclose_gives_up_after_timeout_and_counts_the_rest() -> None:
    class StuckSink(TraceSink):
        async def write(self, message: TraceMessage) -> None:
            await anyio.sleep_forever()

    dispatcher = AsyncTraceDispatcher(StuckSink(), batch_num=2)
    for i in range(5):
        dispatcher.append(ctx(i))
    await dispatcher.aclose(timeout=0.05)
    stats = dispatcher.statistics()
    assert stats.queued == 0
    assert stats.lost == 3  # the batch being written when the timeout hit is not counted


def test_sync_sink_is_written_where_batches_fill_up() -> None:
    class SyncSink(ListSink):
        def write_nowait(self, message: TraceMessage) -> bool:
            self.messages.append(message)
            return True

    sink = SyncSink()
    dispatcher = AsyncTraceDispatcher(sink, batch_num=10, queue_size=12)
    for i in range(25):  # more than queue_size: nothing is dropped, no task needed
        assert dispatcher.append(ctx(i))
    assert [len(batch) for batch in ids(sink)] == [10, 10]
    stats = dispatcher.statistics()
    assert (stats.written, stats.queued, stats.dropped) == (20, 5, 0)


async def test_sink_declining_write_nowait_falls_back_to_the_task() -> None:
    class Declining(ListSink):
        def write_nowait(self, message: TraceMessage) -> bool:
            return False

    sink = Declining()
    dispatcher = AsyncTraceDispatcher(sink, batch_num=2)
    for i in range(3):
        dispatcher.append(ctx(i))
    assert sink.messages == []
    await dispatcher.flush()
    assert ids(sink) == [["M0", "M1"], ["M2"]]


async def test_deferred_contexts_are_encoded_in_order_and_a_failing_encoder_is_lost() -> None:
    sink = ListSink()
    dispatcher = AsyncTraceDispatcher(sink, batch_num=10)
    encoded: list[int] = []

    def encode(n: int) -> tuple[str, list[str]]:
        encoded.append(n)
        if n == 2:
            raise ValueError("encoder bug")
        from stagedconsumer._observability._trace_codec import encode_trace_context

        return encode_trace_context(ctx(n)), [f"M{n}"]

    for n in range(4):
        assert dispatcher.append_deferred(encode, n)
    assert encoded == []  # nothing is encoded on the hot path
    await dispatcher.flush()
    assert encoded == [0, 1, 2, 3]
    assert ids(sink) == [["M0", "M1", "M3"]]
    assert sink.messages[0].keys == ("M0", "M1", "M3")
    stats = dispatcher.statistics()
    assert (stats.appended, stats.written, stats.lost, stats.write_errors) == (4, 3, 1, 0)
