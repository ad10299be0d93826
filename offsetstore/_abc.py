"""StageOffsetStore: where consumers keep the progress of their queues."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from ._exceptions import StoreConfigurationError, StoreFencedError
from ._types import (
    MessageQueue,
    QueueProgress,
    ReadOffsetType,
    StageKey,
    check_offset,
    check_stage_offset,
    check_stage_offsets,
)

__all__ = ("UNSCOPED", "StageOffsetStore")

UNSCOPED = ""
"""The source of progress stored without one: rows written before schema version 4
(or by a store bound to no source). A consumer's store adopts them for its source
(:meth:`StageOffsetStore.adopt_unscoped_progress`)."""

_T = TypeVar("_T")


class _Row:
    __slots__ = ("consume_offset", "finished", "stage_offsets")

    def __init__(self) -> None:
        self.consume_offset: int | None = None
        self.stage_offsets: dict[StageKey, int] = {}
        self.finished: tuple[tuple[int, int], ...] = ()

    def progress(self) -> QueueProgress:
        return QueueProgress(
            consume_offset=self.consume_offset,
            stage_offsets=self.stage_offsets,
            finished=self.finished,
        )


class StageOffsetStore(abc.ABC):
    """Progress of message queues per consumer group: consume and stage offsets.

    RIP-22's ``StageOffsetStore`` operations in Python form, extended to consume
    offsets. The store keeps an in-memory table that ``update_*`` write (cheap,
    synchronous, called on every commit) and a durable store that ``persist`` and
    ``persist_all`` write. The progress of one queue (its consume offset and the
    stage offsets of its stage keys) is always written as one unit: a reader never
    sees a consume offset with the stage offsets of another moment.

    Ordering guarantee: persisted consume offsets never move backwards through
    :meth:`persist` / :meth:`persist_all` (a write with a lower consume offset than the
    stored one is ignored, together with its stage offsets); only
    :meth:`reset_progress`, an operator action, moves them back.

    Subclasses implement the durable part: :meth:`_read_stored`,
    :meth:`_write_stored`, :meth:`_overwrite_stored` and :meth:`_list_stored`, and,
    for consumer groups spread over processes, :meth:`_claim_stored` and
    :meth:`_write_fenced`: each stored row then carries a fence, the highest fencing
    token (queue lock epoch) that claimed it, and writes with a lower token are
    refused, so a consumer that lost a queue cannot overwrite its new owner's progress.

    **Sources.** Offsets mean something only on the log they count: the same group,
    topic and queue on another Redis namespace, a flushed Redis or another broker are
    other messages. So a store keeps the progress of one *source* (its
    :attr:`source`, what its message source's ``source_id()`` says), given when it
    is made (``source=``) or bound by the first consumer that uses it
    (:meth:`bind_source`); durable
    stores key their rows by it, beside group, topic and queue, so one database
    serves many sources. A store bound to no source (a tool's, a script's) works on
    the progress of the group's only source: the rows stored without one
    (:data:`UNSCOPED`: schema version 3 and before) while no source has any; when
    several sources have progress of the group, it raises
    :class:`~offsetstore.StoreConfigurationError` naming them (pass ``source=``).
    """

    def __init__(self, *, source: str | None = None) -> None:
        self._table: dict[tuple[str, MessageQueue], _Row] = {}
        if source is not None:
            _check_source(source)
        self._source = source
        self._unbound_scopes: dict[str, str] = {}
        """Per group, the source an unbound store found last (see _resolve_scope)."""

    # -- source ----------------------------------------------------------------------

    @property
    def source(self) -> str | None:
        """The identity of the source whose progress this store keeps, ``None``
        until bound (see the class documentation)."""
        return self._source

    def _scope_of(self, group: str) -> str:
        """What the durable rows of ``group`` are keyed by: the store's source; for an
        unbound store the one :meth:`_resolve_scope` found (:data:`UNSCOPED` else)."""
        if self._source is not None:
            return self._source
        return self._unbound_scopes.get(group, UNSCOPED)

    async def _resolve_scope(self, group: str) -> None:
        """For an unbound store, find the source whose progress of ``group`` it works
        on: the only one with stored progress of it (:data:`UNSCOPED` when none has
        any); several raise :class:`~offsetstore.StoreConfigurationError`. Called by
        every operation that reads or writes the durable part."""
        if self._source is not None:
            return
        sources = sorted(set(await self._stored_sources(group)) - {UNSCOPED})
        if len(sources) > 1:
            raise StoreConfigurationError(
                f"group {group!r} has stored progress of {len(sources)} sources"
                f" ({', '.join(map(repr, sources))}): make the store with source=... to"
                " say whose progress to use"
            )
        self._unbound_scopes[group] = sources[0] if sources else UNSCOPED

    async def _stored_sources(self, group: str) -> list[str]:
        """The sources with stored progress of ``group``; the default (a store
        without sources) none."""
        del group
        return []

    def bind_source(self, source: str) -> None:
        """Keep the progress of ``source`` from now on (a consumer calls it with its
        source's ``source_id()`` when it starts). Binding again to the same source
        does nothing; a store bound to another source raises
        :class:`~offsetstore.StoreConfigurationError` naming both: make one store
        object per source (they may share a database). Binding forgets the in-memory
        table (what was read or updated unbound belongs to no source)."""
        _check_source(source)
        if self._source == source:
            return
        if self._source is not None:
            raise StoreConfigurationError(
                f"{self!r} keeps the progress of source {self._source!r}; a consumer of"
                f" source {source!r} needs a store of its own (it may use the same"
                " database: progress is keyed by source)"
            )
        self._source = source
        self._table.clear()
        self._source_bound()

    def _source_bound(self) -> None:  # noqa: B027 - optional hook
        """Called when :meth:`bind_source` set the source (drop per-source caches)."""

    async def adopt_unscoped_progress(self, group: str) -> int:
        """Make the progress of ``group`` stored without a source (:data:`UNSCOPED`:
        rows of schema version 3 and before) this store's source's, if that source
        has none of ``group`` yet, in one transaction; returns how many queues' rows
        it adopted (0 when unbound, or when there was nothing to adopt).

        A consumer calls it when it starts: the first source to use a group after the
        upgrade takes the group's old progress (every member of a group has the same
        source, so the group resumes where it was); another source sees none of it.
        The default (a store without sources) adopts nothing."""
        if self._source is None:
            return 0
        return await self._adopt_stored(group)

    async def _adopt_stored(self, group: str) -> int:
        """Durable part of :meth:`adopt_unscoped_progress`; the default adopts nothing."""
        del group
        return 0

    # -- durable part (subclasses) ------------------------------------------------

    @abc.abstractmethod
    async def _read_stored(self, group: str, mq: MessageQueue) -> QueueProgress | None:
        """The persisted progress of ``mq``, or ``None`` when there is none."""

    @abc.abstractmethod
    async def _write_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress]
    ) -> None:
        """Persist the progress of several queues atomically, increase-only on the
        consume offset (a row whose stored consume offset is higher stays as it is)."""

    @abc.abstractmethod
    async def _overwrite_stored(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress | None]
    ) -> None:
        """Set (or, for ``None``, delete) persisted progress unconditionally."""

    @abc.abstractmethod
    async def _list_stored(
        self, group: str, topic: str | None
    ) -> dict[MessageQueue, QueueProgress]:
        """All persisted progress of ``group`` (of one topic when given)."""

    async def load(self) -> None:  # noqa: B027 - optional hook
        """Prepare the store (connect, create tables). The default does nothing."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The default does nothing."""

    async def __aenter__(self) -> StageOffsetStore:
        await self.load()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- in-memory table -------------------------------------------------------------

    def _row(self, group: str, mq: MessageQueue) -> _Row:
        row = self._table.get((group, mq))
        if row is None:
            row = self._table[(group, mq)] = _Row()
        return row

    def update_offset(
        self, group: str, mq: MessageQueue, offset: int, *, increase_only: bool = False
    ) -> None:
        """Set the in-memory consume offset of ``mq`` (an int >= 0: ``TypeError`` or
        ``ValueError`` otherwise)."""
        check_offset("consume offset", offset)
        row = self._row(group, mq)
        if increase_only and row.consume_offset is not None and offset < row.consume_offset:
            return
        if offset != row.consume_offset:
            row.finished = tuple((f, last) for f, last in row.finished if f > offset)
        row.consume_offset = offset

    def update_stage_offset(
        self,
        group: str,
        mq: MessageQueue,
        key: StageKey,
        stage_offset: int,
        *,
        increase_only: bool = False,
    ) -> None:
        """Set the in-memory stage offset of one stage key of ``mq`` (``key`` a
        :class:`StageKey`, ``stage_offset`` an int >= 0: ``TypeError`` or
        ``ValueError`` otherwise)."""
        check_stage_offset(key, stage_offset)
        row = self._row(group, mq)
        current = row.stage_offsets.get(key)
        if increase_only and current is not None and stage_offset < current:
            return
        row.stage_offsets[key] = stage_offset

    def update_progress(self, group: str, mq: MessageQueue, progress: QueueProgress) -> None:
        """Set the in-memory progress of ``mq`` (consume and stage offsets) as one unit.

        ``progress`` must be a :class:`QueueProgress` (which checks its offsets when
        built): ``TypeError`` otherwise."""
        if type(progress) is not QueueProgress and not isinstance(progress, QueueProgress):
            raise TypeError(f"progress of {mq} must be a QueueProgress, got {progress!r}")
        row = self._row(group, mq)
        row.consume_offset = progress.consume_offset
        row.stage_offsets = dict(progress.stage_offsets)
        row.finished = progress.finished

    async def read_progress(
        self,
        group: str,
        mq: MessageQueue,
        read_type: ReadOffsetType = ReadOffsetType.MEMORY_FIRST_THEN_STORE,
    ) -> QueueProgress | None:
        """The progress of ``mq``, or ``None`` when none is known where ``read_type`` looks.

        Reading from the store also refreshes the in-memory table.
        """
        if read_type is not ReadOffsetType.READ_FROM_STORE:
            row = self._table.get((group, mq))
            if row is not None:
                return row.progress()
            if read_type is ReadOffsetType.READ_FROM_MEMORY:
                return None
        await self._resolve_scope(group)
        stored = await self._read_stored(group, mq)
        if stored is not None:
            self.update_progress(group, mq, stored)
        return stored

    async def read_offset(
        self,
        group: str,
        mq: MessageQueue,
        read_type: ReadOffsetType = ReadOffsetType.MEMORY_FIRST_THEN_STORE,
    ) -> int | None:
        """The consume offset of ``mq``, or ``None`` when unknown."""
        progress = await self.read_progress(group, mq, read_type)
        return progress.consume_offset if progress is not None else None

    async def read_stage_offset(
        self,
        group: str,
        mq: MessageQueue,
        read_type: ReadOffsetType = ReadOffsetType.MEMORY_FIRST_THEN_STORE,
    ) -> Mapping[StageKey, int]:
        """The stage offsets of ``mq`` (empty when unknown)."""
        progress = await self.read_progress(group, mq, read_type)
        return progress.stage_offsets if progress is not None else {}

    async def persist(self, group: str, mq: MessageQueue) -> None:
        """Write the in-memory progress of ``mq`` to the store."""
        await self.persist_all(group, (mq,))

    async def persist_all(self, group: str, mqs: Iterable[MessageQueue]) -> None:
        """Write the in-memory progress of ``mqs`` to the store in one transaction."""
        batch: dict[MessageQueue, QueueProgress] = {}
        for mq in mqs:
            row = self._table.get((group, mq))
            if row is not None:
                batch[mq] = row.progress()
        if batch:
            await self._resolve_scope(group)
            await self._write_stored(group, batch)

    # -- fencing (consumer groups across processes) ----------------------------------

    async def _claim_stored(self, group: str, mq: MessageQueue, fence: int) -> QueueProgress | None:
        """Raise the stored fence of ``mq`` to ``fence`` and return its progress, in one
        transaction; raise :class:`StoreFencedError` when the stored fence is higher."""
        raise StoreConfigurationError(f"{type(self).__name__} does not support fencing tokens")

    async def _write_fenced(
        self,
        group: str,
        progress: Mapping[MessageQueue, QueueProgress],
        fences: Mapping[MessageQueue, int],
    ) -> set[MessageQueue]:
        """Persist ``progress`` (increase-only, as :meth:`_write_stored`) for every queue
        whose stored fence is at most its token in ``fences``, in one transaction;
        returns the queues skipped because their stored fence is higher."""
        raise StoreConfigurationError(f"{type(self).__name__} does not support fencing tokens")

    async def claim(self, group: str, mq: MessageQueue, fence: int) -> QueueProgress | None:
        """Take over ``mq`` with fencing token ``fence`` (a queue lock's epoch).

        Raises the stored fence to ``fence`` (so writes with an older token are
        refused from now on) and returns the stored progress, also loaded into the
        in-memory table (``None`` when there is none). Raises
        :class:`~offsetstore.StoreFencedError` when a newer owner already claimed it.
        """
        await self._resolve_scope(group)
        progress = await self._claim_stored(group, mq, fence)
        if progress is None:
            self.remove_offset(group, mq)
        else:
            self.update_progress(group, mq, progress)
        return progress

    async def persist_fenced(self, group: str, fences: Mapping[MessageQueue, int]) -> None:
        """Like :meth:`persist_all` for the queues of ``fences``, each written only if
        its token is at least the stored fence (the one of its last :meth:`claim`).

        The queues that pass are written in one transaction; then, if any queue was
        refused, :class:`~offsetstore.StoreFencedError` is raised with those queues in
        its ``queues``: their owner lost them and must stop without committing.
        """
        batch: dict[MessageQueue, QueueProgress] = {}
        tokens: dict[MessageQueue, int] = {}
        for mq, fence in fences.items():
            row = self._table.get((group, mq))
            if row is not None:
                batch[mq] = row.progress()
                tokens[mq] = fence
        if not batch:
            return
        await self._resolve_scope(group)
        fenced = await self._write_fenced(group, batch, tokens)
        if fenced:
            raise StoreFencedError(
                f"group {group!r}: progress of {', '.join(map(str, sorted(fenced)))} not"
                " written: another consumer took over the queue (newer fencing token)",
                queues=fenced,
            )

    # -- exactly-once effects -----------------------------------------------------------

    async def transact(
        self,
        group: str,
        mq: MessageQueue,
        offsets: Sequence[int],
        fn: Callable[[Any], _T],
        *,
        fence: int | None = None,
    ) -> _T:
        """Run ``fn(connection)`` in one transaction with the finished marks of the
        messages at ``offsets`` of ``mq``, and return what it returns.

        The transaction checks first that ``fence`` (the queue lock's epoch, ``None``
        outside a consumer group) is still the queue's: otherwise
        :class:`~offsetstore.StoreFencedError`, and nothing is done. A message that
        already has its mark raises :class:`~offsetstore.AlreadyFinishedError`
        (nothing is done either). When ``fn`` raises, nothing is committed and its
        exception propagates. Marks are read back by :meth:`claim` and
        :meth:`read_progress` as ``finished`` ranges, and deleted by the progress
        commits that pass them.

        Handlers call it through their context (``await context.transact(fn)``);
        the default implementation raises
        :class:`~offsetstore.StoreConfigurationError`.
        """
        raise StoreConfigurationError(f"{type(self).__name__} does not support transact()")

    def remove_offset(self, group: str, mq: MessageQueue) -> None:
        """Forget the in-memory progress of ``mq`` (its stored progress stays)."""
        self._table.pop((group, mq), None)

    remove_stage_offset = remove_offset
    """RIP-22's name: the stage offsets go with the consume offset, as one unit."""

    def clone_offset_table(self, group: str, topic: str) -> dict[MessageQueue, int]:
        """In-memory consume offsets of the queues of ``topic``."""
        return {
            mq: row.consume_offset
            for (g, mq), row in self._table.items()
            if g == group and mq.topic == topic and row.consume_offset is not None
        }

    def clone_stage_offset_table(
        self, group: str, topic: str
    ) -> dict[MessageQueue, Mapping[StageKey, int]]:
        """In-memory stage offsets of the queues of ``topic``."""
        return {
            mq: dict(row.stage_offsets)
            for (g, mq), row in self._table.items()
            if g == group and mq.topic == topic and row.stage_offsets
        }

    # -- operator actions ------------------------------------------------------------

    async def list_progress(
        self, group: str, topic: str | None = None
    ) -> dict[MessageQueue, QueueProgress]:
        """Every persisted progress of ``group`` (of one topic when given)."""
        await self._resolve_scope(group)
        return await self._list_stored(group, topic)

    async def reset_progress(
        self, group: str, progress: Mapping[MessageQueue, QueueProgress | None]
    ) -> None:
        """Overwrite (``None``: delete) stored progress, backwards too.

        For operators, on a group that is not running: a running consumer would
        overwrite the reset with its own progress.

        Every entry is checked before anything is written: keys must be
        :class:`MessageQueue`, values :class:`QueueProgress` (offsets ints >= 0, stage
        offsets keyed by :class:`StageKey`) or ``None``; a bad one raises
        ``TypeError`` or ``ValueError`` naming it, and nothing changes.
        """
        progress = dict(progress)
        for mq, value in progress.items():
            _check_reset_entry(mq, value)
        await self._resolve_scope(group)
        await self._overwrite_stored(group, progress)
        for mq, value in progress.items():
            if value is None:
                self.remove_offset(group, mq)
            else:
                self.update_progress(group, mq, value)


def _check_source(source: object) -> None:
    if not isinstance(source, str) or not source:
        raise StoreConfigurationError(f"a source must be a non-empty string, got {source!r}")
    if len(source) > SOURCE_MAX_LENGTH:
        raise StoreConfigurationError(
            f"a source must be at most {SOURCE_MAX_LENGTH} characters, got {len(source)}:"
            f" {source[:60]!r}..."
        )


SOURCE_MAX_LENGTH = 191
"""The longest source identity a store keeps (MariaDB/MySQL bound the length of the
SQL store's primary key); sources shorten longer identities with a hash."""


def _check_reset_entry(mq: object, value: object) -> None:
    """One entry of :meth:`StageOffsetStore.reset_progress`, checked in full (the
    offsets again too: an operator action, rare, and the last stop before the store)."""
    if not isinstance(mq, MessageQueue):
        raise TypeError(f"reset_progress(): keys must be MessageQueues, got {mq!r}")
    if value is None:
        return
    if not isinstance(value, QueueProgress):
        raise TypeError(
            f"reset_progress(): the progress of {mq} must be a QueueProgress or None, got {value!r}"
        )
    try:
        if value.consume_offset is not None:
            check_offset("consume offset", value.consume_offset)
        check_stage_offsets(value.stage_offsets)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"reset_progress(): {mq}: {exc}") from None
