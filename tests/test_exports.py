"""The public surface: names in design.md section 5 and nothing private leaks."""

from __future__ import annotations

import importlib

import pytest

DESIGN_NAMES = {
    "stagedconsumer": [
        "Message",
        "MessageQueue",
        "MessageListenerConcurrently",
        "MessageListenerOrderly",
        "MessageListenerStagedConcurrently",
        "ConsumeConcurrentlyStatus",
        "ConsumeOrderlyStatus",
        "ConsumeConcurrentlyContext",
        "ConsumeOrderlyContext",
        "ConsumeStagedConcurrentlyContext",
        "PushConsumer",
        "ConsumerOptions",
        "MemoryBroker",
    ],
    "offsetstore": ["StageOffsetStore", "MemoryOffsetStore", "ReadOffsetType"],
    # the blocking API (design.md 5b), a public module of its own
    "stagedconsumer.blocking": ["BlockingProducer", "BlockingConsumer"],
    # property-based ordering tests for users' listeners (design.md 5b)
    "stagedconsumer.testing": [
        "messages",
        "stage_definitions",
        "failure_schedules",
        "handler_costs",
        "MessageSpec",
        "FailureSchedule",
        "FailureKind",
        "RecordingListener",
        "CallLog",
        "HandlerCall",
        "Outcome",
        "check_staged",
        "check_orderly",
        "check_key_order",
        "check_at_least_once",
        "assert_staged",
        "assert_orderly",
        "assert_key_order",
        "assert_at_least_once",
        "StagePlan",
        "Violation",
        "OrderingViolation",
        "run_virtual",
        "VirtualRun",
        "HYPOTHESIS_PROFILE",
        "Assignment",
        "DeadLetter",
        "InjectedFailure",
        "origin_id",
        "stage_of",
    ],
}


@pytest.mark.parametrize("module_name", sorted(DESIGN_NAMES))
def test_design_names_are_exported(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in DESIGN_NAMES[module_name]:
        assert name in module.__all__, name
        assert getattr(module, name) is not None


def test_every_name_the_testing_kit_exports_is_listed_here() -> None:
    """The kit's whole public surface is covered: a name added to its ``__all__``
    must be added here (and documented), a name dropped from it fails above."""
    module = importlib.import_module("stagedconsumer.testing")
    assert set(module.__all__) == set(DESIGN_NAMES["stagedconsumer.testing"])


@pytest.mark.parametrize("module_name", sorted(DESIGN_NAMES))
def test_all_is_a_tuple_of_existing_public_names(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert isinstance(module.__all__, tuple)
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert not name.startswith("_")
        assert hasattr(module, name), name


@pytest.mark.parametrize("module_name", sorted(DESIGN_NAMES))
def test_public_classes_come_from_private_modules(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in module.__all__:
        value = getattr(module, name)
        defined_in = getattr(value, "__module__", None)
        if defined_in is not None and isinstance(value, type):
            assert defined_in.split(".")[-1].startswith("_"), (name, defined_in)
