"""Unit-testing a two-day approval flow in milliseconds: the memory backend and `FakeClock`.

Run it: `python examples/07_testing_with_fakeclock.py`, or as tests:
`pytest examples/07_testing_with_fakeclock.py` (with pytest-asyncio in auto mode, i.e.
`asyncio_mode = "auto"`; otherwise mark each test `@pytest.mark.asyncio`).

The task under test waits up to two days for a manager's decision, escalates if none comes, and
pays approved expenses after a 12-hour payout window. The memory backend runs the real engine in
process; `FakeClock(auto_advance=True)` jumps to the next timer whenever every run is blocked and
the test awaits a result, and `clock.advance(...)` moves time by hand.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

from umt_sdk import Engine, FactTimeoutError, Registry, TaskContext, connect, task
from umt_sdk.testing import FakeClock

ESCALATED: list[str] = []  # stands in for the e-mail the escalation step would send


@task("expense_approval", version=1)
async def expense_approval(ctx: TaskContext[str]) -> str:
    try:
        decision: dict[str, Any] = await ctx.step.wait_for_fact(
            "decision", timeout=timedelta(days=2)
        )
    except FactTimeoutError:
        await ctx.step.run("escalate", lambda: ESCALATED.append(ctx.input))
        return "escalated"
    if not decision["approved"]:
        return "rejected"
    await ctx.step.sleep("payout-window", timedelta(hours=12))
    return f"paid {ctx.input}"


async def start_engine() -> tuple[Engine, FakeClock]:
    """What a fixture would do: a fresh engine on its own virtual clock."""
    clock = FakeClock(auto_advance=True)
    return await connect("memory://", registry=Registry([expense_approval]), clock=clock), clock


async def test_approved_on_day_one_is_paid_after_the_window() -> None:
    engine, clock = await start_engine()
    start = clock.now()
    run = await engine.enqueue(expense_approval, "exp-1")
    async with engine.worker():
        info = await engine.get(run.run_id)
        while info.waiting_for != "decision":  # until the run is parked on its fact
            await asyncio.sleep(0.001)
            info = await engine.get(run.run_id)
        clock.advance(timedelta(days=1))  # the manager takes a day
        await engine.signal(run.run_id, "decision", {"approved": True})
        assert await run.result(timeout=5) == "paid exp-1"
    assert clock.now() - start == timedelta(days=1, hours=12)
    info = await engine.get(run.run_id)
    assert [(s.name, s.kind) for s in info.timeline] == [
        ("decision", "fact"),
        ("payout-window", "sleep"),
    ]
    await engine.close()


async def test_no_decision_escalates_after_two_days() -> None:
    engine, clock = await start_engine()
    start = clock.now()
    run = await engine.enqueue(expense_approval, "exp-2")
    async with engine.worker():
        assert await run.result(timeout=5) == "escalated"  # auto_advance: two days pass
    assert clock.now() - start == timedelta(days=2)
    assert ESCALATED == ["exp-2"]
    await engine.close()


async def test_rejection_sent_before_the_run_starts() -> None:
    engine, _ = await start_engine()
    run = await engine.enqueue(expense_approval, "exp-3")
    await engine.signal(run.run_id, "decision", {"approved": False})  # kept until it is read
    async with engine.worker():
        assert await run.result(timeout=5) == "rejected"
    await engine.close()


if __name__ == "__main__":
    for test in (
        test_approved_on_day_one_is_paid_after_the_window,
        test_no_decision_escalates_after_two_days,
        test_rejection_sent_before_the_run_starts,
    ):
        started = time.perf_counter()
        asyncio.run(test())
        print(f"ok  {test.__name__}  ({(time.perf_counter() - started) * 1000:.0f} ms)")
