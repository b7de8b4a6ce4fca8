from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.integration._support import Spawner, create_tables
from tests.integration.worker_proc import ALL_TASKS
from umt_sdk import Engine, Registry, connect


@pytest.fixture
def spawner(pg_url: str, pg_schema: str, tmp_path: Path) -> Iterator[Spawner]:
    """Worker processes on the test's schema; every one is SIGKILLed and reaped at teardown
    (before the schema is dropped), whatever the test's outcome."""
    logs = tmp_path / "logs"
    workdir = tmp_path / "files"
    logs.mkdir()
    workdir.mkdir()
    spawned = Spawner(url=pg_url, schema=pg_schema, logs=logs, workdir=workdir)
    try:
        yield spawned
    finally:
        spawned.close()


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    """The test process's client on the schema, with the business and external tables."""
    await create_tables(pg_url, pg_schema)
    client = await connect(
        pg_url, registry=Registry(ALL_TASKS), schema=pg_schema, run_migrations=False
    )
    try:
        yield client
    finally:
        await client.close()
