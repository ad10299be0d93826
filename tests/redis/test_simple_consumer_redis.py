"""SimpleConsumer over Redis (consumer groups, Lua receive and settle), on asyncio
(redis-py) and trio (coredis), and over several processes with SIGKILLs.

"Still invisible" is only ever checked with invisible durations far longer than the
test (a loaded machine cannot make them pass); "visible again" with short ones and a
sleep past them.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from stagedconsumer import (
    InvalidReceiptHandleError,
    ReceivedMessage,
    SimpleConsumer,
    SimpleConsumerOptions,
)
from stagedconsumer._sources._redis_broker import RedisBroker
from stagedconsumer._sources._redis_codec import default_entry_decoder
from stagedconsumer._sources._source import PROPERTY_ORIGIN_MESSAGE_ID, PROPERTY_RETRY_TOPIC
from tests.redis._workers import ROOT

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


def consumer(
    broker: RedisBroker, group: str = "g", expression: str = "*", **options: object
) -> SimpleConsumer:
    return SimpleConsumer(
        group,
        broker,
        subscriptions={"t": expression},
        await_duration=0,
        options=SimpleConsumerOptions(**options),  # type: ignore[arg-type]
    )


async def test_receive_ack_and_the_pending_entries_list(
    broker: RedisBroker, inspect: redis.Redis, namespace: str
) -> None:
    await broker.create_topic("t", 2)
    sent = [await broker.send("t", b"%d" % i, queue_id=i % 2) for i in range(6)]
    async with consumer(broker) as c:
        got = await c.receive(4, 600)
        got += await c.receive(10, 600)
        assert sorted(m.msg_id for m in got) == sorted(m.msg_id for m in sent)
        assert all(m.delivery_attempt == 1 for m in got)
        assert await c.receive(10, 600) == []
        # in flight = the consumer group's pending entries
        pending = sum(inspect.xpending(f"{namespace}:q:{{t:{q}}}", "g")["pending"] for q in (0, 1))
        assert pending == 6
        await c.ack_batch(got[:3])
        for m in got[3:]:
            await c.ack(m)
        pending = sum(inspect.xpending(f"{namespace}:q:{{t:{q}}}", "g")["pending"] for q in (0, 1))
        assert pending == 0
        with pytest.raises(InvalidReceiptHandleError, match="no longer has it"):
            await c.ack(got[0])


async def test_redelivery_after_the_invisible_time_and_expired_ack(broker: RedisBroker) -> None:
    await broker.create_topic("t", 1)
    await broker.send("t", b"x")
    async with consumer(broker) as c:
        (m,) = await c.receive(1, 0.2)
        await anyio.sleep(0.3)
        with pytest.raises(InvalidReceiptHandleError, match="expired"):
            await c.ack(m)
        (again,) = await c.receive(1, 600)
        assert again.msg_id == m.msg_id
        assert again.delivery_attempt == 2
        with pytest.raises(InvalidReceiptHandleError, match="no longer has it"):
            await c.ack(m)
        await c.ack(again)


async def test_change_invisible_duration(broker: RedisBroker) -> None:
    await broker.create_topic("t", 1)
    await broker.send("t", b"x")
    async with consumer(broker) as c:
        (m,) = await c.receive(1, 0.2)
        await c.change_invisible_duration(m, 600)
        await anyio.sleep(0.3)
        assert await c.receive(1, 600) == []
        await c.change_invisible_duration(m, 0)  # nack
        (again,) = await c.receive(1, 600)
        assert again.delivery_attempt == 2
        await c.ack(again)


async def test_dead_letter_after_max_delivery_attempts(broker: RedisBroker) -> None:
    await broker.create_topic("t", 1)
    sent = await broker.send("t", b"x", keys=["k"], properties={"p": "v"})
    async with consumer(broker, max_delivery_attempts=2) as c:
        for attempt in (1, 2):
            (m,) = await c.receive(1, 0.1)
            assert m.delivery_attempt == attempt
            await anyio.sleep(0.2)
        assert await c.receive(1, 600) == []
    (dead,) = await broker.messages("%DLQ%g")
    assert dead.msg_id == sent.msg_id
    assert dead.body == b"x"
    assert dead.properties[PROPERTY_RETRY_TOPIC] == "t"
    assert dead.properties[PROPERTY_ORIGIN_MESSAGE_ID] == sent.msg_id
    assert dead.properties["p"] == "v"
    assert dead.reconsume_times == 1


async def test_ack_batch_over_queues_acks_the_held_and_names_the_refused(
    broker: RedisBroker, inspect: redis.Redis, namespace: str
) -> None:
    await broker.create_topic("t", 3)
    for i in range(9):
        await broker.send("t", b"%d" % i, queue_id=i % 3, keys=[f"k{i % 2}"])
    async with consumer(broker, fifo=True) as c, consumer(broker, fifo=True) as d:
        got = await c.receive(10, 600)
        expired = [m for m in got if m.queue_id == 1]
        assert expired
        for m in expired:
            await c.change_invisible_duration(m, 0)  # handed back: c no longer holds them
        again = await d.receive(10, 600)
        assert {m.msg_id for m in expired} <= {m.msg_id for m in again}
        with pytest.raises(InvalidReceiptHandleError) as info:
            await c.ack_batch(got)  # three queues, one script call
        assert [m.msg_id for m in info.value.refused] == [m.msg_id for m in expired]
        await d.ack_batch(again)
        pending = sum(
            inspect.xpending(f"{namespace}:q:{{t:{q}}}", "g")["pending"] for q in (0, 1, 2)
        )
        # FIFO: acking the heads released the next message of each message group
        more = await c.receive(10, 600)
        assert pending == len(more)
        assert more


async def test_tags_are_filtered_on_the_server(broker: RedisBroker) -> None:
    await broker.create_topic("t", 3)
    for q in range(3):  # each queue's accepted tags in the one script call
        for tag in ("a", "b", "c"):
            await broker.send("t", tag.encode(), tags=tag, queue_id=q)
        await broker.send("t", b"-", queue_id=q)
    async with consumer(broker, expression="a || c") as c:
        got = await c.receive(10, 600)
        assert sorted(m.body for m in got) == [b"a", b"a", b"a", b"c", b"c", b"c"]
        await c.ack_batch(got)
        assert await c.receive(10, 600) == []


async def test_fifo_groups_across_brokers(broker: RedisBroker, redis_url: str) -> None:
    """Two brokers (as two processes would): a group's next message waits for the
    ack of the one before, received by the other."""
    await broker.create_topic("t", 2)
    for i in range(3):
        await broker.send("t", b"a%d" % i, keys=["A"])
        await broker.send("t", b"b%d" % i, keys=["B"])
    async with (
        RedisBroker(redis_url, namespace=broker.namespace) as other,
        consumer(broker, fifo=True) as c1,
        consumer(other, fifo=True) as c2,
    ):
        first = await c1.receive(10, 600)
        assert sorted(m.body for m in first) == [b"a0", b"b0"]
        assert await c2.receive(10, 600) == []
        await c1.ack(next(m for m in first if m.body == b"a0"))
        (a1,) = await c2.receive(10, 0.2)
        assert a1.body == b"a1"
        assert a1.message_group == "A"
        await anyio.sleep(0.3)  # a1 not acked: it comes back, still before a2
        (again,) = await c1.receive(10, 600)
        assert again.body == b"a1"
        assert again.delivery_attempt == 2
        await c1.ack(again)
        (a2,) = await c2.receive(10, 600)
        assert a2.body == b"a2"


async def test_fifo_by_property_on_an_attached_stream(
    broker: RedisBroker, inspect: redis.Redis, namespace: str
) -> None:
    key = f"{namespace}:external"
    for i in range(2):
        inspect.xadd(key, {"body": b"%d" % i, "order": "o1"})
    await broker.attach_stream("t", key)
    async with consumer(broker, fifo=True, message_group_property="order") as c:
        (m0,) = await c.receive(10, 600)
        assert m0.body == b"0"
        assert m0.message_group == "o1"
        await c.ack(m0)
        (m1,) = await c.receive(10, 600)
        assert m1.body == b"1"


async def test_receive_waits_for_a_message(broker: RedisBroker) -> None:
    await broker.create_topic("t", 4)
    c = SimpleConsumer("g", broker, subscriptions={"t": "*"}, await_duration=60)
    got = []
    async with c, anyio.create_task_group() as tg:

        async def receive() -> None:
            got.extend(await c.receive(4, 600))

        tg.start_soon(receive)
        await anyio.sleep(0.2)  # the receive is blocked in XREAD (or about to be)
        await broker.send("t", b"late", queue_id=3)
    assert [m.body for m in got] == [b"late"]


def _spawn(config: dict[str, object], stderr: Path) -> subprocess.Popen[str]:
    with stderr.open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.redis.simple_worker", json.dumps(config)],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )


def _read_log(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines() if line]


@pytest.mark.slow
async def test_worker_processes_with_a_sigkill_lose_nothing_and_keep_fifo_order(
    broker: RedisBroker,
    redis_url: str,
    tmp_path: Path,
    anyio_backend: str,
    inspect: redis.Redis,
) -> None:
    await broker.create_topic("t", 4)
    groups = [f"G{i}" for i in range(8)]
    order: dict[str, list[str]] = defaultdict(list)
    entry: dict[str, tuple[str, str]] = {}
    for seq in range(20):
        for group in groups:
            m = await broker.send("t", f"{group}:{seq}".encode(), keys=[group])
            order[group].append(m.msg_id)
            entry[m.msg_id] = (broker._stream_key("t", m.queue_id), f"{m.queue_offset + 1}-0")
    every = set(entry)
    log = tmp_path / "pop.log"
    config = {
        "url": redis_url,
        "namespace": broker.namespace,
        "log": str(log),
        "fifo": True,
        "invisible": 1.0,
        "backend": anyio_backend,
    }
    procs = [_spawn(config, tmp_path / f"stderr-{i}.log") for i in range(3)]
    by_pid = {str(proc.pid): proc for proc in procs}

    def stderr() -> str:
        return "\n".join((tmp_path / f"stderr-{i}.log").read_text()[-2000:] for i in range(3))

    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("READY")
        with anyio.fail_after(90):  # a guard against hanging, not a bound
            while not log.exists() or sum(r[0] == "acked" for r in _read_log(log)) < 30:
                await anyio.sleep(0.05)
            # the worker that received last (it likely holds messages)
            killed = next(r[-1] for r in reversed(_read_log(log)) if r[0] == "recv")
            by_pid[killed].send_signal(signal.SIGKILL)

            def finished() -> set[str]:
                """Acked: an ``acked`` line, or (the killed worker, killed between its
                ack and the line) an ``acking`` line last and no longer pending."""
                last: dict[str, list[str]] = {}
                done = set()
                for r in _read_log(log):
                    last[r[1]] = r
                    if r[0] == "acked":
                        done.add(r[1])
                for mid, r in last.items():
                    if mid not in done and r[0] == "acking" and r[-1] == killed:
                        stream, entry_id = entry[mid]
                        if not inspect.xpending_range(stream, "g", entry_id, entry_id, 1):
                            done.add(mid)
                return done

            while finished() != every:
                assert all(proc.poll() is None for pid, proc in by_pid.items() if pid != killed), (
                    stderr()
                )
                await anyio.sleep(0.1)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    records = _read_log(log)
    assert by_pid[killed].returncode == -signal.SIGKILL
    position: dict[tuple[str, str], int] = {}
    for index, r in enumerate(records):
        if r[0] == "recv":
            position.setdefault(("recv", r[1]), index)
        elif r[0] == "acking":
            position.setdefault(("acking", r[1]), index)
    for group, ids in order.items():
        for before, after in itertools.pairwise(ids):
            assert position[("acking", before)] < position[("recv", after)], (
                f"group {group}: {after} received before {before} was acked"
            )


async def test_a_destroyed_consumer_group_is_created_again(
    broker: RedisBroker, inspect: redis.Redis, namespace: str
) -> None:
    await broker.create_topic("t", 1)
    await broker.send("t", b"x")
    async with consumer(broker) as c:
        (m,) = await c.receive(1, 600)
        await c.ack(m)
        inspect.xgroup_destroy(f"{namespace}:q:{{t:0}}", "g")
        (again,) = await c.receive(1, 600)  # from the oldest entry: delivered again
        assert again.msg_id == m.msg_id
        assert again.delivery_attempt == 1


async def test_tags_on_an_attached_stream_are_filtered_after_decoding(
    broker: RedisBroker, inspect: redis.Redis, namespace: str
) -> None:
    key = f"{namespace}:tagged"
    for tag in ("a", "b", "b", "a"):
        inspect.xadd(key, {"body": tag, "tag": tag})
    await broker.attach_stream("t", key, decode=default_entry_decoder(tags_field="tag"))
    async with consumer(broker, expression="a") as c:
        got = await c.receive(10, 600)
        got += await c.receive(10, 600)
        assert [m.body for m in got] == [b"a", b"a"]
        assert await c.receive(10, 600) == []
    assert inspect.xpending(key, "g")["pending"] == 2  # the rejected ones were acked


async def test_ack_async_goes_with_the_next_receive(
    broker: RedisBroker, inspect: redis.Redis, namespace: str
) -> None:
    await broker.create_topic("t", 2)
    for i in range(6):
        await broker.send("t", b"%d" % i, queue_id=i % 2)
    async with consumer(broker) as c:
        got = await c.receive(6, 600)
        futures = [c.ack_async(m) for m in got]
        pending = sum(inspect.xpending(f"{namespace}:q:{{t:{q}}}", "g")["pending"] for q in (0, 1))
        assert pending == 6  # queued, not sent
        assert await c.receive(6, 600) == []
        pending = sum(inspect.xpending(f"{namespace}:q:{{t:{q}}}", "g")["pending"] for q in (0, 1))
        assert pending == 0
        for future in futures:
            await future
        refused = c.ack_async(got[0])
        with pytest.raises(InvalidReceiptHandleError, match="refused"):
            await refused


async def test_acks_sent_with_a_receive_release_fifo_heads_and_report_refusals(
    broker: RedisBroker,
) -> None:
    await broker.create_topic("t", 2)
    for i in range(2):
        await broker.send("t", b"a%d" % i, keys=["A"], queue_id=0)
        await broker.send("t", b"b%d" % i, keys=["B"], queue_id=1)
    async with consumer(broker, fifo=True) as c:
        heads = await c.receive(10, 600)
        assert sorted(m.body for m in heads) == [b"a0", b"b0"]
        assert await c.receive(10, 600) == []  # the next of each group waits
        a0, b0 = sorted(heads, key=lambda m: m.body)
        await c.ack(a0)
        again = c.ack_async(a0)  # acked already: refused
        acked = c.ack_async(b0)
        assert not acked.done()
        # one script: the acks, then the head the ack released (a1 was released by the
        # plain ack)
        assert sorted(m.body for m in await c.receive(10, 600)) == [b"a1", b"b1"]
        assert acked.done()
        await acked
        with pytest.raises(InvalidReceiptHandleError, match="refused") as info:
            await again
        assert info.value.refused == [a0]


async def test_acks_sent_with_a_receive_name_the_refused_over_queues(broker: RedisBroker) -> None:
    await broker.create_topic("t", 3)
    for i in range(9):
        await broker.send("t", b"%d" % i, queue_id=i % 3)
    async with consumer(broker) as c:
        got = await c.receive(9, 600)
        assert len(got) == 9
        refused = [got[1], got[5]]
        for m in refused:
            await c.ack(m)
        futures = [c.ack_async(m) for m in got]
        assert await c.receive(9, 600) == []  # the acks went with it
        errors = [f.exception() for f in futures]
        assert [m for m, e in zip(got, errors, strict=True) if e is not None] == refused
        assert isinstance(errors[1], InvalidReceiptHandleError)
        assert errors[1].refused == refused


async def test_acks_awaited_at_once_share_round_trips(broker: RedisBroker) -> None:
    """Group commit: acks queued while one batch is on its way go in the next."""
    await broker.create_topic("t", 2)
    for i in range(10):
        await broker.send("t", b"%d" % i, queue_id=i % 2)
    async with consumer(broker) as c:
        got = await c.receive(10, 600)
        assert len(got) == 10
        backend = c._backend
        assert backend is not None
        calls: list[int] = []
        ack_many = backend.ack_many

        async def counted(messages: Any) -> Any:
            calls.append(len(messages))
            return await ack_many(messages)

        backend.ack_many = counted  # type: ignore[method-assign]

        async def ack(message: ReceivedMessage) -> None:
            await c.ack_async(message)

        async with anyio.create_task_group() as tg:
            for m in got:
                tg.start_soon(ack, m)
        # the first batch goes alone; the nine queued while it was on its way, together
        assert calls == [1, 9]
        assert c.statistics().consumed_ok == len(got)
        assert await c.receive(10, 600) == []


async def test_dead_letters_from_gray_queues_are_marked_gray(broker: RedisBroker) -> None:
    """As the push consumer's: with the gray switch on, a message dead-lettered from a
    gray queue (of 4 with ratio 0.25: queue 3) has ``GRAY=true``, one from a normal
    queue has not."""
    await broker.create_topic("t", 4)
    await broker.send("t", b"normal", queue_id=0)
    await broker.send("t", b"gray", queue_id=3)
    options = {"max_delivery_attempts": 1, "enable_gray_switch": True, "gray_queue_ratio": 0.25}
    async with consumer(broker, **options) as c:
        assert len(await c.receive(8, 0.1)) == 2
        await anyio.sleep(0.2)
        assert await c.receive(8, 600) == []
    dead = {m.body: m.properties for m in await broker.messages("%DLQ%g")}
    assert set(dead) == {b"normal", b"gray"}
    assert "GRAY" not in dead[b"normal"]
    assert dead[b"gray"]["GRAY"] == "true"
