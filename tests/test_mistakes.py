"""Mistakes a new user makes, said at the call (an error) or loudly (a warning)
instead of being accepted silently."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
import pytest

from offsetstore import MemoryOffsetStore
from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    InvalidMessageError,
    InvalidOptionError,
    MemoryBroker,
    Message,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    OutgoingMessage,
    Producer,
    PushConsumer,
    SelectMessageQueueByGray,
    WrongThreadError,
)
from stagedconsumer._message import RESERVED_PROPERTIES
from stagedconsumer.blocking import BlockingConsumer, BlockingProducer

pytestmark = pytest.mark.anyio


class ReturnsConcurrently(MessageListenerConcurrently):
    def __init__(self, value: object) -> None:
        self.value = value

    async def consume_message(  # type: ignore[override]  # the mistake under test
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> object:
        return self.value


class ReturnsOrderly(MessageListenerOrderly):
    def __init__(self, value: object) -> None:
        self.value = value
        self.calls = 0

    async def consume_message(  # type: ignore[override]  # the mistake under test
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> object:
        self.calls += 1
        context.suspend_current_queue_time_millis = 10
        return self.value if self.calls <= 2 else None


@pytest.mark.parametrize(
    ("listener", "value", "status"),
    [
        (ReturnsConcurrently, "CONSUME_SUCCESS", "ConsumeConcurrentlyStatus.CONSUME_SUCCESS"),
        (ReturnsConcurrently, True, "ConsumeConcurrentlyStatus.CONSUME_SUCCESS"),
        (ReturnsOrderly, "SUCCESS", "ConsumeOrderlyStatus.SUCCESS"),
        (ReturnsOrderly, 0, "ConsumeOrderlyStatus.SUCCESS"),
    ],
)
async def test_a_handler_returning_something_that_is_not_a_status_is_told_once(
    caplog: pytest.LogCaptureFixture, listener: type, value: object, status: str
) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    for _ in range(2):
        broker.send("t", b"x", queue_id=0)
    consumer = PushConsumer("g", broker, listener(value), offset_store=MemoryOffsetStore())
    consumer.subscribe("t")
    with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
        async with consumer:
            with anyio.fail_after(30):
                while consumer.statistics().invalid_returns < 2:
                    await anyio.sleep(0.01)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert f"returned {value!r} (a {type(value).__name__}), which is not a status" in errors[0]
    assert status in errors[0]
    assert "statistics().invalid_returns" in errors[0]


def test_gray_value_without_gray_property_is_refused() -> None:
    """Messages marked lane=canary went to the normal queues: the value was compared
    with no property at all."""
    with pytest.raises(ConfigurationError, match="gray_value='canary' is compared with"):
        SelectMessageQueueByGray(0.25, gray_value="canary")
    selector = SelectMessageQueueByGray(0.25, gray_property="lane", gray_value="canary")
    assert selector.gray_value == "canary"
    assert SelectMessageQueueByGray(0.25, gray_property="lane").gray_value == "true"


def test_gray_queue_ratio_with_the_switch_off_is_refused() -> None:
    with pytest.raises(InvalidOptionError, match=r"gray_queue_ratio=0\.25 is used only with"):
        ConsumerOptions(gray_queue_ratio=0.25)
    assert ConsumerOptions(enable_gray_switch=True, gray_queue_ratio=0.25).gray_queue_ratio == 0.25


async def test_arg_without_a_selector_is_refused() -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 4)
    async with Producer(broker) as producer:
        with pytest.raises(ConfigurationError, match="arg=True is handed to a selector"):
            await producer.send("t", b"x", arg=True)
        with pytest.raises(ConfigurationError, match="no selector= is given"):
            await producer.send_batch("t", [b"x"], arg="k")
        sent = await producer.send("t", b"x", selector=SelectMessageQueueByGray(0.25), arg=True)
        assert sent.message_queue.queue_id == 3  # the gray queue


async def test_blocking_calls_from_a_running_event_loop_are_refused() -> None:
    """They would stall the loop they are called from (and everything on it) until the
    other loop has done the call."""
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    with pytest.raises(WrongThreadError, match=r"thread running a (asyncio|trio) event loop"):
        BlockingProducer(broker).__enter__()
    consumer = PushConsumer("g", broker, ReturnsConcurrently(None))
    consumer.subscribe("t")
    with pytest.raises(WrongThreadError, match="use the async consumer"):
        BlockingConsumer(consumer).__enter__()
    producer = BlockingProducer(broker)
    await anyio.to_thread.run_sync(producer.__enter__)  # started where it may block
    try:
        with pytest.raises(WrongThreadError, match=r"send\(\) blocks its thread"):
            producer.send("t", b"x")
        sent = await anyio.to_thread.run_sync(lambda: producer.send("t", b"x"))
        assert sent.queue_offset == 0
    finally:
        await anyio.to_thread.run_sync(producer.__exit__, None, None, None)


@pytest.mark.parametrize("tags", ["a || b", "a b", "a&&b", "*", ""])
async def test_a_tag_no_subscription_can_select_is_refused(tags: str) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    async with Producer(broker) as producer:
        with pytest.raises(InvalidMessageError, match="is not one tag"):
            await producer.send("t", b"x", tags=tags)
        with pytest.raises(InvalidMessageError, match="is not one tag"):
            OutgoingMessage.of(b"x", tags=tags)
        assert (await producer.send("t", b"x", tags="TagA")).queue_offset == 0


@pytest.mark.parametrize("name", sorted(RESERVED_PROPERTIES))
async def test_a_property_the_broker_sets_itself_is_refused(name: str) -> None:
    broker = MemoryBroker()
    broker.create_topic("t", 1)
    async with Producer(broker) as producer:
        with pytest.raises(InvalidMessageError, match=f"property '{name}' is set by the broker"):
            await producer.send("t", b"x", properties={name: "true"})
    assert not broker.messages("t")


def test_the_reserved_properties_are_the_brokers() -> None:
    from stagedconsumer._sources._gray import PROPERTY_GRAY
    from stagedconsumer._sources._source import PROPERTY_ORIGIN_MESSAGE_ID, PROPERTY_RETRY_TOPIC

    assert {PROPERTY_GRAY, PROPERTY_ORIGIN_MESSAGE_ID, PROPERTY_RETRY_TOPIC} == RESERVED_PROPERTIES


def test_run_virtual_says_what_messages_and_crash_points_it_takes() -> None:
    pytest.importorskip("hypothesis")
    from stagedconsumer.testing import MessageSpec, run_virtual

    listener = ReturnsConcurrently(None)
    with pytest.raises(TypeError, match=r"must be MessageSpec values .* got bytes b'x' at index 0"):
        run_virtual(listener, [b"x"])  # type: ignore[list-item]
    spec = MessageSpec(topic="t", queue_id=0, body=b"x")
    for point in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="crash_at points count ended handler calls"):
            run_virtual(listener, [spec], crash_at=[point])  # type: ignore[list-item]
    run = run_virtual(listener, [spec, spec], crash_at=[1])
    assert run.completed


@pytest.mark.slow
@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (
            "import stagedconsumer.testing",
            "needs the 'testing' extra (hypothesis is not installed)",
        ),
        (
            "import runpy; runpy.run_module('benchmarks', run_name='__main__')",
            "python -m benchmarks needs the 'bench' extra (pyspark is not installed)",
        ),
    ],
    ids=["testing", "bench"],
)
def test_a_missing_extra_is_named(code: str, expected: str) -> None:
    """Without the extra's packages (hidden here), the error names the extra."""
    import subprocess
    import sys
    from pathlib import Path

    hide = "import sys; sys.modules['hypothesis'] = sys.modules['pyspark'] = None; "
    result = subprocess.run(
        [sys.executable, "-c", hide + code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 1
    assert expected in result.stderr
    assert "stagedconsumer[" in result.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["demo", "--virtual", "--backend", "asyncio"], "--backend asyncio would be ignored"),
        (["demo", "--keys", "10", "gray"], "--keys before 'gray' belong(s) to the RIP-22 demo"),
        (["demo", "--backend", "trio", "--messages", "5", "gray"], "--messages, --backend"),
    ],
)
def test_demo_options_that_would_be_ignored_are_refused(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from stagedconsumer._cli import main

    assert main(argv) == 2
    assert expected in " ".join(capsys.readouterr().err.split())


class Staged(MessageListenerStagedConcurrently):
    def get_stage_definitions(self) -> list[int]:
        return [2]

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        pass


async def test_members_of_one_group_in_different_modes_are_told_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A staged and an orderly listener in one group both ran, each its own way, with
    nothing said. (Not refused: a deployment changing a group's mode runs both.)"""
    broker = MemoryBroker()
    broker.create_topic("t", 4)
    store = MemoryOffsetStore()
    staged = PushConsumer("g", broker, Staged(), offset_store=store)
    orderly = PushConsumer("g", broker, ReturnsOrderly(None), offset_store=store)
    same = PushConsumer("h", broker, Staged(), offset_store=store)
    same_too = PushConsumer("h", broker, Staged(), offset_store=store)
    for consumer in (staged, orderly, same, same_too):
        consumer.subscribe("t")
    assert staged.client_id.endswith("@mode[staged]")
    assert orderly.client_id.endswith("@mode[orderly]")

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]

    with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
        async with staged, orderly, same, same_too:
            with anyio.fail_after(30):
                while len(errors()) < 2 or len(same.assigned_queues) != 2:
                    await anyio.sleep(0.01)
    told = errors()
    assert len(told) == 2, told  # once by each member of g, never by those of h
    mine = next(e for e in told if f"this staged member {staged.client_id}" in e)
    assert f"{orderly.client_id} (orderly)" in mine
    assert "must agree on the mode" in mine
    assert any(f"this orderly member {orderly.client_id}" in e for e in told)
