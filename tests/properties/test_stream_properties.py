"""Stream writes under crashes and replays, on the memory backend and a `FakeClock`: a run
writes values of any JSON shape to two streams, in steps and between them (some steps reusing
a name, so replay tells them apart by occurrence), while its executions crash at random
writes of the store (before or after a stream value, a step record or an ending lands). Each
crash leaves its lease to lapse and another execution to take over, re-running the step it cut
off and replaying the rest. Whatever the crashes, each stream holds exactly the values the code
writes, once each, in the order it writes them, numbered 1, 2, 3...; and a follower that
watched the run live from its start saw exactly that too."""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import json_values
from umt_backend_memory import MemoryBackend
from umt_sdk import (
    Engine,
    Registry,
    RetryPolicy,
    StreamItem,
    TaskContext,
    connect,
    task,
)
from umt_sdk.testing import FakeClock

START = datetime(2030, 1, 1, tzinfo=UTC)
LEASE = timedelta(seconds=5)
STREAMS = ("a", "b")


@task("prop.streams", version=1, retry=RetryPolicy(max_attempts=1), max_lost_leases=100)
async def plan_task(ctx: TaskContext[list[Any]]) -> int:
    """Each segment of the plan is `[in_step, [[stream, value], ...]]`: its writes go in a
    step (named `seg<i % 2>`: the names repeat) or in the handler's own code."""
    for index, (in_step, writes) in enumerate(ctx.input):
        if in_step:

            async def work(writes: list[Any] = writes) -> int:
                for stream, value in writes:
                    await ctx.stream.write(stream, value)
                return len(writes)

            await ctx.step.run(f"seg{index % 2}", work)
        else:
            for stream, value in writes:
                await ctx.stream.write(stream, value)
    return len(ctx.input)


plans = st.lists(
    st.tuples(
        st.booleans(),
        st.lists(st.tuples(st.sampled_from(STREAMS), json_values), max_size=4),
    ),
    min_size=1,
    max_size=5,
)


def _expected(plan: list[tuple[bool, list[tuple[str, Any]]]]) -> dict[str, list[Any]]:
    expected: dict[str, list[Any]] = {name: [] for name in STREAMS}
    for _, writes in plan:
        for stream, value in writes:
            expected[stream].append(value)
    return expected


async def _follow(engine: Engine, run_id: UUID, name: str) -> list[StreamItem]:
    return [item async for item in engine.stream(run_id, name)]


@given(plan=plans, crash_at=st.sets(st.integers(min_value=1, max_value=40), max_size=4))
def test_writes_land_once_each_in_order_whatever_crashes(
    plan: list[tuple[bool, list[tuple[str, Any]]]], crash_at: set[int]
) -> None:
    async def scenario() -> None:
        clock = FakeClock(START, auto_advance=True)
        engine = await connect("memory://", registry=Registry([plan_task]), clock=clock)
        backend = engine.backend
        assert isinstance(backend, MemoryBackend)
        calls = itertools.count(1)
        crashed: list[str] = []

        def crash(operation: str, run_id: UUID, phase: str) -> bool:
            if next(calls) in crash_at:
                crashed.append(f"{phase} {operation}")
                return True
            return False

        async with engine:
            handle = await engine.enqueue(plan_task, [[s, [list(w) for w in ws]] for s, ws in plan])
            followers = {
                name: asyncio.create_task(_follow(engine, handle.run_id, name)) for name in STREAMS
            }
            backend.crash_hook = crash
            async with engine.worker(concurrency=1, lease=LEASE):
                taken_over = 0
                for _ in range(20_000):
                    info = await engine.get(handle.run_id)
                    if info.status in ("completed", "failed", "canceled"):
                        break
                    if len(crashed) > taken_over:  # let the crashed execution's lease lapse
                        taken_over = len(crashed)
                        clock.advance(LEASE * 2)
                    await asyncio.sleep(0)
                else:
                    raise AssertionError(f"the run never ended; crashes: {crashed}")
            assert info.status == "completed", (info.status, info.error, crashed)
            expected = _expected(plan)
            for name in STREAMS:
                items = [item async for item in engine.stream(handle.run_id, name)]
                assert [item.value for item in items] == expected[name], crashed
                assert [item.seq for item in items] == list(range(1, len(expected[name]) + 1))
                seen = await asyncio.wait_for(followers[name], 30)
                assert seen == items, "the live follower saw the same, once each"
                last = await engine.stream_last(handle.run_id, name)
                assert last == (items[-1] if items else None)

    asyncio.run(scenario())
