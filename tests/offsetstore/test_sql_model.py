"""SqlOffsetStore behaves exactly like MemoryOffsetStore (the model), on random histories.

Random sequences of in-memory updates, persists (increase-only), resets and deletes
are applied to both stores; after every step, what each store has persisted is the
same. Runs on SQLite (a file in a temporary directory), with a fresh consumer group
per example so examples share the tables but not their rows.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offsetstore import MemoryOffsetStore, QueueProgress, SqlOffsetStore, StageKey
from stagedconsumer import MessageQueue

QUEUES = [MessageQueue("a", 0), MessageQueue("b", 0)]
KEYS = [StageKey("s", None), StageKey("s", ""), StageKey("s", "g"), StageKey("t", None)]

offsets = st.integers(min_value=0, max_value=6)
# Few consume offsets, so equal and lower offsets (the interesting cases) are common.
progresses = st.builds(
    QueueProgress,
    consume_offset=st.sampled_from([None, 0, 1, 1, 2, 2]),
    stage_offsets=st.dictionaries(st.sampled_from(KEYS), offsets, max_size=3),
)
queue_indexes = st.integers(min_value=0, max_value=len(QUEUES) - 1)
update = st.tuples(st.just("update"), queue_indexes, progresses)
persist = st.tuples(st.just("persist"), st.sets(queue_indexes, min_size=1), st.none())
steps = st.one_of(
    update,
    persist,
    update,
    persist,
    st.tuples(st.just("reset"), queue_indexes, st.none() | progresses),
    st.tuples(st.just("forget"), queue_indexes, st.none()),
)


@pytest.fixture(scope="module")
def db_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as tmp:
        yield f"sqlite:///{Path(tmp) / 'model.db'}"


_groups = itertools.count()


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(history=st.lists(steps, min_size=6, max_size=24))
def test_sql_store_matches_the_memory_model(
    db_url: str, history: list[tuple[str, object, object]]
) -> None:
    group = f"g{next(_groups)}"

    async def run() -> None:
        model = MemoryOffsetStore()
        store = SqlOffsetStore(db_url)
        try:
            await store.load()
            for step, (action, target, value) in enumerate(history):
                for s in (model, store):
                    if action == "update":
                        assert isinstance(target, int)
                        assert isinstance(value, QueueProgress)
                        s.update_progress(group, QUEUES[target], value)
                    elif action == "persist":
                        assert isinstance(target, set)
                        await s.persist_all(group, [QUEUES[i] for i in sorted(target)])
                    elif action == "reset":
                        assert isinstance(target, int)
                        assert value is None or isinstance(value, QueueProgress)
                        await s.reset_progress(group, {QUEUES[target]: value})
                    else:
                        assert isinstance(target, int)
                        s.remove_offset(group, QUEUES[target])
                expected = await model.list_progress(group)
                assert await store.list_progress(group) == expected, (step, history)
                for mq in QUEUES:
                    assert await store.read_progress(group, mq) == await model.read_progress(
                        group, mq
                    ), (step, mq, history)
        finally:
            await store.aclose()

    anyio.run(run)
