"""The tasks of `test_transactional_steps_killed.py`: runs of transactional steps, each of which
inserts one entry into `<schema>.tx_entries` (no unique constraint: a doubled write would show
as a second row), served by real worker processes (`tests/_procs/worker.py`) that SIGKILL
themselves at random points of those steps.

A worker process kills itself, with the probability `UMT_TEST_TX_KILL` (read at import), at
each of: just before a step starts (`step.before`), inside its transaction right after the
insert (`inserted`), after the body returned and before the step's record is written in the
same transaction (`step.returned`), and just after the commit (`step.recorded`). The first
worker of a test also dies once, for sure, inside the first transaction after its insert (the
file `first-kill` in its workdir marks that it happened). Each kill prints
`DYING <point> <pid>` first. The test process imports this module too, to enqueue; there no
kill is armed.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta
from typing import Any

from psycopg import sql

from tests._procs.kill import die, first_time
from tests._procs.worker import config
from umt_sdk import RetryPolicy, TaskContext, TaskDefinition, task
from umt_sdk._probe import _OBSERVER, Point

ENTRIES = "tx_entries"
STEPS = 4
FIRST_KILL = "first-kill"

_KILL_P = float(os.environ.get("UMT_TEST_TX_KILL", "0"))


def ddl(schema: str) -> sql.Composed:
    return sql.SQL(
        "CREATE TABLE {}.{} (key text NOT NULL, step integer NOT NULL, token bigint NOT NULL, "
        "pid integer NOT NULL)"
    ).format(sql.Identifier(schema), sql.Identifier(ENTRIES))


def _maybe_die(point: str) -> None:
    if _KILL_P and random.random() < _KILL_P:
        die(point, os.getpid())


async def post(tx: Any, key: str, step: int, token: int) -> int:
    await tx.execute(
        sql.SQL("INSERT INTO {}.{} (key, step, token, pid) VALUES (%s, %s, %s, %s)").format(
            sql.Identifier(config().schema), sql.Identifier(ENTRIES)
        ),
        (key, step, token, os.getpid()),
    )
    if _KILL_P and first_time(FIRST_KILL):
        die("first", os.getpid())
    _maybe_die("inserted")
    return 1


@task(
    "tx.ledger",
    version=1,
    retry=RetryPolicy(max_attempts=10, initial=timedelta(milliseconds=100), backoff=1.0),
    max_lost_leases=100,
)
async def ledger(ctx: TaskContext[str]) -> int:
    total = 0
    for i in range(STEPS):
        total += await ctx.step.transaction(f"post-{i}", post, ctx.input, i, ctx.attempt_token)
    return total


TASKS: list[TaskDefinition[Any, Any]] = [ledger]


def _kill_at_random(point: Point) -> bool:
    if point.name.startswith("post-") and point.kind in (
        "step.before",
        "step.returned",
        "step.recorded",
    ):
        _maybe_die(point.kind)
    return False


if _KILL_P:
    _OBSERVER.set(_kill_at_random)
