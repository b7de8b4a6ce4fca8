"""Sagas on the memory backend: declarations refused, a plain handler's saga, a registration
the code no longer makes (never skipped), and the replayer over a compensated run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    Compensate,
    Engine,
    Registry,
    RetryPolicy,
    RunCompensatedError,
    RunFailedError,
    SyncTaskContext,
    TaskContext,
    connect,
    step,
    task,
)
from umt_sdk.exceptions import TaskDefinitionError
from umt_sdk.testing import FakeClock, Replayer

LOG: list[str] = []
DEPLOYED: dict[str, bool] = {"without_compensation": False}


def test_on_failure_takes_fail_or_compensate() -> None:
    with pytest.raises(TaskDefinitionError) as caught:
        task("t", on_failure="undo")  # type: ignore[arg-type]
    assert caught.value.argument == "on_failure"
    assert "'compensate'" in str(caught.value)


def test_step_names_starting_with_umt_are_reserved() -> None:
    with pytest.raises(TaskDefinitionError) as caught:
        step("umt.compensate:charge")
    assert "'umt.'" in str(caught.value)


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


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    LOG.clear()
    DEPLOYED["without_compensation"] = False
    registry = Registry([plain_saga, redeployed_saga])
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
