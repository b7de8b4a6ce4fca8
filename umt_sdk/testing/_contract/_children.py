"""Child runs: started once by a step, their ending wakes the parent (no polling), a failed or
canceled child raises in the parent (and on replay), and a parent that fails or is canceled
cancels the children that asked for it, in the store."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from umt_sdk import (
    ChildCanceledError,
    ChildFailedError,
    Engine,
    ParentClose,
    RetryPolicy,
    TaskContext,
    TaskDefinition,
    task,
)
from umt_sdk._probe import Point, observing
from umt_sdk.testing._contract._base import (
    Job,
    Tally,
    current_tally,
    eventually,
    holds,
    wait_until,
)
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["ChildrenContract"]


@task("contract.child", version=1, retry=RetryPolicy(max_attempts=1))
async def child_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()
    tally.body_runs[(ctx.input.key, "child")] += 1
    if ctx.input.n == 1:  # waits, parked, until the test sends it `go`
        await ctx.step.wait_for_fact("go")
    if ctx.input.n == 2:  # runs, holding its lease, until it learns its cancel
        await ctx.step.run("held", ctx.abort_event.wait)
        await ctx.step.run("after", lambda: None)  # the boundary that ends it canceled
    if "fail" in ctx.input.key:
        raise ValueError(f"child {ctx.input.key} cannot")
    return f"child {ctx.input.key}"


@task("contract.parent", version=1, retry=RetryPolicy(max_attempts=1))
async def parent_task(ctx: TaskContext[Job]) -> str:
    """Starts one child of the same key and `n`, and returns what its result says."""
    tally = current_tally()
    close: ParentClose = "abandon" if ctx.input.key.endswith("abandon") else "cancel"
    handle = await ctx.step.start_child(
        "start", child_task, Job(key=ctx.input.key, n=ctx.input.n), parent_close=close
    )
    tally.business[f"child:{ctx.input.key}"] = handle.run_id
    try:
        outcome = await handle.result()
    except ChildFailedError as exc:
        tally.business.setdefault(f"raised:{ctx.input.key}", []).append(exc.error_message)
        outcome = f"failed: {exc.error_type}: {exc.error_message}"
    except ChildCanceledError as exc:
        outcome = f"canceled: {exc.reason}"
    if ctx.input.key.startswith("replay"):
        await ctx.step.sleep("again", timedelta(milliseconds=200))  # one more execution
    return outcome


@task("contract.failing_parent", version=1, retry=RetryPolicy(max_attempts=1))
async def failing_parent_task(ctx: TaskContext[Job]) -> None:
    """Starts a child that holds its lease, then fails without waiting for it."""
    handle = await ctx.step.start_child("start", child_task, Job(key=ctx.input.key, n=2))
    current_tally().business[f"child:{ctx.input.key}"] = handle.run_id
    await current_tally().gate(f"fail:{ctx.input.key}").wait()  # the test says when
    raise RuntimeError("the parent gives up")


TASKS: tuple[TaskDefinition[Any, Any], ...] = (child_task, parent_task, failing_parent_task)
"""The tasks of this topic that the suite's engine registers."""


class ChildrenContract:
    """A parent and its children, on every backend."""

    async def test_a_parent_waits_parked_for_its_child_and_gets_its_output(
        self, engine: Engine
    ) -> None:
        handle = await engine.enqueue(parent_task, Job(key="c1"))
        # One slot: the child can only run if the waiting parent gave its slot back.
        async with engine.worker(concurrency=1):
            assert await handle.result(timeout=15) == "child c1"
        children = (await engine.list(parent=handle.run_id)).runs
        assert [(c.task_name, c.status, c.parent_run_id) for c in children] == [
            ("contract.child", "completed", handle.run_id)
        ]
        info = await engine.get(handle.run_id)
        assert info.parent_run_id is None
        assert [(s.name, s.kind, s.status) for s in info.timeline] == [
            ("start", "step", "completed"),
            ("start.result", "fact", "completed"),
        ]
        assert (await engine.get(children[0].run_id)).parent_run_id == handle.run_id

    async def test_a_failed_child_raises_in_its_parent_and_again_on_replay(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(parent_task, Job(key="replay-fail"))
        async with engine.worker(concurrency=2):
            outcome = await handle.result(timeout=15)
        assert outcome == "failed: ValueError: child replay-fail cannot", outcome
        # Raised live, then again from the record when the sleep's end replayed the handler.
        assert tally.business["raised:replay-fail"] == ["child replay-fail cannot"] * 2
        assert tally.body_runs[("replay-fail", "child")] == 1

    async def test_a_crash_after_the_child_was_enqueued_starts_it_once(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        crashed: list[Point] = []

        def crash_once_after_start(point: Point) -> bool:
            if point.kind == "step.returned" and point.name == "start" and not crashed:
                crashed.append(point)
                return True  # the child is stored; the step's record is not
            return False

        handle = await engine.enqueue(parent_task, Job(key="once"))
        with observing(crash_once_after_start):
            worker = engine.worker(concurrency=2, lease=harness.lease)
            await worker.start()
        await eventually(lambda: holds(bool(crashed)))
        await harness.advance(harness.lease * 2)
        assert await handle.result(timeout=20) == "child once"
        await worker.stop()
        children = (await engine.list(parent=handle.run_id)).runs
        assert len(children) == 1, "a second execution of the step found the same child"
        assert tally.body_runs[("once", "child")] == 1
        info = await engine.get(handle.run_id)
        assert info.lease_expirations == 1

    async def test_canceling_a_waiting_parent_cancels_its_waiting_child(
        self, engine: Engine
    ) -> None:
        parent = await engine.enqueue(parent_task, Job(key="cascade", n=1))
        kept = await engine.enqueue(parent_task, Job(key="cascade-abandon", n=1))
        async with engine.worker(concurrency=4):
            for handle in (parent, kept):
                await wait_until(
                    engine, handle.run_id, lambda i: i.waiting_for is not None, what="wait"
                )
            children = {
                handle.run_id: (await engine.list(parent=handle.run_id)).runs[0].run_id
                for handle in (parent, kept)
            }
            for handle in (parent, kept):
                await wait_until(
                    engine, children[handle.run_id], lambda i: i.status == "waiting", what="go"
                )
            assert await engine.cancel(parent.run_id, reason="operator") == "canceled"
            assert await engine.cancel(kept.run_id, reason="operator") == "canceled"
        child = await engine.get(children[parent.run_id])
        assert child.status == "canceled"
        assert child.cancel_reason == f"parent {parent.run_id} canceled"
        abandoned = await engine.get(children[kept.run_id])
        assert abandoned.status == "waiting", "parent_close='abandon' lets the child go on"

    async def test_a_canceled_child_raises_child_canceled_in_its_parent(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(parent_task, Job(key="cc", n=1))
        async with engine.worker(concurrency=2):
            await wait_until(engine, handle.run_id, lambda i: i.waiting_for is not None)
            child_id = tally.business["child:cc"]
            await wait_until(engine, child_id, lambda i: i.status == "waiting", what="go")
            assert await engine.cancel(child_id, reason="not needed") == "canceled"
            assert await handle.result(timeout=15) == "canceled: not needed"

    async def test_a_parent_that_fails_requests_the_cancel_of_its_running_child(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(failing_parent_task, Job(key="fp"))
        async with engine.worker(concurrency=2):
            await eventually(lambda: holds("child:fp" in tally.business))
            child_id = tally.business["child:fp"]
            await wait_until(engine, child_id, lambda i: i.status == "running", what="child")
            await eventually(lambda: holds(tally.body_runs[("fp", "child")] == 1))
            tally.gate("fail:fp").set()  # the parent fails now
            info = await wait_until(engine, handle.run_id, lambda i: i.status == "failed")
            assert info.error is not None
            assert info.error.message == "the parent gives up"
            child = await wait_until(
                engine, child_id, lambda i: i.status == "canceled", what="the cascade"
            )
        assert child.cancel_reason == f"parent {handle.run_id} failed"
