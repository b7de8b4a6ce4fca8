"""Flow control: one tenant's burst does not fill every worker (concurrency keys).

Run it: `python examples/14_flow_control.py` (the memory backend; on Postgres the same code
enforces the limit across every worker process and host, in the claim).

- `Concurrency(key=..., limit=2)` on `@task`: at most two runs of a tenant at once; the key is
  computed from the input when the run is enqueued;
- a burst of 12 runs from tenant "acme" waits its turn, two at a time, while the runs of
  "globex" and "initech" go through at once: a full key never holds up another;
- `strategy="keep_newest"`: a burst of "recompute the totals" requests for one tenant runs the
  newest only, the older ones still queued are canceled (a debounce).
"""

from __future__ import annotations

import asyncio
from collections import Counter

from attrs import frozen

from umt_sdk import Concurrency, Registry, TaskContext, connect, task


@frozen
class Export:
    tenant: str
    n: int


inside: Counter[str] = Counter()
most: Counter[str] = Counter()


@task("export", version=1, concurrency=Concurrency(key=lambda e: e.tenant, limit=2))
async def export(ctx: TaskContext[Export]) -> str:
    async def write_file() -> None:
        inside[ctx.input.tenant] += 1
        most[ctx.input.tenant] = max(most[ctx.input.tenant], inside[ctx.input.tenant])
        await asyncio.sleep(0.02)  # the slow part: an API, a file upload
        inside[ctx.input.tenant] -= 1

    await ctx.step.run("write_file", write_file)
    return f"{ctx.input.tenant} #{ctx.input.n}"


@frozen
class Totals:
    tenant: str
    change: int


@task(
    "recompute_totals",
    version=1,
    concurrency=Concurrency(key=lambda t: t.tenant, limit=1, strategy="keep_newest"),
)
async def recompute_totals(ctx: TaskContext[Totals]) -> str:
    return f"totals of {ctx.input.tenant} after change {ctx.input.change}"


async def main() -> None:
    async with await connect("memory://", registry=Registry([export, recompute_totals])) as engine:
        burst = [await engine.enqueue(export, Export(tenant="acme", n=i)) for i in range(12)]
        others = [
            await engine.enqueue(export, Export(tenant=tenant, n=0))
            for tenant in ("globex", "initech")
        ]
        async with engine.worker(concurrency=16):
            # The other tenants finish while acme's burst is still going, two at a time.
            for handle in others:
                print("done:", await handle.result(timeout=10))
            left = [(await engine.get(h.run_id)).status for h in burst].count("pending")
            print(f"acme runs still waiting their turn when the others were done: {left}")
            for handle in burst:
                await handle.result(timeout=10)
            print("most runs of one tenant at once:", dict(sorted(most.items())))
            assert max(most.values()) <= 2

        # No worker: five changes for one tenant in a burst; only the newest is kept.
        changes = [
            await engine.enqueue(recompute_totals, Totals(tenant="acme", change=i))
            for i in range(5)
        ]
        statuses = [(await engine.get(h.run_id)).status for h in changes]
        print("after the burst:", statuses)
        async with engine.worker():
            print(await changes[-1].result(timeout=10))


if __name__ == "__main__":
    asyncio.run(main())
