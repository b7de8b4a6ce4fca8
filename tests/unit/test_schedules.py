"""Schedules on the memory backend and a `FakeClock`, driving the scheduler pass directly
(`engine.schedules.run_due`): a year of hourly ticks, DST in both directions, the overlap
policies, the catch-up window, declarations, and the errors of bad declarations."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from attrs import frozen

from umt_sdk import (
    Engine,
    OverlapPolicy,
    PayloadError,
    Registry,
    Schedule,
    TaskContext,
    UsageError,
    connect,
    task,
)
from umt_sdk._cron import CronSpec, tick_of_key
from umt_sdk.exceptions import TaskDefinitionError, UnknownTaskError
from umt_sdk.testing import FakeClock

START = datetime(2030, 1, 1, tzinfo=UTC)


@frozen
class Sync:
    tenant: str


@task("sched.sync")
async def sync(ctx: TaskContext[Sync]) -> str:
    assert ctx.scheduled_at is not None
    return f"{ctx.input.tenant}@{ctx.scheduled_at.isoformat()}"


@task("sched.other")
async def other(ctx: TaskContext[int]) -> int:
    return ctx.input


def hourly(**changes: Any) -> Schedule[Sync]:
    fields: dict[str, Any] = {
        "name": "hourly",
        "task": sync,
        "cron": "0 * * * *",
        "input": Sync("acme"),
        "overlap": "allow_all",
    }
    return Schedule(**{**fields, **changes})


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
async def engine(clock: FakeClock) -> AsyncIterator[Engine]:
    engine = await connect("memory://", registry=Registry([sync, other]), clock=clock)
    yield engine
    await engine.close()


async def ticks_started(engine: Engine) -> list[datetime]:
    """The ticks of every scheduled run, oldest first."""
    runs = (await engine.list(task_name=sync.name, limit=10_000)).runs
    ticks = [tick_of_key(r.idempotency_key) for r in runs]
    assert None not in ticks
    return sorted(t for t in ticks if t is not None)


async def test_a_year_of_hourly_ticks_makes_one_run_per_tick(
    engine: Engine, clock: FakeClock
) -> None:
    await engine.schedules.create(hourly())
    started = 0
    for _ in range(24 * 365):
        clock.advance(timedelta(hours=1))
        report = await engine.schedules.run_due()
        started += report.started
        assert report.lost_races == 0
    ticks = await ticks_started(engine)
    assert started == len(ticks) == 24 * 365
    assert len(set(ticks)) == len(ticks)
    assert ticks[0] == START + timedelta(hours=1)
    assert ticks[-1] == START + timedelta(days=365)
    info = await engine.schedules.get("hourly")
    assert info.last_tick == ticks[-1]
    assert info.next_tick == ticks[-1] + timedelta(hours=1)
    assert (await engine.schedules.run_due()).started == 0, "nothing is due twice"


# Europe/Paris, 2030: summer time starts on 31 March (02:00 -> 03:00) and ends on 27 October
# (03:00 -> 02:00). What cronsim does with `30 2 * * *`, as each run's tick shows in UTC:
SPRING = [
    datetime(2030, 3, 30, 1, 30, tzinfo=UTC),  # 02:30 CET
    datetime(2030, 3, 31, 1, 0, tzinfo=UTC),  # no 02:30 that day: 03:00 CEST, once
    datetime(2030, 4, 1, 0, 30, tzinfo=UTC),  # 02:30 CEST
]
FALL = [
    datetime(2030, 10, 26, 0, 30, tzinfo=UTC),  # 02:30 CEST
    datetime(2030, 10, 27, 0, 30, tzinfo=UTC),  # the first 02:30 (CEST); not again at CET
    datetime(2030, 10, 28, 1, 30, tzinfo=UTC),  # 02:30 CET
]


@pytest.mark.parametrize(
    ("start", "expected"),
    [
        (datetime(2030, 3, 29, 12, tzinfo=UTC), SPRING),
        (datetime(2030, 10, 25, 12, tzinfo=UTC), FALL),
    ],
    ids=["spring-forward gap", "fall-back repeat"],
)
async def test_dst_in_both_directions(start: datetime, expected: list[datetime]) -> None:
    clock = FakeClock(start)
    async with await connect("memory://", registry=Registry([sync]), clock=clock) as engine:
        await engine.schedules.create(
            hourly(name="paris", cron="30 2 * * *", timezone="Europe/Paris")
        )
        for _ in range(3 * 24 * 4):  # three days, every quarter of an hour
            clock.advance(timedelta(minutes=15))
            await engine.schedules.run_due()
        assert await ticks_started(engine) == expected


def test_an_hourly_schedule_follows_real_time_across_both_changes() -> None:
    spec = CronSpec.parse("0 * * * *", "Europe/Paris")
    spring = spec.between(
        datetime(2030, 3, 30, 23, tzinfo=UTC), datetime(2030, 3, 31, 3, tzinfo=UTC), limit=10
    )
    fall = spec.between(
        datetime(2030, 10, 26, 23, tzinfo=UTC), datetime(2030, 10, 27, 3, tzinfo=UTC), limit=10
    )
    hour = timedelta(hours=1)
    assert spring == [datetime(2030, 3, 30, 23, tzinfo=UTC) + i * hour for i in range(5)]
    assert fall == [datetime(2030, 10, 26, 23, tzinfo=UTC) + i * hour for i in range(5)], (
        "the repeated hour is run twice"
    )


async def _cancel_all(engine: Engine) -> None:
    for run in (await engine.list(task_name=sync.name, status="pending")).runs:
        await engine.cancel(run.run_id, reason="test: finished")


# Nothing runs the runs in these tests: each stays pending, so a schedule's previous run is
# unfinished until the test cancels it.
@pytest.mark.parametrize(
    ("overlap", "expected"),
    [
        ("allow_all", {"started": 3, "skipped": 0, "buffered": 0, "canceled": 0}),
        ("skip", {"started": 1, "skipped": 2, "buffered": 0, "canceled": 0}),
        ("buffer_one", {"started": 1, "skipped": 1, "buffered": 2, "canceled": 0}),
        ("cancel_previous", {"started": 3, "skipped": 0, "buffered": 0, "canceled": 2}),
    ],
)
async def test_overlap_policies(
    engine: Engine, clock: FakeClock, overlap: OverlapPolicy, expected: dict[str, int]
) -> None:
    await engine.schedules.create(hourly(overlap=overlap))
    total = {"started": 0, "skipped": 0, "buffered": 0, "canceled": 0}
    for _ in range(3):  # three ticks while the first run never finishes
        clock.advance(timedelta(hours=1))
        report = await engine.schedules.run_due()
        for key in total:
            total[key] += getattr(report, key)
    assert total == expected
    info = await engine.schedules.get("hourly")
    assert info.last_tick == START + timedelta(hours=3)
    runs = (await engine.list(task_name=sync.name)).runs
    if overlap == "cancel_previous":
        assert sorted(r.status for r in runs) == ["canceled", "canceled", "pending"]
    if overlap == "buffer_one":
        assert info.buffered_tick == START + timedelta(hours=3), "the newest tick is kept"
        await _cancel_all(engine)  # the previous run ends: the buffered tick starts
        report = await engine.schedules.run_due()
        assert report.started == 1
        assert (await ticks_started(engine))[-1] == START + timedelta(hours=3)
        assert (await engine.schedules.get("hourly")).buffered_tick is None
    if overlap == "skip":
        await _cancel_all(engine)
        clock.advance(timedelta(hours=1))
        assert (await engine.schedules.run_due()).started == 1, "starts again once it ended"


async def test_after_downtime_only_the_last_missed_tick_runs_by_default(
    engine: Engine, clock: FakeClock
) -> None:
    await engine.schedules.create(hourly())
    await engine.schedules.create(hourly(name="window", catchup_window=timedelta(hours=3)))
    clock.advance(timedelta(hours=10, minutes=30))
    report = await engine.schedules.run_due()
    assert report.started == 1 + 3  # 10:00; and 08:00, 09:00, 10:00 (since 07:30)
    by_schedule: dict[str, list[datetime]] = {}
    for run in (await engine.list(task_name=sync.name)).runs:
        key = run.idempotency_key or ""
        tick = tick_of_key(key)
        assert tick is not None
        by_schedule.setdefault(key.split(":")[1], []).append(tick)
    assert by_schedule["hourly"] == [START + timedelta(hours=10)]
    assert sorted(by_schedule["window"]) == [START + timedelta(hours=h) for h in (8, 9, 10)]
    assert (await engine.schedules.get("hourly")).next_tick == START + timedelta(hours=11)


async def test_declaring_again_keeps_the_state_and_a_new_cron_moves_the_next_tick(
    clock: FakeClock,
) -> None:
    registry = Registry([sync], schedules=[hourly(overlap="skip")])
    async with await connect("memory://", registry=registry, clock=clock) as engine:
        [first] = await engine.schedules.declare()
        clock.advance(timedelta(hours=1))
        await engine.schedules.run_due()
        await engine.schedules.pause("hourly")
        [again] = await engine.schedules.declare()
        assert again.paused is True, "a declaration never resumes a schedule"
        assert again.last_tick == START + timedelta(hours=1)
        assert again.version == first.version + 2  # the pass and the pause; not the declare
        changed = await engine.schedules.create(hourly(overlap="skip", cron="15 */6 * * *"))
        assert changed.next_tick == START + timedelta(hours=6, minutes=15)
        assert changed.last_tick == again.last_tick
        assert changed.paused is True
        resumed = await engine.schedules.resume("hourly")
        assert resumed.paused is False


async def test_trigger_and_backfill(engine: Engine, clock: FakeClock) -> None:
    await engine.schedules.create(hourly(name="daily", cron="0 3 * * *"))
    handles = await engine.schedules.backfill(
        "daily", START - timedelta(days=3), START + timedelta(hours=3)
    )
    assert [h.created for h in handles] == [True, True, True]
    again = await engine.schedules.backfill(
        "daily", START - timedelta(days=3), START + timedelta(hours=4)
    )
    assert [h.run_id for h in again[:3]] == [h.run_id for h in handles], "a tick runs once"
    assert len(again) == 4
    assert again[3].created
    clock.advance(timedelta(minutes=7, seconds=30, microseconds=5))
    triggered = await engine.schedules.trigger("daily")
    async with engine.worker():
        out = await triggered.result(timeout=5)
    assert out == f"acme@{(START + timedelta(minutes=7, seconds=30)).isoformat()}"
    assert (await engine.schedules.get("daily")).last_run_id == triggered.run_id


async def test_bad_declarations_say_what_is_wrong(engine: Engine) -> None:
    with pytest.raises(UsageError, match=r"cron '0 3 \* \*'.*minute hour"):
        hourly(cron="0 3 * *")
    with pytest.raises(UsageError, match=r"unknown time zone 'Europe/Pariss'.*IANA"):
        hourly(timezone="Europe/Pariss")
    with pytest.raises(UsageError, match="overlap must be one of"):
        hourly(overlap="queue")
    with pytest.raises(PayloadError, match="tenant"):
        Schedule(name="bad-input", task=sync, cron="0 3 * * *", input={"tenant": 7})
    with pytest.raises(TaskDefinitionError, match=r"sched\.sync@1 is not registered"):
        Registry([other], schedules=[hourly()])
    with pytest.raises(UnknownTaskError, match=r"'nowhere' is not registered"):
        await engine.schedules.create(
            Schedule(name="ghost", task="nowhere", cron="0 3 * * *", input=None)
        )
    with pytest.raises(UsageError, match="made by umt only"):
        await engine.enqueue(sync, Sync("x"), idempotency_key="umt.schedule:hourly:x")
    with pytest.raises(UsageError, match=r"end .* must be after start"):
        await engine.schedules.backfill("hourly", START, START)


async def test_a_worker_runs_its_schedules(clock: FakeClock) -> None:
    registry = Registry([sync], schedules=[hourly()])
    engine = await connect("memory://", registry=registry, clock=clock)
    async with engine, engine.worker(poll_interval=timedelta(milliseconds=50)):
        for _ in range(200):  # the worker stores the declared schedule when it starts
            if await engine.schedules.list():
                break
            await asyncio.sleep(0.01)
        clock.advance(timedelta(hours=1))  # the loop wakes when the clock moves
        for _ in range(200):
            page = await engine.list(task_name=sync.name, status="completed")
            if page.runs:
                break
            await asyncio.sleep(0.01)
        assert [await engine.result(r.run_id) for r in page.runs] == [
            f"acme@{(START + timedelta(hours=1)).isoformat()}"
        ]


@pytest.mark.parametrize("minutes", range(0, 60, 5))
def test_ticks_around_a_start_inside_the_repeated_hour(minutes: int) -> None:
    """From 02:xx CET on 27 October (the second 02:xx, fold=1), cronsim by itself walks by wall
    time: forward it gave back 02:30 CEST, an hour *before* the start, and backward it stepped
    over that tick to the day before (found by tests/properties/test_schedule_properties.py)."""
    spec = CronSpec.parse("30 2 * * *", "Europe/Paris")
    moment = datetime(2030, 10, 27, 1, minutes, tzinfo=UTC)  # 02:mm CET
    assert spec.next_after(moment) == datetime(2030, 10, 28, 1, 30, tzinfo=UTC)
    assert spec.last_at_or_before(moment) == datetime(2030, 10, 27, 0, 30, tzinfo=UTC)
