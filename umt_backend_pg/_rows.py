"""Row decoding: the rows of the runs, steps and executions tables as umt's records."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from umt_sdk.backend import (
    ErrorInfo,
    ExecutionRecord,
    PrunedRun,
    RunRecord,
    ScheduleRecord,
    ScheduleState,
    StepRecord,
    StreamEntry,
)

__all__ = [
    "_error",
    "_error_json",
    "_pruned_run",
    "_record",
    "_schedule_record",
    "_step",
    "_stream_entry",
    "_ts",
]


def _error_json(error: ErrorInfo | None) -> str | None:
    if error is None:
        return None
    return json.dumps({"type": error.type, "message": error.message, "traceback": error.traceback})


def _error(value: Any) -> ErrorInfo | None:
    if not value:
        return None
    return ErrorInfo(
        type=str(value.get("type", "")),
        message=str(value.get("message", "")),
        traceback=str(value.get("traceback", "")),
    )


def _step(row: Mapping[str, Any], output_json: str | None) -> StepRecord:
    return StepRecord(
        name=row["name"],
        kind=row["kind"],
        status=row["status"],
        attempt=row["attempt"],
        fencing_token=row["fencing_token"],
        output_json=output_json,
        error=_error(row["error"]),
        started_at=_ts(row["started_at"]),
        finished_at=_ts(row["finished_at"]),
        wake_at=_ts(row["wake_at"]),
    )


def _ts(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


def _record(
    row: dict[str, Any],
    steps: Sequence[dict[str, Any]] = (),
    executions: Sequence[dict[str, Any]] = (),
) -> RunRecord:
    now = row["db_now"]
    records = []
    for e in executions:
        outcome = e["outcome"]  # as stored: the SDK reads a lapsed `running` (`_views`)
        records.append(
            ExecutionRecord(
                fencing_token=e["fencing_token"],
                worker_id=e["worker_id"],
                claimed_at=e["claimed_at"],
                ended_at=e["ended_at"],
                outcome=outcome,
                current_step=e["current_step"],
                step_started_at=e["step_started_at"],
            )
        )
    return RunRecord(
        run_id=row["id"],
        task_name=row["task_name"],
        task_version=row["task_version"],
        status=row["status"],
        priority=row["priority"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        # Stored for a running run, `available_at` is the claim's lower bound of its lease's
        # expiry (claim_runs reads timers by it), not when it may next be claimed: the SPI
        # reports None for it (`RunRecord.available_at`).
        available_at=row["available_at"] if row["status"] != "running" else None,
        input_json=row["input"],
        idempotency_key=row["idempotency_key"],
        output_json=row["output"],
        error=_error(row["error"]),
        claims=row["claims"],
        failures=row["failures"],
        lease_expirations=row["lease_expirations"],
        fencing_token=row["fencing_token"],
        lease_owner=row["lease_owner"],
        lease_expires_at=row["lease_expires_at"],
        finished_at=row["finished_at"],
        cancel_requested_at=row["cancel_requested_at"],
        cancel_reason=row["cancel_reason"],
        wait_for=row["wait_for"],
        trace_context=row["trace_context"] or {},
        parent_run_id=row.get("parent_run_id"),
        rerun_of=row.get("rerun_of"),
        forked_from=row.get("forked_from"),
        forked_at_step=row.get("forked_at_step"),
        tags=row.get("tags") or {},
        concurrency_key=row.get("concurrency_key"),
        fairness_weight=row.get("fairness_weight"),
        deadline_at=row.get("deadline_at"),
        start_by=row.get("start_by"),
        rate_limit=row.get("rate_limit"),
        rate_limit_key=row.get("rate_limit_key"),
        debounce_key=row.get("debounce_key"),
        steps=tuple(_step(s, s["output"]) for s in steps),
        executions=tuple(records),
        observed_at=now,
    )


def _schedule_record(row: Mapping[str, Any]) -> ScheduleRecord:
    return ScheduleRecord(
        state=ScheduleState(
            name=row["name"],
            task_name=row["task_name"],
            cron=row["cron"],
            timezone=row["timezone"],
            input_json=row["input"],
            overlap=row["overlap"],
            catchup_window=row["catchup_window"],
            paused=row["paused"],
            next_tick=row["next_tick"],
            last_tick=row["last_tick"],
            last_run_id=row["last_run_id"],
            buffered_tick=row["buffered_tick"],
        ),
        version=row["version"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        observed_at=row["db_now"],
    )


def _pruned_run(row: Mapping[str, Any]) -> PrunedRun:
    return PrunedRun(
        run_id=row["run_id"],
        task_name=row["task_name"],
        task_version=row["task_version"],
        status=row["status"],
        idempotency_key=row["idempotency_key"],
        input_hash=row["input_hash"],
        created_at=row["created_at"],
        finished_at=row["finished_at"],
        pruned_at=row["pruned_at"],
    )


def _stream_entry(row: Mapping[str, Any]) -> StreamEntry:
    return StreamEntry(
        run_id=row["run_id"],
        stream=row["name"],
        seq=row["seq"],
        key=row["key"],
        value_json=row["value"],
        written_at=row["written_at"],
    )
