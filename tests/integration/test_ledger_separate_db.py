"""with_attempt_token against business tables in a database other than the engine's."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any

import attrs
import psycopg
import pytest

from umt_backend_pg import install_ledger
from umt_sdk import (
    AttemptInfo,
    BackendError,
    Registry,
    RunFailedError,
    TaskContext,
    connect,
    task,
    with_attempt_token,
)
from umt_sdk.testing import freeze_heartbeats

BUSINESS_URL: dict[str, str] = {}
GATES: dict[int, asyncio.Event] = {}
ACTIONS: Counter[int] = Counter()
RESUMED: list[bool] = []


@attrs.frozen
class Order:
    key: str


@task("separate.pay", version=1)
async def pay(ctx: TaskContext[Order]) -> str:
    async def act(info: AttemptInfo) -> str:
        RESUMED.append(info.resumed)
        ACTIONS[ctx.attempt] += 1
        gate = GATES.get(ctx.attempt)
        if gate is not None:
            await gate.wait()
        return f"paid-{info.attempt_token}"

    async def record(tx: psycopg.AsyncConnection[Any], receipt: str) -> None:
        await tx.execute(
            "INSERT INTO payments (key, receipt) VALUES (%s, %s)", (ctx.input.key, receipt)
        )

    async def submit() -> str:
        async with await psycopg.AsyncConnection.connect(
            BUSINESS_URL["url"], autocommit=True
        ) as conn:
            return await with_attempt_token(conn, f"pay:{ctx.input.key}", act, commit=record)

    receipt: str = await ctx.step.run("submit", submit)
    return receipt


@pytest.fixture
async def business_db(second_db: str) -> str:
    BUSINESS_URL["url"] = second_db
    async with await psycopg.AsyncConnection.connect(second_db, autocommit=True) as conn:
        await conn.execute("CREATE TABLE payments (key text, receipt text)")  # no unique key
    return second_db


async def _payments(url: str) -> list[tuple[str, str]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute("SELECT key, receipt FROM payments ORDER BY key")
        return list(await cur.fetchall())


async def test_without_a_ledger_the_error_says_how_to_install_it(
    pg_url: str, pg_schema: str, business_db: str
) -> None:
    engine = await connect(pg_url, registry=Registry([pay]), schema=pg_schema)
    handle = await engine.enqueue(pay, Order("no-ledger"))
    async with engine.worker():
        with pytest.raises(RunFailedError) as caught:
            await handle.result(timeout=20)
    await engine.close()
    assert "install_ledger" in caught.value.error_message
    assert BackendError.__name__ in caught.value.error_message


async def test_separate_database_commits_once_and_refuses_the_stale_attempt(
    pg_url: str, pg_schema: str, business_db: str
) -> None:
    ACTIONS.clear()
    RESUMED.clear()
    GATES.clear()
    async with await psycopg.AsyncConnection.connect(business_db, autocommit=True) as conn:
        await install_ledger(conn, schema=pg_schema)
        await install_ledger(conn, schema=pg_schema)  # idempotent
    engine = await connect(pg_url, registry=Registry([pay]), schema=pg_schema)

    # A stale attempt blocked inside its action while another takes over.
    GATES[1] = asyncio.Event()
    handle = await engine.enqueue(pay, Order("o-1"))
    stale = engine.worker(lease=timedelta(seconds=1))
    await stale.start()
    for _ in range(500):
        if ACTIONS[1]:
            break
        await asyncio.sleep(0.01)
    freeze_heartbeats(stale)
    await asyncio.sleep(2.2)
    async with engine.worker(lease=timedelta(seconds=1)):
        receipt = await handle.result(timeout=20)
        GATES[1].set()
        for _ in range(500):
            if not stale.running_runs:
                break
            await asyncio.sleep(0.01)
    await stale.stop()
    executions = (await engine.get(handle.run_id)).executions
    assert [e.outcome for e in executions] == ["interrupted", "completed"]

    # The same op key again: the recorded result, no new action.
    again = await engine.enqueue(pay, Order("o-1"), idempotency_key="again")
    async with engine.worker():
        assert await again.result(timeout=20) == receipt
    await engine.close()

    rows = await _payments(business_db)
    assert rows == [("o-1", receipt)], f"business rows: {rows}"
    assert RESUMED == [False, True], RESUMED
    assert ACTIONS == {1: 1, 2: 1}, f"actions per attempt: {dict(ACTIONS)}"
    assert receipt == f"paid-{executions[-1].fencing_token}", "the takeover's receipt"


async def test_a_database_with_a_copy_of_the_engine_schema_is_not_the_engine_database(
    pg_url: str, pg_schema: str, business_db: str
) -> None:
    """The ledger and the outbox ask `shares_database_with` (an advisory lock the engine's pool
    must see), never whether a `<schema>.runs` table exists: a business database that holds
    another umt install under the same schema name is still another database, and the fence
    must read the engine's runs, not that copy's."""
    from umt_backend_pg import PostgresBackend, migrate

    await migrate(business_db, schema=pg_schema)  # the same schema name, runs table and all
    engine = await connect(pg_url, registry=Registry([pay]), schema=pg_schema)
    try:
        backend = engine.backend
        assert isinstance(backend, PostgresBackend)
        async with await psycopg.AsyncConnection.connect(business_db) as other:
            assert await backend.shares_database_with(other) is False
            await other.rollback()
            cur = await other.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
            assert await cur.fetchone() == (0,), "the probe's lock is released at once"
        async with (
            await psycopg.AsyncConnection.connect(pg_url) as same,
            same.transaction(),  # inside the caller's transaction too
        ):
            assert await backend.shares_database_with(same) is True
        # And the fenced payment against that business database still fences on the engine.
        ACTIONS.clear()
        GATES.clear()
        handle = await engine.enqueue(pay, Order("copy"))
        async with engine.worker():
            assert (await handle.result(timeout=20)).startswith("paid-")
        assert [k for k, _ in await _payments(business_db)] == ["copy"]
    finally:
        await engine.close()
