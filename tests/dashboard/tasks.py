"""Tasks the dashboard tests run: a shipment with steps, a task that fails with a hostile
message, one that waits for a fact (a form's input type has fields of several kinds)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import attrs

from umt_sdk import Concurrency, Registry, TaskContext, TaskDefinition, task


@attrs.frozen
class Order:
    customer: str
    quantity: int
    express: bool = False
    weight: float = 1.0
    carrier: Literal["post", "courier"] = "post"
    tags: list[str] = attrs.field(factory=list)


@task("dash.ship", version=1)
async def ship(ctx: TaskContext[Order]) -> str:
    async def label() -> str:
        return f"{ctx.input.customer} x{ctx.input.quantity}"

    async def post(text: str) -> str:
        return f"posted {text}"

    text: str = await ctx.step.run("label", label)
    done: str = await ctx.step.run("post", post, text)
    return done


@attrs.frozen
class Trouble:
    message: str


@task("dash.fail", version=1)
async def fail(ctx: TaskContext[Trouble]) -> None:
    async def explode() -> None:
        raise ValueError(ctx.input.message)

    await ctx.step.run("explode", explode)


@attrs.frozen
class Approval:
    item: str


@task("dash.approve", version=1)
async def approve(ctx: TaskContext[Approval]) -> Any:
    return await ctx.step.wait_for_fact("approval")


@attrs.frozen
class Report:
    tenant: str


@task("dash.report", version=1, concurrency=Concurrency(key=lambda r: r.tenant, limit=1))
async def report(ctx: TaskContext[Report]) -> str:
    return ctx.input.tenant


MINTED: dict[str, str] = {}
"""The callback tokens `dash.pay` minted, by its input (the test reads them here)."""


@task("dash.pay", version=1)
async def pay(ctx: TaskContext[str]) -> Any:
    """Mints a callback token (shown to the test in MINTED) and waits for its completion."""
    token = await ctx.step.callback_token("payment", timeout=timedelta(hours=1))
    MINTED[ctx.input] = token
    return await ctx.step.wait_for_callback(token)


@task("dash.on_placed", version=1, on_event="dash.order.placed")
async def on_placed(ctx: TaskContext[Approval]) -> str:
    return ctx.input.item


TASKS: list[TaskDefinition[Any, Any]] = [ship, fail, approve, report, pay, on_placed]


def registry() -> Registry:
    return Registry(TASKS)


TASKS_REGISTRY = registry()
"""For `umt dashboard --registry tests.dashboard.tasks:TASKS_REGISTRY`."""
