"""OpenTelemetry traces and metrics, on the API only (the SDK is the application's choice).

Trace shape: `enqueue` opens a PRODUCER span and stores its W3C context on the run. Every
execution of the run opens a CONSUMER span that is a *child* of that stored context, so all
executions of a run, days apart or not, belong to the enqueuer's trace and `ctx.trace_id` is
that trace's id. Each step that really executes is a child span of its execution; a replayed
step is only an event on the execution span, so traces stay honest across resumes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from umt_sdk._error_info import error_info, printed
from umt_sdk._spi import ClaimedRun, StepRecord, TaskPair

__all__ = ["ExecutionTelemetry", "Telemetry"]

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
        Telemetry.record_exception(span, error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {printed(error)}"))

    @staticmethod
    def record_exception(span: Span, error: BaseException) -> None:
        """The span's `exception` event (OpenTelemetry's semantic conventions), printed safely:
        `span.record_exception` calls the error's `__str__`, which is user code."""
        info = error_info(error)
        span.add_event(
            "exception",
            {
                "exception.type": info.type,
                "exception.message": info.message,
                "exception.stacktrace": info.traceback,
                "exception.escaped": False,
            },
        )


class ExecutionTelemetry:
    """The telemetry of one execution behind one seam: its span (a child of the enqueuer's
    context), the events on it, the step spans, and the run and step metrics. The execution
    and its steps say what happened; only this class knows how that is traced and counted."""

    def __init__(self, telemetry: Telemetry, claimed: ClaimedRun, worker_id: str) -> None:
        self._telemetry = telemetry
        self._claimed = claimed
        self.task_attributes = Telemetry.task_attributes(claimed.task_name, claimed.task_version)
        self.attributes: dict[str, Any] = {
            **self.task_attributes,
            "umt.run.id": str(claimed.run_id),
            "umt.attempt": claimed.claims,
            "umt.priority": claimed.priority,
            "umt.worker.id": worker_id,
        }
        self.span = telemetry.execution_span(
            task_name=claimed.task_name,
            parent=telemetry.extract(claimed.trace_context),
            attributes=self.attributes,
        )
        span_context = self.span.get_span_context()
        self.trace_id = (
            format(span_context.trace_id, "032x") if span_context.is_valid else _trace_id(claimed)
        )

    def event(self, name: str, **attributes: Any) -> None:
        """An event on the execution span (attributes that are None are left out)."""
        self.span.add_event(name, {k: v for k, v in attributes.items() if v is not None})

    @contextmanager
    def running(self) -> Iterator[None]:
        """The execution's span is current while the handler runs, and ends with it."""
        self._telemetry.runs_started.add(1, self.task_attributes)
        claimed = self._claimed
        if claimed.ready_at is not None:
            self._telemetry.claim_latency.record(
                max(0.0, (claimed.claimed_at - claimed.ready_at).total_seconds()),
                self.task_attributes,
            )
        with trace.use_span(self.span, end_on_exit=True):
            yield

    def outcome(self, outcome: str, error: BaseException | None = None) -> None:
        """How the execution ended: the span's `umt.outcome`, and the run counters."""
        self.span.set_attribute("umt.outcome", outcome)
        counter = {
            "completed": self._telemetry.runs_completed,
            "failed": self._telemetry.runs_failed,
            "canceled": self._telemetry.runs_canceled,
        }.get(outcome)
        if counter is not None:
            counter.add(1, self.task_attributes)
        if error is not None and outcome in ("failed", "retrying"):
            Telemetry.fail(self.span, error)
        elif error is not None:
            Telemetry.record_exception(self.span, error)

    def fenced(self, step_name: str | None) -> None:
        """A write of this execution was refused: another attempt holds the run."""
        self._telemetry.fencing_rejections.add(1, self.attributes)
        self.event("umt.fencing_rejected", **{"umt.step.name": step_name})

    def lease_lost(self) -> None:
        """The worker saw this execution's lease lost (its heartbeat was refused)."""
        self._telemetry.lease_expirations.add(1, self.attributes)

    def replayed(self, record: StepRecord) -> None:
        self.event(
            "umt.step.replayed",
            **{
                "umt.step.name": record.name,
                "umt.step.kind": record.kind,
                "umt.step.attempt": record.attempt,
            },
        )

    @contextmanager
    def step(self, name: str, attempt: int) -> Iterator[None]:
        """A step that really executes: a child span, its outcome, and its duration. Control
        flow that unwinds through it (a park, a release, a crash) names its own outcome in a
        `step_outcome` attribute; anything else without one reads `interrupted`."""
        started = time.monotonic()
        with self._telemetry.tracer.start_as_current_span(
            f"umt.step {name}",
            attributes={
                **self.attributes,
                "umt.step.name": name,
                "umt.step.kind": "step",
                "umt.step.attempt": attempt,
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield
                span.set_attribute("umt.step.outcome", "completed")
            except BaseException as exc:
                if isinstance(exc, Exception):
                    span.set_attribute("umt.step.outcome", "failed")
                    Telemetry.fail(span, exc)
                else:
                    span.set_attribute(
                        "umt.step.outcome", getattr(exc, "step_outcome", "interrupted")
                    )
                raise
            finally:
                self._telemetry.step_duration.record(
                    time.monotonic() - started, {**self.task_attributes, "umt.step.kind": "step"}
                )

    @staticmethod
    def current_span_id() -> str | None:
        """The id of the current span (a step's, else the execution's), for log records."""
        span_context = trace.get_current_span().get_span_context()
        return format(span_context.span_id, "016x") if span_context.is_valid else None


def _trace_id(claimed: ClaimedRun) -> str:
    """Without a tracer, the enqueuer's trace id from the stored context, else the run's id."""
    traceparent = claimed.trace_context.get("traceparent", "")
    parts = traceparent.split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
        return parts[1]
    return claimed.run_id.hex
