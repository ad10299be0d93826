from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.replay.workload import WorkloadError, load_workload, parse_workload

WORKLOADS = Path(__file__).resolve().parents[2] / "benchmarks" / "workloads"


def test_shipped_workloads_are_valid() -> None:
    loaded = {load_workload(p).name: load_workload(p) for p in sorted(WORKLOADS.glob("*.yaml"))}
    assert set(loaded) >= {"rip22", "many-queue", "skewed-cost", "with-failures", "large"}
    rip22 = loaded["rip22"]
    assert rip22.stages.definitions == (10, 20, 70)
    assert (rip22.message_count, rip22.threads, rip22.cost.params) == (100, 20, {"ms": 1000.0})
    assert loaded["large"].message_count == 10_000_000
    assert loaded["with-failures"].failures.probability > 0
    assert loaded["skewed-cost"].cost.distribution == "lognormal"


def base(**extra: Any) -> dict[str, Any]:
    return {"name": "w", "partitionsPerTopic": 2, "messagesPerQueue": 10, **extra}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (base(bogus=1), "unknown field(s) bogus"),
        (base(handlerCost={"distribution": "gamma"}), "handlerCost.distribution: must be one of"),
        (base(handlerCost={"distribution": "uniform", "minMs": 5}), "maxMs: is required"),
        (base(handlerCost={"distribution": "uniform", "minMs": 5, "maxMs": 1}), "must be >= minMs"),
        (base(handlerCost={"distribution": "exponential", "meanMs": 0}), "meanMs: must be > 0"),
        (base(stages={"definitions": [10, 0]}), "stage sizes must be positive integers"),
        (base(stages={"definitions": "10,20"}), "must be a list of positive integers"),
        (
            base(stages={"strategyWeights": {"gold": 1}}),
            "strategyWeights.gold: is not a strategy (known: default, none)",
        ),
        (
            base(stages={"strategies": {"gold": [1]}, "strategyWeights": {"silver": 1}}),
            "(known: default, none, gold)",
        ),
        # the weight "none" means no stage: a strategy of that name could never be picked
        (base(stages={"strategies": {"none": [2]}}), "stages.strategies.none: is reserved"),
        # every message would get the default strategy
        (base(stages={"strategies": {"gold": [1]}}), "without stages.strategyWeights"),
        (base(name="../../elsewhere"), "name: must not contain a path separator"),
        (base(name=".."), "name: must not contain a path separator or be . or .."),
        (base(name="a\\b"), "name: must not contain a path separator"),
        ({"recorded": {"path": "missing.csv"}}, "recorded.path: no such file or directory"),
        (base(failures={"probability": 1.5}), "failures.probability: must be >= 0.0 and <= 0.999"),
        (base(failures={"suspendMillis": 5}), "failures.suspendMillis: must be >= 10"),
        (base(modes=["orderly", "fast"]), "modes: must be a non-empty list"),
        (base(consumer={"threads": 0}), "consumer.threads: must be >= 1"),
        (base(consumerPerSubscription=3), "would leave consumers idle"),
        (base(messagesPerQueue="many"), "messagesPerQueue: must be an integer"),
        ([1, 2], "a workload must be a mapping"),
    ],
)
def test_bad_workloads_get_clear_errors(doc: Any, message: str) -> None:
    with pytest.raises(WorkloadError, match=r"^bad\.yaml: ") as info:
        parse_workload(doc, where="bad.yaml")
    assert message in str(info.value)


def test_omb_fields_that_do_not_apply_are_accepted() -> None:
    w = parse_workload(base(producersPerTopic=4, testDurationMinutes=5, payloadFile="x"))
    assert w.queue_count == 2


def test_load_reports_yaml_errors(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(WorkloadError, match=r"broken\.yaml: not valid YAML"):
        load_workload(bad)
    with pytest.raises(WorkloadError, match="cannot read workload file"):
        load_workload(tmp_path / "missing.yaml")


def test_recorded_traffic_refuses_the_fields_of_generated_traffic(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("queue,cost_ms\n0,1\n")
    doc = {"name": "r", "recorded": {"path": "t.csv"}, "stages": {"strategies": {"g": [1]}}}
    w = parse_workload(doc, base=tmp_path)  # strategies may come from a strategy column
    assert w.recorded is not None
    extra = {"messagesPerQueue": 50, "handlerCost": {"distribution": "constant", "ms": 5}}
    with pytest.raises(WorkloadError, match="messagesPerQueue, handlerCost would be ignored"):
        parse_workload({**doc, **extra}, base=tmp_path)


def test_staged_without_definitions_is_warned_about() -> None:
    assert parse_workload(base(stages={"definitions": [2]})).warnings == ()
    assert parse_workload(base(modes=["orderly", "concurrent"])).warnings == ()
    (warning,) = parse_workload(base(modes=["staged"]), where="w.yaml").warnings
    assert warning.startswith("w.yaml: modes: staged without stages.definitions")
    assert "replays exactly as concurrent" in warning
    with_strategy = {"strategies": {"g": [2]}, "strategyWeights": {"g": 1}}
    assert parse_workload(base(stages=with_strategy)).warnings == ()


def test_load_refuses_a_key_given_twice(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("name: t\ntopics: 1\nstages:\n  definitions: [1]\ntopics: 4\n")
    with pytest.raises(WorkloadError, match=r"twice\.yaml: line 5: 'topics' is given twice"):
        load_workload(path)
    path.write_text("name: t\nstages:\n  definitions: [1]\n  definitions: [2]\n")
    with pytest.raises(WorkloadError, match="line 4: 'definitions' is given twice"):
        load_workload(path)
    path.write_text("name: t\nconsumer: {threads: 2}\nstages: {definitions: [1]}\n")
    assert load_workload(path).threads == 2
