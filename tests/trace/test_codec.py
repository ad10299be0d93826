"""Trace records: RocketMQ's field order and separators, round trip, compatibility."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagedconsumer._observability._trace_codec import (
    CONTENT_SPLITOR,
    FIELD_SPLITOR,
    TraceBean,
    TraceContext,
    TraceMessage,
    TraceType,
    decode_trace_data,
    encode_trace_context,
    trace_keys,
)


def _before(**overrides: object) -> TraceContext:
    values: dict[str, object] = {
        "trace_type": TraceType.SubBefore,
        "timestamp": 1_700_000_000_123,
        "region_id": "DefaultRegion",
        "group_name": "g",
        "request_id": "REQ1",
        "stage_index": 2,
        "attempt": 1,
        "strategy_id": "default",
        "beans": [
            TraceBean(
                msg_id="M1",
                retry_times=0,
                keys="k1 k2",
                topic="t",
                barrier_wait_ms=17,
                cached_timestamp=1_700_000_000_100,
                queue_id=3,
                queue_offset=42,
            )
        ],
    }
    values.update(overrides)
    return TraceContext(**values)  # type: ignore[arg-type]


def test_sub_before_keeps_rocketmq_field_order() -> None:
    data = encode_trace_context(_before())
    assert data.endswith(FIELD_SPLITOR)
    assert data.count(FIELD_SPLITOR) == 1
    fields = data[:-1].split(CONTENT_SPLITOR)
    # RocketMQ's 8 fields first, then ours.
    assert fields[:8] == [
        "SubBefore",
        "1700000000123",
        "DefaultRegion",
        "g",
        "REQ1",
        "M1",
        "0",
        "k1 k2",
    ]
    assert fields[8:14] == ["2", "17", "1700000000100", "t", "3", "42"]


def test_sub_after_keeps_rocketmq_field_order() -> None:
    ctx = TraceContext(
        trace_type=TraceType.SubAfter,
        timestamp=1_700_000_000_200,
        group_name="g",
        request_id="REQ1",
        cost_time=12,
        success=False,
        context_code=2,
        stage_index=-1,
        settlement="suspend",
        attempt=1,
        beans=[TraceBean(msg_id="M1", keys="k1"), TraceBean(msg_id="M2", keys="")],
    )
    data = encode_trace_context(ctx)
    records = data.split(FIELD_SPLITOR)
    assert records[-1] == ""  # every record ends with U+0002
    first = records[0].split(CONTENT_SPLITOR)
    assert first[:9] == ["SubAfter", "REQ1", "M1", "12", "false", "k1", "2", "1700000000200", "g"]
    assert first[9:] == ["-1", "suspend", "1"]
    assert records[1].split(CONTENT_SPLITOR)[2] == "M2"


def _pub(**overrides: object) -> TraceContext:
    values: dict[str, object] = {
        "trace_type": TraceType.Pub,
        "timestamp": 1_700_000_000_050,
        "region_id": "DefaultRegion",
        "group_name": "pg",
        "cost_time": 3,
        "success": True,
        "attempt": 2,
        "beans": [
            TraceBean(
                topic="t",
                msg_id="M1",
                tags="paid",
                keys="k1 k2",
                store_host="127.0.0.1:6379",
                body_length=16,
                msg_type=0,
                offset_msg_id="3:42",
                client_host="host-a",
                queue_id=3,
                queue_offset=42,
            )
        ],
    }
    values.update(overrides)
    return TraceContext(**values)  # type: ignore[arg-type]


def test_pub_keeps_rocketmq_field_order() -> None:
    data = encode_trace_context(_pub())
    assert data.endswith(FIELD_SPLITOR)
    assert data.count(FIELD_SPLITOR) == 1
    fields = data[:-1].split(CONTENT_SPLITOR)
    # RocketMQ's 14 fields, clientHost (what its decoder reads as a 15th), then ours.
    assert fields[:14] == [
        "Pub",
        "1700000000050",
        "DefaultRegion",
        "pg",
        "t",
        "M1",
        "paid",
        "k1 k2",
        "127.0.0.1:6379",
        "16",
        "3",
        "0",
        "3:42",
        "true",
    ]
    assert fields[14:] == ["host-a", "3", "42", "2"]


def test_a_pub_context_of_several_beans_is_one_record_per_bean() -> None:
    second = TraceBean(topic="t", msg_id="M2", keys="", queue_id=3, queue_offset=43)
    ctx = _pub(beans=[*_pub().beans, second])
    records = encode_trace_context(ctx).split(FIELD_SPLITOR)
    assert len(records) == 3
    assert records[-1] == ""
    assert records[1].split(CONTENT_SPLITOR)[5] == "M2"
    assert [c.beans[0].msg_id for c in decode_trace_data(encode_trace_context(ctx))] == [
        "M1",
        "M2",
    ]
    assert trace_keys([ctx]) == ["M1", "k1", "k2", "M2"]


_MESSAGE_TYPES = ("Normal_Msg", "Trans_Msg_Half", "Trans_msg_Commit", "Delay_Msg", "Order_Msg")
"""RocketMQ's ``MessageType``, in ordinal order."""


def _java_split(record: str) -> list[str]:
    """``record.split(CONTENT_SPLITOR)`` as Java's ``String.split`` does it: trailing
    empty strings removed."""
    fields = record.split(CONTENT_SPLITOR)
    while len(fields) > 1 and fields[-1] == "":
        fields.pop()
    return fields


def _rocketmq_decode(data: str) -> list[dict[str, object]]:
    """What ``TraceDataEncoder.decoderFromTraceDataString`` (apache/rocketmq, client
    ``org.apache.rocketmq.client.trace``) reads from ``data``, field by field: Java's
    split, ``Long.parseLong`` / ``Integer.parseInt`` (which raise on anything but an
    integer), ``MessageType.values()[i]``, ``Boolean.parseBoolean``, and its rules for
    13, 14 and 15 or more ``Pub`` fields and 7 and 9 ``SubAfter`` fields."""
    out: list[dict[str, object]] = []
    for record in data.split(FIELD_SPLITOR):
        if not record:
            continue  # Java drops the trailing empty string after the last record
        line = _java_split(record)
        if line[0] == "Pub":
            pub: dict[str, object] = {
                "type": "Pub",
                "timeStamp": int(line[1]),
                "regionId": line[2],
                "groupName": line[3],
                "topic": line[4],
                "msgId": line[5],
                "tags": line[6],
                "keys": line[7],
                "storeHost": line[8],
                "bodyLength": int(line[9]),
                "costTime": int(line[10]),
                "msgType": _MESSAGE_TYPES[int(line[11])],
                "offsetMsgId": "",
                "isSuccess": True,
                "clientHost": "",
            }
            if len(line) == 13:
                pub["isSuccess"] = line[12].lower() == "true"
            elif len(line) >= 14:
                pub["offsetMsgId"] = line[12]
                pub["isSuccess"] = line[13].lower() == "true"
            if len(line) >= 15:
                pub["clientHost"] = line[14]
            out.append(pub)
        elif line[0] == "SubBefore":
            out.append(
                {
                    "type": "SubBefore",
                    "timeStamp": int(line[1]),
                    "regionId": line[2],
                    "groupName": line[3],
                    "requestId": line[4],
                    "msgId": line[5],
                    "retryTimes": int(line[6]),
                    "keys": line[7],
                }
            )
        elif line[0] == "SubAfter":
            after: dict[str, object] = {
                "type": "SubAfter",
                "requestId": line[1],
                "msgId": line[2],
                "costTime": int(line[3]),
                "isSuccess": line[4].lower() == "true",
                "keys": line[5],
                "contextCode": 0,
                "timeStamp": 0,
                "groupName": "",
            }
            if len(line) >= 7:
                after["contextCode"] = int(line[6])
            if len(line) >= 9:
                after["timeStamp"] = int(line[7])
                after["groupName"] = line[8]
            out.append(after)
    return out


def test_rocketmq_reads_our_pub_records_with_its_meaning() -> None:
    [pub] = _rocketmq_decode(encode_trace_context(_pub()))
    assert pub == {
        "type": "Pub",
        "timeStamp": 1_700_000_000_050,
        "regionId": "DefaultRegion",
        "groupName": "pg",
        "topic": "t",
        "msgId": "M1",
        "tags": "paid",
        "keys": "k1 k2",
        "storeHost": "127.0.0.1:6379",
        "bodyLength": 16,
        "costTime": 3,
        "msgType": "Normal_Msg",
        "offsetMsgId": "3:42",
        "isSuccess": True,
        "clientHost": "host-a",
    }
    # Without clientHost and our fields (all empty), Java's split leaves RocketMQ's 14.
    bare = _pub(beans=[TraceBean(topic="t", msg_id="M1")], attempt=None, success=False)
    [pub] = _rocketmq_decode(encode_trace_context(bare))
    assert (pub["msgId"], pub["isSuccess"], pub["clientHost"], pub["offsetMsgId"]) == (
        "M1",
        False,
        "",
        "",
    )


def test_decodes_records_written_by_rocketmq() -> None:
    s, e = CONTENT_SPLITOR, FIELD_SPLITOR
    data = (
        s.join(["SubBefore", "1000", "DefaultRegion", "cg", "R", "MID", "1", "a b"])
        + e
        + s.join(["SubAfter", "R", "MID", "5", "true", "a b", "0", "1005", "cg"])
        + e
        # An AccessChannel.CLOUD SubAfter: 7 fields and a trailing separator.
        + s.join(["SubAfter", "R2", "MID", "7", "false", "a b", "4", ""])
        + e
        + s.join(
            [
                "Pub",
                "900",
                "DefaultRegion",
                "pg",
                "t",
                "MID",
                "tag",
                "a b",
                "host:10911",
                "16",
                "3",
                "0",
                "OFF",
                "true",
            ]
        )
        + e
        + s.join(
            ["Pub", "901", "r", "pg", "t", "MID2", "", "", "h", "1", "2", "0", "false"]
        )  # old, 13
        + e
        + s.join(
            ["EndTransaction", "1", "r", "g", "t", "m", "", "", "h", "1", "x", "COMMIT", "false"]
        )
        + e
    )
    contexts = decode_trace_data(data)
    assert [c.trace_type for c in contexts] == [
        TraceType.SubBefore,
        TraceType.SubAfter,
        TraceType.SubAfter,
        TraceType.Pub,
        TraceType.Pub,
    ]
    before, after, cloud, pub, old_pub = contexts
    assert (before.timestamp, before.group_name, before.request_id) == (1000, "cg", "R")
    assert (before.beans[0].msg_id, before.beans[0].retry_times, before.beans[0].keys) == (
        "MID",
        1,
        "a b",
    )
    assert before.stage_index is None
    assert before.beans[0].barrier_wait_ms is None
    assert (after.request_id, after.cost_time, after.success, after.timestamp) == (
        "R",
        5,
        True,
        1005,
    )
    assert (cloud.context_code, cloud.success, cloud.timestamp, cloud.group_name) == (
        4,
        False,
        0,
        "",
    )
    assert (pub.beans[0].offset_msg_id, pub.success, pub.cost_time) == ("OFF", True, 3)
    assert (old_pub.beans[0].offset_msg_id, old_pub.success) == ("", False)


def test_separators_inside_values_cannot_break_records() -> None:
    bean = TraceBean(msg_id="M\u00011", keys="a\u0002b")
    data = encode_trace_context(_before(beans=[bean], group_name="g\u0001x"))
    [decoded] = decode_trace_data(data)
    assert decoded.beans[0].msg_id == "M1"
    assert decoded.beans[0].keys == "ab"
    assert decoded.group_name == "gx"


def test_trace_keys_are_message_ids_and_business_keys() -> None:
    ctx = _before(beans=[TraceBean(msg_id="M1", keys="k1 k2"), TraceBean(msg_id="M2", keys="k2")])
    assert trace_keys([ctx]) == ["M1", "k1", "k2", "M2"]


_text = st.text(
    alphabet=st.characters(exclude_characters="\u0001\u0002", exclude_categories=["Cs"]),
    max_size=12,
)
_word = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=8)
_ms = st.integers(min_value=0, max_value=2**42)
_opt_int = st.none() | st.integers(min_value=-1, max_value=10**6)


@st.composite
def _contexts(draw: st.DrawFn) -> TraceContext:
    kind = draw(st.sampled_from([TraceType.Pub, TraceType.SubBefore, TraceType.SubAfter]))
    keys = st.lists(_word, max_size=3).map(" ".join)
    if kind is TraceType.Pub:
        beans = draw(
            st.lists(
                st.builds(
                    TraceBean,
                    topic=_text,
                    msg_id=_word,
                    tags=_text,
                    keys=keys,
                    store_host=_text,
                    body_length=st.integers(0, 2**31 - 1),
                    msg_type=st.integers(0, 4),
                    offset_msg_id=_text,
                    client_host=_text,
                    queue_id=_opt_int,
                    queue_offset=_opt_int,
                ),
                min_size=1,
                max_size=3,
            )
        )
        return TraceContext(
            trace_type=kind,
            timestamp=draw(_ms),
            region_id=draw(_text),
            group_name=draw(_text),
            cost_time=draw(st.integers(0, 10**6)),
            success=draw(st.booleans()),
            attempt=draw(_opt_int),
            beans=beans,
        )
    if kind is TraceType.SubBefore:
        beans = draw(
            st.lists(
                st.builds(
                    TraceBean,
                    msg_id=_word,
                    keys=keys,
                    retry_times=st.integers(0, 100),
                    barrier_wait_ms=_opt_int,
                    cached_timestamp=st.none() | _ms,
                    topic=_text,
                    queue_id=_opt_int,
                    queue_offset=_opt_int,
                ),
                min_size=1,
                max_size=3,
            )
        )
        return TraceContext(
            trace_type=kind,
            timestamp=draw(_ms),
            region_id=draw(_text),
            group_name=draw(_text),
            request_id=draw(_word),
            stage_index=draw(_opt_int),
            attempt=draw(_opt_int),
            strategy_id=draw(_text),
            stage_group_id=draw(_text),
            beans=beans,
        )
    beans = draw(st.lists(st.builds(TraceBean, msg_id=_word, keys=keys), min_size=1, max_size=3))
    return TraceContext(
        trace_type=kind,
        timestamp=draw(_ms),
        group_name=draw(_text),
        request_id=draw(_word),
        cost_time=draw(st.integers(0, 10**6)),
        success=draw(st.booleans()),
        context_code=draw(st.integers(0, 4)),
        stage_index=draw(_opt_int),
        attempt=draw(_opt_int),
        settlement=draw(st.sampled_from(["", "retry", "suspend", "dlq"])),
        beans=beans,
    )


@pytest.mark.slow
@given(st.lists(_contexts(), min_size=1, max_size=4))
def test_round_trip(contexts: list[TraceContext]) -> None:
    data = "".join(encode_trace_context(c) for c in contexts)
    decoded = decode_trace_data(data)
    expected = [attrs.evolve(c, beans=[bean]) for c in contexts for bean in c.beans]
    assert [attrs.asdict(d) for d in decoded] == [attrs.asdict(e) for e in expected]


@given(st.text(), st.lists(st.text(), max_size=4), st.text())
def test_a_trace_message_line_is_what_json_dumps_makes(
    topic: str, keys: list[str], body: str
) -> None:
    # Any text: separators, quotes, backslashes, control characters, non-ASCII, lone
    # surrogates; the file sink's lines are read back with json.loads.
    message = TraceMessage(topic=topic, keys=tuple(keys), body=body)
    line = message.to_json()
    assert line == json.dumps({"topic": topic, "keys": keys, "body": body})
    assert TraceMessage.from_json(line) == message
