"""Durable sleeps and facts: a sleep frees the slot, a fact is kept until its waiter comes,
the first write wins, a wait times out durably, a check reads business state."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from umt_sdk import Engine, FactTimeoutError, TaskContext, TaskDefinition, task
from umt_sdk.testing._contract._base import Job, Tally, current_tally, wait_until, waiter_task

__all__ = ["FactsContract"]


@task("contract.sleeper", version=1)
async def sleeper_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()
    tally.body_runs[(ctx.input.key, "before-sleep")] += 1
    await ctx.step.run("before", lambda: None)
    await ctx.step.sleep("nap", timedelta(milliseconds=ctx.input.n or 300))
    tally.body_runs[(ctx.input.key, "after-sleep")] += 1
    return "rested"


@task("contract.wait_or_timeout", version=1)
async def wait_or_timeout_task(ctx: TaskContext[Job]) -> str:
    try:
        await ctx.step.wait_for_fact("never", timeout=timedelta(milliseconds=400))
    except FactTimeoutError:
        return "timed out"
    return "got it"


@task("contract.checked", version=1)
async def checked_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()

    def approved_in_db() -> str | None:
        value: str | None = tally.business.get(ctx.input.key)
        return value

    value: str = await ctx.step.wait_for_fact(
        "approved", check=approved_in_db, poll_interval=timedelta(milliseconds=200)
    )
    return value


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    sleeper_task,
    wait_or_timeout_task,
    checked_task,
)
"""The tasks of this topic that the suite's engine registers."""


class FactsContract:
    """Sleeps and fact waits park the run in the store, not in a worker's slot."""

    async def test_sleep_releases_the_slot(self, engine: Engine, tally: Tally) -> None:
        one = await engine.enqueue(sleeper_task, Job(key="s1", n=500))
        two = await engine.enqueue(sleeper_task, Job(key="s2", n=500))
        async with engine.worker(concurrency=1):
            for handle in (one, two):
                await wait_until(
                    engine, handle.run_id, lambda i: i.status == "waiting", what="sleep"
                )
            assert await one.result(timeout=15) == "rested"
            assert await two.result(timeout=15) == "rested"
        assert tally.body_runs[("s1", "after-sleep")] == 1
        info = await engine.get(one.run_id)
        assert [(s.name, s.status) for s in info.timeline] == [
            ("before", "completed"),
            ("nap", "completed"),
        ]

    async def test_fact_sent_before_its_waiter_is_not_lost(self, engine: Engine) -> None:
        handle = await engine.enqueue(
            waiter_task, Job(key="approved"), delay=timedelta(milliseconds=300)
        )
        assert await engine.signal(handle.run_id, "approved", {"by": "ops"})
        async with engine.worker():
            assert await handle.result(timeout=15) == {"by": "ops"}

    async def test_first_write_wins(self, engine: Engine) -> None:
        handle = await engine.enqueue(waiter_task, Job(key="f"))
        assert await engine.signal(handle.run_id, "f", {"v": 1}) is True
        assert await engine.signal(handle.run_id, "f", {"v": 2}) is False
        async with engine.worker():
            assert await handle.result(timeout=15) == {"v": 1}

    async def test_several_runs_wait_for_one_broadcast_fact(self, engine: Engine) -> None:
        handles = [await engine.enqueue(waiter_task, Job(key="go", n=0)) for _ in range(3)]
        async with engine.worker(concurrency=1):
            for h in handles:
                await wait_until(engine, h.run_id, lambda i: i.status == "waiting", what="parked")
            assert await engine.broadcast("go", {"all": True})
            for h in handles:
                assert await h.result(timeout=15) == {"all": True}

    async def test_fact_wait_times_out_durably(self, engine: Engine) -> None:
        handle = await engine.enqueue(wait_or_timeout_task, Job(key="t"))
        async with engine.worker():
            assert await handle.result(timeout=15) == "timed out"
        info = await engine.get(handle.run_id)
        assert [(s.name, s.status) for s in info.timeline] == [("never", "completed")]

    async def test_check_reads_business_state(self, engine: Engine, tally: Tally) -> None:
        handle = await engine.enqueue(checked_task, Job(key="plan-9"))
        async with engine.worker():
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting", what="parked")
            tally.business["plan-9"] = "approved-by-alice"
            assert await handle.result(timeout=15) == "approved-by-alice"
