"""Theoretical lower bounds on the makespan (pure numpy, used inside Spark tasks).

Scheduling jobs with costs ``p`` on ``W`` identical workers (P||Cmax), a lower bound
on the optimum is

    max(sum(p) / W, max(p), max over k >= 1 of p[kW-k] + ... + p[kW])

with ``p`` sorted descending (0-based): among the ``kW + 1`` largest jobs some worker
runs ``k + 1``, so it is busy at least as long as the ``k + 1`` smallest of them take.
The last family makes the bound exact for equal costs (``ceil(n / W) * c``), which
the plain ``max(sum / W, max)`` is not (RIP-22's stage of 70 on 20 workers: 3.5
versus the true 4). It is a lower bound, not a schedule: LPT or any real schedule
can only be longer, so efficiency = bound / makespan <= 1.

Per mode (one consumer instance with ``W`` workers; jobs are handler attempts,
every planned attempt counted at its full cost, retry delays not counted):

- orderly: max(bound of all attempts on ``W``, max over queues of the queue's chain
  ``max_i (publish_i + sum_{j >= i} p_j)``), RIP-22's "sum of costs" for one queue;
- staged: max(bound of all attempts, max over stage keys of the stage chain
  ``T_s = max(T_{s-1} + bound(stage s on W), max_i (publish_i + p_i))``);
- concurrent: bound of all attempts on ``W`` (and ``max_i (publish_i + p_i)``);
  Graham's list-scheduling guarantee ``sum / W + (1 - 1/W) max p`` is reported
  beside it as the upper reference any work-conserving scheduler meets.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ("graham_bound", "makespan_lower_bound", "orderly_chain", "stage_chain")

FloatArray = npt.NDArray[np.float64]


def makespan_lower_bound(costs: Sequence[float] | FloatArray, workers: int) -> float:
    """Lower bound on scheduling independent jobs ``costs`` on ``workers`` workers."""
    p = np.sort(np.asarray(costs, dtype=np.float64))[::-1]
    n = len(p)
    if n == 0:
        return 0.0
    best = max(float(p.sum()) / workers, float(p[0]))
    if n > workers:
        prefix = np.concatenate(([0.0], np.cumsum(p)))
        k = np.arange(1, (n - 1) // workers + 1)
        top = k * workers + 1  # prefix index just past p[kW]
        best = max(best, float(np.max(prefix[top] - prefix[top - k - 1])))
    return best


def graham_bound(costs: Sequence[float] | FloatArray, workers: int) -> float:
    """Graham's list-scheduling guarantee: sum / W + (1 - 1/W) * max."""
    p = np.asarray(costs, dtype=np.float64)
    if len(p) == 0:
        return 0.0
    return float(p.sum()) / workers + (1 - 1 / workers) * float(p.max())


def orderly_chain(publish: FloatArray, work: FloatArray) -> float:
    """A queue consumed one message at a time, in order: max_i (r_i + sum_{j>=i} p_j)."""
    if len(work) == 0:
        return 0.0
    suffix = np.cumsum(work[::-1])[::-1]
    return float(np.max(publish + suffix))


def stage_chain(stages: Sequence[tuple[FloatArray, FloatArray, FloatArray]], workers: int) -> float:
    """Stages in barrier order, each ``(attempt costs, publish, per-message work)``."""
    t = 0.0
    for attempts, publish, work in stages:
        t = max(
            t + makespan_lower_bound(attempts, workers),
            float(np.max(publish + work)) if len(work) else 0.0,
        )
    return t
