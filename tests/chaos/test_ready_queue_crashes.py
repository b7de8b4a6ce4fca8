"""The ready queue through Postgres crashes (`pg_ctl stop -m immediate`): a crash while an
enqueue, a claim and a rotation of the queue are under way loses no run, keeps no run out of
the claim's reach, and hands out no token twice.

At the crash: runs enqueued (committed, durably) across the queue's slots; claims committed
without waiting for their WAL (lost with it: `SLOW_FLUSH` keeps them unflushed); an enqueue in
a transaction still open; a rotation that has moved a slot's live rows and truncated it, not
yet committed. After recovery every committed run must be claimable exactly once (or still
held by a claim that survived), and every new token must be above every token handed out
before the crash.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from tests.fixtures.private_pg import PrivatePostgres
from umt_backend_pg import PostgresBackend, migrate
from umt_sdk.backend import ClaimedRun, NewRun, TaskPair

pytestmark = pytest.mark.slow

SCHEMA = "umt_ready_crash"
PAIR = TaskPair(name="t", version=1)
LEASE = timedelta(minutes=5)
SLOW_FLUSH = {"wal_writer_delay": "10s", "bgwriter_lru_maxpages": "0"}


def new_run() -> NewRun:
    return NewRun(
        run_id=uuid.uuid4(),
        task_name=PAIR.name,
        task_version=PAIR.version,
        input_json="null",
        input_hash="0" * 64,
    )


async def _open(url: str) -> PostgresBackend:
    return await PostgresBackend.open(
        url, schema=SCHEMA, run_migrations=False, listen=False, max_size=3
    )


async def _claim_until_empty(backend: PostgresBackend, worker: str) -> list[ClaimedRun]:
    claimed: list[ClaimedRun] = []
    empty = 0
    while empty < 3:  # the first claims after a start read the timers too; be sure
        got = await backend.claim(worker_id=worker, pairs=[PAIR], limit=7, lease=LEASE)
        claimed += got
        empty = 0 if got else empty + 1
    return claimed


async def _rotation_held_open(url: str) -> psycopg.AsyncConnection[Any]:
    """A connection inside a transaction whose rotation truncated a slot, not yet committed."""
    conn = await psycopg.AsyncConnection.connect(url)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        cur = await conn.execute(f"SELECT {SCHEMA}.rotate_ready(100000)")
        row = await cur.fetchone()
        if row and row[0] == "truncated":
            return conn
        await conn.rollback()
        await asyncio.sleep(0.1)
    await conn.close()
    raise AssertionError("no slot could be rotated in 15 s")


async def test_a_crash_amid_enqueue_claim_and_rotation_loses_no_run_and_reuses_no_token(
    private_pg: PrivatePostgres,
) -> None:
    private_pg.configure(SLOW_FLUSH)
    url = private_pg.url
    await migrate(url, schema=SCHEMA)
    backend = await _open(url)
    committed: list[uuid.UUID] = []
    try:
        for _ in range(40):  # over more than one 2 s slot
            run = new_run()
            await backend.enqueue(run)
            committed.append(run.run_id)
            await asyncio.sleep(0.1)
        before = await backend.claim(worker_id="A", pairs=[PAIR], limit=15, lease=LEASE)
        assert len(before) == 15
        rotation = await _rotation_held_open(url)
        enqueuing = await psycopg.AsyncConnection.connect(url)
        uncommitted = new_run()
        await backend.enqueue(uncommitted, conn=enqueuing)  # its transaction stays open
        private_pg.crash()
        for conn in (rotation, enqueuing):
            await conn.close()
    finally:
        await backend.close()

    private_pg.start()
    backend = await _open(url)
    try:
        after = await _claim_until_empty(backend, "B")
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute(f"SELECT id, status, fencing_token FROM {SCHEMA}.runs")
            stored = {r[0]: (r[1], r[2]) for r in await cur.fetchall()}
            cur = await conn.execute(f"SELECT count(*) FROM {SCHEMA}.ready")
            (left_in_ready,) = await cur.fetchone() or (None,)
    finally:
        await backend.close()

    claimed_after = [c.run_id for c in after]
    assert len(claimed_after) == len(set(claimed_after)), "a run was claimed twice"
    assert uncommitted.run_id not in stored, "an enqueue that never committed left a run"
    assert set(stored) == set(committed), "a committed run was lost"
    assert all(status == "running" for status, _ in stored.values()), (
        "a run was left where no claim finds it: "
        f"{[(k, s) for k, (s, _) in stored.items() if s != 'running']}"
    )
    survived = {c.run_id for c in before if stored[c.run_id][1] == c.fencing_token}
    assert set(claimed_after) | survived == set(committed)
    assert not set(claimed_after) & survived
    assert min(c.fencing_token for c in after) > max(c.fencing_token for c in before), (
        "a token handed out before the crash was handed out again"
    )
    assert left_in_ready == 0
