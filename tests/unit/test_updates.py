"""Updates and queries outside the contract suite: declarations refused when decorated, and
a recorded history with updates replayed by the `Replayer` (what `umt replay` runs)."""

from __future__ import annotations

from typing import Any

import pytest

from umt_sdk import (
    Registry,
    SyncTaskContext,
    TaskContext,
    connect,
    query,
    task,
    update,
)
from umt_sdk.exceptions import TaskDefinitionError
from umt_sdk.testing import FakeClock, Replayer


@update("bump")
async def bump(ctx: TaskContext[int], by: int) -> int:
    total = int(ctx.query_state or 0) + by
    await ctx.set_query_state(total)
    return total


@update("stop")
async def stop(ctx: TaskContext[int], why: str) -> str:
    return why


@query("total")
def total_of(state: int | None) -> int:
    return state or 0


@task("unit.counter", version=1, updates=[bump, stop], queries=[total_of])
async def counter(ctx: TaskContext[int]) -> int:
    await ctx.set_query_state(ctx.input)
    await ctx.step.wait_for_update("stop")
    return int(ctx.query_state)


def test_declarations_are_checked_when_decorated() -> None:
    def plain(ctx: Any, arg: int) -> int:
        return arg

    with pytest.raises(TaskDefinitionError, match="async function"):
        update("plain")(plain)  # type: ignore[arg-type]  # a plain handler, under test

    async def one(ctx: Any) -> int:
        return 1

    with pytest.raises(TaskDefinitionError, match="exactly two parameters"):
        update("one")(one)  # type: ignore[arg-type]  # one parameter, under test
    with pytest.raises(TaskDefinitionError, match="validator"):
        update("v", validator=5)  # type: ignore[arg-type]  # not a function, under test
    with pytest.raises(TaskDefinitionError, match="update name"):
        update("")

    async def reads(state: int) -> int:
        return state

    with pytest.raises(TaskDefinitionError, match="plain function"):
        query("q")(reads)
    with pytest.raises(TaskDefinitionError, match="two updates are named 'bump'"):
        task("unit.twice", updates=[bump, bump])(counter.fn)
    with pytest.raises(TaskDefinitionError, match="updates= takes") as caught:
        task("unit.wrong", updates=[total_of])(counter.fn)  # type: ignore[list-item]  # under test
    assert caught.value.argument == "updates"
    with pytest.raises(TaskDefinitionError, match=r"queries= takes .* @query\(name\)") as caught:
        task("unit.wrong", queries=[bump])(counter.fn)  # type: ignore[list-item]  # under test
    assert caught.value.argument == "queries"
    with pytest.raises(TaskDefinitionError, match="two queries are named 'total'") as caught:
        task("unit.twice", queries=[total_of, total_of])(counter.fn)
    assert caught.value.argument == "queries"

    def sync_handler(ctx: SyncTaskContext[int]) -> int:
        return 1

    with pytest.raises(TaskDefinitionError, match="updates need an async handler"):
        task("unit.sync", updates=[bump])(sync_handler)
    assert task("unit.sync_queries", queries=[total_of])(sync_handler).queries == {
        "total": total_of
    }


async def test_a_history_with_updates_replays() -> None:
    registry = Registry([counter])
    engine = await connect("memory://", registry=registry, clock=FakeClock(auto_advance=True))
    try:
        handle = await engine.enqueue(counter, 10)
        async with engine.worker():
            assert await handle.update("bump", 5, timeout=10) == 15
            assert await handle.update("bump", 1, timeout=10) == 16
            assert await handle.update("stop", "done", timeout=10) == "done"
            assert await handle.result(timeout=10) == 16
        history = await engine.export_history(handle.run_id)
        assert await handle.query("total") == 16
    finally:
        await engine.close()
    replayed = await Replayer(registry).replay(history)
    assert replayed.outcome == "finished", replayed
    assert replayed.steps_matched == replayed.steps_recorded == 6
