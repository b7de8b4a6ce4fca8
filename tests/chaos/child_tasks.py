"""The tasks of `test_child_start_killed.py`: a parent that starts one child, served by real
worker processes (`tests/_procs/worker.py`) that SIGKILL themselves at one point.

Imported by a worker process, this module also watches the execution's points
(`umt_sdk._probe`): the first time the step that starts the child has returned (the child is
stored, the step's record is not), the process SIGKILLs itself. A file in the worker's
`--workdir` marks that it happened, so the next worker lets the run go on. The test process
imports it too, to enqueue; there the watch is never installed.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from tests._procs.kill import kill_once_at
from tests._procs.worker import say
from umt_sdk import TaskContext, TaskDefinition, task

KILLED = "killed-after-start"


@attrs.frozen
class Family:
    key: str


@task("child.leaf", version=1)
async def leaf(ctx: TaskContext[Family]) -> str:
    say("LEAF_BODY", ctx.input.key, ctx.attempt_token)
    return f"leaf {ctx.input.key}"


@task("child.parent", version=1)
async def parent(ctx: TaskContext[Family]) -> str:
    handle = await ctx.step.start_child("start", leaf, Family(ctx.input.key))
    say("STARTED", ctx.input.key, handle.run_id)
    return await handle.result()


TASKS: list[TaskDefinition[Any, Any]] = [leaf, parent]


if os.environ.get("UMT_TEST_KILL_AFTER_START") == "1":
    kill_once_at("step.returned", "start", marker=KILLED)
