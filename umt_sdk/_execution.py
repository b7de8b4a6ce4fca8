"""One execution of a run's handler: replay by step name, durable waits, retries, fencing.

An execution replays the run's recorded steps (a completed step returns its record, a failed
one raises it), runs the first unrecorded step, and records it under its lease. It ends in one of
four ways: the handler returns (complete), raises (retry later or fail), parks (a sleep, a fact
wait or a step's retry backoff: the slot is released), or stops writing because the lease was
lost or the process is going away.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

from opentelemetry import trace

from umt_sdk import _serde
from umt_sdk._context import _CURRENT, SyncTaskContext, TaskContext
from umt_sdk._logging import RunLogger
from umt_sdk._names import check_name
from umt_sdk._retry import RetryPolicy
from umt_sdk._spi import (
    Backend,
    Beat,
    ClaimedRun,
    Ending,
    EndResult,
    ErrorInfo,
    ExecutionOutcome,
    Fact,
    Lease,
    SimulatedCrash,
    StepKind,
    StepRecord,
)
from umt_sdk._task import TaskDefinition
from umt_sdk._telemetry import Telemetry
from umt_sdk.exceptions import (
    BackendError,
    BackendUnavailableError,
    CanceledError,
    FactTimeoutError,
    FencingError,
    LeaseLostTooOftenError,
    NonDeterminismError,
    PayloadError,
    StepFailedError,
)

__all__ = ["Execution", "error_info"]

T = TypeVar("T")

_log = logging.getLogger("umt.worker")


class _Suspend(BaseException):
    """The run is parked; unwind the handler without recording anything else."""


class _Stop(BaseException):
    """This execution must stop writing: its lease is lost or its process is going away."""


class _Release(BaseException):
    """The worker is shutting down: give the run back at the next step boundary."""


_STEP_OUTCOMES: dict[type[BaseException], str] = {_Suspend: "retrying", _Release: "released"}

AbortKind = Literal["cancel", "lease_lost", "shutdown", "crash"]


def error_info(exc: BaseException) -> ErrorInfo:
    """How an exception is recorded: qualified type, message, formatted traceback.

    Ours to store, so never refused: NUL and lone surrogates (which Postgres cannot hold) are
    replaced by visible escapes, and a step whose error message holds them fails normally.
    """
    kind = type(exc)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    message = str(exc)
    if isinstance(exc, StepFailedError) and exc.error_type:
        message = f"{exc.step_name}: {exc.error_type}: {exc.error_message}"
    return ErrorInfo(
        type=_serde.clean_text(name),
        message=_serde.clean_text(message),
        traceback=_serde.clean_text("".join(traceback.format_exception(exc))[-8000:]),
    )


class Execution:
    """The state of one claimed run while its handler runs in this process."""

    def __init__(
        self,
        *,
        backend: Backend,
        claimed: ClaimedRun,
        definition: TaskDefinition[Any, Any],
        worker_id: str,
        lease_duration: timedelta,
        loop: asyncio.AbstractEventLoop,
        telemetry: Telemetry,
    ) -> None:
        self.backend = backend
        self.telemetry = telemetry
        self.claimed = claimed
        self.definition = definition
        self.loop = loop
        self.lease = Lease(
            run_id=claimed.run_id,
            fencing_token=claimed.fencing_token,
            worker_id=worker_id,
            duration=lease_duration,
        )
        self._records: dict[str, list[StepRecord]] = {}
        for record in claimed.steps:
            self._records.setdefault(record.name, []).append(record)
        for records in self._records.values():
            records.sort(key=lambda r: r.attempt)
        self._occurrences: dict[str, int] = {}
        self._started_monotonic = time.monotonic()
        self._loop_thread = threading.get_ident()
        self.abort_event = asyncio.Event()
        self.abort_reason: str | None = None
        self.abort_kind: AbortKind | None = None
        self.cancel_requested = False
        self.current_step: str | None = None
        self.current_step_started_at: datetime | None = None
        # The step a cancel cut off (the handler may still be cleaning up): heartbeats keep
        # naming it, so the timeline shows it as canceled.
        self.canceled_step: tuple[str, datetime] | None = None
        # What the last heartbeat that reached the backend said about the step, and who wants
        # to know when a step starts (the worker, to name it in a prompt beat).
        self.beaten_step: tuple[str, datetime] | None = None
        self.on_step_start: Callable[[], None] | None = None
        self.stopped = False
        # Set while the write that hands the run back (park, complete, fail, ...) is in flight:
        # a heartbeat racing with it may find the run released, which is not a lost lease.
        self.letting_go = False
        # Replaying until the first step the last execution did not finish: logs stay quiet.
        self.replaying = bool(claimed.steps)
        self.attributes = {
            **Telemetry.task_attributes(claimed.task_name, claimed.task_version),
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
        self.logger = RunLogger(
            logging.getLogger("umt.task"),
            {
                "umt_run_id": str(claimed.run_id),
                "umt_task": claimed.task_name,
                "umt_version": claimed.task_version,
                "umt_trace_id": self.trace_id,
            },
            context=self._log_context,
            replaying=lambda: self.replaying,
        )
        self.task: asyncio.Task[None] | None = None

    def _log_context(self) -> dict[str, object]:
        span_context = trace.get_current_span().get_span_context()
        return {
            "umt_step": self.current_step,
            "umt_span_id": format(span_context.span_id, "016x") if span_context.is_valid else None,
        }

    def step_for_beat(self) -> tuple[str, datetime] | None:
        """The step a heartbeat names: the one running, else the one a cancel cut off."""
        if self.current_step is not None and self.current_step_started_at is not None:
            return (self.current_step, self.current_step_started_at)
        return self.canceled_step

    def needs_step_beat(self) -> bool:
        """A step runs that no heartbeat has named yet."""
        step = self.step_for_beat()
        return step is not None and step != self.beaten_step and not self.stopped

    def event(self, name: str, **attributes: Any) -> None:
        """An event on the execution span."""
        self.span.add_event(name, {k: v for k, v in attributes.items() if v is not None})

    # -- time and signals -------------------------------------------------------------------

    def now(self) -> datetime:
        """The backend's clock: its own if it keeps one, else measured from the claim."""
        clock = self.backend.clock
        if clock is not None:
            return clock.now()
        return self.claimed.claimed_at + timedelta(
            seconds=time.monotonic() - self._started_monotonic
        )

    def abort(self, kind: AbortKind, reason: str) -> None:
        """Fire the abort signal. Lease loss, shutdown and crashes also stop all writes."""
        if kind == "cancel":
            self.cancel_requested = True
            self.event("umt.cancel_requested", **{"umt.cancel.reason": reason})
        elif kind == "lease_lost":
            self.event("umt.lease_lost", **{"umt.reason": reason})
        if kind in ("lease_lost", "crash"):
            self.stopped = True
        if self.abort_kind is None or kind in ("lease_lost", "crash"):
            self.abort_kind = kind
            self.abort_reason = reason
        self.loop.call_soon_threadsafe(self.abort_event.set)
        if kind in ("lease_lost", "crash") and self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)

    def _check_before_step(self) -> None:
        if self.stopped:
            raise _Stop
        if self.abort_kind == "shutdown":
            raise _Release
        if self.cancel_requested:
            reason = self.abort_reason or "canceled"
            raise CanceledError(f"run {self.claimed.run_id} canceled: {reason}", reason=reason)

    # -- threads --------------------------------------------------------------------------------

    def in_handler_thread(self) -> bool:
        return threading.get_ident() != self._loop_thread

    def call_from_thread(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the worker's loop from a plain handler's thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(self._as_current(coro), self.loop).result()

    async def _as_current(self, coro: Coroutine[Any, Any, T]) -> T:
        token = _CURRENT.set(self)
        try:
            return await coro
        finally:
            _CURRENT.reset(token)

    # -- records ----------------------------------------------------------------------------------

    def _occurrence(self, name: str) -> str:
        count = self._occurrences.get(name, 0) + 1
        self._occurrences[name] = count
        return name if count == 1 else f"{name}#{count}"

    def _last(self, name: str, kind: StepKind) -> StepRecord | None:
        records = self._records.get(name)
        if not records:
            return None
        last = records[-1]
        if last.kind != kind:
            raise NonDeterminismError(
                f"step {name!r} of run {self.claimed.run_id} was recorded as a {last.kind!r} "
                f"but the code now makes it a {kind!r}; bump the task's version for "
                "incompatible changes and keep the old version registered until its runs drain",
                step_name=name,
                recorded_kind=last.kind,
                current_kind=kind,
            )
        return last

    def _remember(self, record: StepRecord) -> None:
        records = self._records.setdefault(record.name, [])
        records[:] = [r for r in records if r.attempt != record.attempt]
        records.append(record)
        records.sort(key=lambda r: r.attempt)

    async def _guard(self, awaitable: Awaitable[T], *, final: bool = False) -> T:
        """Await a fenced backend write; on a lost lease, stop this execution."""
        if self.stopped:
            raise _Stop
        if final:
            self.letting_go = True
        try:
            return await awaitable
        except FencingError:
            self._fenced()
            raise _Stop from None
        except BackendUnavailableError as exc:
            # Whether the write landed is unknown, and an outage is not the handler's failure:
            # stop writing (like a crash); the run resumes from its records after its lease.
            _log.warning(
                "run %s: the backend is unavailable (%s); stopping this execution, the run "
                "resumes from its recorded steps when its lease expires",
                self.claimed.run_id,
                exc,
            )
            self.abort("crash", f"backend unavailable: {exc}")
            raise _Stop from None
        except SimulatedCrash:
            self.abort("crash", "simulated crash")
            raise _Stop from None

    def _fenced(self) -> None:
        self.telemetry.fencing_rejections.add(1, self.attributes)
        self.event("umt.fencing_rejected", **{"umt.step.name": self.current_step})
        self.abort("lease_lost", "lease lost: another attempt holds the run")

    def _replayed(self, record: StepRecord) -> None:
        self.event(
            "umt.step.replayed",
            **{
                "umt.step.name": record.name,
                "umt.step.kind": record.kind,
                "umt.step.attempt": record.attempt,
            },
        )

    def _live(self) -> None:
        self.replaying = False

    async def _record(self, record: StepRecord) -> None:
        await self._guard(self.backend.record_step(self.lease, record))
        self._remember(record)

    async def _end(self, ending: Ending) -> EndResult:
        """The one ending write: the SDK's decision, stored by the backend as given."""
        result = await self._guard(self.backend.end_execution(self.lease, ending), final=True)
        self.letting_go = result == "ended"
        if result == "ended" and ending.step is not None:
            self._remember(ending.step)
        return result

    async def _park(
        self,
        *,
        outcome: ExecutionOutcome,
        step: StepRecord | None,
        available_at: datetime | None,
        wait_for: str | None = None,
    ) -> bool:
        """Hand the run back until `available_at` (a sleep, a fact wait, a step's retry
        backoff). False: the awaited fact is already stored, so the wait goes on here. A run
        whose cancel was requested is never parked: the cancel is raised here instead."""
        result = await self._end(
            Ending(
                status="pending" if outcome == "retrying" else "waiting",
                outcome=outcome,
                available_at=available_at,
                wait_for=wait_for,
                step=step,
            )
        )
        if result == "cancel_requested":
            await self._learn_cancel()
            self._check_before_step()
        return result == "ended"

    async def _learn_cancel(self) -> None:
        """The store refused to park the run because its cancel was requested (no heartbeat
        said so yet): take the request, with its reason, as the heartbeat would have."""
        reason = "canceled"
        try:
            record = await self.backend.get_run(self.claimed.run_id)
        except BackendError as exc:  # the reason is for the error message; the cancel holds
            _log.debug("run %s: could not read the cancel reason: %s", self.claimed.run_id, exc)
        else:
            if record is not None and record.cancel_reason:
                reason = record.cancel_reason
        self.abort("cancel", reason)

    def _step_record(self, name: str, kind: StepKind, **fields: Any) -> StepRecord:
        return StepRecord(name=name, kind=kind, fencing_token=self.lease.fencing_token, **fields)

    # -- steps ----------------------------------------------------------------------------------

    def run_step(
        self,
        name: str,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        retry: RetryPolicy | None,
        output_type: Any,
    ) -> Coroutine[Any, Any, Any]:
        return self._run_step(name, fn, args, kwargs, retry, output_type)

    def run_step_from_thread(
        self,
        name: str,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        retry: RetryPolicy | None,
        output_type: Any,
    ) -> Any:
        return self.call_from_thread(self._run_step(name, fn, args, kwargs, retry, output_type))

    async def _run_step(
        self,
        name: str,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        retry: RetryPolicy | None,
        output_type: Any,
    ) -> Any:
        full = self._occurrence(name)
        last = self._last(full, "step")
        if last is not None:
            if last.status == "completed":
                self._replayed(last)
                return _serde.decode(
                    last.output_json or "null", output_type, what=f"output of step {full!r}"
                )
            if last.status == "failed":
                self._replayed(last)
                raise _step_failed(full, last.error)
        attempt = (last.attempt + 1) if last is not None else 1
        self._check_before_step()
        self._live()
        with self.telemetry.tracer.start_as_current_span(
            f"umt.step {full}",
            attributes={
                **self.attributes,
                "umt.step.name": full,
                "umt.step.kind": "step",
                "umt.step.attempt": attempt,
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            started_clock = time.monotonic()
            try:
                value = await self._execute_step(
                    full, attempt, fn, args, kwargs, retry, output_type
                )
                span.set_attribute("umt.step.outcome", "completed")
                return value
            except BaseException as exc:
                if isinstance(exc, Exception):
                    span.set_attribute("umt.step.outcome", "failed")
                    Telemetry.fail(span, exc)
                else:
                    span.set_attribute(
                        "umt.step.outcome", _STEP_OUTCOMES.get(type(exc), "interrupted")
                    )
                raise
            finally:
                self.telemetry.step_duration.record(
                    time.monotonic() - started_clock,
                    {
                        **Telemetry.task_attributes(
                            self.claimed.task_name, self.claimed.task_version
                        ),
                        "umt.step.kind": "step",
                    },
                )

    async def _execute_step(
        self,
        full: str,
        attempt: int,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        retry: RetryPolicy | None,
        output_type: Any,
    ) -> Any:
        started = self.now()
        self.current_step, self.current_step_started_at = full, started
        if self.on_step_start is not None:
            self.on_step_start()
        try:
            if inspect.iscoroutinefunction(fn):
                value = await fn(*args, **kwargs)
            else:
                # Plain bodies run in a thread (the handler's own thread already, for plain
                # tasks: the loop never blocks on user code).
                value = await asyncio.to_thread(fn, *args, **kwargs)
                if inspect.isawaitable(value):
                    value = await value
        except (_Stop, _Suspend, _Release, SimulatedCrash, asyncio.CancelledError):
            raise
        except FencingError:
            self._fenced()
            raise _Stop from None
        except Exception as exc:
            if self.stopped:
                raise _Stop from None
            if self.abort_kind == "shutdown":
                raise _Release from None
            if isinstance(exc, CanceledError) and self.cancel_requested:
                self.canceled_step = (full, started)
                raise  # the run ends canceled; the step is not recorded as failed
            policy = retry or self.definition.retry
            info = error_info(exc)
            if policy.should_retry(exc, attempt) and not self.cancel_requested:
                now = self.now()
                record = self._step_record(
                    full,
                    "step",
                    status="retrying",
                    attempt=attempt,
                    error=info,
                    started_at=started,
                    finished_at=now,
                )
                retry_at = now + policy.delay_before(attempt + 1)
                try:
                    await self._park(outcome="retrying", step=record, available_at=retry_at)
                except CanceledError:
                    self.canceled_step = (full, started)
                    raise
                self.event(
                    "umt.step.retry_scheduled",
                    **{
                        "umt.step.name": full,
                        "umt.step.attempt": attempt,
                        "umt.retry_at": retry_at.isoformat(),
                    },
                )
                raise _Suspend from None
            record = self._step_record(
                full,
                "step",
                status="failed",
                attempt=attempt,
                error=info,
                started_at=started,
                finished_at=self.now(),
            )
            await self._record(record)
            raise _step_failed(full, info) from exc
        finally:
            self.current_step = self.current_step_started_at = None
        try:
            # The value every replay decodes is the one this execution returns too.
            output_json, value = _serde.encode_output(
                value, output_type, what=f"output of step {full!r}"
            )
        except PayloadError as exc:
            # Deterministic: the same body would return the same value, so no retry.
            info = error_info(exc)
            await self._record(
                self._step_record(
                    full,
                    "step",
                    status="failed",
                    attempt=attempt,
                    error=info,
                    started_at=started,
                    finished_at=self.now(),
                )
            )
            raise _step_failed(full, info) from exc
        await self._record(
            self._step_record(
                full,
                "step",
                status="completed",
                attempt=attempt,
                output_json=output_json,
                started_at=started,
                finished_at=self.now(),
            )
        )
        return value

    async def sleep(self, name: str, duration: timedelta) -> None:
        if not isinstance(duration, timedelta):
            raise TypeError(f"sleep {name!r}: duration must be a timedelta, got {duration!r}")
        full = self._occurrence(name)
        last = self._last(full, "sleep")
        if last is not None and last.status == "completed":
            self._replayed(last)
            return
        self._check_before_step()
        self._live()
        now = self.now()
        if last is None:
            if duration <= timedelta(0):
                await self._record(
                    self._step_record(
                        full,
                        "sleep",
                        status="completed",
                        started_at=now,
                        finished_at=now,
                        wake_at=now,
                    )
                )
                return
            wake_at = now + duration
            waiting = self._step_record(
                full, "sleep", status="waiting", started_at=now, wake_at=wake_at
            )
            await self._park(outcome="waiting", step=waiting, available_at=wake_at)
            self.event(
                "umt.sleep", **{"umt.step.name": full, "umt.sleep.until": wake_at.isoformat()}
            )
            raise _Suspend
        wake_at = last.wake_at or now
        if wake_at <= now:
            await self._record(
                self._step_record(
                    full,
                    "sleep",
                    status="completed",
                    started_at=last.started_at,
                    finished_at=now,
                    wake_at=wake_at,
                )
            )
            self.event("umt.sleep.done", **{"umt.step.name": full})
            return
        await self._park(outcome="waiting", step=None, available_at=wake_at)
        self.event("umt.sleep", **{"umt.step.name": full, "umt.sleep.until": wake_at.isoformat()})
        raise _Suspend

    async def wait_for_fact(
        self,
        name: str,
        *,
        timeout: timedelta | None,
        check: Callable[[], Any] | None,
        payload_type: Any,
        poll: timedelta | None,
    ) -> Any:
        check_name("fact", name)
        full = self._occurrence(name)
        last = self._last(full, "fact")
        if last is not None and last.status == "completed":
            self._replayed(last)
            return _fact_outcome(full, name, last.output_json, payload_type)
        self._check_before_step()
        self._live()
        started = last.started_at if last is not None and last.started_at else self.now()
        deadline: datetime | None
        if last is not None:
            deadline = last.wake_at
        else:
            deadline = started + timeout if timeout is not None else None
        while True:
            now = self.now()
            if check is not None:
                if inspect.iscoroutinefunction(check):
                    value = await check()
                else:
                    value = await asyncio.to_thread(check)
                    if inspect.isawaitable(value):
                        value = await value
                if value is not None:
                    text = _serde.encode(value, payload_type, what=f"fact {name!r} from check()")
                    output = '{"fact":' + text + ',"source":"check"}'
                    await self._record(
                        self._step_record(
                            full,
                            "fact",
                            status="completed",
                            started_at=started,
                            finished_at=now,
                            output_json=output,
                        )
                    )
                    self.event(
                        "umt.fact.received", **{"umt.fact.name": name, "umt.fact.source": "check"}
                    )
                    return _fact_outcome(full, name, output, payload_type)  # as a replay sees it
            fact = _visible_fact(
                await self._guard(self.backend.get_facts(run_id=self.claimed.run_id, name=name))
            )
            if fact is not None:
                output = '{"fact":' + fact.payload_json + ',"source":"signal"}'
                await self._record(
                    self._step_record(
                        full,
                        "fact",
                        status="completed",
                        started_at=started,
                        finished_at=now,
                        output_json=output,
                    )
                )
                self.event(
                    "umt.fact.received", **{"umt.fact.name": name, "umt.fact.source": "signal"}
                )
                return _fact_outcome(full, name, output, payload_type)
            if deadline is not None and now >= deadline:
                await self._record(
                    self._step_record(
                        full,
                        "fact",
                        status="completed",
                        started_at=started,
                        finished_at=now,
                        wake_at=deadline,
                        output_json='{"timeout":true}',
                    )
                )
                self.event("umt.fact.timeout", **{"umt.fact.name": name})
                return _fact_outcome(full, name, '{"timeout":true}', payload_type)
            wake_at = deadline
            if poll is not None:
                wake_at = now + poll if wake_at is None else min(wake_at, now + poll)
            waiting = (
                None
                if last is not None
                else self._step_record(
                    full, "fact", status="waiting", started_at=started, wake_at=deadline
                )
            )
            if await self._park(
                outcome="waiting", step=waiting, available_at=wake_at, wait_for=name
            ):
                self.event(
                    "umt.wait_for_fact",
                    **{
                        "umt.fact.name": name,
                        "umt.fact.deadline": deadline.isoformat() if deadline else None,
                    },
                )
                raise _Suspend
            # The fact arrived between our look and the park: go round again.

    # -- the handler ------------------------------------------------------------------------------

    async def execute(self) -> None:
        """Run the handler to its next durable boundary and record how it ended."""
        token = _CURRENT.set(self)
        telemetry = self.telemetry
        task_attributes = Telemetry.task_attributes(
            self.claimed.task_name, self.claimed.task_version
        )
        telemetry.runs_started.add(1, task_attributes)
        if self.claimed.ready_at is not None:
            telemetry.claim_latency.record(
                max(0.0, (self.claimed.claimed_at - self.claimed.ready_at).total_seconds()),
                task_attributes,
            )
        try:
            with trace.use_span(self.span, end_on_exit=True):
                try:
                    await self._execute()
                except _Suspend:
                    self.span.set_attribute("umt.outcome", "parked")
                except (_Stop, SimulatedCrash):
                    self.span.set_attribute("umt.outcome", "stopped")
                except asyncio.CancelledError:
                    self.span.set_attribute("umt.outcome", "stopped")
                    if not self.stopped:
                        raise
        finally:
            _CURRENT.reset(token)

    def _outcome(self, outcome: str, error: BaseException | None = None) -> None:
        attributes = Telemetry.task_attributes(self.claimed.task_name, self.claimed.task_version)
        self.span.set_attribute("umt.outcome", outcome)
        if outcome == "completed":
            self.telemetry.runs_completed.add(1, attributes)
        elif outcome == "failed":
            self.telemetry.runs_failed.add(1, attributes)
        elif outcome == "canceled":
            self.telemetry.runs_canceled.add(1, attributes)
        if error is not None and outcome in ("failed", "retrying"):
            Telemetry.fail(self.span, error)
        elif error is not None:
            self.span.record_exception(error)

    async def _execute(self) -> None:
        definition = self.definition
        if self.claimed.cancel_reason is not None:
            # Requested while an earlier execution held the run, which was cut off before it
            # could end it: the handler does not start again.
            self.abort("cancel", self.claimed.cancel_reason or "canceled")
            await self._end(Ending(status="canceled", outcome="canceled"))
            self._outcome("canceled")
            return
        if self.claimed.lost_leases >= definition.max_lost_leases:
            await self._fail_lost_leases()
            return
        try:
            try:
                value = _serde.decode(self.claimed.input_json, definition.input_type, what="input")
            except PayloadError as exc:
                await self._finish_failed(exc)
                return
            if definition.is_async:
                output = await definition.fn(TaskContext(self, value))
            else:
                output = await asyncio.to_thread(definition.fn, SyncTaskContext(self, value))
            output_json = _serde.encode(output, definition.output_type, what="task output")
            if definition.output_type is not Any and not _serde.decodes_to_itself(
                output, definition.output_type
            ):  # what result() will decode: if that would fail, fail the run now
                _serde.decode(output_json, definition.output_type, what="task output")
        except (_Stop, _Suspend, SimulatedCrash):
            raise
        except _Release:
            await self._release()
            return
        except asyncio.CancelledError:
            if self.stopped:
                raise
            if self.abort_kind == "shutdown":
                await self._release()
                return
            raise
        except Exception as exc:
            if self.stopped:
                raise _Stop from None
            await self._finish_failed(exc)
            return
        await self._end(Ending(status="completed", outcome="completed", output_json=output_json))
        self._outcome("completed")

    async def _release(self) -> None:
        """The worker is going away: hand the run back at once, uncharged. A run whose cancel
        was requested meanwhile is not handed back to be started again: it ends canceled."""
        if await self._end(Ending(status="pending", outcome="released")) == "ended":
            self._outcome("released")
            return
        await self._end(Ending(status="canceled", outcome="canceled"))
        self._outcome("canceled")

    async def _fail_lost_leases(self) -> None:
        """The run's executions keep dying without progress: fail it rather than start the
        same fault again (no retry: the retry policy is for errors a handler raises)."""
        claimed = self.claimed
        limit = self.definition.max_lost_leases
        step_name = await self._last_seen_step()
        where = f" (last seen in step {step_name!r})" if step_name else ""
        exc = LeaseLostTooOftenError(
            f"run {claimed.run_id} of {claimed.task_name}@{claimed.task_version} lost its lease "
            f"{claimed.lost_leases} times without recording a step{where}; its executions keep "
            "dying (a crash, an OOM kill, a freeze longer than the lease) on a fault that "
            f"repeats, so it is failed instead of started again (max_lost_leases={limit}). "
            "Fix the cause, then enqueue it again",
            run_id=claimed.run_id,
            lost_leases=claimed.lost_leases,
            max_lost_leases=limit,
            step_name=step_name,
        )
        _log.warning("%s", exc)
        await self._end(
            Ending(status="failed", outcome="failed", error=error_info(exc), count_failure=True)
        )
        self._outcome("failed", exc)

    async def _last_seen_step(self) -> str | None:
        """The step the last interrupted execution was in, as its heartbeats reported."""
        try:
            record = await self.backend.get_run(self.claimed.run_id)
        except BackendError:
            return None
        if record is None:
            return None
        for execution in reversed(record.executions):
            if execution.fencing_token != self.lease.fencing_token and execution.current_step:
                return execution.current_step
        return None

    async def _finish_failed(self, exc: Exception) -> None:
        """The handler raised: end canceled (its cancel was requested), retry later, or fail."""
        if self.cancel_requested:
            await self._finish_canceled(exc)
            return
        info = error_info(exc)
        policy = self.definition.retry
        failures = self.claimed.failures + 1
        if not policy.should_retry(exc, failures):
            await self._end(
                Ending(status="failed", outcome="failed", error=info, count_failure=True)
            )
            self._outcome("failed", exc)
            return
        retry_at = self.now() + policy.delay_before(failures + 1)
        ending = Ending(
            status="pending",
            outcome="retrying",
            available_at=retry_at,
            error=info,
            count_failure=True,
        )
        if await self._end(ending) == "cancel_requested":
            await self._learn_cancel()
            await self._finish_canceled(exc)
            return
        self._outcome("retrying", exc)

    async def _finish_canceled(self, exc: Exception) -> None:
        """End canceled, keeping the handler's error unless it is the cancel itself."""
        error = None if isinstance(exc, CanceledError) else error_info(exc)
        await self._name_canceled_step()
        await self._end(Ending(status="canceled", outcome="canceled", error=error))
        self._outcome("canceled", exc)

    async def _name_canceled_step(self) -> None:
        """Make sure the backend knows the step the cancel cut off before the run finishes
        (it keeps it on the canceled execution); one beat, only if no heartbeat said it."""
        step = self.canceled_step
        if step is None or step == self.beaten_step or self.stopped:
            return
        beat = Beat(
            run_id=self.claimed.run_id,
            fencing_token=self.lease.fencing_token,
            current_step=step[0],
            step_started_at=step[1],
        )
        try:
            result = await self.backend.heartbeat(
                worker_id=self.lease.worker_id, beats=[beat], lease=self.lease.duration
            )
        except BackendError as exc:  # the timeline loses a step; finishing the run matters more
            _log.debug("run %s: could not name the canceled step: %s", self.claimed.run_id, exc)
            return
        if self.claimed.run_id not in result.lost:
            self.beaten_step = step


def _step_failed(name: str, error: ErrorInfo | None) -> StepFailedError:
    error_type = error.type if error else "Error"
    message = error.message if error else ""
    return StepFailedError(
        f"step {name!r} failed after its last attempt: {error_type}: {message}",
        step_name=name,
        error_type=error_type,
        error_message=message,
    )


def _visible_fact(facts: Sequence[Fact]) -> Fact | None:
    """The fact a wait receives: the run's own, else the broadcast one."""
    for fact in facts:
        if fact.run_id is not None:
            return fact
    return facts[0] if facts else None


def _fact_outcome(
    step_name: str, fact_name: str, output_json: str | None, payload_type: Any
) -> Any:
    raw = json.loads(output_json or "{}")
    if raw.get("timeout"):
        raise FactTimeoutError(
            f"no fact {fact_name!r} arrived before the wait {step_name!r} timed out",
            fact_name=fact_name,
        )
    return _serde.from_raw(raw.get("fact"), payload_type, what=f"fact {fact_name!r}")


def _trace_id(claimed: ClaimedRun) -> str:
    traceparent = claimed.trace_context.get("traceparent", "")
    parts = traceparent.split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
        return parts[1]
    return claimed.run_id.hex
