"""``stagedconsumer demo``: the RIP-22 example through orderly, concurrent and staged.

100 messages on one queue, each handler call takes 10 ms, 20 workers, stage
definitions ``[10, 20, 70]``. Orderly consumption takes 100 units, staged
``ceil(10/20) + ceil(20/20) + ceil(70/20) = 6``, concurrent ``ceil(100/20) = 5``.
Every run logs handler start and end times; the order check verifies, from that
log, each mode's guarantee and that every message was consumed exactly once.

With --keys K, message i has the key user-{i % K}, and the modes are orderly,
key-ordered (one message at a time per key, keys concurrently), staged per key
(the stages count each key's messages) and concurrent.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Sequence

import anyio
import attrs
from rich import box
from rich.console import Console
from rich.table import Table

from .._core import TAIL_STAGE, StageDefinition
from .._listeners import (
    ConsumeConcurrentlyContext,
    ConsumeOrderlyContext,
    ConsumeStagedConcurrentlyContext,
    MessageListener,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    MessageListenerStagedConcurrently,
    Ordering,
)
from .._message import Message
from .._options import ConsumerOptions
from .._sources._memory import MemoryBroker

__all__ = ("DemoResult", "register", "run_demo", "theoretical_units")

TOPIC = "rip22"


@attrs.frozen(kw_only=True)
class _Event:
    offset: int
    stage: int
    start: float
    end: float
    key: str = ""


class _Log:
    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.events: list[_Event] = []
        self.running = 0
        self.peak = 0

    async def handle(self, msgs: Sequence[Message], stage: int) -> None:
        start = anyio.current_time()
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await anyio.sleep(self.cost * len(msgs))
        finally:
            self.running -= 1
        end = anyio.current_time()
        self.events.extend(
            _Event(
                offset=m.queue_offset,
                stage=stage,
                start=start,
                end=end,
                key=m.keys[0] if m.keys else "",
            )
            for m in msgs
        )


class _Concurrent(MessageListenerConcurrently):
    def __init__(self, log: _Log) -> None:
        self.log = log

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        await self.log.handle(msgs, TAIL_STAGE)


class _Orderly(MessageListenerOrderly):
    def __init__(self, log: _Log) -> None:
        self.log = log

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        await self.log.handle(msgs, TAIL_STAGE)


class _KeyOrdered(MessageListenerOrderly):
    ordering = Ordering.BY_KEY

    def __init__(self, log: _Log) -> None:
        self.log = log

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeOrderlyContext
    ) -> None:
        await self.log.handle(msgs, TAIL_STAGE)


class _Staged(MessageListenerStagedConcurrently):
    def __init__(self, log: _Log, stages: Sequence[int], *, by_key: bool = False) -> None:
        self.log = log
        self.stages = list(stages)
        self.by_key = by_key

    def compute_group(self, msg: Message) -> str | None:
        return msg.keys[0] if self.by_key else None

    def get_stage_definitions(self) -> Sequence[int]:
        return self.stages

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        await self.log.handle(msgs, context.stage_index)


@attrs.frozen(kw_only=True)
class DemoResult:
    """One mode's run of the demo."""

    mode: str
    messages: int
    elapsed: float
    """Seconds from start until every message finished."""
    bound_units: int
    """The theoretical makespan in handler-cost units."""
    unit: float
    """Seconds per unit (the handler cost)."""
    peak_concurrency: int
    violations: tuple[str, ...]
    keys: int = 0
    """Distinct message keys (0: none, the RIP-22 example)."""
    bare: float
    """Seconds the same schedule of sleeps takes with no consumer at all (the timer
    floor of this machine and event loop), measured in the same run."""

    @property
    def rate(self) -> float:
        return self.messages / self.elapsed if self.elapsed > 0 else math.inf

    @property
    def bound(self) -> float:
        return self.bound_units * self.unit

    @property
    def ok(self) -> bool:
        return not self.violations


def theoretical_units(
    mode: str, messages: int, workers: int, stages: Sequence[int], keys: int = 0
) -> int:
    """Makespan in handler-cost units with batch size 1 and equal costs.

    With ``keys``, message ``i`` has key ``i % keys`` and the key modes are those of
    the ideal schedule that starts, each unit, the ready messages lowest offset first
    (see :func:`_rounds`)."""
    if mode in ("key-ordered", "staged/key"):
        return len(_rounds(mode, messages, workers, stages, keys))
    if mode == "orderly":
        return messages
    if mode == "concurrent":
        return math.ceil(messages / workers)
    units = 0
    left = messages
    for size in stages:
        take = min(size, left)
        units += math.ceil(take / workers)
        left -= take
    return units + math.ceil(left / workers)


def check_order(
    mode: str, events: Sequence[_Event], messages: int, stages: Sequence[int]
) -> list[str]:
    """Verify the mode's guarantee from the handler log; returns the violations.

    The key modes check each key's messages as orderly (``key-ordered``) or staged
    (``staged/key``) check a queue's."""
    if mode in ("key-ordered", "staged/key"):
        problems = _check_exactly_once(events, messages)
        by_key: dict[str, list[_Event]] = {}
        for event in sorted(events, key=lambda e: e.offset):
            by_key.setdefault(event.key, []).append(event)
        inner = "orderly" if mode == "key-ordered" else "staged"
        for key, key_events in by_key.items():
            # Each key's n-th message as offset n of its own sequence.
            renumbered = [attrs.evolve(e, offset=n) for n, e in enumerate(key_events)]
            for problem in _check_sequence(inner, renumbered, stages):
                problems.append(f"key {key}: {problem} (counting the key's messages)")
                break
        return problems
    return _check_exactly_once(events, messages) + _check_sequence(mode, events, stages)


def _check_exactly_once(events: Sequence[_Event], messages: int) -> list[str]:
    problems: list[str] = []
    offsets = sorted(e.offset for e in events)
    if offsets != list(range(messages)):
        missing = sorted(set(range(messages)) - set(offsets))
        duplicates = len(offsets) - len(set(offsets))
        problems.append(
            f"consumed {len(offsets)} of {messages}"
            f" (missing {missing[:5]}, duplicates {duplicates})"
        )
    return problems


def _check_sequence(mode: str, events: Sequence[_Event], stages: Sequence[int]) -> list[str]:
    problems: list[str] = []
    by_offset = sorted(events, key=lambda e: e.offset)
    if mode == "orderly":
        for before, after in itertools.pairwise(by_offset):
            if after.start < before.end:
                problems.append(
                    f"offset {after.offset} started before offset {before.offset} ended"
                )
                break
    elif mode == "staged":
        definition = StageDefinition.of(stages)
        for event in by_offset:
            expected = definition.stage_index(event.offset)
            if event.stage != expected:
                problems.append(
                    f"offset {event.offset} ran as stage {event.stage}, expected {expected}"
                )
                break
        order = {
            index: position for position, index in enumerate([*range(len(stages)), TAIL_STAGE])
        }
        ends: dict[int, float] = {}
        starts: dict[int, float] = {}
        for event in by_offset:
            ends[event.stage] = max(ends.get(event.stage, -math.inf), event.end)
            starts[event.stage] = min(starts.get(event.stage, math.inf), event.start)
        for stage, start in starts.items():
            for earlier, end in ends.items():
                if order[earlier] < order[stage] and start < end:
                    problems.append(f"stage {stage} started before stage {earlier} finished")
    return problems


def _rounds(
    mode: str, messages: int, workers: int, stages: Sequence[int], keys: int = 0
) -> list[int]:
    """Handler calls per round of the ideal schedule (each round lasts one unit)."""
    if mode in ("key-ordered", "staged/key"):
        return _key_rounds(mode, messages, workers, stages, keys)
    if mode == "orderly":
        return [1] * messages
    groups = [messages] if mode == "concurrent" else []
    if mode == "staged":
        left = messages
        for size in stages:
            groups.append(min(size, left))
            left -= groups[-1]
        groups.append(left)
    rounds: list[int] = []
    for size in groups:
        while size > 0:
            rounds.append(min(size, workers))
            size -= workers
    return rounds


def _key_rounds(
    mode: str, messages: int, workers: int, stages: Sequence[int], keys: int
) -> list[int]:
    """Rounds of the key modes: each round starts up to ``workers`` ready messages,
    lowest offset first. Key-ordered: a key's next message is ready when its previous
    one finished. Staged by key: a key's messages of its current stage are ready, the
    next stage when all of them finished."""
    definition = StageDefinition.of(stages)
    stage_of = {}
    per_key: dict[int, list[int]] = {}
    for offset in range(messages):
        sequence = per_key.setdefault(offset % keys, [])
        stage_of[offset] = definition.stage_index(len(sequence))
        sequence.append(offset)
    rounds: list[int] = []
    while per_key:
        ready: list[int] = []
        for sequence in per_key.values():
            if mode == "key-ordered":
                ready.append(sequence[0])
            else:
                stage = stage_of[sequence[0]]
                ready.extend(o for o in sequence if stage_of[o] == stage)
        started = set(sorted(ready)[:workers])
        rounds.append(len(started))
        for key in list(per_key):
            left = [o for o in per_key[key] if o not in started]
            if left:
                per_key[key] = left
            else:
                del per_key[key]
    return rounds


async def _bare_schedule(rounds: Sequence[int], cost: float) -> float:
    start = anyio.current_time()
    for width in rounds:
        async with anyio.create_task_group() as tg:
            for _ in range(width):
                tg.start_soon(anyio.sleep, cost)
    return anyio.current_time() - start


async def _run_mode(
    mode: str, *, messages: int, cost: float, workers: int, stages: Sequence[int], keys: int = 0
) -> DemoResult:
    broker = MemoryBroker()
    broker.create_topic(TOPIC, 1)
    for i in range(messages):
        message_keys = [f"user-{i % keys}"] if keys else []
        broker.send(TOPIC, f"order {i}".encode(), keys=message_keys, queue_id=0)
    log = _Log(cost)
    listener: MessageListener
    if mode == "orderly":
        listener = _Orderly(log)
    elif mode == "concurrent":
        listener = _Concurrent(log)
    elif mode == "key-ordered":
        listener = _KeyOrdered(log)
    else:
        listener = _Staged(log, stages, by_key=mode == "staged/key")
    from .._runtime._consumer import PushConsumer

    consumer = PushConsumer(
        f"demo-{mode}", broker, listener, options=ConsumerOptions(consume_thread_max=workers)
    )
    consumer.subscribe(TOPIC)
    async with consumer:
        start = anyio.current_time()
        await consumer.wait_caught_up()
        elapsed = anyio.current_time() - start
    return DemoResult(
        mode=mode,
        messages=messages,
        elapsed=elapsed,
        bound_units=theoretical_units(mode, messages, workers, stages, keys),
        unit=cost,
        peak_concurrency=log.peak,
        violations=tuple(check_order(mode, log.events, messages, stages)),
        bare=await _bare_schedule(_rounds(mode, messages, workers, stages, keys), cost),
        keys=keys,
    )


async def run_demo(
    *,
    messages: int = 100,
    cost: float = 0.010,
    workers: int = 20,
    stages: Sequence[int] = (10, 20, 70),
    keys: int = 0,
) -> list[DemoResult]:
    """Run orderly, concurrent and staged consumption of the same workload; with
    ``keys``, message ``i`` has key ``user-{i % keys}`` and the modes are orderly,
    key-ordered, staged by key (``stages`` per key) and concurrent."""
    StageDefinition.of(stages)
    modes = (
        ("orderly", "key-ordered", "staged/key", "concurrent")
        if keys
        else ("orderly", "concurrent", "staged")
    )
    return [
        await _run_mode(
            mode, messages=messages, cost=cost, workers=workers, stages=stages, keys=keys
        )
        for mode in modes
    ]


def _parse_stages(text: str) -> list[int]:
    text = text.strip().strip("[]")
    if not text:
        return []
    sizes: list[int] | None
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = None
    if sizes is None or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"stages must be comma-separated positive ints like 10,20,70, got {text!r}"
        )
    return sizes


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def render(results: Sequence[DemoResult], console: Console, *, virtual: bool) -> None:
    """The results as a table that fits 80 columns (narrower terminals fold numbers
    onto a second line; a mode's name is never cut), a legend, and the order
    violations, if any, below the table.

    In virtual time the *bare* column is left out: the bare schedule of sleeps takes
    exactly the bound there, so it says nothing the bound does not."""
    orderly = next(r for r in results if r.mode == "orderly")
    clock = "virtual time" if virtual else "wall clock"
    first = results[0]
    table = Table(
        title=(
            f"{first.messages} messages of {first.keys} keys x {first.unit * 1000:g} ms ({clock})"
            if first.keys
            else f"RIP-22 example: {first.messages} messages x {first.unit * 1000:g} ms ({clock})"
        ),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    columns = ["mode", "ms", "msg/s", "speedup", "bound", "/bound", "bare", "peak", "order"]
    if virtual:
        columns.remove("bare")
    for column in columns:
        if column == "mode":
            width = max(len(r.mode) for r in results)
            table.add_column(column, no_wrap=True, min_width=width)
        else:
            table.add_column(
                column, justify="left" if column == "order" else "right", overflow="fold"
            )
    for r in results:
        cells = {
            "mode": r.mode,
            "ms": f"{r.elapsed * 1000:.1f}",
            "msg/s": f"{r.rate:,.0f}",
            "speedup": f"{orderly.elapsed / r.elapsed:.1f}x",
            "bound": f"{r.bound_units} u",
            "/bound": f"{r.elapsed / r.bound:.3f}",
            "bare": f"{r.bare * 1000:.1f}",
            "peak": str(r.peak_concurrency),
            "order": "[green]ok[/green]" if r.ok else "[red]FAILED[/red]",
        }
        table.add_row(*(cells[column] for column in columns))
    console.print(table)
    legend = (
        "ms: elapsed until every message finished; speedup: over orderly; bound: the"
        " theoretical makespan in units (u) of one message's handler time (orderly ="
        " messages, staged = sum of ceil(stage / workers), concurrent = ceil(messages /"
        " workers)); /bound: elapsed over bound;"
    )
    if first.keys:
        legend = legend.replace(
            " /bound:",
            " key-ordered and staged/key: the rounds of the ideal schedule that starts"
            " the ready messages lowest offset first; /bound:",
        )
    if not virtual:
        legend += (
            " bare: ms the same schedule of sleeps takes with no consumer, the timer"
            " floor of this event loop;"
        )
    legend += (
        " peak: most handlers running at once; order: the mode's guarantee and"
        " exactly-once, checked from the handler log."
    )
    console.print(legend, highlight=False)
    for r in results:
        for violation in r.violations:
            console.print(f"[red]{r.mode}: {violation}[/red]", highlight=False)


_DEFAULTS = {"messages": 100, "cost_ms": 10.0, "workers": 20, "keys": 0}
"""The demo's options left unset (``None``) take these; unset, so that ``demo gray``
can tell the options it does not take from defaults."""


def _handle(args: argparse.Namespace) -> int:
    if args.virtual and args.demo_backend == "asyncio":
        sys.stderr.write(
            "error: demo --virtual runs on trio, in virtual time: --backend asyncio would be"
            " ignored (drop one of them)\n"
        )
        return 2
    for dest, default in _DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    args.backend = args.demo_backend or "asyncio"
    if args.stages is None:  # RIP-22's stages; per key, stages that fit a key's share
        args.stages = [1, 2, 3] if args.keys else [10, 20, 70]
    kwargs = {
        "messages": args.messages,
        "cost": args.cost_ms / 1000,
        "workers": args.workers,
        "stages": args.stages,
        "keys": args.keys,
    }
    started = time.perf_counter()
    if args.backend == "trio" and not args.virtual:
        try:
            import trio  # only to say which extra is missing
        except ImportError:
            raise SystemExit(
                "stagedconsumer demo --backend trio needs trio: pip install 'stagedconsumer[trio]'"
            ) from None
    if args.virtual:
        try:
            import trio.testing
        except ImportError:
            raise SystemExit(
                "stagedconsumer demo --virtual runs on trio: pip install 'stagedconsumer[trio]'"
            ) from None

        results: list[DemoResult] = anyio.run(
            lambda: run_demo(**kwargs),
            backend="trio",
            backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)},
        )
    else:
        results = anyio.run(lambda: run_demo(**kwargs), backend=args.backend)
    console = Console(emoji=False)  # like the other commands (nothing here is user text)
    render(results, console, virtual=args.virtual)
    console.print(
        f"stages {args.stages}, {args.workers} workers,"
        f" {'trio in virtual time' if args.virtual else args.backend}:"
        f" {time.perf_counter() - started:.2f} s of wall time",
        highlight=False,
    )
    return 0 if all(r.ok for r in results) else 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the RIP-22 example through orderly, concurrent and staged consumption",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--messages",
        type=_positive_int,
        default=None,
        metavar="N",
        help="messages on the queue (100)",
    )
    parser.add_argument(
        "--cost-ms",
        type=_positive_float,
        default=None,
        metavar="MS",
        help="handler time per message in ms (10)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="handler calls at once, consume_thread_max (20)",
    )
    parser.add_argument(
        "--stages",
        type=_parse_stages,
        default=None,
        metavar="N,N,...",
        help="stage sizes (10,20,70; with --keys, per key: 1,2,3)",
    )
    parser.add_argument(
        "--keys",
        type=_non_negative_int,
        default=None,
        metavar="K",
        help="give message i the key user-{i %% K} and compare orderly, key-ordered,"
        " staged by key and concurrent (0: the RIP-22 example)",
    )
    parser.add_argument(
        "--backend",
        dest="demo_backend",
        choices=["asyncio", "trio"],
        default=None,
        help="event loop of the wall-clock run: asyncio (default) or trio (needs the"
        " trio extra: pip install 'stagedconsumer[trio]'); --virtual runs on trio",
    )
    parser.add_argument(
        "--virtual",
        action="store_true",
        help="run on trio in virtual time: exact and instant (needs the trio extra)",
    )
    parser.set_defaults(handler=_handle)
    from ._demo_gray import register_gray

    register_gray(parser)
