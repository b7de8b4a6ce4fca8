"""A nightly schedule in Paris time, declared in code, run by the workers, managed at run time.

Run it: `python examples/12_schedules.py` (the memory backend and a `FakeClock`: a week of
nights in well under a second). On Postgres the same code stores the schedule in the `schedules`
table, and any number of workers on any number of hosts start exactly one run per night.

- `Schedule(...)` in the `Registry` declares it: every worker that serves `nightly_sync` stores
  it when it starts (idempotently: a schedule that exists keeps where it stands);
- the workers' scheduler loop starts the run of each due tick under the key
  `umt.schedule:nightly-sync:<tick>`, so racing schedulers make one run;
- the run reads its tick as `ctx.scheduled_at` (UTC);
- `engine.schedules` pauses, resumes, triggers and backfills it (`umt schedules ...` too).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from attrs import frozen

from umt_sdk import Engine, Registry, Schedule, TaskContext, connect, task
from umt_sdk.testing import FakeClock

PARIS = ZoneInfo("Europe/Paris")


@frozen
class SyncInput:
    source: str


@task("nightly_sync", version=1)
async def nightly_sync(ctx: TaskContext[SyncInput]) -> str:
    assert ctx.scheduled_at is not None
    night = ctx.scheduled_at.astimezone(PARIS)
    await ctx.step.run("sync", lambda: None)
    return f"synced {ctx.input.source} for the night of {night:%a %d %b %H:%M %Z}"


NIGHTLY = Schedule(
    name="nightly-sync",
    task=nightly_sync,
    cron="0 3 * * *",  # 03:00, Paris time, whatever the season
    input=SyncInput(source="crm"),
    timezone="Europe/Paris",
    overlap="skip",  # a night still running when the next one comes: skip the next one
)
registry = Registry([nightly_sync], schedules=[NIGHTLY])


async def wait_for_runs(engine: Engine, count: int) -> list[str]:
    """The outputs of the completed runs, oldest first, once there are `count` of them."""
    for _ in range(500):
        page = await engine.list(task_name=nightly_sync.name, status="completed")
        if len(page.runs) >= count:
            return [await engine.result(r.run_id) for r in reversed(page.runs)]
        await asyncio.sleep(0.01)
    raise TimeoutError(f"expected {count} completed runs")


async def main() -> None:
    clock = FakeClock(datetime(2030, 3, 28, 12, tzinfo=UTC))  # summer time starts on the 31st
    async with await connect("memory://", registry=registry, clock=clock) as engine:
        await engine.schedules.declare()  # what each worker does when it starts
        async with engine.worker(poll_interval=timedelta(milliseconds=20)):
            for _ in range(7):  # a week of nights
                clock.advance(timedelta(days=1))
                await asyncio.sleep(0.05)
            for line in await wait_for_runs(engine, 7):
                print(line)

            await engine.schedules.pause(NIGHTLY.name)
            clock.advance(timedelta(days=2))  # two nights pass while paused: nothing runs
            info = await engine.schedules.resume(NIGHTLY.name)
            print(f"resumed; next tick {info.next_tick.astimezone(PARIS):%a %d %b %H:%M %Z}")

            handle = await engine.schedules.trigger(NIGHTLY.name)  # one run now, by hand
            print("triggered:", await handle.result(timeout=5))
            missed = await engine.schedules.backfill(
                NIGHTLY.name,
                datetime(2030, 4, 4, 12, tzinfo=UTC),
                datetime(2030, 4, 6, 12, tzinfo=UTC),
            )
            for run in missed:
                print("backfilled:", await run.result(timeout=5))
        total = len((await engine.list(task_name=nightly_sync.name)).runs)
        print(f"{total} runs: 7 nights, 1 trigger, 2 backfilled nights; none while paused")


if __name__ == "__main__":
    asyncio.run(main())
