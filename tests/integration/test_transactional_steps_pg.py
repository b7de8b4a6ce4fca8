"""Transactional steps on Postgres, beyond the contract suite: the body's connection is inside
a READ COMMITTED transaction on the engine's database, and a deadlock between two steps' bodies
runs the loser's transaction again at once instead of failing its step, and a commit slower
than the lease costs no run of the worker its lease."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql

from umt_sdk import Registry, TaskContext, connect, task

SCHEMA: list[str] = []
LOCKED: dict[str, asyncio.Event] = {}
BODIES: list[str] = []
SEEN: list[tuple[str, str, str]] = []


def _table() -> sql.Composed:
    return sql.SQL("{}.accounts").format(sql.Identifier(SCHEMA[0]))


@task("tx.transfer", version=1)
async def transfer(ctx: TaskContext[list[str]]) -> int:
    """Adds one to both accounts, the first named first: two runs naming them in opposite
    orders deadlock on their first try (each waits, holding its first row, for the other's)."""
    first, second = ctx.input

    async def move(tx: psycopg.AsyncConnection[Any]) -> int:
        BODIES.append(first)
        cur = await tx.execute("SHOW transaction_isolation")
        row = await cur.fetchone()
        assert row is not None
        SEEN.append((first, row[0], str(tx.info.transaction_status.name)))
        update = sql.SQL("UPDATE {} SET balance = balance + 1 WHERE id = %s").format(_table())
        await tx.execute(update, (first,))
        if BODIES.count(first) == 1:  # the first try: hold the row until the other holds its
            LOCKED[first].set()
            await LOCKED[second].wait()
        await tx.execute(update, (second,))
        return BODIES.count(first)

    tries: int = await ctx.step.transaction("move", move)
    return tries


async def test_a_deadlock_runs_the_losing_transaction_again(pg_url: str, pg_schema: str) -> None:
    SCHEMA[:] = [pg_schema]
    LOCKED.update(a=asyncio.Event(), b=asyncio.Event())
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(
            sql.SQL("CREATE TABLE {} (id text PRIMARY KEY, balance integer NOT NULL)").format(
                _table()
            )
        )
        await conn.execute(sql.SQL("INSERT INTO {} VALUES ('a', 0), ('b', 0)").format(_table()))
    engine = await connect(
        pg_url, registry=Registry([transfer]), schema=pg_schema, run_migrations=False
    )
    async with engine:
        ab = await engine.enqueue(transfer, ["a", "b"])
        ba = await engine.enqueue(transfer, ["b", "a"])
        async with engine.worker(concurrency=2):
            tries = sorted([await ab.result(timeout=30), await ba.result(timeout=30)])
        assert tries == [1, 2], "one transaction lost the deadlock and ran again, once"
        for handle in (ab, ba):
            info = await engine.get(handle.run_id)
            assert [(s.name, s.attempt, s.status) for s in info.timeline] == [
                ("move", 1, "completed")
            ], "a conflict is not a failed attempt of the step"
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        cur = await conn.execute(sql.SQL("SELECT id, balance FROM {} ORDER BY id").format(_table()))
        assert await cur.fetchall() == [("a", 2), ("b", 2)], "each transfer landed once"
    assert {(isolation, status) for _, isolation, status in SEEN} == {("read committed", "INTRANS")}


HELD_COMMIT = 72001
OTHER_GO: list[asyncio.Event] = []


@task("tx.held_commit", version=1)
async def held_commit(ctx: TaskContext[None]) -> int:
    """A transactional step whose commit waits (a deferred trigger) for a lock the test holds,
    as a commit waits for deferred constraints or a synchronous standby."""

    async def post(tx: psycopg.AsyncConnection[Any]) -> int:
        await tx.execute(sql.SQL("INSERT INTO {}.posted VALUES (1)").format(_schema()))
        return 1

    posted: int = await ctx.step.transaction("post", post)
    return posted


@task("tx.neighbour", version=1)
async def neighbour(ctx: TaskContext[None]) -> str:
    async def work() -> str:
        await OTHER_GO[0].wait()
        return "done"

    done: str = await ctx.step.run("work", work)
    return done


def _schema() -> sql.Identifier:
    return sql.Identifier(SCHEMA[0])


async def test_a_commit_slower_than_the_lease_costs_no_run_of_the_worker_its_lease(
    pg_url: str, pg_schema: str
) -> None:
    """The heartbeat once waited for the run row the committing step holds locked, timed out,
    and every execution of the worker stopped (the neighbour too, again and again, until it
    failed with `LeaseLostTooOftenError`)."""
    SCHEMA[:] = [pg_schema]
    OTHER_GO[:] = [asyncio.Event()]
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(
            sql.SQL(
                "CREATE TABLE {s}.posted (n integer);"
                " CREATE FUNCTION {s}.held() RETURNS trigger LANGUAGE plpgsql AS"
                " $$ BEGIN PERFORM pg_advisory_xact_lock_shared({key}); RETURN NULL; END $$;"
                " CREATE CONSTRAINT TRIGGER held AFTER INSERT ON {s}.posted"
                " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {s}.held()"
            ).format(s=_schema(), key=sql.Literal(HELD_COMMIT))
        )
    holder = await psycopg.AsyncConnection.connect(pg_url, autocommit=True)
    await holder.execute("SELECT pg_advisory_lock(%s)", (HELD_COMMIT,))
    engine = await connect(
        pg_url, registry=Registry([held_commit, neighbour]), schema=pg_schema, run_migrations=False
    )
    try:
        async with engine.worker(concurrency=4, lease=timedelta(seconds=1)):
            other = await engine.enqueue(neighbour, None)
            slow = await engine.enqueue(held_commit, None)
            for _ in range(1500):
                cur = await holder.execute(
                    "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                    " AND classid = 0 AND objid = %s",
                    (HELD_COMMIT,),
                )
                if await cur.fetchone():
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the commit never waited for the test's lock")
            await asyncio.sleep(3)  # three leases with the commit in flight
            await holder.execute("SELECT pg_advisory_unlock(%s)", (HELD_COMMIT,))
            OTHER_GO[0].set()
            assert await engine.result(slow.run_id, timeout=30) == 1
            assert await engine.result(other.run_id, timeout=30) == "done"
        for handle in (other, slow):
            info = await engine.get(handle.run_id)
            assert info.lease_expirations == 0, info.task_name
            assert [e.outcome for e in info.executions] == ["completed"], info.task_name
    finally:
        await holder.close()
        await engine.close()
