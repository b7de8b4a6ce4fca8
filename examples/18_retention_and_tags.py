"""Tags to find runs by tenant, and retention that deletes the old ones in the background.

Run it: `python examples/18_retention_and_tags.py` (the memory backend and a `FakeClock`: two
months in well under a second). On Postgres the same code deletes in batches of 500, one worker
at a time, and each list reads about a page of index entries however many runs there are.

- `enqueue(..., tags={"tenant": ...})` labels a run; `engine.list(tags=...)` finds them;
- `connect(retention=timedelta(days=30))`: the workers delete finished runs older than that
  (pending, running and waiting runs never); `@task(retention=...)` sets a task's own;
- a pruned run leaves a tombstone: its idempotency key still names it, and reading it raises
  `RunPrunedError`, saying when it finished and when it was deleted.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from attrs import frozen

from umt_sdk import Registry, RunPrunedError, TaskContext, connect, task
from umt_sdk.testing import FakeClock


@frozen
class Invoice:
    tenant: str
    number: int


@task("send_invoice", version=1)
async def send_invoice(ctx: TaskContext[Invoice]) -> str:
    await ctx.step.run("send", lambda: None)
    return f"invoice {ctx.input.number} of {ctx.input.tenant} sent"


@task("audit_invoice", version=1, retention=timedelta(days=365))  # audits: kept a year
async def audit_invoice(ctx: TaskContext[Invoice]) -> str:
    return f"invoice {ctx.input.number} audited"


async def main() -> None:
    clock = FakeClock(auto_advance=True)
    registry = Registry([send_invoice, audit_invoice])
    engine = await connect(
        "memory://", registry=registry, clock=clock, retention=timedelta(days=30)
    )
    async with engine, engine.worker(prune_interval=timedelta(seconds=1)):
        first = await engine.enqueue(
            send_invoice, Invoice("t7", 1), idempotency_key="invoice-1", tags={"tenant": "t7"}
        )
        for number, tenant in ((2, "t8"), (3, "t7")):
            await engine.enqueue(send_invoice, Invoice(tenant, number), tags={"tenant": tenant})
        audit = await engine.enqueue(audit_invoice, Invoice("t7", 1), tags={"tenant": "t7"})
        print(await first.result(timeout=10))
        await audit.result(timeout=10)

        page = await engine.list(tags={"tenant": "t7"})
        print(f"tenant t7 has {len(page.runs)} runs:", [r.task_name for r in page.runs])

        clock.advance(timedelta(days=45))  # the workers' next pass finds them old
        for _ in range(500):
            if len(await engine.list(task_name="send_invoice")) == 0:
                break
            await asyncio.sleep(0.01)
        left = [r.task_name for r in await engine.list()]
        print("45 days later, what is left:", left)

        try:
            await engine.get(first.run_id)
        except RunPrunedError as exc:
            print(f"reading invoice 1: {type(exc).__name__}: {exc.status}, pruned {exc.pruned_at}")
        again = await engine.enqueue(
            send_invoice, Invoice("t7", 1), idempotency_key="invoice-1", tags={"tenant": "t7"}
        )
        print(
            f"enqueued again under its key: the same run ({again.run_id == first.run_id}), "
            f"not sent twice ({not again.created})"
        )


if __name__ == "__main__":
    asyncio.run(main())
