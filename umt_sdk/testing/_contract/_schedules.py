"""Schedules: the store keeps them as the SDK wrote them, first write wins for a name, an
update lands only on the version it was read at, and a due tick makes one run that knows its
tick (`ctx.scheduled_at`). For a backend that implements `umt_sdk.backend.ScheduleStore`."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import pytest

from umt_sdk import (
    Engine,
    Schedule,
    ScheduleNotFoundError,
    TaskContext,
    TaskDefinition,
    task,
)
from umt_sdk._cron import tick_of_key
from umt_sdk._spi import ScheduleQuery, ScheduleState, ScheduleStore
from umt_sdk.testing._contract._base import Job, current_tally, wait_until
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["SchedulesContract"]


@task("contract.scheduled", version=1)
async def scheduled_task(ctx: TaskContext[Job]) -> str:
    current_tally().order.append(f"scheduled:{ctx.input.key}")
    return "" if ctx.scheduled_at is None else ctx.scheduled_at.isoformat()


TASKS: tuple[TaskDefinition[Any, Any], ...] = (scheduled_task,)
"""The tasks of this topic that the suite's engine registers."""

_PAST = datetime(2020, 1, 1, tzinfo=UTC)
_FUTURE = datetime(2999, 1, 1, tzinfo=UTC)


def _store(engine: Engine) -> ScheduleStore:
    backend = engine.backend
    if not isinstance(backend, ScheduleStore):
        pytest.skip(f"{type(backend).__name__} does not implement ScheduleStore (optional)")
    return backend


def _state(name: str, **changes: Any) -> ScheduleState:
    fields: dict[str, Any] = {
        "name": name,
        "task_name": scheduled_task.name,
        "cron": "0 3 * * *",
        "timezone": "Europe/Paris",
        "input_json": json.dumps({"key": name, "n": 1}),
        "overlap": "skip",
        "catchup_window": timedelta(hours=2),
        "next_tick": _FUTURE,
    }
    return ScheduleState(**{**fields, **changes})


def _same(stored: ScheduleState, written: ScheduleState) -> bool:
    """Stored as written: JSON compared as JSON (a store may normalize its text)."""
    if json.loads(stored.input_json) != json.loads(written.input_json):
        return False
    return attrs.evolve(stored, input_json=written.input_json) == written


class SchedulesContract:
    """A backend that stores schedules keeps the SDK's rows and checks two conditions."""

    async def test_schedule_store_first_write_wins_and_updates_compare_and_set(
        self, engine: Engine
    ) -> None:
        store = _store(engine)
        first = _state("cas", last_tick=_PAST, last_run_id=None, buffered_tick=None)
        assert await store.create_schedule(first) is True
        assert await store.create_schedule(_state("cas", cron="*/5 * * * *")) is False, (
            "first write wins for a schedule's name"
        )
        record = await store.get_schedule("cas")
        assert record is not None
        assert record.version == 1
        assert _same(record.state, first), record.state
        assert record.observed_at.tzinfo is not None

        moved = attrs.evolve(first, next_tick=_PAST, paused=True, last_tick=_PAST)
        assert await store.update_schedule(moved, expected_version=1) is True
        stale = attrs.evolve(first, cron="*/5 * * * *")
        assert await store.update_schedule(stale, expected_version=1) is False, (
            "an update made from an older version must be refused"
        )
        record = await store.get_schedule("cas")
        assert record is not None
        assert record.version == 2
        assert _same(record.state, moved), record.state
        assert await store.update_schedule(_state("nobody"), expected_version=1) is False

        assert await store.delete_schedule("cas") is True
        assert await store.delete_schedule("cas") is False
        assert await store.get_schedule("cas") is None

    async def test_list_schedules_filters_by_task_and_by_due(self, engine: Engine) -> None:
        store = _store(engine)
        for state in (
            _state("list-due", next_tick=_PAST),
            _state("list-future", next_tick=_FUTURE),
            _state("list-paused", next_tick=_PAST, paused=True),
            _state("list-buffered", next_tick=_FUTURE, buffered_tick=_PAST),
            _state("list-other", task_name="contract.echo", next_tick=_PAST),
        ):
            assert await store.create_schedule(state)
        everything = await store.list_schedules(ScheduleQuery())
        assert [r.state.name for r in everything] == sorted(r.state.name for r in everything)
        assert {r.state.name for r in everything} >= {
            "list-due",
            "list-future",
            "list-paused",
            "list-buffered",
            "list-other",
        }
        mine = await store.list_schedules(ScheduleQuery(task_names=[scheduled_task.name]))
        assert {r.state.name for r in mine} == {
            "list-due",
            "list-future",
            "list-paused",
            "list-buffered",
        }
        due = await store.list_schedules(
            ScheduleQuery(task_names=[scheduled_task.name], due_only=True)
        )
        assert [r.state.name for r in due] == ["list-buffered", "list-due"]

    async def test_pause_resume_and_delete_through_the_engine(self, engine: Engine) -> None:
        _store(engine)
        nightly = Schedule(
            name="contract-nightly",
            task=scheduled_task,
            cron="0 3 * * *",
            input=Job(key="nightly"),
            timezone="Europe/Paris",
        )
        created = await engine.schedules.create(nightly)
        assert created.paused is False
        assert created.next_tick.astimezone(UTC).hour in (1, 2)  # 03:00 Paris, winter or summer
        assert await engine.schedules.create(nightly) == created, "declaring again changes nothing"
        paused = await engine.schedules.pause("contract-nightly")
        assert paused.paused is True
        assert (await engine.schedules.create(nightly)).paused is True, (
            "a declaration never resumes a paused schedule"
        )
        assert (await engine.schedules.resume("contract-nightly")).paused is False
        listed = await engine.schedules.list(task_name=scheduled_task.name)
        assert [s.name for s in listed] == ["contract-nightly"]
        assert await engine.schedules.delete("contract-nightly") is True
        with pytest.raises(ScheduleNotFoundError, match="contract-nightly"):
            await engine.schedules.get("contract-nightly")

    async def test_due_ticks_make_one_run_each_whoever_races(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _store(engine)
        await engine.schedules.create(
            Schedule(
                name="contract-every-second",
                task=scheduled_task,
                cron="* * * * * *",
                input=Job(key="tick"),
                overlap="allow_all",
                catchup_window=timedelta(minutes=1),
            )
        )
        await harness.advance(timedelta(seconds=2.5))
        reports = await asyncio.gather(*(engine.schedules.run_due() for _ in range(5)))
        assert sum(r.started for r in reports) >= 2, reports
        runs = (await engine.list(task_name=scheduled_task.name)).runs
        ticks = Counter(tick_of_key(r.idempotency_key) for r in runs)
        assert None not in ticks, "every scheduled run's key names its tick"
        assert len(ticks) >= 2
        assert max(ticks.values()) == 1, f"one run per tick: {ticks}"
        info = await engine.schedules.get("contract-every-second")
        assert info.last_tick == max(t for t in ticks if t is not None)
        assert info.next_tick > info.last_tick

    async def test_a_scheduled_run_reads_its_tick(self, engine: Engine) -> None:
        _store(engine)
        await engine.schedules.create(
            Schedule(
                name="contract-trigger",
                task=scheduled_task,
                cron="0 3 * * *",
                input=Job(key="trigger"),
            )
        )
        handle = await engine.schedules.trigger("contract-trigger")
        plain = await engine.enqueue(scheduled_task, Job(key="plain"))
        async with engine.worker():
            tick = await handle.result(timeout=15)
            assert await plain.result(timeout=15) == "", "a run no schedule started has none"
        info = await wait_until(engine, handle.run_id, lambda i: i.status == "completed")
        expected = tick_of_key(info.idempotency_key)
        assert expected is not None
        assert tick == expected.isoformat()
        assert (await engine.schedules.get("contract-trigger")).last_run_id == handle.run_id
