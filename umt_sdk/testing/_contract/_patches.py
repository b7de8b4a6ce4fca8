"""Patches: `ctx.patched` decides the same on every execution of a run (the marker recorded
by the first execution to reach the point on patched code; nothing for a run already past
it), `ctx.deprecate_patch` still records the marker, and a patch id used at two points is
refused with nothing stored."""

from __future__ import annotations

import json
from typing import Any

import pytest

from umt_sdk import (
    Engine,
    Registry,
    RunFailedError,
    RunHistory,
    SyncTaskContext,
    TaskContext,
    TaskDefinition,
    task,
)
from umt_sdk.testing._contract._base import Job, current_tally, wait_until
from umt_sdk.testing._replay import Replayer

__all__ = ["PatchesContract"]


def _count(key: str, what: str) -> str:
    current_tally().body_runs[(key, what)] += 1
    return what


@task("contract.fraud", version=1)
async def fraud_old(ctx: TaskContext[Job]) -> str:
    """Yesterday's code: look the order up, wait for `go` and `more`, charge."""
    key = ctx.input.key
    await ctx.step.run("lookup", _count, key, "lookup")
    await ctx.step.wait_for_fact("go")
    await ctx.step.wait_for_fact("more")
    await ctx.step.run("charge", _count, key, "charge")
    return "old"


@task("contract.fraud", version=1)
async def fraud_patched(ctx: TaskContext[Job]) -> str:
    """Today's code: a fraud check between the lookup and the waits, for new runs only. The
    decision is returned from the last execution, so it shows what a replay decided."""
    key = ctx.input.key
    await ctx.step.run("lookup", _count, key, "lookup")
    checked = await ctx.patched("new-fraud-check")
    if checked:
        await ctx.step.run("fraud-check", _count, key, "fraud-check")
    await ctx.step.wait_for_fact("go")
    await ctx.step.wait_for_fact("more")
    await ctx.step.run("charge", _count, key, "charge")
    return "new" if checked else "old"


@task("contract.fraud", version=1)
async def fraud_deprecated(ctx: TaskContext[Job]) -> str:
    """The release after: only the new branch is left."""
    key = ctx.input.key
    await ctx.step.run("lookup", _count, key, "lookup")
    await ctx.deprecate_patch("new-fraud-check")
    await ctx.step.run("fraud-check", _count, key, "fraud-check")
    await ctx.step.wait_for_fact("go")
    await ctx.step.wait_for_fact("more")
    await ctx.step.run("charge", _count, key, "charge")
    return "new"


@task("contract.fraud_plain", version=1)
def fraud_plain(ctx: SyncTaskContext[Job]) -> list[bool]:
    """A plain task asks in its thread; the same call site in a loop gets one decision."""
    return [ctx.patched("plain-patch") for _ in range(3)]


@task("contract.patch_twice", version=1)
async def patch_twice(ctx: TaskContext[Job]) -> str:
    """One patch id at two points: the second is refused."""
    if await ctx.patched("reused"):
        await ctx.step.run("first-point", _count, ctx.input.key, "first-point")
    if await ctx.patched("reused"):
        await ctx.step.run("second-point", _count, ctx.input.key, "second-point")
    return "done"


@task("contract.patch_unawaited", version=1)
async def patch_unawaited(ctx: TaskContext[Job]) -> str:
    if ctx.patched("forgot-await"):  # the mistake under test: always true if it were allowed
        return "new"
    return "old"  # pragma: no cover - never reached


TASKS: tuple[TaskDefinition[Any, Any], ...] = (fraud_plain, patch_twice, patch_unawaited)
"""Not the `contract.fraud` releases: they share a name and version on purpose, so each runs
on an engine of its own over the suite's backend."""


def _markers(history: RunHistory) -> list[tuple[str, Any]]:
    return [(s.name, s.output) for s in history.steps if s.name.startswith("umt.patch:")]


async def _park(engine: Engine, run_id: Any, fact: str) -> None:
    """Run `engine`'s worker until the run parks on the wait for `fact`."""
    async with engine.worker():
        await wait_until(
            engine,
            run_id,
            lambda i: i.status == "waiting" and any(s.name == fact for s in i.timeline),
            what=f"parked on {fact!r}",
        )


class PatchesContract:
    """A patch's decision is the run's: recorded when it takes the new code, derived (and
    stable) when it was past the point before the patch, the same in a replay."""

    async def test_a_new_run_takes_the_patch_and_every_execution_replays_it(
        self, engine: Engine
    ) -> None:
        patched = Engine(engine.backend, Registry([fraud_patched]))
        handle = await patched.enqueue(fraud_patched, Job(key="fresh"))
        await _park(patched, handle.run_id, "go")
        await engine.signal(handle.run_id, "go")
        await _park(patched, handle.run_id, "more")  # a second execution: marker replayed
        await engine.signal(handle.run_id, "more")
        async with patched.worker():
            assert await handle.result(timeout=15) == "new"  # a third one
        tally = current_tally()
        assert tally.body_runs[("fresh", "fraud-check")] == 1
        history = await engine.export_history(handle.run_id)
        assert [s.name for s in history.steps] == [
            "lookup",
            "umt.patch:new-fraud-check",
            "fraud-check",
            "go",
            "more",
            "charge",
        ]
        assert _markers(history) == [
            ("umt.patch:new-fraud-check", {"umt_patch": "new-fraud-check", "deprecated": False})
        ]
        result = await Replayer(Registry([fraud_patched])).replay(history)
        assert result.outcome == "finished"

    async def test_a_run_past_the_point_keeps_the_old_code_on_every_execution(
        self, engine: Engine
    ) -> None:
        old = Engine(engine.backend, Registry([fraud_old]))
        handle = await old.enqueue(fraud_old, Job(key="inflight"))
        await _park(old, handle.run_id, "go")  # recorded `lookup` and `go`: past the point
        patched = Engine(engine.backend, Registry([fraud_patched]))
        await engine.signal(handle.run_id, "go")
        await _park(patched, handle.run_id, "more")  # decided False, recorded nothing
        assert _markers(await engine.export_history(handle.run_id)) == []
        await engine.signal(handle.run_id, "more")
        async with patched.worker():
            assert await handle.result(timeout=15) == "old"  # False again
        assert current_tally().body_runs[("inflight", "fraud-check")] == 0
        history = await engine.export_history(handle.run_id)
        assert [s.name for s in history.steps] == ["lookup", "go", "more", "charge"]
        result = await Replayer(Registry([fraud_patched])).replay(history)
        assert result.outcome == "finished"

    async def test_a_run_parked_before_the_point_takes_the_patch(self, engine: Engine) -> None:
        """Only what was recorded counts: a run that has not reached the point yet (nothing
        recorded after it) takes the new code there, whenever it was started."""
        old = Engine(engine.backend, Registry([fraud_old]))
        handle = await old.enqueue(fraud_old, Job(key="early"))
        patched = Engine(engine.backend, Registry([fraud_patched]))
        await engine.signal(handle.run_id, "go")
        await engine.signal(handle.run_id, "more")
        async with patched.worker():
            assert await handle.result(timeout=15) == "new"
        history = await engine.export_history(handle.run_id)
        assert [name for name, _ in _markers(history)] == ["umt.patch:new-fraud-check"]

    async def test_deprecate_patch_replays_both_kinds_and_records_for_new_runs(
        self, engine: Engine
    ) -> None:
        patched = Engine(engine.backend, Registry([fraud_patched]))
        taken = await patched.enqueue(fraud_patched, Job(key="taken"))
        await _park(patched, taken.run_id, "go")
        deprecated = Engine(engine.backend, Registry([fraud_deprecated]))
        fresh = await deprecated.enqueue(fraud_deprecated, Job(key="fresh"))
        await _park(deprecated, fresh.run_id, "go")
        fresh_markers = _markers(await engine.export_history(fresh.run_id))
        assert fresh_markers == [
            ("umt.patch:new-fraud-check", {"umt_patch": "new-fraud-check", "deprecated": True})
        ]
        for run_id in (taken.run_id, fresh.run_id):
            await engine.signal(run_id, "go")
            await engine.signal(run_id, "more")
        # A worker of the previous release finishes the run the new release started: the
        # deprecated marker makes it take the new branch too.
        async with patched.worker():
            assert await fresh.result(timeout=15) == "new"
        async with deprecated.worker():
            assert await taken.result(timeout=15) == "new"
        tally = current_tally()
        assert tally.body_runs[("fresh", "fraud-check")] == 1
        assert tally.body_runs[("taken", "fraud-check")] == 1

    async def test_a_plain_task_asks_in_its_thread_and_a_loop_decides_once(
        self, engine: Engine
    ) -> None:
        handle = await engine.enqueue(fraud_plain, Job(key="plain"))
        async with engine.worker():
            assert await handle.result(timeout=15) == [True, True, True]
        history = await engine.export_history(handle.run_id)
        assert [s.name for s in history.steps] == ["umt.patch:plain-patch"]

    async def test_a_patch_id_at_a_second_point_is_refused_and_nothing_stored(
        self, engine: Engine
    ) -> None:
        handle = await engine.enqueue(patch_twice, Job(key="twice"))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert caught.value.error_type.endswith("UsageError")
        message = caught.value.error_message
        assert "patch 'reused'" in message
        assert "give each point its own id" in message
        history = await engine.export_history(handle.run_id)
        assert [s.name for s in history.steps] == ["umt.patch:reused", "first-point"]
        assert (await engine.get(handle.run_id)).attempts == 1  # final: never retried

    async def test_patched_without_await_fails_the_run_saying_so(self, engine: Engine) -> None:
        handle = await engine.enqueue(patch_unawaited, Job(key="unawaited"))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert caught.value.error_type.endswith("UsageError")
        assert "if await ctx.patched('forgot-await')" in caught.value.error_message
        history = await engine.export_history(handle.run_id)
        assert history.steps == ()
        assert json.loads(history.to_json())["steps"] == []
