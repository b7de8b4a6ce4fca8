"""Changing a task while its runs are in flight: v1 and v2, and one worker group for each.

Run it: `python examples/05_versioning_two_groups.py`. It prints what happened and exits 0.

Runs of `invoice@1` are parked waiting for an approval when `invoice@2` is deployed (a new step
order: v1's records would not replay on v2's code). Both versions stay registered. New runs use
v2; the `legacy` group serves only v1, the `current` group only v2. A v2 run that no worker
serves yet waits, unharmed. The v1 runs drain on v1 code, after which v1 can be deleted.
Memory backend here; on Postgres the groups would be separate processes (see docs/versioning.md).
"""

from __future__ import annotations

import asyncio
from uuid import UUID

from umt_sdk import Engine, Registry, TaskContext, connect, task
from umt_sdk.exceptions import TaskDefinitionError


@task("invoice", version=1)
async def invoice_v1(ctx: TaskContext[int]) -> str:
    await ctx.step.wait_for_fact("approved")
    total = await ctx.step.run("total", lambda: ctx.input * 100)
    return f"v1: invoice of {total} cents"


@task("invoice", version=2)  # incompatible: a new first step, amounts with VAT
async def invoice_v2(ctx: TaskContext[int]) -> str:
    rate = await ctx.step.run("vat-rate", lambda: 20)
    total = await ctx.step.run("total", lambda: ctx.input * (100 + rate))
    return f"v2: invoice of {total} cents incl. VAT"


async def wait_for(engine: Engine, run_id: UUID, status: str) -> None:
    info = await engine.get(run_id)
    while info.status != status:
        await asyncio.sleep(0.01)
        info = await engine.get(run_id)


async def main() -> None:
    registry = Registry([invoice_v1])  # yesterday's deployment knew only v1
    engine = await connect("memory://", registry=registry)
    legacy = engine.worker(versions=["invoice@1"], worker_id="legacy")
    await legacy.start()
    old = [await engine.enqueue(invoice_v1, n) for n in (1, 2)]
    for run in old:
        await wait_for(engine, run.run_id, "waiting")
    print("2 runs of invoice@1 are parked, waiting for 'approved'")

    registry.add(invoice_v2)  # deploy v2, keeping v1 registered until its runs drain
    new = await engine.enqueue("invoice", 3)  # by name: the newest version
    assert new.task_version == 2
    await asyncio.sleep(0.2)  # the legacy group never claims v2 runs
    info = await engine.get(new.run_id)
    assert info.status == "pending"
    assert info.attempts == 0
    print(f"new run uses invoice@{new.task_version}; unserved so far: {info.status}, 0 attempts")
    try:  # a stale import cannot start runs on old code by accident
        await engine.enqueue(invoice_v1, 4)
    except TaskDefinitionError:
        print("enqueue(invoice_v1, ...) is refused: pin version=1 to start a v1 run on purpose")
    else:
        raise AssertionError("an old definition must need version= to be enqueued")

    async with engine.worker(versions=[invoice_v2], worker_id="current"):
        print(f"v2 run: {await new.result(timeout=5)!r}")
        for run in old:
            await engine.signal(run.run_id, "approved")
        outputs = [await run.result(timeout=5) for run in old]
        print(f"v1 runs, approved after the deployment: {outputs}")
    await legacy.stop()
    assert all(output.startswith("v1:") for output in outputs), "old runs finish on v1 code"

    for run in (*old, new):
        info = await engine.get(run.run_id)
        workers = {e.worker_id for e in info.executions}
        expected = {1: {"legacy"}, 2: {"current"}}[info.task_version]
        assert workers == expected, f"{run.run_id}: executed by {workers}"
    live = [
        r
        for status in ("pending", "running", "waiting")
        for r in await engine.list(task_name="invoice", version=1, status=status)
    ]
    assert not live
    print("each run ran on its own group; invoice@1 has no live runs: delete invoice_v1 now")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
