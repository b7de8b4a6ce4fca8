"""Read-only projections of runs for `engine.get` / `engine.list`, the same for every backend."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from attrs import evolve, field, frozen

from umt_sdk._attention import parse_attention_fact
from umt_sdk._spi import (
    TERMINAL_STATUSES,
    ErrorInfo,
    ExecutionOutcome,
    ExecutionRecord,
    RunRecord,
    RunStatus,
    StepKind,
)

__all__ = [
    "RunInfo",
    "RunPage",
    "StepView",
    "build_run_info",
    "deadline_passed",
    "execution_outcome",
    "lease_expired",
    "trace_id_of",
    "with_execution_outcomes",
]

StepViewStatus = Literal[
    "completed", "failed", "retrying", "waiting", "running", "interrupted", "canceled", "abandoned"
]


@frozen(kw_only=True)
class StepView:
    """One entry of a run's step timeline.

    `interrupted`: the attempt was cut off by a lost lease (a crash, a freeze); the step
    re-runs in a later execution. `running`: the step is executing now. `canceled`: the run
    was canceled while this step ran or waited. `abandoned`: the run ended (failed, or
    completed without it) while this sleep or fact wait was still waiting.

    `inferred`: no heartbeat named the step of an interrupted attempt (it was cut off within
    moments of starting it); it is shown at the step the next attempt ran first: the attempt
    stopped in that step or in the handler's code just before it, and `started_at` is unknown.
    """

    name: str
    kind: StepKind
    status: StepViewStatus
    attempt: int
    fencing_token: int
    started_at: datetime | None
    finished_at: datetime | None
    wake_at: datetime | None = None
    error: ErrorInfo | None = None
    inferred: bool = False
    output_json: str | None = None
    """The recorded output as stored (a step's result, the payload a fact wait received)."""


@frozen(kw_only=True)
class RunInfo:
    """A run as users see it: status, attempts, errors and the step timeline."""

    run_id: UUID
    task_name: str
    task_version: int
    status: RunStatus
    priority: int
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    attempts: int
    """Claims so far: every execution of the handler, including interrupted ones."""
    failures: int
    lease_expirations: int
    error: ErrorInfo | None
    input_json: str
    """The input as stored: JSON text of the task's input type."""
    output_json: str | None
    idempotency_key: str | None
    cancel_requested: bool
    cancel_reason: str | None
    waiting_for: str | None
    available_at: datetime | None
    timeline: Sequence[StepView] = ()
    executions: Sequence[ExecutionRecord] = ()
    lease_expires_at: datetime | None = None
    lease_expired: bool = False
    """`running`, but its lease had expired when the backend read it (its worker crashed,
    froze or lost the database): the run waits for another worker to claim it."""
    parent_run_id: UUID | None = None
    """The run whose step started this one (`ctx.step.start_child`); its children are
    `engine.list(parent=run_id)`."""
    rerun_of: UUID | None = None
    """The run this one runs again (`engine.rerun`)."""
    forked_from: UUID | None = None
    """The run this one is a fork of (`engine.fork`): it kept that run's steps recorded
    before `forked_at_step`, and its facts."""
    forked_at_step: str | None = None
    """The step this fork executed from."""
    tags: Mapping[str, str] = field(factory=dict)
    """The labels given at enqueue (`enqueue(..., tags=...)`); `engine.list(tags=...)` finds
    runs by them."""
    concurrency_key: str | None = None
    """The run's concurrency key (`@task(concurrency=...)`), computed at enqueue; a `pending`
    run of a full key waits for a slot. `engine.list(concurrency_key=...)` finds its runs."""
    rate_limit: str | None = None
    """The rate limit its starts take a token of (`@task(rate_limit=...)`); a `pending` run
    whose bucket had no token waits until `available_at`, when the next one is due."""
    rate_limit_key: str | None = None
    """With `rate_limit`: the run's bucket ("": the limit's one bucket)."""
    debounce_key: str | None = None
    """The key of `enqueue(debounce=Debounce(key, ...))` for a debounced run (from
    `engine.get`; None in lists and for other runs)."""
    fairness_weight: int | None = None
    """When `concurrency_key` is a fairness key (`enqueue(fairness_key=..., weight=...)`): the
    key's weight (from `engine.get`; None in lists and for other keys)."""
    deadline_at: datetime | None = None
    """When the run must be finished by (`@task(timeout=...)`, `enqueue(deadline=...)`);
    None: no deadline."""
    start_by: datetime | None = None
    """When the run must have started by (`enqueue(start_within=...)`); None: no limit."""
    deadline_passed: bool = False
    """Unfinished, but past its deadline (or, never claimed, past its start deadline) when
    the backend read it: the next worker to claim it ends it failed."""
    trace_id: str | None = None
    """The OpenTelemetry trace id the run's spans belong to (from the enqueue's stored trace
    context, 32 hex digits), None when the enqueue had no trace."""

    @property
    def display_status(self) -> str:
        """The status as people read it: `running (lease expired)` for a running run whose
        lease lapsed, `needs_attention` for a run parked until an operator settles one of its
        steps, else `status`."""
        if self.needs_attention is not None:
            return "needs_attention"
        return "running (lease expired)" if self.lease_expired else self.status

    @property
    def needs_attention(self) -> str | None:
        """The step an operator must settle (`engine.settle`), for a run parked in
        `needs_attention` (stored as `waiting` on that step's settlement); else None."""
        if self.status != "waiting":
            return None
        parked = parse_attention_fact(self.waiting_for)
        return None if parked is None else parked[0]

    @property
    def input(self) -> Any:
        """The input as JSON-ready data (a dict for an attrs or dataclass input)."""
        return json.loads(self.input_json)

    @property
    def output(self) -> Any:
        """The output as JSON-ready data (use `engine.result` for the typed value)."""
        return None if self.output_json is None else json.loads(self.output_json)

    @property
    def interrupted_attempts(self) -> int:
        return sum(1 for e in self.executions if e.outcome == "interrupted")


@frozen(kw_only=True)
class RunPage:
    """One page of `engine.list`; pass `next_cursor` as `before=` for the next page."""

    runs: Sequence[RunInfo]
    next_cursor: UUID | None

    def __iter__(self) -> Any:
        return iter(self.runs)

    def __len__(self) -> int:
        return len(self.runs)


def lease_expired(record: RunRecord) -> bool:
    """Whether `record` is `running` with a lease that had lapsed when the backend read it (at
    its own clock, `observed_at`). The rule lives here, once: `execution_outcome` and the
    `RunInfo` of `build_run_info` both ask it."""
    expires, now = record.lease_expires_at, record.observed_at
    return record.status == "running" and expires is not None and now is not None and expires <= now


def execution_outcome(record: RunRecord, execution: ExecutionRecord) -> ExecutionOutcome:
    """What an execution's outcome reads as: backends store what happened, and an execution
    still stored as `running` reads `interrupted` once it no longer holds the run (another
    claim took it, or it ended) or its lease lapsed (`lease_expired`)."""
    if execution.outcome != "running":
        return execution.outcome
    if (
        execution.fencing_token != record.fencing_token
        or record.status != "running"
        or lease_expired(record)
    ):
        return "interrupted"
    return "running"


def with_execution_outcomes(record: RunRecord) -> RunRecord:
    """`record` with each execution's outcome as `execution_outcome` reads it."""
    executions = tuple(
        e if (o := execution_outcome(record, e)) == e.outcome else evolve(e, outcome=o)
        for e in record.executions
    )
    return evolve(record, executions=executions)


def build_run_info(record: RunRecord) -> RunInfo:
    """The projection: step records, plus the steps that interrupted or canceled executions
    were in, with the statuses a finished run gives its unfinished steps."""
    record = with_execution_outcomes(record)
    terminal = record.status in TERMINAL_STATUSES
    closed: StepViewStatus = "canceled" if record.status == "canceled" else "abandoned"
    # (view, sort key): by start time, then by attempt token (a later execution is later when
    # a frozen test clock gives both the same time); ties keep the backend's order.
    entries: list[tuple[StepView, datetime, int]] = [
        (
            StepView(
                name=s.name,
                kind=s.kind,
                status=closed if terminal and s.status == "waiting" else s.status,
                attempt=s.attempt,
                fencing_token=s.fencing_token,
                started_at=s.started_at,
                finished_at=s.finished_at,
                wake_at=s.wake_at,
                error=s.error,
                output_json=s.output_json,
            ),
            s.started_at or record.created_at,
            s.fencing_token,
        )
        for s in record.steps
    ]
    recorded = {(s.name, s.fencing_token) for s in record.steps}
    for execution in record.executions:
        status: StepViewStatus
        if execution.outcome == "interrupted":
            status = "interrupted"
        elif execution.outcome == "running":
            status = "running"
        elif execution.outcome == "canceled":
            status = "canceled"
        else:
            continue
        step = execution.current_step
        started_at = execution.step_started_at
        inferred = False
        if status == "interrupted" and (
            step is None or (step, execution.fencing_token) in recorded
        ):
            # No heartbeat named the step it was cut off in: none came, or the last one named a
            # step this attempt went on to record (the cut came after it). Where it stopped is
            # where the next execution to do anything began.
            step = _next_live_step(record, execution.fencing_token)
            started_at, inferred = None, True
        if step is None or (step, execution.fencing_token) in recorded:
            continue
        attempt = 1 + sum(
            1
            for s in record.steps
            if s.name == step
            and s.status == "retrying"
            and s.fencing_token < execution.fencing_token
        )
        entries.append(
            (
                StepView(
                    name=step,
                    kind="step",
                    status=status,
                    attempt=attempt,
                    fencing_token=execution.fencing_token,
                    started_at=started_at,
                    finished_at=execution.ended_at,
                    inferred=inferred,
                ),
                started_at or execution.ended_at or execution.claimed_at,
                execution.fencing_token,
            )
        )
    entries.sort(key=lambda entry: (entry[1], entry[2]))
    return RunInfo(
        run_id=record.run_id,
        task_name=record.task_name,
        task_version=record.task_version,
        status=record.status,
        priority=record.priority,
        created_at=record.created_at,
        updated_at=record.updated_at,
        finished_at=record.finished_at,
        attempts=record.claims,
        failures=record.failures,
        lease_expirations=record.lease_expirations,
        error=record.error,
        input_json=record.input_json,
        output_json=record.output_json,
        idempotency_key=record.idempotency_key,
        cancel_requested=record.cancel_requested_at is not None,
        cancel_reason=record.cancel_reason,
        waiting_for=record.wait_for,
        available_at=record.available_at,
        timeline=tuple(view for view, _, _ in entries),
        executions=tuple(record.executions),
        lease_expires_at=record.lease_expires_at if record.status == "running" else None,
        lease_expired=lease_expired(record),
        parent_run_id=record.parent_run_id,
        rerun_of=record.rerun_of,
        forked_from=record.forked_from,
        forked_at_step=record.forked_at_step,
        tags=dict(record.tags),
        concurrency_key=record.concurrency_key,
        rate_limit=record.rate_limit,
        rate_limit_key=record.rate_limit_key,
        debounce_key=record.debounce_key,
        fairness_weight=record.fairness_weight,
        deadline_at=record.deadline_at,
        start_by=record.start_by,
        deadline_passed=deadline_passed(record),
        trace_id=trace_id_of(record.trace_context),
    )


def trace_id_of(trace_context: Mapping[str, str]) -> str | None:
    """The trace id of a stored W3C trace context (`traceparent`), None without a valid one."""
    parts = trace_context.get("traceparent", "").split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
        try:
            int(parts[1], 16)
        except ValueError:
            return None
        return parts[1].lower()
    return None


def deadline_passed(record: RunRecord) -> bool:
    """Unfinished and past its deadline, or never claimed and past its start deadline, at the
    backend's read (`observed_at`)."""
    now = record.observed_at
    if now is None or record.status in TERMINAL_STATUSES:
        return False
    if record.deadline_at is not None and now >= record.deadline_at:
        return True
    return record.start_by is not None and record.claims == 0 and now > record.start_by


def _next_live_step(record: RunRecord, token: int) -> str | None:
    """The step that the next execution to do anything ran first: where an execution that no
    heartbeat described stopped (in that step, or in the handler just before it). Replay is
    deterministic, so the next execution picks up exactly there."""
    for execution in sorted(record.executions, key=lambda e: e.fencing_token):
        if execution.fencing_token <= token:
            continue
        for s in record.steps:  # the backend's order: the first record this execution wrote
            if s.fencing_token == execution.fencing_token:
                return s.name if s.kind == "step" else None
        if execution.current_step is not None:
            return execution.current_step
    return None
