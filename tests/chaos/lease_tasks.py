"""The tasks of the lease and ledger chaos tests (`test_lease_*.py`), their tables, and the
test process's reads of those tables.

A worker process (`tests/_procs/worker.py`, started with the `lease_spawner` fixture of
tests/chaos/conftest.py: a 0.2 s poll) serves them and prints what the tests wait for, one line
each, flushed: `READY ...`, then `<EVENT> <run key> <attempt token>` lines
(`Process.printed`, `Process.events`). Every body also appends a row to `<schema>.lease_log`
(key, event, token, pid), so a test can count from the database how often, and under which
attempt, each body really ran. Files in the worker's `--workdir` are the tests' switches
(`touch` one to let a body go on).

- `lease.busy`: one step held open for `hold` seconds, or until the file `done-<key>` exists
  when `hold` is 0, or until the run's abort signal fires (`ABORT_SEEN`, then it raises the
  cancellation). Prints `BUSY_STARTED` when the body starts.
- `lease.fenced`: one step whose side effect goes through `with_attempt_token`; its commit
  callback inserts a row into `<schema>.<business>` (no unique constraint: a doubled commit
  would show as a second row). On the first attempt the callback prints `IN_COMMIT` and waits
  for `release-<key>` (the test SIGSTOPs the process in there). With `hold_takeover`, a later
  attempt prints `IN_ACT` inside its action (the op is begun) and waits for `release2-<key>`.
  With `slow_commit` seconds, the callback waits for `go-<key>`, prints `SLOW_COMMIT`, then
  takes that long (an async sleep: the process stays alive and heartbeats) before it returns.
  Prints `FENCED` when the ledger refuses the attempt, `STOPPED` when its execution was
  stopped in there (its heartbeat found the lease lost), `COMMITTED` when it committed.
- `lease.kills_itself`: records a step, then its second step SIGKILLs its own process (think of
  an OOM kill on one input), every time. `max_lost_leases=3`.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import attrs
import psycopg
from psycopg import sql

from tests._procs.support import fetch, q
from tests._procs.worker import config, say, until_file
from umt_sdk import (
    AttemptInfo,
    FencingError,
    TaskContext,
    TaskDefinition,
    task,
    with_attempt_token,
)

LOG_TABLE = "lease_log"
BUSINESS = "lease_bookings"
KILLS_ITSELF_MAX_LOST_LEASES = 3


@attrs.frozen
class Busy:
    key: str
    hold: float = 0.0


@attrs.frozen
class Fenced:
    key: str
    hold_takeover: bool = False
    slow_commit: float = 0.0


@attrs.frozen
class Doomed:
    key: str


def ddl(schema: str, business: str) -> sql.Composed:
    return sql.SQL(
        """
        CREATE TABLE IF NOT EXISTS {s}.{log} (
            seq bigserial PRIMARY KEY, key text NOT NULL, event text NOT NULL,
            token bigint NOT NULL, pid integer NOT NULL,
            at timestamptz NOT NULL DEFAULT clock_timestamp());
        CREATE TABLE IF NOT EXISTS {s}.{business} (
            key text NOT NULL, token bigint NOT NULL, pid integer NOT NULL);
        """
    ).format(
        s=sql.Identifier(schema), log=sql.Identifier(LOG_TABLE), business=sql.Identifier(business)
    )


async def log(event: str, key: str, token: int) -> None:
    async with await psycopg.AsyncConnection.connect(config().url, autocommit=True) as conn:
        await conn.execute(
            sql.SQL("INSERT INTO {}.{} (key, event, token, pid) VALUES (%s, %s, %s, %s)").format(
                sql.Identifier(config().schema), sql.Identifier(LOG_TABLE)
            ),
            (key, event, token, os.getpid()),
        )


async def heartbeat_named(run_id: Any, token: int, step_name: str) -> None:
    """Wait until a heartbeat has recorded that this execution is inside `step_name`."""
    query = sql.SQL(
        "SELECT current_step FROM {}.executions WHERE run_id = %s AND fencing_token = %s"
    ).format(sql.Identifier(config().schema))
    async with await psycopg.AsyncConnection.connect(config().url, autocommit=True) as conn:
        for _ in range(1000):
            cur = await conn.execute(query, (run_id, token))
            row = await cur.fetchone()
            if row is not None and row[0] == step_name:
                return
            await asyncio.sleep(0.02)


@task("lease.busy", version=1)
async def busy(ctx: TaskContext[Busy]) -> str:
    key, token = ctx.input.key, ctx.attempt_token

    async def hold() -> str:
        await log("body", key, token)
        say("BUSY_STARTED", key, token)
        if ctx.input.hold:
            waiting = asyncio.create_task(asyncio.sleep(ctx.input.hold))
        else:
            waiting = asyncio.create_task(until_file(f"done-{key}"))
        aborted = asyncio.create_task(ctx.abort_event.wait())
        await asyncio.wait({waiting, aborted}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        aborted.cancel()
        if ctx.abort_event.is_set():
            await log("abort-seen", key, token)
            say("ABORT_SEEN", key, token)
            ctx.throw_if_canceled()
        return "held"

    value: str = await ctx.step.run("hold", hold)
    say("BUSY_DONE", key, token)
    return value


@task("lease.fenced", version=1)
async def fenced(ctx: TaskContext[Fenced]) -> str:
    key, token = ctx.input.key, ctx.attempt_token

    async def act(info: AttemptInfo) -> str:
        await log("act", key, token)
        if ctx.input.hold_takeover and ctx.attempt > 1:
            say("IN_ACT", key, token)
            await until_file(f"release2-{key}")
        return f"receipt-{info.attempt_token}"

    async def commit(tx: Any, receipt: str) -> None:
        await tx.execute(
            sql.SQL("INSERT INTO {}.{} (key, token, pid) VALUES (%s, %s, %s)").format(
                sql.Identifier(config().schema), sql.Identifier(config().business)
            ),
            (key, token, os.getpid()),
        )
        if ctx.input.slow_commit:
            await until_file(f"go-{key}")
            say("SLOW_COMMIT", key, token)
            await asyncio.sleep(ctx.input.slow_commit)
        elif ctx.attempt == 1:
            say("IN_COMMIT", key, token)
            await until_file(f"release-{key}")

    async def submit() -> str:
        async with await psycopg.AsyncConnection.connect(config().url, autocommit=True) as conn:
            try:
                receipt = await with_attempt_token(conn, f"book:{key}", act, commit=commit)
            except FencingError:
                say("FENCED", key, token)
                raise
            except BaseException:  # stopped by its lost lease (the heartbeat found it gone)
                say("STOPPED", key, token)
                raise
        say("COMMITTED", key, token)
        return receipt

    receipt: str = await ctx.step.run("submit", submit)
    return receipt


@task("lease.kills_itself", version=1, max_lost_leases=KILLS_ITSELF_MAX_LOST_LEASES)
async def kills_itself(ctx: TaskContext[Doomed]) -> str:
    key, token = ctx.input.key, ctx.attempt_token
    await ctx.step.run("before", lambda: None)

    async def oom() -> str:
        await log("body", key, token)
        await heartbeat_named(ctx.run_id, token, "oom")  # so the failure can name the step
        say("DYING", key, token)
        os.kill(os.getpid(), signal.SIGKILL)
        return "unreachable"

    value: str = await ctx.step.run("oom", oom)
    return value


TASKS: list[TaskDefinition[Any, Any]] = [busy, fenced, kills_itself]


async def log_rows(url: str, schema: str, key: str) -> list[dict[str, Any]]:
    """The `lease_log` rows of `key`, in order."""
    return await fetch(
        url,
        q("SELECT * FROM {schema}.{log} WHERE key = %s ORDER BY seq", schema, log=LOG_TABLE),
        (key,),
    )


async def bookings(url: str, schema: str) -> list[dict[str, Any]]:
    return await fetch(url, q("SELECT * FROM {schema}.{b} ORDER BY key", schema, b=BUSINESS))
