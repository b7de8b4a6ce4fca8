"""Durable sleeps and facts: days of waiting that free the worker, in milliseconds of wall time.

Run it: `python examples/03_sleep_and_facts.py`. It prints what happened and exits 0.

1. a 14-day trial: `ctx.step.sleep` parks the run and releases its worker slot until it ends;
2. a fact signalled *before* its run even starts is kept, and found when the run waits for it;
3. one broadcast fact wakes every run waiting for that name;
4. a wait that nobody answers ends with `FactTimeoutError` after its timeout (two days).

`FakeClock(auto_advance=True)` jumps virtual time to the next timer whenever every run is
blocked and we wait on a result, so none of this takes real time.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

from umt_sdk import FactTimeoutError, Registry, TaskContext, connect, task
from umt_sdk.testing import FakeClock


@task("trial", version=1)
async def trial(ctx: TaskContext[str]) -> str:
    await ctx.step.sleep("trial-period", timedelta(days=14))  # durable: survives restarts
    return f"trial of {ctx.input} ended"


@task("await_fact", version=1)
async def await_fact(ctx: TaskContext[str]) -> str:
    try:  # the input is the fact's name; wait at most two days for it
        payload: dict[str, Any] = await ctx.step.wait_for_fact(ctx.input, timeout=timedelta(days=2))
    except FactTimeoutError:
        return "timed out"
    return f"got {payload}"


async def main() -> None:
    clock = FakeClock(auto_advance=True)
    engine = await connect("memory://", registry=Registry([trial, await_fact]), clock=clock)
    start, wall = clock.now(), time.monotonic()
    async with engine.worker(concurrency=4) as worker:
        # 1. A durable sleep.
        run = await engine.enqueue(trial, "alice")
        assert await run.result(timeout=5) == "trial of alice ended"
        print(f"1. sleep: trial ended after {clock.now() - start} of virtual time")

        # 2. A fact sent before its waiter: signal first, the run finds it when it gets there.
        run = await engine.enqueue(await_fact, "email-verified", delay=timedelta(hours=1))
        assert await engine.signal(run.run_id, "email-verified", {"by": "alice"})
        assert (await engine.get(run.run_id)).attempts == 0, "the run has not started yet"
        assert await run.result(timeout=5) == "got {'by': 'alice'}"
        print("2. fact sent before its waiter: the run found it -> got {'by': 'alice'}")

        # 3. Three runs park on the same fact name; one broadcast wakes them all.
        runs = [await engine.enqueue(await_fact, "release-1.0") for _ in range(3)]
        for r in runs:
            info = await engine.get(r.run_id)
            while info.waiting_for != "release-1.0":
                await asyncio.sleep(0.01)
                info = await engine.get(r.run_id)
        assert not worker.running_runs, "parked runs hold no worker slot"
        print("3. three runs are waiting for 'release-1.0' (no worker slot is held)")
        assert await engine.broadcast("release-1.0", {"tag": "v1.0"})
        results = [await r.result(timeout=5) for r in runs]
        assert results == ["got {'tag': 'v1.0'}"] * 3
        print(f"   one broadcast woke all three: {results[0]} (x3)")

        # 4. Nobody sends 'manager-approval': the wait times out after two (virtual) days.
        before = clock.now()
        run = await engine.enqueue(await_fact, "manager-approval")
        assert await run.result(timeout=5) == "timed out"
        waited = clock.now() - before
        assert waited >= timedelta(days=2)
        print(f"4. no fact: FactTimeoutError after {waited} of virtual time -> 'timed out'")

    print(f"virtual time passed: {clock.now() - start}; wall time: {time.monotonic() - wall:.2f} s")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
