"""Debounce on the memory backend's virtual clock: a burst of triggers starts one run with the
last input `period` after the last trigger, never later than `max_wait` after the first; the
claim offers nothing before that time and the run at it."""

from __future__ import annotations

from datetime import timedelta

import attrs

from umt_sdk import Debounce, Engine, Registry, TaskContext, connect, task
from umt_sdk.backend import TaskPair
from umt_sdk.testing import FakeClock

MINUTE = timedelta(minutes=1)


@attrs.frozen
class Change:
    n: int


@task("unit.debounced", version=1)
async def recompute(ctx: TaskContext[Change]) -> int:  # pragma: no cover - never executed
    return ctx.input.n


PAIR = TaskPair(name="unit.debounced", version=1)


async def _claimable(engine: Engine) -> list[str]:
    claimed = await engine.backend.claim(
        worker_id="unit", pairs=[PAIR], limit=10, lease=timedelta(seconds=30)
    )
    return [c.input_json for c in claimed]


async def test_a_burst_starts_once_max_wait_after_the_first_trigger() -> None:
    clock = FakeClock()
    engine = await connect("memory://", registry=Registry([recompute]), clock=clock)
    debounce = Debounce("tenant-7", period=5 * MINUTE, max_wait=12 * MINUTE)
    first = await engine.enqueue(recompute, Change(n=0), debounce=debounce)
    elapsed = 0
    for n, at in enumerate((4, 8, 11), start=1):  # minutes after the first trigger
        clock.advance((at - elapsed) * MINUTE)
        elapsed = at
        again = await engine.enqueue(recompute, Change(n=n), debounce=debounce)
        assert (again.created, again.run_id) == (False, first.run_id)
    # Quiet from 11 min on: 16 min by the period, but 12 min by max_wait.
    clock.advance(timedelta(seconds=59))  # 11:59
    assert await _claimable(engine) == []
    clock.advance(timedelta(seconds=1))  # 12:00
    assert await _claimable(engine) == ['{"n":3}']
    # It started: the next trigger opens a new window.
    later = await engine.enqueue(recompute, Change(n=4), debounce=debounce)
    assert later.created
    await engine.close()


async def test_without_max_wait_the_run_starts_a_period_after_the_last_trigger() -> None:
    clock = FakeClock()
    engine = await connect("memory://", registry=Registry([recompute]), clock=clock)
    debounce = Debounce("tenant-8", period=5 * MINUTE)
    first = await engine.enqueue(recompute, Change(n=0), debounce=debounce)
    clock.advance(4 * MINUTE)
    again = await engine.enqueue(recompute, Change(n=1), debounce=debounce)
    assert again.run_id == first.run_id
    clock.advance(5 * MINUTE - timedelta(seconds=1))  # 8:59
    assert await _claimable(engine) == []
    clock.advance(timedelta(seconds=1))  # 9:00
    assert await _claimable(engine) == ['{"n":1}']
    await engine.close()
