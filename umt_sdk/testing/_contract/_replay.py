"""Replay: a completed step never runs again, steps are found by name, a changed handler
is caught."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    Engine,
    Registry,
    RunFailedError,
    SyncTaskContext,
    TaskContext,
    TaskDefinition,
    step,
    task,
)
from umt_sdk.testing._contract._base import Job, Tally, eventually, holds, steps_task, wait_until
from umt_sdk.testing._helpers import BackendHarness, simulate_crash

__all__ = ["ReplayContract"]


@task("contract.shape", version=1)
async def shape_a(ctx: TaskContext[Job]) -> str:
    await ctx.step.run("x", lambda: 1)
    await ctx.step.wait_for_fact("go")
    return "a"


@task("contract.shape", version=1)
async def shape_b(ctx: TaskContext[Job]) -> str:
    await ctx.step.sleep("x", timedelta(milliseconds=1))
    return "b"


@task("contract.repeats", version=1)
async def repeats_task(ctx: TaskContext[Job]) -> list[int]:
    return [await ctx.step.run("tick", lambda i=i: i) for i in range(3)]


@step("sync-double")
def sync_double(x: int) -> int:
    return x * 2


@task("contract.plain", version=1)
def plain_task(ctx: SyncTaskContext[Job]) -> int:
    doubled = sync_double(ctx.input.n)
    tripled = ctx.step.run("triple", lambda: ctx.input.n * 3)
    ctx.step.sleep("tiny", timedelta(milliseconds=50))
    return doubled + tripled


@task("contract.mixed", version=1)
async def mixed_task(ctx: TaskContext[Job]) -> int:
    a = await sync_double.aio(ctx.input.n)
    b: int = await sync_double(ctx.input.n)  # type: ignore[misc]  # runtime form, untyped
    return a + b


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    repeats_task,
    plain_task,
    mixed_task,
)
"""The tasks of this topic that the suite's engine registers. Not `shape_a` and `shape_b`: they
share a name and version on purpose, so each runs on an engine of its own."""


class ReplayContract:
    """A run resumed after a crash replays its recorded steps by name and re-runs only the
    interrupted one; a handler whose steps no longer match its record fails the run."""

    async def test_replay_by_name_after_crash(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        tally.gate("r1")
        handle = await engine.enqueue(steps_task, Job(key="r1"))
        worker_a = engine.worker(concurrency=1, lease=harness.lease)
        await worker_a.start()
        await eventually(lambda: holds(tally.body_runs[("r1", "second")] == 1))
        await asyncio.sleep(worker_a.heartbeat_interval.total_seconds() * 2)
        simulate_crash(worker_a)
        await worker_a.stop()
        await harness.advance(harness.lease * 2)
        tally.gates["r1"].set()
        async with engine.worker(concurrency=1, lease=harness.lease):
            assert await handle.result(timeout=20) == 6
        assert tally.body_runs[("r1", "first")] == 1, "a completed step never runs again"
        assert tally.body_runs[("r1", "second")] == 2, "the interrupted step re-runs"
        info = await engine.get(handle.run_id)
        assert info.attempts == 2
        assert info.lease_expirations == 1
        statuses = [(s.name, s.status) for s in info.timeline]
        assert ("second", "interrupted") in statuses, statuses
        assert statuses.count(("second", "completed")) == 1
        assert all(s.status != "running" for s in info.timeline)

    async def test_repeated_step_names_get_occurrence_suffix(self, engine: Engine) -> None:
        handle = await engine.enqueue(repeats_task, Job(key="rep"))
        async with engine.worker():
            assert await handle.result(timeout=15) == [0, 1, 2]
        names = [s.name for s in (await engine.get(handle.run_id)).timeline]
        assert names == ["tick", "tick#2", "tick#3"]

    async def test_non_determinism_is_detected(self, engine: Engine) -> None:
        original = Engine(engine.backend, Registry([shape_a]))
        handle = await original.enqueue(shape_a, Job(key="nd"))
        async with original.worker():
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting", what="waiting")
        changed = Engine(engine.backend, Registry([shape_b]))
        await engine.signal(handle.run_id, "go")
        async with changed.worker():
            with pytest.raises(RunFailedError) as caught:
                await changed.result(handle.run_id, timeout=15)
        assert caught.value.error_type.endswith("NonDeterminismError")
        assert "'step'" in caught.value.error_message
        assert "'sleep'" in caught.value.error_message

    async def test_plain_task_and_plain_steps(self, engine: Engine) -> None:
        plain = await engine.enqueue(plain_task, Job(key="p", n=5))
        mixed = await engine.enqueue(mixed_task, Job(key="m", n=4))
        async with engine.worker():
            assert await plain.result(timeout=15) == 25
            assert await mixed.result(timeout=15) == 16
        names = [s.name for s in (await engine.get(plain.run_id)).timeline]
        assert names == ["sync-double", "triple", "tiny"]
