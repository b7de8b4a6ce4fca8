"""Subscribers for the `umt events` tests: two tasks on `shop.order.placed`."""

from __future__ import annotations

import attrs

from umt_sdk import Registry, TaskContext, task


@attrs.frozen
class Placed:
    order_id: str
    amount: int = 0


@task("shop.mail", version=1, on_event="shop.order.placed")
async def mail(ctx: TaskContext[Placed]) -> str:
    return f"mailed {ctx.input.order_id}"


@task("shop.stock", version=1, on_event="shop.order.placed")
async def stock(ctx: TaskContext[Placed]) -> int:
    return ctx.input.amount


registry = Registry([mail, stock])
