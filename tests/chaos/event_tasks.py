"""The tasks of `test_event_fanout_killed.py`: three subscribers of one event, served by real
worker processes (`tests/_procs/worker.py`) that SIGKILL themselves at one point.

Imported by a worker process with `UMT_TEST_KILL_EVENT_FANOUT=N`, this module wraps the write
with which a worker starts the runs of earlier events (`EventStarter._store`): once the N-th
such write has committed, and before the worker goes on, the process SIGKILLs itself. A file in
the worker's `--workdir` marks that it happened, so the next worker fans out undisturbed. The
test process imports it too, to publish; there the wrap is never installed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs

from tests._procs.kill import die, first_time
from umt_sdk import TaskContext, TaskDefinition, task
from umt_sdk._events import EventStarter
from umt_sdk.backend import EnqueueResult, NewRun

EVENT = "chaos.order.placed"
KILLED = "killed-while-fanning-out"


@attrs.frozen
class Placed:
    n: int


@task("chaos.events.receipt", version=1, on_event=EVENT)
async def receipt(ctx: TaskContext[Placed]) -> int:
    return ctx.input.n


@task("chaos.events.stock", version=1, on_event=EVENT)
async def stock(ctx: TaskContext[Placed]) -> int:
    return ctx.input.n


@task("chaos.events.points", version=1, on_event=EVENT)
async def points(ctx: TaskContext[Placed]) -> int:
    return ctx.input.n


TASKS: list[TaskDefinition[Any, Any]] = [receipt, stock, points]


def install(after: int) -> None:
    """SIGKILL this process once its `after`-th fan-out write has committed (once per test)."""
    store = EventStarter._store
    writes = [0]

    async def store_then_die(self: EventStarter, news: Sequence[NewRun]) -> Sequence[EnqueueResult]:
        results = await store(self, news)
        if news:
            writes[0] += 1
        if writes[0] >= after and first_time(KILLED):
            die(writes[0], sum(1 for r in results if r.created))
        return results

    EventStarter._store = store_then_die  # type: ignore[method-assign]  # the test's kill point


if os.environ.get("UMT_TEST_KILL_EVENT_FANOUT"):
    install(int(os.environ["UMT_TEST_KILL_EVENT_FANOUT"]))
