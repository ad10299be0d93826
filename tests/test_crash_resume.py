"""Crash-resume: a staged consumer killed with SIGKILL at random moments, restarted.

The consumer runs in a subprocess (``tests/crash_resume_worker.py``) with progress in
a SQLite file or PostgreSQL and a source with the same content at every start. Each
run is killed at a random moment (``SIGKILL``: no shutdown, no final persist) and
restarted; the last run goes to the end. The worker's append-only, fsynced event log
then has to show:

- no message lost: every message completed;
- stages kept and the stage barrier held across restarts, checked by the kit
  (``stagedconsumer.testing.assert_staged(..., within_runs=True)``): every handler
  call of a message saw the stage computed from the queue contents, in every run;
  for each queue and stage key, every start of a later stage comes after the first
  completion of every message of the stage before, and within each run after the
  completion of every message of that stage the run consumed again;
- progress committed as a unit and never regressed: every committed (and resumed)
  consume offset only grows, every message below it had completed when it was
  committed, and its stage offsets are exactly those of the messages below it;
- duplicates only within what was in flight at each kill: a message runs again in a
  later run only if it was at or above the last committed offset of its queue when
  the previous run died.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from stagedconsumer import ConsumeStagedConcurrentlyContext, Message, MessageQueue
from stagedconsumer.testing import CallLog, HandlerCall, Outcome, StagePlan, assert_staged
from tests.crash_resume_worker import QUEUES, STAGES, TOPIC, content

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
KILLS = 5


def _read_log(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open() as f:
        for pos, line in enumerate(f):
            assert line.endswith("\n"), f"torn log line {pos}: {line!r}"
            record = json.loads(line)
            record["pos"] = pos
            records.append(record)
    return records


def _wait_for(log: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait until ``needle`` is in the log; ``False`` when the process exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and needle in log.read_text():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    raise AssertionError(f"{needle!r} did not appear in the log within {timeout} s")


def _crash_and_resume(store_url: str, prefix: str, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    log = tmp_path / "events.jsonl"
    stderr = (tmp_path / "stderr.txt").open("ab")

    def start(run: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.crash_resume_worker",
                "--store",
                store_url,
                "--prefix",
                prefix,
                "--log",
                str(log),
                "--run",
                str(run),
                "--backend",
                "trio" if run % 2 else "asyncio",
                "--persist-interval",
                "0.05",
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )

    try:
        for run in range(KILLS):
            proc = start(run)
            try:
                # Kill at a random moment after the run began handling messages (the
                # start-up time varies too much with the machine's load to aim at).
                assert _wait_for(log, f'"ev":"run","run":{run},', proc, 30), "died early"
                if _wait_for(log, f'"ev":"start","run":{run},', proc, 30):
                    time.sleep(rng.uniform(0.0, 0.3))
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=30)
        final = start(KILLS)
        try:
            assert final.wait(timeout=60) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
        finally:
            if final.poll() is None:
                final.kill()
                final.wait()
    finally:
        stderr.close()
    _check_log(_read_log(log), seed)


def _message(q: int, o: int, key: str, attempt: int = 0) -> Message:
    """A stand-in for the message at ``q``/``o`` (its id is its position)."""
    return Message(
        topic=TOPIC,
        queue_id=q,
        queue_offset=o,
        body=b"",
        keys=(key,),
        msg_id=f"{q}:{o}",
        reconsume_times=attempt,
    )


def _call_log(records: list[dict[str, Any]]) -> CallLog:
    """The handler events as a kit :class:`CallLog` (in log order; one run at a time)."""
    log = CallLog()
    running: dict[tuple[int, int, int], HandlerCall] = {}
    for r in records:
        if r["ev"] not in ("start", "fail", "done"):
            continue
        where = (r["run"], r["q"], r["o"])
        if r["ev"] == "start":
            log.run = r["run"]
            context = ConsumeStagedConcurrentlyContext(
                message_queue=MessageQueue(TOPIC, r["q"]),
                stage_index=r["stage"],
                strategy_id="default",
                group_id=r["sg"],
            )
            message = _message(r["q"], r["o"], r["sg"], r["attempt"])
            running[where] = log.start_call([message], context, float(r["pos"]))
        else:
            outcome = Outcome.SUCCESS if r["ev"] == "done" else Outcome.RAISED
            log.end_call(running.pop(where), float(r["pos"]), outcome, acked=1)
    return log


def _check_log(records: list[dict[str, Any]], seed: int) -> None:
    where = f"(kill timing seed {seed})"
    messages = content()
    key_of = {
        (q, o): spec["key"] for q, specs in enumerate(messages) for o, spec in enumerate(specs)
    }

    def stage_offsets_at(q: int, c: int) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for o in range(c):
            counts[f"default|{key_of[(q, o)]}"] += 1
        return dict(counts)

    def nonzero(so: dict[str, int]) -> dict[str, int]:
        return {k: v for k, v in so.items() if v}

    runs = sorted({r["run"] for r in records})
    assert runs == list(range(KILLS + 1)), where
    run_start = {r["run"]: r["pos"] for r in records if r["ev"] == "run"}
    finished = {r["run"] for r in records if r["ev"] == "finished"}
    assert KILLS in finished, where
    handled = [r for r in records if r["ev"] in ("start", "fail", "done")]
    killed_mid_work = [
        run for run in range(KILLS) if run not in finished and any(r["run"] == run for r in handled)
    ]
    summary = {
        run: (
            "finished" if run in finished else "killed",
            sum(1 for r in handled if r["run"] == run and r["ev"] == "start"),
            sum(1 for r in handled if r["run"] == run and r["ev"] == "done"),
        )
        for run in runs
    }
    assert len(killed_mid_work) >= 2, f"too few kills hit a working consumer {summary} {where}"

    # Stages kept, in every run and every attempt, and the stage barrier across runs
    # and within each run (the kit's staged check; one stage key per order key).
    sent = [_message(q, o, key) for (q, o), key in sorted(key_of.items())]
    plan = StagePlan.from_definitions({"default": STAGES}, sent, compute_group=lambda m: m.keys[0])
    assert_staged(_call_log(records), plan, within_runs=True)

    # No message lost; no message completed twice within one run.
    done = [r for r in records if r["ev"] == "done"]
    first_done: dict[tuple[int, int], int] = {}
    per_run: set[tuple[int, int, int]] = set()
    for r in done:
        m = (r["q"], r["o"])
        first_done.setdefault(m, r["pos"])
        assert (r["run"], *m) not in per_run, f"{m} completed twice in run {r['run']} {where}"
        per_run.add((r["run"], *m))
    assert set(first_done) == set(key_of), f"lost: {sorted(set(key_of) - set(first_done))}"

    # Progress: committed as a unit, never past an unfinished message, never backwards.
    last_persisted: dict[int, int] = defaultdict(int)
    resumed: dict[tuple[int, int], int] = {}
    persisted_before_run: dict[tuple[int, int], int] = {}
    for r in records:
        if r["ev"] == "run":
            for q in range(QUEUES):
                persisted_before_run[(r["run"], q)] = last_persisted[q]
        if r["ev"] not in ("persisted", "resume"):
            continue
        q = r["q"]
        c = r["c"] if r["c"] is not None else 0
        assert nonzero(r["so"]) == stage_offsets_at(q, c), f"not one unit: {r} {where}"
        if r["ev"] == "persisted":
            assert c >= last_persisted[q], f"committed offset went back: {r} {where}"
            unfinished = [o for o in range(c) if first_done.get((q, o), 1 << 60) > r["pos"]]
            assert not unfinished, f"committed {c} past unfinished {unfinished} {where}"
            last_persisted[q] = c
        else:
            assert c >= persisted_before_run[(r["run"], q)], f"resumed behind: {r} {where}"
            resumed[(r["run"], q)] = c
    for q in range(QUEUES):
        offsets = [resumed[(run, q)] for run in runs if (run, q) in resumed]
        assert offsets == sorted(offsets), f"resume offsets of queue {q} went back {where}"

    # Duplicates only within what was uncommitted (in flight) when the previous run died.
    duplicates = 0
    for r in records:
        if r["ev"] != "start" or r["attempt"] != 0:
            continue
        m = (r["q"], r["o"])
        if first_done[m] < run_start[r["run"]]:
            duplicates += 1
            floor = persisted_before_run[(r["run"], r["q"])]
            assert r["o"] >= floor, f"{m} re-ran below committed offset {floor} {where}"

    print(f"crash-resume: {len(killed_mid_work)} kills mid-work, {duplicates} duplicates")


def _seed() -> int:
    return int(os.environ.get("CRASH_RESUME_SEED", random.randrange(1 << 30)))


def test_crash_resume_on_sqlite(tmp_path: Path) -> None:
    _crash_and_resume(f"sqlite:///{tmp_path / 'progress.db'}", "stagedconsumer_", tmp_path, _seed())


@pytest.mark.postgres
def test_crash_resume_on_postgresql(tmp_path: Path) -> None:
    from tests.offsetstore.conftest import POSTGRES_URL, drop_tables, require_url

    url = require_url("PostgreSQL", POSTGRES_URL)
    prefix = f"crash{uuid.uuid4().hex[:8]}_"
    try:
        _crash_and_resume(url, prefix, tmp_path, _seed())
    finally:
        drop_tables(url, prefix)
