"""Fairness keys: one tenant's backlog does not hold up another tenant's run.

Run it: `python examples/27_fairness.py` (the memory backend; on Postgres the same turns are
taken in the claim, across every worker).

A reporting service renders reports for its tenants. "bulk-co" re-renders its whole archive
(500 reports at once); a minute later "acme" asks for one report. Without fairness keys the
claim serves runs in enqueue order, and acme waits for the whole archive. With
`fairness_key=tenant`, tenants take turns: acme's run starts in the next turn.

`weight=` gives a tenant a larger share while tenants have a backlog: "pro-co" (weight 3)
gets three runs for each of "free-co"'s (weight 1).
"""

from __future__ import annotations

import asyncio
from collections import Counter

from attrs import frozen

from umt_sdk import Registry, TaskContext, connect, task


@frozen
class Report:
    tenant: str
    n: int


rendered: list[str] = []


@task("render_report", version=1)
async def render_report(ctx: TaskContext[Report]) -> str:
    def render() -> None:
        rendered.append(ctx.input.tenant)

    await ctx.step.run("render", render)
    return f"{ctx.input.tenant} report {ctx.input.n}"


async def archive_then_one_report(*, fair: bool) -> int:
    """How many reports were rendered before acme's (its position in the order)."""
    rendered.clear()
    async with await connect("memory://", registry=Registry([render_report])) as engine:
        for n in range(500):
            await engine.enqueue(
                render_report, Report("bulk-co", n), fairness_key="bulk-co" if fair else None
            )
        acme = await engine.enqueue(
            render_report, Report("acme", 0), fairness_key="acme" if fair else None
        )
        async with engine.worker(concurrency=4):
            print("   ", await acme.result(timeout=30))
        return rendered.index("acme")


async def weighted_shares() -> Counter[str]:
    """The first 40 reports rendered while two tenants have a backlog of 100 each."""
    rendered.clear()
    async with await connect("memory://", registry=Registry([render_report])) as engine:
        handles = []
        for n in range(100):
            for tenant, weight in (("free-co", 1), ("pro-co", 3)):
                handles.append(
                    await engine.enqueue(
                        render_report, Report(tenant, n), fairness_key=tenant, weight=weight
                    )
                )
        async with engine.worker(concurrency=8):
            for handle in handles:
                await handle.result(timeout=30)
        return Counter(rendered[:40])


async def main() -> None:
    print("500 bulk-co reports, then one acme report, on 4 worker slots:")
    before = await archive_then_one_report(fair=False)
    print(f"  in enqueue order: acme's report was rendered after {before} others")
    after = await archive_then_one_report(fair=True)
    print(f"  with fairness_key=tenant: after {after} others (its turn came next)")
    assert before == 500, before
    assert after <= 4, after

    shares = await weighted_shares()
    print(f"pro-co (weight 3) and free-co (weight 1), first 40 reports: {dict(shares)}")
    assert shares["pro-co"] > shares["free-co"], shares


if __name__ == "__main__":
    asyncio.run(main())
