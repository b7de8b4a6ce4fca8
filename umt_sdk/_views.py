"""Read-only projections of runs for `engine.get` / `engine.list`, the same for every backend."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from attrs import frozen

from umt_sdk._spi import ErrorInfo, ExecutionRecord, RunRecord, RunStatus, StepKind

__all__ = ["RunInfo", "RunPage", "StepView", "build_run_info"]

StepViewStatus = Literal["completed", "failed", "retrying", "waiting", "running", "interrupted"]


@frozen(kw_only=True)
class StepView:
    """One entry of a run's step timeline.

    `interrupted`: the attempt was cut off by a lost lease (a crash, a freeze); the step
    re-runs in a later execution. `running`: the step is executing now.
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
    output_json: str | None
    idempotency_key: str | None
    cancel_requested: bool
    cancel_reason: str | None
    waiting_for: str | None
    available_at: datetime | None
    timeline: Sequence[StepView] = ()
    executions: Sequence[ExecutionRecord] = ()

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


def build_run_info(record: RunRecord) -> RunInfo:
    """The projection: step records, plus the steps that interrupted executions were in."""
    views: list[StepView] = [
        StepView(
            name=s.name,
            kind=s.kind,
            status=s.status,
            attempt=s.attempt,
            fencing_token=s.fencing_token,
            started_at=s.started_at,
            finished_at=s.finished_at,
            wake_at=s.wake_at,
            error=s.error,
        )
        for s in record.steps
    ]
    recorded = {(s.name, s.fencing_token) for s in record.steps}
    for execution in record.executions:
        step = execution.current_step
        if step is None or (step, execution.fencing_token) in recorded:
            continue
        if execution.outcome == "interrupted":
            status: StepViewStatus = "interrupted"
        elif execution.outcome == "running":
            status = "running"
        else:
            continue
        attempt = 1 + sum(1 for s in record.steps if s.name == step and s.status == "retrying")
        views.append(
            StepView(
                name=step,
                kind="step",
                status=status,
                attempt=attempt,
                fencing_token=execution.fencing_token,
                started_at=execution.step_started_at,
                finished_at=execution.ended_at,
            )
        )
    # Stable: records that share a start time (a frozen test clock) keep the backend's order.
    views.sort(key=lambda v: v.started_at or record.created_at)
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
        output_json=record.output_json,
        idempotency_key=record.idempotency_key,
        cancel_requested=record.cancel_requested_at is not None,
        cancel_reason=record.cancel_reason,
        waiting_for=record.wait_for,
        available_at=record.available_at,
        timeline=tuple(views),
        executions=tuple(record.executions),
    )
