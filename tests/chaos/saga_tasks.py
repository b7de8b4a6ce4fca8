"""The tasks of `test_saga_killed.py`: a four-step saga that gives up, served by real worker
processes (`tests/_procs/worker.py`) that SIGKILL themselves once in the middle of compensating.

Imported by a worker process, this module also watches the execution's points
(`umt_sdk._probe`): the first time the compensation of `book-1` is about to start (those of
`book-3` and `book-2` ran and are recorded), the process SIGKILLs itself. A file in the
worker's `--workdir` marks that it happened, so the next worker lets the run go on. Each
compensation appends a line to `undone.log` in the workdir, the outside effect the test counts.
The test process imports it too, to enqueue; there the watch is never installed.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from tests._procs.kill import kill_once_at
from tests._procs.worker import config, say
from umt_sdk import Compensate, RetryPolicy, TaskContext, TaskDefinition, task

KILLED = "killed-while-compensating"
UNDONE = "undone.log"
STEPS = 4


@attrs.frozen
class Trip:
    key: str


def book(key: str, i: int) -> str:
    say("BOOKED", key, i, os.getpid())
    return f"{key}-{i}"


def cancel_booking(booking: str) -> None:
    with (config().workdir / UNDONE).open("a") as log:
        log.write(f"{booking} {os.getpid()}\n")
    say("UNDONE", booking, os.getpid())


@task("saga.trip", version=1, retry=RetryPolicy.none())
async def trip(ctx: TaskContext[Trip]) -> str:
    for i in range(STEPS):
        await ctx.step.run(f"book-{i}", book, ctx.input.key, i, compensate=cancel_booking)
    raise Compensate("no flight home")


TASKS: list[TaskDefinition[Any, Any]] = [trip]


if os.environ.get("UMT_TEST_KILL_WHILE_COMPENSATING") == "1":
    kill_once_at("step.before", "umt.compensate:book-1", marker=KILLED)
