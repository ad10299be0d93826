"""The Redis codec's decoders build ``Message`` objects without attrs' ``__init__``
(plain stores on ``_MessageFields``, then a class change): what comes out must be a
``Message`` in every respect, field for field what ``Message(...)`` makes. Pure
functions, no Redis."""

from __future__ import annotations

import copy
import pickle
import weakref
from collections.abc import Mapping
from types import MappingProxyType

import attrs
import pytest

from stagedconsumer import Message, OutgoingMessage
from stagedconsumer._sources._redis_codec import (
    _attached_offset,
    _decode_attached,
    _decode_entries,
    _encode_fields,
    _ForeignEntry,
)

FIELDS = [a.name for a in attrs.fields(Message)]


def _same(got: Message, expected: Message) -> None:
    assert type(got) is Message
    for name in FIELDS:
        assert getattr(got, name) == getattr(expected, name), name
        assert type(getattr(got, name)) is type(getattr(expected, name)), name
    assert repr(got) == repr(expected)


def _entry(offset: int, fields: list[bytes]) -> list[object]:
    return [b"%d-0" % (offset + 1), fields]


def test_plain_entries_decode_to_the_messages_the_constructor_makes() -> None:
    entries = [
        _entry(o, _encode_fields(f"id{o}", b"body%d" % o, 1_700_000_000_123 + o, (), None, {}, 0))
        for o in range(5, 8)
    ]
    got = _decode_entries("orders", 3, entries)
    assert len(got) == 3
    for o, message in zip(range(5, 8), got, strict=True):
        _same(
            message,
            Message(
                topic="orders",
                queue_id=3,
                queue_offset=o,
                body=b"body%d" % o,
                msg_id=f"id{o}",
                born_timestamp=(1_700_000_000_123 + o) / 1000,
            ),
        )


FULL_FIELDS = _encode_fields("m1", b"x", 1_000, ("k1", "k2"), "tagA", {"a": "1", "b": "2"}, 4)
"""A stored entry's fields with every optional one, and the message it decodes to
(at offset 41 of queue 0 of ``t``)."""
FULL = Message(
    topic="t",
    queue_id=0,
    queue_offset=41,
    body=b"x",
    keys=("k1", "k2"),
    tags="tagA",
    properties={"a": "1", "b": "2"},
    msg_id="m1",
    born_timestamp=1.0,
    reconsume_times=4,
)


def test_entries_with_every_optional_field_decode_field_for_field() -> None:
    (got,) = _decode_entries("t", 0, [_entry(41, FULL_FIELDS)])
    _same(got, FULL)
    assert isinstance(got.properties, MappingProxyType)


def test_decoded_messages_are_frozen_hashable_and_weakly_referable() -> None:
    (message,) = _decode_entries("t", 1, [_entry(0, _encode_fields("a", b"", 0, (), None, {}, 0))])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        message.queue_offset = 9  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        message.body = b"changed"  # type: ignore[misc]
    assert message.queue_offset == 0
    assert message.body == b""
    again = Message(topic="t", queue_id=1, queue_offset=0, body=b"other", msg_id="a")
    assert message == again
    assert hash(message) == hash(again)
    assert {message: 1}[again] == 1
    assert weakref.ref(message)() is message
    retried = attrs.evolve(message, reconsume_times=1)
    assert type(retried) is Message
    assert retried.reconsume_times == 1
    assert retried.msg_id == "a"


@pytest.mark.parametrize(
    "message",
    [
        FULL,
        Message(topic="t", queue_id=0, queue_offset=0, body=b""),
        _decode_entries("t", 0, [_entry(41, FULL_FIELDS)])[0],
    ],
    ids=["every field", "defaults", "decoded"],
)
def test_messages_pickle_and_copy_field_for_field(message: Message) -> None:
    # Messages go to process pools and queues between processes: pickle must keep
    # every field (the read-only properties included, which pickle alone refuses).
    for copied in (
        pickle.loads(pickle.dumps(message)),
        pickle.loads(pickle.dumps(message, protocol=2)),
        copy.deepcopy(message),
    ):
        _same(copied, message)
        assert isinstance(copied.properties, MappingProxyType)
        with pytest.raises(TypeError):
            copied.properties["a"] = "changed"  # type: ignore[index]
        assert hash(copied) == hash(message)


def test_offsets_come_from_the_ids_when_entries_were_deleted_between() -> None:
    entries = [_entry(o, _encode_fields(f"m{o}", b"", 0, (), None, {}, 0)) for o in (2, 3, 9)]
    got = _decode_entries("t", 0, entries)
    assert [m.queue_offset for m in got] == [2, 3, 9]
    assert [m.msg_id for m in got] == ["m2", "m3", "m9"]


@pytest.mark.parametrize(
    "entry",
    [
        [b"5-1", [b"i", b"a", b"b", b"", b"t", b"0"]],  # an id the broker never writes
        [b"6-0", [b"body", b"hello"]],  # a plain XADD's fields
        [b"6-0", [b"i", b"a", b"b", b"x"]],  # no born time
    ],
)
def test_a_foreign_entry_among_ours_is_refused(entry: list[object]) -> None:
    ours = _entry(4, _encode_fields("a", b"", 0, (), None, {}, 0))
    with pytest.raises(_ForeignEntry):
        _decode_entries("t", 0, [ours, entry])


def test_attached_entries_freeze_what_a_decoder_returns() -> None:
    def decode(entry_id: str, fields: Mapping[bytes, bytes]) -> OutgoingMessage:
        # attrs' define does not convert: a careless decoder can pass a list and a dict
        return OutgoingMessage(
            body=fields[b"payload"],
            keys=["order-1"],  # type: ignore[arg-type]
            tags="created",
            properties={"source": entry_id},
        )

    entry_id = b"1700000000123-2"
    (got,) = _decode_attached("ext", 2, [[entry_id, [b"payload", b"{}"]]], decode)
    _same(
        got,
        Message(
            topic="ext",
            queue_id=2,
            queue_offset=_attached_offset(entry_id),
            body=b"{}",
            keys=("order-1",),
            tags="created",
            properties={"source": "1700000000123-2"},
            msg_id="1700000000123-2",
            born_timestamp=1_700_000_000.123,
        ),
    )
    assert isinstance(got.properties, MappingProxyType)
    with pytest.raises(TypeError):
        got.properties["x"] = "y"  # type: ignore[index]
