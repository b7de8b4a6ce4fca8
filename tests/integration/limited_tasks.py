"""The task of the rate-limit process test (tests/integration/test_rate_limits_pg.py), served
by worker processes (`tests/_procs/worker.py --tasks tests.integration.limited_tasks`).

`t_limited` starts only with a token of its tenant's bucket of `proc.runs` (4 per second), and
its one step takes a token of the shared `proc.steps` (5 per second) before its body runs.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import attrs

from umt_sdk import RateLimit, RetryPolicy, TaskContext, TaskDefinition, task

RUNS = RateLimit[Any](
    "proc.runs", limit=4, per=timedelta(seconds=1), key=lambda job: job.key.split(":")[0]
)
STEPS = RateLimit[Any]("proc.steps", limit=5, per=timedelta(seconds=1))


@attrs.frozen
class LimitedJob:
    key: str
    delay: float = 0.05


@task(
    "t_limited",
    version=1,
    retry=RetryPolicy(max_attempts=5, initial=timedelta(milliseconds=50)),
    rate_limit=RUNS,
)
async def t_limited(ctx: TaskContext[LimitedJob]) -> str:
    async def call_api() -> str:
        await asyncio.sleep(ctx.input.delay)
        return ctx.input.key

    return await ctx.step.run("call_api", call_api, rate_limit=STEPS)


TASKS: tuple[TaskDefinition[Any, Any], ...] = (t_limited,)
