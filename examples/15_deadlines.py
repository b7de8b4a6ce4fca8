"""Timeouts and deadlines: a hung call gives its slot back, and a run ends when it must.

Run it: `python examples/15_deadlines.py`. It prints what happened and exits 0.

1. a step with `timeout=`: its first attempt hangs (an async body, cancelled at the timeout),
   fails with `StepTimeoutError`, and the retry succeeds;
2. a plain step (a thread, which cannot be killed) hangs for good: the task's `timeout=` ends
   the run `failed` with `DeadlineExceededError` at its deadline, the handler gets its abort
   signal first, and the worker's one slot runs the next run while the thread still sleeps;
3. a run asleep for a week, enqueued with `deadline=` one day: it ends at the deadline, not at
   its wake-up, and no step runs after it;
4. `start_within=`: a run that no worker claimed in time ends without running
   (`StartDeadlineExceededError`).

Time is a `FakeClock`: a step's timeout and a run's deadline are measured on the backend's
clock, so moving it (or `auto_advance`, which jumps it to the next timer when every run is
blocked) is all the waiting there is. On Postgres they count in the database's time.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

from umt_sdk import (
    DeadlineExceededError,
    Registry,
    RetryPolicy,
    RunFailedError,
    RunHandle,
    SyncTaskContext,
    TaskContext,
    connect,
    step,
    task,
)
from umt_sdk.testing import FakeClock

CALLS: list[str] = []
STARTED = asyncio.Event()
NEVER = threading.Event()  # the service that never answers


@step("fetch_quote", timeout=timedelta(seconds=10), retry=RetryPolicy(max_attempts=3))
async def fetch_quote(symbol: str) -> float:
    CALLS.append(symbol)
    if len(CALLS) == 1:  # the first call hangs (a stuck connection)
        STARTED.set()
        await asyncio.Event().wait()
    return 101.5


@task("quote", version=1)
async def quote(ctx: TaskContext[str]) -> float:
    return await fetch_quote(ctx.input)


@task("report", version=1, timeout=timedelta(minutes=5))
def report(ctx: SyncTaskContext[str]) -> str:
    def call_legacy_service() -> str:
        NEVER.wait()  # a blocking call with no timeout of its own
        return "never"

    try:
        return ctx.step.run("legacy", call_legacy_service)
    finally:
        print(f"   the handler's abort signal fired: {ctx.abort_event.is_set()}")


@task("renewal", version=1)
async def renewal(ctx: TaskContext[str]) -> str:
    await ctx.step.sleep("wait-a-week", timedelta(days=7))
    await ctx.step.run("charge", lambda: CALLS.append("charged"))
    return "renewed"


@task("hello", version=1)
async def hello(ctx: TaskContext[str]) -> str:
    return f"hello {ctx.input}"


async def failure(handle: RunHandle[object]) -> str:
    """The short type name of the error a run ended with (it must have failed)."""
    try:
        await handle.result(timeout=5)
    except RunFailedError as exc:
        return exc.error_type.rsplit(".", 1)[-1]
    raise AssertionError(f"run {handle.run_id} did not fail")


async def main() -> None:
    clock = FakeClock()
    registry = Registry([quote, report, renewal, hello])
    engine = await connect("memory://", registry=registry, clock=clock)
    async with engine.worker(concurrency=1):
        # 1. A step attempt past its timeout fails, and is retried.
        run = await engine.enqueue(quote, "UMT")
        await asyncio.wait_for(STARTED.wait(), 5)
        clock.advance(timedelta(seconds=10))
        clock.auto_advance = True  # from here on, jump to each next timer
        assert await run.result(timeout=5) == 101.5
        first = (await engine.get(run.run_id)).timeline[0]
        assert first.error is not None
        print(f"1. step timeout: attempt 1 failed with {first.error.type}, attempt 2 -> 101.5")

        # 2. A plain step hung in a thread: the run's deadline ends it, the slot is freed.
        clock.auto_advance = False
        stuck = await engine.enqueue(report, "Q3")
        after = await engine.enqueue(hello, "world")
        await asyncio.sleep(0.1)  # the legacy call is hanging in its thread now
        clock.advance(timedelta(minutes=5))
        error = await failure(stuck)
        assert error == "DeadlineExceededError", error
        print(f"2. run deadline: {error} after 5 minutes, though the thread still hangs")
        assert await after.result(timeout=5) == "hello world"
        print("   the worker's one slot ran the next run: hello world")

        # 3. Asleep past its deadline: ended at the deadline, the charge never runs.
        clock.auto_advance = True
        started = clock.now()
        nap = await engine.enqueue(renewal, "alice", deadline=timedelta(days=1))
        error = await failure(nap)
        info = await engine.get(nap.run_id)
        assert info.finished_at is not None
        assert "charged" not in CALLS
        print(
            f"3. asleep past its deadline: {error} {info.finished_at - started} after it "
            "started, not after a week; the charge never ran"
        )

        # 4. Not claimed in time: ends without running.
    late = await engine.enqueue(hello, "late", start_within=timedelta(minutes=1))
    clock.advance(timedelta(minutes=2))  # no worker was there to claim it
    async with engine.worker():
        error = await failure(late)
    assert error == "StartDeadlineExceededError", error
    print(f"4. start deadline: {error}, the handler never ran")
    NEVER.set()  # let the abandoned thread go
    await engine.close()
    assert issubclass(DeadlineExceededError, TimeoutError)


if __name__ == "__main__":
    asyncio.run(main())
