"""A pause racing a claim on Postgres: both must finish, neither may fail with `deadlock detected`.

A claim locks a run's row, then deletes its `ready` row; a pause deletes the pair's `ready` rows
and marks their runs unqueued. When the pause took a `ready` row first and then waited for its
run's row, held by a claim waiting for that same `ready` row, the two deadlocked (seen once in
the dashboard's tests). The test makes that order happen every time: a third connection holds
the first run's `ready` row, the pause queues behind it, then the claim locks the run and queues
behind the pause; the holder lets go."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import attrs
import psycopg
import pytest
from psycopg import sql

from umt_sdk import Engine, Registry, TaskContext, connect, task
from umt_sdk.backend import TaskPair


@attrs.frozen
class Job:
    n: int


@task("pause.race", version=1)
async def job(ctx: TaskContext[Job]) -> int:
    return ctx.input.n


PAIR = TaskPair(name="pause.race", version=1)


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    client = await connect(pg_url, registry=Registry([job]), schema=pg_schema, run_migrations=False)
    try:
        yield client
    finally:
        await client.close()


async def waiting_for_locks(pg_url: str, count: int) -> None:
    """Until `count` sessions of this database wait for a lock."""
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        for _ in range(500):
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            row = await cur.fetchone()
            if row is not None and row[0] >= count:
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"{count} sessions never waited for a lock")


async def test_a_pause_queued_before_a_claim_on_the_same_run_does_not_deadlock(
    engine: Engine, pg_url: str, pg_schema: str
) -> None:
    backend = engine.backend
    for round_ in range(3):
        first = (await engine.enqueue(job, Job(n=2 * round_))).run_id
        await engine.enqueue(job, Job(n=2 * round_ + 1))
        async with await psycopg.AsyncConnection.connect(pg_url) as holder:
            await holder.execute(
                sql.SQL("SELECT 1 FROM {}.ready WHERE run_id = %s FOR UPDATE").format(
                    sql.Identifier(pg_schema)
                ),
                (first,),
            )
            pause = asyncio.create_task(engine.pause("pause.race@1"))
            await waiting_for_locks(pg_url, 1)
            claim = asyncio.create_task(
                backend.claim(worker_id="racer", pairs=[PAIR], limit=1, lease=timedelta(seconds=60))
            )
            # The claim either queued behind the pause (on the run's `ready` row) or found
            # every run locked by the pause and came back empty: give it the time to do either.
            done, _ = await asyncio.wait({claim}, timeout=1.0)
            if not done:
                await waiting_for_locks(pg_url, 2)
            await holder.commit()
        outcomes = await asyncio.gather(pause, claim, return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        assert not errors, f"round {round_}: {errors!r}"
        assert outcomes[0] is True, "the pause is stored"
        assert await engine.resume("pause.race@1")
