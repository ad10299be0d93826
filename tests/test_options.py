from __future__ import annotations

import inspect
import math
from typing import Any

import attrs
import pytest

from stagedconsumer import ConsumerOptions, InvalidOptionError, ProducerOptions


def test_defaults_are_rocketmqs() -> None:
    options = ConsumerOptions()
    assert options.consume_thread_max == 20
    assert options.consume_message_batch_max_size == 1
    assert options.pull_batch_size == 32
    assert options.pull_threshold_for_queue == 1000
    assert options.pull_threshold_size_for_queue == 100 * 1024 * 1024
    assert options.consume_concurrently_max_span == 2000
    assert options.max_reconsume_times is None
    assert options.suspend_current_queue_time_millis == 1000
    assert options.persist_consumer_offset_interval == 5.0
    assert options.effective_max_reconsume_times(concurrent=True) == 16
    assert options.effective_max_reconsume_times(concurrent=False) is None


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("consume_thread_max", 0, "[1, 1000]"),
        ("consume_thread_max", 1001, "[1, 1000]"),
        ("consume_message_batch_max_size", 1025, "[1, 1024]"),
        ("pull_batch_size", 0, "[1, 1024]"),
        ("pull_threshold_for_queue", 65536, "[1, 65535]"),
        ("consume_concurrently_max_span", 0, "[1, 65535]"),
        ("suspend_current_queue_time_millis", 5, "[10, 30000]"),
        ("max_reconsume_times", -1, "max_reconsume_times"),
        ("consume_thread_max", 2.5, "must be an int"),
        ("consume_thread_max", True, "must be an int"),
        ("persist_consumer_offset_interval", 0, "positive"),
    ],
)
def test_out_of_range_values_are_named(name: str, value: object, fragment: str) -> None:
    with pytest.raises(InvalidOptionError) as info:
        ConsumerOptions(**{name: value})  # type: ignore[arg-type]
    assert name in str(info.value)
    assert fragment in str(info.value)


def test_unknown_option_is_named() -> None:
    with pytest.raises(InvalidOptionError, match="consume_thread_maxx"):
        ConsumerOptions(consume_thread_maxx=3)  # type: ignore[call-arg]


def test_from_mapping() -> None:
    options = ConsumerOptions.from_mapping({"consume_thread_max": 4, "pull_batch_size": 8})
    assert (options.consume_thread_max, options.pull_batch_size) == (4, 8)
    with pytest.raises(InvalidOptionError, match="nope"):
        ConsumerOptions.from_mapping({"nope": 1})


def test_options_are_frozen() -> None:
    options = ConsumerOptions()
    with pytest.raises(AttributeError):
        options.consume_thread_max = 3  # type: ignore[misc]


@pytest.mark.parametrize("cls", [ConsumerOptions, ProducerOptions])
def test_positional_arguments_get_a_clear_message(cls: type[Any]) -> None:
    with pytest.raises(InvalidOptionError) as info:
        cls(10)
    message = str(info.value)
    assert "keyword arguments only" in message
    assert f"{cls.__name__}({attrs.fields(cls)[0].name}=10)" in message
    assert "_checked_init" not in message
    assert "checked_init" not in cls.__init__.__qualname__
    assert "consume_thread_max" in str(inspect.signature(ConsumerOptions))


FLOAT_OPTIONS = [
    "persist_consumer_offset_interval",
    "shutdown_timeout",
    "start_timeout",
    "pull_long_polling_timeout",
    "pull_time_delay_when_exception",
]


@pytest.mark.parametrize("name", FLOAT_OPTIONS)
@pytest.mark.parametrize(
    ("value", "fragment"),
    [(math.inf, "finite"), (-math.inf, "positive"), (math.nan, "positive"), (-1.0, "positive")],
)
def test_durations_must_be_positive_and_finite(name: str, value: float, fragment: str) -> None:
    with pytest.raises(InvalidOptionError) as info:
        ConsumerOptions(**{name: value})  # type: ignore[arg-type]
    assert name in str(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize("name", FLOAT_OPTIONS)
def test_durations_accept_small_and_int_values(name: str) -> None:
    assert getattr(ConsumerOptions(**{name: 0.001}), name) == 0.001  # type: ignore[arg-type]
    assert getattr(ConsumerOptions(**{name: 2}), name) == 2  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.parametrize("timeout", [-1.0, -0.001, math.nan])
async def test_wait_caught_up_rejects_a_negative_or_nan_timeout(timeout: float) -> None:
    from stagedconsumer import MemoryBroker, MessageListenerConcurrently, PushConsumer

    class Listener(MessageListenerConcurrently):
        async def consume_message(self, msgs: object, context: object) -> None:
            pass

    broker = MemoryBroker()
    broker.create_topic("t", 1)
    consumer = PushConsumer("g", broker, Listener())
    consumer.subscribe("t")
    async with consumer:
        with pytest.raises(ValueError, match="timeout must be None or >= 0"):
            await consumer.wait_caught_up(timeout)
        await consumer.wait_caught_up(math.inf)  # infinity is "no timeout"
