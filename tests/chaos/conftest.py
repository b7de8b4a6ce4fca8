"""Fixtures of the lease chaos tests: worker processes serving tests/chaos/lease_tasks.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest

from tests._procs.support import Spawner
from tests.chaos.lease_tasks import BUSINESS, TASKS, ddl
from umt_sdk import Engine, Registry, connect


@pytest.fixture
def lease_spawner(pg_url: str, pg_schema: str, tmp_path: Path) -> Iterator[Spawner]:
    """Workers of the lease tasks on the test's schema, polling every 0.2 s; SIGKILLed and
    reaped at teardown (a stopped one too) before the schema is dropped."""
    fields = {"url": pg_url, "schema": pg_schema, "business": BUSINESS, "poll": 0.2}
    with Spawner.under(tmp_path, tasks="tests.chaos.lease_tasks", **fields) as spawned:
        yield spawned


@pytest.fixture
async def lease_engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(ddl(pg_schema, BUSINESS))
    client = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema, run_migrations=False)
    try:
        yield client
    finally:
        await client.close()
