"""A worker process for tests/chaos/test_epoch_worker_processes.py (Postgres crashed under it).

    python crash_worker.py --url URL --schema S --business-url URL --workdir DIR --name NAME

It serves `epoch.pay` until killed (SIGTERM stops it gracefully). Nothing its step bodies do
touches the engine's database, which the test crashes: every body appends a line
`<run key> <step> <attempt token> <pid>` to `<workdir>/bodies.log`, and the fenced side effect
goes to a business database on another server:
- inside `with_attempt_token` (ledger installed there with `install_ledger`), it writes to an
  outside store that fences by token itself, as outside systems do: a write is taken unless
  the store has already seen a newer token for the op (`store_writes`, `accepted`);
- the ledger's commit adds the op's row to `payments` (deliberately no unique key).

The test process imports this module for the task definition and the DDL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import psycopg

from umt_backend_pg import install_ledger
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

READY = "READY"
BODIES = "bodies.log"
BUSINESS_DDL = (
    "CREATE TABLE payments (op_key text NOT NULL, receipt text NOT NULL, token bigint NOT NULL,"
    " pid integer NOT NULL)",
    "CREATE TABLE store_fence (op_key text PRIMARY KEY, max_token bigint NOT NULL)",
    "CREATE TABLE store_writes (seq bigserial PRIMARY KEY, op_key text NOT NULL,"
    " token bigint NOT NULL, pid integer NOT NULL, accepted boolean NOT NULL,"
    " at timestamptz NOT NULL DEFAULT clock_timestamp())",
)


@attrs.frozen
class Config:
    business_url: str
    workdir: Path


_CONFIG: list[Config] = []


@attrs.frozen
class Payment:
    key: str
    delay: float = 1.0
    """How long the side effect takes (seconds): a crash lands while it runs."""


async def install_business(conn: psycopg.AsyncConnection[Any], schema: str) -> None:
    await install_ledger(conn, schema=schema)
    for statement in BUSINESS_DDL:
        await conn.execute(statement)


def log_body(ctx: TaskContext[Payment], step: str) -> None:
    line = f"{ctx.input.key} {step} {ctx.attempt_token} {os.getpid()}\n".encode()
    fd = os.open(_CONFIG[0].workdir / BODIES, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one small append: atomic among processes
    finally:
        os.close(fd)


async def store_write(op_key: str, token: int) -> None:
    """The outside store: takes the write unless it has seen a newer token for `op_key`."""
    async with await psycopg.AsyncConnection.connect(
        _CONFIG[0].business_url, autocommit=True
    ) as conn:
        await conn.execute(
            "WITH fence AS ("
            " INSERT INTO store_fence (op_key, max_token) VALUES (%(op)s, %(token)s)"
            " ON CONFLICT (op_key) DO UPDATE SET max_token = EXCLUDED.max_token"
            " WHERE store_fence.max_token <= EXCLUDED.max_token RETURNING 1)"
            " INSERT INTO store_writes (op_key, token, pid, accepted)"
            " SELECT %(op)s, %(token)s, %(pid)s, EXISTS (SELECT 1 FROM fence)",
            {"op": op_key, "token": token, "pid": os.getpid()},
        )


async def pay_step(ctx: TaskContext[Payment]) -> str:
    log_body(ctx, "pay")
    op_key = f"pay-{ctx.input.key}"

    async def act(info: AttemptInfo) -> str:
        log_body(ctx, "act")
        await store_write(op_key, info.attempt_token)
        await asyncio.sleep(ctx.input.delay)
        return f"receipt-{info.attempt_token}"

    async def commit(tx: Any, receipt: str) -> None:
        await tx.execute(
            "INSERT INTO payments (op_key, receipt, token, pid) VALUES (%s, %s, %s, %s)",
            (op_key, receipt, ctx.attempt_token, os.getpid()),
        )

    async with await psycopg.AsyncConnection.connect(
        _CONFIG[0].business_url, autocommit=True
    ) as conn:
        try:
            return await with_attempt_token(conn, op_key, act, commit=commit)
        except FencingError as exc:
            print(f"FENCED run={ctx.run_id} token={ctx.attempt_token}: {exc}", flush=True)
            raise


async def note_step(ctx: TaskContext[Payment]) -> str:
    log_body(ctx, "note")
    await asyncio.sleep(ctx.input.delay / 2)
    return f"noted {ctx.input.key}"


@task("epoch.pay", version=1, retry=RetryPolicy.none())
async def pay(ctx: TaskContext[Payment]) -> list[str]:
    """The fenced payment, then a plain step; no retries: a failure would show."""
    receipt = await ctx.step.run("pay", pay_step, ctx)
    note = await ctx.step.run("note", note_step, ctx)
    return [receipt, note]


STEPS = ("pay", "note")


async def serve(args: argparse.Namespace) -> None:
    _CONFIG.append(Config(business_url=args.business_url, workdir=Path(args.workdir)))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    parent = os.getppid()
    engine = await connect(
        args.url, registry=Registry([pay]), schema=args.schema, run_migrations=False
    )
    async with engine:
        worker = engine.worker(
            concurrency=args.concurrency,
            lease=timedelta(seconds=args.lease),
            worker_id=f"{args.name}-{os.getpid()}",
            poll_interval=timedelta(seconds=args.poll),
            shutdown_grace=timedelta(seconds=1),
        )
        async with worker:
            print(f"{READY} pid={os.getpid()} worker={worker.worker_id}", flush=True)
            while not stop.is_set():
                if os.getppid() != parent:  # die with the test process
                    os._exit(3)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.5)
    print("STOPPED", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--business-url", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--name", default="w")
    parser.add_argument("--lease", type=float, default=3.0, help="lease in seconds")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--poll", type=float, default=0.05, help="poll interval in seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
