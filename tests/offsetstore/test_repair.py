"""Corrupt progress rows: ``offsets show`` shows them marked, ``offsets reset --force``
repairs them, fence included, and a consumer can claim the queue again."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import sqlalchemy as sa

from offsetstore import OffsetStoreError, QueueProgress, SqlOffsetStore, StageKey, StoreFencedError
from stagedconsumer import MessageQueue
from stagedconsumer._cli import main
from tests.offsetstore.test_cli_offsets import GROUP, _members, orders_on_redis, store_url

__all__ = ("orders_on_redis", "store_url")  # fixtures, used by name

BAD_FENCE = 9_000_000_000_000_000_000


def _corrupt(url: str, sql: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(sql))
    finally:
        engine.dispose()


@pytest.fixture
def corrupt_url(store_url: str) -> str:
    """orders#1 with a negative consume offset, audit#0 with a fence no epoch reaches."""
    _corrupt(
        store_url,
        "UPDATE stagedconsumer_progress SET consume_offset = -5"
        " WHERE topic = 'orders' AND queue_id = 1",
    )
    _corrupt(
        store_url,
        f"UPDATE stagedconsumer_progress SET fence = {BAD_FENCE} WHERE topic = 'audit'",
    )
    return store_url


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # messages and tables on one line each


def _claim(url: str, mq: MessageQueue, fence: int) -> QueueProgress | None:
    async def claim() -> QueueProgress | None:
        store = SqlOffsetStore(url)
        try:
            return await store.claim(GROUP, mq, fence)
        finally:
            await store.aclose()

    return anyio.run(claim)


def _rows(url: str) -> dict[MessageQueue, tuple[int | None, str, int]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT topic, queue_id, consume_offset, stage_offsets, fence"
                    " FROM stagedconsumer_progress"
                )
            ).all()
    finally:
        engine.dispose()
    return {MessageQueue(r[0], r[1]): (r[2], r[3], r[4]) for r in rows}


def test_show_prints_every_row_and_marks_the_corrupt_ones(
    corrupt_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    show = ["offsets", "show", "--store", corrupt_url, "--group", GROUP]
    assert main(show) == 1  # after the table: there are corrupt rows
    captured = capsys.readouterr()
    lines = {line.split()[1]: line for line in captured.out.splitlines() if "#" in line}
    assert set(lines) == {"audit#0", "orders#0", "orders#1", "orders#2"}
    assert "-5" in lines["orders#1"]
    assert "consume offset must be >= 0, got -5" in lines["orders#1"]
    assert str(BAD_FENCE) in lines["audit#0"]
    assert "above 2**53" in lines["audit#0"]
    assert "default=4" in lines["orders#0"]
    err = " ".join(captured.err.split())
    assert "2 corrupt progress row(s)" in err
    assert f"--group {GROUP} --topic orders --queue 1 --to-offset N --force" in err
    assert f"--group {GROUP} --topic audit --queue 0 --force" in err
    # JSON: every row, the corrupt ones with what is wrong
    assert main([*show, "--json"]) == 1
    queues = {(q["topic"], q["queue_id"]): q for q in json.loads(capsys.readouterr().out)["queues"]}
    assert queues["orders", 1]["consume_offset"] == -5
    assert queues["orders", 1]["corrupt"] == ["consume offset must be >= 0, got -5"]
    assert queues["audit", 0]["fence"] == BAD_FENCE
    assert queues["orders", 0]["corrupt"] == []
    # a corrupt row of another topic does not concern this one
    assert main([*show, "--topic", "orders", "--json"]) == 1
    capsys.readouterr()
    _corrupt(
        corrupt_url, "UPDATE stagedconsumer_progress SET consume_offset = 1 WHERE queue_id = 1"
    )
    assert main([*show, "--topic", "orders"]) == 0
    assert "orders#1" in capsys.readouterr().out


def test_reset_refuses_corrupt_rows_without_force(
    corrupt_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _rows(corrupt_url)
    args = ["offsets", "reset", "--store", corrupt_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--stage-offset", "default=0", "--yes"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "corrupt progress row(s): orders#1 (consume offset must be >= 0, got -5)" in err
    assert "--force" in err
    # --force needs the new consume offset of a row whose one cannot be read
    assert main([*args, "--queue", "1", "--force", "--yes"]) == 1
    assert "give the new one with --to-offset N" in " ".join(capsys.readouterr().err.split())
    assert _rows(corrupt_url) == before


def test_reset_force_repairs_a_negative_consume_offset(
    corrupt_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    mq = MessageQueue("orders", 1)
    with pytest.raises(OffsetStoreError, match="--to-offset N --force"):
        _claim(corrupt_url, mq, 10)  # a consumer cannot take the queue
    args = ["offsets", "reset", "--store", corrupt_url, "--group", GROUP, "--topic", "orders"]
    assert main([*args, "--queue", "1", "--to-offset", "7", "--force", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "corrupt: -5" in out
    assert "Dry run: nothing changed." in out
    assert _rows(corrupt_url)[mq][0] == -5
    assert main([*args, "--queue", "1", "--to-offset", "7", "--force", "--yes"]) == 0
    assert "Repaired 1 corrupt row(s)." in capsys.readouterr().out
    assert _rows(corrupt_url)[mq][0] == 7
    # moved as seek() moves it: the stage offsets start over from the new offset
    assert _claim(corrupt_url, mq, 10) == QueueProgress(consume_offset=7)


def test_reset_force_lowers_a_blocking_fence_only_when_told_what_it_risks(
    corrupt_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    mq = MessageQueue("audit", 0)
    epoch = 1_800_000_000_000  # a lock epoch: milliseconds of the clock
    with pytest.raises(StoreFencedError) as refused:
        _claim(corrupt_url, mq, epoch)  # blocked for good, and the error says so
    assert "the stored fence is corrupt and blocks the queue" in str(refused.value)
    assert f"--group {GROUP} --topic audit --queue 0 --force --redis URL" in str(refused.value)
    args = ["offsets", "reset", "--store", corrupt_url, "--group", GROUP, "--topic", "audit"]
    # without a broker, whether a member holds the queue is unknown: refused
    assert main([*args, "--force", "--yes"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "--allow-stale-writes" in err
    assert "write its older progress over the repair" in err
    assert _rows(corrupt_url)[mq][2] == BAD_FENCE
    assert main([*args, "--force", "--allow-stale-writes", "--yes"]) == 0
    out = capsys.readouterr().out
    assert str(BAD_FENCE) in out  # the plan shows the fence's change
    assert _rows(corrupt_url)[mq] == (99, "[]", 0)  # the rest of the row is kept
    assert _claim(corrupt_url, mq, epoch) == QueueProgress(consume_offset=99)


@pytest.mark.redis
def test_reset_force_lowers_a_blocking_fence_of_a_stopped_group(
    corrupt_url: str,
    orders_on_redis: tuple[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    redis_url, namespace = orders_on_redis
    mq = MessageQueue("audit", 0)
    args = ["offsets", "reset", "--store", corrupt_url, "--group", GROUP, "--topic", "audit",
            "--redis", redis_url, "--redis-namespace", namespace, "--yes"]  # fmt: skip
    _members(redis_url, namespace, "heartbeat", "host@1@aa")
    assert main([*args, "--force"]) == 1  # a live member: --force is not enough
    err = " ".join(capsys.readouterr().err.split())
    assert "has live member(s) (host@1@aa)" in err
    assert "--allow-stale-writes" in err
    assert _rows(corrupt_url)[mq][2] == BAD_FENCE
    _members(redis_url, namespace, "leave", "host@1@aa")
    assert main([*args, "--force"]) == 0  # the group is stopped: repaired
    assert _rows(corrupt_url)[mq][2] == 0


def test_a_fence_far_ahead_of_the_clock_is_marked(
    store_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ahead = 4_000_000_000_000  # milliseconds: the year 2096
    _corrupt(store_url, f"UPDATE stagedconsumer_progress SET fence = {ahead} WHERE topic = 'audit'")
    assert main(["offsets", "show", "--store", store_url, "--group", GROUP, "--json"]) == 1
    queues = json.loads(capsys.readouterr().out)["queues"]
    (audit,) = (q for q in queues if q["topic"] == "audit")
    assert "ahead of this machine's clock" in audit["corrupt"][0]


def test_to_offset_drops_the_stage_offsets_as_seek_does_and_says_so(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders",
            "--queue", "0", "--yes"]  # fmt: skip
    assert main([*args, "--to-offset", "3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "every other stored one is dropped" in out
    assert "as seek() does" in out
    progress = _claim(store_url, MessageQueue("orders", 0), 1)
    assert progress == QueueProgress(consume_offset=3)
    q1 = MessageQueue("orders", 1)
    assert main([*args[:-3], "--queue", "1", "--to-offset", "2", "--keep-stage-offsets",
                 "--yes"]) == 0  # fmt: skip
    assert "the other stored ones are kept" in " ".join(capsys.readouterr().out.split())
    assert _claim(store_url, q1, 1) == QueueProgress(
        consume_offset=2, stage_offsets={StageKey("default", None): 5, StageKey("vip", ""): 1}
    )
    assert main([*args, "--to-offset", "4", "--stage-offset", "vip/=2"]) == 0
    assert _claim(store_url, MessageQueue("orders", 0), 1) == QueueProgress(
        consume_offset=4, stage_offsets={StageKey("vip", ""): 2}
    )


def test_a_stage_key_of_a_strategy_the_group_never_stored_is_refused(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["offsets", "reset", "--store", store_url, "--group", GROUP, "--topic", "orders",
            "--queue", "0", "--yes"]  # fmt: skip
    before = _rows(store_url)
    assert main([*args, "--stage-offset", "defualt=3"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "--stage-offset names strategy 'defualt', which no stored progress" in err
    assert "(it has 'default', 'vip')" in err
    assert _rows(store_url) == before
    assert main([*args, "--stage-offset", "default/k1=3"]) == 0  # a new group of a known one
    assert main([*args, "--stage-offset", "fresh=3", "--new-stage-key"]) == 0
    stages = _claim(store_url, MessageQueue("orders", 0), 1)
    assert stages is not None
    assert stages.stage_offsets[StageKey("fresh", None)] == 3
