"""Stage arithmetic (sans-I/O).

A stage definition ``[n1, ..., nk]`` has cumulative boundaries ``c_i = n1 + ... + ni``.
A message whose *stage offset* is ``o`` belongs to the first stage ``i`` with
``c_i > o``; when ``o >= c_k`` it belongs to the unbounded, concurrent *tail stage*,
index :data:`TAIL_STAGE` (``-1``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs

from .._exceptions import InvalidStageDefinitionError

__all__ = ("TAIL_STAGE", "StageDefinition")

TAIL_STAGE = -1
"""Stage index of messages past the last defined stage: unbounded and concurrent."""


def _validate_sizes(sizes: Sequence[int], *, name: str = "stage definitions") -> tuple[int, ...]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise InvalidStageDefinitionError(
            f"{name} must be a sequence of positive ints, got {type(sizes).__name__}"
        )
    for position, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int):
            raise InvalidStageDefinitionError(
                f"{name}[{position}] must be an int, got {type(size).__name__} {size!r}"
            )
        if size <= 0:
            raise InvalidStageDefinitionError(
                f"{name}[{position}] must be a positive int, got {size}"
            )
    return tuple(sizes)


@attrs.frozen
class StageDefinition:
    """Validated stage sizes with their cumulative boundaries.

    >>> d = StageDefinition.of([10, 20, 70])
    >>> d.boundaries
    (10, 30, 100)
    >>> d.stage_index(0), d.stage_index(10), d.stage_index(99), d.stage_index(100)
    (0, 1, 2, -1)
    >>> d.leftover(25)
    5
    """

    sizes: tuple[int, ...]
    """The stage sizes ``n1, ..., nk``."""
    boundaries: tuple[int, ...]
    """The cumulative boundaries ``c1, ..., ck`` (``c_i = n1 + ... + ni``)."""

    @classmethod
    def of(cls, sizes: Sequence[int], *, name: str = "stage definitions") -> StageDefinition:
        """Validate ``sizes`` (each a positive ``int``) and build the definition."""
        valid = _validate_sizes(sizes, name=name)
        boundaries: list[int] = []
        total = 0
        for size in valid:
            total += size
            boundaries.append(total)
        return cls(valid, tuple(boundaries))

    @property
    def total(self) -> int:
        """Number of messages covered by the defined stages (``c_k``; 0 when empty)."""
        return self.boundaries[-1] if self.boundaries else 0

    def stage_index(self, stage_offset: int) -> int:
        """Index of the stage of a message at ``stage_offset``, or :data:`TAIL_STAGE`."""
        if stage_offset < 0:
            raise ValueError(f"stage offset must be >= 0, got {stage_offset}")
        index = bisect.bisect_right(self.boundaries, stage_offset)
        return index if index < len(self.boundaries) else TAIL_STAGE

    def leftover(self, stage_offset: int) -> int:
        """How many messages, starting at ``stage_offset``, remain in its stage.

        Returns ``-1`` in the tail stage, which is unbounded.
        """
        index = self.stage_index(stage_offset)
        if index == TAIL_STAGE:
            return -1
        return self.boundaries[index] - stage_offset

    def is_boundary(self, stage_offset: int) -> bool:
        """Whether ``stage_offset`` is the first offset of a stage (or of the tail)."""
        return stage_offset == 0 or stage_offset in self.boundaries
