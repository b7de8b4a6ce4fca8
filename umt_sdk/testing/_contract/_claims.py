"""Claim order: priority first, then first in first out, within a task pair and across
pairs; a worker claims only the pairs it serves."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from umt_sdk import Engine, TaskDefinition
from umt_sdk.testing._contract._base import Job, Tally, echo_task, echo_task_v2, other_task

__all__ = ["ClaimsContract"]


TASKS: tuple[TaskDefinition[Any, Any], ...] = ()
"""None of its own: these tests run the shared echo and other tasks of `_base`."""


class ClaimsContract:
    """Which run a worker claims next, and which runs it never claims."""

    async def test_priority_first_then_fifo(self, engine: Engine, tally: Tally) -> None:
        plan = [("low-1", 0), ("high-1", 5), ("low-2", 0), ("top", 9), ("high-2", 5), ("neg", -1)]
        handles = []
        for key, priority in plan:
            handles.append(
                await engine.enqueue(echo_task, Job(key=key), priority=priority, version=1)
            )
        async with engine.worker(versions=["contract.echo@1"], concurrency=1):
            for handle in handles:
                await handle.result(timeout=15)
        assert tally.order == ["top", "high-1", "high-2", "low-1", "low-2", "neg"]

    async def test_worker_claims_only_its_pairs(self, engine: Engine, tally: Tally) -> None:
        v1 = await engine.enqueue(echo_task, Job(key="old"), version=1)
        v2 = await engine.enqueue(echo_task_v2, Job(key="new"))
        other = await engine.enqueue(other_task, Job(key="o"))
        async with engine.worker(versions=["contract.echo@2"]):
            await v2.result(timeout=15)
            await asyncio.sleep(0.3)
        assert tally.order == ["v2:new"]
        for handle in (v1, other):
            info = await engine.get(handle.run_id)
            assert info.status == "pending", "an unserved pair waits without failing"
            assert info.attempts == 0
            assert info.failures == 0
        async with engine.worker(versions=["contract.echo@1", "contract.other@1"]):
            await v1.result(timeout=15)
            await other.result(timeout=15)
        assert sorted(tally.order) == ["old", "other:o", "v2:new"]

    async def test_one_slot_goes_by_priority_across_pairs(
        self, engine: Engine, tally: Tally
    ) -> None:
        # contract.echo@1 is served (and listed) before contract.other@1; its runs are newer
        # and of lower priority, so with one slot every run of the other pair goes first.
        others = [await engine.enqueue(other_task, Job(key=f"b{i}"), priority=0) for i in range(4)]
        echoes = [
            await engine.enqueue(echo_task, Job(key=f"a{i}"), priority=-5, version=1)
            for i in range(4)
        ]
        runs: list[Any] = [*others, *echoes]
        async with engine.worker(versions=["contract.echo@1", "contract.other@1"], concurrency=1):
            for run in runs:
                await run.result(timeout=15)
        assert tally.order == [
            "other:b0",
            "other:b1",
            "other:b2",
            "other:b3",
            "a0",
            "a1",
            "a2",
            "a3",
        ]

    async def test_one_slot_is_fifo_across_pairs_at_equal_priority(
        self, engine: Engine, tally: Tally
    ) -> None:
        handles: list[Any] = []
        for i in range(3):
            handles.append(await engine.enqueue(other_task, Job(key=f"b{i}")))
            handles.append(await engine.enqueue(echo_task, Job(key=f"a{i}"), version=1))
        async with engine.worker(versions=["contract.echo@1", "contract.other@1"], concurrency=1):
            for handle in handles:
                await handle.result(timeout=15)
        assert tally.order == ["other:b0", "a0", "other:b1", "a1", "other:b2", "a2"]

    async def test_a_batch_shares_slots_across_pairs_by_turns(self, engine: Engine) -> None:
        # Turn 1 holds each pair's best run, turn 2 each pair's second best, ...: a busy pair
        # with higher priorities does not take the whole batch; within a turn priority leads.
        busy = [await engine.enqueue(other_task, Job(key=f"b{i}"), priority=9) for i in range(6)]
        quiet = [await engine.enqueue(echo_task, Job(key=f"a{i}"), version=1) for i in range(2)]
        worker = engine.worker(versions=["contract.echo@1", "contract.other@1"], concurrency=3)
        claimed = await worker.backend.claim(
            worker_id="probe", pairs=worker.pairs, limit=3, lease=timedelta(seconds=30)
        )
        taken = {c.run_id for c in claimed}
        assert taken == {busy[0].run_id, busy[1].run_id, quiet[0].run_id}, claimed
