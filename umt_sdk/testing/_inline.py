"""Run runs to their end in the caller's own event loop, one execution at a time: the engine a
test tool drives (the crash explorer, the pytest plugin's `run_inline`).

It is a one-slot worker without a claim loop or heartbeats: claim, execute the handler to its
next durable boundary, and when nothing is due, move a controllable clock to the next time
something is (a sleep's end, a backoff, a wait's timeout, the lapse of a crashed execution's
lease) or, on a real clock, sleep until then. Facts a run waits for come from `facts`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from umt_sdk._engine import Engine
from umt_sdk._execution import Execution
from umt_sdk._spi import TERMINAL_STATUSES, ControllableClock, RunQuery, RunRecord, TaskPair
from umt_sdk.exceptions import RunNotFoundError, UsageError

__all__ = ["Facts", "drive"]

Facts = Mapping[str, Any] | Callable[[str], Any]
"""The facts a run waits for: `{name: payload}`, or a function of the name returning the
payload (None: no such fact)."""

_NO_FACT = object()

INLINE_WORKER = "umt-inline"
INLINE_LEASE = timedelta(seconds=30)
_REAL_CLOCK_RETRY = 0.05
"""Seconds between claims of a run that is due on a real clock but not claimed yet."""


def _fact(facts: Facts | None, name: str) -> Any:
    if facts is None:
        return _NO_FACT
    if callable(facts):
        value = facts(name)
        return _NO_FACT if value is None else value
    return facts.get(name, _NO_FACT)


async def execute_one(engine: Engine, *, lease: timedelta = INLINE_LEASE) -> bool:
    """Claim one due run of the registry's tasks and execute it to its next durable boundary
    (it completes, fails, parks, or crashes); False when no run was due."""
    backend = engine.backend
    pairs = engine.registry.pairs()
    claimed = await backend.claim(worker_id=INLINE_WORKER, pairs=pairs, limit=1, lease=lease)
    if not claimed:
        return False
    run = claimed[0]
    execution = Execution(
        backend=backend,
        claimed=run,
        definition=engine.registry.get(run.task_name, run.task_version),
        worker_id=INLINE_WORKER,
        lease_duration=lease,
        loop=asyncio.get_running_loop(),
        telemetry=engine.telemetry,
    )
    await execution.start()
    return True


async def drive(
    engine: Engine,
    run_id: UUID,
    *,
    facts: Facts | None = None,
    lease: timedelta = INLINE_LEASE,
    max_executions: int = 10_000,
) -> RunRecord:
    """Execute due runs until run `run_id` has finished; return it as stored (without steps).

    Every due run of the registry's tasks is executed, in claim order, as a worker would (the
    run's children, runs enqueued before it). When none is due: each waiting run (this one, its
    children...) is sent the fact it waits for if `facts` has it, else the clock moves to when
    a run is next due (a `ControllableClock` is advanced; on a real clock this sleeps). When
    nothing would ever wake the run (a fact with no deadline that `facts` cannot give),
    `UsageError`.
    """
    backend = engine.backend
    clock = backend.clock
    controls = clock if isinstance(clock, ControllableClock) else None
    executions = 0
    while True:
        head = await backend.get_run_head(run_id)
        if head is None:
            raise RunNotFoundError(f"no run {run_id}", run_id=run_id)
        if head.status in TERMINAL_STATUSES:
            return head
        if executions >= max_executions:
            raise UsageError(
                f"run {run_id} did not finish in {max_executions} executions (it is "
                f"{head.status}); a handler that parks or fails forever? Raise max_executions "
                "if it really needs more",
                argument="max_executions",
            )
        if await execute_one(engine, lease=lease):
            executions += 1
            continue
        if await _send_facts(engine, facts):
            continue
        due = await _next_due(engine, head)
        if due is None:
            raise UsageError(
                f"run {run_id} waits for fact {head.wait_for!r} with no deadline, and nothing "
                f"sends it: pass facts={{{head.wait_for!r}: payload}}",
                argument="facts",
            )
        now = controls.now() if controls is not None else head.observed_at or due
        if due <= now and head.status != "running":
            pair = TaskPair(name=head.task_name, version=head.task_version)
            if controls is None and pair in engine.registry.pairs():
                # A backend may find due timers on its own schedule (Postgres reads them about
                # once a second): the claim takes the run soon.
                await asyncio.sleep(_REAL_CLOCK_RETRY)
                continue
            raise UsageError(
                f"run {run_id} of {head.task_name}@{head.task_version} is due but nothing "
                "claims it: register that task (and version) in the engine's registry",
                argument="registry",
            )
        if controls is not None:
            controls.advance_to(due)
        else:
            await asyncio.sleep(max(0.01, min(1.0, (due - now).total_seconds())))


async def _send_facts(engine: Engine, facts: Facts | None) -> bool:
    """Send each waiting run the fact it waits for, if `facts` has it; whether any was sent
    (the run, or a child or a run it waits for: any waiting run)."""
    if facts is None:
        return False
    sent = False
    for run in await engine.backend.list_runs(RunQuery(status="waiting", limit=10_000)):
        if run.wait_for is None:
            continue
        payload = _fact(facts, run.wait_for)
        if payload is not _NO_FACT and await engine.signal(run.run_id, run.wait_for, payload):
            sent = True
    return sent


def _due(run: RunRecord) -> datetime | None:
    """When the run is next claimable: its `available_at`, or the lapse of its lease."""
    if run.status == "running":
        return run.lease_expires_at
    return run.available_at


async def _next_due(engine: Engine, head: RunRecord) -> datetime | None:
    """The earliest time any unfinished run is next claimable (the run's children, or the
    runs it waits for, may be due before it), or None when none ever is by itself."""
    times = [] if _due(head) is None else [_due(head)]
    for status in ("pending", "waiting", "running"):
        runs = await engine.backend.list_runs(RunQuery(status=status, limit=10_000))
        times += [_due(run) for run in runs]
    due = [time for time in times if time is not None]
    return min(due) if due else None
