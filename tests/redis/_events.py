"""Reading and checking the event logs of consumer processes (see group_worker)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import attrs

from .group_worker import stage_of


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


def check_stages_and_barrier(events: list[Event]) -> None:
    """Each message ran in the stage its offset implies, and no message of a later
    stage of a queue started before every message of each earlier stage finished
    (once, anywhere)."""
    first_end: dict[tuple[int, int], float] = {}
    for e in events:
        assert e.stage == stage_of(e.offset), e
        if e.kind == "E":
            first_end.setdefault((e.queue, e.offset), e.time)
    stage_done: dict[tuple[int, int], float] = {}
    for (queue, offset), at in first_end.items():
        key = (queue, stage_of(offset))
        stage_done[key] = max(stage_done.get(key, 0.0), at)
    for e in events:
        if e.kind != "S":
            continue
        stage = e.stage if e.stage >= 0 else 99
        for earlier in range(min(stage, 3)):
            done = stage_done.get((e.queue, earlier))
            assert done is not None, f"stage {earlier} of queue {e.queue} never finished"
            assert e.time >= done, (
                f"barrier broken on queue {e.queue}: offset {e.offset} (stage {e.stage}) started"
                f" at {e.time:.6f} before stage {earlier} finished at {done:.6f}"
            )


def starts_by_message(events: list[Event]) -> dict[tuple[int, int], list[Event]]:
    starts: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in events:
        if e.kind == "S":
            starts[(e.queue, e.offset)].append(e)
    return starts
