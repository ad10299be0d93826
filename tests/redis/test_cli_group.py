"""``stagedconsumer group show`` against a real Redis: owners that are not live,
retry queue owners, gray queues."""

from __future__ import annotations

import re

import anyio
import pytest

from stagedconsumer import MessageQueue
from stagedconsumer._cli import main
from stagedconsumer._sources._group import GroupOptions
from stagedconsumer._sources._redis_broker import RedisBroker

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

GRAY = "host@2@bb@gray[0.5]"


async def test_group_show_marks_an_owner_that_is_not_live(
    broker: RedisBroker, redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await broker.create_topic("t", 4)
    # A member that stops heartbeating (killed with kill -9) leaves the live members
    # after its member ttl; its queue lock stays until the lock expires (60 s).
    async with RedisBroker(
        redis_url, namespace=namespace, group_options=GroupOptions(member_ttl=0.2)
    ) as short:
        dying = short.group_coordinator()
        await dying.heartbeat("g", "host@1@aa")
        assert await dying.lock("g", "host@1@aa", [MessageQueue("t", 0)])
    coordinator = broker.group_coordinator()
    for member, mq in [
        ("host@3@cc", MessageQueue("t", 1)),
        (GRAY, MessageQueue("t", 3)),
        (GRAY, MessageQueue("%RETRY%g", 1)),
        ("host@3@cc", MessageQueue("%RETRY%g", 0)),
    ]:
        await coordinator.heartbeat("g", member)
        assert await coordinator.lock("g", member, [mq])
    with anyio.fail_after(10):
        while "host@1@aa" in await coordinator.members("g"):
            await anyio.sleep(0.05)

    args = ["group", "show", "--group", "g", "--topic", "t"]
    args += ["--redis", redis_url, "--redis-namespace", namespace]
    assert await anyio.to_thread.run_sync(main, args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "group g: 2 live member(s)",
        "  host@2@bb@gray[0.5]  gray (ratio 0.5)",
        "  host@3@cc  normal",
    ]
    match = re.fullmatch(
        r"  t#0: host@1@aa \(not live: lock held until it expires, in (\d+) s\)", lines[4]
    )
    assert match, lines[4]
    assert 50 <= int(match.group(1)) <= 60  # GroupOptions().lock_ttl
    assert lines[3:] == [
        "queues of topic t:",
        lines[4],
        "  t#1: host@3@cc",
        "  t#2: -  gray",  # the last half of the queues: the gray member's ratio is 0.5
        f"  t#3: {GRAY}  gray",
        "retry queues of group g:",
        "  %RETRY%g#0: host@3@cc",
        f"  %RETRY%g#1: {GRAY}  gray",
    ]


async def test_group_show_without_gray_members_marks_no_queue(
    broker: RedisBroker, redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    coordinator = broker.group_coordinator()
    await coordinator.heartbeat("g", "host@3@cc")
    assert await coordinator.lock("g", "host@3@cc", [MessageQueue("%RETRY%g", 1)])
    args = ["group", "show", "--group", "g", "--redis", redis_url, "--redis-namespace", namespace]
    assert await anyio.to_thread.run_sync(main, args) == 0
    assert capsys.readouterr().out.splitlines() == [
        "group g: 1 live member(s)",
        "  host@3@cc  normal",
        "retry queues of group g:",
        "  %RETRY%g#0: -",
        "  %RETRY%g#1: host@3@cc",
    ]


async def test_group_show_errors_go_to_stderr(
    redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["group", "show", "--group", "g", "--topic", "nope"]
    args += ["--redis", redis_url, "--redis-namespace", namespace]
    assert await anyio.to_thread.run_sync(main, args) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {redis_url}: topic 'nope' does not exist")
