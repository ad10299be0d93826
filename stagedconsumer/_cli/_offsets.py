"""``stagedconsumer offsets``: inspect and reset the stored progress of a consumer group.

``show`` prints every queue of a group (optionally of one topic) with its consume
offset and stage offsets. ``reset`` overwrites them, backwards too, for a group that
is not running (a running consumer would overwrite the reset with its own progress
at its next persist). Stage keys are written ``STRATEGY`` (no stage group) or
``STRATEGY/GROUP`` (``STRATEGY/`` is the empty group, distinct from none); the
default strategy is ``default``. A store made with
``SqlOffsetStore(url, table_prefix="x_")`` needs ``--table-prefix x_``.

Lag (messages in the queue beyond the consume offset) needs the queue's max offset
from the source: ``show --redis URL`` reads it from a :class:`RedisBroker` (and
exits 1, after printing the progress, when it cannot); without it there is no lag
column (the embedded broker lives inside the consumer's process).

Progress is kept per source (schema version 4): ``--source ID`` names it (a broker's
``source_id()``, e.g. ``redis://127.0.0.1:6379/0#sc``). Without it ``show`` shows
every source's rows (a Source column when there are several; with ``--redis URL``
only that broker's, ``redis://host:port/db#namespace``, and rows stored without a
source), and ``reset`` resets the group's only source (refused, naming them, when
there are several).

``reset --redis URL`` checks against the broker, before anything is written: that
the group has no live members (a running group is refused, naming them, unless
``--force``), that ``--queue`` ids are queues of the topic, and that ``--to-offset``
lies in every reset queue's [min offset, max offset]. Without a broker none of this
can be checked: the command says so for queue ids, and takes the group as stopped
and the offset as given.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from offsetstore import (
    OffsetStoreError,
    QueueProgress,
    StageKey,
    StageOffsetStore,
    StoreConfigurationError,
)
from offsetstore._inspect import StoredRow

from .._exceptions import StagedConsumerError
from .._message import MessageQueue
from .._sources._redis_url import redact_url, redis_source_id
from ._redis_args import add_redis_arguments, operator_broker

if TYPE_CHECKING:
    from offsetstore import SqlOffsetStore

__all__ = ("format_stage_key", "parse_stage_key", "register")


def parse_stage_key(text: str) -> StageKey:
    """Parse ``STRATEGY[/GROUP]``.

    ``"s"`` is ``StageKey("s", None)``, ``"s/g"`` is ``StageKey("s", "g")`` and ``"s/"``
    is ``StageKey("s", "")``: the inverse of :func:`format_stage_key`.
    """
    strategy, sep, group = text.partition("/")
    if not strategy:
        raise ValueError(f"stage key {text!r} has no strategy id (use STRATEGY or STRATEGY/GROUP)")
    return StageKey(strategy, group if sep else None)


def format_stage_key(key: StageKey) -> str:
    return key.strategy_id if key.group_id is None else f"{key.strategy_id}/{key.group_id}"


def _stage_assignment(text: str) -> tuple[StageKey, int]:
    key_text, sep, value = text.rpartition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=N, got {text!r}")
    try:
        key = parse_stage_key(key_text)
        offset = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if offset < 0:
        raise argparse.ArgumentTypeError(f"stage offset must be >= 0, got {offset}")
    return key, offset


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _format_stages(offsets: Mapping[StageKey, int]) -> str:
    if not offsets:
        return "-"
    items = sorted(offsets.items(), key=lambda kv: (kv[0].strategy_id, kv[0].group_id or ""))
    return ", ".join(f"{format_stage_key(k)}={v}" for k, v in items)


def _format_finished(finished: Sequence[tuple[int, int]]) -> str:
    """The finished ranges above the consume offset (sparse progress and the marks of
    exactly-once effects), ``"-"`` when none: ``12-15, 18 (5 messages)``."""
    if not finished:
        return "-"
    ranges = ", ".join(
        str(first) if first == last else f"{first}-{last}" for first, last in finished
    )
    count = sum(last - first + 1 for first, last in finished)
    return f"{ranges} ({count} messages)"


def _store(args: argparse.Namespace, *, read_only: bool = False) -> SqlOffsetStore:
    # Imported here: SQLAlchemy is needed by these commands only, not by the others.
    from offsetstore import SqlOffsetStore

    # Never create tables from an operator command: a mistyped URL should fail.
    return SqlOffsetStore(
        args.store,
        table_prefix=args.table_prefix,
        create_tables=False,
        read_only=read_only,
        source=_source_arg(args),
    )


def _source_arg(args: argparse.Namespace) -> str | None:
    """``--source``, else ``None`` (show: every source; reset: the group's only one)."""
    return str(args.source) if args.source else None


def _kafka_store(url: str) -> StageOffsetStore:
    """``--store kafka://host:port[,host:port]``: a Kafka group's offset commits."""
    from .._sources._kafka_broker import KafkaBroker
    from .._sources._kafka_group import KafkaOffsetStore

    servers = url.removeprefix("kafka://").strip("/").split(",")
    return KafkaOffsetStore(KafkaBroker(servers), own_broker=True)


def _open_store(args: argparse.Namespace, *, read_only: bool = False) -> StageOffsetStore:
    """The store of ``--store``: a Kafka group's commits (``kafka://``) or SQL."""
    if args.store.startswith("kafka://"):
        return _kafka_store(args.store)
    return _store(args, read_only=read_only)


async def _check_on_kafka(
    store: StageOffsetStore, args: argparse.Namespace, plan: Mapping[MessageQueue, QueueProgress]
) -> str | None:
    """Check a reset of a Kafka group's commits against its cluster: the partitions
    exist, ``--to-offset`` is within each one's [min offset, max offset]. (Whether the
    group runs is Kafka's to check: it refuses commits from outside a group that has
    members.)"""
    broker: Any = getattr(store, "broker", None)
    if broker is None:
        return None
    try:
        count = len(await broker.get_queues(args.topic))
        bad = sorted(mq.queue_id for mq in plan if mq.queue_id >= count)
        if bad:
            return (
                f"topic {args.topic!r} has {count} partition(s), 0 to {count - 1}:"
                f" no partition {', '.join(map(str, bad))}"
            )
        if args.to_offset is None:
            return None
        outside = []
        for mq in plan:
            low, high = await broker.min_offset(mq), await broker.max_offset(mq)
            if not low <= args.to_offset <= high:
                outside.append(f"{mq} [{low}, {high}]")
    except StagedConsumerError as exc:
        return f"cannot check the partitions of topic {args.topic!r} on Kafka: {exc}"
    if outside:
        return (
            f"--to-offset {args.to_offset} is outside the offsets of {', '.join(outside)};"
            " nothing changed"
        )
    return None


async def _load(store: StageOffsetStore) -> None:
    """``store.load()``; a store without the tables is told about ``--table-prefix``."""
    try:
        await store.load()
    except StoreConfigurationError as exc:
        if not str(exc).startswith("no offset store tables"):
            raise
        raise StoreConfigurationError(
            f"{exc}: a store made with SqlOffsetStore(table_prefix=...) has other table"
            f" names, give its prefix with --table-prefix (this looked for"
            f" {getattr(store, 'table_prefix', '')!r})"
        ) from exc


def _console(*, stderr: bool = False) -> Console:
    """A console that leaves ``:name:`` emoji codes alone: group, topic and stage key
    names, URLs and the error messages quoting them are shown verbatim (their
    ``[...]`` is escaped where they are printed, so rich reads no markup in them)."""
    return Console(stderr=stderr, emoji=False)


def _fail(console: Console, message: str) -> int:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return 1


# -- show ------------------------------------------------------------------------------------


def _row_json(row: StoredRow, lag: int | None, with_lag: bool) -> dict[str, Any]:
    stages = row.stage_offsets
    entry: dict[str, Any] = {
        "source": row.source,
        "topic": row.queue.topic,
        "queue_id": row.queue.queue_id,
        "consume_offset": row.consume_offset
        if row.consume_offset_readable
        else row.raw_consume_offset,
        "stage_offsets": None
        if stages is None
        else [
            {"strategy_id": k.strategy_id, "group_id": k.group_id, "stage_offset": v}
            for k, v in sorted(
                stages.items(), key=lambda kv: (kv[0].strategy_id, kv[0].group_id or "")
            )
        ],
        "fence": row.fence,
        "finished": [list(pair) for pair in row.finished],
    }
    if stages is None:
        entry["raw_stage_offsets"] = row.raw_stage_offsets
    entry["corrupt"] = list(row.problems)
    if with_lag:
        entry["lag"] = lag
    return entry


def _repair_command(args: argparse.Namespace, url: str, row: StoredRow) -> str:
    """The ``offsets reset`` command that repairs ``row``."""
    words = ["stagedconsumer", "offsets", "reset", "--store", url]
    if args.table_prefix != "stagedconsumer_":
        words += ["--table-prefix", args.table_prefix]
    if row.source:
        words += ["--source", row.source]
    words += ["--group", args.group, "--topic", row.queue.topic, "--queue", str(row.queue.queue_id)]
    if row.stage_offsets is None and len(row.problems) == 1:
        words.append("--clear-stage-offsets")  # only the stage offsets: no --force needed
    else:
        if not row.consume_offset_readable:
            words += ["--to-offset", "N"]
        words.append("--force")
    return shlex.join(words)


def _corrupt_note(args: argparse.Namespace, url: str, rows: list[StoredRow]) -> str:
    bad = [row for row in rows if row.corrupt]
    lines = [
        f"{len(bad)} corrupt progress row(s): no consumer can claim such a queue. With the"
        " group stopped, repair each with the command after it (N: the new consume"
        " offset; add --redis URL to check the group is stopped; --dry-run shows the plan):"
    ]
    for row in bad:
        lines.append(f"  {row.queue}: {'; '.join(row.problems)}")
        lines.append(f"    {_repair_command(args, url, row)}")
    return "\n".join(lines)


def _store_url(store: StageOffsetStore, args: argparse.Namespace) -> str:
    """The store's URL as shown (its password masked), else the one given."""
    return str(getattr(store, "url", args.store))


async def _stored_rows(store: StageOffsetStore, group: str, topic: str | None) -> list[StoredRow]:
    """Every stored row of the group: an SQL store's as stored, corrupt ones marked;
    another store's (Kafka's commits) from its progress, which it keeps sound."""
    inspect = getattr(store, "inspect_progress", None)
    if inspect is not None:
        rows: list[StoredRow] = await inspect(group, topic, every_source=store.source is None)
        return rows
    progress = await store.list_progress(group, topic)
    return [
        StoredRow(
            queue=mq,
            consume_offset=p.consume_offset,
            consume_offset_readable=True,
            stage_offsets=dict(p.stage_offsets),
            raw_consume_offset=p.consume_offset,
            raw_stage_offsets="",
            fence=0,
            problems=(),
            finished=p.finished,
        )
        for mq, p in sorted(progress.items(), key=lambda item: (item[0].topic, item[0].queue_id))
    ]


async def _show(args: argparse.Namespace) -> int:
    err = _console(stderr=True)
    try:
        store = _open_store(args, read_only=True)  # SQL: works on a read-only replica too
    except OffsetStoreError as exc:
        return _fail(err, str(exc))
    try:
        await _load(store)
        rows = await _stored_rows(store, args.group, args.topic)
    except OffsetStoreError as exc:
        return _fail(err, str(exc))
    finally:
        await store.aclose()
    if args.redis and not args.source:  # that broker's rows (and those without a source)
        broker_source = redis_source_id(
            args.redis, args.redis_namespace, cluster=args.redis_cluster
        )
        rows = [row for row in rows if row.source in ("", broker_source)]
    corrupt = any(row.corrupt for row in rows)
    lags: dict[MessageQueue, int] | None = None
    lag_error: str | None = None
    if args.redis and rows:
        lags, lag_error = await _lags(args, rows)
        if lag_error is not None:
            err.print(f"[bold yellow]warning:[/] no lag: {escape(lag_error)}", highlight=False)
    status = 0 if lag_error is None and not corrupt else 1
    if args.json:
        queues = [
            _row_json(row, None if lags is None else lags.get(row.queue), lags is not None)
            for row in rows
        ]
        sys.stdout.write(json.dumps({"group": args.group, "queues": queues}, indent=2) + "\n")
        if corrupt:
            err.print(
                "[bold red]corrupt:[/] "
                + escape(_corrupt_note(args, _store_url(store, args), rows)),
                highlight=False,
            )
        return status
    console = _console()
    where = f"group [bold]{escape(args.group)}[/]"
    if args.topic:
        where += f", topic [bold]{escape(args.topic)}[/]"
    if not rows:
        url = _store_url(store, args)
        console.print(f"No stored progress for {where} in {escape(url)}.", highlight=False)
        return 0
    sources = sorted({row.source for row in rows})
    several = len(sources) > 1
    if not several:
        where += f", source [bold]{escape(sources[0] or '(none)')}[/]"
    table = Table(title=f"Progress of {where}", title_justify="left")
    if several:
        table.add_column("Source")
    table.add_column("Queue")
    table.add_column("Consume offset", justify="right")
    table.add_column("Stage offsets")
    table.add_column("Fence", justify="right")
    table.add_column("Finished above")
    if lags is not None:
        table.add_column("Lag", justify="right")
    if corrupt:
        table.add_column("Corrupt")
    for row in rows:
        table.add_row(*_row_cells(row, lags, corrupt, source_column=several))
    console.print(table)
    if corrupt:
        err.print(
            "[bold red]corrupt:[/] " + escape(_corrupt_note(args, _store_url(store, args), rows)),
            highlight=False,
        )
    return status


def _row_cells(
    row: StoredRow,
    lags: Mapping[MessageQueue, int] | None,
    corrupt_column: bool,
    *,
    source_column: bool = False,
) -> list[str]:
    if not row.consume_offset_readable:
        offset = f"[red]{escape(str(row.raw_consume_offset))}[/]"
    else:
        offset = "-" if row.consume_offset is None else str(row.consume_offset)
    if row.stage_offsets is None:
        stages = f"[red]unreadable: {escape(row.raw_stage_offsets[:40])}[/]"
    else:
        stages = escape(_format_stages(row.stage_offsets))
    fence = f"[red]{row.fence}[/]" if row.fence_corrupt else str(row.fence)
    cells = [escape(str(row.queue)), offset, stages, fence, _format_finished(row.finished)]
    if source_column:
        cells.insert(0, escape(row.source) if row.source else "(none)")
    if lags is not None:
        cells.append(str(lags[row.queue]) if row.queue in lags else "?")
    if corrupt_column:
        cells.append(f"[red]{escape('; '.join(row.problems))}[/]" if row.corrupt else "")
    return cells


async def _lags(
    args: argparse.Namespace, rows: list[StoredRow]
) -> tuple[dict[MessageQueue, int], str | None]:
    """Max offset minus consume offset of every queue whose consume offset can be read,
    from a RedisBroker, and why some are missing (``None``: none is)."""
    lags: dict[MessageQueue, int] = {}
    try:
        async with operator_broker(args) as broker:
            for row in rows:
                if not row.consume_offset_readable:
                    continue
                max_offset = await broker.max_offset(row.queue)
                lags[row.queue] = max(max_offset - (row.consume_offset or 0), 0)
    except (ImportError, StagedConsumerError) as exc:
        return lags, f"{redact_url(args.redis)}: {exc}"
    return lags, None


def _note_unchecked_queues(args: argparse.Namespace, err: Console) -> None:
    """Without a broker ``--queue`` ids cannot be checked against the topic: say so."""
    if args.queue:
        err.print(
            "[bold yellow]note:[/] queue ids are not checked against the topic's queues"
            " (no broker given: add --redis URL to check them); a queue the topic does not"
            " have would get a row no consumer reads",
            highlight=False,
        )


async def _check_on_broker(
    args: argparse.Namespace, plan: Mapping[MessageQueue, QueueProgress], err: Console
) -> tuple[str | None, list[str]]:
    """Check the reset against the ``--redis`` broker; the error (or ``None``) and the
    group's live members.

    In this order: ``--queue`` ids against the topic's queues; the group's live
    members (refused unless ``--force``, then only warned about); ``--to-offset``
    against each planned queue's [min offset, max offset]."""
    where = redact_url(args.redis)
    what = f"the queues of topic {args.topic!r}"
    outside: list[str] = []
    members: list[str] = []
    try:
        async with operator_broker(args) as broker:
            if args.queue or args.to_offset is not None:
                count = await broker.queue_count(args.topic)
                bad = sorted(q for q in set(args.queue or ()) if q >= count)
                if bad:
                    return (
                        f"topic {args.topic!r} has {count} queue(s), 0 to {count - 1}:"
                        f" no queue {', '.join(map(str, bad))}"
                    ), members
            what = f"whether group {args.group!r} is running"
            members = list(await broker.group_coordinator().members(args.group))
            if members and not args.force:
                return (
                    f"group {args.group!r} is running: {len(members)} live member(s):"
                    f" {', '.join(members)}. A running member keeps consuming from its own"
                    " offsets and overwrites the reset at its next persist: stop the group"
                    " first, or pass --force to reset anyway"
                ), members
            if members:
                err.print(
                    f"[bold yellow]warning:[/] group {escape(repr(args.group))} has"
                    f" {len(members)} live member(s) ({escape(', '.join(members))}); resetting"
                    " anyway (--force): they overwrite the reset at their next persist",
                    highlight=False,
                )
            if args.to_offset is None:
                return None, members
            what = f"the offsets of the queues of topic {args.topic!r}"
            for mq in plan:
                low, high = await broker.min_offset(mq), await broker.max_offset(mq)
                if not low <= args.to_offset <= high:
                    outside.append(f"{mq} [{low}, {high}]")
    except (ImportError, StagedConsumerError) as exc:
        return f"cannot check {what} on {where}: {exc}", members
    if outside:
        return (
            f"--to-offset {args.to_offset} is outside the offsets of {', '.join(outside)}"
            " (from the min offset, the oldest message still stored, to the max offset,"
            " where the next message goes); nothing changed"
        ), members
    return None, members


# -- reset -----------------------------------------------------------------------------------


class _PlanError(Exception):
    pass


def _planned(
    args: argparse.Namespace, stored: Mapping[MessageQueue, StoredRow]
) -> tuple[dict[MessageQueue, QueueProgress], dict[MessageQueue, int]]:
    """The new progress of every queue of the reset, and the new fence of each queue
    whose stored fence blocks it; raises :class:`_PlanError` for a corrupt row the
    options do not repair."""
    if args.queue:
        targets = sorted({MessageQueue(args.topic, q) for q in args.queue})
    elif args.to_offset is None and not args.stage_offset and not args.clear_stage_offsets:
        targets = sorted(mq for mq, row in stored.items() if row.corrupt)  # --force alone
    else:
        targets = sorted(stored)
    plan: dict[MessageQueue, QueueProgress] = {}
    fences: dict[MessageQueue, int] = {}
    refused: list[str] = []
    for mq in targets:
        row = stored.get(mq)
        if row is None:
            consume: int | None = None
            stages: dict[StageKey, int] = {}
        else:
            only_stages = row.stage_offsets is None and len(row.problems) == 1
            repaired_anyway = only_stages and args.clear_stage_offsets
            if row.corrupt and not args.force and not repaired_anyway:
                refused.append(f"{mq} ({'; '.join(row.problems)})")
                continue
            if not row.consume_offset_readable and args.to_offset is None:
                raise _PlanError(
                    f"the consume offset of {mq} cannot be read ({row.raw_consume_offset}):"
                    " give the new one with --to-offset N"
                )
            consume = row.consume_offset
            stages = (
                {}
                if _drops_stage_offsets(args) or row.stage_offsets is None
                else dict(row.stage_offsets)
            )
            if row.fence_corrupt:
                fences[mq] = 0
        if args.to_offset is not None:
            consume = args.to_offset
        for key, value in args.stage_offset or ():
            stages[key] = value
        # The messages that finished above an unchanged consume offset stay finished.
        keep = row is not None and row.consume_offset_readable and consume == row.consume_offset
        plan[mq] = QueueProgress(
            consume_offset=consume,
            stage_offsets=stages,
            finished=row.finished if keep and row is not None else (),
        )
    if refused:
        raise _PlanError(
            f"corrupt progress row(s): {', '.join(refused)}. Pass --force to repair them"
            " (unreadable stage offsets are dropped, an unreadable consume offset needs"
            " --to-offset, a blocking fence is set back to 0); nothing changed"
        )
    return plan, fences


def _drops_stage_offsets(args: argparse.Namespace) -> bool:
    """Whether the stored stage offsets go: with --clear-stage-offsets, and with
    --to-offset unless --keep-stage-offsets (as ``PushConsumer.seek()``: a stage offset
    is the stage counter *at* the consume offset, so moving the one without the other
    would give messages other stages than they had)."""
    if args.clear_stage_offsets:
        return True
    return args.to_offset is not None and not args.keep_stage_offsets


def _stage_plan_note(args: argparse.Namespace) -> str:
    """What the confirmation says the stage offsets become."""
    given = " the --stage-offset ones are set;" if args.stage_offset else ""
    if _drops_stage_offsets(args):
        why = (
            "--clear-stage-offsets"
            if args.clear_stage_offsets
            else "--to-offset moves the consume offset, as seek() does; --keep-stage-offsets"
            " keeps them"
        )
        return (
            f"Stage offsets:{given} every other stored one is dropped, so its stage key"
            f" starts over at its first stage from the consume offset ({why})."
        )
    return f"Stage offsets:{given} the other stored ones are kept."


def _unknown_stage_keys(
    args: argparse.Namespace, rows: list[StoredRow]
) -> tuple[str | None, str | None]:
    """An error for ``--stage-offset`` keys whose strategy no stored row of the group
    has (a typo: the listener never reads them), or a note that they cannot be
    checked (no stored stage offsets)."""
    if not args.stage_offset or args.new_stage_key:
        return None, None
    known = {key.strategy_id for row in rows for key in (row.stage_offsets or {})}
    if not known:
        return None, (
            "stage keys are not checked: group has no stored stage offsets to compare with"
        )
    unknown = sorted({key.strategy_id for key, _ in args.stage_offset} - known)
    if not unknown:
        return None, None
    return (
        f"--stage-offset names strategy {', '.join(map(repr, unknown))}, which no stored"
        f" progress of group {args.group!r} has (it has {', '.join(map(repr, sorted(known)))}):"
        " a stage key the listener does not have is never read. Check the name, or pass"
        " --new-stage-key if the listener has that strategy; nothing changed"
    ), None


def _fence_risk(args: argparse.Namespace, members: list[str] | None) -> str | None:
    """Why the fences of the plan may not be lowered, or ``None``."""
    if args.allow_stale_writes:
        return None
    if members is None:
        return (
            "a blocking fence is lowered only when the group is known to be stopped: give"
            " --redis URL to check that it has no live member, or pass --allow-stale-writes"
            " (a member that held the queue can then write its older progress over the"
            " repair, until a member claims the queue again); nothing changed"
        )
    if members:
        return (
            f"group {args.group!r} has live member(s) ({', '.join(members)}): lowering a"
            " fence lets a member that held the queue write its older progress over the"
            " repair; stop the group, or pass --allow-stale-writes; nothing changed"
        )
    return None


async def _reset(args: argparse.Namespace) -> int:
    err = _console(stderr=True)
    changes = args.to_offset is not None or args.stage_offset or args.clear_stage_offsets
    if not changes and not args.force:  # --force alone repairs the corrupt rows
        return _fail(
            err,
            "nothing to reset: give --to-offset, --stage-offset or --clear-stage-offsets"
            " (or --force to repair corrupt rows)",
        )
    try:
        store = _open_store(args)
    except OffsetStoreError as exc:
        return _fail(err, str(exc))
    kafka = args.store.startswith("kafka://")
    try:
        await _load(store)
        list_sources = getattr(store, "list_sources", None)  # SQL: progress per source
        if list_sources is not None and store.source is None:
            sources = [source for source in await list_sources(args.group) if source]
            if len(sources) > 1:
                return _fail(
                    err,
                    f"group {args.group!r} has stored progress of {len(sources)} sources"
                    f" ({', '.join(sources)}): say which with --source ID (or --redis URL)",
                )
            if sources:
                store.bind_source(sources[0])
        stored = {row.queue: row for row in await _stored_rows(store, args.group, args.topic)}
        if args.stage_offset and not args.new_stage_key:
            # Kafka: the topic's commits (Tansu cannot list a group's every partition)
            every = await _stored_rows(store, args.group, args.topic if kafka else None)
            problem, note = _unknown_stage_keys(args, every)
            if problem is not None:
                return _fail(err, problem)
            if note is not None:
                err.print(f"[bold yellow]note:[/] {escape(note)}", highlight=False)
        try:
            plan, fences = _planned(args, stored)
        except _PlanError as exc:
            return _fail(err, str(exc))
        if not plan:
            return _fail(
                err,
                f"no stored progress for group {args.group!r}, topic {args.topic!r}:"
                " name the queues with --queue",
            )
        members: list[str] | None = None
        if kafka:
            if (problem := await _check_on_kafka(store, args, plan)) is not None:
                return _fail(err, problem)
        elif args.redis:
            problem, members = await _check_on_broker(args, plan, err)
            if problem is not None:
                return _fail(err, problem)
        else:
            _note_unchecked_queues(args, err)
        if fences and (risk := _fence_risk(args, members)) is not None:
            return _fail(err, risk)
        console = _console()
        console.print(
            f"Source: {escape(store.source or '(none: progress stored without a source)')}",
            highlight=False,
        )
        console.print(_plan_table(args, plan, fences, stored))
        console.print(escape(_stage_plan_note(args)), highlight=False)
        if args.dry_run:
            console.print("Dry run: nothing changed.")
            return 0
        if not args.yes:
            if not sys.stdin.isatty():
                return _fail(
                    err,
                    "no answer to the confirmation (stdin is not a terminal); nothing"
                    " changed. Pass --yes (-y) to reset without asking.",
                )
            question = (
                f"Reset the progress of {len(plan)} queue(s) of group {args.group!r}?"
                " The group must not be running. [y/N] "
            )
            try:
                answer = await anyio.to_thread.run_sync(input, question)
            except EOFError:
                console.print()
                return _fail(
                    err,
                    "no answer to the confirmation (stdin was closed); nothing changed."
                    " Pass --yes (-y) to reset without asking.",
                )
            if answer.strip().lower() not in ("y", "yes"):
                console.print("Aborted; nothing changed (--yes resets without asking).")
                return 1
        repair = getattr(store, "repair_progress", None)  # SQL: rows, fences
        if repair is None:  # Kafka: standalone commits, refused while the group has members
            await store.reset_progress(args.group, plan)
        else:
            await repair(args.group, plan, fences)
        repaired = sum(1 for mq in plan if mq in stored and stored[mq].corrupt)
        done = f"Reset {len(plan)} queue(s)."
        if repaired:
            done += f" Repaired {repaired} corrupt row(s)."
        console.print(done)
        return 0
    except OffsetStoreError as exc:
        return _fail(err, str(exc))
    finally:
        await store.aclose()


def _plan_table(
    args: argparse.Namespace,
    plan: Mapping[MessageQueue, QueueProgress],
    fences: Mapping[MessageQueue, int],
    stored: Mapping[MessageQueue, StoredRow],
) -> Table:
    table = Table(
        title=f"Reset of group [bold]{escape(args.group)}[/], topic [bold]{escape(args.topic)}[/]",
        title_justify="left",
    )
    table.add_column("Queue")
    table.add_column("Consume offset", justify="right")
    table.add_column("")
    table.add_column("New", justify="right")
    table.add_column("Stage offsets")
    table.add_column("")
    table.add_column("New")
    if fences:
        table.add_column("Fence", justify="right")
        table.add_column("")
        table.add_column("New", justify="right")
    for mq, new in plan.items():
        old = stored.get(mq)
        if old is None:
            old_consume, old_stages = "-", "-"
        else:
            if not old.consume_offset_readable:
                old_consume = f"corrupt: {old.raw_consume_offset}"
            else:
                old_consume = "-" if old.consume_offset is None else str(old.consume_offset)
            old_stages = (
                "unreadable"
                if old.stage_offsets is None
                else escape(_format_stages(old.stage_offsets))
            )
        cells = [
            escape(str(mq)),
            escape(old_consume),
            "->",
            "-" if new.consume_offset is None else str(new.consume_offset),
            old_stages,
            "->",
            escape(_format_stages(new.stage_offsets)),
        ]
        if fences:
            if mq in fences and old is not None:
                cells += [str(old.fence), "->", str(fences[mq])]
            else:
                cells += ["", "", ""]
        table.add_row(*cells)
    return table


# -- init ------------------------------------------------------------------------------------


_GRANTS = """\
-- The running consumer needs only these privileges (ROLE: its database user; for
-- MariaDB/MySQL 'user'@'host'; --grant-to ROLE writes them as statements). offsets
-- show needs SELECT on both tables, offsets reset the same as the consumer. Creating
-- and migrating the tables (offsets init, or a consumer's first start) needs CREATE
-- and ALTER, which the consumer never uses once the tables exist at this version.
{comment}GRANT SELECT ON {schema} TO {role};
{comment}GRANT SELECT, INSERT, UPDATE ON {progress} TO {role};
{comment}GRANT SELECT, INSERT, DELETE ON {marks} TO {role};
"""


async def _init(args: argparse.Namespace) -> int:
    from offsetstore._sql import SqlOffsetStore, migration_sql, schema_sql

    err = _console(stderr=True)
    if args.sql:
        dialect = args.dialect
        if dialect is None:
            if not args.store:
                return _fail(err, "--sql needs --dialect or --store URL (whose dialect it takes)")
            try:
                import sqlalchemy as sa

                dialect = sa.make_url(args.store).get_backend_name()
            except Exception as exc:  # any malformed URL
                return _fail(err, f"malformed offset store URL: {exc}")
        try:
            if args.from_version is not None:
                text = migration_sql(dialect, args.table_prefix, args.from_version)
            else:
                text = schema_sql(dialect, args.table_prefix)
        except OffsetStoreError as exc:
            return _fail(err, str(exc))
        prefix = args.table_prefix
        if args.from_version is not None:
            sys.stdout.write(
                f"-- stagedconsumer offset store: migration from schema version"
                f" {args.from_version} ({dialect}). Rows get source '' (none), adopted by"
                " the first consumer of their group that starts (it logs it); the grants"
                " do not change.\n"
                f"{text}"
            )
            return 0
        sys.stdout.write(f"-- stagedconsumer offset store tables ({dialect})\n{text}")
        if dialect == "sqlite":
            sys.stdout.write(
                "-- SQLite has no grants: the consumer needs to write the database file and"
                " its directory (WAL journal).\n"
            )
        else:
            sys.stdout.write(
                _GRANTS.format(
                    schema=f"{prefix}schema",
                    progress=f"{prefix}progress",
                    marks=f"{prefix}marks",
                    role=args.grant_to or "ROLE",
                    comment="" if args.grant_to else "-- ",
                )
            )
        return 0
    if not args.store:
        return _fail(err, "give --store URL (or --sql to print the SQL instead)")
    console = _console()
    try:
        store = SqlOffsetStore(args.store, table_prefix=args.table_prefix)
    except OffsetStoreError as exc:
        return _fail(err, str(exc))
    try:
        done = await store.init_schema()
    except OffsetStoreError as exc:
        return _fail(err, str(exc))
    finally:
        await store.aclose()
    for line in done:
        console.print(f"{escape(store.url)}: {escape(line)}", highlight=False)
    return 0


# -- registration ------------------------------------------------------------------------------


def _run(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        return int(anyio.run(handler, args))

    return run


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "offsets",
        help="show, reset or repair the stored progress (consume and stage offsets) of a group;"
        " create the offset store's tables (init)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="offsets_command", metavar="ACTION", title="actions")

    def no_action(args: argparse.Namespace) -> int:
        parser.print_help()  # no action: the help, with the actions, as a usage error
        return 2

    parser.set_defaults(handler=no_action)

    def common(sub: argparse.ArgumentParser, *, topic_required: bool) -> None:
        sub.add_argument(
            "--store",
            required=True,
            metavar="URL",
            help="offset store URL, e.g. sqlite:///progress.db or postgresql+psycopg://user@host/db"
            " (show, reset: also kafka://host:port, a Kafka group's offset commits)",
        )
        sub.add_argument(
            "--table-prefix",
            default="stagedconsumer_",
            metavar="PREFIX",
            help="the store's table_prefix, as given to SqlOffsetStore (default stagedconsumer_)",
        )
        sub.add_argument("--group", required=True, help="consumer group")
        sub.add_argument("--topic", required=topic_required, help="topic")
        sub.add_argument(
            "--source",
            metavar="ID",
            help="the source whose progress (a broker's source_id(), e.g."
            " redis://127.0.0.1:6379/0#sc); default: show: every source (with --redis:"
            " that broker's, redis://host:port/db#namespace, and rows without a source),"
            " reset: the group's only one",
        )

    init = commands.add_parser(
        "init",
        help="create or migrate the offset store's tables, or print their SQL (--sql)",
        description="Create the offset store's tables when missing and migrate them to"
        " this version's schema (what a consumer's first start does), printing each step;"
        " a database user with only SELECT, INSERT and UPDATE can then run the consumers."
        " --sql prints the SQL instead (for a DBA), with the grants the consumer needs.",
    )
    init.add_argument(
        "--store",
        metavar="URL",
        help="offset store URL, e.g. sqlite:///progress.db or postgresql+psycopg://user@host/db",
    )
    init.add_argument(
        "--table-prefix",
        default="stagedconsumer_",
        metavar="PREFIX",
        help="the store's table_prefix, as given to SqlOffsetStore (default stagedconsumer_)",
    )
    init.add_argument(
        "--sql",
        action="store_true",
        help="print the CREATE TABLE statements and the grants instead of running anything",
    )
    init.add_argument(
        "--dialect",
        choices=("postgresql", "mysql", "mariadb", "sqlite"),
        help="the SQL dialect of --sql (default: the --store URL's)",
    )
    init.add_argument(
        "--from-version",
        type=int,
        metavar="N",
        help="with --sql: print the statements that migrate tables of schema version N"
        " (3) to this version's instead of the CREATE TABLE statements",
    )
    init.add_argument(
        "--grant-to",
        metavar="ROLE",
        help="with --sql: write the grants the consumer needs as GRANT statements to ROLE"
        " (default: as comments)",
    )
    init.set_defaults(handler=_run(_init))

    show = commands.add_parser("show", help="print the progress of every queue of a group")
    common(show, topic_required=False)
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_redis_arguments(
        show,
        url_help="RedisBroker holding the queues: adds a lag column (exit 1 if unreachable)",
    )
    show.set_defaults(handler=_run(_show))

    reset = commands.add_parser(
        "reset",
        help="overwrite consume and/or stage offsets of a stopped group",
        description="Overwrite consume and/or stage offsets of a group that is not running."
        " Without --queue, every queue of the topic with stored progress is reset."
        " Prints the planned change and asks for confirmation (y/N) on the terminal; --yes"
        " skips the question and is needed when stdin is not a terminal (scripts, pipes:"
        " a piped answer does not confirm); --dry-run only prints the plan."
        " A corrupt row (see 'offsets show') is refused unless --force, which repairs it."
        " With --redis URL the reset is checked against the broker first: a group with"
        " live members is refused (unless --force), and so are queue ids the topic does"
        " not have and a --to-offset outside a queue's [min offset, max offset]. Without"
        " --redis none of this is checked: whether the group is running is up to you.",
    )
    common(reset, topic_required=True)
    reset.add_argument(
        "--queue", type=_non_negative, action="append", metavar="N", help="queue id (repeatable)"
    )
    reset.add_argument(
        "--to-offset",
        type=_non_negative,
        metavar="N",
        help="new consume offset (with --redis: refused outside each queue's"
        " [min offset, max offset])",
    )
    reset.add_argument(
        "--stage-offset",
        type=_stage_assignment,
        action="append",
        metavar="KEY=N",
        help="new stage offset of a stage key (STRATEGY or STRATEGY/GROUP; repeatable)",
    )
    reset.add_argument(
        "--keep-stage-offsets",
        action="store_true",
        help="with --to-offset: keep the stored stage offsets (by default they are dropped,"
        " as PushConsumer.seek() does, so every stage key starts over at its first stage"
        " from the new offset)",
    )
    reset.add_argument(
        "--new-stage-key",
        action="store_true",
        help="allow --stage-offset keys whose strategy no stored progress of the group has"
        " (refused by default: most often a typo the listener never reads)",
    )
    reset.add_argument(
        "--clear-stage-offsets",
        action="store_true",
        help="drop every stage offset first (stage keys restart at 0); also repairs a row"
        " whose stored stage offsets cannot be read (a 'corrupt progress row')",
    )
    add_redis_arguments(
        reset,
        url_help="RedisBroker holding the topic: the group must have no live members, --queue"
        " ids and --to-offset are checked against its queues",
    )
    reset.add_argument(
        "--force",
        action="store_true",
        help="reset even though the group has live members on the --redis broker (they"
        " overwrite the reset at their next persist; without --redis the group is not"
        " checked at all); and repair corrupt rows: unreadable stage offsets are dropped,"
        " an unreadable consume offset is replaced by --to-offset, a fence that blocks"
        " the queue is set back to 0 (only when --redis shows no live member, or with"
        " --allow-stale-writes)",
    )
    reset.add_argument(
        "--allow-stale-writes",
        action="store_true",
        help="lower a blocking fence without knowing the group is stopped (no --redis, or"
        " live members): a member that held the queue can then write its older progress"
        " over the repair, until a member claims the queue again",
    )
    reset.add_argument(
        "--dry-run",
        action="store_true",
        help="print the planned change (after every check) and change nothing",
    )
    reset.add_argument(
        "-y",
        "--yes",
        action="store_true",
        help="reset without asking for confirmation; needed when stdin is not a terminal"
        " (scripts, pipes: a piped 'y' does not confirm)",
    )
    reset.set_defaults(handler=_run(_reset))
