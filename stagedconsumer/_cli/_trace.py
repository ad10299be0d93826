"""``stagedconsumer trace MSG_ID_OR_KEY``: a message's life from its trace records.

Reads the JSON-lines file written by :class:`~stagedconsumer.FileTraceSink`
(``--trace-file``), pairs ``SubBefore`` and ``SubAfter`` records by request id and
prints one row per handler call: when the message was received and cached, how long
its stage's barrier held it, when the handler started and ended, the attempt, the
result and how a failure was settled.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Sequence
from pathlib import Path

import attrs
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .._observability._trace_codec import TraceContext, TraceType
from .._observability._trace_query import query_message_trace, read_trace_file

__all__ = ("LifeRow", "message_life", "register")


@attrs.frozen(kw_only=True)
class LifeRow:
    """One handler call of one message, from a ``SubBefore``/``SubAfter`` pair."""

    msg_id: str
    keys: str
    group: str
    topic: str
    queue_id: int | None
    queue_offset: int | None
    attempt: int
    stage_index: int | None
    cached_ms: int | None
    """Received and cached by the consumer (ms since the epoch; one step here)."""
    barrier_wait_ms: int | None
    start_ms: int
    end_ms: int | None
    cost_ms: int | None
    """RocketMQ's costTime: handler time divided by the batch size."""
    success: bool | None
    """``None``: no ``SubAfter`` yet (the call was running or the consumer died)."""
    context_code: int | None
    settlement: str


def message_life(contexts: Sequence[TraceContext]) -> list[LifeRow]:
    """Handler calls found in ``contexts``, in start order."""
    afters = {
        (c.request_id, c.beans[0].msg_id): c for c in contexts if c.trace_type is TraceType.SubAfter
    }
    rows: list[LifeRow] = []
    for before in contexts:
        if before.trace_type is not TraceType.SubBefore:
            continue
        bean = before.beans[0]
        after = afters.get((before.request_id, bean.msg_id))
        rows.append(
            LifeRow(
                msg_id=bean.msg_id,
                keys=bean.keys,
                group=before.group_name,
                topic=bean.topic,
                queue_id=bean.queue_id,
                queue_offset=bean.queue_offset,
                attempt=before.attempt if before.attempt is not None else bean.retry_times + 1,
                stage_index=before.stage_index,
                cached_ms=bean.cached_timestamp,
                barrier_wait_ms=bean.barrier_wait_ms,
                start_ms=before.timestamp,
                end_ms=after.timestamp if after is not None else None,
                cost_ms=after.cost_time if after is not None else None,
                success=after.success if after is not None else None,
                context_code=after.context_code if after is not None else None,
                settlement=after.settlement if after is not None else "",
            )
        )
    rows.sort(key=lambda r: (r.msg_id, r.start_ms, r.attempt))
    return rows


_CODES = {0: "SUCCESS", 1: "TIME_OUT", 2: "EXCEPTION", 3: "RETURNNULL", 4: "FAILED"}


def _time(ms: int | None) -> str:
    if ms is None:
        return ""
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    return moment.strftime("%H:%M:%S.%f")[:-3]


def _result(row: LifeRow) -> str:
    if row.success is None:
        return "(no SubAfter)"
    code = _CODES.get(row.context_code or 0, str(row.context_code))
    text = "success" if row.success else f"failed ({code})"
    if row.settlement:
        text += f" -> {row.settlement}"
    return text


def _stage(index: int | None) -> str:
    if index is None:
        return ""
    return "tail" if index < 0 else str(index)


def _run(args: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 140))
    path = Path(args.trace_file)
    if not path.exists():
        console.print(f"[red]no trace file {path}[/red]")
        return 1
    contexts = query_message_trace(read_trace_file(path), args.key)
    rows = message_life(contexts)
    if args.json:
        print(json.dumps([attrs.asdict(r) for r in rows], indent=2))
        return 0 if rows else 1
    if not rows:
        console.print(f"no trace records for {args.key!r} in {path}")
        return 1
    by_message: dict[str, list[LifeRow]] = {}
    for row in rows:
        by_message.setdefault(row.msg_id, []).append(row)
    for msg_id, calls in by_message.items():
        first = calls[0]
        where = f"{first.topic} queue {first.queue_id} offset {first.queue_offset}"
        table = Table(
            title=escape(f"message {msg_id}  keys [{first.keys}]  {where}  group {first.group}"),
            caption="times: UTC, HH:MM:SS.mmm; cost: RocketMQ costTime (handler ms / batch size)",
        )
        for name in (
            "attempt",
            "stage",
            "received/cached",
            "barrier wait",
            "handler start",
            "handler end",
            "cost",
            "result",
        ):
            table.add_column(name, no_wrap=True)
        for row in calls:
            table.add_row(
                str(row.attempt),
                _stage(row.stage_index),
                _time(row.cached_ms),
                "" if row.barrier_wait_ms is None else f"{row.barrier_wait_ms} ms",
                _time(row.start_ms),
                _time(row.end_ms),
                "" if row.cost_ms is None else f"{row.cost_ms} ms",
                _result(row),
            )
        console.print(table)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="print a message's life from its trace records",
        description=(
            "Print every handler call of a message (found by message id or business key)"
            " from the trace file written by FileTraceSink: received/cached, barrier wait,"
            " handler start and end, attempt, result."
        ),
    )
    parser.add_argument("key", metavar="MSG_ID_OR_KEY")
    parser.add_argument(
        "--trace-file",
        required=True,
        help="JSON-lines file written by ConsumeMessageTraceHook(FileTraceSink(PATH))",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=_run)
