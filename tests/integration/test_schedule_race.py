"""Ten schedulers racing on Postgres make exactly one run per tick.

Ten engines, each with its own pool and a worker whose scheduler loop polls every 50 ms, all
declare the same every-second schedule and start its ticks; then ten bare passes
(`run_due`) race for the same due ticks at once. Every tick from the first to the schedule's
`last_tick` has one run, none has two, none is skipped."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta

from umt_sdk import Registry, Schedule, TaskContext, connect, task
from umt_sdk._cron import tick_of_key


@task("race.tick")
async def tick_task(ctx: TaskContext[str]) -> str:
    assert ctx.scheduled_at is not None
    return ctx.scheduled_at.isoformat()


EVERY_SECOND = Schedule(
    name="race-every-second",
    task=tick_task,
    cron="* * * * * *",
    input="tick",
    overlap="allow_all",
    catchup_window=timedelta(minutes=5),
)


async def test_ten_schedulers_make_one_run_per_tick(pg_url: str, pg_schema: str) -> None:
    registry = Registry([tick_task], schedules=[EVERY_SECOND])
    engines = [
        await connect(pg_url, registry=registry, schema=pg_schema, run_migrations=False, max_size=3)
        for _ in range(10)
    ]
    try:
        workers = [e.worker(poll_interval=timedelta(milliseconds=50)) for e in engines]
        await asyncio.gather(*(w.start() for w in workers))
        await asyncio.sleep(4)
        await asyncio.gather(*(w.stop() for w in workers))

        await asyncio.sleep(1.5)  # ticks come due with no scheduler running
        reports = await asyncio.gather(*(e.schedules.run_due() for e in engines))

        client = engines[0]
        runs = (await client.list(task_name=tick_task.name, limit=1000)).runs
        ticks = Counter(tick_of_key(r.idempotency_key) for r in runs)
        assert None not in ticks
        assert max(ticks.values()) == 1, f"a tick with two runs: {ticks.most_common(3)}"
        info = await client.schedules.get(EVERY_SECOND.name)
        first = min(t for t in ticks if t is not None)
        expected = int((info.last_tick - first).total_seconds()) + 1 if info.last_tick else 0
        assert len(ticks) == expected >= 5, "every tick from the first to the last has a run"
        movers = [r for r in reports if r.started and not r.lost_races]
        assert len(movers) == 1, f"one pass moves the schedule on, the others lose: {reports}"
        assert (await client.schedules.list()) == [info], "ten declarations, one schedule"
    finally:
        for engine in engines:
            await engine.close()
