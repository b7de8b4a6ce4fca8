"""Cancel: a waiting run ends at once, a running one is told through its abort signal and
ends at the handler's next step, a stored cancel is never lost to a park or a crash."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import CanceledError, Engine, RunCanceledError, TaskContext, TaskDefinition, task
from umt_sdk._spi import Ending, Lease, StepRecord
from umt_sdk.exceptions import FencingError
from umt_sdk.testing._contract._base import (
    Job,
    Tally,
    current_tally,
    eventually,
    holds,
    steps_task,
    wait_until,
    waiter_task,
)
from umt_sdk.testing._helpers import BackendHarness, freeze_heartbeats, simulate_crash

__all__ = ["CancelContract"]


@task("contract.gated_waiter", version=1)
async def gated_waiter_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()

    async def gated() -> None:
        tally.gate(ctx.input.key + ":in").set()
        await tally.gate(ctx.input.key).wait()

    await ctx.step.run("gated", gated)
    try:
        await ctx.step.wait_for_fact(ctx.input.key + ":never-sent")
    except CanceledError:
        tally.body_runs[(ctx.input.key, "saw-cancel")] += 1
        raise
    return "woken"


@task("contract.cancellable", version=1)
async def cancellable_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()
    await ctx.step.run("started", lambda: None)

    async def wait_for_abort() -> None:
        tally.body_runs[(ctx.input.key, "waiting")] += 1
        tally.gate(ctx.input.key + ":started").set()
        await asyncio.wait_for(ctx.abort_event.wait(), timeout=20)
        if ctx.input.n == 1:
            raise ValueError("cleanup failed while stopping")
        ctx.throw_if_canceled()

    await ctx.step.run("long", wait_for_abort)
    tally.body_runs[(ctx.input.key, "after")] += 1
    await ctx.step.run("after", lambda: None)
    return "not canceled"


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    gated_waiter_task,
    cancellable_task,
)
"""The tasks of this topic that the suite's engine registers."""


class CancelContract:
    """A cancel reaches the run wherever it is: parked, running, or held by a dead worker."""

    async def test_cancel_waiting_run_ends_it_at_once(self, engine: Engine) -> None:
        handle = await engine.enqueue(waiter_task, Job(key="never-sent"))
        async with engine.worker():
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting", what="parked")
            assert await engine.cancel(handle.run_id, reason="user asked") == "canceled"
            with pytest.raises(RunCanceledError) as caught:
                await handle.result(timeout=5)
        assert caught.value.reason == "user asked"
        assert await engine.cancel(handle.run_id, reason="again") == "already_finished"

    async def test_cancel_running_fires_abort_and_stops_later_steps(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(cancellable_task, Job(key="c1"))
        async with engine.worker():
            await asyncio.wait_for(tally.gate("c1:started").wait(), 15)
            started = time.monotonic()
            assert await engine.cancel(handle.run_id, reason="stop it") == "requested"
            with pytest.raises(RunCanceledError):
                await handle.result(timeout=15)
            assert time.monotonic() - started < 2.0, "abort must fire within about a second"
        assert tally.body_runs[("c1", "after")] == 0
        info = await engine.get(handle.run_id)
        assert info.status == "canceled"
        assert info.cancel_reason == "stop it"
        assert [s.name for s in info.timeline if s.status == "completed"] == ["started"]

    async def test_a_run_whose_cancel_was_requested_is_never_parked(
        self, engine: Engine, tally: Tally
    ) -> None:
        """The store refuses to hand back a run whose cancel was requested (the heartbeat
        that would have told the worker may not have come yet): the cancel reaches the
        handler at the wait instead, and the run ends canceled rather than waiting forever."""
        handle = await engine.enqueue(gated_waiter_task, Job(key="cp"))
        async with engine.worker() as worker:
            await asyncio.wait_for(tally.gate("cp:in").wait(), 15)
            freeze_heartbeats(worker)  # the cancel is stored, and no heartbeat reports it
            assert await engine.cancel(handle.run_id, reason="no more") == "requested"
            tally.gate("cp").set()
            with pytest.raises(RunCanceledError) as caught:
                await handle.result(timeout=15)
        assert caught.value.reason == "no more"
        assert tally.body_runs[("cp", "saw-cancel")] == 1, "the handler saw the cancel at the wait"
        info = await engine.get(handle.run_id)
        assert [e.outcome for e in info.executions] == ["canceled"]

    async def test_a_cancel_its_crashed_holder_never_saw_ends_the_run_at_the_next_claim(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        tally.gate("cc")
        handle = await engine.enqueue(steps_task, Job(key="cc"))
        worker_a = engine.worker(concurrency=1, lease=harness.lease)
        await worker_a.start()
        await eventually(lambda: holds(tally.body_runs[("cc", "second")] == 1))
        simulate_crash(worker_a)
        await worker_a.stop()
        assert await engine.cancel(handle.run_id, reason="while it was down") == "requested"
        await harness.advance(harness.lease * 2)
        tally.gates["cc"].set()
        async with engine.worker(concurrency=1, lease=harness.lease):
            with pytest.raises(RunCanceledError) as caught:
                await handle.result(timeout=20)
        assert caught.value.reason == "while it was down"
        assert tally.body_runs[("cc", "second")] == 1, "the handler does not start again"
        info = await engine.get(handle.run_id)
        assert [e.outcome for e in info.executions] == ["interrupted", "canceled"]
        assert info.lease_expirations == 1

    async def test_end_execution_refusals_change_nothing(self, engine: Engine) -> None:
        """`end_execution` refuses a park onto a fact already stored and any hand-back of a
        run whose cancel was requested, and stores nothing then; a finishing ending lands."""
        handle = await engine.enqueue(waiter_task, Job(key="refusals"))
        [claimed] = await engine.backend.claim(
            worker_id="w", pairs=[waiter_task.pair], limit=1, lease=timedelta(seconds=30)
        )
        lease = Lease(
            run_id=handle.run_id,
            fencing_token=claimed.fencing_token,
            worker_id="w",
            duration=timedelta(seconds=30),
        )
        waiting = StepRecord(name="refusals", kind="fact", status="waiting")
        await engine.signal(handle.run_id, "refusals", {"early": True})
        park = Ending(status="waiting", outcome="waiting", wait_for="refusals", step=waiting)
        assert await engine.backend.end_execution(lease, park) == "fact_present"
        assert await engine.cancel(handle.run_id, reason="stop") == "requested"
        elsewhere = Ending(status="waiting", outcome="waiting", wait_for="other", step=waiting)
        retry = Ending(status="pending", outcome="retrying", count_failure=True)
        for ending in (elsewhere, retry, Ending(status="pending", outcome="released")):
            assert await engine.backend.end_execution(lease, ending) == "cancel_requested"
        record = await engine.backend.get_run(handle.run_id)
        assert record is not None
        assert (record.status, record.failures, tuple(record.steps)) == ("running", 0, ())
        assert record.fencing_token == claimed.fencing_token
        canceled = Ending(status="canceled", outcome="canceled")
        assert await engine.backend.end_execution(lease, canceled) == "ended"
        info = await engine.get(handle.run_id)
        assert (info.status, [e.outcome for e in info.executions]) == ("canceled", ["canceled"])
        with pytest.raises(FencingError):
            await engine.backend.end_execution(lease, canceled)

    async def test_errors_of_a_canceled_handler_are_recorded(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(cancellable_task, Job(key="c2", n=1))
        async with engine.worker():
            await asyncio.wait_for(tally.gate("c2:started").wait(), 15)
            await engine.cancel(handle.run_id, reason="stop")
            with pytest.raises(RunCanceledError):
                await handle.result(timeout=15)
        info = await engine.get(handle.run_id)
        assert info.status == "canceled"
        assert info.error is not None
        assert "cleanup failed while stopping" in info.error.message
