"""OpenTelemetry traces and metrics, on the API only (the SDK is the application's choice).

Trace shape: `enqueue` opens a PRODUCER span and stores its W3C context on the run. Every
execution of the run opens a CONSUMER span that is a *child* of that stored context, so all
executions of a run, days apart or not, belong to the enqueuer's trace and `ctx.trace_id` is
that trace's id. Each step that really executes is a child span of its execution; a replayed
step is only an event on the execution span, so traces stay honest across resumes.

One rule for span status: a failure of the user's code (a step's or a handler's exception) is
ERROR with an `exception` event, whether or not it will be retried; a cancel, a release, a lost
lease or a crash is not an error (status UNSET) and the outcome attribute says which it was.
Every metric and attribute is listed, with its meaning and the process that emits it, in
docs/operations.md ("Telemetry").
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from typing import Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from umt_sdk._error_info import error_info, printed
from umt_sdk._spi import ClaimedRun, StepRecord, TaskPair
from umt_sdk.exceptions import CanceledError

__all__ = ["ExecutionTelemetry", "StepTrace", "Telemetry"]

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
        # Only a commit the SDK made itself is known to have happened: an enqueue on the
        # caller's transaction (`conn=`) is a request, counted as such and not as a run.
        self.runs_enqueued = meter.create_counter(
            "umt.runs.enqueued",
            unit="{run}",
            description="Runs created and committed by enqueue in its own transaction",
        )
        self.enqueue_requests = meter.create_counter(
            "umt.enqueue.requests",
            unit="{request}",
            description="Enqueue calls the backend answered, in the SDK's own transaction or "
            "the caller's (umt.enqueue.transaction)",
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
            "umt.lease.expirations",
            unit="{lease}",
            description="Expired leases taken over by this process's claims",
        )
        self.leases_lost = meter.create_counter(
            "umt.lease.lost",
            unit="{execution}",
            description="Executions this process stopped because it found their lease lost",
        )
        self.runs_needing_attention = meter.create_counter(
            "umt.runs.needs_attention",
            unit="{run}",
            description="Runs parked in needs_attention: a step's outcome is unknown and an "
            "operator must settle it",
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
        if not _records(self.tracer):
            # No span, no context switch: what is injected is the caller's context, as the
            # no-op span (which carries it) would have given.
            yield trace.INVALID_SPAN
            return
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
        # No tracer records (no SDK installed, a no-op provider): no step span, attribute dict
        # or context switch per step; the execution span (a no-op too) is made once per run.
        self.records = _records(telemetry.tracer)
        self._step_metric_attributes = {**self.task_attributes, "umt.step.kind": "step"}
        self.span = telemetry.execution_span(
            task_name=claimed.task_name,
            parent=telemetry.extract(claimed.trace_context),
            attributes=self.attributes,
        )
        span_context = self.span.get_span_context()
        self.trace_id = (
            format(span_context.trace_id, "032x") if span_context.is_valid else _trace_id(claimed)
        )
        self._retry_error: BaseException | None = None

    def event(self, name: str, **attributes: Any) -> None:
        """An event on the execution span (attributes that are None are left out)."""
        if not self.records:
            return
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
        if claimed.lost_leases > 0:
            # This claim took over a lease that expired: the one place an expiration is seen
            # by a live process (its holder may be dead, as after a `kill -9`).
            self._telemetry.lease_expirations.add(1, self.task_attributes)
            self.event("umt.lease_taken_over", **{"umt.lease.lost_since_step": claimed.lost_leases})
        with trace.use_span(self.span, end_on_exit=True):
            yield

    def outcome(self, outcome: str, error: BaseException | None = None) -> None:
        """How the execution ended: the span's `umt.outcome`, and the run counters. An error of
        the user's code makes the span ERROR (a cancel itself is no error)."""
        self.span.set_attribute("umt.outcome", outcome)
        counter = {
            "completed": self._telemetry.runs_completed,
            "failed": self._telemetry.runs_failed,
            "canceled": self._telemetry.runs_canceled,
        }.get(outcome)
        if counter is not None:
            counter.add(1, self.task_attributes)
        if error is not None and not _is_cancel(error):
            Telemetry.fail(self.span, error)

    def parked(self) -> None:
        """The execution parked the run: `retrying` when a step's failure scheduled a retry
        (the span already carries that failure), else `parked` (a sleep, a fact wait)."""
        self.outcome("retrying" if self._retry_error is not None else "parked")

    def retry_scheduled(
        self, step_name: str, attempt: int, retry_at: str, error: BaseException
    ) -> None:
        """A step's failure parked the run until its retry: the event names the error, and
        the execution span is ERROR as when the handler's own failure is retried."""
        info = error_info(error)
        self.event(
            "umt.step.retry_scheduled",
            **{
                "umt.step.name": step_name,
                "umt.step.attempt": attempt,
                "umt.retry_at": retry_at,
                "exception.type": info.type,
                "exception.message": info.message,
            },
        )
        self._retry_error = error
        Telemetry.fail(self.span, error)

    def needs_attention(self, step_name: str, attempt: int, error: BaseException) -> None:
        """A step failed in a way that leaves its outcome unknown: the run parks in
        `needs_attention` (an event naming the step and the error, and the counter)."""
        info = error_info(error)
        self._telemetry.runs_needing_attention.add(1, self.task_attributes)
        self.event(
            "umt.step.needs_attention",
            **{
                "umt.step.name": step_name,
                "umt.step.attempt": attempt,
                "exception.type": info.type,
                "exception.message": info.message,
            },
        )

    def rate_limit_wait(
        self,
        step_name: str,
        attempt: int,
        *,
        limit: str,
        key: str,
        until: datetime,
        paused: bool,
        parked: bool,
    ) -> None:
        """A step found no token of its rate limit and waits for one: in place (a token due
        within a second) or with its run parked until `until`, when it asks again."""
        if not self.records:
            return
        self.event(
            "umt.rate_limit.wait",
            **{
                "umt.step.name": step_name,
                "umt.step.attempt": attempt,
                "umt.rate_limit.name": limit,
                "umt.rate_limit.key": key or None,
                "umt.rate_limit.until": until.isoformat(),
                "umt.rate_limit.paused": paused,
                "umt.rate_limit.parked": parked,
            },
        )

    def fenced(self, step_name: str | None) -> None:
        """A write of this execution was refused: another attempt holds the run."""
        self._telemetry.fencing_rejections.add(1, self.task_attributes)
        self.event("umt.fencing_rejected", **{"umt.step.name": step_name})

    def lease_lost(self, reason: str) -> None:
        """This execution stops because its lease is lost (a refused heartbeat or write, or a
        lease that ran out before a heartbeat renewed it). Counted here, once per execution,
        as `umt.lease.lost`; the expiration itself is counted by the claim that takes the run
        over (`umt.lease.expirations`), in whichever process makes it, so a frozen worker
        that wakes up does not count it a second time and a killed one is not left out."""
        self._telemetry.leases_lost.add(1, self.task_attributes)
        self.event("umt.lease_lost", **{"umt.reason": reason})

    def replayed(self, record: StepRecord) -> None:
        if not self.records:
            return
        self.event(
            "umt.step.replayed",
            **{
                "umt.step.name": record.name,
                "umt.step.kind": record.kind,
                "umt.step.attempt": record.attempt,
            },
        )

    def step(self, name: str, attempt: int) -> AbstractContextManager[StepTrace]:
        """A step that really executes: a child span, its outcome, and its duration. The step
        says how it ended on the `StepTrace` it is given; an exception that unwinds through
        without one is a failure if it is an `Exception`, else control flow that names its own
        outcome in a `step_outcome` attribute (a release), or `interrupted` (a crash)."""
        if not self.records:
            # A plain object, not a generator: no span to manage, only the duration to record.
            return _UntracedStepTiming(self._telemetry.step_duration, self._step_metric_attributes)
        return self._traced_step(name, attempt)

    @contextmanager
    def _traced_step(self, name: str, attempt: int) -> Iterator[StepTrace]:
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
            step_trace = StepTrace(span)
            try:
                yield step_trace
                step_trace.ended("completed")
            except BaseException as exc:
                if isinstance(exc, Exception):
                    step_trace.failed(exc, "failed")
                else:
                    step_trace.ended(getattr(exc, "step_outcome", "interrupted"))
                raise
            finally:
                self._telemetry.step_duration.record(
                    time.monotonic() - started, self._step_metric_attributes
                )

    @staticmethod
    def current_span_id() -> str | None:
        """The id of the current span (a step's, else the execution's), for log records."""
        span_context = trace.get_current_span().get_span_context()
        return format(span_context.span_id, "016x") if span_context.is_valid else None


class StepTrace:
    """How one executed step ended, said once by the step (the first word stands)."""

    def __init__(self, span: Span) -> None:
        self._span = span
        self.outcome: str | None = None

    def failed(self, error: BaseException, outcome: str) -> None:
        """The step's code failed: ERROR with its exception, whatever happens next (`failed`,
        `retrying`, or `canceled` when a cancel keeps it from being retried)."""
        if self.outcome is None:
            self.outcome = outcome
            self._span.set_attribute("umt.step.outcome", outcome)
            Telemetry.fail(self._span, error)

    def ended(self, outcome: str) -> None:
        """The step ended without a failure of its code: `completed`, or cut off by a cancel,
        a release, a lost lease or a crash (`canceled`, `released`, `lease_lost`,
        `interrupted`): status UNSET."""
        if self.outcome is None:
            self.outcome = outcome
            self._span.set_attribute("umt.step.outcome", outcome)


class _UntracedStep(StepTrace):
    """The `StepTrace` of every step when no tracer records: says nothing to no span."""

    def __init__(self) -> None:
        super().__init__(trace.INVALID_SPAN)

    def failed(self, error: BaseException, outcome: str) -> None:
        del error, outcome

    def ended(self, outcome: str) -> None:
        del outcome


_UNTRACED = _UntracedStep()


class _UntracedStepTiming:
    """`ExecutionTelemetry.step` when no tracer records: gives `_UNTRACED` and records the
    step's duration however it ends, as the traced path does."""

    __slots__ = ("_attributes", "_histogram", "_started")

    def __init__(self, histogram: metrics.Histogram, attributes: Mapping[str, Any]) -> None:
        self._histogram = histogram
        self._attributes = attributes
        self._started = time.monotonic()

    def __enter__(self) -> StepTrace:
        return _UNTRACED

    def __exit__(self, *exc_info: object) -> None:
        self._histogram.record(time.monotonic() - self._started, self._attributes)


def _records(tracer: trace.Tracer) -> bool:
    """Whether `tracer` may record: False only for the API's no-op tracer, given directly (a
    `NoOpTracerProvider`) or through the API's proxy while no global provider is set. The
    proxy is asked per execution, so a provider set later is used from the next run on."""
    resolved = getattr(tracer, "_tracer", tracer)  # the proxy's delegate (a private name)
    return not isinstance(resolved, trace.NoOpTracer)


def _is_cancel(error: BaseException) -> bool:
    return isinstance(error, CanceledError | asyncio.CancelledError)


def _trace_id(claimed: ClaimedRun) -> str:
    """Without a tracer, the enqueuer's trace id from the stored context, else the run's id."""
    traceparent = claimed.trace_context.get("traceparent", "")
    parts = traceparent.split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
        return parts[1]
    return claimed.run_id.hex
