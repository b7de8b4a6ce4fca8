"""A plain step hung in its thread, in a real worker process: the run still ends at its
deadline, and the worker's slot and the run's lease are released (Postgres).

A thread cannot be killed, so the worker gives the step up: the run ends `failed` with
`DeadlineExceededError` by the worker that holds it (no takeover, no lost lease), the one slot
of the worker (`concurrency=1`) runs the next run while the hung thread still sleeps, and the
process stays up. This fails if the deadline waits for the thread, or if the slot or the lease
stays with the hung run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from psycopg import sql

from tests._procs.support import Spawner, fetch, finished
from tests.chaos.deadline_tasks import HUNG_DEADLINE, TASKS, Key, hung, quick
from umt_sdk import Engine, Registry, connect


@pytest.fixture
def deadline_spawner(pg_url: str, pg_schema: str, tmp_path: Path) -> Iterator[Spawner]:
    fields = {"url": pg_url, "schema": pg_schema, "poll": 0.2}
    with Spawner.under(tmp_path, tasks="tests.chaos.deadline_tasks", **fields) as spawned:
        yield spawned


@pytest.fixture
async def deadline_engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    client = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema, run_migrations=False)
    try:
        yield client
    finally:
        await client.close()


async def test_a_plain_step_hung_in_its_thread_ends_at_the_deadline_and_frees_the_slot(
    deadline_engine: Engine, deadline_spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    worker = deadline_spawner.start(concurrency=1, lease=1.0)
    await worker.wait_ready()
    stuck = await deadline_engine.enqueue(hung, Key(key="stuck"))
    token = await worker.printed("HUNG_STARTED", "stuck")
    after = await deadline_engine.enqueue(quick, Key(key="after"))

    info = await finished(deadline_engine, stuck.run_id, timeout=30)
    assert info.status == "failed", worker.describe()
    assert info.error is not None
    assert info.error.type.rsplit(".", 1)[-1] == "DeadlineExceededError"
    assert info.deadline_at == info.created_at + HUNG_DEADLINE
    assert info.finished_at is not None
    assert info.finished_at >= info.deadline_at
    assert (info.attempts, info.lease_expirations) == (1, 0), "ended by its holder, no takeover"
    assert [(e.fencing_token, e.outcome) for e in info.executions] == [(token, "failed")]

    # The one slot runs the next run while the hung thread still sleeps in the process.
    assert (await finished(deadline_engine, after.run_id, timeout=30)).status == "completed"
    assert worker.events("QUICK_RAN", "after"), worker.describe()
    assert worker.alive, worker.describe()
    (row,) = await fetch(
        pg_url,
        sql.SQL("SELECT status, lease_owner, lease_expires_at FROM {}.runs WHERE id = %s").format(
            sql.Identifier(pg_schema)
        ),
        (stuck.run_id,),
    )
    assert row == {"status": "failed", "lease_owner": None, "lease_expires_at": None}
