"""Event triggers on Postgres: one published event starts every task subscribed to it, once.

Run it: `python examples/25_event_triggers.py` (uses `UMT_DATABASE_URL`, else the embedded
Postgres in `.umt/pg`; everything lives in a fresh schema, dropped at the end).

1. A shop inserts an order and publishes `order.placed` in the same transaction
   (`engine.publish(..., conn=conn)`): the receipt and the stock reservation both start, once
   each. The web request is retried and publishes the same event again (same `key`): nothing
   new starts. An order whose transaction rolls back publishes nothing.
2. A payload a subscriber's input type refuses fails the publish, and nothing is stored.
3. A loyalty-points task is deployed later, on a worker of its own: it gets the events of the
   last 24 hours (`connect(event_window=...)`) it has no run for, the order that committed
   among them, and still never runs twice for one event.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import attrs
import psycopg

from umt_backend_pg import database_url
from umt_sdk import Engine, PayloadError, Registry, TaskContext, connect, task

URL = database_url()  # UMT_DATABASE_URL if set, else the embedded Postgres
SCHEMA = f"ex25_{uuid.uuid4().hex[:8]}"  # our own schema: engine tables and the orders table


@attrs.frozen
class OrderPlaced:
    order_id: str
    total_cents: int


@task("send_receipt", version=1, on_event="order.placed")
async def send_receipt(ctx: TaskContext[OrderPlaced]) -> str:
    return f"receipt for {ctx.input.order_id}: {ctx.input.total_cents / 100:.2f} EUR"


@task("reserve_stock", version=1, on_event="order.placed")
async def reserve_stock(ctx: TaskContext[OrderPlaced]) -> str:
    return f"stock reserved for {ctx.input.order_id}"


@task("award_points", version=1, on_event="order.placed")  # deployed later (part 3)
async def award_points(ctx: TaskContext[OrderPlaced]) -> int:
    return ctx.input.total_cents // 100


async def db(*, autocommit: bool) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(
        URL, autocommit=autocommit, options=f"-c search_path={SCHEMA}"
    )


class CardDeclined(Exception):
    pass


async def place_order(engine: Engine, order: OrderPlaced, *, card_ok: bool = True) -> list[str]:
    """Insert the order and publish its event in one transaction; return the started tasks."""
    started: list[str] = []
    try:
        async with await db(autocommit=False) as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO orders (id) VALUES (%s) ON CONFLICT DO NOTHING", (order.order_id,)
            )
            published = await engine.publish(
                "order.placed", order, key=order.order_id, conn=conn
            )  # same transaction
            started = [run.task_name for run in published.runs]
            if not card_ok:
                raise CardDeclined(order.order_id)
    except CardDeclined:
        return []
    return started


async def main() -> None:
    shop = await connect(URL, registry=Registry([send_receipt, reserve_stock]), schema=SCHEMA)
    try:
        async with await db(autocommit=True) as conn:
            await conn.execute("CREATE TABLE orders (id text PRIMARY KEY)")

        # 1. One event, every subscriber once; a retried request; a rolled-back order.
        first = await place_order(shop, OrderPlaced("o-1", 4250))
        print(f"o-1 placed: started {sorted(first)}")
        assert sorted(first) == ["reserve_stock", "send_receipt"]
        retried = await place_order(shop, OrderPlaced("o-1", 4250))
        print(f"o-1 placed again (retried request): started {retried}")
        assert retried == []
        declined = await place_order(shop, OrderPlaced("o-2", 999), card_ok=False)
        assert declined == []
        for name in ("send_receipt", "reserve_stock"):
            assert len(list(await shop.list(task_name=name))) == 1, name
        print("o-2 declined: its transaction rolled back, no event and no run")

        async with shop.worker(concurrency=4):
            for run in await shop.list():
                print(f"  worker: {await shop.result(run.run_id, timeout=15)!r}")

        # 2. A payload a subscriber refuses: nothing is stored.
        try:
            await shop.publish("order.placed", {"order_id": "o-3"}, key="o-3")
            raise AssertionError("a payload without total_cents must be refused")
        except PayloadError as exc:
            print(f"refused: {str(exc).splitlines()[0]}")

        # 3. A task deployed later, on a worker of its own (its own registry).
        points = await connect(
            URL, registry=Registry([award_points]), schema=SCHEMA, run_migrations=False
        )
        try:
            async with points.worker():
                runs: list[Any] = []
                for _ in range(300):  # its first look at the window comes as it starts
                    if runs := list(await points.list(task_name="award_points")):
                        break
                    await asyncio.sleep(0.05)
                awarded = await points.result(runs[0].run_id, timeout=15)
            print(f"award_points, deployed later, got o-1 from the window: {awarded} points")
            assert awarded == 42
            assert len(list(await points.list(task_name="award_points"))) == 1  # o-1, once
        finally:
            await points.close()
    finally:
        await shop.close()
        async with await db(autocommit=True) as conn:  # clean up: drop the example's schema
            await conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")


if __name__ == "__main__":
    asyncio.run(main())
