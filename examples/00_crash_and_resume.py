"""A multi-step task with a sleep, a fact and a crash, on the memory backend.

Run it: `python examples/00_crash_and_resume.py`. It prints what happened and exits 0.

The story: a download plan is fetched (step), probed (inline step), waits two days for an
operator's approval (a durable fact), cools down for five minutes (a durable sleep) and is
submitted once (a fenced side effect). The first worker "crashes" in the middle of the probe;
a second worker picks the run up after the lease expires, without fetching the plan again.
A virtual clock makes the two-day wait take milliseconds.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta

import attrs

from umt_backend_memory import MemoryStore, MemoryTransaction
from umt_sdk import AttemptInfo, Registry, RetryPolicy, TaskContext, connect, step, task
from umt_sdk import with_attempt_token as fenced
from umt_sdk.testing import FakeClock, simulate_crash

BODIES: Counter[str] = Counter()
PROBE_STARTED = asyncio.Event()
RELEASE_PROBE = asyncio.Event()
DOWNLOADS = MemoryStore()  # the business tables


@attrs.frozen
class SubmitDownload:
    plan_id: str


@attrs.frozen
class Plan:
    plan_id: str
    url: str


@attrs.frozen
class Receipt:
    plan_id: str
    approved_by: str
    size: int
    client_ref: str


@step("fetch-plan")
async def fetch_plan(plan_id: str) -> Plan:
    BODIES["fetch-plan"] += 1
    return Plan(plan_id=plan_id, url=f"https://example.invalid/{plan_id}.iso")


async def probe_size(url: str) -> int:
    BODIES["probe"] += 1
    PROBE_STARTED.set()
    await RELEASE_PROBE.wait()
    return 4_700_000_000


@task("submit_download", version=2, retry=RetryPolicy.network())
async def submit_download(ctx: TaskContext[SubmitDownload]) -> Receipt:
    plan = await fetch_plan(ctx.input.plan_id)
    size = await ctx.step.run("probe", probe_size, plan.url)
    approval: dict[str, str] = await ctx.step.wait_for_fact("approved", timeout=timedelta(days=2))
    await ctx.step.sleep("cool-down", timedelta(minutes=5))

    async def submit() -> str:
        async def call_client(info: AttemptInfo) -> str:
            BODIES["submit"] += 1
            return f"client-{info.op_key}-{info.attempt_token}"

        async def record(tx: MemoryTransaction, ref: str) -> None:
            tx.put("downloads", plan.plan_id, ref)

        return await fenced(DOWNLOADS, f"submit:{plan.plan_id}", call_client, commit=record)

    client_ref = await ctx.step.run("submit", submit)
    return Receipt(
        plan_id=plan.plan_id, approved_by=approval["by"], size=size, client_ref=client_ref
    )


async def main() -> None:
    clock = FakeClock(auto_advance=True)
    engine = await connect("memory://", registry=Registry([submit_download]), clock=clock)
    started = clock.now()
    run = await engine.enqueue(submit_download, SubmitDownload("p1"), idempotency_key="plan:p1")
    print(f"enqueued run {run.run_id}")

    first = engine.worker(lease=timedelta(seconds=10))
    await first.start()
    await PROBE_STARTED.wait()
    print("worker 1 is probing the file ... and crashes (no lease release, like kill -9)")
    simulate_crash(first)
    await first.stop()
    PROBE_STARTED.clear()
    RELEASE_PROBE.set()

    clock.advance(timedelta(seconds=11))
    print("11 s later the lease has expired; worker 2 takes over")
    async with engine.worker(lease=timedelta(seconds=10)):
        info = await engine.get(run.run_id)
        while info.status != "waiting":
            await asyncio.sleep(0.01)
            info = await engine.get(run.run_id)
        print(f"run is {info.status}, waiting for fact {info.waiting_for!r}")
        await engine.signal(run.run_id, "approved", {"by": "ops"})
        print("operator approved")
        receipt = await run.result(timeout=10)

    info = await engine.get(run.run_id)
    print(f"result: {receipt}")
    print(
        f"status={info.status} attempts={info.attempts} lease_expirations={info.lease_expirations}"
    )
    print("timeline:")
    for entry in info.timeline:
        print(f"  {entry.name:<10} {entry.kind:<5} {entry.status:<11} token={entry.fencing_token}")
    print(f"bodies run: {dict(BODIES)}")
    print(f"virtual time passed: {clock.now() - started}")
    assert BODIES["fetch-plan"] == 1, "a completed step never runs again"
    assert BODIES["submit"] == 1, "the side effect happened once"
    assert DOWNLOADS.rows("downloads") == {"p1": receipt.client_ref}
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
