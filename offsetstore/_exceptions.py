"""Exceptions raised by :mod:`offsetstore`.

The tree::

    OffsetStoreError                 every store failure; ``retriable`` says whether
    │                                trying again later can succeed
    ├── StoreConfigurationError      malformed URL, unknown dialect (not retriable)
    ├── StoreUnavailableError        cannot reach the database (retriable)
    │   └── StoreReadOnlyError       the database can be read but not written: a
    │                                read-only file, file system, transaction or
    │                                server (not retriable; raised by load() and by
    │                                any write)
    ├── StoreCommitError             a write failed (retriable unless the data is bad)
    ├── StoreFencedError             a write carried a stale fencing token (not retriable)
    └── AlreadyFinishedError         a transaction's message already has its finished
                                     mark: its effect was committed before

Driver and SQLAlchemy errors are wrapped at the boundary (``raise ... from exc``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._types import MessageQueue

__all__ = (
    "AlreadyFinishedError",
    "OffsetStoreError",
    "StoreCommitError",
    "StoreConfigurationError",
    "StoreFencedError",
    "StoreReadOnlyError",
    "StoreUnavailableError",
)


class OffsetStoreError(Exception):
    """Base class of every offset store failure."""

    def __init__(self, message: str, *, retriable: bool) -> None:
        super().__init__(message)
        self.retriable = retriable
        """Whether trying again later can succeed (a database that is restarting)."""


class StoreConfigurationError(OffsetStoreError, ValueError):
    """The store is configured wrongly (malformed URL, unsupported database)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=False)


class StoreUnavailableError(OffsetStoreError):
    """The database cannot be reached (or, :class:`StoreReadOnlyError`, not written)."""

    def __init__(self, message: str, *, retriable: bool = True) -> None:
        super().__init__(message, retriable=retriable)


class StoreReadOnlyError(StoreUnavailableError):
    """The database can be read but not written, so progress cannot be saved.

    A SQLite file opened read-only (``?mode=ro``) or on a read-only file system, a
    PostgreSQL hot standby or ``default_transaction_read_only``, a MariaDB/MySQL server
    running ``--read-only`` or a session in ``READ ONLY`` transactions. Not retriable:
    trying again does not make the database writable, an operator has to. A subclass
    of :class:`StoreUnavailableError` (the database is unavailable *for writing*), so
    code that handled an unopenable SQLite file as unavailable still does; it is not a
    :class:`StoreConfigurationError` because the store's configuration is fine and the
    database's state is what is wrong (it may be made writable again while the
    configuration stays as is).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=False)


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
        """The queues whose write was refused: their writer no longer owns them."""


class AlreadyFinishedError(OffsetStoreError):
    """A transaction (``transact``) found a finished mark of one of its messages: the
    effect of that message was committed before, so nothing was done (not retriable;
    the consumer counts the message as finished)."""

    def __init__(self, message: str, *, offsets: Iterable[int] = ()) -> None:
        super().__init__(message, retriable=False)
        self.offsets: frozenset[int] = frozenset(offsets)
        """The offsets of the messages that had already finished."""
