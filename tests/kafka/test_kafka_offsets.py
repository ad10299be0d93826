"""A Kafka group's progress from the command line: offsets show and reset."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from offsetstore import QueueProgress, StageKey
from stagedconsumer import (
    ConsumeConcurrentlyContext,
    KafkaBroker,
    Message,
    MessageListenerConcurrently,
    MessageQueue,
    PushConsumer,
)
from tests.kafka.conftest import send_messages

pytestmark = [pytest.mark.anyio, pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]


async def _offsets(broker: KafkaBroker, *words: str) -> tuple[int, str, str]:
    store = "kafka://" + ",".join(broker.bootstrap_servers)
    action, *rest = words
    done = await anyio.run_process(
        [sys.executable, "-m", "stagedconsumer", "offsets", action, "--store", store, *rest],
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"},
        check=False,
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def _shown(broker: KafkaBroker, group: str, topic: str) -> dict[int, int]:
    code, out, err = await _offsets(broker, "show", "--group", group, "--topic", topic, "--json")
    assert code == 0, err
    return {q["queue_id"]: q["consume_offset"] for q in json.loads(out)["queues"]}


@pytest.mark.slow
async def test_offsets_reset_moves_a_stopped_kafka_groups_commits_within_the_partitions(
    broker: KafkaBroker, name: str
) -> None:
    await broker.create_topic(name, 2)
    await send_messages(broker, name, 10, queue_id=0)
    store = broker.default_offset_store()
    mq = MessageQueue(name, 0)
    await store.reset_progress(name, {mq: QueueProgress(consume_offset=8)})
    assert await _shown(broker, name, name) == {0: 8}
    group = ["--group", name, "--topic", name]
    code, _, err = await _offsets(broker, "reset", *group, "--to-offset", "3", "--yes")
    assert code == 0, err
    assert await _shown(broker, name, name) == {0: 3}
    # checked against the partitions: an offset past the end, a partition it has not
    code, _, err = await _offsets(broker, "reset", *group, "--to-offset", "11", "--yes")
    assert code == 1
    assert "outside the offsets of" in err
    assert f"{name}#0 [0, 10]" in err
    code, _, err = await _offsets(broker, "reset", *group, "--queue", "2", "--to-offset", "1", "-y")
    assert code == 1
    assert "has 2 partition(s)" in err
    assert await _shown(broker, name, name) == {0: 3}


class Idle(MessageListenerConcurrently):
    async def consume_message(
        self, msgs: Sequence[Message], context: ConsumeConcurrentlyContext
    ) -> None:
        pass


@pytest.mark.slow
async def test_offsets_reset_of_a_running_kafka_group_is_refused(
    broker: KafkaBroker, name: str
) -> None:
    await broker.create_topic(name, 1)
    await send_messages(broker, name, 5)
    consumer = PushConsumer(name, broker, Idle())
    consumer.subscribe(name)
    async with consumer:
        with anyio.fail_after(30):
            while (await broker.default_offset_store().list_progress(name, name)) != {
                MessageQueue(name, 0): QueueProgress(consume_offset=5)
            }:
                await anyio.sleep(0.1)
        group = ["--group", name, "--topic", name]
        code, _, err = await _offsets(broker, "reset", *group, "--to-offset", "1", "--yes")
    assert code == 1
    assert "has members" in err
    assert await _shown(broker, name, name) == {0: 5}


async def test_the_store_resumes_at_the_offset_when_the_broker_drops_commit_metadata(
    broker: KafkaBroker, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Tansu 0.6 keeps no commit metadata: stage offsets and finished ranges do not come
    back, the offset does, and the store counts the commit (on Kafka, see the codec
    tests: they come back as written)."""
    await broker.create_topic(name, 1)
    mq = MessageQueue(name, 0)
    written = QueueProgress(
        consume_offset=4, stage_offsets={StageKey("default"): 2}, finished=((6, 7),)
    )
    store = broker.default_offset_store()
    await store.reset_progress(name, {mq: written})
    with caplog.at_level(logging.WARNING, logger="stagedconsumer"):
        read = await broker.default_offset_store().list_progress(name, name)
        await broker.default_offset_store().list_progress(name, name)
    assert read[mq].consume_offset == 4
    if read[mq] != written:  # the broker dropped the metadata
        assert read[mq] == QueueProgress(consume_offset=4)
        assert broker.statistics().metadata_missing == 2
        warned = [r for r in caplog.records if "without metadata" in r.getMessage()]
        assert len(warned) == 1  # once per store
