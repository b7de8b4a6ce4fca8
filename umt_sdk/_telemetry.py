"""OpenTelemetry traces and metrics, on the API only (the SDK is the application's choice).

Trace shape: `enqueue` opens a PRODUCER span and stores its W3C context on the run. Every
execution of the run opens a CONSUMER span that is a *child* of that stored context, so all
executions of a run, days apart or not, belong to the enqueuer's trace and `ctx.trace_id` is
that trace's id. Each step that really executes is a child span of its execution; a replayed
step is only an event on the execution span, so traces stay honest across resumes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from umt_sdk._spi import TaskPair

__all__ = ["Telemetry"]

_SYSTEM = "umt"


class Telemetry:
    """The tracer and instruments of one engine."""

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self.tracer = trace.get_tracer("umt", tracer_provider=tracer_provider)
        meter = metrics.get_meter("umt", meter_provider=meter_provider)
        self.runs_enqueued = meter.create_counter(
            "umt.runs.enqueued", unit="{run}", description="Runs created by enqueue"
        )
        self.runs_started = meter.create_counter(
            "umt.runs.started", unit="{execution}", description="Executions started by workers"
        )
        self.runs_completed = meter.create_counter("umt.runs.completed", unit="{run}")
        self.runs_failed = meter.create_counter("umt.runs.failed", unit="{run}")
        self.runs_canceled = meter.create_counter("umt.runs.canceled", unit="{run}")
        self.step_duration = meter.create_histogram(
            "umt.step.duration", unit="s", description="Duration of executed (not replayed) steps"
        )
        self.claim_latency = meter.create_histogram(
            "umt.claim.latency", unit="s", description="Time from a run's available_at to its claim"
        )
        self.lease_expirations = meter.create_counter(
            "umt.lease.expirations", unit="{lease}", description="Leases this process lost"
        )
        self.fencing_rejections = meter.create_counter(
            "umt.fencing.rejections", unit="{write}", description="Writes refused by fencing"
        )
        self._depths: dict[TaskPair, int] = {}
        self._depths_lock = threading.Lock()
        meter.create_observable_gauge(
            "umt.queue.depth",
            callbacks=[self._observe_depths],
            unit="{run}",
            description="Pending runs per task and version (refreshed by workers)",
        )

    # -- metrics helpers ------------------------------------------------------------------------

    @staticmethod
    def task_attributes(name: str, version: int) -> dict[str, Any]:
        return {"umt.task.name": name, "umt.task.version": version}

    def set_depths(self, depths: Mapping[TaskPair, int]) -> None:
        with self._depths_lock:
            self._depths.update(depths)

    def _observe_depths(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._depths_lock:
            items = list(self._depths.items())
        return [Observation(count, self.task_attributes(p.name, p.version)) for p, count in items]

    # -- spans --------------------------------------------------------------------------------

    @contextmanager
    def producer_span(self, name: str, attributes: Mapping[str, Any]) -> Iterator[Span]:
        with self.tracer.start_as_current_span(
            name,
            kind=SpanKind.PRODUCER,
            attributes={"messaging.system": _SYSTEM, **attributes},
            record_exception=True,
            set_status_on_exception=True,
        ) as span:
            yield span

    @contextmanager
    def client_span(self, name: str, attributes: Mapping[str, Any]) -> Iterator[Span]:
        with self.tracer.start_as_current_span(
            name, kind=SpanKind.CLIENT, attributes=dict(attributes)
        ) as span:
            yield span

    @staticmethod
    def inject() -> dict[str, str]:
        """The current context as W3C headers (traceparent, tracestate, baggage)."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return carrier

    @staticmethod
    def extract(carrier: Mapping[str, str]) -> Context:
        return propagate.extract(dict(carrier))

    def execution_span(
        self, *, task_name: str, parent: Context, attributes: Mapping[str, Any]
    ) -> Span:
        return self.tracer.start_span(
            f"umt.run {task_name}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": _SYSTEM,
                "messaging.operation.type": "process",
                "messaging.destination.name": task_name,
                **attributes,
            },
        )

    @staticmethod
    def fail(span: Span, error: BaseException) -> None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
