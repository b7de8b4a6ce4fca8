"""The scheduler pass under random downtimes and racing passes, on the memory backend and a
`FakeClock`: whatever the clock does and however many passes race, each tick has at most one
run; with the default catch-up each pass that finds ticks due starts exactly the last one; with
a window, every tick within it; and the schedule's next tick is the first one after now."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from umt_sdk import Registry, Schedule, TaskContext, connect, task
from umt_sdk._cron import CronSpec, tick_of_key
from umt_sdk.testing import FakeClock

START = datetime(2030, 10, 25, tzinfo=UTC)  # Europe/Paris falls back on the 27th


@task("prop.tick")
async def tick_task(ctx: TaskContext[int]) -> int:
    return ctx.input


@given(
    cron=st.sampled_from(["0 * * * *", "*/20 * * * *", "30 2 * * *", "0 9-17 * * MON-FRI"]),
    window=st.sampled_from([timedelta(0), timedelta(hours=3)]),
    steps=st.lists(
        st.tuples(st.integers(min_value=1, max_value=24 * 60), st.integers(1, 3)),
        min_size=1,
        max_size=25,
    ),
)
def test_each_tick_runs_once_and_catch_up_starts_what_it_should(
    cron: str, window: timedelta, steps: list[tuple[int, int]]
) -> None:
    spec = CronSpec.parse(cron, "Europe/Paris")

    async def scenario() -> None:
        clock = FakeClock(START)
        engine = await connect("memory://", registry=Registry([tick_task]), clock=clock)
        async with engine:
            await engine.schedules.create(
                Schedule(
                    name="prop",
                    task=tick_task,
                    cron=cron,
                    input=1,
                    timezone="Europe/Paris",
                    overlap="allow_all",
                    catchup_window=window,
                )
            )
            expected: list[datetime] = []
            next_tick = spec.next_after(START)
            for minutes, racers in steps:
                clock.advance(timedelta(minutes=minutes))
                now = clock.now()
                due = spec.between(next_tick, now, limit=10_000)
                if due:
                    recent = [t for t in due if t >= now - window] if window else []
                    expected += recent if due[-1] in recent else [*recent, due[-1]]
                    next_tick = spec.next_after(now)
                await asyncio.gather(*(engine.schedules.run_due() for _ in range(racers)))
                info = await engine.schedules.get("prop")
                assert info.next_tick == next_tick
            runs = (await engine.list(task_name=tick_task.name, limit=10_000)).runs
            ticks = [tick_of_key(r.idempotency_key) for r in runs]
            assert len(ticks) == len(set(ticks)), "a tick with two runs"
            assert sorted(t for t in ticks if t is not None) == expected

    asyncio.run(scenario())
