"""``stagedconsumer trace MSG_ID_OR_KEY``: a message's life from its trace records.

Reads the JSON-lines file written by :class:`~stagedconsumer.FileTraceSink`
(``--trace-file``) or the trace topic of a :class:`~stagedconsumer.RedisBroker`
(``--redis URL --namespace NS``), and prints one table per message: its send (the
``Pub`` record: sent at, send cost, queue and offset, producer group), then every
handler call, from a ``SubBefore``/``SubAfter`` pair matched by request id: how long
the message waited in the broker before the consumer cached it, how long its stage's
barrier held it, how long it then waited in the cache for a worker, when the handler
started, how long it ran, and how a failure was settled.

A message retried through the retry queue (concurrent mode) is a new copy there with
the same ``msg_id`` (and ``ORIGIN_MESSAGE_ID``), traced under it: its attempts are
rows of the same table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from collections.abc import Sequence
from pathlib import Path

import anyio
import attrs
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from .._exceptions import ConfigurationError, StagedConsumerError
from .._observability._trace_codec import RMQ_SYS_TRACE_TOPIC, TraceContext, TraceMessage, TraceType
from .._observability._trace_query import query_message_trace, read_trace_file, read_trace_topic
from .._sources._redis_url import redact_url
from ._redis_args import add_redis_arguments, operator_broker

__all__ = ("LifeRow", "MessageHistory", "SendRow", "message_history", "message_life", "register")


@attrs.frozen(kw_only=True)
class SendRow:
    """One send of a message, from a ``Pub`` record."""

    msg_id: str
    keys: str
    tags: str
    group: str
    """The producer group."""
    topic: str
    queue_id: int | None
    queue_offset: int | None
    sent_ms: int
    """When the send call started (ms since the epoch)."""
    cost_ms: int
    """How long the send call took (ms, retries included)."""
    success: bool
    attempts: int | None
    store_host: str
    client_host: str
    body_length: int


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
    took_ms: int | None
    """How long the handler call took, ``end_ms - start_ms`` (the table's ``took``)."""
    cost_ms: int | None
    """RocketMQ's costTime, as the ``SubAfter`` record has it: the handler time
    divided by the batch size, truncated to whole ms. ``took_ms`` is the difference
    of the two records' rounded timestamps, so even for a call of one message the
    two may differ by 1 ms."""
    success: bool | None
    """``None``: no ``SubAfter`` yet (the call was running or the consumer died)."""
    context_code: int | None
    settlement: str
    broker_wait_ms: int | None = None
    """From the end of the send call (first attempt) or of the previous attempt (a
    retry through the retry queue) to the consumer caching the message; 0 when the
    consumer had it before the send returned. ``None``: a local retry (the message
    never left the cache) or nothing to measure from."""
    cache_wait_ms: int | None = None
    """From when the message was cached and its barrier open (after a local retry:
    from the previous attempt's end) to the handler start."""
    local_retry: bool = False
    """The message stayed in the consumer's cache since the previous attempt
    (suspended: orderly and staged modes retry locally)."""


@attrs.frozen(kw_only=True)
class MessageHistory:
    """Everything traced of one message: its sends, then its handler calls."""

    msg_id: str
    keys: str
    sends: tuple[SendRow, ...]
    calls: tuple[LifeRow, ...]
    """In start order (several consumer groups interleave)."""


def _send_row(pub: TraceContext) -> SendRow:
    bean = pub.beans[0]
    return SendRow(
        msg_id=bean.msg_id,
        keys=bean.keys,
        tags=bean.tags,
        group=pub.group_name,
        topic=bean.topic,
        queue_id=bean.queue_id,
        queue_offset=bean.queue_offset,
        sent_ms=pub.timestamp,
        cost_ms=pub.cost_time,
        success=pub.success,
        attempts=pub.attempt,
        store_host=bean.store_host,
        client_host=bean.client_host,
        body_length=bean.body_length,
    )


def _calls(contexts: Sequence[TraceContext]) -> list[LifeRow]:
    """Handler calls found in ``contexts`` (waits not filled in)."""
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
                took_ms=after.timestamp - before.timestamp if after is not None else None,
                cost_ms=after.cost_time if after is not None else None,
                success=after.success if after is not None else None,
                context_code=after.context_code if after is not None else None,
                settlement=after.settlement if after is not None else "",
            )
        )
    return rows


def _is_local_retry(prev: LifeRow, call: LifeRow) -> bool:
    """Whether ``call`` retried ``prev`` (the previous call of the same consumer group)
    locally: the same queue position, one attempt more.

    Exact, from counts the consumer keeps: a local retry counts one more
    ``reconsume_times`` on the message it holds, while anything pulled again brings
    the count of its stored copy: a redelivery of the original (a crash, a
    rebalance) starts again at attempt 1, and a retry through the retry queue has
    another queue position. The cached times are no test: each call converts them to
    wall-clock milliseconds with its own clock reading, so the two attempts' values
    may differ by 1 ms."""
    return (
        call.attempt == prev.attempt + 1
        and call.topic == prev.topic
        and call.queue_id == prev.queue_id
        and call.queue_offset == prev.queue_offset
    )


def _with_waits(calls: list[LifeRow], send: SendRow | None) -> list[LifeRow]:
    """``calls`` (of one message, in start order) with their broker and cache waits,
    each measured from the previous step of the same consumer group."""
    previous: dict[str, LifeRow] = {}
    out: list[LifeRow] = []
    for call in calls:
        prev = previous.get(call.group)
        previous[call.group] = call
        broker: int | None = None
        cache: int | None = None
        local = False
        if call.cached_ms is None:
            pass  # records of another writer: nothing to measure
        elif prev is not None and _is_local_retry(prev, call):
            local = True  # a local retry: the message stayed in the cache, suspended
            if prev.end_ms is not None:
                cache = call.start_ms - prev.end_ms
        else:
            handed_over: int | None = None
            if prev is not None:
                handed_over = prev.end_ms  # it came back through the retry queue
            elif send is not None:
                handed_over = send.sent_ms + send.cost_ms
            if handed_over is not None:
                broker = call.cached_ms - handed_over
            cache = call.start_ms - call.cached_ms - (call.barrier_wait_ms or 0)
        out.append(
            attrs.evolve(
                call,
                broker_wait_ms=None if broker is None else max(0, broker),
                cache_wait_ms=None if cache is None else max(0, cache),
                local_retry=local,
            )
        )
    return out


def message_history(contexts: Sequence[TraceContext]) -> list[MessageHistory]:
    """The messages found in ``contexts``, by message id: each one's sends (``Pub``
    records, in time order) and handler calls (in start order, with their waits)."""
    sends: dict[str, list[SendRow]] = {}
    for ctx in contexts:
        if ctx.trace_type is TraceType.Pub:
            row = _send_row(ctx)
            sends.setdefault(row.msg_id, []).append(row)
    calls: dict[str, list[LifeRow]] = {}
    for call in _calls(contexts):
        calls.setdefault(call.msg_id, []).append(call)
    histories: list[MessageHistory] = []
    for msg_id in sorted(sends.keys() | calls.keys()):  # then by time, below
        message_sends = sorted(sends.get(msg_id, ()), key=lambda r: r.sent_ms)
        first_send = next((s for s in message_sends if s.success), None)
        message_calls = sorted(calls.get(msg_id, ()), key=lambda r: (r.start_ms, r.attempt))
        keys = message_sends[0].keys if message_sends else message_calls[0].keys
        histories.append(
            MessageHistory(
                msg_id=msg_id,
                keys=keys,
                sends=tuple(message_sends),
                calls=tuple(_with_waits(message_calls, first_send)),
            )
        )
    histories.sort(key=_first_time)
    return histories


def _first_time(history: MessageHistory) -> int:
    """When a message's history starts: its first send, else its first handler call."""
    times = [send.sent_ms for send in history.sends[:1]]
    times += [call.start_ms for call in history.calls[:1]]
    return min(times, default=0)


def message_life(contexts: Sequence[TraceContext]) -> list[LifeRow]:
    """Handler calls found in ``contexts``, by message id, each message's in start
    order (see :func:`message_history`, which has the sends too)."""
    return [call for history in message_history(contexts) for call in history.calls]


_CODES = {0: "SUCCESS", 1: "TIME_OUT", 2: "EXCEPTION", 3: "RETURNNULL", 4: "FAILED"}


def _time(ms: int | None) -> str:
    if ms is None:
        return ""
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    return moment.strftime("%H:%M:%S.%f")[:-3]


def _ms(value: int | None) -> str:
    return "" if value is None else f"{value} ms"


def _where(topic: str, queue_id: int | None, queue_offset: int | None) -> str:
    if queue_id is None:
        return topic
    return f"{topic}:{queue_id}@{queue_offset}"


def _result(row: LifeRow) -> str:
    if row.success is None:
        return "(no SubAfter)"
    code = _CODES.get(row.context_code or 0, str(row.context_code))
    text = "success" if row.success else f"failed ({code})"
    if row.settlement:
        text += f" -> {row.settlement}"
    return text


def _send_result(row: SendRow) -> str:
    text = "sent" if row.success else "not SEND_OK"
    if row.attempts is not None and row.attempts > 1:
        text += f" ({row.attempts} attempts)"
    return text


def _stage(index: int | None) -> str:
    if index is None:
        return ""
    return "tail" if index < 0 else str(index)


_COLUMNS = (
    "step",
    "group",
    "queue",
    "stage",
    "in broker",
    "barrier",
    "in cache",
    "start",
    "took",
    "result",
)
_CAPTION = "times: UTC; what the columns measure: stagedconsumer trace --help"
_COLUMN_HELP = """\
columns:
  step       send (a Pub record), then attempt N (a SubBefore/SubAfter pair)
  group      producer group, then consumer group
  queue      topic:queue@offset where the message was stored, then where each
             attempt pulled it from (%RETRY%<group> for a retry through the retry
             queue: a new message there, traced under the first delivery's id)
  stage      stage index of the attempt (tail: the unbounded last stage, and every
             message in concurrent mode)
  in broker  from the end of the send (or of the previous attempt, for a retry
             through the retry queue) to the consumer caching the message
  barrier    how long it was cached while its stage's barrier was closed
  in cache   from cached with the barrier open (after a local retry: from the
             previous attempt's end) to the handler start
  start      when the send or the handler call started (UTC)
  took       how long the send call (retries included) or the handler call took
  result     sent; or the handler's result and how a failure was settled
"""


def _table(history: MessageHistory) -> Table:
    sent_to = ""
    if history.sends:
        send = history.sends[0]
        sent_to = f"  stored on {send.store_host}" if send.store_host else ""
    table = Table(
        title=escape(f"message {history.msg_id}  keys [{history.keys}]{sent_to}"),
        caption=_CAPTION,
    )
    for name in _COLUMNS:
        table.add_column(name, no_wrap=name != "result")
    for send in history.sends:
        table.add_row(
            "send",
            escape(send.group),
            escape(_where(send.topic, send.queue_id, send.queue_offset)),
            "",
            "",
            "",
            "",
            _time(send.sent_ms),
            _ms(send.cost_ms),
            _send_result(send),
        )
    for call in history.calls:
        table.add_row(
            f"attempt {call.attempt}",
            escape(call.group),
            escape(_where(call.topic, call.queue_id, call.queue_offset)),
            _stage(call.stage_index),
            _ms(call.broker_wait_ms),
            "" if call.local_retry else _ms(call.barrier_wait_ms),
            _ms(call.cache_wait_ms),
            _time(call.start_ms),
            _ms(call.took_ms),
            _result(call),
        )
    return table


def _narrow(history: MessageHistory) -> list[str]:
    """The rows of :func:`_table` for a terminal too narrow for it: per row one line
    with the step, start, group, queue, stage and length, then the result and the
    waits, indented."""
    sent_to = ""
    if history.sends and history.sends[0].store_host:
        sent_to = f"  stored on {history.sends[0].store_host}"
    lines = [escape(f"message {history.msg_id}  keys [{history.keys}]{sent_to}")]
    indent = " " * 11
    for send in history.sends:
        lines.append(
            f"{'send':<11}{_time(send.sent_ms)}  {escape(send.group)}"
            f"  {escape(_where(send.topic, send.queue_id, send.queue_offset))}"
            f"  took {_ms(send.cost_ms)}"
        )
        lines.append(f"{indent}{_send_result(send)}")
    for call in history.calls:
        lines.append(
            f"{f'attempt {call.attempt}':<11}{_time(call.start_ms)}  {escape(call.group)}"
            f"  {escape(_where(call.topic, call.queue_id, call.queue_offset))}"
            + (f"  stage {_stage(call.stage_index)}" if call.stage_index is not None else "")
            + f"  took {_ms(call.took_ms) or '?'}"
        )
        lines.append(f"{indent}{_result(call)}")
        waits = [
            f"{name} {_ms(value)}"
            for name, value in (
                ("in broker", call.broker_wait_ms),
                ("barrier", None if call.local_retry else call.barrier_wait_ms),
                ("in cache", call.cache_wait_ms),
            )
            if value is not None
        ]
        if waits:
            lines.append(f"{indent}waited: {', '.join(waits)}")
    lines.append(_CAPTION)
    return lines


async def _read_redis(args: argparse.Namespace) -> list[TraceMessage]:
    async with operator_broker(args) as broker:
        return await read_trace_topic(broker, args.trace_topic)


def _console() -> Console:
    """A terminal's own width (the table folds to fit it); 160 columns when the
    output goes to a file or a pipe and ``COLUMNS`` does not say otherwise, so a
    saved table keeps one line per row. ``:name:`` emoji codes are not replaced:
    keys, groups and the records quoted in errors are shown as they are (their
    ``[...]`` is escaped where they are printed)."""
    console = Console(emoji=False)
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(width=160, emoji=False)


def _error(text: str) -> None:
    """``text`` (plain, not markup) on stderr, in red on a terminal: stdout holds only
    the tables, or only JSON with ``--json``."""
    Console(stderr=True, emoji=False).print(
        f"[red]stagedconsumer trace: {escape(text)}[/red]", soft_wrap=True, highlight=False
    )


def _run(args: argparse.Namespace) -> int:
    console = _console()
    if args.redis:
        where = f"{args.trace_topic} of {redact_url(args.redis)} namespace {args.redis_namespace}"
        try:
            messages = anyio.run(_read_redis, args, backend="asyncio")
        except ImportError as exc:
            _error(str(exc))
            return 1
        except StagedConsumerError as exc:
            _error(f"cannot read {where}: {exc}")
            return 1
    else:
        path = Path(args.trace_file)
        where = str(path)
        if not path.exists():
            _error(f"no trace file {where}")
            return 1
        try:
            messages = list(read_trace_file(path))
        except (ConfigurationError, OSError) as exc:
            _error(str(exc))
            return 1
    histories = message_history(query_message_trace(messages, args.key))
    if not histories:
        _error(f"no trace records for {args.key!r} in {where}")
    if args.json:
        print(json.dumps([attrs.asdict(h) for h in histories], indent=2))
        return 0 if histories else 1
    if not histories:
        return 1
    if len(histories) > 1:
        console.print(
            f"{len(histories)} messages match {escape(repr(args.key))}, oldest first"
            " (a trace file written by several runs holds the records of each: FileTraceSink"
            " appends)",
            highlight=False,
        )
    for history in histories:
        table = _table(history)
        wide = Measurement.get(console, console.options.update_width(10_000), table)
        if wide.maximum <= console.width:
            console.print(table)
        else:  # a narrow terminal: a few lines per row instead of a folded table
            for line in _narrow(history):
                console.print(line, highlight=False)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "trace",
        epilog=_COLUMN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="print a message's life from its trace records",
        description=(
            "Print the life of a message (found by message id or business key) from its"
            " trace records: its send (producer group, queue and offset, send cost), then"
            " every handler call: time in the broker, behind the stage barrier and in the"
            " cache, handler start and length, attempt, result."
        ),
    )
    parser.add_argument("key", metavar="MSG_ID_OR_KEY")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--trace-file",
        metavar="PATH",
        help="JSON-lines file written by FileTraceSink(PATH)",
    )
    add_redis_arguments(
        parser,
        url_help="read the trace topic of the RedisBroker at URL (e.g. redis://127.0.0.1:6379/0)",
        url_group=source,
    )
    parser.add_argument(
        "--trace-topic",
        default=RMQ_SYS_TRACE_TOPIC,
        metavar="TOPIC",
        help=f"trace topic to read with --redis (default {RMQ_SYS_TRACE_TOPIC})",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help=(
            "print the rows as JSON instead of a table (a list of messages, each with its"
            " sends and calls; a call's took_ms is the took column, its cost_ms RocketMQ's"
            " costTime: handler time / batch size, truncated to ms); errors go to stderr"
        ),
    )
    parser.set_defaults(handler=_run)
