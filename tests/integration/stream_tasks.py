"""The task of the stream tests that run real worker processes (tests/_procs/worker.py serves
`TASKS`; the test process imports them to enqueue and to follow the runs).

- `streams.progress`: one step, `work`, that writes `progress` {done, total} for done = 1..total
  and prints `wrote <key> <done>` after each write; after each it waits for the test's switch
  file `<key>.<done>` (at once when it exists), so the test decides when the next value comes.
"""

from __future__ import annotations

from typing import Any

import attrs

from tests._procs.worker import say, until_file
from umt_sdk import TaskContext, TaskDefinition, task


@attrs.frozen
class Progress:
    key: str
    total: int


@task("streams.progress", version=1)
async def progress(ctx: TaskContext[Progress]) -> int:
    key, total = ctx.input.key, ctx.input.total

    async def work() -> int:
        for done in range(1, total + 1):
            await ctx.stream.write("progress", {"done": done, "total": total})
            say("wrote", key, done)
            await until_file(f"{key}.{done}", limit=None)
        return total

    count: int = await ctx.step.run("work", work)
    return count


TASKS: list[TaskDefinition[Any, Any]] = [progress]
