"""The tasks of the deadline chaos test (`test_deadline_hung_thread.py`).

- `deadline.hung`: a plain handler whose plain step hangs in its thread for an hour (a call
  with no timeout of its own into a service that never answers). Threads cannot be killed: only
  the run's deadline (`timeout=3 s`) ends the run. Prints `HUNG_STARTED <key> <token>`.
- `deadline.quick`: returns at once; prints `QUICK_RAN <key> <token>`.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import attrs

from tests._procs.worker import say
from umt_sdk import SyncTaskContext, TaskContext, TaskDefinition, task

HUNG_DEADLINE = timedelta(seconds=3)


@attrs.frozen
class Key:
    key: str


@task("deadline.hung", version=1, timeout=HUNG_DEADLINE)
def hung(ctx: SyncTaskContext[Key]) -> str:
    def call_the_service() -> str:
        say("HUNG_STARTED", ctx.input.key, ctx.attempt_token)
        time.sleep(3600)
        return "answered"

    return ctx.step.run("call", call_the_service)


@task("deadline.quick", version=1)
async def quick(ctx: TaskContext[Key]) -> str:
    say("QUICK_RAN", ctx.input.key, ctx.attempt_token)
    return "done"


TASKS: list[TaskDefinition[Any, Any]] = [hung, quick]
