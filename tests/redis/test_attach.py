"""RedisBroker.attach_stream: streams written by other applications with plain XADD,
consumed without the broker's producer: offsets from entry ids, staged semantics on
sparse offsets, flow control in messages, lag, decoders, start by time."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlparse

import anyio
import pytest
import redis

from offsetstore import MemoryOffsetStore
from stagedconsumer import (
    ConfigurationError,
    ConsumeConcurrentlyContext,
    ConsumerOptions,
    ConsumeStagedConcurrentlyContext,
    Message,
    MessageListenerConcurrently,
    MessageListenerStagedConcurrently,
    MessageQueue,
    OutgoingMessage,
    PushConsumer,
    SourceError,
)
from stagedconsumer._sources._redis_broker import RedisBroker
from stagedconsumer._sources._redis_codec import _attached_id, _attached_offset
from tests.redis.conftest import entry_id

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

FAST = ConsumerOptions(pull_long_polling_timeout=0.2, persist_consumer_offset_interval=0.1)


@pytest.fixture
def streams(namespace: str, inspect: redis.Redis) -> Iterator[list[str]]:
    keys = [f"{namespace}:orders:{i}" for i in range(2)]
    yield keys
    inspect.delete(*keys)


class Staged(MessageListenerStagedConcurrently):
    def __init__(self, stages: Sequence[int]) -> None:
        self.stages = list(stages)
        self.seen: list[tuple[Message, int]] = []

    def get_stage_definitions(self) -> Sequence[int]:
        return self.stages

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeStagedConcurrentlyContext
    ) -> None:
        self.seen += [(m, context.stage_index) for m in msgs]


async def _consume(
    broker: RedisBroker, listener: Staged, store: MemoryOffsetStore, topic: str = "orders"
) -> None:
    consumer = PushConsumer("billing", broker, listener, offset_store=store, options=FAST)
    consumer.subscribe(topic)
    async with consumer:
        await consumer.wait_caught_up(timeout=10)


def test_entry_ids_map_to_ordered_offsets_without_loss() -> None:
    ids = [b"0-1", b"5-0", b"5-1", b"5-524287", b"6-0", b"1763900000000-0", b"1763900000000-7"]
    offsets = [_attached_offset(i) for i in ids]
    assert offsets == sorted(offsets)
    assert len(set(offsets)) == len(offsets)
    assert [_attached_id(o) for o in offsets] == ids
    assert _attached_id(offsets[3] + 1) == b"6-0"  # resuming after 5-524287
    assert max(offsets) < 2**63


async def test_plain_xadd_entries_are_consumed_staged_and_resume_after_the_last(
    broker: RedisBroker, streams: list[str], inspect: redis.Redis
) -> None:
    ids = [
        entry_id(inspect.xadd(streams[0], {"body": f"order {i}", "shop": "s1"})).decode()
        for i in range(3)
    ]
    queues = await broker.attach_stream("orders", streams)
    assert queues == [MessageQueue("orders", 0), MessageQueue("orders", 1)]
    store = MemoryOffsetStore()
    first = Staged([2])
    await _consume(broker, first, store)
    got = [m for m, _ in first.seen]
    assert [m.msg_id for m in got] == ids
    assert [m.body for m in got] == [b"order 0", b"order 1", b"order 2"]
    assert all(dict(m.properties) == {"shop": "s1"} for m in got)
    offsets = [m.queue_offset for m in got]
    assert offsets == sorted(set(offsets))  # distinct, increasing
    assert [stage for _, stage in first.seen] == [0, 0, -1]  # stages count messages
    assert abs(got[0].born_timestamp - time.time()) < 60
    progress = await store.read_progress("billing", MessageQueue("orders", 0))
    assert progress is not None
    assert progress.consume_offset == offsets[-1] + 1
    # Two more entries: a new consumer on the same store takes only those.
    inspect.xadd(streams[0], {"body": "order 3"})
    inspect.xadd(streams[0], {"body": "order 4"})
    second = Staged([2])
    await _consume(broker, second, store)
    assert [m.body for m, _ in second.seen] == [b"order 3", b"order 4"]
    assert [stage for _, stage in second.seen] == [-1, -1]  # stage offsets resumed


async def test_max_offset_min_offset_and_lag_in_messages(
    broker: RedisBroker, streams: list[str], inspect: redis.Redis
) -> None:
    mq = MessageQueue("orders", 0)
    await broker.attach_stream("orders", streams)
    assert await broker.max_offset(mq) == 0  # no stream yet
    assert await broker.min_offset(mq) == 0
    for i in range(5):
        inspect.xadd(streams[0], {"body": str(i)}, id=f"{1000 * (i + 1)}-0")
    pulled = await broker.pull(mq, 0, 2)
    assert [m.msg_id for m in pulled.messages] == ["1000-0", "2000-0"]
    assert await broker.min_offset(mq) == _attached_offset(b"1000-0")
    assert await broker.max_offset(mq) == _attached_offset(b"5000-0") + 1
    assert await broker.entries_after(mq, pulled.next_offset) == 3
    assert await broker.entries_after(mq, 0) == 5
    inspect.xtrim(streams[0], maxlen=0)  # trimmed: the max offset stays
    assert await broker.max_offset(mq) == _attached_offset(b"5000-0") + 1
    assert await broker.min_offset(mq) == _attached_offset(b"5000-0") + 1


async def test_long_poll_wakes_on_a_plain_xadd(
    broker: RedisBroker, streams: list[str], inspect: redis.Redis
) -> None:
    mq = MessageQueue("orders", 1)
    await broker.attach_stream("orders", streams)
    entry = entry_id(inspect.xadd(streams[1], {"body": "x"}))
    offset = (await broker.pull(mq, 0, 10)).next_offset
    assert offset == _attached_offset(entry) + 1

    async def later() -> None:
        await anyio.sleep(0.3)
        inspect.xadd(streams[1], {"body": "y"})

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        started = time.monotonic()
        pulled = await broker.pull(mq, offset, 10, timeout=60)
    assert [m.body for m in pulled.messages] == [b"y"]
    assert time.monotonic() - started < 30  # woken by the XADD, long before its timeout
    started = time.monotonic()
    idle = await broker.pull(mq, pulled.next_offset, 10, timeout=0.3)
    assert idle.messages == []
    assert idle.next_offset == pulled.next_offset
    assert time.monotonic() - started >= 0.25


class Blocking(MessageListenerConcurrently):
    """The first message waits for ``release``; the others finish at once."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.done: list[int] = []

    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        for m in msgs:
            if m.body == b"0":
                await self.release.wait()
            self.done.append(int(m.body))


@pytest.mark.slow
async def test_concurrent_span_limit_counts_messages_not_id_distance(
    broker: RedisBroker, streams: list[str], inspect: redis.Redis
) -> None:
    # Entries a second apart: 1000 * 2**19 offsets between neighbours.
    for i in range(40):
        inspect.xadd(streams[0], {"body": str(i)}, id=f"{1000 * (i + 1)}-0")
    broker.read_ahead = 0
    await broker.attach_stream("orders", streams[:1])
    listener = Blocking()
    options = ConsumerOptions(
        pull_batch_size=2,
        consume_message_batch_max_size=1,
        consume_concurrently_max_span=10,
        pull_long_polling_timeout=0.2,
    )
    consumer = PushConsumer("span", broker, listener, options=options)
    consumer.subscribe("orders")
    async with consumer:
        await anyio.sleep(1.0)  # the first message blocks: how far does pulling go?
        held = len(listener.done)
        listener.release.set()
        await consumer.wait_caught_up(timeout=10)
    # By message count the queue pulls until ten messages are past the blocked one;
    # by id distance it would have stopped after the first pull.
    assert 9 <= held <= 12, held
    assert sorted(listener.done) == list(range(40))


async def test_a_user_decoder_and_the_body_field(
    broker: RedisBroker, streams: list[str], inspect: redis.Redis
) -> None:
    inspect.xadd(streams[0], {"payload": json.dumps({"id": "o-1", "kind": "paid"})})
    inspect.xadd(streams[1], {"data": "raw", "src": "app"})

    def decode(entry_id: str, fields: Mapping[bytes, bytes]) -> OutgoingMessage:
        doc = json.loads(fields[b"payload"])
        return OutgoingMessage.of(
            fields[b"payload"], keys=[doc["id"]], tags=doc["kind"], properties={"entry": entry_id}
        )

    await broker.attach_stream("events", streams[:1], decode=decode)
    await broker.attach_stream("raw", streams[1:], body_field="data")
    (event,) = (await broker.pull(MessageQueue("events", 0), 0, 10)).messages
    assert (event.keys, event.tags, event.properties["entry"]) == (("o-1",), "paid", event.msg_id)
    (raw,) = (await broker.pull(MessageQueue("raw", 0), 0, 10)).messages
    assert (raw.body, dict(raw.properties)) == (b"raw", {"src": "app"})


async def test_attach_checks_its_arguments_and_send_is_refused(
    broker: RedisBroker, streams: list[str], inspect: redis.Redis
) -> None:
    inspect.set(streams[1], "not a stream")
    with pytest.raises(ConfigurationError, match="is a string, not a stream"):
        await broker.attach_stream("orders", streams)
    with pytest.raises(ConfigurationError, match="stream_keys repeat"):
        await broker.attach_stream("orders", [streams[0], streams[0]])
    with pytest.raises(ConfigurationError, match="stream_keys must be"):
        await broker.attach_stream("orders", [])
    with pytest.raises(ConfigurationError, match="reserved prefix"):
        await broker.attach_stream("%RETRY%g", streams[:1])
    await broker.attach_stream("orders", streams[:1])
    with pytest.raises(ConfigurationError, match="attached to"):
        await broker.attach_stream("orders", streams[1:])
    with pytest.raises(ConfigurationError, match="attach_stream"):
        await broker.send("orders", b"x")
    with pytest.raises(ConfigurationError, match="attach_stream"):
        await broker.send_many("orders", [b"x"])
    await broker.create_topic("mine", 1)
    with pytest.raises(ConfigurationError, match="broker's own topics"):
        await broker.attach_stream("mine", streams[:1])


async def test_an_id_past_the_mapping_is_named_not_shared(
    broker: RedisBroker, streams: list[str], inspect: redis.Redis
) -> None:
    inspect.xadd(streams[0], {"body": "ok"}, id="7-0")
    inspect.xadd(streams[0], {"body": "too far"}, id="7-600000")
    await broker.attach_stream("orders", streams[:1])
    with pytest.raises(SourceError, match="entry 7-600000 has a sequence part"):
        await broker.pull(MessageQueue("orders", 0), 0, 10)


async def test_offset_for_timestamp_on_attached_and_own_streams(
    broker: RedisBroker, streams: list[str], inspect: redis.Redis
) -> None:
    for ms in (1000, 2000, 3000):
        inspect.xadd(streams[0], {"body": str(ms)}, id=f"{ms}-0")
    await broker.attach_stream("orders", streams[:1])
    mq = MessageQueue("orders", 0)
    assert await broker.offset_for_timestamp(mq, 1.5) == _attached_offset(b"2000-0")
    assert await broker.offset_for_timestamp(mq, 0) == _attached_offset(b"1000-0")
    assert await broker.offset_for_timestamp(mq, 9.0) == await broker.max_offset(mq)
    # The broker's own queue: born times.
    await broker.create_topic("t", 1)
    own = MessageQueue("t", 0)
    assert await broker.offset_for_timestamp(own, time.time()) == 0  # empty
    for i in range(5):
        await broker.send("t", b"%d" % i, queue_id=0)
    await anyio.sleep(0.05)
    middle = time.time()
    await anyio.sleep(0.05)
    for i in range(5, 12):
        await broker.send("t", b"%d" % i, queue_id=0)
    assert await broker.offset_for_timestamp(own, middle) == 5
    assert await broker.offset_for_timestamp(own, 0) == 0
    assert await broker.offset_for_timestamp(own, time.time() + 60) == 12


def _readme_blocks() -> tuple[str, str]:
    """The shell and Python blocks of the page 'Streams written by other
    applications' (docs/how-to/attach-streams.md)."""
    section = (Path(__file__).resolve().parents[2] / "docs/how-to/attach-streams.md").read_text()
    shell = re.search(r"```sh\n(.*?)```", section, re.S)
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert shell is not None
    assert code is not None
    return shell.group(1), code.group(1)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_readme_example_written_with_redis_cli_and_consumed_staged(
    backend: str, namespace: str, redis_url: str, inspect: redis.Redis, tmp_path: Path
) -> None:
    shell, code = _readme_blocks()
    key = f"{namespace}:orders"  # the README's shop:orders, unique per test
    port = str(urlparse(redis_url).port or 6379)
    try:
        for line in shell.strip().splitlines():
            args = shlex.split(line.replace("shop:orders", key))
            assert args[0] == "redis-cli"
            subprocess.run(["redis-cli", "-p", port, *args[1:]], check=True, capture_output=True)
        script = tmp_path / "example.py"
        script.write_text(
            code.replace("shop:orders", key)
            .replace("redis://127.0.0.1:6379/0", redis_url)
            .replace("anyio.run(main)", f"anyio.run(main, backend={backend!r})")
        )
        result = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=60
        )
    finally:
        inspect.delete(key)
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())  # entry ids sort as they were written
    assert [line.split(" ", 2)[1:] for line in lines] == [
        ["0", "order 1 {'shop': 's1'}"],
        ["0", "order 2 {'shop': 's1'}"],
        ["-1", "order 3 {'shop': 's2'}"],
    ]
    assert all(re.fullmatch(r"\d+-\d+", line.split()[0]) for line in lines)
