"""Handlers and steps as users write them: plain code in threads, errors of odd kinds."""

from __future__ import annotations

import asyncio
from typing import Any

from umt_sdk import (
    Engine,
    RetryPolicy,
    StepFailedError,
    SyncTaskContext,
    TaskContext,
    TaskDefinition,
    task,
)
from umt_sdk.testing._contract._base import Job, Tally, current_tally

__all__ = ["UserCodeContract"]


@task("contract.plain_nested", version=1)
def plain_nested_task(ctx: SyncTaskContext[Job]) -> int:
    """The shape docs/writing-tasks.md shows: a plain handler calling a plain step."""
    doubled: int = ctx.step.run("double", lambda n: 2 * n, ctx.input.n)
    return doubled + 1


@task("contract.own_cancelled_error", version=1, retry=RetryPolicy.none())
async def own_cancelled_error_task(ctx: TaskContext[Job]) -> str:
    """A step whose code raises `asyncio.CancelledError` itself (a library cancelling a future
    of its own): a failure of that step, not the worker stopping the execution."""
    tally = current_tally()

    async def body() -> str:
        tally.body_runs[(ctx.input.key, "inner")] += 1
        inner: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        inner.cancel()
        return await inner

    try:
        await ctx.step.run("inner", body, retry=RetryPolicy.none())
    except StepFailedError as exc:
        return f"step failed: {exc.error_type}"
    return "not reached"


class Unprintable(Exception):
    """An error whose `__str__` and `__repr__` raise: umt still records it."""

    def __str__(self) -> str:
        raise RuntimeError("no str for you")

    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


@task("contract.unprintable", version=1, retry=RetryPolicy.none())
async def unprintable_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()

    def body() -> str:
        tally.body_runs[(ctx.input.key, "boom")] += 1
        raise Unprintable

    try:
        await ctx.step.run("boom", body, retry=RetryPolicy.none())
    except StepFailedError as exc:
        return exc.error_type
    return "not reached"


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    plain_nested_task,
    own_cancelled_error_task,
    unprintable_task,
)
"""The tasks of this topic that the suite's engine registers."""


class UserCodeContract:
    """Whatever user code does (blocks a thread, raises `CancelledError` itself, raises an
    error that cannot be printed), the run ends and its record says what happened."""

    async def test_plain_handlers_calling_plain_steps_never_deadlock(self, engine: Engine) -> None:
        """Each plain handler holds a thread while its plain step needs another: with more
        slots than the default thread pool has threads, every run must still finish."""
        handles = [
            await engine.enqueue(plain_nested_task, Job(key=f"p{i}", n=i)) for i in range(70)
        ]
        async with engine.worker(concurrency=64):
            results = [await h.result(timeout=60) for h in handles]
        assert results == [2 * i + 1 for i in range(70)]

    async def test_a_cancelled_error_raised_by_step_code_fails_the_step(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(own_cancelled_error_task, Job(key="own-cancel"))
        async with engine.worker():
            result = await handle.result(timeout=15)
        assert result == "step failed: asyncio.exceptions.CancelledError"
        assert tally.body_runs[("own-cancel", "inner")] == 1
        info = await engine.get(handle.run_id)
        assert [e.outcome for e in info.executions] == ["completed"]
        (record,) = [s for s in info.timeline if s.name == "inner"]
        assert record.status == "failed"

    async def test_an_error_that_cannot_be_printed_is_still_recorded(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(unprintable_task, Job(key="unprintable"))
        async with engine.worker():
            result = await handle.result(timeout=15)
        assert result.endswith("Unprintable")
        assert tally.body_runs[("unprintable", "boom")] == 1
        info = await engine.get(handle.run_id)
        (record,) = [s for s in info.timeline if s.name == "boom"]
        assert record.status == "failed"
        assert record.error is not None
        assert "unprintable" in record.error.message
