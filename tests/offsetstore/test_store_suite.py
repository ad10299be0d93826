"""The store contract, run on every implementation (memory, SQLite, PostgreSQL, MariaDB).

Includes RIP-22's own store test cases (``LocalFileStageOffsetStoreTest`` /
``RemoteBrokerStageOffsetStoreTest``): update to 1024 then 1023 reads 1023; an
increase-only update to 1022 keeps 1023; reads from the store are empty before
``persist_all`` and 1024 after; a cloned table holds the values; a removed queue
reads empty.
"""

from __future__ import annotations

import random

import anyio
import pytest

from offsetstore import QueueProgress, ReadOffsetType, StageKey
from stagedconsumer import MessageQueue

from .conftest import Backend

pytestmark = pytest.mark.anyio

GROUP = "group-a"
MQ = MessageQueue("TopicA", 1)
KEY = StageKey("strategyId", "groupId")
MEMORY = ReadOffsetType.READ_FROM_MEMORY
STORE = ReadOffsetType.READ_FROM_STORE


def progress(offset: int | None, **stages: int) -> QueueProgress:
    return QueueProgress(
        consume_offset=offset, stage_offsets={StageKey(k, None): v for k, v in stages.items()}
    )


# -- RIP-22's store cases -------------------------------------------------------------------


async def test_update_stage_offset_then_lower_reads_lower_increase_only_keeps(
    backend: Backend,
) -> None:
    store = backend.new_store()
    await store.load()
    store.update_stage_offset(GROUP, MQ, KEY, 1024)
    assert await store.read_stage_offset(GROUP, MQ, MEMORY) == {KEY: 1024}
    store.update_stage_offset(GROUP, MQ, KEY, 1023)
    assert await store.read_stage_offset(GROUP, MQ, MEMORY) == {KEY: 1023}
    store.update_stage_offset(GROUP, MQ, KEY, 1022, increase_only=True)
    assert await store.read_stage_offset(GROUP, MQ, MEMORY) == {KEY: 1023}


async def test_update_offset_then_lower_reads_lower_increase_only_keeps(backend: Backend) -> None:
    store = backend.new_store()
    await store.load()
    store.update_offset(GROUP, MQ, 1024)
    assert await store.read_offset(GROUP, MQ, MEMORY) == 1024
    store.update_offset(GROUP, MQ, 1023)
    assert await store.read_offset(GROUP, MQ, MEMORY) == 1023
    store.update_offset(GROUP, MQ, 1022, increase_only=True)
    assert await store.read_offset(GROUP, MQ, MEMORY) == 1023


async def test_read_from_store_is_empty_before_persist_all_and_1024_after(
    backend: Backend,
) -> None:
    store = backend.new_store()
    await store.load()
    store.update_stage_offset(GROUP, MQ, KEY, 1024)
    store.update_offset(GROUP, MQ, 2048)
    assert await store.read_stage_offset(GROUP, MQ, STORE) == {}
    assert await store.read_offset(GROUP, MQ, STORE) is None
    await store.persist_all(GROUP, [MQ])
    assert await store.read_stage_offset(GROUP, MQ, STORE) == {KEY: 1024}
    assert await store.read_offset(GROUP, MQ, STORE) == 2048
    # A restarted process (a new store on the same durable place) reads the same.
    restarted = backend.new_store()
    await restarted.load()
    assert await restarted.read_stage_offset(GROUP, MQ, MEMORY) == {}
    assert await restarted.read_progress(GROUP, MQ) == QueueProgress(
        consume_offset=2048, stage_offsets={KEY: 1024}
    )


async def test_clone_stage_offset_table_holds_the_values(backend: Backend) -> None:
    store = backend.new_store()
    await store.load()
    store.update_stage_offset(GROUP, MQ, KEY, 1024)
    store.update_offset(GROUP, MQ, 7)
    store.update_stage_offset(GROUP, MessageQueue("TopicB", 0), KEY, 5)
    cloned = store.clone_stage_offset_table(GROUP, "TopicA")
    assert cloned == {MQ: {KEY: 1024}}
    assert store.clone_offset_table(GROUP, "TopicA") == {MQ: 7}
    store.update_stage_offset(GROUP, MQ, KEY, 2000)
    assert cloned == {MQ: {KEY: 1024}}, "a clone is a copy, not a view"


async def test_removed_queue_reads_empty_from_memory_and_stays_stored(backend: Backend) -> None:
    store = backend.new_store()
    await store.load()
    store.update_progress(GROUP, MQ, QueueProgress(consume_offset=10, stage_offsets={KEY: 1024}))
    await store.persist(GROUP, MQ)
    store.remove_stage_offset(GROUP, MQ)
    assert await store.read_stage_offset(GROUP, MQ, MEMORY) == {}
    assert await store.read_offset(GROUP, MQ, MEMORY) is None
    assert store.clone_stage_offset_table(GROUP, "TopicA") == {}
    assert await store.read_offset(GROUP, MQ, STORE) == 10


# -- progress as a unit, increase-only in the store -------------------------------------------


async def test_lower_consume_offset_changes_neither_offset_nor_stage_offsets(
    backend: Backend,
) -> None:
    store = backend.new_store()
    await store.load()
    store.update_progress(GROUP, MQ, progress(10, a=5))
    await store.persist(GROUP, MQ)
    store.update_progress(GROUP, MQ, progress(9, a=100, b=1))
    await store.persist(GROUP, MQ)
    assert await store.read_progress(GROUP, MQ, STORE) == progress(10, a=5)
    store.update_progress(GROUP, MQ, progress(None, a=100))
    await store.persist(GROUP, MQ)
    assert await store.read_progress(GROUP, MQ, STORE) == progress(10, a=5)
    # The same consume offset may carry new stage offsets (a stage reset at a boundary).
    store.update_progress(GROUP, MQ, progress(10, a=0))
    await store.persist(GROUP, MQ)
    assert await store.read_progress(GROUP, MQ, STORE) == progress(10, a=0)
    store.update_progress(GROUP, MQ, progress(11, a=1))
    await store.persist(GROUP, MQ)
    assert await store.read_progress(GROUP, MQ, STORE) == progress(11, a=1)


async def test_stage_offsets_without_consume_offset_are_replaced_by_any_write(
    backend: Backend,
) -> None:
    store = backend.new_store()
    await store.load()
    store.update_stage_offset(GROUP, MQ, KEY, 3)
    await store.persist(GROUP, MQ)
    assert await store.read_progress(GROUP, MQ, STORE) == QueueProgress(
        consume_offset=None, stage_offsets={KEY: 3}
    )
    store.update_progress(GROUP, MQ, progress(0))
    await store.persist(GROUP, MQ)
    assert await store.read_progress(GROUP, MQ, STORE) == progress(0)


async def test_none_and_empty_group_ids_round_trip_distinctly(backend: Backend) -> None:
    keys = {
        StageKey("s", None): 1,
        StageKey("s", ""): 2,
        StageKey("s", "g"): 3,
        StageKey("", None): 4,
        StageKey("", ""): 5,
        StageKey("t/x", "ünï\"cødé'"): 6,
    }
    store = backend.new_store()
    await store.load()
    store.update_progress(GROUP, MQ, QueueProgress(consume_offset=1, stage_offsets=keys))
    await store.persist(GROUP, MQ)
    restarted = backend.new_store()
    read = await restarted.read_progress(GROUP, MQ, STORE)
    assert read is not None
    assert dict(read.stage_offsets) == keys
    assert {type(k) for k in read.stage_offsets} == {StageKey}


async def test_persist_all_many_queues_groups_and_topics(backend: Backend) -> None:
    store = backend.new_store()
    await store.load()
    queues = [MessageQueue(topic, i) for topic in ("A", "B") for i in range(50)]
    for i, mq in enumerate(queues):
        store.update_progress("g1", mq, progress(i, x=i // 2))
        store.update_progress("g2", mq, progress(1000 + i))
    await store.persist_all("g1", queues)
    assert await store.list_progress("g2") == {}
    listed = await store.list_progress("g1", "B")
    assert list(listed) == [MessageQueue("B", i) for i in range(50)]
    assert listed[MessageQueue("B", 3)] == progress(53, x=26)
    assert len(await store.list_progress("g1")) == 100
    await store.persist_all("g2", queues[:10])
    everything = await store.list_progress("g2")
    assert everything == {mq: progress(1000 + i) for i, mq in enumerate(queues[:10])}
    # Names are compared exactly (no case folding, no trailing-space padding).
    assert await store.list_progress("G1") == {}
    assert await store.list_progress("g1 ") == {}
    assert await store.list_progress("g1", "a") == {}


async def test_persist_all_of_unknown_queues_writes_nothing(backend: Backend) -> None:
    store = backend.new_store()
    await store.load()
    await store.persist_all(GROUP, [MQ])
    assert await store.list_progress(GROUP) == {}


async def test_reset_progress_moves_back_and_deletes(backend: Backend) -> None:
    store = backend.new_store()
    await store.load()
    other = MessageQueue("TopicA", 2)
    store.update_progress(GROUP, MQ, progress(100, a=50))
    store.update_progress(GROUP, other, progress(7))
    await store.persist_all(GROUP, [MQ, other])
    await store.reset_progress(GROUP, {MQ: progress(3, a=0), other: None})
    assert await store.list_progress(GROUP) == {MQ: progress(3, a=0)}
    assert await store.read_progress(GROUP, other, MEMORY) is None
    assert await store.read_progress(GROUP, MQ, MEMORY) == progress(3, a=0)
    restarted = backend.new_store()
    assert await restarted.read_progress(GROUP, MQ) == progress(3, a=0)


@pytest.mark.parametrize(
    ("stage_offsets", "error", "match"),
    [
        (
            {KEY: -1},
            ValueError,
            r"stage offset must be >= 0, got -1 for stage key 'strategyId/groupId'",
        ),
        ({"default": 25}, TypeError, r"key 'default' is a str, not a StageKey"),
        ({KEY: True}, TypeError, r"stage offset must be an int, got True for stage key"),
        ({KEY: 2.0}, TypeError, r"stage offset must be an int, got 2.0"),
        ([(KEY, 1)], TypeError, r"stage offsets must be a mapping of StageKey to int"),
    ],
)
async def test_progress_the_store_could_not_read_back_is_refused(
    backend: Backend, stage_offsets: object, error: type[Exception], match: str
) -> None:
    """A negative, bool or float stage offset, a key that is not a StageKey: refused
    before anything is stored, so no row is ever unreadable ("corrupt progress row")."""
    store = backend.new_store()
    await store.load()
    store.update_progress(GROUP, MQ, progress(10, a=5))
    await store.persist_all(GROUP, [MQ])
    other = MessageQueue("TopicA", 2)
    with pytest.raises(error, match=match):
        await store.reset_progress(
            GROUP,
            {
                other: progress(1),
                MQ: QueueProgress(consume_offset=3, stage_offsets=stage_offsets),  # type: ignore[arg-type]
            },
        )
    # Smuggled past QueueProgress's own check: reset_progress checks again, and
    # writes nothing of the batch.
    smuggled = progress(3)
    object.__setattr__(smuggled, "stage_offsets", stage_offsets)
    with pytest.raises(error, match=match):
        await store.reset_progress(GROUP, {other: progress(1), MQ: smuggled})
    assert await store.list_progress(GROUP) == {MQ: progress(10, a=5)}
    assert await backend.new_store().read_progress(GROUP, MQ) == progress(10, a=5)


@pytest.mark.parametrize(
    ("consume_offset", "error", "match"),
    [
        (-1, ValueError, "consume offset must be >= 0, got -1"),
        (True, TypeError, "consume offset must be an int, got True"),
        (1.5, TypeError, "consume offset must be an int, got 1.5"),
    ],
)
async def test_bad_consume_offsets_are_refused_on_every_way_in(
    backend: Backend, consume_offset: object, error: type[Exception], match: str
) -> None:
    store = backend.new_store()
    await store.load()
    with pytest.raises(error, match=match):
        QueueProgress(consume_offset=consume_offset)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        store.update_offset(GROUP, MQ, consume_offset)  # type: ignore[arg-type]
    smuggled = progress(3)
    object.__setattr__(smuggled, "consume_offset", consume_offset)
    with pytest.raises(error, match=match):
        await store.reset_progress(GROUP, {MQ: smuggled})
    assert await store.list_progress(GROUP) == {}


async def test_the_in_memory_updates_refuse_what_a_persist_could_not_store(
    backend: Backend,
) -> None:
    store = backend.new_store()
    await store.load()
    with pytest.raises(ValueError, match="stage offset must be >= 0, got -1 for stage key"):
        store.update_stage_offset(GROUP, MQ, KEY, -1)
    with pytest.raises(TypeError, match="stage offset must be an int, got False"):
        store.update_stage_offset(GROUP, MQ, KEY, False)
    with pytest.raises(TypeError, match="key 'default' is a str, not a StageKey"):
        store.update_stage_offset(GROUP, MQ, "default", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a QueueProgress"):
        store.update_progress(GROUP, MQ, {"consume_offset": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keys must be MessageQueues"):
        await store.reset_progress(GROUP, {"TopicA#1": progress(1)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="'strategy_id' must be <class 'str'>"):
        StageKey(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="'group_id' must be <class 'str'>"):
        StageKey("s", 2)  # type: ignore[arg-type]
    await store.persist_all(GROUP, [MQ])
    assert await store.list_progress(GROUP) == {}


async def test_read_progress_memory_first_then_store(backend: Backend) -> None:
    store = backend.new_store()
    await store.load()
    store.update_progress(GROUP, MQ, progress(5))
    await store.persist(GROUP, MQ)
    restarted = backend.new_store()
    assert await restarted.read_progress(GROUP, MQ, MEMORY) is None
    assert await restarted.read_progress(GROUP, MQ) == progress(5)
    # The read filled the in-memory table.
    assert await restarted.read_progress(GROUP, MQ, MEMORY) == progress(5)
    restarted.update_progress(GROUP, MQ, progress(6))
    assert await restarted.read_progress(GROUP, MQ) == progress(6)


# -- concurrency ------------------------------------------------------------------------------


def _unit(offset: int, writer: int) -> QueueProgress:
    """Progress whose stage offset names the writer and the consume offset it came with."""
    return QueueProgress(consume_offset=offset, stage_offsets={KEY: offset * 100 + writer})


async def test_concurrent_writers_end_at_the_highest_offset_with_its_own_stage_offsets(
    backend: Backend,
) -> None:
    queues = [MessageQueue("race", i) for i in range(20)]
    writers = 6
    rounds = 15
    stores = [backend.new_store() for _ in range(writers)]
    for store in stores:
        await store.load()
    highest: dict[MessageQueue, int] = dict.fromkeys(queues, -1)

    async def write(w: int) -> None:
        rng = random.Random(w)
        store = stores[w]
        for _ in range(rounds):
            chosen = rng.sample(queues, 8)
            for mq in chosen:
                offset = rng.randrange(1000)
                store.update_progress(GROUP, mq, _unit(offset, w))
                highest[mq] = max(highest[mq], offset)
            await store.persist_all(GROUP, chosen)

    async with anyio.create_task_group() as tg:
        for w in range(writers):
            tg.start_soon(write, w)
    stored = await stores[0].list_progress(GROUP, "race")
    for mq in queues:
        if highest[mq] < 0:
            continue
        value = stored[mq]
        assert value.consume_offset == highest[mq], mq
        (stage,) = value.stage_offsets.values()
        assert stage // 100 == value.consume_offset, "stage offsets of another write"


async def test_increase_only_race_never_moves_back(backend: Backend) -> None:
    """Writers racing a high and a low offset on the same queues: high always wins."""
    queues = [MessageQueue("race", i) for i in range(10)]
    high = backend.new_store()
    low = backend.new_store()
    await high.load()
    await low.load()
    for step in range(1, 16):
        for mq in queues:
            high.update_progress(GROUP, mq, _unit(step * 10, 1))
            low.update_progress(GROUP, mq, _unit(step * 10 - 5, 2))
        async with anyio.create_task_group() as tg:
            tg.start_soon(low.persist_all, GROUP, queues[::-1])
            tg.start_soon(high.persist_all, GROUP, queues)
            tg.start_soon(low.persist_all, GROUP, queues)
        stored = await high.list_progress(GROUP)
        assert all(value == _unit(step * 10, 1) for value in stored.values()), step


async def test_one_persist_all_is_one_transaction(server_backend: Backend) -> None:
    """A row the database rejects rolls back every queue of the same persist_all.

    (Servers only: SQLite does not enforce VARCHAR lengths, so it rejects no row.)
    """
    from offsetstore import StoreCommitError

    store = server_backend.new_store()
    await store.load()
    good = [MessageQueue("ok", i) for i in range(5)]
    bad = MessageQueue("x" * 2000, 0)  # longer than the topic column
    for mq in [*good, bad]:
        store.update_progress(GROUP, mq, progress(1))
    with pytest.raises(StoreCommitError) as info:
        await store.persist_all(GROUP, [*good, bad])
    assert info.value.retriable is False
    assert info.value.__cause__ is not None
    assert await store.list_progress(GROUP) == {}
    await store.persist_all(GROUP, good)
    assert len(await store.list_progress(GROUP)) == 5
