"""The Kafka broker's pure parts: commit metadata of stage offsets, topic names."""

from __future__ import annotations

import pytest

from offsetstore import QueueProgress, StageKey
from stagedconsumer import KafkaBroker, KafkaOffsetStore
from stagedconsumer._sources._kafka_codec import (
    METADATA_LIMIT,
    TopicNames,
    decode_metadata,
    decode_progress,
    decode_records,
    encode_metadata,
    encode_progress,
)


def test_stage_offsets_round_trip_through_the_commit_metadata() -> None:
    offsets = {StageKey("default"): 7, StageKey("orders", "user-1"): 3, StageKey("a/b", "c d"): 0}
    text, dropped = encode_metadata(offsets)
    assert text.startswith("sc1:")
    assert dropped == 0
    assert decode_metadata(text) == offsets
    assert decode_metadata(encode_metadata({})[0]) == {}


def test_long_metadata_is_compressed_and_what_still_does_not_fit_is_left_out() -> None:
    many = {StageKey("s", f"key-{i:06d}"): i for i in range(400)}
    text, dropped = encode_metadata(many)
    assert text.startswith("sc1z:")  # JSON would be ~9 KiB; compressed it fits
    assert len(text) <= METADATA_LIMIT
    assert (dropped, decode_metadata(text)) == (0, many)
    huge = {StageKey("s", f"{i * 7919 % 100003:x}-{i}"): i for i in range(20000)}
    text, dropped = encode_metadata(huge)
    assert len(text.encode()) <= METADATA_LIMIT
    kept = decode_metadata(text)
    assert dropped == len(huge) - len(kept) > 0
    assert all(huge[key] == value for key, value in kept.items())
    # the highest stage offsets are kept (the lowest restart their stages)
    assert min(kept.values()) >= max(set(huge.values()) - set(kept.values()))


def test_metadata_of_other_clients_reads_as_no_stage_offsets() -> None:
    for foreign in ("", "some metadata", "sc1:not json", "sc1z:@@@", 'sc1:{"a": -1}'):
        assert decode_metadata(foreign) == {}


def test_the_store_counts_stage_keys_left_out() -> None:
    broker = KafkaBroker("127.0.0.1:1", metadata_limit=200)
    store = KafkaOffsetStore(broker)
    progress = QueueProgress(
        consume_offset=5, stage_offsets={StageKey("s", f"k{i}"): i for i in range(100)}
    )
    encoded = store._encode(progress)
    assert encoded is not None
    assert encoded[0] == 5
    assert len(encoded[1]) <= 200
    assert broker.statistics().metadata_overflows == 100 - len(decode_metadata(encoded[1]))


def test_retry_and_dead_letter_topics_get_legal_kafka_names() -> None:
    names = TopicNames("stagedconsumer-retry.", "stagedconsumer-dlq.")
    assert names.kafka("orders") == "orders"
    assert names.kafka("%RETRY%my group/1") == "stagedconsumer-retry.my_group_1"
    assert names.kafka("%DLQ%g") == "stagedconsumer-dlq.g"
    assert names.ours("stagedconsumer-retry.my_group_1") == "%RETRY%my group/1"


def test_finished_ranges_round_trip_through_the_commit_metadata() -> None:
    stages = {StageKey("default"): 7, StageKey("orders", "user-1"): 3}
    progress = QueueProgress(
        consume_offset=100, stage_offsets=stages, finished=((102, 105), (110, 110))
    )
    text, dropped, cut = encode_progress(progress)
    assert text == 'sc2:2+3,5+0;{"default":7,"orders\\u001fuser-1":3}'
    assert (dropped, cut) == (0, 0)
    assert decode_progress(100, text) == (stages, ((102, 105), (110, 110)))
    # without finished ranges: the format of before, readable both ways
    plain, _, _ = encode_progress(QueueProgress(consume_offset=100, stage_offsets=stages))
    assert plain.startswith("sc1:")
    assert decode_progress(100, plain) == (stages, ())
    for foreign in ("", "x", "sc2:", "sc2:1+x;{}", "sc2z:@@", "sc2:1+1,0+1;{}"):
        assert decode_progress(100, foreign) == ({}, ()), foreign


def test_past_the_limit_the_highest_finished_ranges_go_first_and_are_counted() -> None:
    stages = {StageKey("s", f"k{i}"): i for i in range(20)}
    ranges = tuple((1000 + 7 * i * i, 1000 + 7 * i * i + i % 3) for i in range(1, 3000))
    progress = QueueProgress(consume_offset=1000, stage_offsets=stages, finished=ranges)
    text, dropped, cut = encode_progress(progress)
    assert text.startswith(("sc2:", "sc2z:"))
    assert len(text.encode()) <= METADATA_LIMIT
    got_stages, got_ranges = decode_progress(1000, text)
    assert got_stages == stages  # every stage key kept: ranges are cut first
    assert dropped == 0
    assert 0 < cut == len(ranges) - len(got_ranges)
    assert got_ranges == ranges[: len(got_ranges)]  # the lowest ranges are kept
    assert len(got_ranges) > 100
    # a limit too small for the stage offsets: no range, then stage keys left out
    text, dropped, cut = encode_progress(progress, limit=60)
    got_stages, got_ranges = decode_progress(1000, text)
    assert (got_ranges, cut) == ((), len(ranges))
    assert 0 < dropped == len(stages) - len(got_stages)


def test_the_store_counts_finished_ranges_left_out() -> None:
    broker = KafkaBroker("127.0.0.1:1", metadata_limit=64)
    store = KafkaOffsetStore(broker)
    ranges = tuple((10 + i * i, 10 + i * i + i % 4) for i in range(2, 50))
    encoded = store._encode(QueueProgress(consume_offset=10, finished=ranges))
    assert encoded is not None
    _, kept = decode_progress(10, encoded[1])
    assert 0 < len(kept) < len(ranges)
    assert broker.statistics().finished_overflows == len(ranges) - len(kept)


def test_messages_of_one_record_key_share_their_keys_tuple() -> None:
    from aiokafka.structs import ConsumerRecord

    records = [
        ConsumerRecord(
            topic="t",
            partition=0,
            offset=i,
            timestamp=1000 + i,
            timestamp_type=0,
            key=b"k%d" % (i % 2),
            value=b"v",
            checksum=None,
            serialized_key_size=2,
            serialized_value_size=1,
            headers=[],
        )
        for i in range(4)
    ]
    a, b, c, d = decode_records("t", 0, "t", records)
    assert (a.keys, b.keys) == (("k0",), ("k1",))
    assert a.keys is c.keys
    assert b.keys is d.keys
    assert [m.msg_id for m in (a, d)] == ["t-0@0", "t-0@3"]


def test_a_null_value_is_a_tombstone_and_an_empty_one_is_not() -> None:
    from aiokafka.structs import ConsumerRecord

    def record(offset: int, value: bytes | None, headers: list[tuple[str, bytes]]) -> object:
        return ConsumerRecord(
            topic="t",
            partition=0,
            offset=offset,
            timestamp=1000,
            timestamp_type=0,
            key=b"k",
            value=value,
            checksum=None,
            serialized_key_size=1,
            serialized_value_size=-1 if value is None else len(value),
            headers=headers,
        )

    plain, with_headers, empty = decode_records(
        "t", 0, "t", [record(0, None, []), record(1, None, [("p", b"v")]), record(2, b"", [])]
    )
    assert (plain.body, dict(plain.properties)) == (b"", {"TOMBSTONE": "true"})
    assert dict(with_headers.properties) == {"p": "v", "TOMBSTONE": "true"}
    assert (empty.body, dict(empty.properties)) == (b"", {})


@pytest.mark.anyio
async def test_metadata_refused_as_too_large_is_committed_again_with_less() -> None:
    """``metadata_limit`` above the broker's ``offset.metadata.max.bytes``: the
    broker refuses the commit with OFFSET_METADATA_TOO_LARGE (aiokafka's error, not
    retriable). The store lowers its limit, commits again with finished ranges left
    out first, counts it, and later commits fit at once. (Tansu 0.6 accepts metadata
    of any length, 30,000 characters tried, and keeps none: the broker's check is
    played by ``commit``.)"""
    import anyio
    from aiokafka.errors import OffsetMetadataTooLargeError
    from aiokafka.structs import TopicPartition

    broker = KafkaBroker("127.0.0.1:1", metadata_limit=1_000_000)
    store = KafkaOffsetStore(broker)
    stages = {StageKey(f"stage-{i}"): 1000 + i for i in range(5)}
    ranges = tuple((1000 + 7 * i * i, 1000 + 7 * i * i + i % 3) for i in range(1, 3000))
    tp = TopicPartition("t", 0)
    progress = {tp: QueueProgress(consume_offset=1000, stage_offsets=stages, finished=ranges)}
    attempts: list[int] = []
    committed: list[str] = []

    async def commit(offsets: dict[object, tuple[int, str]]) -> None:
        (offset, metadata), *_ = offsets.values()
        attempts.append(len(metadata))
        if len(metadata) > 1000:  # the broker's offset.metadata.max.bytes
            raise OffsetMetadataTooLargeError()
        assert offset == 1000
        committed.append(metadata)

    await store._commit(commit, progress)
    assert attempts[0] > 4096  # all of it: more than Kafka's default
    assert attempts[1] <= 4096  # then Kafka's default, then halves
    assert attempts[-1] <= 1000
    assert broker.statistics().metadata_rejections == len(attempts) - 1 >= 2
    got_stages, got_ranges = decode_progress(1000, committed[0])
    assert got_stages == stages  # finished ranges are left out first
    assert 0 < len(got_ranges) < len(ranges)
    assert broker.statistics().finished_overflows > 0
    # the next commit fits at once
    attempts.clear()
    await store._commit(commit, progress)
    assert len(attempts) == 1
    assert broker.statistics().metadata_rejections >= 2

    # a broker that takes no metadata at all: the offset alone in the end
    bare = KafkaBroker("127.0.0.1:1")
    bare_store = KafkaOffsetStore(bare)
    seen: list[str] = []

    async def no_metadata(offsets: dict[object, tuple[int, str]]) -> None:
        ((_, metadata),) = offsets.values()
        seen.append(metadata)
        if metadata:
            raise OffsetMetadataTooLargeError()

    with anyio.fail_after(5):
        await bare_store._commit(no_metadata, progress)
    assert seen[-1] == ""
    assert bare.statistics().metadata_rejections == len(seen) - 1
