"""The tasks of the Postgres integration tests: a worker process (`tests/_procs/worker.py`)
serves them, started with the `spawner` fixture of tests/integration/conftest.py:

    worker = spawner.start(versions="t_io@1", lease=1.0, concurrency=4)

Every step body first appends a row to the append-only "external system" table
`<schema>.ext_log` (run key, step, event, attempt token, pid, worker group), so the tests can
count how often each body really ran, and under which attempt. The fenced side effect of `t_io`
goes through `with_attempt_token` on its own psycopg connection: it writes a receipt file in
the worker's `--workdir` (first write wins, reconciled by op key on a resumed attempt) and commits
one row to the business table `<schema>.<business>`.

The test process imports this module for the task definitions (to enqueue); the worker
configuration is only read when a task runs, in the worker process.
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

import attrs
import psycopg
from psycopg import sql

from tests._procs.worker import append_line, config, say, write_first
from umt_sdk import (
    AttemptInfo,
    FencingError,
    RetryPolicy,
    TaskContext,
    TaskDefinition,
    task,
    with_attempt_token,
)

EXT_TABLE = "ext_log"
BUSINESS = "receipts"


@attrs.frozen
class Job:
    key: str
    delay: float = 0.0
    """How long each step body takes (seconds): long enough for a kill to land mid-step."""


def ext_table_ddl(schema: str) -> sql.Composed:
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {}.{} ("
        " seq bigserial PRIMARY KEY, run_key text NOT NULL, step text NOT NULL,"
        " event text NOT NULL, token bigint NOT NULL, pid integer NOT NULL, grp text NOT NULL,"
        " resumed boolean, at timestamptz NOT NULL DEFAULT clock_timestamp())"
    ).format(sql.Identifier(schema), sql.Identifier(EXT_TABLE))


def business_table_ddl(schema: str, business: str) -> sql.Composed:
    # Deliberately no unique constraint: a doubled side effect must show up as a second row.
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {}.{} ("
        " op_key text NOT NULL, receipt text NOT NULL, token bigint NOT NULL,"
        " pid integer NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
    ).format(sql.Identifier(schema), sql.Identifier(business))


async def create_tables(url: str, schema: str, business: str = BUSINESS) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(ext_table_ddl(schema))
        await conn.execute(business_table_ddl(schema, business))


async def external(
    ctx: TaskContext[Job], step: str, event: str, *, resumed: bool | None = None
) -> None:
    """Append one row to the external system (its own connection, committed at once)."""
    cfg = config()
    async with await psycopg.AsyncConnection.connect(cfg.url, autocommit=True) as conn:
        await conn.execute(
            sql.SQL(
                "INSERT INTO {}.{} (run_key, step, event, token, pid, grp, resumed)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s)"
            ).format(sql.Identifier(cfg.schema), sql.Identifier(EXT_TABLE)),
            (ctx.input.key, step, event, ctx.attempt_token, os.getpid(), cfg.group, resumed),
        )


async def slow_body(ctx: TaskContext[Job], step: str) -> str:
    await external(ctx, step, "body")
    await asyncio.sleep(ctx.input.delay)
    return f"{step}:{ctx.input.key}"


async def fenced_side_effect(ctx: TaskContext[Job]) -> str:
    await external(ctx, "side", "body")
    cfg = config()
    op_key = f"pay-{ctx.input.key}"

    async def act(info: AttemptInfo) -> str:
        await external(ctx, "side", "act", resumed=info.resumed)
        await asyncio.sleep(ctx.input.delay)
        return write_first(cfg.workdir / f"{op_key}.receipt", f"receipt-{info.attempt_token}")

    async def commit(tx: Any, receipt: str) -> None:
        await tx.execute(
            sql.SQL(
                "INSERT INTO {}.{} (op_key, receipt, token, pid) VALUES (%s, %s, %s, %s)"
            ).format(sql.Identifier(cfg.schema), sql.Identifier(cfg.business)),
            (op_key, receipt, ctx.attempt_token, os.getpid()),
        )

    async with await psycopg.AsyncConnection.connect(cfg.url, autocommit=True) as conn:
        try:
            return await with_attempt_token(conn, op_key, act, commit=commit)
        except FencingError as exc:
            say(f"FENCED run={ctx.run_id} token={ctx.attempt_token}: {exc}")
            raise


RETRY = RetryPolicy(max_attempts=5, initial=timedelta(milliseconds=200), backoff=1.5)


@task("t_io", version=1, retry=RETRY)
async def t_io(ctx: TaskContext[Job]) -> dict[str, Any]:
    """Four steps; the third is the fenced side effect."""
    s1 = await ctx.step.run("s1", slow_body, ctx, "s1")
    s2 = await ctx.step.run("s2", slow_body, ctx, "s2")
    receipt = await ctx.step.run("side", fenced_side_effect, ctx)
    s3 = await ctx.step.run("s3", slow_body, ctx, "s3")
    return {"key": ctx.input.key, "parts": [s1, s2, s3], "receipt": receipt}


@task("t_io", version=2, retry=RETRY)
async def t_io_v2(ctx: TaskContext[Job]) -> str:
    """Registered, but no test starts a worker for it."""
    await ctx.step.run("v2", slow_body, ctx, "v2")
    return "v2"


@task("t_agent", version=1, retry=RETRY)
async def t_agent(ctx: TaskContext[Job]) -> str:
    await ctx.step.run("think", slow_body, ctx, "think")
    await ctx.step.run("act", slow_body, ctx, "act")
    return f"agent:{ctx.input.key}"


@task("t_order", version=1, retry=RETRY)
async def t_order(ctx: TaskContext[Job]) -> str:
    return await ctx.step.run("record", slow_body, ctx, "record")


@task("t_cancel", version=1, retry=RETRY)
async def t_cancel(ctx: TaskContext[Job]) -> str:
    await ctx.step.run("started", slow_body, ctx, "started")

    async def long() -> None:
        await external(ctx, "long", "body")
        try:
            await asyncio.wait_for(ctx.abort_event.wait(), timeout=30)
        except TimeoutError:
            return
        await external(ctx, "long", "abort-seen")
        ctx.throw_if_canceled()

    await ctx.step.run("long", long)
    await ctx.step.run("after", slow_body, ctx, "after")
    return "not canceled"


async def pure_body(ctx: TaskContext[Job], step: str) -> str:
    """A step body that touches no database: it appends a line to a local file."""
    append_line(config().workdir / f"{ctx.input.key}.bodies", f"{step} {ctx.attempt_token}")
    await asyncio.sleep(ctx.input.delay)
    return f"{step}:{ctx.input.key}"


@task("t_pure", version=1, retry=RetryPolicy.none())
async def t_pure(ctx: TaskContext[Job]) -> list[str]:
    """No retries at all, and no database in its steps: only the engine's own writes can
    be hit by a database outage, and they must not fail the run."""
    return [await ctx.step.run(name, pure_body, ctx, name) for name in PURE_STEPS]


PURE_STEPS = ("p1", "p2", "p3", "p4")

TASKS: list[TaskDefinition[Any, Any]] = [t_io, t_io_v2, t_agent, t_order, t_cancel, t_pure]
