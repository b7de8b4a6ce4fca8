"""Transactional enqueue on Postgres: a run exists if and only if your transaction commits.

Run it: `python examples/06_transactional_enqueue.py` (uses `UMT_DATABASE_URL`, else the
embedded Postgres in `.umt/pg`; everything lives in a fresh schema, dropped at the end).

A shop inserts an order and enqueues its confirmation e-mail in the same transaction, through
`engine.enqueue(..., conn=conn)`. When the transaction commits, the order and the run both
exist and a worker sends the e-mail. When it rolls back (here: the card is declined after the
enqueue), neither exists: no e-mail for an order that never was, and no order without its e-mail.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg

from umt_backend_pg import database_url
from umt_sdk import Engine, Registry, RunNotFoundError, TaskContext, connect, task

URL = database_url()  # UMT_DATABASE_URL if set, else the embedded Postgres
SCHEMA = f"ex06_{uuid.uuid4().hex[:8]}"  # our own schema: engine tables and the orders table


async def db(*, autocommit: bool) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(
        URL, autocommit=autocommit, options=f"-c search_path={SCHEMA}"
    )


@task("send_confirmation", version=1)
async def send_confirmation(ctx: TaskContext[str]) -> str:
    return f"e-mail sent for order {ctx.input}"


class CardDeclined(Exception):
    pass


async def place_order(engine: Engine, order_id: str, *, card_ok: bool) -> uuid.UUID:
    """Insert the order and enqueue its e-mail in one transaction; return the run's id."""
    run_id = None
    try:
        async with await db(autocommit=False) as conn, conn.transaction():
            await conn.execute("INSERT INTO orders (id) VALUES (%s)", (order_id,))
            run = await engine.enqueue(send_confirmation, order_id, conn=conn)  # same transaction
            run_id = run.run_id
            if not card_ok:
                raise CardDeclined(order_id)  # an error leaving the block rolls it all back
        print(f"order {order_id}: committed, with run {run_id}")
    except CardDeclined:
        print(f"order {order_id}: card declined, rolled back (run {run_id} was enqueued in it)")
    assert run_id is not None
    return run_id


async def main() -> None:
    engine = await connect(URL, registry=Registry([send_confirmation]), schema=SCHEMA)
    try:
        async with await db(autocommit=True) as conn:
            await conn.execute("CREATE TABLE orders (id text PRIMARY KEY)")

        committed = await place_order(engine, "o-1", card_ok=True)
        rolled_back = await place_order(engine, "o-2", card_ok=False)

        print(f"run of o-1: {(await engine.get(committed)).status}")
        try:
            await engine.get(rolled_back)
            raise AssertionError("the rolled-back enqueue must leave no run")
        except RunNotFoundError:
            print("run of o-2: does not exist (RunNotFoundError)")
        runs = await engine.list(task_name="send_confirmation")
        assert [r.run_id for r in runs] == [committed]

        async with engine.worker():
            sent = await engine.result(committed, timeout=10)
        print(f"worker: {sent!r}")
        assert sent == "e-mail sent for order o-1"

        async with await db(autocommit=True) as conn:
            orders = [
                row[0] for row in await (await conn.execute("SELECT id FROM orders")).fetchall()
            ]
        print(f"orders table: {orders}")
        assert orders == ["o-1"]
    finally:
        await engine.close()
        async with await db(autocommit=True) as conn:  # clean up: drop the example's schema
            await conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")


if __name__ == "__main__":
    asyncio.run(main())
