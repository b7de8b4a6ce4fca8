"""The timeline of runs that did not end well: canceled, failed, cut off by a crash, with
an expired lease."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import Engine, Registry, RunCanceledError, RunFailedError, TaskDefinition
from umt_sdk.testing._contract._base import Job, Tally, eventually, holds, steps_task, wait_until
from umt_sdk.testing._contract._cancel import cancellable_task
from umt_sdk.testing._contract._replay import shape_a, shape_b
from umt_sdk.testing._helpers import BackendHarness, freeze_heartbeats, simulate_crash

__all__ = ["TimelineContract"]


TASKS: tuple[TaskDefinition[Any, Any], ...] = ()
"""None of its own: the timeline tests run the tasks of other topics."""


class TimelineContract:
    """Every step of the timeline ends in a status that says what became of it."""

    async def test_a_canceled_run_shows_the_step_the_cancel_stopped(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(cancellable_task, Job(key="tc"))
        async with engine.worker():
            await asyncio.wait_for(tally.gate("tc:started").wait(), 15)
            await engine.cancel(handle.run_id, reason="stop it")
            with pytest.raises(RunCanceledError):
                await handle.result(timeout=15)
        info = await engine.get(handle.run_id)
        assert [(v.name, v.status) for v in info.timeline] == [
            ("started", "completed"),
            ("long", "canceled"),
        ]
        long = info.timeline[1]
        assert long.fencing_token == info.executions[-1].fencing_token
        assert long.started_at is not None
        assert not long.inferred

    async def test_a_failed_run_leaves_no_step_waiting(self, engine: Engine) -> None:
        original = Engine(engine.backend, Registry([shape_a]))
        handle = await original.enqueue(shape_a, Job(key="nd2"))
        async with original.worker():
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting", what="waiting")
        assert [(v.name, v.status) for v in (await engine.get(handle.run_id)).timeline] == [
            ("x", "completed"),
            ("go", "waiting"),
        ]
        changed = Engine(engine.backend, Registry([shape_b]))
        await engine.signal(handle.run_id, "go")
        async with changed.worker():
            with pytest.raises(RunFailedError) as caught:
                await changed.result(handle.run_id, timeout=15)
        assert caught.value.error_type.endswith("NonDeterminismError")
        info = await engine.get(handle.run_id)
        assert [(v.name, v.status) for v in info.timeline] == [
            ("x", "completed"),
            ("go", "abandoned"),
        ]

    async def test_a_step_cut_off_before_any_heartbeat_shows_as_interrupted(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        tally.gate("nb")
        handle = await engine.enqueue(steps_task, Job(key="nb"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        freeze_heartbeats(stale)  # not one heartbeat: nothing ever names the step
        await stale.start()
        await eventually(lambda: holds(tally.body_runs[("nb", "second")] == 1))
        simulate_crash(stale)
        await stale.stop()
        await harness.advance(harness.lease * 2)
        tally.gates["nb"].set()
        async with engine.worker(concurrency=1, lease=harness.lease):
            assert await handle.result(timeout=20) == 6
        info = await engine.get(handle.run_id)
        first_token, second_token = (e.fencing_token for e in info.executions)
        assert [(v.name, v.status, v.fencing_token) for v in info.timeline] == [
            ("first", "completed", first_token),
            ("second", "interrupted", first_token),
            ("second", "completed", second_token),
            ("third", "completed", second_token),
        ]
        cut = info.timeline[1]
        assert cut.inferred, "no heartbeat named it: inferred from the next attempt"
        assert cut.started_at is None
        assert cut.attempt == 1

    async def test_a_step_is_named_by_a_prompt_heartbeat(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        tally.gate("pb")
        handle = await engine.enqueue(steps_task, Job(key="pb"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        stale.heartbeat_interval = timedelta(hours=1)  # no regular beat during this test
        await stale.start()
        await wait_until(
            engine,
            handle.run_id,
            lambda i: bool(i.executions) and i.executions[-1].current_step == "second",
            what="a heartbeat that names the running step",
        )
        simulate_crash(stale)
        await stale.stop()
        await harness.advance(harness.lease * 2)
        tally.gates["pb"].set()
        async with engine.worker(concurrency=1, lease=harness.lease):
            assert await handle.result(timeout=20) == 6
        info = await engine.get(handle.run_id)
        cut = [v for v in info.timeline if v.status == "interrupted"]
        assert [(v.name, v.inferred) for v in cut] == [("second", False)]
        assert cut[0].started_at is not None

    async def test_an_expired_lease_reads_lease_expired(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        tally.gate("le")
        handle = await engine.enqueue(steps_task, Job(key="le"))
        pending = await engine.get(handle.run_id)
        assert (pending.lease_expired, pending.display_status) == (False, "pending")
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await eventually(lambda: holds(tally.body_runs[("le", "second")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        info = await engine.get(handle.run_id)
        assert info.status == "running", "the data model keeps the stored status"
        assert info.lease_expired
        assert info.display_status == "running (lease expired)"
        assert info.lease_expires_at is not None
        listed = [r for r in await engine.list() if r.run_id == handle.run_id]
        assert [r.display_status for r in listed] == ["running (lease expired)"]
        simulate_crash(stale)
        await stale.stop()
        tally.gates["le"].set()
        async with engine.worker(concurrency=1, lease=harness.lease):
            assert await handle.result(timeout=20) == 6
        done = await engine.get(handle.run_id)
        assert (done.lease_expired, done.display_status) == (False, "completed")
