"""A worker process for the lease and ledger chaos tests (`test_lease_*.py`).

    python lease_worker.py --url URL --schema S --versions lease.busy@1 --lease 1 \
        --business lease_bookings --group a --workdir DIR --concurrency 4 --poll 0.2

The command line is the one `tests.integration._support.Spawner` passes. The worker serves the
tasks below until killed (SIGTERM stops it gracefully) and prints what the tests wait for, one
line each, flushed: `READY ...`, then `<EVENT> <run key> <attempt token>` lines. Every body also
appends a row to `<schema>.lease_log` (key, event, token, pid), so a test can count from the
database how often, and under which attempt, each body really ran. Files in `--workdir` are the
tests' switches (`touch` one to let a body go on).

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
    TaskContext,
    TaskDefinition,
    connect,
    task,
    with_attempt_token,
)

READY = "READY"
LOG_TABLE = "lease_log"
KILLS_ITSELF_MAX_LOST_LEASES = 3


@attrs.frozen
class Config:
    url: str
    schema: str
    business: str
    workdir: Path


_CONFIG: list[Config] = []


def cfg() -> Config:
    if not _CONFIG:
        raise RuntimeError("these tasks run only inside lease_worker.py")
    return _CONFIG[0]


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


def say(event: str, key: str, token: int) -> None:
    print(f"{event} {key} {token}", flush=True)


async def log(event: str, key: str, token: int) -> None:
    async with await psycopg.AsyncConnection.connect(cfg().url, autocommit=True) as conn:
        await conn.execute(
            sql.SQL("INSERT INTO {}.{} (key, event, token, pid) VALUES (%s, %s, %s, %s)").format(
                sql.Identifier(cfg().schema), sql.Identifier(LOG_TABLE)
            ),
            (key, event, token, os.getpid()),
        )


async def until_file(name: str, *, limit: float = 60.0) -> bool:
    """Wait for the switch file `name` in the workdir (at most `limit` seconds)."""
    path = cfg().workdir / name
    for _ in range(int(limit / 0.02)):
        if path.exists():
            return True
        await asyncio.sleep(0.02)
    return False


async def heartbeat_named(run_id: Any, token: int, step_name: str) -> None:
    """Wait until a heartbeat has recorded that this execution is inside `step_name`."""
    query = sql.SQL(
        "SELECT current_step FROM {}.executions WHERE run_id = %s AND fencing_token = %s"
    ).format(sql.Identifier(cfg().schema))
    async with await psycopg.AsyncConnection.connect(cfg().url, autocommit=True) as conn:
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
                sql.Identifier(cfg().schema), sql.Identifier(cfg().business)
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
        async with await psycopg.AsyncConnection.connect(cfg().url, autocommit=True) as conn:
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


ALL_TASKS: list[TaskDefinition[Any, Any]] = [busy, fenced, kills_itself]


async def serve(args: argparse.Namespace) -> None:
    _CONFIG.append(Config(args.url, args.schema, args.business, Path(args.workdir)))
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


async def exit_when_orphaned(parent: int) -> None:
    """Die with the test process: a worker must not outlive a test run that was killed."""
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for flag in ("--url", "--schema", "--versions", "--business", "--workdir"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--lease", type=float, required=True)
    parser.add_argument("--group", default="default")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--poll", type=float, default=1.0)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
