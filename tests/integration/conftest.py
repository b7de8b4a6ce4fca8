from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests._procs.support import Spawner
from tests.integration.tasks import BUSINESS, TASKS, create_tables
from umt_sdk import Engine, Registry, connect


@pytest.fixture
def spawner(pg_url: str, pg_schema: str, tmp_path: Path) -> Iterator[Spawner]:
    """Worker processes serving tests/integration/tasks.py on the test's schema; every one is
    SIGKILLed and reaped at teardown (before the schema is dropped), whatever the test's
    outcome."""
    fields = {"url": pg_url, "schema": pg_schema, "business": BUSINESS}
    with Spawner.under(tmp_path, tasks="tests.integration.tasks", **fields) as spawned:
        yield spawned


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    """The test process's client on the schema, with the business and external tables."""
    await create_tables(pg_url, pg_schema)
    client = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema, run_migrations=False)
    try:
        yield client
    finally:
        await client.close()
