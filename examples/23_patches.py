"""Change a task's code under its running runs: `ctx.patched`, then `ctx.deprecate_patch`,
checked before each deploy with the deploy check (`umt check`).

Run it: `python examples/23_patches.py`. It prints what happened and exits 0.

Yesterday's release runs `checkout@1`: quote the order, wait (days) for its payment, ship.
Today's adds a fraud check. Bumping the version would leave the parked runs on yesterday's
code until they drain; a patch changes the code for every run that has not reached that point
yet, and keeps the old code for the runs already past it:

    if await ctx.patched("fraud-check"):
        await ctx.step.run("fraud-check", score_fraud, ctx.input)

Before each deploy, the check replays every live run against the new code (here in process;
in CI `umt check --registry app.tasks:registry --against postgresql://...`):
1. the patched release passes; `--unpatched fraud-check` lists the runs on the old branch;
2. a release that adds the fraud check *without* a patch is refused, naming the runs;
3. the runs finish: the parked ones without the check, the new ones with it;
4. once no live run takes the old branch, `deprecate_patch` keeps only the new code.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import attrs

from umt_sdk import Engine, Registry, RunHandle, TaskContext, connect, task
from umt_sdk.testing import FakeClock, check_deploy, live_histories


@attrs.frozen
class Order:
    order_id: str
    amount_cents: int


FRAUD_CHECKS: list[str] = []


async def quote(order: Order) -> int:
    return order.amount_cents


async def score_fraud(order: Order) -> float:
    FRAUD_CHECKS.append(order.order_id)
    return 0.1


async def ship(order_id: str) -> str:
    return f"shipped {order_id}"


@task("checkout", version=1)
async def checkout_yesterday(ctx: TaskContext[Order]) -> str:
    amount = await ctx.step.run("quote", quote, ctx.input)
    await ctx.step.wait_for_fact("paid", timeout=timedelta(days=2))
    return f"{await ctx.step.run('ship', ship, ctx.input.order_id)} ({amount})"


@task("checkout", version=1)
async def checkout_unpatched(ctx: TaskContext[Order]) -> str:
    """The fraud check added in place: the parked runs would replay into it."""
    amount = await ctx.step.run("quote", quote, ctx.input)
    await ctx.step.run("fraud-check", score_fraud, ctx.input)
    await ctx.step.wait_for_fact("paid", timeout=timedelta(days=2))
    return f"{await ctx.step.run('ship', ship, ctx.input.order_id)} ({amount})"


@task("checkout", version=1)
async def checkout_today(ctx: TaskContext[Order]) -> str:
    """The fraud check behind a patch: new runs only."""
    amount = await ctx.step.run("quote", quote, ctx.input)
    if await ctx.patched("fraud-check"):
        await ctx.step.run("fraud-check", score_fraud, ctx.input)
    await ctx.step.wait_for_fact("paid", timeout=timedelta(days=2))
    return f"{await ctx.step.run('ship', ship, ctx.input.order_id)} ({amount})"


@task("checkout", version=1)
async def checkout_tomorrow(ctx: TaskContext[Order]) -> str:
    """The old branch gone; the marker still recorded for workers of today's release."""
    amount = await ctx.step.run("quote", quote, ctx.input)
    await ctx.deprecate_patch("fraud-check")
    await ctx.step.run("fraud-check", score_fraud, ctx.input)
    await ctx.step.wait_for_fact("paid", timeout=timedelta(days=2))
    return f"{await ctx.step.run('ship', ship, ctx.input.order_id)} ({amount})"


async def park(engine: Engine, definition: Any, orders: list[str]) -> list[RunHandle[str]]:
    """Start a checkout per order and let it run until it waits for its payment."""
    handles = [await engine.enqueue(definition, Order(o, 2500)) for o in orders]
    async with engine.worker():
        for handle in handles:
            info = await engine.get(handle.run_id)
            while info.status != "waiting":
                await asyncio.sleep(0.01)
                info = await engine.get(handle.run_id)
    return handles


async def deploy_check(engine: Engine, release: Registry, name: str) -> bool:
    report = await check_deploy(release, await live_histories(engine))
    print(f"   umt check ({name}): {report.summary()}")
    for failure in report.failures[:1]:
        print("\n".join(f"     {line}" for line in failure.summary().splitlines()[:5]))
    return report.ok


async def main() -> None:
    clock = FakeClock(auto_advance=True)
    engine = await connect("memory://", registry=Registry([checkout_yesterday]), clock=clock)
    await park(engine, checkout_yesterday, ["o-1", "o-2"])
    print("0. yesterday's release: o-1 and o-2 quoted, parked on their payment")

    print("1. today's release, the fraud check behind ctx.patched('fraud-check'):")
    today = Registry([checkout_today])
    assert await deploy_check(engine, today, "patched")
    report = await check_deploy(today, await live_histories(engine))
    unpatched = [str(r.run_id) for r in report.unpatched("fraud-check")]
    print(f"   --unpatched fraud-check: {len(unpatched)} run(s) keep the old branch")
    assert len(unpatched) == 2

    print("2. the same check added without a patch:")
    assert not await deploy_check(engine, Registry([checkout_unpatched]), "unpatched")
    print("   -> refused: the parked runs recorded `paid` where the code now asks for the check")

    print("3. today's release deployed; o-3 starts on it; every payment arrives:")
    engine = Engine(engine.backend, today)
    fresh = await engine.enqueue(checkout_today, Order("o-3", 4200))
    for run in (await engine.list(task_name="checkout")).runs:
        await engine.signal(run.run_id, "paid", {"by": "card"})
    async with engine.worker():
        for run in sorted((await engine.list(task_name="checkout")).runs, key=lambda r: r.run_id):
            print(f"   {await engine.result(run.run_id, timeout=5)}")
    history = await engine.export_history(fresh.run_id)
    print(f"   fraud checks: {FRAUD_CHECKS}; o-3 recorded {[s.name for s in history.steps]}")
    assert FRAUD_CHECKS == ["o-3"]
    (parked,) = await park(engine, checkout_today, ["o-4"])  # past its fraud check

    print("4. no live run takes the old branch any more: deprecate_patch ships")
    tomorrow = Registry([checkout_tomorrow])
    report = await check_deploy(tomorrow, await live_histories(engine))
    assert report.ok
    assert not report.unpatched("fraud-check")
    print(f"   umt check (deprecated): {report.summary()}; --unpatched lists none")
    engine = Engine(engine.backend, tomorrow)
    late = await engine.enqueue(checkout_tomorrow, Order("o-5", 2500))
    for handle in (parked, late):
        await engine.signal(handle.run_id, "paid", {"by": "card"})
    async with engine.worker():
        for handle in (parked, late):
            print(f"   {await engine.result(handle.run_id, timeout=5)}")
    print(f"   fraud checks: {FRAUD_CHECKS} (o-4's replayed from its record)")
    assert FRAUD_CHECKS == ["o-3", "o-4", "o-5"]
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
