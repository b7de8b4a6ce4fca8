"""Tasks the outbox tests route events to (the runs are counted, never executed)."""

from __future__ import annotations

import attrs

from umt_sdk import Registry, TaskContext, task


@attrs.frozen
class Item:
    n: int


@attrs.frozen
class Order:
    order_id: str
    quantity: int


@task("process_item", version=1)
async def process_item(ctx: TaskContext[Item]) -> int:
    return ctx.input.n


@task("ship_order", version=1)
async def ship_order(ctx: TaskContext[Order]) -> str:
    return ctx.input.order_id


registry = Registry([process_item, ship_order])
