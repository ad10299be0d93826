"""Durable progress of staged consumers: consume offsets and stage offsets, as one unit.

:class:`SqlOffsetStore` is imported on first use (a module ``__getattr__``, PEP 562):
it needs SQLAlchemy, whose import alone costs about half a second, and a consumer
with an in-memory store (or the CLI printing its help) should not pay for it.
Nothing else in this package imports SQLAlchemy; ``tests/offsetstore/test_imports.py``
holds that in line.
"""

from typing import TYPE_CHECKING, Any

from ._abc import UNSCOPED as UNSCOPED
from ._abc import StageOffsetStore as StageOffsetStore
from ._exceptions import AlreadyFinishedError as AlreadyFinishedError
from ._exceptions import OffsetStoreError as OffsetStoreError
from ._exceptions import StoreCommitError as StoreCommitError
from ._exceptions import StoreConfigurationError as StoreConfigurationError
from ._exceptions import StoreFencedError as StoreFencedError
from ._exceptions import StoreReadOnlyError as StoreReadOnlyError
from ._exceptions import StoreUnavailableError as StoreUnavailableError
from ._memory import MemoryOffsetStore as MemoryOffsetStore
from ._types import QueueProgress as QueueProgress
from ._types import ReadOffsetType as ReadOffsetType
from ._types import StageKey as StageKey

if TYPE_CHECKING:
    from ._sql import SqlOffsetStore as SqlOffsetStore

__all__ = (
    "AlreadyFinishedError",
    "MemoryOffsetStore",
    "OffsetStoreError",
    "QueueProgress",
    "ReadOffsetType",
    "SqlOffsetStore",
    "StageKey",
    "StageOffsetStore",
    "StoreCommitError",
    "StoreConfigurationError",
    "StoreFencedError",
    "StoreReadOnlyError",
    "StoreUnavailableError",
    "UNSCOPED",
)

_LAZY = frozenset({"SqlOffsetStore"})
"""Names of :mod:`offsetstore._sql`, imported (with SQLAlchemy) when first asked for."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import _sql

        value = getattr(_sql, name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
