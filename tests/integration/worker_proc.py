"""A real worker process for the Postgres integration tests.

    python worker_proc.py --url URL --schema S --versions t_io@1 --lease 1 --business receipts

It serves the tasks below with `engine.worker(...)` until it is killed (SIGTERM stops it
gracefully). Every step body first appends a row to the append-only "external system" table
`<schema>.ext_log` (run key, step, event, attempt token, pid, worker group), so the tests can
count how often each body really ran, and under which attempt. The fenced side effect of `t_io`
goes through `with_attempt_token` on its own psycopg connection: it writes a receipt file in
`--workdir` (first write wins, reconciled by op key on a resumed attempt) and commits one row
to the business table `<schema>.<business>`.

The test process imports this module for the task definitions (to enqueue); the worker
configuration is only read when a task runs, in the worker process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import psycopg
from psycopg import sql

from umt_sdk import (
    AttemptInfo,
    FencingError,
    Registry,
    RetryPolicy,
    TaskContext,
    TaskDefinition,
    connect,
    task,
    with_attempt_token,
)

EXT_TABLE = "ext_log"
READY = "READY"


@attrs.frozen
class Config:
    url: str
    schema: str
    business: str
    group: str
    workdir: Path


_CONFIG: list[Config] = []


def config() -> Config:
    if not _CONFIG:
        raise RuntimeError("worker_proc tasks run only inside the worker process")
    return _CONFIG[0]


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


def write_receipt_file(op_key: str, receipt: str) -> str:
    """Create the receipt file of `op_key` unless it exists (first write wins, atomically);
    return the receipt the file holds."""
    folder = config().workdir
    final = folder / f"{op_key}.receipt"
    scratch = folder / f".{op_key}.{os.getpid()}.{receipt}.tmp"
    scratch.write_text(receipt)
    try:
        os.link(scratch, final)  # fails if another attempt created it first
    except FileExistsError:
        pass
    finally:
        scratch.unlink()
    return final.read_text()


async def fenced_side_effect(ctx: TaskContext[Job]) -> str:
    await external(ctx, "side", "body")
    cfg = config()
    op_key = f"pay-{ctx.input.key}"

    async def act(info: AttemptInfo) -> str:
        await external(ctx, "side", "act", resumed=info.resumed)
        await asyncio.sleep(ctx.input.delay)
        return write_receipt_file(op_key, f"receipt-{info.attempt_token}")

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
            print(f"FENCED run={ctx.run_id} token={ctx.attempt_token}: {exc}", flush=True)
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
    with (config().workdir / f"{ctx.input.key}.bodies").open("a") as log:
        log.write(f"{step} {ctx.attempt_token}\n")
    await asyncio.sleep(ctx.input.delay)
    return f"{step}:{ctx.input.key}"


@task("t_pure", version=1, retry=RetryPolicy.none())
async def t_pure(ctx: TaskContext[Job]) -> list[str]:
    """No retries at all, and no database in its steps: only the engine's own writes can
    be hit by a database outage, and they must not fail the run."""
    return [await ctx.step.run(name, pure_body, ctx, name) for name in PURE_STEPS]


PURE_STEPS = ("p1", "p2", "p3", "p4")

ALL_TASKS: list[TaskDefinition[Any, Any]] = [t_io, t_io_v2, t_agent, t_order, t_cancel, t_pure]


async def serve(args: argparse.Namespace) -> None:
    _CONFIG.append(
        Config(
            url=args.url,
            schema=args.schema,
            business=args.business,
            group=args.group,
            workdir=Path(args.workdir),
        )
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    orphan_watch = asyncio.create_task(exit_when_orphaned(os.getppid()))
    engine = await connect(
        args.url,
        registry=Registry(ALL_TASKS),
        schema=args.schema,
        run_migrations=False,
        max_size=args.concurrency + 4,
    )
    async with engine:
        worker = engine.worker(
            versions=args.versions.split(","),
            concurrency=args.concurrency,
            lease=timedelta(seconds=args.lease),
            worker_id=f"{args.group}-{os.getpid()}",
            poll_interval=timedelta(seconds=args.poll),
            shutdown_grace=timedelta(seconds=1),
        )
        async with worker:
            print(f"{READY} pid={os.getpid()} worker={worker.worker_id}", flush=True)
            await stop.wait()
    orphan_watch.cancel()
    print("STOPPED", flush=True)


async def exit_when_orphaned(parent: int) -> None:
    """Die with the test process: a worker must not outlive a test run that was killed."""
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--versions", required=True, help="comma-separated name@version pairs")
    parser.add_argument("--lease", type=float, required=True, help="lease in seconds")
    parser.add_argument("--business", required=True, help="business table name in the schema")
    parser.add_argument("--group", default="default", help="worker group, recorded per step")
    parser.add_argument("--workdir", required=True, help="where receipt files are written")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--poll", type=float, default=1.0, help="poll interval in seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
