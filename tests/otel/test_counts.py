"""The asynchronous counts the OpenTelemetry hooks keep between collections."""

from __future__ import annotations

from opentelemetry.metrics import CallbackOptions
from opentelemetry.util.types import AttributeValue

from stagedconsumer._observability._otel_common import Counts


def observed(counts: Counts) -> list[tuple[float, dict[str, object]]]:
    return sorted(
        ((obs.value, dict(obs.attributes or {})) for obs in counts.observe(CallbackOptions())),
        key=lambda item: sorted(item[1].items()),
    )


def test_counts_add_up_per_attribute_set() -> None:
    counts = Counts()
    queue0: dict[str, AttributeValue] = {"messaging.destination.partition.id": "0"}
    queue1: dict[str, AttributeValue] = {"messaging.destination.partition.id": "1"}
    for _ in range(3):
        counts.add(1, queue0)
    counts.add(5, queue1)
    counts.add(2, queue0)
    assert observed(counts) == [(5, queue0), (5, queue1)]
    counts.add(1, queue1)  # cumulative: a later collection sees the earlier adds too
    assert observed(counts) == [(5, queue0), (6, queue1)]


def test_counts_with_an_error_type_are_keyed_by_value() -> None:
    counts = Counts()
    # A fresh dict per failed call, equal by value: one count, not one per dict.
    for _ in range(4):
        counts.add(1, {"messaging.destination.partition.id": "0", "error.type": "ValueError"})
    counts.add(2, {"messaging.destination.partition.id": "0", "error.type": "KeyError"})
    assert observed(counts) == [
        (2, {"messaging.destination.partition.id": "0", "error.type": "KeyError"}),
        (4, {"messaging.destination.partition.id": "0", "error.type": "ValueError"}),
    ]


def test_a_registered_attribute_set_counts_by_its_key_and_through_add() -> None:
    counts = Counts()
    queue0: dict[str, AttributeValue] = {"messaging.destination.partition.id": "0"}
    key = counts.key_of(queue0)
    assert observed(counts) == []  # registered, nothing counted yet
    counts.by_key[key] += 3
    counts.add(2, queue0)  # the same dict: the same count
    assert observed(counts) == [(5, queue0)]
