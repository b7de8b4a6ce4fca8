"""Pause targets, the steps a fork keeps, and the Postgres claim's timers after a resume."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from uuid import UUID

import pytest

from umt_backend_pg._ready import ClaimClocks
from umt_sdk import TaskPair, UsageError
from umt_sdk._engine import new_run_id
from umt_sdk._lifecycle import ForkPlan, pause_target, plan_fork
from umt_sdk.backend import RunRecord, StepRecord

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _run(run_id: UUID, steps: list[tuple[str, int]], **fields: object) -> RunRecord:
    values: dict[str, object] = {
        "run_id": run_id,
        "task_name": "t",
        "task_version": 1,
        "status": "failed",
        "priority": 0,
        "created_at": NOW,
        "updated_at": NOW,
        "available_at": None,
        "input_json": "{}",
        "steps": tuple(
            StepRecord(name=n, kind="step", status="completed", attempt=a, output_json="1")
            for n, a in steps
        ),
    }
    values.update(fields)
    return RunRecord(**values)  # type: ignore[arg-type]


def test_pause_targets_name_one_version_or_the_whole_task() -> None:
    assert pause_target("send_mail@3", "pause") == ("send_mail", 3)
    assert pause_target(" send_mail ", "pause") == ("send_mail", None)
    assert pause_target(TaskPair(name="a.b", version=2), "pause") == ("a.b", 2)
    for bad, words in [
        ("", "expected a task as 'name'"),
        ("a b", "letters, digits"),
        ("a@x", "task_name@version"),
        (None, "expected a task"),
    ]:
        with pytest.raises(UsageError, match=words):
            pause_target(bad, "pause")


def test_a_fork_keeps_the_records_before_the_first_record_of_its_step() -> None:
    run_id = new_run_id()
    record = _run(run_id, [("a", 1), ("a", 2), ("b", 1), ("submit", 1), ("c", 1), ("submit", 2)])
    plan = plan_fork(record, "submit", [])
    assert plan == ForkPlan(from_step="submit", kept_steps=(("a", 1), ("a", 2), ("b", 1)))
    assert plan_fork(record, "a", []) == ForkPlan(from_step="a", kept_steps=())
    missing = plan_fork(record, "nope", [])
    assert isinstance(missing, str)
    assert "never recorded a step 'nope' (its steps: 'a', 'b', 'submit', 'c')" in missing


def test_a_fork_drops_the_children_that_did_not_complete_and_their_results() -> None:
    parent = new_run_id()
    record = _run(
        parent,
        [("ok", 1), ("bad", 1), ("ok.result", 1), ("bad.result", 1), ("bad.result#2", 1)],
    )
    children = [
        _run(new_run_id(), [], status="completed", idempotency_key=f"umt.child:{parent}:ok"),
        _run(new_run_id(), [], status="failed", idempotency_key=f"umt.child:{parent}:bad"),
        _run(new_run_id(), [], status="failed", idempotency_key="umt.child:someone-else:x"),
    ]
    plan = plan_fork(record, "bad.result#2", children)
    assert isinstance(plan, ForkPlan)
    assert plan.kept_steps == (("ok", 1), ("ok.result", 1))
    assert plan.restarted_children == ("bad",)


def test_a_claim_reads_every_timer_once_a_paused_pair_is_resumed() -> None:
    """Timers of a paused pair are not read, and the read cursor passes them by: after the
    resume the next claim reads them all (from the start), not from the cursor."""
    clocks = ClaimClocks()
    pairs = frozenset({TaskPair(name="t", version=1)})
    first = clocks.timers(pairs)
    assert (first.read, first.after) == (True, None)
    started = time.monotonic()
    clocks.timers_read(
        pairs, first, started=started, timers_from=NOW, left=True, paused=frozenset({"t@1"})
    )
    still = clocks.timers(pairs)
    assert (still.read, still.after) == (True, NOW), "from the cursor while it stays paused"
    clocks.timers_read(
        pairs, still, started=started, timers_from=NOW + timedelta(1), left=True,
        paused=frozenset({"t@1"}),
    )  # fmt: skip
    assert clocks.timers(pairs).after == NOW + timedelta(1)
    clocks.timers_read(
        pairs, still, started=started, timers_from=NOW + timedelta(2), left=False
    )  # the pair was resumed
    again = clocks.timers(pairs)
    assert (again.read, again.after) == (True, None)
