"""The ``--http`` endpoints of ``stagedconsumer run``, served by Hypercorn on the run's
own event loop (asyncio or trio: Hypercorn serves both, so a loop that stops answering
fails the liveness probe with it).

- ``/healthz``: 200 while the event loop answers.
- ``/readyz``: 200 once everything started and while it runs: each consumer has queues
  assigned or waits for an assignment (a group with more members than queues), and its
  offset store and broker answer a read within a second; 503 otherwise (starting,
  stopping, a store or broker that does not answer), with the reasons as JSON.
- ``/metrics``: the Prometheus exposition of :class:`stagedconsumer.otel.OpenTelemetryHook`
  and ``OpenTelemetrySendHook`` (registered on every consumer and producer the run
  starts), with the process's own metrics (``process_*``, ``python_gc_*``).
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
import attrs
import sniffio

from .._message import MessageQueue
from .._runtime._consumer import PushConsumer
from .._sources._source import RETRY_PREFIX
from ._run_target import Unit

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

__all__ = ("Metrics", "RunStatus", "bind", "serve_http")

logger = logging.getLogger("stagedconsumer.run")

PROBE_TIMEOUT = 1.0
"""Seconds a readiness probe waits for the store's and the broker's answer."""

Phase = Literal["starting", "running", "stopping"]


@attrs.define(eq=False)
class RunStatus:
    """What the endpoints see of a run."""

    phase: Phase = "starting"
    units: list[Unit] = attrs.Factory(list)


async def _answers(what: Callable[[], Any]) -> str | None:
    """``None`` when ``what()`` returns within :data:`PROBE_TIMEOUT`, else why not."""
    try:
        with anyio.move_on_after(PROBE_TIMEOUT) as scope:
            await what()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if scope.cancelled_caught:
        return f"no answer within {PROBE_TIMEOUT:g} s"
    return None


def _probe_queue(consumer: PushConsumer) -> MessageQueue | None:
    queues = consumer.assigned_queues or sorted(
        consumer._known_queues or (), key=lambda mq: (mq.topic, mq.queue_id)
    )
    plain = [mq for mq in queues if not mq.topic.startswith(RETRY_PREFIX)]
    return plain[0] if plain else None


async def consumer_readiness(consumer: PushConsumer) -> dict[str, Any]:
    """One consumer's part of ``/readyz``: ``ready`` and what it is based on."""
    state = consumer._state
    queues = consumer.assigned_queues
    entry: dict[str, Any] = {
        "group": consumer.group,
        "client_id": consumer.client_id,
        "queues": [f"{mq.topic}#{mq.queue_id}" for mq in queues],
    }
    problems: list[str] = []
    if not state.started:
        problems.append("not started")
    elif state.closed or state.stopping:
        problems.append("stopping")
    if not queues and consumer._coordinator is None and state.started:
        problems.append("no queues")
    elif not queues:
        entry["waiting_for_assignment"] = True
    mq = _probe_queue(consumer)
    if mq is not None and not problems:
        store_error = await _answers(lambda: consumer.offset_store._read_stored(consumer.group, mq))
        broker_error = await _answers(lambda: consumer.source.max_offset(mq))
        entry["store"] = store_error or "ok"
        entry["broker"] = broker_error or "ok"
        if store_error is not None:
            problems.append(f"offset store: {store_error}")
        if broker_error is not None:
            problems.append(f"broker: {broker_error}")
    entry["ready"] = not problems
    if problems:
        entry["problems"] = problems
    return entry


async def readiness(status: RunStatus) -> tuple[bool, dict[str, Any]]:
    """``/readyz``'s verdict and body."""
    body: dict[str, Any] = {"phase": status.phase}
    consumers = []
    for unit in status.units:
        if unit.consumer is not None:
            consumers.append(await consumer_readiness(unit.consumer))
        elif unit.probe is not None:
            consumers.append(await unit.probe.readiness())
    body["consumers"] = consumers
    ready = status.phase == "running" and all(c["ready"] for c in consumers)
    body["ready"] = ready
    return ready, body


class Metrics:
    """A Prometheus registry of the run's own, fed by OpenTelemetry hooks."""

    def __init__(self) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from prometheus_client import CollectorRegistry, GCCollector, ProcessCollector

        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.meter_provider = MeterProvider(
            metric_readers=[PrometheusMetricReader(registry=self.registry)]
        )

    def prepare(self, unit: Unit) -> None:
        """Register the metrics hook on a consumer or producer not started yet."""
        from ..otel import OpenTelemetryHook, OpenTelemetrySendHook

        if unit.context is None:  # running already: hooks can no longer be added
            return
        if unit.probe is not None:
            unit.probe.prepare_metrics(self.meter_provider)
        elif unit.consumer is not None:
            unit.consumer.register_consume_message_hook(
                OpenTelemetryHook(meter_provider=self.meter_provider, spans=False)
            )
        elif unit.producer is not None:
            unit.producer.register_send_message_hook(
                OpenTelemetrySendHook(meter_provider=self.meter_provider, spans=False)
            )

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def close(self) -> None:
        self.meter_provider.shutdown()


class HealthApp:
    """The ASGI application of the endpoints (GET and HEAD only)."""

    def __init__(self, status: RunStatus, metrics: Metrics | None) -> None:
        self.status = status
        self.metrics = metrics

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        content_type = "text/plain; charset=utf-8"
        if scope["method"] not in ("GET", "HEAD"):
            code, body = 405, b"method not allowed\n"
        elif scope["path"] == "/healthz":
            code, body = 200, b"ok\n"
        elif scope["path"] == "/readyz":
            ready, detail = await readiness(self.status)
            code = 200 if ready else 503
            body = (json.dumps(detail) + "\n").encode()
            content_type = "application/json"
        elif scope["path"] == "/metrics" and self.metrics is not None:
            code, body = 200, self.metrics.exposition()
            content_type = "text/plain; version=0.0.4; charset=utf-8"
        else:
            code, body = 404, b"not found: /healthz, /readyz, /metrics\n"
        headers = [
            (b"content-type", content_type.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": code, "headers": headers})
        await send(
            {
                "type": "http.response.body",
                "body": b"" if scope["method"] == "HEAD" else body,
                "more_body": False,
            }
        )


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` (host ``127.0.0.1``); ``[::1]:PORT`` for IPv6."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--http {text!r}: expected HOST:PORT or PORT") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"--http {text!r}: port {number} is out of range")
    return host, number


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (``OSError`` naming it when it cannot be had)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"--http: cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


async def serve_http(
    app: HealthApp,
    sock: socket.socket,
    shutdown: anyio.Event,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``sock`` (taken over) until ``shutdown`` is set."""
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = None
    config.graceful_timeout = 1.0
    task_status.started()
    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve as trio_serve

        await trio_serve(app, config, shutdown_trigger=shutdown.wait)
    else:
        from hypercorn.asyncio import serve as asyncio_serve

        await asyncio_serve(app, config, shutdown_trigger=shutdown.wait)
