"""Transactional steps on Postgres, beyond the contract suite: the body's connection is inside
a READ COMMITTED transaction on the engine's database, and a deadlock between two steps' bodies
runs the loser's transaction again at once instead of failing its step."""

from __future__ import annotations

import asyncio
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
