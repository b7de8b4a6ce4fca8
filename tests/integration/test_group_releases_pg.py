"""A map's `max_concurrency` never strands its held children on Postgres.

The write that ends a member of a map lets the next held member run, skipping held members
another write has locked (waiting for them could deadlock). When every held member is locked
by a write that then does not end it (a cancel rolled back, a dropped connection, any other
write), that release must not be lost: the group row keeps it owed, and the next write that
ends a member, or a worker's pass about once a second, pays it
(migrations/0015_group_releases.sql). Each test holds the held member's row from a second
connection while its running sibling ends, then rolls that connection back (or has the server
end its session).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from tests.integration.test_query_plans import generic
from umt_backend_pg import PostgresBackend
from umt_backend_pg._sql import queries, render
from umt_sdk import (
    Engine,
    Registry,
    RetryPolicy,
    RunFailedError,
    RunInfo,
    TaskContext,
    connect,
    task,
)

GATES: dict[str, asyncio.Event] = {}


@attrs.frozen
class Leaf:
    key: str
    n: int


@attrs.frozen
class Fan:
    key: str
    count: int
    limit: int


@task("releases.leaf", version=1, retry=RetryPolicy(max_attempts=1))
async def leaf(ctx: TaskContext[Leaf]) -> int:
    await asyncio.wait_for(GATES[ctx.input.key].wait(), 60)
    return ctx.input.n * ctx.input.n


@task("releases.fan", version=1, retry=RetryPolicy(max_attempts=1))
async def fan(ctx: TaskContext[Fan]) -> list[int]:
    inputs = [Leaf(key=ctx.input.key, n=n) for n in range(ctx.input.count)]
    return await ctx.step.map("fan", leaf, inputs, max_concurrency=ctx.input.limit)


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    connected = await connect(
        pg_url, registry=Registry([leaf, fan]), schema=pg_schema, run_migrations=False
    )
    try:
        yield connected
    finally:
        await connected.close()


@pytest.fixture
async def locker(pg_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    conn = await psycopg.AsyncConnection.connect(pg_url, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()  # also when a test had the server end its session


async def _children(engine: Engine, parent: uuid.UUID) -> list[RunInfo]:
    runs = (await engine.list(parent=parent, limit=100)).runs
    return sorted(runs, key=lambda r: r.input["n"])


async def _until(engine: Engine, parent: uuid.UUID, wanted: list[str], what: str) -> None:
    """The children's statuses (held ones read `held`), in input order, become `wanted`."""
    seen: list[str] = []
    for _ in range(600):
        seen = [
            "held" if c.waiting_for == "umt turn" else c.status
            for c in await _children(engine, parent)
        ]
        if seen == wanted:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: the children were {seen}, never {wanted}")


async def _hold_rows(conn: psycopg.AsyncConnection[Any], schema: str, ids: list[Any]) -> None:
    """A write that locks waiting runs and will not end them (it rolls back)."""
    await conn.execute("BEGIN")
    await conn.execute(
        sql.SQL("SELECT 1 FROM {}.runs WHERE id = ANY(%s) FOR NO KEY UPDATE").format(
            sql.Identifier(schema)
        ),
        (ids,),
    )


async def _owed(pg_url: str, schema: str) -> list[int]:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        cur = await conn.execute(
            sql.SQL("SELECT owed FROM {}.child_groups").format(sql.Identifier(schema))
        )
        return [row[0] for row in await cur.fetchall()]


@pytest.mark.parametrize("ends", ["rolled back", "connection killed"])
async def test_a_release_lost_to_a_lock_is_paid_by_the_workers(
    engine: Engine,
    locker: psycopg.AsyncConnection[Any],
    pg_url: str,
    pg_schema: str,
    ends: str,
) -> None:
    key = f"lost-{ends}"
    GATES[key] = asyncio.Event()
    handle = await engine.enqueue(fan, Fan(key=key, count=2, limit=1))
    async with engine.worker(concurrency=4):
        await _until(engine, handle.run_id, ["running", "held"], "the map started")
        _, held = await _children(engine, handle.run_id)
        await _hold_rows(locker, pg_schema, [held.run_id])
        GATES[key].set()
        # The sibling's ending did not wait for the held row: it is stored while it is locked.
        await _until(engine, handle.run_id, ["completed", "held"], "the sibling's ending")
        assert await _owed(pg_url, pg_schema) == [1], "the release is owed on the group row"
        if ends == "rolled back":
            await locker.execute("ROLLBACK")
        else:  # the server ends the locker's session: its transaction is rolled back
            async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
                await admin.execute("SELECT pg_terminate_backend(%s)", (locker.info.backend_pid,))
        assert await handle.result(timeout=30) == [0, 1]
    assert await _owed(pg_url, pg_schema) == [0]
    assert (await engine.get(handle.run_id)).attempts == 2, "the parent was woken once"


async def test_a_release_owed_is_paid_by_the_next_ending_first(
    engine: Engine,
    locker: psycopg.AsyncConnection[Any],
    pg_url: str,
    pg_schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the workers' pass off, the next write that ends a member (here the cancel of a
    held one, which frees no slot of its own) pays what the group owes."""
    backend = engine.backend
    assert isinstance(backend, PostgresBackend)
    monkeypatch.setattr(backend._clocks, "releases_due", lambda: False)
    key = "next-ending"
    GATES[key] = asyncio.Event()
    handle = await engine.enqueue(fan, Fan(key=key, count=4, limit=1))
    async with engine.worker(concurrency=4):
        await _until(engine, handle.run_id, ["running", "held", "held", "held"], "the start")
        _, *held = await _children(engine, handle.run_id)
        await _hold_rows(locker, pg_schema, [h.run_id for h in held])
        GATES[key].set()
        await _until(engine, handle.run_id, ["completed", "held", "held", "held"], "the end")
        assert await _owed(pg_url, pg_schema) == [1]
        await locker.execute("ROLLBACK")
        assert await engine.cancel(held[2].run_id, reason="skip") == "canceled"
        with pytest.raises(RunFailedError):  # the map raised ChildrenFailedError: one canceled
            await handle.result(timeout=30)
        await _until(
            engine,
            handle.run_id,
            ["completed", "completed", "completed", "canceled"],
            "the owed release paid by the cancel",
        )
    assert await _owed(pg_url, pg_schema) == [0]


async def test_a_release_is_never_paid_twice(
    engine: Engine, locker: psycopg.AsyncConnection[Any], pg_url: str, pg_schema: str
) -> None:
    """Owed releases paid, the map still runs at most `max_concurrency` children at once."""
    key = "never-twice"
    GATES[key] = asyncio.Event()
    handle = await engine.enqueue(fan, Fan(key=key, count=5, limit=2))
    async with engine.worker(concurrency=8):
        await _until(
            engine, handle.run_id, ["running", "running", "held", "held", "held"], "the start"
        )
        children = await _children(engine, handle.run_id)
        await _hold_rows(locker, pg_schema, [c.run_id for c in children[2:]])
        GATES[key].set()
        await _until(
            engine,
            handle.run_id,
            ["completed", "completed", "held", "held", "held"],
            "both endings stored",
        )
        assert await _owed(pg_url, pg_schema) == [2]
        GATES[key].clear()  # the children let run now wait: count how many run at once
        await locker.execute("ROLLBACK")
        await _until(
            engine,
            handle.run_id,
            ["completed", "completed", "running", "running", "held"],
            "two paid, the third held",
        )
        GATES[key].set()
        assert await handle.result(timeout=30) == [0, 1, 4, 9, 16]
    assert await _owed(pg_url, pg_schema) == [0]


def _indexes_on(plan: Any, relation: str, found: set[str]) -> set[str]:
    if isinstance(plan, dict):
        if plan.get("Relation Name") == relation and plan["Node Type"] != "ModifyTable":
            found.add(plan.get("Index Name") or plan["Node Type"])
        for value in plan.values():
            _indexes_on(value, relation, found)
    elif isinstance(plan, list):
        for value in plan:
            _indexes_on(value, relation, found)
    return found


def test_the_workers_pass_reads_only_the_groups_that_owe(pg_url: str, pg_schema: str) -> None:
    """Every worker runs pay_group_releases about once a second: with 10,000 groups stored
    and none owing, it reads the partial index of the groups that owe (empty), never the
    groups themselves (no scan of child_groups)."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {s}.child_groups (parent_run_id, name, total, remaining, "
                "max_concurrency) SELECT gen_random_uuid(), 'umt.group fan', 10, g % 10, 2 "
                "FROM generate_series(1, 10000) AS g"
            ).format(s=sql.Identifier(pg_schema))
        )
        conn.execute(sql.SQL("ANALYZE {}.child_groups").format(sql.Identifier(pg_schema)))
        text = generic(render(queries()["pay_group_releases"], pg_schema))
        row = conn.execute("EXPLAIN (GENERIC_PLAN, FORMAT JSON) " + text).fetchone()
    assert row is not None
    plan = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    # The groups that owe come from the partial index; each one found is then updated
    # through the primary key.
    assert _indexes_on(plan, "child_groups", set()) == {"child_groups_owing", "child_groups_pkey"}
