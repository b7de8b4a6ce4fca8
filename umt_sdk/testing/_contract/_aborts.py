"""The abort table: how each handler shape ends under each abort (a worker's graceful
shutdown, the run's cancel, both at once, a crash of the worker, a lease lost to another
worker)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest

from umt_sdk import (
    CanceledError,
    Engine,
    RunCanceledError,
    RunInfo,
    SyncTaskContext,
    TaskContext,
    TaskDefinition,
    task,
)
from umt_sdk.testing._contract._base import Job, Tally, current_tally, eventually, holds
from umt_sdk.testing._helpers import BackendHarness, freeze_heartbeats, simulate_crash

__all__ = ["AbortsContract"]


ABORT_SHAPES = ("ignores", "throws", "catches", "sync")
"""ignores: waits for its go-ahead without looking at the abort; throws: awaits the abort
signal (or the go-ahead), then calls throw_if_canceled(); catches: the same, but catches
CanceledError and returns; sync: a plain handler that polls throw_if_canceled()."""


async def _abort_or_go(ctx: TaskContext[Job]) -> None:
    tally = current_tally()
    go = asyncio.ensure_future(tally.gate(f"{ctx.input.key}:go").wait())
    abort = asyncio.ensure_future(ctx.abort_event.wait())
    try:
        await asyncio.wait({go, abort}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        go.cancel()
        abort.cancel()


@task("contract.aborts", version=1)
async def aborts_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()
    key, shape = ctx.input.key, ABORT_SHAPES[ctx.input.n]

    def body(name: str) -> str:
        tally.body_runs[(key, name)] += 1
        return name

    await ctx.step.run("a", body, "a")
    tally.gate(f"{key}:in").set()
    if shape == "ignores":
        await tally.gate(f"{key}:go").wait()
    else:
        await _abort_or_go(ctx)
        if shape == "catches":
            try:
                ctx.throw_if_canceled()
            except CanceledError:
                return "caught"
        else:
            ctx.throw_if_canceled()
    await ctx.step.run("b", body, "b")
    return "done"


@task("contract.aborts_sync", version=1)
def aborts_sync_task(ctx: SyncTaskContext[Job]) -> str:
    tally = current_tally()
    key = ctx.input.key

    def body(name: str) -> str:
        tally.body_runs[(key, name)] += 1
        return name

    ctx.step.run("a", body, "a")
    tally.business[f"{key}:in"] = True
    while not tally.business.get(f"{key}:go"):
        ctx.throw_if_canceled()
        time.sleep(0.01)
    ctx.step.run("b", body, "b")
    return "done"


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    aborts_task,
    aborts_sync_task,
)
"""The tasks of this topic that the suite's engine registers."""


class AbortsContract:
    """A shutdown hands the run back uncharged whatever the handler does with the abort; a cancel
    ends it as the handler answers it."""

    async def _start_abort_shape(self, engine: Engine, key: str, shape: str) -> UUID:
        if shape == "sync":
            handle = await engine.enqueue(aborts_sync_task, Job(key=key))
        else:
            handle = await engine.enqueue(aborts_task, Job(key=key, n=ABORT_SHAPES.index(shape)))
        return handle.run_id

    async def _inside(self, tally: Tally, key: str, shape: str) -> None:
        if shape == "sync":
            await eventually(lambda: holds(bool(tally.business.get(f"{key}:in"))))
        else:
            await asyncio.wait_for(tally.gate(f"{key}:in").wait(), 15)

    def _go(self, tally: Tally, key: str) -> None:
        tally.gate(f"{key}:go").set()
        tally.business[f"{key}:go"] = True

    @pytest.mark.parametrize("shape", ABORT_SHAPES)
    async def test_a_worker_shutting_down_hands_the_run_back_uncharged(
        self, engine: Engine, tally: Tally, shape: str
    ) -> None:
        """A deploy: the worker stops gracefully while a handler is between steps. Whatever the
        handler does with the abort signal, the run is released (never failed, never charged
        a failure), and the next worker finishes it without running a completed step again."""
        key = f"shutdown-{shape}"
        run_id = await self._start_abort_shape(engine, key, shape)
        async with engine.worker(shutdown_grace=timedelta(milliseconds=300)):
            await self._inside(tally, key, shape)
        info = await engine.get(run_id)
        assert info.status == "pending", (shape, info.status, info.error)
        assert info.failures == 0
        assert [e.outcome for e in info.executions] == ["released"]
        self._go(tally, key)
        async with engine.worker():
            assert await engine.result(run_id, timeout=15) == "done"
        info = await engine.get(run_id)
        assert (info.status, info.failures) == ("completed", 0)
        assert [e.outcome for e in info.executions] == ["released", "completed"]
        assert tally.body_runs[(key, "a")] == 1
        assert tally.body_runs[(key, "b")] == 1

    @pytest.mark.parametrize("shape", ["throws", "catches", "sync"])
    async def test_a_cancel_ends_the_run_as_the_handler_answers_it(
        self, engine: Engine, tally: Tally, shape: str
    ) -> None:
        """The run's cancel: a handler that lets `CanceledError` out ends canceled, one that
        catches it and returns completes with what it returned."""
        key = f"cancel-{shape}"
        run_id = await self._start_abort_shape(engine, key, shape)
        async with engine.worker():
            await self._inside(tally, key, shape)
            assert await engine.cancel(run_id, reason="no longer wanted") == "requested"
            if shape == "catches":
                assert await engine.result(run_id, timeout=15) == "caught"
            else:
                with pytest.raises(RunCanceledError) as caught:
                    await engine.result(run_id, timeout=15)
                assert caught.value.reason == "no longer wanted"
        info = await engine.get(run_id)
        assert info.status == ("completed" if shape == "catches" else "canceled")
        assert info.failures == 0
        assert info.error is None
        assert tally.body_runs[(key, "b")] == 0

    async def test_a_cancel_during_a_shutdown_ends_the_run_canceled(
        self, engine: Engine, tally: Tally
    ) -> None:
        """Both at once: the cancel wins; the run is not handed back to be started again."""
        key = "cancel-and-shutdown"
        run_id = await self._start_abort_shape(engine, key, "ignores")
        async with engine.worker(shutdown_grace=timedelta(milliseconds=300)):
            await self._inside(tally, key, "ignores")
            assert await engine.cancel(run_id, reason="both") == "requested"
        info = await engine.get(run_id)
        assert info.status == "canceled", (info.status, info.error)
        assert info.failures == 0

    @pytest.mark.parametrize("shape", ABORT_SHAPES)
    async def test_a_crash_stops_the_handler_without_writes_and_the_next_worker_finishes(
        self, engine: Engine, tally: Tally, harness: BackendHarness, shape: str
    ) -> None:
        """A worker killed between two steps: whatever the handler does, its execution writes
        nothing more (no step `b`, no ending); after the lease the next worker replays `a` and
        finishes the run, uncharged."""
        key = f"crash-{shape}"
        run_id = await self._start_abort_shape(engine, key, shape)
        crashed = engine.worker(concurrency=1, lease=harness.lease)
        await crashed.start()
        await self._inside(tally, key, shape)
        simulate_crash(crashed)
        self._go(tally, key)  # the handler may go on: nothing it does may be written
        await crashed.stop()
        info = await engine.get(run_id)
        assert info.status == "running", (shape, info.status)
        assert _completed_steps(info) == ["a"], "the crashed execution wrote no step after `a`"
        await harness.advance(harness.lease * 2)
        async with engine.worker(concurrency=1, lease=harness.lease):
            assert await engine.result(run_id, timeout=20) == "done"
        info = await engine.get(run_id)
        assert (info.status, info.failures, info.lease_expirations) == ("completed", 0, 1)
        assert [e.outcome for e in info.executions] == ["interrupted", "completed"]
        assert tally.body_runs[(key, "a")] == 1, "a completed step never runs again"
        assert _completed_steps(info) == ["a", "b"]

    @pytest.mark.parametrize("shape", ABORT_SHAPES)
    async def test_a_lost_lease_stops_the_stale_handler_and_the_new_holder_finishes(
        self, engine: Engine, tally: Tally, harness: BackendHarness, shape: str
    ) -> None:
        """A worker whose heartbeats stopped (frozen, cut off) loses the run to another worker:
        its handler's next step is refused, it ends nothing, and the new holder finishes the run
        without a failure charged."""
        key = f"lost-{shape}"
        run_id = await self._start_abort_shape(engine, key, shape)
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await self._inside(tally, key, shape)
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        async with engine.worker(concurrency=1, lease=harness.lease):
            await eventually(lambda: _executions_at_least(engine, run_id, 2), timeout=20)
            self._go(tally, key)
            assert await engine.result(run_id, timeout=20) == "done"
            await eventually(lambda: holds(not stale.running_runs), timeout=20)
        await stale.stop()
        info = await engine.get(run_id)
        assert (info.status, info.failures) == ("completed", 0)
        assert [e.outcome for e in info.executions] == ["interrupted", "completed"]
        assert _completed_steps(info) == ["a", "b"], "the stale handler wrote no step"
        assert info.output_json == '"done"'


def _completed_steps(info: RunInfo) -> list[str]:
    return [v.name for v in info.timeline if v.status == "completed"]


async def _executions_at_least(engine: Engine, run_id: UUID, n: int) -> bool:
    return len((await engine.get(run_id)).executions) >= n
