"""OpenTelemetry integration (``pip install 'stagedconsumer[otel]'``).

A public module of its own, not re-exported by the package, because it imports
OpenTelemetry and the package must work without it::

    from stagedconsumer.otel import OpenTelemetryHook, OpenTelemetrySendHook, serve_prometheus

    endpoint = serve_prometheus(9464)  # every interface; addr="127.0.0.1": this machine only
    consumer.register_consume_message_hook(
        OpenTelemetryHook(meter_provider=endpoint.meter_provider)
    )
    producer.register_send_message_hook(
        OpenTelemetrySendHook(meter_provider=endpoint.meter_provider)
    )
"""

try:
    import opentelemetry.metrics
    import opentelemetry.propagate
    import opentelemetry.trace  # noqa: F401
except ImportError as exc:  # pragma: no cover - tested in a subprocess
    raise ImportError(
        "stagedconsumer.otel needs OpenTelemetry, which is not installed:"
        " pip install 'stagedconsumer[otel]'",
        name=exc.name,
    ) from None

from ._observability._otel_hook import DURATION_BUCKETS as DURATION_BUCKETS
from ._observability._otel_hook import OpenTelemetryHook as OpenTelemetryHook
from ._observability._otel_hook import PrometheusEndpoint as PrometheusEndpoint
from ._observability._otel_hook import serve_prometheus as serve_prometheus
from ._observability._otel_send_hook import OpenTelemetrySendHook as OpenTelemetrySendHook
from ._observability._traceparent import format_traceparent as format_traceparent
from ._observability._traceparent import inject_traceparent as inject_traceparent
from ._observability._traceparent import parse_traceparent as parse_traceparent

__all__ = (
    "DURATION_BUCKETS",
    "OpenTelemetryHook",
    "OpenTelemetrySendHook",
    "PrometheusEndpoint",
    "format_traceparent",
    "inject_traceparent",
    "parse_traceparent",
    "serve_prometheus",
)
