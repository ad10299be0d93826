"""``stagedconsumer run`` for a :class:`~stagedconsumer.SimpleWorker`: the adapter that
turns one into a :class:`~._run_target.Unit` (registered in
:data:`~._run_target.ADAPTERS` on import), and what it tells the log and ``/readyz``."""

from __future__ import annotations

from typing import Any

from .._message import MessageQueue
from .._runtime._simple import SimpleConsumer
from .._runtime._simple_worker import SimpleWorker
from ._run_target import ADAPTERS, Unit

__all__ = ("idle_consumers", "simple_worker_unit")


class WorkerProbe:
    def __init__(self, worker: SimpleWorker) -> None:
        self.worker = worker

    def leaving(self) -> str:
        worker = self.worker
        return (
            f"SimpleWorker {worker.consumer.group}: stop receiving, let handler calls in"
            f" flight finish and ack (up to shutdown_timeout={worker.shutdown_timeout:g} s),"
            " hand back the rest"
        )

    def abandoned(self) -> str | None:
        worker = self.worker
        held = worker.in_flight
        if not held:
            return None
        ids = ", ".join(m.msg_id for m in held[:10]) + (" ..." if len(held) > 10 else "")
        return (
            f"SimpleWorker {worker.consumer.group} ({worker.consumer.client_id}):"
            f" {len(held)} message(s) received and not acked ({ids}); they are delivered"
            f" again once their invisible duration ({worker.invisible_duration:g} s from"
            " their receive) has passed"
        )

    async def readiness(self) -> dict[str, Any]:
        from ._serve_http import _answers

        worker = self.worker
        consumer = worker.consumer
        topics = sorted(consumer.subscriptions)
        entry: dict[str, Any] = {
            "group": consumer.group,
            "client_id": consumer.client_id,
            "kind": "simple",
            "topics": topics,
            "in_flight": len(worker.in_flight),
        }
        problems: list[str] = []
        if not worker.running:
            problems.append("stopping" if worker._stopping else "not started")
        elif topics:
            error = await _answers(lambda: consumer.source.max_offset(MessageQueue(topics[0], 0)))
            error = error or worker.receive_error
            entry["broker"] = error or "ok"
            if error is not None:
                problems.append(f"broker: {error}")
        entry["ready"] = not problems
        if problems:
            entry["problems"] = problems
        return entry

    def prepare_metrics(self, meter_provider: Any) -> None:
        from ..otel import OpenTelemetryHook

        if not self.worker.consumer._started:
            self.worker.consumer.register_consume_message_hook(
                OpenTelemetryHook(meter_provider=meter_provider, spans=False)
            )


def simple_worker_unit(value: object) -> Unit | None:
    if not isinstance(value, SimpleWorker):
        return None
    return Unit(
        name=f"SimpleWorker {value.consumer.group} ({value.consumer.client_id})",
        context=value,
        probe=WorkerProbe(value),
    )


def idle_consumers(units: list[Unit]) -> list[SimpleConsumer]:
    """The SimpleConsumers entered with no SimpleWorker receiving from them."""
    served = {id(u.probe.worker.consumer) for u in units if isinstance(u.probe, WorkerProbe)}
    return [
        u.context
        for u in units
        if isinstance(u.context, SimpleConsumer) and id(u.context) not in served
    ]


ADAPTERS.append(simple_worker_unit)
