"""Durable progress of staged consumers: consume offsets and stage offsets, as one unit."""

from ._abc import StageOffsetStore as StageOffsetStore
from ._exceptions import OffsetStoreError as OffsetStoreError
from ._exceptions import StoreCommitError as StoreCommitError
from ._exceptions import StoreConfigurationError as StoreConfigurationError
from ._exceptions import StoreFencedError as StoreFencedError
from ._exceptions import StoreUnavailableError as StoreUnavailableError
from ._memory import MemoryOffsetStore as MemoryOffsetStore
from ._sql import SqlOffsetStore as SqlOffsetStore
from ._types import QueueProgress as QueueProgress
from ._types import ReadOffsetType as ReadOffsetType
from ._types import StageKey as StageKey

__all__ = (
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
    "StoreUnavailableError",
)
