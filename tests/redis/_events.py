"""Reading the event logs of consumer processes (see group_worker) and checking them
with the kit (``stagedconsumer.testing``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

from stagedconsumer import ConsumeStagedConcurrentlyContext, Message, MessageQueue
from stagedconsumer.testing import CallLog, HandlerCall, Outcome, StagePlan, assert_staged

from .group_worker import STAGES

TOPIC = "t"
DEFAULT_STRATEGY = "default"


@attrs.frozen
class Event:
    kind: str
    queue: int
    offset: int
    stage: int
    time: float
    pid: int


def read_events(paths: Iterable[Path]) -> list[Event]:
    events = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 6:
                continue  # a line cut by SIGKILL (never fsynced, never acted on)
            kind, queue, offset, stage, at, pid = parts
            events.append(Event(kind, int(queue), int(offset), int(stage), float(at), int(pid)))
    return sorted(events, key=lambda e: e.time)


def _message(queue: int, offset: int) -> Message:
    """A stand-in for the message at ``queue``/``offset`` (the logs keep no bodies):
    its id is its position, the same for every delivery of it."""
    return Message(
        topic=TOPIC, queue_id=queue, queue_offset=offset, body=b"", msg_id=f"{queue}:{offset}"
    )


def call_log(events: Iterable[Event]) -> CallLog:
    """The events as a kit :class:`CallLog`: one call per message and process, in the
    order the events happened (at equal times an end before a start: the old check
    allowed a start at the very instant the stage before ended). A start without an end
    is a call cut by a kill (still running)."""
    log = CallLog()
    runs: dict[int, int] = {}
    running: dict[tuple[int, int, int], HandlerCall] = {}
    for e in sorted(events, key=lambda e: (e.time, e.kind != "E")):
        where = (e.pid, e.queue, e.offset)
        if e.kind == "S":
            log.run = runs.setdefault(e.pid, len(runs))
            context = ConsumeStagedConcurrentlyContext(
                message_queue=MessageQueue(TOPIC, e.queue),
                stage_index=e.stage,
                strategy_id=DEFAULT_STRATEGY,
                group_id=None,
            )
            running[where] = log.start_call([_message(e.queue, e.offset)], context, e.time)
        elif e.kind == "E":
            log.end_call(running.pop(where), e.time, Outcome.SUCCESS, acked=1)
    return log


def check_stages_and_barrier(
    events: list[Event],
    *,
    queues: int = 0,
    per_queue: int = 0,
    ends: Mapping[int, int] | None = None,
) -> None:
    """The kit's staged check (``stagedconsumer.testing.assert_staged``) on the events
    of ``queues`` queues of ``per_queue`` messages each (or of the queues of ``ends``,
    queue id to end offset): every message ran in the stage its offset implies, and no
    message of a later stage of a queue started before every message of each earlier
    stage finished (once, in any process)."""
    if ends is None:
        ends = dict.fromkeys(range(queues), per_queue)
    sent = [_message(q, o) for q, end in sorted(ends.items()) for o in range(end)]
    assert_staged(call_log(events), StagePlan.from_definitions({DEFAULT_STRATEGY: STAGES}, sent))


def starts_by_message(events: list[Event]) -> dict[tuple[int, int], list[Event]]:
    starts: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in events:
        if e.kind == "S":
            starts[(e.queue, e.offset)].append(e)
    return starts
