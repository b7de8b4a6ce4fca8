"""A worker process for the fenced side-effect tests.

    python worker_proc.py --url URL --schema S --workdir DIR --name NAME

It serves two tasks until killed (SIGTERM stops it gracefully):

- `fenced_action`: one step that submits an order to a fake "external system" through
  `with_attempt_token`: it writes a file (first write wins) and appends the order to the
  external system's append-only table `ext_orders`, then commits a `bookings` row in the ledger's
  transaction. A resumed attempt (`info.resumed`) reconciles first: it looks the order up by its
  key and finishes with it, or redoes the action when it is not there. The external system
  refuses a write whose fencing token is older than one it has already seen for the key.
  The input names a pause point; on the run's first claim the worker prints
  `PAUSED <point> <token>` there and blocks until the file `<workdir>/release` exists, so a test
  can SIGKILL or SIGSTOP it at exactly that point:
    before_begin  - in the step, before the ledger's begin
    in_action     - inside the action, before it writes anything
    after_action  - after the action wrote (file and external order), before the commit
    after_commit  - after the commit of the business row, before the step is recorded
- `copy_file`: a long step copying a file in chunks, checking the abort signal per chunk;
  it prints `ABORTED signal_at=<chunk> stopped_at=<chunk>` when a cancel stops it.

Every handler exit prints `EXIT <token> <outcome>`. The test process imports this module for
the task definitions and the DDL.
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
    connect,
    task,
    with_attempt_token,
)

POINTS = ("before_begin", "in_action", "after_action", "after_commit")
CHUNK = 64 * 1024


@attrs.frozen
class Config:
    url: str
    schema: str
    workdir: Path
    name: str


_CONFIG: list[Config] = []


def cfg() -> Config:
    if not _CONFIG:
        raise RuntimeError("these tasks run only inside worker_proc.py")
    return _CONFIG[0]


@attrs.frozen
class Action:
    key: str
    pause: str = ""


@attrs.frozen
class Copy:
    source: str
    target: str
    chunk_delay: float = 0.02


def ddl(schema: str) -> sql.Composed:
    # No unique constraints anywhere: a doubled side effect must show up as a second row.
    return sql.SQL(
        """
        CREATE TABLE {s}.ext_orders (
            seq bigserial PRIMARY KEY, op_key text NOT NULL, ref text NOT NULL,
            token bigint NOT NULL, pid integer NOT NULL);
        CREATE TABLE {s}.ext_log (
            seq bigserial PRIMARY KEY, op_key text NOT NULL, token bigint NOT NULL,
            event text NOT NULL, pid integer NOT NULL);
        CREATE TABLE {s}.attempt_log (
            seq bigserial PRIMARY KEY, op_key text NOT NULL, token bigint NOT NULL,
            resumed boolean NOT NULL, decision text NOT NULL);
        CREATE TABLE {s}.bookings (
            op_key text NOT NULL, ref text NOT NULL, token bigint NOT NULL);
        """
    ).format(s=sql.Identifier(schema))


def _q(text: str) -> sql.Composed:
    return sql.SQL(text).format(s=sql.Identifier(cfg().schema))


class StaleTokenError(Exception):
    """The external system has seen a newer fencing token for this key."""


async def ext_submit(op_key: str, token: int) -> str:
    """The external system's write: refused for a stale token; otherwise a new order."""
    async with await psycopg.AsyncConnection.connect(cfg().url) as conn:
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (op_key,))
        cur = await conn.execute(
            _q("SELECT max(token) FROM {s}.ext_log WHERE op_key = %s AND event = 'submit'"),
            (op_key,),
        )
        row = await cur.fetchone()
        newest = row[0] if row else None
        if newest is not None and newest > token:
            await conn.execute(
                _q("INSERT INTO {s}.ext_log (op_key, token, event, pid) VALUES (%s, %s, %s, %s)"),
                (op_key, token, "rejected-stale", os.getpid()),
            )
            await conn.commit()
            raise StaleTokenError(f"{op_key}: token {token} is older than {newest}")
        ref = f"order-{op_key}-{token}"
        await conn.execute(
            _q("INSERT INTO {s}.ext_log (op_key, token, event, pid) VALUES (%s, %s, %s, %s)"),
            (op_key, token, "submit", os.getpid()),
        )
        await conn.execute(
            _q("INSERT INTO {s}.ext_orders (op_key, ref, token, pid) VALUES (%s, %s, %s, %s)"),
            (op_key, ref, token, os.getpid()),
        )
        await conn.commit()
    return ref


async def ext_find(op_key: str) -> str | None:
    async with await psycopg.AsyncConnection.connect(cfg().url, autocommit=True) as conn:
        cur = await conn.execute(
            _q("SELECT ref FROM {s}.ext_orders WHERE op_key = %s ORDER BY seq LIMIT 1"), (op_key,)
        )
        row = await cur.fetchone()
    return None if row is None else str(row[0])


def write_first(path: Path, content: str) -> None:
    """Create `path` with `content` unless it exists (atomically; the first write wins)."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(content)
    try:
        os.link(scratch, path)
    except FileExistsError:
        pass
    finally:
        scratch.unlink()


async def pause(ctx: TaskContext[Action], point: str) -> None:
    if ctx.input.pause != point or ctx.attempt != 1:
        return
    print(f"PAUSED {point} {ctx.attempt_token}", flush=True)
    release = cfg().workdir / "release"
    while not release.exists():  # noqa: ASYNC110 - a flag set by another process
        await asyncio.sleep(0.01)
    print(f"RESUMED {point} {ctx.attempt_token}", flush=True)


async def log_attempt(op_key: str, info: AttemptInfo, decision: str) -> None:
    async with await psycopg.AsyncConnection.connect(cfg().url, autocommit=True) as conn:
        await conn.execute(
            _q(
                "INSERT INTO {s}.attempt_log (op_key, token, resumed, decision)"
                " VALUES (%s, %s, %s, %s)"
            ),
            (op_key, info.attempt_token, info.resumed, decision),
        )


async def submit(ctx: TaskContext[Action]) -> str:
    op_key = f"submit:{ctx.input.key}"
    await pause(ctx, "before_begin")

    async def act(info: AttemptInfo) -> str:
        await pause(ctx, "in_action")
        if info.resumed:  # an earlier attempt began: look the outside state up first
            found = await ext_find(op_key)
            if found is not None:
                await log_attempt(op_key, info, "reconciled")
                return found
            await log_attempt(op_key, info, "redo")
        else:
            await log_attempt(op_key, info, "fresh")
        write_first(cfg().workdir / f"{ctx.input.key}.order", f"token {info.attempt_token}\n")
        ref = await ext_submit(op_key, info.attempt_token)
        await pause(ctx, "after_action")
        return ref

    async def record(tx: Any, ref: str) -> None:
        await tx.execute(
            _q("INSERT INTO {s}.bookings (op_key, ref, token) VALUES (%s, %s, %s)"),
            (op_key, ref, ctx.attempt_token),
        )

    async with await psycopg.AsyncConnection.connect(cfg().url, autocommit=True) as conn:
        try:
            ref = await with_attempt_token(conn, op_key, act, commit=record)
        except FencingError:
            print(f"FENCED {ctx.attempt_token}", flush=True)
            raise
    await pause(ctx, "after_commit")
    return ref


RETRY = RetryPolicy(max_attempts=5, initial=timedelta(milliseconds=100))


@task("fenced_action", version=1, retry=RETRY)
async def fenced_action(ctx: TaskContext[Action]) -> str:
    outcome = "returned"
    try:
        ref: str = await ctx.step.run("submit", submit, ctx)
        return ref
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        print(f"EXIT {ctx.attempt_token} {outcome}", flush=True)


@task("copy_file", version=1, retry=RetryPolicy.file())
async def copy_file(ctx: TaskContext[Copy]) -> int:
    async def copy() -> int:
        done = 0
        signal_at: list[int] = []

        async def watch() -> None:
            await ctx.abort_event.wait()
            signal_at.append(done)

        watcher = asyncio.create_task(watch())
        try:
            with open(ctx.input.source, "rb") as src, open(ctx.input.target, "wb") as dst:  # noqa: ASYNC230
                while True:
                    ctx.throw_if_canceled()  # once per chunk
                    chunk = src.read(CHUNK)
                    if not chunk:
                        return done
                    dst.write(chunk)
                    dst.flush()
                    done += 1
                    print(f"CHUNK {done}", flush=True)
                    await asyncio.sleep(ctx.input.chunk_delay)
        except BaseException:
            if signal_at:
                print(f"ABORTED signal_at={signal_at[0]} stopped_at={done}", flush=True)
            raise
        finally:
            watcher.cancel()

    return await ctx.step.run("copy", copy)


registry = Registry([fenced_action, copy_file])
READY = "READY"


async def main(args: argparse.Namespace) -> None:
    _CONFIG.append(Config(args.url, args.schema, Path(args.workdir), args.name))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    engine = await connect(
        args.url, registry=registry, schema=args.schema, run_migrations=False, max_size=4
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with engine.worker(
        concurrency=1,
        lease=timedelta(seconds=1),
        worker_id=args.name,
        poll_interval=timedelta(milliseconds=200),
        shutdown_grace=timedelta(seconds=2),
    ):
        print(READY, flush=True)
        await stop.wait()
    await engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--url", "--schema", "--workdir", "--name"):
        parser.add_argument(flag, required=True)
    asyncio.run(main(parser.parse_args()))
