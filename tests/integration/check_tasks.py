"""`check.order@1` as the release in production recorded it, and as the releases a deploy
check is asked about would have it (`umt check --registry
tests.integration.check_tasks:<name>`). The candidate releases' step bodies record that they
ran in `RAN`: a check must never call one."""

from __future__ import annotations

from typing import Any

import attrs

from umt_sdk import Registry, TaskContext, task

RAN: list[str] = []


@attrs.frozen
class Quote:
    amount: int
    currency: str


@attrs.frozen
class TextQuote:
    """The candidate `drifted`'s quote: the amount became text."""

    amount: str
    currency: str


async def quote(order_id: str) -> Quote:
    return Quote(amount=42, currency="EUR")


async def ship(order_id: str) -> str:
    return f"shipped {order_id}"


def never(name: str) -> Any:
    async def body(*_: Any) -> Any:
        RAN.append(name)
        raise AssertionError(f"step body {name!r} ran during a check")

    return body


@task("check.order", version=1)
async def recorded(ctx: TaskContext[str]) -> str:
    """Production's code: quote, wait for the payment, ship."""
    await ctx.step.run("quote", quote, ctx.input)
    await ctx.step.wait_for_fact("paid")
    return await ctx.step.run("ship", ship, ctx.input)


@task("check.order", version=1)
async def patched(ctx: TaskContext[str]) -> str:
    """A fraud check for the runs not yet past it: compatible."""
    await ctx.step.run("quote", never("quote"), ctx.input, output_type=Quote)
    if await ctx.patched("fraud"):
        await ctx.step.run("fraud", never("fraud"), ctx.input, output_type=float)
    await ctx.step.wait_for_fact("paid")
    return await ctx.step.run("ship", never("ship"), ctx.input, output_type=str)


@task("check.order", version=1)
async def renamed(ctx: TaskContext[str]) -> str:
    await ctx.step.run("price", never("price"), ctx.input, output_type=Quote)
    await ctx.step.wait_for_fact("paid")
    return await ctx.step.run("ship", never("ship"), ctx.input, output_type=str)


@task("check.order", version=1)
async def drifted(ctx: TaskContext[str]) -> str:
    await ctx.step.run("quote", never("quote"), ctx.input, output_type=TextQuote)
    await ctx.step.wait_for_fact("paid")
    return await ctx.step.run("ship", never("ship"), ctx.input, output_type=str)


@task("check.order", version=2)
async def only_v2(ctx: TaskContext[str]) -> str:
    return await ctx.step.run("ship", never("ship"), ctx.input, output_type=str)


recorded_registry = Registry([recorded])
patched_registry = Registry([patched])
renamed_registry = Registry([renamed])
drifted_registry = Registry([drifted])
dropped_registry = Registry([only_v2])
