"""`ctx.step.map` and `ctx.step.gather` as users call them: plain handlers, the arguments
refused with a message that says how to fix the call, and what a replay returns."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from umt_sdk import (
    ChildrenFailedError,
    Concurrency,
    Engine,
    Registry,
    RetryPolicy,
    RunFailedError,
    SyncTaskContext,
    TaskContext,
    connect,
    task,
)
from umt_sdk.testing import FakeClock
from umt_sdk.testing._run_inline import run_inline


@task("fan.square", version=1, retry=RetryPolicy(max_attempts=1))
async def square(ctx: TaskContext[int]) -> int:
    if ctx.input < 0:
        raise ValueError(f"{ctx.input} is negative")
    return ctx.input * ctx.input


@task(
    "fan.keyed",
    version=1,
    concurrency=Concurrency(key=lambda n: str(n), limit=1),
)
async def keyed(ctx: TaskContext[int]) -> int:
    return ctx.input


@task("fan.sync_parent", version=1, retry=RetryPolicy(max_attempts=1))
def sync_parent(ctx: SyncTaskContext[list[int]]) -> list[int]:
    mapped = ctx.step.map("squares", square, ctx.input, max_concurrency=2)
    handles = [ctx.step.start_child(f"one{i}", square, n) for i, n in enumerate(ctx.input)]
    gathered = ctx.step.gather("again", handles)
    return mapped + gathered


@task("fan.bad", version=1, retry=RetryPolicy(max_attempts=1))
async def bad(ctx: TaskContext[str]) -> Any:
    arguments: dict[str, Any] = {
        "string": {"inputs": "abc"},
        "zero": {"inputs": [1], "max_concurrency": 0},
        "flag": {"inputs": [1], "return_exceptions": 1},
        "keyed": {"inputs": [1], "task": keyed},
    }[ctx.input]
    return await ctx.step.map(
        "m", arguments.pop("task", square), arguments.pop("inputs"), **arguments
    )


@task("fan.gather_bad", version=1, retry=RetryPolicy(max_attempts=1))
async def gather_bad(ctx: TaskContext[str]) -> Any:
    handle = await ctx.step.start_child("one", square, 2)
    handles: Any = {"twice": [handle, handle], "not-handles": [handle.run_id]}[ctx.input]
    return await ctx.step.gather("g", handles)


@task("fan.failing", version=1, retry=RetryPolicy(max_attempts=1))
async def failing(ctx: TaskContext[list[int]]) -> dict[str, Any]:
    try:
        await ctx.step.map("squares", square, ctx.input)
    except ChildrenFailedError as exc:
        return {
            "step": exc.step_name,
            "errors": {str(i): e.error_message for i, e in exc.errors.items()},
            "results": [r if isinstance(r, int) else type(r).__name__ for r in exc.results],
        }
    return {}


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    registry = Registry([square, keyed, sync_parent, bad, gather_bad, failing])
    engine = await connect(
        "memory://", registry=registry, clock=FakeClock(datetime(2030, 1, 1, tzinfo=UTC))
    )
    yield engine
    await engine.close()


async def test_a_plain_handler_maps_and_gathers(engine: Engine) -> None:
    assert await run_inline(engine, sync_parent, [1, 2, 3]) == [1, 4, 9, 1, 4, 9]


async def test_partial_failure_names_each_failed_child(engine: Engine) -> None:
    outcome = await run_inline(engine, failing, [1, -2, 3, -4])
    assert outcome == {
        "step": "squares",
        "errors": {"1": "-2 is negative", "3": "-4 is negative"},
        "results": [1, "ChildFailedError", 9, "ChildFailedError"],
    }


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("string", "inputs must be a list (or another iterable) of the children's inputs"),
        ("zero", "max_concurrency must be"),
        ("flag", "return_exceptions must be True or False"),
        ("keyed", "has a concurrency key"),
    ],
)
async def test_map_refuses_bad_arguments(engine: Engine, case: str, says: str) -> None:
    with pytest.raises(RunFailedError) as caught:
        await run_inline(engine, bad, case)
    assert caught.value.error_type == "umt_sdk.UsageError"
    assert says in caught.value.error_message


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("twice", "handles must be distinct child handles"),
        ("not-handles", "handles must be child handles from start_child"),
    ],
)
async def test_gather_refuses_bad_handles(engine: Engine, case: str, says: str) -> None:
    with pytest.raises(RunFailedError) as caught:
        await run_inline(engine, gather_bad, case)
    assert caught.value.error_type == "umt_sdk.UsageError"
    assert says in caught.value.error_message
