"""The ledger behind `with_attempt_token`: a fenced side effect commits once, a stale
attempt is refused before its commit callback runs, and a commit frozen mid-way holds up
neither the takeover nor a cancel."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import UUID

import pytest

from umt_sdk import AttemptInfo, Engine, TaskContext, TaskDefinition, task, with_attempt_token
from umt_sdk._spi import Lease
from umt_sdk.exceptions import FencingError
from umt_sdk.testing._contract._base import Job, Tally, current_tally, eventually, holds
from umt_sdk.testing._helpers import BackendHarness, freeze_heartbeats

__all__ = ["LedgerContract"]


@task("contract.fenced", version=1)
async def fenced_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()
    harness = tally.harness

    async def submit() -> str:
        async def act(info: AttemptInfo) -> str:
            tally.business.setdefault("resumed", []).append(info.resumed)
            tally.body_runs[(ctx.input.key, "act")] += 1
            gate = tally.gates.get(f"{ctx.input.key}:attempt{ctx.attempt}")
            if gate is not None:
                await gate.wait()
            return f"receipt-{info.attempt_token}"

        async def commit(tx: Any, receipt: str) -> None:
            tally.business.setdefault("commits", []).append(ctx.attempt_token)
            tally.body_runs[(ctx.input.key, "precommit")] += 1
            gate = tally.gates.get(f"{ctx.input.key}:precommit{ctx.attempt}")
            if gate is not None:  # frozen inside the commit, before its business write
                await gate.wait()
            await harness.business_insert(tx, ctx.input.key, receipt)
            tally.body_runs[(ctx.input.key, "commit")] += 1
            gate = tally.gates.get(f"{ctx.input.key}:commit{ctx.attempt}")
            if gate is not None:  # frozen inside the commit, its business row written
                await gate.wait()

        conn = await harness.business_connection()
        try:
            return await with_attempt_token(conn, f"submit:{ctx.input.key}", act, commit=commit)
        except FencingError:
            tally.business.setdefault("fenced", []).append(ctx.attempt_token)
            raise
        finally:
            await harness.business_release(conn)

    receipt: str = await ctx.step.run("submit", submit)
    return receipt


async def _assert_ledger_refuses(
    engine: Engine, harness: BackendHarness, op_key: str, run_id: UUID, stale_token: int
) -> None:
    """The ledger refuses a stale attempt directly: no begin, no commit, the callback uncalled."""
    stale_lease = Lease(
        run_id=run_id, fencing_token=stale_token, worker_id="stale", duration=harness.lease
    )
    called: list[Any] = []

    async def commit(tx: Any) -> None:
        called.append(tx)

    conn = await harness.business_connection()
    try:
        ledger = engine.backend.ledger(conn)
        with pytest.raises(FencingError):
            await ledger.finish(
                op_key=op_key, lease=stale_lease, result_json='"stale"', commit=commit
            )
        assert called == [], "fence first: a stale attempt's commit callback never runs"
        with pytest.raises(FencingError):
            await ledger.begin(op_key=op_key, lease=stale_lease)
    finally:
        await harness.business_release(conn)


TASKS: tuple[TaskDefinition[Any, Any], ...] = (fenced_task,)
"""The tasks of this topic that the suite's engine registers."""


class LedgerContract:
    """A side effect fenced by the attempt token lands once, whatever the stale attempts do."""

    async def test_fenced_side_effect_commits_once(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        tally.gate("op1:attempt1")  # the first attempt blocks inside its side effect
        handle = await engine.enqueue(fenced_task, Job(key="op1"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await eventually(lambda: holds(tally.body_runs[("op1", "act")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        async with engine.worker(concurrency=1, lease=harness.lease):
            receipt = await handle.result(timeout=20)
            stale_token, fresh_token = (
                e.fencing_token for e in (await engine.get(handle.run_id)).executions
            )
            await _assert_ledger_refuses(engine, harness, "submit:op1", handle.run_id, stale_token)
            tally.gates["op1:attempt1"].set()
            await eventually(lambda: holds(not stale.running_runs))
        await stale.stop()
        info = await engine.get(handle.run_id)
        rows = await harness.business_rows()
        assert rows == {"op1": receipt}, f"business rows: {rows}"
        assert tally.business["resumed"] == [False, True], "the takeover sees the earlier start"
        assert receipt == f"receipt-{info.executions[-1].fencing_token}"
        assert [e.outcome for e in info.executions] == ["interrupted", "completed"]
        assert tally.business["fenced"] == [stale_token], (
            "the stale attempt's commit got FencingError"
        )
        assert tally.business["commits"] == [fresh_token], "fence first: its callback never ran"

    async def test_fenced_op_returns_the_recorded_result(
        self, engine: Engine, tally: Tally
    ) -> None:
        first_run = await engine.enqueue(fenced_task, Job(key="op2"))
        async with engine.worker():
            receipt = await first_run.result(timeout=15)
            again = await engine.enqueue(fenced_task, Job(key="op2", n=1))
            assert await again.result(timeout=15) == receipt
        assert tally.body_runs[("op2", "act")] == 1

    async def test_a_commit_frozen_in_its_callback_does_not_hold_up_the_takeover(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        tally.gate("op3:commit1")  # the first attempt freezes inside its commit, its row written
        handle = await engine.enqueue(fenced_task, Job(key="op3"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await eventually(lambda: holds(tally.body_runs[("op3", "commit")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        async with engine.worker(concurrency=1, lease=harness.lease):
            # No lock of the frozen commit holds the run: the takeover claims it and its new
            # attempt begins the operation (raising the op's token) while the old one is frozen.
            await eventually(lambda: holds(tally.body_runs[("op3", "act")] == 2))
            tally.gates["op3:commit1"].set()  # the stale commit goes on: refused, rolled back
            receipt = await handle.result(timeout=20)
            await eventually(lambda: holds(not stale.running_runs))
        await stale.stop()
        info = await engine.get(handle.run_id)
        stale_token, fresh_token = (e.fencing_token for e in info.executions)
        assert receipt == f"receipt-{fresh_token}"
        assert await harness.business_rows() == {"op3": receipt}
        assert tally.business["fenced"] == [stale_token]
        assert tally.business["commits"] == [stale_token, fresh_token]
        assert tally.business["resumed"] == [False, True]
        assert [e.outcome for e in info.executions] == ["interrupted", "completed"]

    async def test_a_stale_commit_after_a_newer_attempt_began_is_refused_before_its_callback(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        tally.gate("op5:attempt1")  # the first attempt blocks inside its action
        tally.gate("op5:attempt2")  # the takeover too, once it has begun the operation
        handle = await engine.enqueue(fenced_task, Job(key="op5"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await eventually(lambda: holds(tally.body_runs[("op5", "act")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        async with engine.worker(concurrency=1, lease=harness.lease):
            await eventually(lambda: holds(tally.body_runs[("op5", "act")] == 2))
            tally.gates["op5:attempt1"].set()  # the stale attempt tries to commit: refused
            await eventually(lambda: holds(not stale.running_runs))
            assert tally.business.get("commits", []) == [], "fence first: its callback never ran"
            assert await harness.business_rows() == {}
            tally.gates["op5:attempt2"].set()
            receipt = await handle.result(timeout=20)
        await stale.stop()
        info = await engine.get(handle.run_id)
        stale_token, fresh_token = (e.fencing_token for e in info.executions)
        assert tally.business["fenced"] == [stale_token]
        assert tally.business["commits"] == [fresh_token]
        assert await harness.business_rows() == {"op5": receipt}
        assert receipt == f"receipt-{fresh_token}"

    async def test_a_stale_callback_that_fails_on_the_newer_commit_raises_fencing_error(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        tally.gate("op6:precommit1")  # fenced in, then frozen before its insert
        handle = await engine.enqueue(fenced_task, Job(key="op6"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await eventually(lambda: holds(tally.body_runs[("op6", "precommit")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        async with engine.worker(concurrency=1, lease=harness.lease):
            receipt = await handle.result(timeout=20)  # the newer attempt's row is committed
            tally.gates["op6:precommit1"].set()  # the stale insert hits its unique key
            await eventually(lambda: holds(not stale.running_runs))
        await stale.stop()
        info = await engine.get(handle.run_id)
        stale_token = info.executions[0].fencing_token
        assert tally.business["fenced"] == [stale_token], (
            "FencingError, not the duplicate-key error"
        )
        assert await harness.business_rows() == {"op6": receipt}

    async def test_cancel_is_not_held_up_by_a_frozen_commit_which_then_writes_nothing(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        tally.gate("op4:commit1")
        handle = await engine.enqueue(fenced_task, Job(key="op4"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await eventually(lambda: holds(tally.body_runs[("op4", "commit")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        outcome = await asyncio.wait_for(engine.cancel(handle.run_id, reason="operator"), 10)
        assert outcome == "canceled", "its holder is gone (lease expired): canceled at once"
        tally.gates["op4:commit1"].set()
        await eventually(lambda: holds(not stale.running_runs))
        await stale.stop()
        info = await engine.get(handle.run_id)
        assert info.status == "canceled"
        assert tally.business["fenced"] == [info.executions[0].fencing_token]
        assert await harness.business_rows() == {}, "the frozen commit landed nowhere"
