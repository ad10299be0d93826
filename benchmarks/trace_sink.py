"""Message trace to a file on a busy consumer: does the trace keep up?

A consumer with a no-op ``async`` handler (concurrent mode, 20 workers, 8 queues of
the embedded broker) and a producer in the same process, sending 16-byte messages
as fast as the consumer takes them (at most ``--backlog`` unconsumed), for
``--seconds``; then the consumer stops (its trace flushed, the file closed). Cases:

- ``no trace``: no hook, the consumer's own pace;
- ``file trace``: ``ConsumeMessageTraceHook(FileTraceSink(path))``, every call
  traced (one ``SubBefore`` and one ``SubAfter`` record per message);
- ``topic trace``: ``ConsumeMessageTraceHook()``, to the embedded broker's trace topic
  (appended in memory where a batch fills up): what the trace costs with a sink
  that costs next to nothing;
- ``file sink alone`` (a second table): ``--sink-messages`` trace messages of 10
  ``SubBefore`` records handed to ``FileTraceSink.write_nowait`` in a row, then a
  flush: the sink's CPU time per context, its encoding and its writer thread together
  (with ``--baseline``, for both trees).

Columns: messages consumed per second, trace records found in the file per second
(both over the time from the start until the consumer has stopped and its trace
file is closed), records per consumed message (2.00 when every message got both of
its records), and the contexts the hook dropped (``trace buffer full``) and lost.

With ``--baseline TREE`` the ``file trace`` case also runs on the code of another
checkout (``stagedconsumer`` imported from ``TREE``), in the same run, interleaved
round by round with this tree's, so both see the same machine load::

    git worktree add --detach /tmp/trace-base 177712b
    python -m benchmarks.trace_sink --baseline /tmp/trace-base --baseline-label 177712b
    python -m benchmarks.trace_sink --seconds 20 --rounds 3

Every run is a child process of its own (``python benchmarks/trace_sink.py --child``
with ``PYTHONPATH`` set to the tree it measures); the trace file is in a temporary
directory on the disk of ``--dir`` (default: the system's), removed after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FIELD_SPLITOR = "\u0002"
TOPIC = "bench"


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One run, in this process: returns its measures (imports ``stagedconsumer`` from
    wherever ``PYTHONPATH`` points)."""
    if spec["trace"] == "sink":
        return _sink_alone(spec)
    from collections.abc import Sequence as Seq

    import anyio
    import anyio.lowlevel

    import stagedconsumer
    from offsetstore import MemoryOffsetStore
    from stagedconsumer import (
        ConsumeConcurrentlyContext,
        ConsumeMessageTraceHook,
        ConsumerOptions,
        FileTraceSink,
        MemoryBroker,
        Message,
        MessageListenerConcurrently,
        PushConsumer,
    )

    class Noop(MessageListenerConcurrently):
        async def consume_message(
            self, msgs: Seq[Message], context: ConsumeConcurrentlyContext
        ) -> None:
            return None

    queues: int = spec["queues"]
    trace_path = spec["trace_path"]
    topic_trace = spec["trace"] == "topic"

    async def run() -> dict[str, Any]:
        broker = MemoryBroker()
        broker.create_topic(TOPIC, queues)
        consumer = PushConsumer(
            "bench",
            broker,
            Noop(),
            offset_store=MemoryOffsetStore(),
            options=ConsumerOptions(consume_thread_max=20),
        )
        consumer.subscribe(TOPIC)
        hook = None
        if trace_path is not None:
            hook = ConsumeMessageTraceHook(FileTraceSink(trace_path))
        elif topic_trace:
            hook = ConsumeMessageTraceHook()
        if hook is not None:
            consumer.register_consume_message_hook(hook)
        body = b"x" * 16
        sent = 0
        start = time.perf_counter()
        cpu = time.process_time()
        async with consumer:
            deadline = start + spec["seconds"]
            while time.perf_counter() < deadline:
                if sent - consumer.statistics().consumed_ok < spec["backlog"]:
                    for _ in range(100):
                        broker.send(TOPIC, body, queue_id=sent % queues)
                        sent += 1
                    await anyio.lowlevel.checkpoint()
                else:
                    await anyio.sleep(0.001)
            await consumer.wait_caught_up()
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
        consumed = consumer.statistics().consumed_ok
        out: dict[str, Any] = {
            "sent": sent,
            "consumed": consumed,
            "seconds": elapsed,
            "cpu_seconds": cpu,
            "module": stagedconsumer.__file__,
        }
        if hook is not None:
            stats = hook.statistics()
            out.update(
                appended=stats.appended,
                dropped=stats.dropped,
                lost=stats.lost,
                written=stats.written,
            )
        if topic_trace:
            out["records"] = sum(
                message.body.decode().count(FIELD_SPLITOR)
                for message in broker.messages("RMQ_SYS_TRACE_TOPIC")
            )
        return out

    result = anyio.run(run)
    if trace_path is not None:
        records = 0
        with open(trace_path, encoding="utf-8") as file:
            for line in file:
                if line.strip():
                    records += json.loads(line)["body"].count(FIELD_SPLITOR)
        result["records"] = records
    return result


def _sink_alone(spec: dict[str, Any]) -> dict[str, Any]:
    """The file sink without a consumer: ``spec["sink_messages"]`` trace messages of 10
    ``SubBefore`` records each given to ``FileTraceSink.write_nowait`` in a row, then a
    flush; the process's CPU time (both threads) per context, best of 5."""
    import anyio

    import stagedconsumer
    from stagedconsumer import FileTraceSink
    from stagedconsumer._observability._trace_codec import TraceMessage

    fields = ["SubBefore", "1700000000000", "DefaultRegion", "bench", "0" * 32, "A" * 32]
    record = "\u0001".join([*fields, "0", "", "-1", "0", "1700000000000", TOPIC, "3", "123", "1"])
    count = spec["sink_messages"]
    messages = [
        TraceMessage(
            topic="RMQ_SYS_TRACE_TOPIC",
            keys=tuple(f"{i * 10 + k:032X}" for k in range(10)),
            body=(record + FIELD_SPLITOR) * 10,
            contexts=10,
        )
        for i in range(count)
    ]

    async def run() -> float:
        sink = FileTraceSink(spec["trace_path"], queue_size=10 * count)
        best = float("inf")
        for _ in range(5):
            cpu = time.process_time()
            for message in messages:
                sink.write_nowait(message)
            await sink.flush()
            best = min(best, time.process_time() - cpu)
        await sink.aclose()
        return best

    cpu = anyio.run(run)
    return {"contexts": 10 * count, "cpu_seconds": cpu, "module": stagedconsumer.__file__}


def _run_case(tree: Path, spec: dict[str, Any], directory: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        if spec["trace"] in ("file", "sink"):
            spec = {**spec, "trace_path": str(Path(tmp) / "trace.jsonl")}
        else:
            spec = {**spec, "trace_path": None}
        env = {**os.environ, "PYTHONPATH": str(tree)}
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
            env=env,
            cwd=tmp,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"run on {tree} failed:\n{done.stderr}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    expected = Path(tree).resolve()
    if not Path(result["module"]).resolve().is_relative_to(expected):
        raise RuntimeError(f"measured {result['module']}, expected code from {expected}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="producing time per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each case, interleaved")
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument("--backlog", type=int, default=10_000, help="most messages unconsumed")
    parser.add_argument("--baseline", type=Path, help="a checkout to measure as the baseline")
    parser.add_argument("--baseline-label", default="baseline")
    parser.add_argument(
        "--sink-messages",
        type=int,
        default=20_000,
        help="trace messages (10 contexts each) of the 'file sink alone' case; 0 skips it",
    )
    parser.add_argument("--dir", help="where the trace files go (a temporary directory in it)")
    parser.add_argument("--json", type=Path, help="also write every run as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(_child(json.loads(args.child))))
        return 0

    from rich.console import Console
    from rich.table import Table

    from benchmarks._reproduce import print_reproduce

    here = Path(__file__).resolve().parent.parent
    cases: list[tuple[str, Path, str | None]] = [
        ("no trace", here, None),
        ("topic trace", here, "topic"),
    ]
    if args.baseline is not None:
        cases.append((f"file trace, {args.baseline_label}", args.baseline.resolve(), "file"))
    cases.append(("file trace", here, "file"))
    if args.sink_messages > 0:
        if args.baseline is not None:
            cases.append(
                (f"file sink alone, {args.baseline_label}", args.baseline.resolve(), "sink")
            )
        cases.append(("file sink alone", here, "sink"))
    spec = {
        "seconds": args.seconds,
        "queues": args.queues,
        "backlog": args.backlog,
        "sink_messages": args.sink_messages,
    }
    load_before = os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        for name, tree, trace in cases:
            result = _run_case(tree, {**spec, "trace": trace}, args.dir)
            runs.append({"case": name, "round": round_, "load": os.getloadavg()[0], **result})
    load_after = os.getloadavg()[0]

    table = Table(
        title=f"Message trace to a file on a busy no-op consumer ({args.seconds:g} s producing,"
        f" {args.queues} queues, concurrent, 20 workers)"
    )
    for column, justify in (
        ("case", "left"),
        ("round", "right"),
        ("messages consumed/s", "right"),
        ("trace records written/s", "right"),
        ("records/message", "right"),
        ("contexts dropped", "right"),
        ("lost", "right"),
        ("CPU µs/msg", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for run in runs:
        if "consumed" not in run:
            continue  # the file sink alone: the table below
        traced = "records" in run
        table.add_row(
            run["case"],
            str(run["round"]),
            f"{run['consumed'] / run['seconds']:,.0f}",
            f"{run['records'] / run['seconds']:,.0f}" if traced else "",
            f"{run['records'] / run['consumed']:.2f}" if traced else "",
            f"{run['dropped']:,}" if traced else "",
            f"{run['lost']:,}" if traced else "",
            f"{1e6 * run['cpu_seconds'] / run['consumed']:.1f}",
        )
    console = Console()
    console.print(table)
    alone = [run for run in runs if "consumed" not in run]
    if alone:
        sink_table = Table(
            title=f"The file sink alone: {args.sink_messages:,} trace messages of 10 contexts"
            " given to FileTraceSink.write_nowait, then a flush (best of 5)"
        )
        for column in ("case", "round", "CPU µs/context (both threads)", "contexts/CPU-s"):
            sink_table.add_column(column, justify="left" if column == "case" else "right")
        for run in alone:
            per_context = run["cpu_seconds"] / run["contexts"]
            sink_table.add_row(
                run["case"],
                str(run["round"]),
                f"{1e6 * per_context:.2f}",
                f"{1 / per_context:,.0f}" if per_context else "",
            )
        console.print(sink_table)
    console.print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs (shared); every run a"
        f" process of its own, cases interleaved round by round; 1-minute load average"
        f" {load_before:.2f} before, {load_after:.2f} after"
    )
    print_reproduce(console, "trace_sink", argv)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    if "--child" not in sys.argv:
        # Run as a script, benchmarks/ comes first on sys.path: put the repository root
        # there instead, so that imports resolve as under ``python -m benchmarks.X``.
        sys.path[0] = str(Path(__file__).resolve().parent.parent)
    else:
        del sys.path[0]  # the measured tree comes from PYTHONPATH alone
    sys.exit(main())
