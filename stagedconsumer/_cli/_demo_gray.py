"""``stagedconsumer demo gray``: gray release (RIP-72) on the embedded broker.

A normal and a gray consumer of one staged group share a topic of 8 queues (gray
ratio 0.25: queues 6 and 7 are gray). A producer sends normal and gray orders with
keys through SelectMessageQueueByGray; the first gray message of some orders fails
once. Then the gray consumer stops (a rollback or a promotion) and more gray
traffic is sent: the normal consumer takes the gray queues over where the gray one
committed. Every check below is computed from the log of handler calls.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence

import anyio
import attrs

from offsetstore import MemoryOffsetStore

from .._listeners import ConsumeStagedConcurrentlyContext, MessageListenerStagedConcurrently
from .._message import Message
from .._options import ConsumerOptions
from .._runtime._consumer import PushConsumer
from .._runtime._producer import Producer
from .._sources._memory import MemoryBroker
from .._sources._selectors import SelectMessageQueueByGray

__all__ = ("GrayDemoResult", "register_gray", "run_gray_demo")

TOPIC = "orders"
RATIO = 0.25
STAGES = (2, 3)


@attrs.frozen(kw_only=True)
class Call:
    """One message in one handler call."""

    event: str  # "start" or "end"
    consumer: str
    queue_id: int
    offset: int
    gray: bool  # sent as gray traffic
    attempt: int  # reconsume_times
    phase: int


@attrs.frozen(kw_only=True)
class GrayDemoResult:
    checks: tuple[tuple[str, bool], ...]
    handled: dict[str, dict[str, int]]
    """Per phase ("both running" / "gray stopped"), messages handled per consumer."""

    @property
    def ok(self) -> bool:
        return all(ok for _, ok in self.checks)


class _Listener(MessageListenerStagedConcurrently):
    def __init__(self, name: str, log: list[Call], phase: list[int], failed: set[str]) -> None:
        self.name = name
        self.log = log
        self.phase = phase
        self.failed = failed

    def get_stage_definitions(self) -> Sequence[int]:
        return STAGES

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        def call(event: str, m: Message) -> Call:
            gray = m.properties.get("lane") == "gray"
            return Call(
                event=event,
                consumer=self.name,
                queue_id=m.queue_id,
                offset=m.queue_offset,
                gray=gray,
                attempt=m.reconsume_times,
                phase=self.phase[0],
            )

        self.log.extend(call("start", m) for m in msgs)
        await anyio.sleep(0.002)
        for m in msgs:  # the first gray message of every third order fails once
            first = m.body.endswith(b":0") and m.keys[0].endswith("0")
            if first and m.properties.get("lane") == "gray" and m.msg_id not in self.failed:
                self.failed.add(m.msg_id)
                context.suspend_current_queue_time_millis = 10
                raise RuntimeError(f"{m.keys[0]} fails once")
        self.log.extend(call("end", m) for m in msgs)


def _stage_start(offset: int) -> int:
    start = 0
    for size in STAGES:
        if offset < start + size:
            return start
        start += size
    return start


def _stage_order_kept(log: Sequence[Call]) -> bool:
    ended: dict[int, set[int]] = defaultdict(set)
    for c in log:
        if c.event == "end":
            ended[c.queue_id].add(c.offset)
        elif not set(range(_stage_start(c.offset))) <= ended[c.queue_id]:
            return False
    return True


async def run_gray_demo(*, orders: int = 12, events: int = 4) -> GrayDemoResult:
    """Run the demo; ``orders`` orders of ``events`` messages each per phase, half
    of them gray."""
    broker = MemoryBroker()
    broker.create_topic(TOPIC, 8)
    log: list[Call] = []
    phase = [1]
    failed: set[str] = set()
    sent: set[tuple[int, int]] = set()
    gray_queues = {6, 7}
    selector = SelectMessageQueueByGray(RATIO, gray_property="lane", gray_value="gray")
    producer = Producer(broker)
    store = MemoryOffsetStore()  # the group's progress, shared by its members

    def consumer(name: str, gray: bool) -> PushConsumer:
        options = ConsumerOptions(
            enable_gray_switch=True, gray_tag=gray, gray_queue_ratio=RATIO, consume_thread_max=8
        )
        listener = _Listener(name, log, phase, failed)
        c = PushConsumer("shop", broker, listener, offset_store=store, options=options)
        c.subscribe(TOPIC)
        return c

    async def send_orders(first: int) -> None:
        for order in range(first, first + orders):
            lane = "gray" if order % 2 else "normal"
            for event in range(events):
                result = await producer.send(
                    TOPIC,
                    f"order-{order}:{event}".encode(),
                    keys=[f"order-{order}0" if order % 3 == 0 else f"order-{order}"],
                    properties={"lane": lane},
                    selector=selector,
                )
                sent.add((result.message_queue.queue_id, result.queue_offset))

    def done() -> bool:
        return {(c.queue_id, c.offset) for c in log if c.event == "end"} >= sent

    async def until(predicate: Callable[[], bool], timeout: float = 30) -> None:
        with anyio.fail_after(timeout):
            while not predicate():  # noqa: ASYNC110 - consumer state has no event to wait on
                await anyio.sleep(0.01)

    normal, gray = consumer("normal", False), consumer("gray", True)
    async with producer, normal:
        async with gray:
            await until(lambda: len(gray.assigned_queues) == 2)
            await send_orders(0)
            await until(done)
        phase[0] = 2
        await until(lambda: len(normal.assigned_queues) == 8)  # the gray queues handed over
        await send_orders(orders)
        await until(done)
    ends = [c for c in log if c.event == "end"]
    first = [c for c in ends if c.phase == 1]
    checks = (
        (
            "gray traffic only on gray queues",
            all((c.queue_id in gray_queues) == c.gray for c in ends),
        ),
        (
            "gray traffic handled only by the gray consumer (while it ran)",
            all(c.consumer == "gray" for c in first if c.gray),
        ),
        (
            "normal traffic handled only by the normal consumer",
            all(c.consumer == "normal" for c in ends if not c.gray),
        ),
        (
            f"retried gray messages ({sum(1 for c in ends if c.attempt)}) still gray,"
            " on the gray consumer",
            any(c.attempt for c in first)
            and all(c.gray and c.consumer == "gray" for c in first if c.attempt),
        ),
        (
            "after the gray consumer stopped, the normal one handled the gray traffic",
            any(c.gray for c in ends if c.phase == 2)
            and all(c.consumer == "normal" for c in ends if c.phase == 2),
        ),
        (
            f"nothing lost: all {len(sent)} messages handled",
            {(c.queue_id, c.offset) for c in ends} == sent,
        ),
        (
            "nothing handled twice across the hand-over",
            len({(c.queue_id, c.offset) for c in ends}) == len(ends),
        ),
        ("stage order kept on every queue, across the hand-over", _stage_order_kept(log)),
    )
    handled: dict[str, dict[str, int]] = {}
    for number, label in ((1, "both running"), (2, "gray stopped")):
        counts: dict[str, int] = defaultdict(int)
        for c in ends:
            if c.phase == number:
                counts[f"{c.consumer} <- {'gray' if c.gray else 'normal'} traffic"] += 1
        handled[label] = dict(sorted(counts.items()))
    return GrayDemoResult(checks=checks, handled=handled)


def demo_options_given(args: argparse.Namespace) -> list[str]:
    """The ``demo`` options given on the command line (``demo gray`` takes none)."""
    names = {
        "messages": "--messages",
        "cost_ms": "--cost-ms",
        "workers": "--workers",
        "stages": "--stages",
        "keys": "--keys",
        "demo_backend": "--backend",
    }
    given = [flag for dest, flag in names.items() if getattr(args, dest, None) is not None]
    if getattr(args, "virtual", False):
        given.append("--virtual")
    return given


def _handle(args: argparse.Namespace) -> int:
    ignored = demo_options_given(args)
    if ignored:
        sys.stderr.write(
            f"error: demo gray takes --orders, --events and --backend (after 'gray');"
            f" {', '.join(ignored)} before 'gray' belong(s) to the RIP-22 demo and would be"
            " ignored\n"
        )
        return 2
    # the planned failures would print their tracebacks through logging's last resort
    quiet = logging.getLogger("stagedconsumer")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    result = anyio.run(
        lambda: run_gray_demo(orders=args.orders, events=args.events), backend=args.backend
    )
    for label, counts in result.handled.items():
        print(f"{label}:")
        for who, count in counts.items():
            print(f"  {who}: {count}")
    print("checks (from the handler-call log):")
    for text, ok in result.checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {text}")
    return 0 if result.ok else 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text}")
    return value


def register_gray(demo: argparse.ArgumentParser) -> None:
    """Add ``demo gray`` under the ``demo`` command."""
    commands = demo.add_subparsers(dest="demo_command", metavar="{gray}")
    parser = commands.add_parser(
        "gray",
        help="gray release (RIP-72) on the embedded broker: who consumes what, cut-over",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--orders", type=_positive_int, default=12, metavar="N", help="orders per phase (12)"
    )
    parser.add_argument(
        "--events", type=_positive_int, default=4, metavar="N", help="messages per order (4)"
    )
    parser.add_argument(
        "--backend", choices=["asyncio", "trio"], default="asyncio", help="event loop (asyncio)"
    )
    parser.set_defaults(handler=_handle)
