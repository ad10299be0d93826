"""The Kafka broker's pure parts: commit metadata of stage offsets, topic names."""

from __future__ import annotations

from offsetstore import QueueProgress, StageKey
from stagedconsumer import KafkaBroker, KafkaOffsetStore
from stagedconsumer._sources._kafka_codec import (
    METADATA_LIMIT,
    TopicNames,
    decode_metadata,
    encode_metadata,
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
