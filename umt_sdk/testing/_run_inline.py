"""`run_inline`: enqueue one run and execute it to its end in the test's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any, TypeVar, overload
from uuid import UUID

from umt_sdk import _check as check
from umt_sdk._engine import Engine
from umt_sdk._spi import ControllableClock
from umt_sdk._task import TaskDefinition
from umt_sdk.exceptions import ResultTimeoutError, UnknownTaskError, UsageError
from umt_sdk.testing._inline import _NO_FACT, Facts, _fact, drive

__all__ = ["run_inline"]

I = TypeVar("I")
O = TypeVar("O")

REGISTRY_HINT = (
    "the engine's registry is empty: with the pytest plugin, override the `umt_registry` "
    "fixture in conftest.py (`return Registry([my_task, ...])`)"
)


@overload
async def run_inline(
    engine: Engine,
    task: TaskDefinition[I, O],
    input: I | Mapping[str, Any],
    *,
    facts: Facts | None = None,
    priority: int = 0,
    idempotency_key: str | None = None,
    timeout: float | None = 60.0,
) -> O: ...
@overload
async def run_inline(
    engine: Engine,
    task: str,
    input: Any,
    *,
    facts: Facts | None = None,
    priority: int = 0,
    idempotency_key: str | None = None,
    timeout: float | None = 60.0,
) -> Any: ...
async def run_inline(
    engine: Engine,
    task: TaskDefinition[Any, Any] | str,
    input: Any,
    *,
    facts: Facts | None = None,
    priority: int = 0,
    idempotency_key: str | None = None,
    timeout: float | None = 60.0,
) -> Any:
    """Enqueue a run of `task` and execute it, durably, to its end in this event loop; return
    its output decoded to the task's output type.

    Nothing but this call executes runs meanwhile (no worker may be running on `engine`): it
    claims due runs one at a time, the run's children and runs enqueued before it included,
    and executes each to its next durable boundary, as a worker would. When nothing is due it
    sends a fact the run waits for from `facts` (`{name: payload}`, or a function of the name
    returning the payload or None), or moves the clock on: a `FakeClock` jumps to the next
    sleep's end, backoff or wait timeout at no cost; a real clock (Postgres) is slept on.

    Args:
        facts: the facts the run (and its children) wait for.
        priority, idempotency_key: as for `engine.enqueue`.
        timeout: seconds of real time the whole call may take (None: no limit); on a real
            clock a long sleep in the task hits it.

    Raises:
        RunFailedError, RunCanceledError: the run did not complete (as `result()`).
        ResultTimeoutError: `timeout` passed first.
        UsageError: the run waits for a fact with no deadline that `facts` does not give, or
            a worker is running on `engine`.
    """
    __tracebackhide__ = True  # pytest shows the test's line, not ours
    if not isinstance(engine, Engine):
        check.refuse(
            "engine", "an Engine (the umt_engine fixture, say)", engine, where="run_inline"
        )
    if facts is not None and not (isinstance(facts, Mapping) or callable(facts)):
        check.refuse(
            "facts",
            "a dict of fact name -> payload, a function of the name, or None",
            facts,
            where="run_inline",
        )
    limit = None
    if timeout is not None:
        limit = check.seconds(
            timeout, "timeout", expected="a finite number of seconds >= 0, or None"
        )
    running = [w.worker_id for w in engine._workers if w.running]
    if running:
        raise UsageError(
            f"run_inline executes runs itself, but worker {running[0]} is running on this "
            "engine and would claim them too; use one or the other (not the umt_worker "
            "fixture with run_inline)",
            argument="engine",
        )
    try:
        handle = await engine.enqueue(
            task, input, priority=priority, idempotency_key=idempotency_key
        )
    except UnknownTaskError as exc:
        if len(engine.registry):
            raise
        raise UnknownTaskError(f"{exc}; {REGISTRY_HINT}", task_name=exc.task_name) from exc
    await _drive_within(engine, handle.run_id, facts, limit)
    return await handle.result()


_LOOK_EVERY = 0.05
"""Seconds between looks at the run while `drive` works: for the deadline, and on a real
clock for a run that will not be due before it."""


async def _drive_within(
    engine: Engine, run_id: UUID, facts: Facts | None, limit: float | None
) -> None:
    """`drive` the run to its end within `limit` seconds of real time. On a real clock, a run
    parked until after the deadline (a long sleep, backoff or wait timeout) fails at once
    instead of when the deadline passes."""
    loop = asyncio.get_running_loop()
    deadline = None if limit is None else loop.time() + limit
    real_clock = not isinstance(engine.backend.clock, ControllableClock)
    driving = asyncio.ensure_future(drive(engine, run_id, facts=facts))
    try:
        while True:
            await asyncio.wait([driving], timeout=_LOOK_EVERY)
            if driving.done():
                driving.result()
                return
            now = loop.time()
            if deadline is not None and now >= deadline:
                raise await _too_slow(engine, run_id, limit, real_clock)
            if deadline is None or not real_clock:
                continue
            head = await engine.backend.get_run_head(run_id)
            if head is None or head.status not in ("pending", "waiting"):
                continue
            if head.available_at is None or head.observed_at is None:
                continue
            if head.wait_for is not None and _fact(facts, head.wait_for) is not _NO_FACT:
                continue  # `drive` sends it
            if (head.available_at - head.observed_at).total_seconds() > deadline - now:
                raise await _too_slow(engine, run_id, limit, real_clock)
    finally:
        if not driving.done():
            driving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driving


async def _too_slow(
    engine: Engine, run_id: UUID, limit: float | None, real_clock: bool
) -> ResultTimeoutError:
    info = await engine.get(run_id)
    until = f" until {info.available_at}" if info.available_at else ""
    real = ""
    if real_clock:
        real = (
            "; this engine keeps real time (Postgres, or no FakeClock), so sleeps, backoffs "
            "and wait timeouts last as long as they say: keep them short in tests, or run this "
            "test on the memory backend with its FakeClock"
        )
    return ResultTimeoutError(
        f"run_inline: run {run_id} of {info.task_name}@{info.task_version} is {info.status}"
        f"{until}, past the timeout of {limit:g} s{real}"
    )
