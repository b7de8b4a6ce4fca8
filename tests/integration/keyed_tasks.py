"""The task of the concurrency-key process test (tests/integration/test_concurrency_keys_pg.py),
served by worker processes (`tests/_procs/worker.py --tasks tests.integration.keyed_tasks`).

`t_keyed` runs at most two at a time per tenant (the part of its key before the colon). Its
step takes `delay` seconds; every third run also sleeps durably between two steps, giving its
slot back and needing a free one again to go on.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import attrs

from umt_sdk import Concurrency, RetryPolicy, TaskContext, TaskDefinition, task

LIMIT = 2


@attrs.frozen
class KeyedJob:
    key: str
    delay: float = 0.05
    nap: bool = False


def tenant_of(job: KeyedJob) -> str:
    return job.key.split(":")[0]


@task(
    "t_keyed",
    version=1,
    retry=RetryPolicy(max_attempts=5, initial=timedelta(milliseconds=50)),
    concurrency=Concurrency(key=tenant_of, limit=LIMIT),
)
async def t_keyed(ctx: TaskContext[KeyedJob]) -> str:
    async def work() -> str:
        await asyncio.sleep(ctx.input.delay)
        return ctx.input.key

    done = await ctx.step.run("work", work)
    if ctx.input.nap:
        await ctx.step.sleep("nap", timedelta(milliseconds=100))
        await ctx.step.run("after-nap", work)
    return done


TASKS: list[TaskDefinition[Any, Any]] = [t_keyed]
