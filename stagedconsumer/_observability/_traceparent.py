"""W3C ``traceparent`` on message properties, without importing OpenTelemetry.

Producers call :func:`inject_traceparent` (or :func:`with_traceparent`) on the
properties of every message they send: when OpenTelemetry is loaded and a span is
current, its context is written as a W3C ``traceparent`` property, which the
consumer's ``process`` spans link to (the message's creation context). When
OpenTelemetry was never imported there can be no current span, so the check is a
single dictionary lookup and nothing is imported: the core package runs without
OpenTelemetry installed.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator, Mapping

__all__ = (
    "TRACEPARENT",
    "TRACESTATE",
    "format_traceparent",
    "inject_traceparent",
    "parse_traceparent",
    "with_traceparent",
    "without_current_span",
)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# opentelemetry-api's TraceContextTextMapPropagator pattern.
_TRACEPARENT_RE = re.compile(
    r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?[ \t]*$"
)


def format_traceparent(trace_id: int, span_id: int, trace_flags: int) -> str:
    """``00-<32 hex trace id>-<16 hex span id>-<2 hex flags>``."""
    return f"00-{trace_id:032x}-{span_id:016x}-{trace_flags:02x}"


# The canonical form (version 00, no surrounding blanks): one fullmatch, three groups.
_TRACEPARENT_00_RE = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """``(trace_id, span_id, trace_flags)`` of a valid ``traceparent``, else ``None``.

    Follows W3C Trace Context: version ``ff`` and all-zero ids are invalid; a
    version-00 value must have exactly four fields.
    """
    match = _TRACEPARENT_00_RE.fullmatch(value)
    if match is not None:  # the usual case, checked first
        trace_hex, span_hex, flags_hex = match.groups()
        trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
        if not trace_id or not span_id:
            return None
        return trace_id, span_id, int(flags_hex, 16)
    match = _TRACEPARENT_RE.match(value)
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(flags_hex, 16)


def _current_traceparent() -> tuple[str, str] | None:
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    header = format_traceparent(
        span_context.trace_id, span_context.span_id, int(span_context.trace_flags)
    )
    return header, span_context.trace_state.to_header()


@contextlib.contextmanager
def without_current_span() -> Iterator[None]:
    """Run the block with no current span (an empty OpenTelemetry context), so that
    producers called in it inject no ``traceparent``. A no-op when OpenTelemetry is
    not loaded."""
    context = sys.modules.get("opentelemetry.context")
    if context is None:
        yield
        return
    token = context.attach(context.Context())
    try:
        yield
    finally:
        context.detach(token)


def inject_traceparent(properties: dict[str, str]) -> None:
    """Write the current span's context into ``properties`` as ``traceparent``
    (and ``tracestate`` when it has entries).

    A no-op when OpenTelemetry is not loaded, when no valid span is current, or
    when ``properties`` already carries a ``traceparent`` (a message keeps its
    first creation context).
    """
    if TRACEPARENT in properties:
        return
    current = _current_traceparent()
    if current is None:
        return
    properties[TRACEPARENT] = current[0]
    if current[1]:
        properties[TRACESTATE] = current[1]


def with_traceparent(properties: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """``properties`` plus the current ``traceparent`` (a new dict), or ``properties``
    itself when there is nothing to inject (see :func:`inject_traceparent`)."""
    if "opentelemetry.trace" not in sys.modules:
        return properties
    if properties and TRACEPARENT in properties:
        return properties
    current = _current_traceparent()
    if current is None:
        return properties
    out = dict(properties) if properties else {}
    out[TRACEPARENT] = current[0]
    if current[1]:
        out[TRACESTATE] = current[1]
    return out
