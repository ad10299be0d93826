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
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from offsetstore import OffsetStoreError, QueueProgress, StageKey, StoreConfigurationError

from .._exceptions import StagedConsumerError
from .._message import MessageQueue
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


def _format_finished(progress: QueueProgress) -> str:
    """The finished ranges above the consume offset (sparse progress and the marks of
    exactly-once effects), ``"-"`` when none: ``12-15, 18 (5 messages)``."""
    if not progress.finished:
        return "-"
    ranges = ", ".join(
        str(first) if first == last else f"{first}-{last}" for first, last in progress.finished
    )
    return f"{ranges} ({progress.finished_count} messages)"


def _progress_json(mq: MessageQueue, progress: QueueProgress | None) -> dict[str, Any]:
    return {
        "topic": mq.topic,
        "queue_id": mq.queue_id,
        "consume_offset": progress.consume_offset if progress else None,
        "stage_offsets": [
            {"strategy_id": k.strategy_id, "group_id": k.group_id, "stage_offset": v}
            for k, v in sorted(
                (progress.stage_offsets if progress else {}).items(),
                key=lambda kv: (kv[0].strategy_id, kv[0].group_id or ""),
            )
        ],
        "finished": [list(pair) for pair in progress.finished] if progress else [],
    }


def _store(args: argparse.Namespace, *, read_only: bool = False) -> SqlOffsetStore:
    # Imported here: SQLAlchemy is needed by these commands only, not by the others.
    from offsetstore import SqlOffsetStore

    # Never create tables from an operator command: a mistyped URL should fail.
    return SqlOffsetStore(
        args.store, table_prefix=args.table_prefix, create_tables=False, read_only=read_only
    )


async def _load(store: SqlOffsetStore) -> None:
    """``store.load()``; a store without the tables is told about ``--table-prefix``."""
    try:
        await store.load()
    except StoreConfigurationError as exc:
        if not str(exc).startswith("no offset store tables"):
            raise
        raise StoreConfigurationError(
            f"{exc}: a store made with SqlOffsetStore(table_prefix=...) has other table"
            f" names, give its prefix with --table-prefix (this looked for"
            f" {store.table_prefix!r})"
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


async def _show(args: argparse.Namespace) -> int:
    err = _console(stderr=True)
    try:
        store = _store(args, read_only=True)  # works on a read-only replica too
    except OffsetStoreError as exc:
        return _fail(err, str(exc))
    try:
        await _load(store)
        progress = await store.list_progress(args.group, args.topic)
    except OffsetStoreError as exc:
        return _fail(err, str(exc))
    finally:
        await store.aclose()
    lags: dict[MessageQueue, int] | None = None
    lag_error: str | None = None
    if args.redis and progress:
        lags, lag_error = await _lags(args, progress)
        if lag_error is not None:
            err.print(f"[bold yellow]warning:[/] no lag: {escape(lag_error)}", highlight=False)
    if args.json:
        queues = [_progress_json(mq, p) for mq, p in progress.items()]
        if lags is not None:
            for entry, mq in zip(queues, progress, strict=True):
                entry["lag"] = lags.get(mq)
        sys.stdout.write(json.dumps({"group": args.group, "queues": queues}, indent=2) + "\n")
        return 0 if lag_error is None else 1
    console = _console()
    where = f"group [bold]{escape(args.group)}[/]"
    if args.topic:
        where += f", topic [bold]{escape(args.topic)}[/]"
    if not progress:
        console.print(f"No stored progress for {where} in {escape(store.url)}.", highlight=False)
        return 0
    table = Table(title=f"Progress of {where}", title_justify="left")
    table.add_column("Queue")
    table.add_column("Consume offset", justify="right")
    table.add_column("Stage offsets")
    table.add_column("Finished above")
    if lags is not None:
        table.add_column("Lag", justify="right")
    for mq, value in progress.items():
        offset = "-" if value.consume_offset is None else str(value.consume_offset)
        row = [
            escape(str(mq)),
            offset,
            escape(_format_stages(value.stage_offsets)),
            _format_finished(value),
        ]
        if lags is not None:
            row.append(str(lags[mq]) if mq in lags else "?")
        table.add_row(*row)
    console.print(table)
    return 0 if lag_error is None else 1


async def _lags(
    args: argparse.Namespace, progress: Mapping[MessageQueue, QueueProgress]
) -> tuple[dict[MessageQueue, int], str | None]:
    """Max offset minus consume offset of every queue, from a RedisBroker, and why
    some are missing (``None``: none is)."""
    lags: dict[MessageQueue, int] = {}
    try:
        async with operator_broker(args) as broker:
            for mq, value in progress.items():
                max_offset = await broker.max_offset(mq)
                lags[mq] = max(max_offset - (value.consume_offset or 0), 0)
    except (ImportError, StagedConsumerError) as exc:
        return lags, f"{args.redis}: {exc}"
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
) -> str | None:
    """Check the reset against the ``--redis`` broker; the error, or ``None``.

    In this order: ``--queue`` ids against the topic's queues; the group's live
    members (refused unless ``--force``, then only warned about); ``--to-offset``
    against each planned queue's [min offset, max offset]."""
    where = args.redis
    what = f"the queues of topic {args.topic!r}"
    outside: list[str] = []
    try:
        async with operator_broker(args) as broker:
            if args.queue or args.to_offset is not None:
                count = await broker.queue_count(args.topic)
                bad = sorted(q for q in set(args.queue or ()) if q >= count)
                if bad:
                    return (
                        f"topic {args.topic!r} has {count} queue(s), 0 to {count - 1}:"
                        f" no queue {', '.join(map(str, bad))}"
                    )
            what = f"whether group {args.group!r} is running"
            members = await broker.group_coordinator().members(args.group)
            if members and not args.force:
                return (
                    f"group {args.group!r} is running: {len(members)} live member(s):"
                    f" {', '.join(members)}. A running member keeps consuming from its own"
                    " offsets and overwrites the reset at its next persist: stop the group"
                    " first, or pass --force to reset anyway"
                )
            if members:
                err.print(
                    f"[bold yellow]warning:[/] group {escape(repr(args.group))} has"
                    f" {len(members)} live member(s) ({escape(', '.join(members))}); resetting"
                    " anyway (--force): they overwrite the reset at their next persist",
                    highlight=False,
                )
            if args.to_offset is None:
                return None
            what = f"the offsets of the queues of topic {args.topic!r}"
            for mq in plan:
                low, high = await broker.min_offset(mq), await broker.max_offset(mq)
                if not low <= args.to_offset <= high:
                    outside.append(f"{mq} [{low}, {high}]")
    except (ImportError, StagedConsumerError) as exc:
        return f"cannot check {what} on {where}: {exc}"
    if outside:
        return (
            f"--to-offset {args.to_offset} is outside the offsets of {', '.join(outside)}"
            " (from the min offset, the oldest message still stored, to the max offset,"
            " where the next message goes); nothing changed"
        )
    return None


# -- reset -----------------------------------------------------------------------------------


def _planned(
    args: argparse.Namespace, stored: Mapping[MessageQueue, QueueProgress]
) -> dict[MessageQueue, QueueProgress]:
    if args.queue:
        targets = sorted({MessageQueue(args.topic, q) for q in args.queue})
    else:
        targets = sorted(stored)
    plan: dict[MessageQueue, QueueProgress] = {}
    for mq in targets:
        current = stored.get(mq)
        consume = current.consume_offset if current else None
        stages = {} if args.clear_stage_offsets or current is None else dict(current.stage_offsets)
        if args.to_offset is not None:
            consume = args.to_offset
        for key, value in args.stage_offset or ():
            stages[key] = value
        # The messages that finished above an unchanged consume offset stay finished.
        keep = current is not None and consume == current.consume_offset
        plan[mq] = QueueProgress(
            consume_offset=consume,
            stage_offsets=stages,
            finished=current.finished if keep and current is not None else (),
        )
    return plan


async def _reset(args: argparse.Namespace) -> int:
    err = _console(stderr=True)
    if args.to_offset is None and not args.stage_offset and not args.clear_stage_offsets:
        return _fail(
            err, "nothing to reset: give --to-offset, --stage-offset or --clear-stage-offsets"
        )
    try:
        store = _store(args)
    except OffsetStoreError as exc:
        return _fail(err, str(exc))
    try:
        await _load(store)
        unreadable: frozenset[MessageQueue] = frozenset()
        if args.clear_stage_offsets:  # the stored stage offsets are not kept: a row
            # whose stage offsets cannot be read is repaired rather than refused
            stored, unreadable = await store.list_progress_for_repair(args.group, args.topic)
        else:
            stored = await store.list_progress(args.group, args.topic)
        plan = _planned(args, stored)
        if not plan:
            return _fail(
                err,
                f"no stored progress for group {args.group!r}, topic {args.topic!r}:"
                " name the queues with --queue",
            )
        if args.redis:
            problem = await _check_on_broker(args, plan, err)
            if problem is not None:
                return _fail(err, problem)
        else:
            _note_unchecked_queues(args, err)
        console = _console()
        table = Table(
            title=f"Reset of group [bold]{escape(args.group)}[/],"
            f" topic [bold]{escape(args.topic)}[/]",
            title_justify="left",
        )
        table.add_column("Queue")
        table.add_column("Consume offset", justify="right")
        table.add_column("")
        table.add_column("New", justify="right")
        table.add_column("Stage offsets")
        table.add_column("")
        table.add_column("New")
        for mq, new in plan.items():
            old = stored.get(mq)
            old_stages = escape(_format_stages(old.stage_offsets)) if old else "-"
            table.add_row(
                escape(str(mq)),
                "-" if old is None or old.consume_offset is None else str(old.consume_offset),
                "->",
                "-" if new.consume_offset is None else str(new.consume_offset),
                "unreadable" if mq in unreadable else old_stages,
                "->",
                escape(_format_stages(new.stage_offsets)),
            )
        console.print(table)
        if not args.yes:
            question = (
                f"Reset the progress of {len(plan)} queue(s) of group {args.group!r}?"
                " The group must not be running. [y/N] "
            )
            try:
                answer = await anyio.to_thread.run_sync(input, question)
            except EOFError:
                console.print()
                where = "is not a terminal" if not sys.stdin.isatty() else "was closed"
                return _fail(
                    err,
                    f"no answer to the confirmation (stdin {where}); nothing changed."
                    " Pass --yes (-y) to reset without asking.",
                )
            if answer.strip().lower() not in ("y", "yes"):
                console.print("Aborted; nothing changed (--yes resets without asking).")
                return 1
        await store.reset_progress(args.group, plan)
        console.print(f"Reset {len(plan)} queue(s).")
        return 0
    except OffsetStoreError as exc:
        return _fail(err, str(exc))
    finally:
        await store.aclose()


# -- registration ------------------------------------------------------------------------------


def _run(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        return int(anyio.run(handler, args))

    return run


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "offsets",
        help="show or reset the stored progress (consume and stage offsets) of a group",
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
            help="offset store URL, e.g. sqlite:///progress.db or postgresql+psycopg://user@host/db",
        )
        sub.add_argument(
            "--table-prefix",
            default="stagedconsumer_",
            metavar="PREFIX",
            help="the store's table_prefix, as given to SqlOffsetStore (default stagedconsumer_)",
        )
        sub.add_argument("--group", required=True, help="consumer group")
        sub.add_argument("--topic", required=topic_required, help="topic")

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
        " Prints the planned change and asks for confirmation (y/N) on stdin; --yes skips"
        " the question (needed when stdin is not a terminal, e.g. in scripts)."
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
        " overwrite the reset at their next persist); without --redis the group is not"
        " checked at all",
    )
    reset.add_argument(
        "-y",
        "--yes",
        action="store_true",
        help="reset without asking for confirmation (for scripts: stdin not a terminal)",
    )
    reset.set_defaults(handler=_run(_reset))
