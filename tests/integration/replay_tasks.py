"""One task, `replay.order@1`, as it was recorded and as four changes of today's code would
have it (`umt replay --registry tests.integration.replay_tasks:<name>`). The changed versions'
step bodies record that they ran in `RAN`: a replay must never call one."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from umt_sdk import Registry, TaskContext, task

RAN: list[str] = []


async def fetch(order_id: str) -> dict[str, Any]:
    return {"order_id": order_id, "amount": 42}


async def charge(amount: int) -> str:
    return f"charged {amount}"


def never(name: str) -> Any:
    async def body(*_: Any) -> Any:
        RAN.append(name)
        raise AssertionError(f"step body {name!r} ran during a replay")

    return body


@task("replay.order", version=1)
async def recorded(ctx: TaskContext[str]) -> str:
    order = await ctx.step.run("fetch", fetch, ctx.input)
    receipt: str = await ctx.step.run("charge", charge, order["amount"])
    shipped: dict[str, str] = await ctx.step.wait_for_fact("shipped")
    return f"{receipt}, shipped by {shipped['by']}"


@task("replay.order", version=1)
async def reordered(ctx: TaskContext[str]) -> str:
    receipt: str = await ctx.step.run("charge", never("charge"), 42)
    await ctx.step.run("fetch", never("fetch"), ctx.input)
    shipped: dict[str, str] = await ctx.step.wait_for_fact("shipped")
    return f"{receipt}, shipped by {shipped['by']}"


@task("replay.order", version=1)
async def renamed(ctx: TaskContext[str]) -> str:
    order = await ctx.step.run("fetch", never("fetch"), ctx.input)
    receipt: str = await ctx.step.run("charge_card", never("charge_card"), order["amount"])
    shipped: dict[str, str] = await ctx.step.wait_for_fact("shipped")
    return f"{receipt}, shipped by {shipped['by']}"


@task("replay.order", version=1)
async def run_to_sleep(ctx: TaskContext[str]) -> str:
    await ctx.step.run("fetch", never("fetch"), ctx.input)
    await ctx.step.sleep("charge", timedelta(seconds=1))
    shipped: dict[str, str] = await ctx.step.wait_for_fact("shipped")
    return f"shipped by {shipped['by']}"


@task("replay.order", version=1)
async def appended(ctx: TaskContext[str]) -> str:
    order = await ctx.step.run("fetch", never("fetch"), ctx.input)
    receipt: str = await ctx.step.run("charge", never("charge"), order["amount"])
    shipped: dict[str, str] = await ctx.step.wait_for_fact("shipped")
    await ctx.step.run("notify", never("notify"), shipped["by"])
    return f"{receipt}, shipped by {shipped['by']}"


recorded_registry = Registry([recorded])
reordered_registry = Registry([reordered])
renamed_registry = Registry([renamed])
run_to_sleep_registry = Registry([run_to_sleep])
appended_registry = Registry([appended])
