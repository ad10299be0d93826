"""Shared hypothesis strategies for the property tests.

Everything here draws plain data (lists, ints, frozensets, :class:`Scenario`); the
tests turn it into listeners, brokers and process queues. Stage definitions come from
the public kit, ``stagedconsumer.testing``; the rest is shaped for the internal tests
(failures by queue, offset and attempt, arrival gaps, flow-control thresholds).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from hypothesis import strategies as st

from stagedconsumer.testing import stage_definitions

__all__ = (
    "Scenario",
    "arrival_gaps",
    "batch_sizes",
    "concurrency_limits",
    "degenerate_orderly_sizes",
    "durations",
    "failure_schedules",
    "invalid_stage_sizes",
    "max_reconsume_times",
    "message_counts",
    "queue_counts",
    "scenarios",
    "stage_sizes",
)


def stage_sizes(*, max_stages: int = 5, max_size: int = 6) -> st.SearchStrategy[list[int]]:
    """Valid stage definitions, weighted towards the degenerate ones (``[]``, ``[1] * n``):
    the public kit's :func:`stagedconsumer.testing.stage_definitions`."""
    return stage_definitions(max_stages=max_stages, max_size=max_size)


def degenerate_orderly_sizes() -> st.SearchStrategy[list[int]]:
    """``[1] * n``, which must behave as orderly for the first ``n`` messages."""
    return st.integers(1, 12).map(lambda n: [1] * n)


def invalid_stage_sizes() -> st.SearchStrategy[list[object]]:
    """Definitions with at least one bad element: zero, negative, bool, float, str, None."""
    bad = st.one_of(
        st.integers(max_value=0),
        st.booleans(),
        st.floats(allow_nan=True),
        st.text(max_size=3),
        st.none(),
        st.decimals(allow_nan=False, allow_infinity=False),
    )
    good = st.integers(1, 100)
    return st.tuples(st.lists(good, max_size=4), bad, st.lists(good, max_size=4)).map(
        lambda t: [*t[0], t[1], *t[2]]
    )


queue_counts = st.integers(1, 3)
message_counts = st.integers(0, 30)
batch_sizes = st.integers(1, 4)
concurrency_limits = st.integers(1, 8)
max_reconsume_times: st.SearchStrategy[int | None] = st.one_of(st.none(), st.integers(0, 2))


def durations(*, max_cost: int = 4) -> st.SearchStrategy[list[int]]:
    """A schedule of handler costs in virtual time units, cycled over the messages."""
    return st.lists(st.integers(0, max_cost), min_size=1, max_size=8)


def arrival_gaps() -> st.SearchStrategy[list[int]]:
    """Gaps between message arrivals: often none (all sent up front), else a schedule."""
    return st.one_of(st.just([0]), st.lists(st.integers(0, 3), min_size=1, max_size=6))


def failure_schedules(
    counts: Sequence[int], *, max_attempt: int = 3, max_failures: int = 6
) -> st.SearchStrategy[frozenset[tuple[int, int, int]]]:
    """Sets of ``(queue_id, queue_offset, reconsume_times)`` whose handler call fails.

    A message fails on its attempt number ``reconsume_times + 1`` when its triple is in
    the set; a batch fails when any of its messages is scheduled to fail.
    """
    slots = [(q, o) for q, n in enumerate(counts) for o in range(n)]
    if not slots:
        return st.just(frozenset())
    return st.frozensets(
        st.tuples(st.sampled_from(slots), st.integers(0, max_attempt)).map(
            lambda t: (t[0][0], t[0][1], t[1])
        ),
        max_size=max_failures,
    )


@attrs.frozen(kw_only=True)
class Scenario:
    """One end-to-end workload: queues, messages, costs, limits and failures."""

    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    """Messages per queue."""
    costs: tuple[int, ...]
    """Handler cost per message, cycled by global message index (virtual time units)."""
    batch_size: int
    workers: int
    failures: frozenset[tuple[int, int, int]]
    max_reconsume_times: int | None
    suspend_millis: int
    pull_threshold: int = 1000
    """``pull_threshold_for_queue``: small values make pulling pause and resume."""
    pull_batch: int = 7
    """``pull_batch_size``."""
    gaps: tuple[int, ...] = (0,)
    """Time units between the arrivals of consecutive messages of a queue, cycled by
    global message index; ``(0,)``: everything is in the broker before consuming starts."""

    @property
    def queue_count(self) -> int:
        return len(self.counts)

    @property
    def total(self) -> int:
        return sum(self.counts)

    def cost(self, queue_id: int, offset: int) -> int:
        index = sum(self.counts[:queue_id]) + offset
        return self.costs[index % len(self.costs)]

    def arrival(self, queue_id: int, offset: int) -> int:
        """When message ``offset`` of ``queue_id`` is sent (non-decreasing per queue)."""
        start = sum(self.counts[:queue_id])
        return sum(self.gaps[(start + k) % len(self.gaps)] for k in range(1, offset + 1))

    def fails(self, queue_id: int, offset: int, reconsume_times: int) -> bool:
        return (queue_id, offset, reconsume_times) in self.failures


@st.composite
def scenarios(
    draw: st.DrawFn,
    *,
    sizes: st.SearchStrategy[list[int]] | None = None,
    max_messages: int = 30,
    max_queues: int = 3,
    with_failures: bool = True,
    batch: st.SearchStrategy[int] | None = None,
    workers: st.SearchStrategy[int] | None = None,
) -> Scenario:
    """A full :class:`Scenario`; ``with_failures=False`` draws no failures."""
    drawn_sizes = draw(sizes if sizes is not None else stage_sizes())
    queues = draw(st.integers(1, max_queues))
    counts = draw(st.lists(st.integers(0, max_messages), min_size=queues, max_size=queues))
    failures: frozenset[tuple[int, int, int]] = frozenset()
    limit = None
    if with_failures:
        failures = draw(failure_schedules(counts))
        limit = draw(max_reconsume_times)
    return Scenario(
        sizes=tuple(drawn_sizes),
        counts=tuple(counts),
        costs=tuple(draw(durations())),
        batch_size=draw(batch if batch is not None else batch_sizes),
        workers=draw(workers if workers is not None else concurrency_limits),
        failures=failures,
        max_reconsume_times=limit,
        suspend_millis=draw(st.sampled_from([10, 500, 1000, 2500])),
        gaps=tuple(draw(arrival_gaps())),
        pull_threshold=draw(st.sampled_from([1000, 1000, 1, 2, 3, 5])),
        pull_batch=draw(st.sampled_from([7, 1, 2, 32])),
    )
