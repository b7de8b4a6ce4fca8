"""Sagas on the memory backend: declarations refused, a plain handler's saga, a registration
the code no longer makes (never skipped), and the replayer over a compensated run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    ChildFailedError,
    Compensate,
    Engine,
    Registry,
    RetryPolicy,
    RunCanceledError,
    RunCompensatedError,
    RunFailedError,
    SyncTaskContext,
    TaskContext,
    connect,
    step,
    task,
)
from umt_sdk._names import check_sleep_arguments, check_wait_arguments
from umt_sdk.exceptions import TaskDefinitionError, UsageError
from umt_sdk.testing import FakeClock, Replayer

LOG: list[str] = []
DEPLOYED: dict[str, bool] = {"without_compensation": False}


def test_on_failure_takes_fail_or_compensate() -> None:
    with pytest.raises(TaskDefinitionError) as caught:
        task("t", on_failure="undo")  # type: ignore[arg-type]  # the bad input under test
    assert caught.value.argument == "on_failure"
    assert "'compensate'" in str(caught.value)


def test_step_names_starting_with_umt_are_reserved() -> None:
    with pytest.raises(TaskDefinitionError) as caught:
        step("umt.compensate:charge")
    assert "'umt.'" in str(caught.value)
    for refused in (
        lambda: check_sleep_arguments("umt.compensating", timedelta(seconds=1)),
        lambda: check_wait_arguments(
            "umt.compensating", timeout=None, check_fn=None, payload_type=Any, poll=None
        ),
    ):
        with pytest.raises(UsageError) as used:
            refused()
        assert used.value.argument == "name"
        assert "'umt.'" in str(used.value)


@task("plain_saga", retry=RetryPolicy.none())
def plain_saga(ctx: SyncTaskContext[str]) -> None:
    for name in ("a", "b", "c"):
        ctx.step.run(name, lambda n=name: n, compensate=lambda out: LOG.append(f"undo {out}"))
    raise Compensate(f"gave up on {ctx.input}")


@task("redeployed_saga", retry=RetryPolicy.none())
async def redeployed_saga(ctx: TaskContext[str]) -> None:
    undo: Any = None if DEPLOYED["without_compensation"] else (lambda: LOG.append("undo a"))
    await ctx.step.run("a", lambda: "a", compensate=undo)
    await ctx.step.run("b", lambda: "b", compensate=lambda: LOG.append("undo b"))
    await ctx.step.wait_for_fact("go", timeout=timedelta(days=1))
    raise Compensate("no stock")


def undo_b_broken() -> None:
    LOG.append("undo b failed")
    raise OSError("the refund API is down")


@task("fixable_saga", version=1, retry=RetryPolicy.none())
async def fixable_saga(ctx: TaskContext[str]) -> None:
    await ctx.step.run("a", lambda: "a", compensate=lambda: LOG.append("undo a"))
    await ctx.step.run("b", lambda: "b", compensate=undo_b_broken)
    await ctx.step.run("c", lambda: "c", compensate=lambda: LOG.append("undo c"))
    raise Compensate("no stock")


@task("fixable_saga", version=2, retry=RetryPolicy.none())
async def fixable_saga_v2(ctx: TaskContext[str]) -> None:
    await ctx.step.run("a", lambda: "a", compensate=lambda: LOG.append("undo a"))
    await ctx.step.run("b", lambda: "b", compensate=lambda: LOG.append("undo b"))
    await ctx.step.run("c", lambda: "c", compensate=lambda: LOG.append("undo c"))
    raise Compensate("no stock")


@task("saga_child", retry=RetryPolicy.none())
async def saga_child(ctx: TaskContext[str]) -> None:
    await ctx.step.run("a", lambda: "a", compensate=lambda: LOG.append("child undo a"))
    raise Compensate("child gave up")


@task("saga_parent", retry=RetryPolicy.none())
async def saga_parent(ctx: TaskContext[str]) -> str:
    child = await ctx.step.start_child("child", saga_child, ctx.input)
    try:
        await child.result()
    except ChildFailedError as exc:
        return f"child failed: {exc.error_type}: {exc.error_message}"
    return "unreachable"


@task("canceled_saga", retry=RetryPolicy.none())
async def canceled_saga(ctx: TaskContext[str]) -> None:
    async def undo_until_the_cancel_arrives() -> None:
        LOG.append("undo b started")
        await ctx.abort_event.wait()  # the cancel reached this execution
        LOG.append("undo b returned")

    await ctx.step.run("a", lambda: "a", compensate=lambda: LOG.append("undo a"))
    await ctx.step.run("b", lambda: "b", compensate=undo_until_the_cancel_arrives)
    raise Compensate("no stock")


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    LOG.clear()
    DEPLOYED["without_compensation"] = False
    registry = Registry(
        [
            plain_saga,
            redeployed_saga,
            fixable_saga,
            fixable_saga_v2,
            saga_child,
            saga_parent,
            canceled_saga,
        ]
    )
    engine = await connect("memory://", registry=registry, clock=FakeClock(auto_advance=True))
    yield engine
    await engine.close()


async def test_a_plain_handler_compensates_newest_first(engine: Engine) -> None:
    handle = await engine.enqueue(plain_saga, "trip")
    async with engine.worker():
        with pytest.raises(RunCompensatedError) as caught:
            await handle.result(timeout=5)
    assert caught.value.error_message == "gave up on trip"
    assert LOG == ["undo c", "undo b", "undo a"]
    history = await engine.export_history(handle.run_id)
    assert history.status == "compensated"
    result = await Replayer(Registry([plain_saga])).replay(history)
    assert (result.ok, result.outcome) == (True, "finished"), result.summary()
    assert LOG == ["undo c", "undo b", "undo a"], "a replay runs no compensation"


async def test_a_registration_the_code_no_longer_makes_is_never_skipped(engine: Engine) -> None:
    handle = await engine.enqueue(redeployed_saga, "x")
    async with engine.worker():
        for _ in range(500):
            if (await engine.get(handle.run_id)).status == "waiting":
                break
            await asyncio.sleep(0.01)
        DEPLOYED["without_compensation"] = True  # a deploy dropped compensate= from step a
        await engine.signal(handle.run_id, "go")
        with pytest.raises(RunFailedError) as caught:
            await handle.result(timeout=5)
    assert not isinstance(caught.value, RunCompensatedError)
    assert caught.value.error_type == "umt_sdk.CompensationFailedError"
    assert "of step 'a' could not run" in caught.value.error_message
    assert "<lambda>" in caught.value.error_message, "named as it was registered"
    assert LOG == ["undo b"], "the one before it in the reverse order ran"


async def test_a_saga_whose_undo_failed_is_finished_by_a_fork_on_fixed_code(
    engine: Engine,
) -> None:
    handle = await engine.enqueue(fixable_saga, "x", version=1)
    async with engine.worker():
        with pytest.raises(RunFailedError) as caught:
            await handle.result(timeout=5)
        assert caught.value.error_type == "umt_sdk.CompensationFailedError"
        assert LOG == ["undo c", "undo b failed"]
        fork = await engine.fork(handle.run_id, "umt.compensate:b", version=2)
        with pytest.raises(RunCompensatedError) as compensated:
            await fork.result(timeout=5)
    assert compensated.value.error_message == "no stock"
    assert LOG == ["undo c", "undo b failed", "undo b", "undo a"], "undo c is not run again"


async def test_a_compensated_child_fails_its_parents_result(engine: Engine) -> None:
    handle = await engine.enqueue(saga_parent, "x")
    async with engine.worker():
        result = await handle.result(timeout=5)
    assert result == "child failed: umt_sdk.Compensate: child gave up"
    assert LOG == ["child undo a"]


async def test_a_cancel_wins_over_compensating(engine: Engine) -> None:
    handle = await engine.enqueue(canceled_saga, "x")
    async with engine.worker():
        for _ in range(500):
            if LOG == ["undo b started"]:
                break
            await asyncio.sleep(0.01)
        assert await engine.cancel(handle.run_id, reason="operator") == "requested"
        with pytest.raises(RunCanceledError):
            await handle.result(timeout=5)
    assert LOG == ["undo b started", "undo b returned"], "undo a never started"
    info = await engine.get(handle.run_id)
    assert info.status == "canceled"
    assert [(s.name, s.status) for s in info.timeline if s.name.startswith("umt.compensate:")] == [
        ("umt.compensate:b", "completed")
    ]
