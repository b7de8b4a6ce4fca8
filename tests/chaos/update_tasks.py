"""The tasks of `test_update_killed.py`: an order that waits for an `approve` update, served
by real worker processes (`tests/_procs/worker.py`) that SIGKILL themselves at one point.

Imported by a worker process with `UMT_TEST_KILL_UPDATE=1`, this module watches the
execution's points (`umt_sdk._probe`): the first time the update's handler has returned (its
step recorded, its result not), the process SIGKILLs itself. A file in the worker's
`--workdir` marks that it happened, so the next worker lets the run go on. The test process
imports it too, to enqueue and update; there the watch is never installed.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from tests._procs.kill import kill_once_at
from tests._procs.worker import append_line, config, say
from umt_sdk import TaskContext, TaskDefinition, query, task, update

KILLED = "killed-before-update-record"
RESERVED = "reserved.log"


@attrs.frozen
class Order:
    order_id: str


@attrs.frozen
class Approval:
    by: str


async def reserve(order_id: str, by: str) -> str:
    """The update's side effect: one line per run of the body (a fenced write in real code)."""
    append_line(config().workdir / RESERVED, f"{order_id} {by} {os.getpid()}")
    return f"slot-{order_id}"


@update("approve")
async def approve(ctx: TaskContext[Order], approval: Approval) -> str:
    slot = await ctx.step.run("reserve", reserve, ctx.input.order_id, approval.by)
    await ctx.set_query_state({"status": "approved", "by": approval.by})
    say("APPLIED", ctx.input.order_id, os.getpid())
    return f"approved by {approval.by} ({slot})"


@query("status")
def status_of(state: dict[str, str] | None) -> str:
    return "unknown" if state is None else state["status"]


@task("update.order", version=1, updates=[approve], queries=[status_of])
async def order(ctx: TaskContext[Order]) -> str:
    await ctx.set_query_state({"status": "waiting"})
    applied = await ctx.step.wait_for_update("approve")
    return str(applied.result)


TASKS: list[TaskDefinition[Any, Any]] = [order]


if os.environ.get("UMT_TEST_KILL_UPDATE") == "1":
    kill_once_at("step.returned", "umt.update-result:1", marker=KILLED)
