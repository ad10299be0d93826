"""Exceptions raised by :mod:`offsetstore`.

The tree::

    OffsetStoreError                 every store failure; ``retriable`` says whether
    │                                trying again later can succeed
    ├── StoreConfigurationError      malformed URL, unknown dialect (not retriable)
    ├── StoreUnavailableError        cannot reach the database (retriable)
    ├── StoreCommitError             a write failed (retriable unless the data is bad)
    └── StoreFencedError             a write carried a stale fencing token (not retriable)

Driver and SQLAlchemy errors are wrapped at the boundary (``raise ... from exc``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._types import MessageQueue

__all__ = (
    "OffsetStoreError",
    "StoreCommitError",
    "StoreConfigurationError",
    "StoreFencedError",
    "StoreUnavailableError",
)


class OffsetStoreError(Exception):
    """Base class of every offset store failure."""

    def __init__(self, message: str, *, retriable: bool) -> None:
        super().__init__(message)
        self.retriable = retriable


class StoreConfigurationError(OffsetStoreError, ValueError):
    """The store is configured wrongly (malformed URL, unsupported database)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=False)


class StoreUnavailableError(OffsetStoreError):
    """The database cannot be reached."""

    def __init__(self, message: str, *, retriable: bool = True) -> None:
        super().__init__(message, retriable=retriable)


class StoreCommitError(OffsetStoreError):
    """Writing progress failed."""

    def __init__(self, message: str, *, retriable: bool = True) -> None:
        super().__init__(message, retriable=retriable)


class StoreFencedError(OffsetStoreError):
    """A write carried a fencing token older than the queue's current owner's.

    ``queues`` are the queues refused (their writer lost them); other queues of the
    same write may have been written.
    """

    def __init__(self, message: str, *, queues: Iterable[MessageQueue] = ()) -> None:
        super().__init__(message, retriable=False)
        self.queues: frozenset[MessageQueue] = frozenset(queues)
