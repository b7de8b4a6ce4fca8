"""Leases and fencing: an expired lease is taken over under a larger fencing token and every
write of the stale attempt is refused; a run that keeps losing its lease without progress
fails with the reason."""

from __future__ import annotations

from typing import Any

import pytest

from umt_sdk import Engine, ErrorInfo, Registry, RunFailedError, TaskContext, TaskDefinition, task
from umt_sdk._spi import Ending, Lease, StepRecord
from umt_sdk.exceptions import FencingError
from umt_sdk.testing._contract._base import (
    Job,
    Tally,
    counted,
    current_tally,
    eventually,
    heartbeat_names,
    holds,
    steps_task,
)
from umt_sdk.testing._helpers import BackendHarness, freeze_heartbeats, simulate_crash

__all__ = ["LeasesContract"]


@task("contract.dies", version=1, max_lost_leases=3)
async def dies_task(ctx: TaskContext[Job]) -> str:
    """Its worker dies inside `doomed` every time (the test crashes it there)."""
    tally = current_tally()
    await ctx.step.run("before", lambda: None)

    async def doomed() -> str:
        tally.body_runs[(ctx.input.key, "doomed")] += 1
        await tally.gate(f"{ctx.input.key}:never").wait()
        return "survived"

    value: str = await ctx.step.run("doomed", doomed)
    return value


@task("contract.inching", version=1, max_lost_leases=2)
async def inching_task(ctx: TaskContext[Job]) -> list[str]:
    """Each execution records one more step, then its worker dies in the next one."""
    tally = current_tally()
    key = ctx.input.key

    async def part(name: str) -> str:
        tally.body_runs[(key, name)] += 1
        if name != "p1" and tally.body_runs[(key, name)] == 1:
            tally.body_runs[(key, "dying")] += 1
            await tally.gate(f"{key}:never").wait()
        return name

    return [await ctx.step.run(name, part, name) for name in ("p1", "p2", "p3", "p4")]


TASKS: tuple[TaskDefinition[Any, Any], ...] = ()
"""None registered with the suite's engine: the dying tasks run on engines of their own."""


class LeasesContract:
    """Only the holder of the newest lease writes; a dead holder's run is taken over."""

    async def test_lease_expiry_takeover_rejects_the_stale_attempt(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        tally.gate("l1")
        handle = await engine.enqueue(steps_task, Job(key="l1"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await eventually(lambda: holds(tally.body_runs[("l1", "second")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        stale_execution = stale._executions[handle.run_id]
        async with engine.worker(concurrency=1, lease=harness.lease) as fresh:
            await eventually(lambda: holds(tally.body_runs[("l1", "second")] == 2))
            # The fresh attempt holds the run (inside `second`): the stale attempt's writes are
            # refused, whatever they are, and leave nothing behind.
            held = await engine.get(handle.run_id)
            stale_token, fresh_token = (e.fencing_token for e in held.executions)
            assert fresh_token > stale_token, "a takeover gets a new, larger fencing token"
            stale_lease = Lease(
                run_id=handle.run_id,
                fencing_token=stale_token,
                worker_id=stale.worker_id,
                duration=harness.lease,
            )
            with pytest.raises(FencingError):
                await engine.backend.record_step(
                    stale_lease,
                    StepRecord(
                        name="second",
                        kind="step",
                        status="completed",
                        fencing_token=stale_token,
                        output_json="2",
                    ),
                )
            with pytest.raises(FencingError):
                await engine.backend.end_execution(
                    stale_lease, Ending(status="completed", outcome="completed", output_json="0")
                )
            with pytest.raises(FencingError):
                await engine.backend.end_execution(
                    stale_lease,
                    Ending(
                        status="failed",
                        outcome="failed",
                        error=ErrorInfo(type="Stale", message="stale"),
                        count_failure=True,
                    ),
                )
            record = await engine.backend.get_run(handle.run_id)
            assert record is not None
            assert record.status == "running"
            assert record.fencing_token == fresh_token
            assert [(s.name, s.fencing_token) for s in record.steps] == [("first", stale_token)]
            tally.gates["l1"].set()  # both attempts proceed; only the holder may record
            assert await handle.result(timeout=20) == 6
            await eventually(lambda: holds(not stale.running_runs))
            del fresh
        await stale.stop()
        assert stale_execution.abort_kind == "lease_lost", "the stale attempt's write was refused"
        info = await engine.get(handle.run_id)
        tokens = {
            s.fencing_token for s in info.timeline if s.name == "second" and s.status == "completed"
        }
        assert len(tokens) == 1
        assert max(e.fencing_token for e in info.executions) in tokens
        assert [e.outcome for e in info.executions] == ["interrupted", "completed"]
        record = await engine.backend.get_run(handle.run_id)
        assert record is not None
        assert {s.name: s.fencing_token for s in record.steps} == {
            "first": stale_token,
            "second": fresh_token,
            "third": fresh_token,
        }, "no step record under the stale token after the takeover"

    async def test_a_run_that_keeps_losing_its_lease_fails_with_the_reason(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        dying = Engine(engine.backend, Registry([dies_task]))
        handle = await dying.enqueue(dies_task, Job(key="d1"))
        for lost in range(1, dies_task.max_lost_leases + 1):
            worker = dying.worker(concurrency=1, lease=harness.lease)
            await worker.start()
            await eventually(counted(tally, ("d1", "doomed"), lost))
            await eventually(heartbeat_names(engine, handle.run_id, "doomed"))
            simulate_crash(worker)  # the worker dies in `doomed`, every time
            await worker.stop()
            await harness.advance(harness.lease * 2)
        async with dying.worker(concurrency=1, lease=harness.lease):
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=20)
        assert caught.value.error_type == "umt_sdk.LeaseLostTooOftenError"
        message = caught.value.error_message
        assert "lost its lease 3 times without recording a step" in message, message
        assert "'doomed'" in message, message
        assert "max_lost_leases=3" in message, message
        assert tally.body_runs[("d1", "doomed")] == 3, (
            "the claim after the third loss does not run it"
        )
        info = await engine.get(handle.run_id)
        assert info.status == "failed"
        assert info.lease_expirations == 3
        assert info.attempts == 4
        assert info.failures == 1
        assert [e.outcome for e in info.executions] == ["interrupted"] * 3 + ["failed"]
        assert info.error is not None
        assert info.error.type == caught.value.error_type

    async def test_lost_leases_count_since_the_last_step_record(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        inching = Engine(engine.backend, Registry([inching_task]))
        handle = await inching.enqueue(inching_task, Job(key="in"))
        for died in range(1, 4):  # more losses in all than max_lost_leases=2, one per step
            worker = inching.worker(concurrency=1, lease=harness.lease)
            await worker.start()
            await eventually(counted(tally, ("in", "dying"), died))
            simulate_crash(worker)
            await worker.stop()
            await harness.advance(harness.lease * 2)
        async with inching.worker(concurrency=1, lease=harness.lease):
            assert await handle.result(timeout=20) == ["p1", "p2", "p3", "p4"]
        info = await engine.get(handle.run_id)
        assert info.lease_expirations == 3, "each execution made progress before it died"
        assert info.failures == 0
