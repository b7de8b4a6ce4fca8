"""The one rule for an execution stored as `running` (the SDK's, not the backends')."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import attrs
import pytest

from umt_sdk._spi import ExecutionRecord, RunRecord, RunStatus, StepRecord
from umt_sdk._views import build_run_info, execution_outcome, lease_expired

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def _record(
    *, status: RunStatus = "running", token: int = 2, expires: datetime | None = None
) -> RunRecord:
    return RunRecord(
        run_id=uuid.uuid4(),
        task_name="t",
        task_version=1,
        status=status,
        priority=0,
        created_at=NOW,
        updated_at=NOW,
        available_at=NOW,
        input_json="null",
        fencing_token=token,
        lease_expires_at=expires,
        observed_at=NOW,
        executions=(
            ExecutionRecord(
                fencing_token=2, worker_id="w", claimed_at=NOW, ended_at=None, outcome="running"
            ),
        ),
    )


@pytest.mark.parametrize(
    ("record", "reads"),
    [
        (_record(expires=NOW + timedelta(seconds=5)), "running"),
        (_record(expires=None), "running"),
        (_record(expires=NOW), "interrupted"),  # lapsed at the backend's clock
        (_record(expires=NOW - timedelta(seconds=1)), "interrupted"),
        (_record(token=3, expires=NOW + timedelta(seconds=5)), "interrupted"),  # taken over
        (_record(status="pending", expires=None), "interrupted"),  # the run moved on
    ],
    ids=["held", "no-lease", "lapsed-now", "lapsed", "taken-over", "run-not-running"],
)
def test_a_running_execution_reads_interrupted_once_it_lost_the_run(
    record: RunRecord, reads: str
) -> None:
    [execution] = record.executions
    assert execution_outcome(record, execution) == reads
    assert [e.outcome for e in build_run_info(record).executions] == [reads]


def test_other_outcomes_are_reported_as_stored() -> None:
    record = _record(expires=NOW - timedelta(seconds=1))
    done = ExecutionRecord(
        fencing_token=2, worker_id="w", claimed_at=NOW, ended_at=NOW, outcome="completed"
    )
    assert execution_outcome(record, done) == "completed"


@pytest.mark.parametrize(
    ("record", "expired"),
    [
        (_record(expires=NOW + timedelta(seconds=5)), False),
        (_record(expires=None), False),
        (_record(expires=NOW), True),
        (_record(expires=NOW - timedelta(seconds=1)), True),
        (_record(status="pending", expires=NOW - timedelta(seconds=1)), False),
    ],
    ids=["held", "no-lease", "lapsed-now", "lapsed", "not-running"],
)
def test_the_run_info_reads_an_expired_lease_by_the_same_rule(
    record: RunRecord, expired: bool
) -> None:
    assert lease_expired(record) is expired
    assert build_run_info(record).lease_expired is expired


def test_a_cut_after_the_step_a_heartbeat_named_is_placed_where_the_next_execution_began() -> None:
    """The last heartbeat of the cut attempt named `a`, which it then recorded: it was cut off
    later, in the step the next attempt began with (`b`), not in `a`."""
    first = ExecutionRecord(
        fencing_token=2,
        worker_id="w1",
        claimed_at=NOW,
        ended_at=NOW + timedelta(seconds=3),
        outcome="interrupted",
        current_step="a",
        step_started_at=NOW,
    )
    second = ExecutionRecord(
        fencing_token=3,
        worker_id="w2",
        claimed_at=NOW + timedelta(seconds=3),
        ended_at=None,
        outcome="running",
    )
    record = attrs.evolve(
        _record(token=3, expires=NOW + timedelta(seconds=5)),
        executions=(first, second),
        steps=(
            StepRecord(name="a", kind="step", status="completed", fencing_token=2, started_at=NOW),
            StepRecord(
                name="b",
                kind="step",
                status="completed",
                fencing_token=3,
                started_at=NOW + timedelta(seconds=4),
            ),
        ),
    )
    timeline = [
        (s.name, s.status, s.fencing_token, s.inferred) for s in build_run_info(record).timeline
    ]
    assert timeline == [
        ("a", "completed", 2, False),
        ("b", "interrupted", 2, True),
        ("b", "completed", 3, False),
    ]
