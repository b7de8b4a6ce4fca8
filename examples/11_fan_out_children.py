"""A parent run that starts one child per tenant and gathers what they return.

Run it: `python examples/11_fan_out_children.py` (memory backend, a virtual clock).

`sync_all` starts a `sync_tenant` child per tenant with `ctx.step.start_child` (each child is
created exactly once, even if the parent crashes in between), then awaits each handle: the
parent is parked, its worker slot freed, until the child finishes, and the child's ending
wakes it. One tenant's sync fails; the parent gets `ChildFailedError` for it and goes on. Then
a second parent is canceled while its children wait for an approval: its children are
canceled with it (`parent_close="cancel"`, the default).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from attrs import frozen

from umt_sdk import ChildFailedError, Registry, TaskContext, connect, task
from umt_sdk.testing import FakeClock


@frozen
class Tenant:
    id: int
    needs_approval: bool = False


@task("sync_tenant")
async def sync_tenant(ctx: TaskContext[Tenant]) -> int:
    tenant = ctx.input
    if tenant.needs_approval:
        await ctx.step.wait_for_fact("approved")
    await ctx.step.sleep("rate-limit", timedelta(minutes=tenant.id))  # costs nothing here
    if tenant.id == 3:
        raise RuntimeError("tenant 3's API is down")
    rows: int = await ctx.step.run("copy", lambda: 100 * tenant.id)
    return rows


@task("sync_all")
async def sync_all(ctx: TaskContext[list[Tenant]]) -> dict[str, str]:
    handles = [
        (tenant.id, await ctx.step.start_child(f"sync-{tenant.id}", sync_tenant, tenant))
        for tenant in ctx.input
    ]
    outcome: dict[str, str] = {}  # JSON object keys are strings
    for tenant_id, handle in handles:
        try:
            outcome[f"tenant-{tenant_id}"] = f"{await handle.result()} rows"
        except ChildFailedError as exc:
            outcome[f"tenant-{tenant_id}"] = f"failed: {exc.error_message}"
    return outcome


async def main() -> None:
    clock = FakeClock(auto_advance=True)
    engine = await connect("memory://", registry=Registry([sync_all, sync_tenant]), clock=clock)
    async with engine, engine.worker(concurrency=2):
        run = await engine.enqueue(sync_all, [Tenant(1), Tenant(2), Tenant(3), Tenant(4)])
        outcome = await run.result(timeout=10)
        print("sync_all:", outcome)
        assert outcome == {
            "tenant-1": "100 rows",
            "tenant-2": "200 rows",
            "tenant-3": "failed: tenant 3's API is down",
            "tenant-4": "400 rows",
        }
        children = (await engine.list(parent=run.run_id)).runs
        print("children:", sorted((c.status, c.task_name) for c in children))
        assert len(children) == 4

        waiting = await engine.enqueue(sync_all, [Tenant(5, needs_approval=True)])
        for _ in range(1000):  # until its child waits for the approval
            children = (await engine.list(parent=waiting.run_id, status="waiting")).runs
            if children:
                break
            await asyncio.sleep(0.01)
        [child] = children
        print("cancel the second parent:", await engine.cancel(waiting.run_id, reason="stop"))
        info = await engine.get(child.run_id)
        print(f"its child: {info.status} ({info.cancel_reason})")
        assert info.status == "canceled"


if __name__ == "__main__":
    asyncio.run(main())
