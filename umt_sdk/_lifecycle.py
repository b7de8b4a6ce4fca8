"""Pause and resume tasks; rerun and fork runs: the decisions, for the engine and the CLI.

The store keeps the rows (`umt_sdk.backend.LifecycleStore`); everything decided is here:

- what a pause names: `"name@version"` one version, `"name"` every version of the task; a
  resume of one version while the whole task is paused is refused (it would resume nothing);
- which runs may start again: only finished ones (a rerun or a fork of a run still going would
  do its work twice at once);
- which step records a fork keeps: those recorded before the first record of `from_step`, in
  their order, except the steps of child runs that did not complete (`plan_fork`).
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from uuid import UUID

from attrs import frozen

from umt_sdk import _check as check
from umt_sdk._check import shown
from umt_sdk._spi import (
    TERMINAL_STATUSES,
    Backend,
    LifecycleStore,
    RunQuery,
    RunRecord,
    TaskPair,
)
from umt_sdk._views import RunInfo
from umt_sdk.exceptions import UsageError

__all__ = [
    "CHILD_KEY_PREFIX",
    "MAP_KEY_PREFIX",
    "ForkPlan",
    "children_of",
    "lifecycle_store",
    "pause_target",
    "plan_fork",
    "restartable",
]

CHILD_KEY_PREFIX = "umt.child:"
"""A child run's idempotency key is `umt.child:<parent id>:<start step name>` (`_steps`), and
the fact a child stores for its parent when it finishes is `umt.child:<child id>`."""

MAP_KEY_PREFIX = "umt.map:"
"""A map's child's idempotency key is `umt.map:<parent id>:<step name>:<index>` (`_steps`)."""

_CHILD_PAGE = 1000


def lifecycle_store(backend: Backend, call: str) -> LifecycleStore:
    """The backend as a `LifecycleStore`, or a `UsageError` that says it cannot do `call`."""
    if isinstance(backend, LifecycleStore):
        return backend
    raise UsageError(
        f"{call}() needs a backend that stores pauses and forks (one that implements "
        f"umt_sdk.backend.LifecycleStore); {type(backend).__name__} does not. Use the memory "
        "or Postgres backend, or implement it (the contract suite checks it)",
        argument="backend",
    )


def pause_target(task: object, call: str) -> tuple[str, int | None]:
    """`"name@version"` (a `TaskPair` too) or `"name"` as (name, version or None)."""
    if isinstance(task, TaskPair):
        return task.name, task.version
    if not isinstance(task, str) or not task.strip():
        raise UsageError(
            f"{call}(task): expected a task as 'name' (every version) or 'name@version' (one "
            f"version), got {shown(task)}",
            argument="task",
        )
    text = task.strip()
    if "@" in text:
        pair = TaskPair.parse(text)
        return pair.name, pair.version
    try:
        TaskPair.parse(f"{text}@1")  # the same rule for the name as a pair's
    except UsageError:
        raise UsageError(
            f"{call}(task): a task name is 1-200 letters, digits and _ . : - /, got {task!r}",
            argument="task",
        ) from None
    return text, None


def restartable(record: RunRecord | RunInfo, version: int | None, call: str) -> int:
    """The version a rerun or fork of `record` runs on; refuses an unfinished run, and a
    version older than the run's (replaying newer records on older code)."""
    if record.status not in TERMINAL_STATUSES:
        raise UsageError(
            f"{call}(): run {record.run_id} is still {record.status}; only a finished run can "
            f"start again (two executions of its work at once otherwise): cancel it first "
            f"(engine.cancel / umt cancel), or wait for it to finish",
            argument="run_id",
        )
    if version is None:
        return record.task_version
    check.integer(version, "version", at_least=1, expected="an integer >= 1 or None")
    if version < record.task_version:
        raise UsageError(
            f"{call}(): run {record.run_id} is of version {record.task_version}; it can start "
            f"again on that version or a newer one, not on version {version}",
            argument="version",
        )
    return version


@frozen(kw_only=True)
class ForkPlan:
    """What a fork of a run keeps: its step records before `from_step`, by (name, attempt),
    in their order, and the start steps of the children it starts again."""

    from_step: str
    kept_steps: tuple[tuple[str, int], ...]
    restarted_children: tuple[str, ...] = ()
    """Start steps (before `from_step`) of children that did not complete: the fork drops
    their records and starts them again as its own children."""


def plan_fork(record: RunRecord, from_step: str, children: Sequence[RunRecord]) -> ForkPlan | str:
    """The steps a fork of `record` from `from_step` keeps, or why it cannot fork (the run
    never recorded that step).

    Kept: every record first recorded before the first record of `from_step` (its retries
    included), as stored. Not kept: the start of a child run that did not complete (failed,
    canceled, or still going: a parent's failure cancels its children, and the fork is the
    tool for running the broken part again), nor its `.result` records; the fork starts such a
    child again, as its own. A child that completed is kept: the fork does not start it again,
    and reads its result (the fork has the facts of the old run, the child's among them).
    """
    cut = next((i for i, s in enumerate(record.steps) if s.name == from_step), None)
    if cut is None:
        names = builtins.list(dict.fromkeys(s.name for s in record.steps))
        listed = ", ".join(repr(n) for n in names[:20]) + (", ..." if len(names) > 20 else "")
        return (
            f"run {record.run_id} never recorded a step {from_step!r} (its steps: "
            f"{listed or 'none'}); fork it from one of those, or rerun it"
        )
    prefix = f"{CHILD_KEY_PREFIX}{record.run_id}:"
    not_completed = {
        child.idempotency_key[len(prefix) :]
        for child in children
        if child.idempotency_key is not None
        and child.idempotency_key.startswith(prefix)
        and child.status != "completed"
    }
    before = record.steps[:cut]
    restarted = tuple(dict.fromkeys(s.name for s in before if s.name in not_completed))

    def dropped(name: str) -> bool:
        return any(
            name == start or name == f"{start}.result" or name.startswith(f"{start}.result#")
            for start in restarted
        )

    kept = tuple((s.name, s.attempt) for s in before if not dropped(s.name))
    return ForkPlan(from_step=from_step, kept_steps=kept, restarted_children=restarted)


async def children_of(backend: Backend, run_id: UUID) -> builtins.list[RunRecord]:
    """Every child run of `run_id` (heads, newest first), read a page at a time."""
    found: builtins.list[RunRecord] = []
    before: UUID | None = None
    while True:
        page = await backend.list_runs(
            RunQuery(parent_run_id=run_id, limit=_CHILD_PAGE, before=before)
        )
        found += page
        if len(page) < _CHILD_PAGE:
            return found
        before = page[-1].run_id
