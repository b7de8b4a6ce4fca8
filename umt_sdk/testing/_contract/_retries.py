"""Retries: a failing step retries durably with its backoff and gives up after its
attempts; a failing handler retries the run without re-running completed steps."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    Engine,
    RetryPolicy,
    RunFailedError,
    StepFailedError,
    TaskContext,
    TaskDefinition,
    task,
)
from umt_sdk.testing._contract._base import Job, current_tally

__all__ = ["RetriesContract"]


@task(
    "contract.flaky",
    version=1,
    retry=RetryPolicy(max_attempts=3, initial=timedelta(milliseconds=200), backoff=1.0),
)
async def flaky_task(ctx: TaskContext[Job]) -> int:
    tally = current_tally()

    async def flaky() -> int:
        tally.body_runs[(ctx.input.key, "flaky")] += 1
        if tally.body_runs[(ctx.input.key, "flaky")] <= ctx.input.n:
            raise ConnectionError(f"attempt {tally.body_runs[(ctx.input.key, 'flaky')]} failed")
        return tally.body_runs[(ctx.input.key, "flaky")]

    value: int = await ctx.step.run("call", flaky)
    return value


@task(
    "contract.flaky_handler",
    version=1,
    retry=RetryPolicy(
        max_attempts=3,
        initial=timedelta(milliseconds=200),
        backoff=1.0,
        non_retryable=(KeyError,),
    ),
)
async def flaky_handler_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()
    await ctx.step.run("once", lambda: tally.body_runs.update({(ctx.input.key, "once"): 1}))
    tally.body_runs[(ctx.input.key, "handler")] += 1
    if ctx.input.n == -1:
        raise KeyError("not retryable")
    if tally.body_runs[(ctx.input.key, "handler")] <= ctx.input.n:
        raise RuntimeError("handler failed")
    return "ok"


@task("contract.step_gives_up", version=1, retry=RetryPolicy.none())
async def step_gives_up_task(ctx: TaskContext[Job]) -> str:
    def boom() -> None:
        raise OSError("disk on fire")

    try:
        await ctx.step.run("boom", boom)
    except StepFailedError as exc:
        if ctx.input.n == 1:
            return f"handled {exc.error_type}"
        raise
    return "unreachable"


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    flaky_task,
    flaky_handler_task,
    step_gives_up_task,
)
"""The tasks of this topic that the suite's engine registers."""


class RetriesContract:
    """Each retry is a new execution that replays what completed and runs the rest."""

    async def test_step_retries_durably_with_backoff(self, engine: Engine) -> None:
        handle = await engine.enqueue(flaky_task, Job(key="fl", n=2))
        async with engine.worker():
            assert await handle.result(timeout=15) == 3
        info = await engine.get(handle.run_id)
        assert [(s.name, s.status, s.attempt) for s in info.timeline] == [
            ("call", "retrying", 1),
            ("call", "retrying", 2),
            ("call", "completed", 3),
        ]
        assert info.attempts == 3, "each retry releases the slot and is claimed again"
        assert info.failures == 0
        first_try, second_try = info.timeline[0], info.timeline[1]
        assert second_try.started_at is not None
        assert first_try.finished_at is not None
        assert second_try.started_at - first_try.finished_at >= timedelta(milliseconds=190)

    async def test_step_gives_up_after_its_attempts(self, engine: Engine) -> None:
        failing = await engine.enqueue(step_gives_up_task, Job(key="g0"))
        handled = await engine.enqueue(step_gives_up_task, Job(key="g1", n=1))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await failing.result(timeout=15)
            assert await handled.result(timeout=15) == "handled OSError"
        assert "disk on fire" in caught.value.error_message
        info = await engine.get(failing.run_id)
        assert info.failures == 1
        assert [(s.name, s.status) for s in info.timeline] == [("boom", "failed")]

    async def test_handler_failures_retry_the_run(self, engine: Engine) -> None:
        flaky = await engine.enqueue(flaky_handler_task, Job(key="h", n=2))
        final = await engine.enqueue(flaky_handler_task, Job(key="k", n=-1))
        async with engine.worker():
            assert await flaky.result(timeout=15) == "ok"
            with pytest.raises(RunFailedError) as caught:
                await final.result(timeout=15)
        assert caught.value.error_type == "KeyError"
        info = await engine.get(flaky.run_id)
        assert info.failures == 2
        assert info.attempts == 3
        assert [s.name for s in info.timeline] == ["once"], "completed steps are not re-run"
        assert (await engine.get(final.run_id)).failures == 1
