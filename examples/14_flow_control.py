"""Flow control: one tenant's burst does not fill every worker (concurrency keys), and an
API's rate limit is kept by every worker together (rate limits).

Run it: `python examples/14_flow_control.py` (the memory backend; on Postgres the same code
enforces the limit across every worker process and host, in the claim).

- `Concurrency(key=..., limit=2)` on `@task`: at most two runs of a tenant at once; the key is
  computed from the input when the run is enqueued;
- a burst of 12 runs from tenant "acme" waits its turn, two at a time, while the runs of
  "globex" and "initech" go through at once: a full key never holds up another;
- `strategy="keep_newest"`: a burst of "recompute the totals" requests for one tenant runs the
  newest only, the older ones still queued are canceled (a debounce);
- `RateLimit("digests", limit=3, per=timedelta(minutes=1), key=...)` on `@task`: a tenant's
  digests start three at once, then one every 20 seconds (a token bucket per tenant), on a
  virtual clock here; `rate_limit=MAIL_API` on a step: every send of every tenant shares the
  mail API's 5 per second; `engine.rate_limits.set(...)` raises a limit at run time.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta

from attrs import frozen

from umt_sdk import Concurrency, RateLimit, Registry, TaskContext, connect, task
from umt_sdk.testing import FakeClock


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


@frozen
class Digest:
    tenant: str
    n: int


MAIL_API = RateLimit("mail_api", limit=5, per=timedelta(seconds=1))
"""Shared by every step that sends mail, on every worker."""

sent: list[str] = []


@task(
    "send_digest",
    version=1,
    rate_limit=RateLimit("digests", limit=3, per=timedelta(minutes=1), key=lambda d: d.tenant),
)
async def send_digest(ctx: TaskContext[Digest]) -> str:
    def send() -> None:
        sent.append(f"{ctx.input.tenant} #{ctx.input.n}")

    await ctx.step.run("send", send, rate_limit=MAIL_API)
    return f"digest {ctx.input.n} of {ctx.input.tenant}"


async def rate_limits() -> None:
    clock = FakeClock(auto_advance=True)  # jumps to the next token instead of waiting for it
    start = clock.now()
    registry = Registry([send_digest])
    async with await connect("memory://", registry=registry, clock=clock) as engine:
        digests = [await engine.enqueue(send_digest, Digest("acme", i)) for i in range(6)]
        digests.append(await engine.enqueue(send_digest, Digest("globex", 0)))
        async with engine.worker(concurrency=8):
            began = []
            for handle in digests:
                await handle.result(timeout=10)
                info = await engine.get(handle.run_id)
                began.append((info.executions[0].claimed_at - start).total_seconds())
                print(f"{info.output_json} started at +{began[-1]:g}s")
            assert began[:3] == [0, 0, 0], "a burst of three"
            assert began[3] >= 20, "then one every 20 seconds"
            # Six a minute from now on: the tokens taken stay taken, the rest come faster.
            stored = await engine.rate_limits.set("digests", limit=6, per=timedelta(minutes=1))
            print(f"digests now {stored.limit} per minute (one every {stored.interval})")
            more = [await engine.enqueue(send_digest, Digest("acme", i)) for i in range(6, 9)]
            for handle in more:
                await handle.result(timeout=10)
        print(
            "stored limits:",
            [(i.name, i.limit, str(i.per)) for i in await engine.rate_limits.list()],
        )
        print("mail sent:", len(sent))


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
    await rate_limits()


if __name__ == "__main__":
    asyncio.run(main())
