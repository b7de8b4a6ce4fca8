"""The smallest umt program: one task, one run, one worker, one result.

Run it: `python examples/01_hello.py`. It prints what happened and exits 0.

Everything runs in this process on the memory backend (`memory://`); the same code runs on
Postgres by changing the URL (see 04 and 06).
"""

from __future__ import annotations

import asyncio

from umt_sdk import Registry, TaskContext, connect, task


# A task is an async (or plain) function with one parameter, the context. The type inside
# `TaskContext[...]` is the input type and the return annotation is the output type: umt checks
# inputs at enqueue and stores both as JSON.
@task("hello", version=1)
async def hello(ctx: TaskContext[str]) -> str:
    return f"hello, {ctx.input}!"


async def main() -> None:
    # The registry lists the tasks this process knows; `connect` picks the backend by URL.
    engine = await connect("memory://", registry=Registry([hello]))

    # Enqueue stores a run; nothing executes it yet.
    run = await engine.enqueue(hello, "world")
    print(f"enqueued run {run.run_id} of {run.task_name}@{run.task_version}")
    print(f"status before any worker: {(await engine.get(run.run_id)).status}")

    # A worker claims runs and executes them while the `async with` block is open.
    async with engine.worker():
        greeting = await run.result(timeout=5)

    info = await engine.get(run.run_id)
    print(f"result: {greeting!r}")
    print(f"status: {info.status}, attempts: {info.attempts}")
    assert greeting == "hello, world!"
    assert info.status == "completed"
    assert info.attempts == 1
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
