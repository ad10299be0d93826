"""How the Redis broker stores a message: stream entry fields, packed retries.

Entry fields: ``i`` message id, ``b`` body, ``t`` born timestamp (ms since the
epoch), and only when set: ``k`` keys (JSON list), ``g`` tags, ``p`` properties (JSON
object), ``r`` reconsume times, ``o`` the id of the stored copy when it is not the
message id (a retry's or a dead-letter copy's ``offset_msg_id``). A message waiting
to be retried is stored packed, its fields as ``<len>:<bytes>`` pairs in one string
(:func:`_pack`; the Lua of ``_redis_scripts.UNPACK_LUA`` reads them back).

Pure functions, nothing here talks to Redis; their names stay private (as
``_message``'s ``_MessageFields``): the broker and its benchmark are their only users.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, cast

from .._message import (
    EMPTY_PROPERTIES,
    Message,
    OutgoingMessage,
    _freeze_keys,
    _freeze_properties,
    _MessageFields,
)


def _pack(fields: Sequence[bytes]) -> bytes:
    return b"".join(b"%d:%s" % (len(value), value) for value in fields)


def _unpack(data: bytes) -> list[bytes]:
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        colon = data.index(b":", pos)
        length = int(data[pos:colon])
        out.append(data[colon + 1 : colon + 1 + length])
        pos = colon + 1 + length
    return out


def _encode_fields(
    msg_id: str,
    body: bytes,
    born_ms: int,
    keys: tuple[str, ...],
    tags: str | None,
    properties: Mapping[str, str] | None,
    reconsume_times: int,
    offset_msg_id: str | None = None,
) -> list[bytes]:
    fields = [b"i", msg_id.encode(), b"b", body, b"t", b"%d" % born_ms]
    if keys:
        fields += [b"k", json.dumps(list(keys)).encode()]
    if tags is not None:
        fields += [b"g", tags.encode()]
    if properties:
        fields += [b"p", json.dumps(dict(properties), sort_keys=True).encode()]
    if reconsume_times:
        fields += [b"r", b"%d" % reconsume_times]
    if offset_msg_id is not None and offset_msg_id != msg_id:
        fields += [b"o", offset_msg_id.encode()]
    return fields


def _message_fields(message: Message, properties: Mapping[str, str]) -> list[bytes]:
    return _encode_fields(
        message.msg_id,
        message.body,
        round(message.born_timestamp * 1000),
        message.keys,
        message.tags,
        properties,
        message.reconsume_times,
        message.offset_msg_id,
    )


class _ForeignEntry(Exception):
    """An entry the broker did not write (its id is not ``<n>-0``, or a field every
    message has is missing): raised by :func:`_decode_entries` and
    :func:`_entry_offset`, turned into a ``SourceError`` naming the stream by the broker.
    """

    def __init__(self, entry_id: bytes, raw: Sequence[bytes] = ()) -> None:
        super().__init__(f"entry {entry_id.decode(errors='replace')}{_field_sizes(raw)}")
        self.entry_id = entry_id


def _field_sizes(raw: Sequence[bytes]) -> str:
    """`` (fields name: N bytes, ...)``: an entry's field names and value sizes, never
    its values (they may hold personal data), for logs and errors."""
    if not raw:
        return ""
    shown = [
        f"{bytes(name[:40]).decode(errors='replace')!r}: {len(value)} bytes"
        for name, value in zip(raw[:16:2], raw[1:16:2], strict=False)
    ]
    more = f", {(len(raw) - 16) // 2} more" if len(raw) > 16 else ""
    return f" (fields {', '.join(shown)}{more})"


def _entry_offset(entry_id: bytes) -> int:
    if not entry_id.endswith(b"-0"):
        raise _ForeignEntry(entry_id)
    return int(entry_id[:-2]) - 1


_entry_id = operator.itemgetter(0)
_PLAIN_NAMES = [b"i", b"b", b"t"]
"""The names of an entry's fields when it has only those every message has."""


def _decode_entries(topic: str, queue_id: int, entries: Sequence[Any]) -> list[Message]:
    """Raw ``XRANGE`` entries (``[id, [field, value, ...]]``) as :class:`Message` objects.

    The hot path of every pull: messages are built as :class:`_MessageFields` with
    plain stores, then made ``Message`` objects (see ``_MessageFields``), without
    attrs' ``__init__`` and its converters (the fields are ours, already in their
    stored form). Entry ids are ``<offset + 1>-0``; when the first and last id span
    exactly the number of entries (always, unless some were deleted) the offsets are
    counted instead of parsed from every id. The ids are checked all at once (joined,
    their ``-0`` endings counted). Entries with only the three fields every message
    has (``i``, ``b``, ``t``, written in that order: one slice compare) are read by
    position, and a born time is parsed only when it differs from the entry before's
    (a producer's batch shares one).

    Raises :class:`_ForeignEntry` for an entry the broker did not write: an id that
    is not ``<n>-0`` or fields without ``i``, ``b`` and ``t``. (One with our fields
    and an id past the queue's counter is caught by the broker, which compares the
    ids with the counter whenever they are not consecutive.)
    """
    if not entries:
        return []
    # Every id ends with "-0": as many "-0 " as ids in them joined (an id has one "-").
    if (b" ".join(map(_entry_id, entries)) + b" ").count(b"-0 ") != len(entries):
        for entry_id, raw in entries:
            if not entry_id.endswith(b"-0"):
                raise _ForeignEntry(entry_id, raw)
    first = _entry_offset(entries[0][0])
    consecutive = _entry_offset(entries[-1][0]) - first == len(entries) - 1
    out: list[_MessageFields] = []
    append = out.append
    fields = _MessageFields
    message_class = Message
    empty = EMPTY_PROPERTIES
    plain_names = _PLAIN_NAMES
    offset = first
    last_t = b""
    born = 0.0
    for entry_id, raw in entries:
        m = fields()
        m.topic = topic
        m.queue_id = queue_id
        m.queue_offset = offset if consecutive else _entry_offset(entry_id)
        if raw[::2] == plain_names:
            m.body = raw[3]
            m.keys = ()
            m.tags = None
            m.properties = empty
            m.msg_id = m.offset_msg_id = raw[1].decode()
            t = raw[5]
            if t != last_t:
                last_t = t
                born = int(t) / 1000
            m.born_timestamp = born
            m.reconsume_times = 0
        else:
            _set_fields(m, entry_id, raw)
        m.__class__ = message_class
        append(m)
        offset += 1
    return cast("list[Message]", out)  # every one made a Message above


def _set_fields(m: _MessageFields, entry_id: bytes, raw: Sequence[bytes]) -> None:
    """The general case of :func:`_decode_entries`: optional fields present."""
    fields = dict(zip(raw[::2], raw[1::2], strict=True))
    if b"i" not in fields or b"b" not in fields or b"t" not in fields:
        raise _ForeignEntry(entry_id, raw)
    keys: tuple[str, ...] = ()
    tags: str | None = None
    properties: Mapping[str, str] = EMPTY_PROPERTIES
    if (k := fields.get(b"k")) is not None:
        loaded = json.loads(k)
        if not isinstance(loaded, list) or not all(isinstance(key, str) for key in loaded):
            raise TypeError(f"keys (field k) are not a JSON list of strings: {_shape(loaded)}")
        keys = tuple(loaded)
    if (g := fields.get(b"g")) is not None:
        tags = g.decode()
    if (p := fields.get(b"p")) is not None:
        loaded = json.loads(p)
        if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
            raise TypeError(
                f"properties (field p) are not a JSON object of strings: {_shape(loaded)}"
            )
        properties = MappingProxyType(loaded) or EMPTY_PROPERTIES
    r = fields.get(b"r")
    m.body = fields[b"b"]
    m.keys = keys
    m.tags = tags
    m.properties = properties
    m.msg_id = fields[b"i"].decode()
    o = fields.get(b"o")
    m.offset_msg_id = o.decode() if o is not None else m.msg_id
    m.born_timestamp = int(fields[b"t"]) / 1000
    m.reconsume_times = int(r) if r is not None else 0


def _shape(value: object) -> str:
    """What a decoded JSON value is, without its content."""
    if isinstance(value, list):
        return f"a list of {', '.join(sorted({type(v).__name__ for v in value})) or 'nothing'}"
    if isinstance(value, dict):
        kinds = sorted({type(v).__name__ for v in value.values()})
        return f"an object of {', '.join(kinds) or 'nothing'}"
    return f"a {type(value).__name__}"


def _decode_one(topic: str, queue_id: int, entry: Any) -> Message:
    """One raw entry as a :class:`Message`; raises :class:`_ForeignEntry` for an entry
    the broker did not write, and ``ValueError``, ``UnicodeDecodeError`` (a
    ``ValueError``), ``TypeError`` for one with the broker's fields, corrupt."""
    raw = entry[1]
    if len(raw) % 2:
        raise ValueError(f"odd number of field names and values ({len(raw)})")
    return _decode_entries(topic, queue_id, [entry])[0]


def _poison_message(
    topic: str,
    queue_id: int,
    offset: int,
    raw: Sequence[bytes],
    properties: Mapping[str, str],
) -> Message:
    """The dead-letter copy of a poison entry: what can be read of it (its body as
    stored, its message id with undecodable bytes replaced) and ``properties``."""
    fields = dict(zip(raw[::2], raw[1::2], strict=False))
    msg_id = fields.get(b"i", b"").decode(errors="replace")
    born = fields.get(b"t", b"")
    return Message(
        topic=topic,
        queue_id=queue_id,
        queue_offset=offset,
        body=bytes(fields.get(b"b", b"")),
        properties=properties,
        msg_id=msg_id,
        born_timestamp=int(born) / 1000 if born.isdigit() else 0.0,
    )


# -- streams written by other applications (RedisBroker.attach_stream) ----------------------

_SEQ_BITS = 19
"""Bits of an attached entry's offset that hold its id's sequence part."""
_SEQ_LIMIT = 1 << _SEQ_BITS
_SEQ_MASK = _SEQ_LIMIT - 1

EntryDecoder = Callable[[str, Mapping[bytes, bytes]], OutgoingMessage]
"""Turns an entry of an attached stream (its id, its fields) into a message's
content: body, keys, tags, properties. The broker adds the topic, queue, offset,
message id (the entry id) and born time (the id's milliseconds)."""


def _attached_offset(entry_id: bytes) -> int:
    """The queue offset of an attached stream's entry: ``ms << 19 | seq``.

    Order-preserving and without loss for every id whose sequence part is below 2**19
    (524,288 entries in one millisecond; ``XADD *`` numbers them from 0 each
    millisecond); an id past that raises :class:`_ForeignEntry` rather than share an
    offset. Offsets stay below 2**63 until the year 2527.
    """
    ms, _, seq = entry_id.partition(b"-")
    sequence = int(seq or b"0")
    if sequence >= _SEQ_LIMIT:
        raise _ForeignEntry(entry_id)
    return int(ms) << _SEQ_BITS | sequence


def _attached_id(offset: int) -> bytes:
    """The smallest entry id whose offset is at least ``offset``."""
    return b"%d-%d" % (offset >> _SEQ_BITS, offset & _SEQ_MASK)


def default_entry_decoder(
    body_field: str = "body", *, keys_field: str | None = None, tags_field: str | None = None
) -> EntryDecoder:
    """The decoder :meth:`RedisBroker.attach_stream <stagedconsumer.RedisBroker.attach_stream>`
    uses by default: ``body_field``'s value is the body (empty when the entry has none),
    ``keys_field``'s value (when given) the message key, ``tags_field``'s the tag, and
    every other field a property (names and values read as UTF-8, undecodable bytes
    replaced)."""
    body_name = body_field.encode()
    keys_name = keys_field.encode() if keys_field else None
    tags_name = tags_field.encode() if tags_field else None

    def decode(entry_id: str, fields: Mapping[bytes, bytes]) -> OutgoingMessage:
        properties = {
            name.decode(errors="replace"): value.decode(errors="replace")
            for name, value in fields.items()
            if name not in (body_name, keys_name, tags_name)
        }
        key = fields.get(keys_name) if keys_name else None
        tag = fields.get(tags_name) if tags_name else None
        return OutgoingMessage(
            body=bytes(fields.get(body_name, b"")),
            keys=(key.decode(errors="replace"),) if key is not None else (),
            tags=tag.decode(errors="replace") if tag is not None else None,
            properties=properties,
        )

    return decode


def _decode_attached(
    topic: str, queue_id: int, entries: Sequence[Any], decode: EntryDecoder
) -> list[Message]:
    """Raw ``XRANGE`` entries of an attached stream as :class:`Message` objects."""
    out: list[_MessageFields] = []
    for entry_id, raw in entries:
        offset = _attached_offset(entry_id)
        text_id = entry_id.decode()
        content = decode(text_id, dict(zip(raw[::2], raw[1::2], strict=True)))
        m = _MessageFields()
        m.topic = topic
        m.queue_id = queue_id
        m.queue_offset = offset
        m.body = content.body
        m.keys = _freeze_keys(content.keys)
        m.tags = content.tags
        m.properties = _freeze_properties(content.properties)
        m.msg_id = m.offset_msg_id = text_id
        m.born_timestamp = (offset >> _SEQ_BITS) / 1000
        m.reconsume_times = 0
        m.__class__ = Message
        out.append(m)
    return cast("list[Message]", out)
