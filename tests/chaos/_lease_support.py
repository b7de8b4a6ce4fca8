"""Fixtures and helpers of the lease chaos tests: worker processes running `lease_worker.py`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from tests.chaos.lease_worker import ALL_TASKS, ddl
from tests.integration._support import Spawner, WorkerProcess, fetch, q
from umt_sdk import Engine, Registry, RunInfo, connect

PROGRAM = Path(__file__).with_name("lease_worker.py")
BUSINESS = "lease_bookings"


@pytest.fixture
def lease_spawner(pg_url: str, pg_schema: str, tmp_path: Path) -> Iterator[Spawner]:
    """`lease_worker.py` processes on the test's schema, SIGKILLed and reaped at teardown
    (a stopped one too) before the schema is dropped."""
    logs, workdir = tmp_path / "logs", tmp_path / "files"
    logs.mkdir()
    workdir.mkdir()
    spawned = Spawner(url=pg_url, schema=pg_schema, logs=logs, workdir=workdir, business=BUSINESS)
    try:
        yield spawned
    finally:
        spawned.close()


@pytest.fixture
async def lease_engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(ddl(pg_schema, BUSINESS))
    client = await connect(
        pg_url, registry=Registry(ALL_TASKS), schema=pg_schema, run_migrations=False
    )
    try:
        yield client
    finally:
        await client.close()


def start(
    spawner: Spawner, *, group: str, concurrency: int = 4, lease: float = 1.0
) -> WorkerProcess:
    return spawner.start(
        versions="lease.busy@1,lease.fenced@1,lease.kills_itself@1",
        lease=lease,
        group=group,
        concurrency=concurrency,
        poll=0.2,
        program=PROGRAM,
    )


def lines(worker: WorkerProcess, event: str, key: str | None = None) -> list[list[str]]:
    """The `<event> <key> <token>` lines the worker printed (for `key`, when given)."""
    found = []
    for line in worker.output().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == event and (key is None or parts[1] == key):
            found.append(parts)
    return found


async def printed(worker: WorkerProcess, event: str, key: str, *, timeout: float = 30.0) -> int:
    """Wait for the worker to print `<event> <key> <token>`; return the token."""
    deadline = time.monotonic() + timeout
    while True:
        found = lines(worker, event, key)
        if found:
            return int(found[0][2])
        if time.monotonic() > deadline:
            raise AssertionError(f"no {event} {key} after {timeout} s\n{worker.describe()}")
        await asyncio.sleep(0.02)


def stopped(worker: WorkerProcess) -> bool:
    """Whether the process is stopped (SIGSTOP), as the kernel says."""
    stat = Path(f"/proc/{worker.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def finished(engine: Engine, run_id: UUID, *, timeout: float = 60.0) -> RunInfo:
    info: RunInfo = (await engine.wait_idle([run_id], timeout=timeout))[0]
    return info


async def log_rows(url: str, schema: str, key: str) -> list[dict[str, Any]]:
    return await fetch(
        url, q("SELECT * FROM {schema}.lease_log WHERE key = %s ORDER BY seq", schema), (key,)
    )


async def bookings(url: str, schema: str) -> list[dict[str, Any]]:
    return await fetch(url, q("SELECT * FROM {schema}.{b} ORDER BY key", schema, b=BUSINESS))
