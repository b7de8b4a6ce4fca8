"""Debounce racing a claim on Postgres: a trigger never changes a run that a claim took.

A trigger updates the key's run that has not started (pending, never claimed). When a claim
takes that run while the trigger waits for its row, the trigger's update re-checks the run on
its newest version, finds it claimed, and stores a new run instead: the claimed run keeps the
input it was claimed with. The test makes that order happen every time: a second connection
locks the run's row and writes what a claim writes (running, one claim); the trigger queues
behind it; the holder commits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import attrs
import psycopg
import pytest
from psycopg import sql

from umt_sdk import Debounce, Engine, Registry, TaskContext, connect, task
from umt_sdk.backend import ClaimedRun, TaskPair


@attrs.frozen
class Edit:
    text: str


@task("debounce.race", version=1)
async def reindex(ctx: TaskContext[Edit]) -> str:
    return ctx.input.text


PAIR = TaskPair(name="debounce.race", version=1)
EDITS = Debounce("doc", period=timedelta(milliseconds=1))


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    client = await connect(
        pg_url, registry=Registry([reindex]), schema=pg_schema, run_migrations=False
    )
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


async def test_a_trigger_waiting_for_a_run_a_claim_takes_stores_a_new_run(
    engine: Engine, pg_url: str, pg_schema: str
) -> None:
    first = await engine.enqueue(reindex, Edit("v1"), debounce=EDITS)
    async with await psycopg.AsyncConnection.connect(pg_url) as holder:
        await holder.execute(
            sql.SQL(
                "UPDATE {}.runs SET status = 'running', claims = claims + 1 WHERE id = %s"
            ).format(sql.Identifier(pg_schema)),
            (first.run_id,),
        )
        trigger = asyncio.create_task(engine.enqueue(reindex, Edit("v2"), debounce=EDITS))
        await waiting_for_locks(pg_url, 1)
        assert not trigger.done()
        await holder.commit()
    second = await asyncio.wait_for(trigger, timeout=30)
    assert second.created
    assert second.run_id != first.run_id
    taken = await engine.get(first.run_id)
    assert taken.input == {"text": "v1"}, "the claimed run keeps the input it was claimed with"
    assert (await engine.get(second.run_id)).input == {"text": "v2"}


async def test_a_trigger_after_a_real_claim_stores_a_new_run(engine: Engine) -> None:
    first = await engine.enqueue(reindex, Edit("v1"), debounce=EDITS)
    claimed: list[ClaimedRun] = []
    for _ in range(200):  # the period is a millisecond; the claim reads timers about once a second
        claimed += await engine.backend.claim(
            worker_id="racer", pairs=[PAIR], limit=1, lease=timedelta(seconds=60)
        )
        if claimed:
            break
        await asyncio.sleep(0.05)
    assert [c.run_id for c in claimed] == [first.run_id]
    second = await engine.enqueue(reindex, Edit("v2"), debounce=EDITS)
    assert second.created
    assert (await engine.get(first.run_id)).input == {"text": "v1"}
