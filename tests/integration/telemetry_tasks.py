"""The task of the telemetry tests that SIGKILL a worker process (tests/_procs/worker.py serves
`TASKS`; the test process imports them to enqueue and to take the run over).

- `telemetry.hold`: one step; its first attempt creates `started-1` in the input's folder
  and then waits until its process is killed; a later attempt returns "taken over".
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import attrs

from umt_sdk import TaskContext, TaskDefinition, task


@attrs.frozen
class Hold:
    folder: str


@task("telemetry.hold", version=1)
async def hold(ctx: TaskContext[Hold]) -> str:
    def held() -> str:  # a plain step: it runs in a worker thread
        Path(ctx.input.folder, f"started-{ctx.attempt}").touch()
        if ctx.attempt == 1:
            threading.Event().wait()  # until the test kills this process
        return "taken over"

    value: str = await ctx.step.run("held", held)
    return value


TASKS: list[TaskDefinition[Any, Any]] = [hold]
