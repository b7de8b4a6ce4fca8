"""A client frozen between the statements of a transaction (SIGSTOP, a stalled VM) must not keep
its row locks: Postgres keeps a stopped process's connection alive (the kernel still answers),
so without a limit a claim or a heartbeat frozen after its statement and before its COMMIT holds
the run's row until the process wakes up, and every other worker's claim skips it (SKIP LOCKED):
the run stays `running` under a dead lease. The engine's pool sets
`idle_in_transaction_session_timeout` on its connections (`idle_in_transaction_timeout=`, 10 s by
default), so the server rolls the frozen transaction back.

Each test starts a real process that opens the Postgres backend, takes a connection of the
engine's own pool, locks a run's row inside a transaction as a heartbeat does, and stops itself
with SIGSTOP. A worker in this process must then finish the run. Without the setting the run is
still stuck seconds after the lease (the control: the test can fail)."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta

import attrs
import psycopg
import pytest
from psycopg import sql

from umt_backend_pg import PostgresBackend
from umt_sdk import Engine, Registry, TaskContext, UsageError, connect, task


@attrs.frozen
class Job:
    n: int


@task("frozen.job", version=1)
async def job(ctx: TaskContext[Job]) -> int:
    return ctx.input.n * 2


FREEZER = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from datetime import timedelta
    from umt_backend_pg import PostgresBackend

    async def main(url, schema, run_id, idle):
        timeout = None if idle == "none" else timedelta(seconds=float(idle))
        backend = await PostgresBackend.open(
            url, schema=schema, run_migrations=False, listen=False,
            idle_in_transaction_timeout=timeout,
        )
        async with backend._pool.connection() as conn:
            async with conn.transaction():
                await conn.execute(
                    f"SELECT 1 FROM {schema}.runs WHERE id = %s FOR NO KEY UPDATE", (run_id,)
                )
                print("LOCKED", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen here, the transaction open

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    client = await connect(pg_url, registry=Registry([job]), schema=pg_schema, run_migrations=False)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def freezers() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def freeze_holding(
    freezers: list[subprocess.Popen[str]], pg_url: str, schema: str, run_id: object, idle: str
) -> None:
    """A process holding `run_id`'s row in an open transaction, stopped by SIGSTOP."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FREEZER, pg_url, schema, str(run_id), idle],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    freezers.append(proc)
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], 60)  # bounded: it may never print
    line = proc.stdout.readline() if readable else ""
    assert line.strip() == "LOCKED", f"the freezer printed {line!r} (exit {proc.poll()})"


async def row_locked(pg_url: str, schema: str, run_id: object) -> bool:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        try:
            async with conn.transaction():
                await conn.execute(
                    sql.SQL("SELECT 1 FROM {}.runs WHERE id = %s FOR NO KEY UPDATE NOWAIT").format(
                        sql.Identifier(schema)
                    ),
                    (run_id,),
                )
        except psycopg.errors.LockNotAvailable:
            return True
    return False


async def test_a_frozen_transaction_is_rolled_back_and_the_run_taken(
    engine: Engine, pg_url: str, pg_schema: str, freezers: list[subprocess.Popen[str]]
) -> None:
    handle = await engine.enqueue(job, Job(n=21))
    freeze_holding(freezers, pg_url, pg_schema, handle.run_id, "1")
    assert await row_locked(pg_url, pg_schema, handle.run_id), "the freezer holds the row"
    async with engine.worker(lease=timedelta(seconds=1), schedules=False):
        assert await engine.result(handle.run_id, timeout=30) == 42
    assert freezers[0].poll() is None, "the freezer is still stopped, not gone"


async def test_without_the_timeout_the_frozen_transaction_keeps_the_run(
    engine: Engine, pg_url: str, pg_schema: str, freezers: list[subprocess.Popen[str]]
) -> None:
    """The control: with the server's default (no limit), the frozen lock holds the run back."""
    handle = await engine.enqueue(job, Job(n=1))
    freeze_holding(freezers, pg_url, pg_schema, handle.run_id, "none")
    async with engine.worker(lease=timedelta(seconds=1), schedules=False):
        await asyncio.sleep(4)  # four leases: the run would long be done
        info = await engine.get(handle.run_id)
        assert info.status == "pending", info
        assert await row_locked(pg_url, pg_schema, handle.run_id)


async def test_the_setting_is_on_every_connection_of_the_pool(pg_url: str, pg_schema: str) -> None:
    backend = await PostgresBackend.open(
        pg_url,
        schema=pg_schema,
        run_migrations=False,
        listen=False,
        idle_in_transaction_timeout=timedelta(seconds=7),
    )
    try:
        async with backend._pool.connection() as conn:
            row = await (await conn.execute("SHOW idle_in_transaction_session_timeout")).fetchone()
        assert row == ("7s",)
    finally:
        await backend.close()


@pytest.mark.parametrize(
    "value", [timedelta(milliseconds=500), 10, "10s", timedelta(seconds=-1)], ids=repr
)
async def test_a_bad_timeout_is_refused_naming_it(pg_url: str, value: object) -> None:
    with pytest.raises(UsageError, match="idle_in_transaction_timeout must be a timedelta"):
        await PostgresBackend.open(
            pg_url,
            run_migrations=False,
            idle_in_transaction_timeout=value,  # type: ignore[arg-type]
        )
