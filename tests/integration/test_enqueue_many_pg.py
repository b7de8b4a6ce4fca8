"""`enqueue_many` on Postgres: in the caller's transaction the
runs exist if and only if it commits; a batch and single enqueues of the same keys from other
connections, at once, end with one run per key."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import attrs
import psycopg
import pytest

from umt_sdk import Engine, Registry, TaskContext, connect, task


@attrs.frozen
class Item:
    key: str


@task("many.noop")
async def noop(ctx: TaskContext[Item]) -> str:
    return ctx.input.key


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    opened = await connect(
        pg_url, registry=Registry([noop]), schema=pg_schema, run_migrations=False
    )
    yield opened
    await opened.close()


async def test_in_the_callers_transaction_runs_exist_only_if_it_commits(
    pg_url: str, engine: Engine
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url) as conn:
        async with conn.transaction(force_rollback=True):
            gone = await engine.enqueue_many(noop, [Item("a"), Item("b")], conn=conn)
        async with conn.transaction():
            kept = await engine.enqueue_many(
                noop, [Item("c"), Item("d")], conn=conn, idempotency_keys=["c", None]
            )
    assert [h.created for h in gone + kept] == [True] * 4
    stored = {r.run_id for r in await engine.list(task_name="many.noop")}
    assert stored == {h.run_id for h in kept}
    async with engine.worker(concurrency=2):
        assert [await h.result(timeout=15) for h in kept] == ["c", "d"]


async def test_a_large_batch_is_stored_whole(engine: Engine) -> None:
    handles = await engine.enqueue_many(noop, [Item(str(i)) for i in range(500)])
    assert len({h.run_id for h in handles}) == 500
    page = await engine.list(task_name="many.noop", limit=1000)
    assert {r.run_id for r in page} == {h.run_id for h in handles}


async def test_racing_batches_and_singles_store_one_run_per_key(
    pg_url: str, pg_schema: str
) -> None:
    engines = [
        await connect(pg_url, registry=Registry([noop]), schema=pg_schema, run_migrations=False)
        for _ in range(3)
    ]
    try:
        keys = [f"k{i}" for i in range(200)]
        items = [Item(k) for k in keys]
        batch_a, batch_b, singles = await asyncio.gather(
            engines[0].enqueue_many(noop, items, idempotency_keys=keys),
            engines[1].enqueue_many(noop, items[::-1], idempotency_keys=keys[::-1]),
            asyncio.gather(
                *(
                    engines[2].enqueue(noop, i, idempotency_key=k)
                    for i, k in zip(items, keys, strict=True)
                )
            ),
        )
        by_key = [
            {h.run_id for h in (a, b, s)}
            for a, b, s in zip(batch_a, batch_b[::-1], singles, strict=True)
        ]
        assert all(len(ids) == 1 for ids in by_key), "every call names the key's one run"
        created = sum(h.created for h in (*batch_a, *batch_b, *singles))
        assert created == 200
        assert len(await engines[0].list(task_name="many.noop", limit=1000)) == 200
    finally:
        for opened in engines:
            await opened.close()
