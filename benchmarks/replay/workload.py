"""Workload files: OpenMessaging Benchmark fields plus what a consumer replay needs.

A workload is a YAML mapping. Fields taken from the OpenMessaging Benchmark (OMB)
``Workload.java`` keep their OMB names and meaning where they fit:

``name``, ``topics``, ``partitionsPerTopic`` (queues per topic), ``messageSize``
(bytes, recorded per message; bodies in the replay only carry an index),
``keyDistributor`` (``NO_KEY``, ``KEY_ROUND_ROBIN``, ``RANDOM_NANO``),
``producerRate`` (messages per second over all queues, interleaved round-robin;
``0`` means the whole backlog is published at time 0, like OMB's backlog tests),
``consumerPerSubscription`` (consumer instances of the one consumer group; queues
are spread over them in contiguous blocks, as RocketMQ's
``AllocateMessageQueueAveragely`` does).

OMB fields that mean nothing for a replay (``subscriptionsPerTopic``,
``producersPerTopic``, ``payloadFile``, ``testDurationMinutes``, ...) are accepted
and ignored, so an OMB file can be extended in place. Any other unknown field is an
error. Consumer fields added here:

``messagesPerQueue``, ``keyCount``, ``seed``, ``handlerCost`` (default constant 1 ms;
``distribution``:
``constant`` {``ms``}, ``uniform`` {``minMs``, ``maxMs``}, ``exponential``
{``meanMs``}, ``lognormal`` {``medianMs``, ``sigma``}), ``failures``
(``probability`` that an attempt fails, ``maxFailures`` consecutive failures of one
message at most, ``suspendMillis``, ``maxReconsumeTimes``), ``stages``
(``definitions``, optional ``strategies`` + ``strategyWeights`` and ``groupBy``),
``consumer`` (``threads`` = ``consume_thread_max``, ``batchSize`` =
``consume_message_batch_max_size``, ``pullBatchSize``), ``modes`` and ``recorded``
(import measured traffic from Parquet/CSV instead of generating it; the fields that
only shape generated traffic are then refused).

A key given twice is an error (PyYAML alone keeps the last). What is valid but
probably not meant is in :attr:`Workload.warnings`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

__all__ = (
    "MODES",
    "CostModel",
    "FailureModel",
    "RecordedTraffic",
    "RecordedTrafficError",
    "StageModel",
    "Workload",
    "WorkloadError",
    "load_workload",
    "parse_workload",
)

MODES: tuple[str, ...] = ("orderly", "concurrent", "staged")
KEY_DISTRIBUTORS = ("NO_KEY", "KEY_ROUND_ROBIN", "RANDOM_NANO")
DISTRIBUTIONS: Mapping[str, tuple[str, ...]] = {
    "constant": ("ms",),
    "uniform": ("minMs", "maxMs"),
    "exponential": ("meanMs",),
    "lognormal": ("medianMs", "sigma"),
}
NO_STAGE = "none"
"""Strategy weight name for messages consumed directly, with no stage."""

_OMB_IGNORED = frozenset(
    {
        "subscriptionsPerTopic",
        "producersPerTopic",
        "payloadFile",
        "useRandomizedPayloads",
        "randomBytesRatio",
        "randomizedPayloadPoolSize",
        "consumerBacklogSizeGB",
        "backlogDrainRatio",
        "testDurationMinutes",
        "warmupDurationMinutes",
    }
)


_GENERATION_ONLY = (
    "topics",
    "partitionsPerTopic",
    "keyDistributor",
    "keyCount",
    "producerRate",
    "messagesPerQueue",
    "handlerCost",
)
"""Fields that only shape generated traffic: recorded traffic has its own queues,
keys, publish times, message count and costs."""


class WorkloadError(ValueError):
    """A workload file is malformed; the message names the file and the field."""


class RecordedTrafficError(WorkloadError):
    """Recorded traffic cannot be replayed as it is (a column missing, a value that is
    not a valid number, an offset twice in a queue); the message names the file, and
    the row and column of the first bad value."""


@attrs.frozen(kw_only=True)
class CostModel:
    """Handler cost per attempt, in milliseconds."""

    distribution: str
    params: Mapping[str, float]

    @property
    def mean_ms(self) -> float:
        p = self.params
        if self.distribution == "constant":
            return p["ms"]
        if self.distribution == "uniform":
            return (p["minMs"] + p["maxMs"]) / 2
        if self.distribution == "exponential":
            return p["meanMs"]
        return p["medianMs"] * math.exp(p["sigma"] ** 2 / 2)


@attrs.frozen(kw_only=True)
class FailureModel:
    """Each attempt fails with ``probability``; a message fails at most
    ``max_failures`` times in a row (then succeeds)."""

    probability: float = 0.0
    max_failures: int = 3
    suspend_millis: int = 1000
    max_reconsume_times: int | None = None


@attrs.frozen(kw_only=True)
class StageModel:
    """Stage definitions, optional named strategies picked by weight, and grouping."""

    definitions: tuple[int, ...] = ()
    strategies: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)
    strategy_weights: Mapping[str, float] = attrs.field(factory=dict)
    group_by: str = "none"

    def all_strategies(self) -> dict[str, tuple[int, ...]]:
        """Every strategy id with its definitions (``default`` = ``definitions``)."""
        out = {"default": self.definitions}
        out.update(self.strategies)
        return out


@attrs.frozen(kw_only=True)
class RecordedTraffic:
    """Measured traffic: a table with at least ``queue`` and ``cost_ms`` columns;
    optional ``topic``, ``offset``, ``key``, ``size``, ``fail_attempts``,
    ``publish_ms``, ``strategy``. Without ``offset``, file order within a queue is
    queue order. Its values are checked when it is imported (see
    :func:`~benchmarks.replay.generate.import_recorded`)."""

    path: Path
    format: str


@attrs.frozen(kw_only=True)
class Workload:
    name: str
    topics: int = 1
    partitions_per_topic: int = 1
    message_size: int = 1024
    key_distributor: str = "NO_KEY"
    key_count: int = 100
    producer_rate: float = 0.0
    consumers: int = 1
    messages_per_queue: int = 100
    seed: int = 0
    cost: CostModel = attrs.field(
        factory=lambda: CostModel(distribution="constant", params={"ms": 1.0})
    )
    failures: FailureModel = attrs.field(factory=FailureModel)
    stages: StageModel = attrs.field(factory=StageModel)
    threads: int = 20
    batch_size: int = 1
    pull_batch_size: int = 32
    modes: tuple[str, ...] = MODES
    recorded: RecordedTraffic | None = None
    source: Path | None = None
    warnings: tuple[str, ...] = attrs.field(default=(), eq=False)
    """What the file says that is valid but probably not meant (each names the file)."""

    @property
    def queue_count(self) -> int:
        return self.topics * self.partitions_per_topic

    @property
    def message_count(self) -> int:
        """Generated messages (unknown for recorded traffic: -1)."""
        if self.recorded is not None:
            return -1
        return self.queue_count * self.messages_per_queue


class _Reader:
    """Typed access to a YAML mapping with errors naming the file and field."""

    def __init__(self, where: str, data: Mapping[str, Any], prefix: str = "") -> None:
        self.where = where
        self.data = data
        self.prefix = prefix
        self.used: set[str] = set()

    def fail(self, field: str, message: str) -> WorkloadError:
        return WorkloadError(f"{self.where}: {self.prefix}{field}: {message}")

    def has(self, field: str) -> bool:
        return field in self.data

    def raw(self, field: str, default: Any = None) -> Any:
        self.used.add(field)
        return self.data.get(field, default)

    def get_int(self, field: str, default: int, *, low: int = 0) -> int:
        value = self.raw(field, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"must be an integer, got {value!r}")
        if value < low:
            raise self.fail(field, f"must be >= {low}, got {value}")
        return value

    def get_number(
        self,
        field: str,
        default: float | None,
        *,
        low: float = 0.0,
        high: float = math.inf,
        strict: bool = False,
    ) -> float:
        value = self.raw(field, default)
        if value is None:
            raise self.fail(field, "is required")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise self.fail(field, f"must be a number, got {value!r}")
        if value < low or (strict and value == low) or value > high:
            bound = f"> {low}" if strict else f">= {low}"
            if high != math.inf:
                bound += f" and <= {high}"
            raise self.fail(field, f"must be {bound}, got {value}")
        return float(value)

    def get_str(self, field: str, default: str, choices: Sequence[str] | None = None) -> str:
        value = self.raw(field, default)
        if not isinstance(value, str) or not value:
            raise self.fail(field, f"must be a non-empty string, got {value!r}")
        if choices is not None and value not in choices:
            raise self.fail(field, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def mapping(self, field: str) -> _Reader:
        value = self.raw(field, {})
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise self.fail(field, f"must be a mapping, got {type(value).__name__}")
        return _Reader(self.where, value, f"{self.prefix}{field}.")

    def stage_list(self, field: str, value: Any) -> tuple[int, ...]:
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise self.fail(field, f"must be a list of positive integers, got {value!r}")
        for size in value:
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise self.fail(field, f"stage sizes must be positive integers, got {size!r}")
        return tuple(value)

    def check_unknown(self, extra_ok: frozenset[str] = frozenset()) -> None:
        unknown = sorted(set(self.data) - self.used - extra_ok)
        if unknown:
            known = ", ".join(sorted(self.used))
            raise WorkloadError(
                f"{self.where}: unknown field(s) {', '.join(self.prefix + u for u in unknown)}"
                f" (known here: {known})"
            )


def _cost(r: _Reader) -> CostModel:
    if not r.data:
        return CostModel(distribution="constant", params={"ms": 1.0})  # default: 1 ms
    distribution = r.get_str("distribution", "constant", tuple(DISTRIBUTIONS))
    params: dict[str, float] = {}
    for name in DISTRIBUTIONS[distribution]:
        if not r.has(name):
            raise r.fail(name, f"is required for distribution {distribution!r}")
        if name == "sigma":
            params[name] = r.get_number(name, None, low=0.0)
        else:
            params[name] = r.get_number(name, None, low=0.0, strict=name != "minMs")
    if distribution == "uniform" and params["maxMs"] < params["minMs"]:
        raise r.fail("maxMs", f"must be >= minMs ({params['minMs']}), got {params['maxMs']}")
    r.check_unknown()
    return CostModel(distribution=distribution, params=params)


def _failures(r: _Reader) -> FailureModel:
    probability = r.get_number("probability", 0.0, low=0.0, high=0.999)
    max_failures = r.get_int("maxFailures", 3, low=0)
    suspend = r.get_int("suspendMillis", 1000, low=10)
    if suspend > 30000:
        raise r.fail("suspendMillis", f"must be in [10, 30000] (RocketMQ's clamp), got {suspend}")
    reconsume = r.raw("maxReconsumeTimes", None)
    if reconsume is not None and (
        isinstance(reconsume, bool) or not isinstance(reconsume, int) or reconsume < 0
    ):
        raise r.fail(
            "maxReconsumeTimes", f"must be a non-negative integer or null, got {reconsume!r}"
        )
    r.check_unknown()
    return FailureModel(
        probability=probability,
        max_failures=max_failures,
        suspend_millis=suspend,
        max_reconsume_times=reconsume,
    )


def _stages(r: _Reader) -> StageModel:
    definitions = r.stage_list("definitions", r.raw("definitions", []))
    strategies_r = r.mapping("strategies")
    strategies = {str(k): strategies_r.stage_list(str(k), v) for k, v in strategies_r.data.items()}
    if "default" in strategies:
        raise strategies_r.fail("default", "is reserved for stages.definitions")
    if NO_STAGE in strategies:
        raise strategies_r.fail(
            NO_STAGE, f"is reserved: strategy weight {NO_STAGE} means consumed with no stage"
        )
    weights_r = r.mapping("strategyWeights")
    weights: dict[str, float] = {}
    for k in weights_r.data:
        name = str(k)
        if name not in strategies and name not in ("default", NO_STAGE):
            known = ", ".join(["default", NO_STAGE, *strategies])
            raise weights_r.fail(name, f"is not a strategy (known: {known})")
        weights[name] = weights_r.get_number(name, None, low=0.0)
    if weights and sum(weights.values()) <= 0:
        raise r.fail("strategyWeights", "must have a positive total weight")
    group_by = r.get_str("groupBy", "none", ("none", "key"))
    r.check_unknown()
    return StageModel(
        definitions=definitions,
        strategies=strategies,
        strategy_weights=weights,
        group_by=group_by,
    )


def parse_workload(data: Any, *, where: str = "<workload>", base: Path | None = None) -> Workload:
    """Validate a parsed YAML document; raises :class:`WorkloadError`."""
    if not isinstance(data, Mapping):
        raise WorkloadError(f"{where}: a workload must be a mapping, got {type(data).__name__}")
    r = _Reader(where, data)
    name = r.get_str("name", "") if r.has("name") else Path(where).stem
    if "/" in name or "\\" in name or name in (".", ".."):
        raise r.fail(
            "name",
            f"must not contain a path separator or be . or .. (it names the default output"
            f" directory bench-results/<name>), got {name!r}",
        )
    recorded: RecordedTraffic | None = None
    rec = r.mapping("recorded")
    if rec.data:
        path_value = rec.raw("path")
        if not isinstance(path_value, str) or not path_value:
            raise rec.fail("path", f"must be a file path, got {path_value!r}")
        path = Path(path_value)
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.exists():
            raise rec.fail("path", f"no such file or directory: {path}")
        ignored = [f for f in _GENERATION_ONLY if r.has(f)]
        if ignored:
            raise r.fail(
                "recorded",
                f"the traffic comes from {path_value}, so {', '.join(ignored)} would be"
                " ignored: remove them",
            )
        fmt = rec.get_str(
            "format", "csv" if path.suffix.lower() == ".csv" else "parquet", ("csv", "parquet")
        )
        rec.check_unknown()
        recorded = RecordedTraffic(path=path, format=fmt)
    modes_value = r.raw("modes", list(MODES))
    if (
        not isinstance(modes_value, Sequence)
        or isinstance(modes_value, str)
        or not modes_value
        or any(m not in MODES for m in modes_value)
        or len(set(modes_value)) != len(modes_value)
    ):
        raise r.fail(
            "modes", f"must be a non-empty list of distinct {', '.join(MODES)}, got {modes_value!r}"
        )
    consumer = r.mapping("consumer")
    threads = consumer.get_int("threads", 20, low=1)
    batch = consumer.get_int("batchSize", 1, low=1)
    pull_batch = consumer.get_int("pullBatchSize", 32, low=1)
    if threads > 1000:
        raise consumer.fail("threads", f"must be <= 1000 (RocketMQ's range), got {threads}")
    if batch > 1024 or pull_batch > 1024:
        raise consumer.fail("batchSize", "batch sizes must be <= 1024 (RocketMQ's range)")
    consumer.check_unknown()
    workload = Workload(
        name=name,
        topics=r.get_int("topics", 1, low=1),
        partitions_per_topic=r.get_int("partitionsPerTopic", 1, low=1),
        message_size=r.get_int("messageSize", 1024, low=0),
        key_distributor=r.get_str("keyDistributor", "NO_KEY", KEY_DISTRIBUTORS),
        key_count=r.get_int("keyCount", 100, low=1),
        producer_rate=r.get_number("producerRate", 0.0, low=0.0),
        consumers=r.get_int("consumerPerSubscription", 1, low=1),
        messages_per_queue=r.get_int("messagesPerQueue", 100, low=1),
        seed=r.get_int("seed", 0, low=0),
        cost=_cost(r.mapping("handlerCost")),
        failures=_failures(r.mapping("failures")),
        stages=_stages(r.mapping("stages")),
        threads=threads,
        batch_size=batch,
        pull_batch_size=pull_batch,
        modes=tuple(modes_value),
        recorded=recorded,
        source=Path(where) if where != "<workload>" else None,
    )
    if recorded is None and workload.consumers > workload.queue_count:
        raise r.fail(
            "consumerPerSubscription",
            f"{workload.consumers} consumers for {workload.queue_count} queues would leave"
            " consumers idle",
        )
    stages = workload.stages
    if recorded is None and stages.strategies and not stages.strategy_weights:
        # (recorded traffic may name each message's strategy in a strategy column)
        raise r.fail(
            "stages.strategies",
            "without stages.strategyWeights every message uses stages.definitions"
            " (strategy default): give each strategy a weight",
        )
    r.check_unknown(_OMB_IGNORED)
    warnings = []
    if "staged" in workload.modes and not any(stages.all_strategies().values()):
        warnings.append(
            f"{where}: modes: staged without stages.definitions (or a strategy with"
            " definitions) replays exactly as concurrent"
        )
    return attrs.evolve(workload, warnings=tuple(warnings))


class _DuplicateKey(yaml.YAMLError):  # type: ignore[misc]
    def __init__(self, key: object, line: int) -> None:
        super().__init__(f"duplicate key {key!r} on line {line}")
        self.key = key
        self.line = line


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
    """PyYAML's safe loader, except that a key given twice in one mapping is an error
    (PyYAML keeps the last value silently)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable: the base class reports it
                continue
            if duplicate:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep)


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload YAML file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read workload file ({exc.strerror})") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except _DuplicateKey as exc:
        raise WorkloadError(
            f"{path}: line {exc.line}: {exc.key!r} is given twice in the same mapping"
            " (YAML would keep only the last value)"
        ) from exc
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{path}: not valid YAML ({exc})") from exc
    return parse_workload(data, where=str(path), base=path.parent)
