from __future__ import annotations

import pytest

from stagedconsumer import ConsumerOptions, InvalidOptionError


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
