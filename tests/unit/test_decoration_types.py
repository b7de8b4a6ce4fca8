"""Types umt cannot store are refused when decorated, naming the type and the function; a
decorated step passed to `ctx.step.run` runs as that step (the README's call)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs
import pytest

from umt_sdk import (
    Registry,
    RetryPolicy,
    RunFailedError,
    SyncTaskContext,
    TaskContext,
    connect,
    step,
    task,
)
from umt_sdk.exceptions import TaskDefinitionError
from umt_sdk.testing import FakeClock


class Opaque:
    """A plain class: no attrs, no dataclass, nothing a converter can build from JSON."""


@attrs.frozen
class HoldsObject:
    name: str
    anything: object


@attrs.frozen
class Fine:
    name: str
    tags: list[str]


async def returns_object(ctx: TaskContext[Fine]) -> object:
    return ctx.input


async def returns_opaque(ctx: TaskContext[Fine]) -> Opaque:
    return Opaque()


async def returns_nested_object(ctx: TaskContext[Fine]) -> list[HoldsObject]:
    return []


async def takes_object(ctx: TaskContext[object]) -> str:
    return "x"


def plain_takes_opaque(ctx: SyncTaskContext[Opaque]) -> None:
    return None


@pytest.mark.parametrize(
    ("fn", "named"),
    [
        (returns_object, ["output type of returns_object is object"]),
        (returns_opaque, ["output type of returns_opaque is Opaque"]),
        (returns_nested_object, ["output type of returns_nested_object", "object"]),
        (takes_object, ["input type of takes_object is object"]),
        (plain_takes_opaque, ["input type of plain_takes_opaque is Opaque"]),
    ],
)
def test_a_task_type_umt_cannot_store_is_refused(fn: Callable[..., Any], named: list[str]) -> None:
    with pytest.raises(TaskDefinitionError) as caught:
        task("types.bad")(fn)
    message = str(caught.value)
    assert message.startswith("task 'types.bad': ")
    for part in named:
        assert part in message, message
    assert "Any" in message, "the message says how to fix it"


def test_a_step_type_umt_cannot_store_is_refused_and_storable_types_pass() -> None:
    async def gives_object() -> object:
        return 1

    def gives_opaque() -> Opaque:
        return Opaque()

    with pytest.raises(
        TaskDefinitionError, match=r"step 'obj': the return type of .*gives_object is object"
    ):
        step("obj")(gives_object)
    with pytest.raises(
        TaskDefinitionError, match=r"step 'opaque': the return type of .*gives_opaque is Opaque"
    ):
        step("opaque")(gives_opaque)

    # What umt can store stays accepted, Any included.
    async def fine(ctx: TaskContext[Fine]) -> dict[str, list[Fine]]:
        return {}

    async def anything(ctx: TaskContext[Any]) -> Any:
        return None

    assert task("types.fine")(fine).output_type == dict[str, list[Fine]]
    assert task("types.any")(anything).output_type is Any
    assert step("fine")(fine).output_type == dict[str, list[Fine]]


# -- a decorated step in ctx.step.run ------------------------------------------------------------

CALLS: list[str] = []


@step("always")
async def always(n: int) -> int:
    CALLS.append(f"always({n})")
    if len(CALLS) < 2:
        raise ConnectionError("first call fails")
    return n * 2


@step("twice-plain")
def twice_plain(n: int) -> int:
    CALLS.append(f"twice_plain({n})")
    return n * 2


@task("types.inline_async", version=1, retry=RetryPolicy.none())
async def inline_async(ctx: TaskContext[int]) -> int:
    # The README's call: a decorated async step through ctx.step.run, with a retry override.
    doubled = await ctx.step.run(
        "always",
        always,
        ctx.input,
        retry=RetryPolicy(max_attempts=2, initial=timedelta(milliseconds=10)),
    )
    return await ctx.step.run("twice", twice_plain, doubled)


@task("types.inline_plain", version=1)
def inline_plain(ctx: SyncTaskContext[int]) -> int:
    # From a plain task, the advice the async step's own error gives: ctx.step.run.
    return ctx.step.run("always", always, ctx.input) + ctx.step.run("twice", twice_plain, 1)


async def _run(definition: Any, value: int) -> tuple[Any, Any]:
    engine = await connect(
        "memory://", registry=Registry([definition]), clock=FakeClock(auto_advance=True)
    )
    try:
        handle = await engine.enqueue(definition, value)
        async with engine.worker():
            try:
                result = await handle.result(timeout=10)
            except RunFailedError as exc:
                result = exc
        return result, await engine.get(handle.run_id)
    finally:
        await engine.close()


async def test_a_decorated_async_step_in_ctx_step_run() -> None:
    CALLS.clear()
    result, info = await _run(inline_async, 5)
    assert result == 20
    assert CALLS == ["always(5)", "always(5)", "twice_plain(10)"]
    assert [(v.name, v.status, v.attempt) for v in info.timeline] == [
        ("always", "retrying", 1),
        ("always", "completed", 2),
        ("twice", "completed", 1),
    ], "one step each, under the name given to ctx.step.run, with the retry override"


async def test_a_decorated_async_step_in_ctx_step_run_of_a_plain_task() -> None:
    CALLS[:] = ["warm"]  # `always` succeeds at once
    result, info = await _run(inline_plain, 4)
    assert result == 10
    assert [(v.name, v.status) for v in info.timeline] == [
        ("always", "completed"),
        ("twice", "completed"),
    ]
