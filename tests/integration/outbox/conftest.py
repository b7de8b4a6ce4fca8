"""Fixtures of the outbox tests: the engine's schema, an outbox table, the two layouts, relays."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests._procs.support import Spawner
from tests.integration.outbox.tasks import registry
from umt_backend_pg import OutboxRelay, install_outbox
from umt_sdk import Engine, connect


@pytest.fixture(params=["same", "two"], ids=["same-db", "two-dbs"])
def layout(request: pytest.FixtureRequest, pg_url: str) -> Iterator[str]:
    """The business database URL: the engine's own (same-db) or a second database (two-dbs)."""
    if request.param == "same":
        yield pg_url
        return
    yield request.getfixturevalue("second_db")


@pytest.fixture
async def outbox(pg_url: str, pg_schema: str) -> str:
    """The outbox table `<pg_schema>.outbox_event` in the engine's database."""
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await install_outbox(conn, schema=pg_schema)
    return pg_url


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    client = await connect(
        pg_url, registry=registry, schema=pg_schema, run_migrations=False, max_size=4
    )
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def relays(tmp_path: Path) -> Iterator[Spawner]:
    """Relay processes (`start_relay`), SIGKILLed and reaped at teardown if still alive."""
    with Spawner.under(tmp_path) as spawned:
        yield spawned


@pytest.fixture
async def make_relay() -> AsyncIterator[Callable[..., OutboxRelay]]:
    """OutboxRelay(...), closed at teardown (a relay used through run_once keeps a connection)."""
    made: list[OutboxRelay] = []

    def make(*args: Any, **kwargs: Any) -> OutboxRelay:
        relay = OutboxRelay(*args, **kwargs)
        made.append(relay)
        return relay

    yield make
    for relay in made:
        await relay.stop()
