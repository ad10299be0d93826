"""W3C traceparent parsing: the canonical fast path agrees with the full grammar."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagedconsumer.otel import format_traceparent, parse_traceparent

_FULL = re.compile(r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?[ \t]*$")


def reference(value: str) -> tuple[int, int, int] | None:
    """The grammar alone (opentelemetry-api's propagator pattern and W3C's rules)."""
    match = _FULL.match(value)
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(flags_hex, 16)


@pytest.mark.parametrize(
    "value",
    [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\t",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c8031_c-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
        "",
    ],
)
def test_parse_matches_the_grammar(value: str) -> None:
    assert parse_traceparent(value) == reference(value)


@given(
    trace_id=st.integers(0, 2**128 - 1),
    span_id=st.integers(0, 2**64 - 1),
    flags=st.integers(0, 255),
    prefix=st.sampled_from(["", " ", "\t"]),
    suffix=st.sampled_from(["", " ", "-x", "\n"]),
)
def test_parse_round_trips_and_matches_the_grammar(
    trace_id: int, span_id: int, flags: int, prefix: str, suffix: str
) -> None:
    value = prefix + format_traceparent(trace_id, span_id, flags) + suffix
    assert parse_traceparent(value) == reference(value)
    if not prefix and not suffix and trace_id and span_id:
        assert parse_traceparent(value) == (trace_id, span_id, flags)
