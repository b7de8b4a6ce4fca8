"""A tiny task module for the CLI tests: `umt worker tests.integration.cli.app_tasks:registry`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import attrs

from umt_sdk import Concurrency, Registry, RetryPolicy, SyncTaskContext, TaskContext, task


@attrs.frozen
class Greeting:
    name: str
    times: int = 1


@attrs.frozen
class Nap:
    seconds: float
    marker: str
    """A file that gets one line each time the `doze` step starts (so tests can see it)."""


@attrs.frozen
class Order:
    order_id: str


def _compose(greeting: str, name: str, times: int) -> str:
    return " ".join([f"{greeting}, {name}!"] * times)


@task("greet", version=1)
async def greet(ctx: TaskContext[Greeting]) -> str:
    return await ctx.step.run("compose", _compose, "Hello", ctx.input.name, ctx.input.times)


@task("greet", version=2)
async def greet_v2(ctx: TaskContext[Greeting]) -> str:
    return await ctx.step.run("compose", _compose, "Hi", ctx.input.name, ctx.input.times)


def _mark(marker: str) -> None:
    with Path(marker).open("a", encoding="utf-8") as file:
        file.write("doze\n")


async def _doze(seconds: float, marker: str) -> float:
    await asyncio.to_thread(_mark, marker)
    await asyncio.sleep(seconds)
    return seconds


async def _wake() -> str:
    return "awake"


@task("nap", version=1, retry=RetryPolicy.none())
async def nap(ctx: TaskContext[Nap]) -> str:
    await ctx.step.run("doze", _doze, ctx.input.seconds, ctx.input.marker)
    return await ctx.step.run("wake", _wake)


@task("approval", version=1)
async def approval(ctx: TaskContext[Order]) -> dict[str, str]:
    approved: dict[str, str] = await ctx.step.wait_for_fact("approved")
    return {"order_id": ctx.input.order_id, **approved}


def _explode() -> None:
    raise ValueError("kaboom")


@task("boom", version=1, retry=RetryPolicy.none())
async def boom(ctx: TaskContext[Order]) -> None:
    await ctx.step.run("explode", _explode)


@attrs.frozen
class Count:
    n: int


def _double(n: int) -> int:
    return 2 * n


@task("plain_nested", version=1)
def plain_nested(ctx: SyncTaskContext[Count]) -> int:
    """The shape docs/writing-tasks.md shows: a plain handler calling a plain step."""
    doubled: int = ctx.step.run("double", _double, ctx.input.n)
    return doubled + 1


@task("sync_tenant", version=1)
async def sync_tenant(ctx: TaskContext[Count]) -> int:
    if ctx.input.n > 1:  # a tenant of many shards starts one child per shard
        for shard in range(ctx.input.n):
            await ctx.step.start_child(f"shard-{shard}", sync_tenant, Count(n=1))
    return ctx.input.n


@task("sync_all", version=1)
async def sync_all(ctx: TaskContext[Count]) -> list[int]:
    """A parent of `n` children, the last of which has two of its own."""
    handles = [
        await ctx.step.start_child(
            f"tenant-{i}", sync_tenant, Count(n=2 if i == ctx.input.n - 1 else 1)
        )
        for i in range(ctx.input.n)
    ]
    return [await handle.result() for handle in handles]


@task("order_report", version=1, concurrency=Concurrency(key=lambda o: o.order_id, limit=1))
async def order_report(ctx: TaskContext[Order]) -> str:
    """One report of an order at a time (its concurrency key is the order)."""
    return ctx.input.order_id


FIXED_ORDERS: set[str] = set()
"""Orders whose `charge` works: the CLI tests "fix the bug" by adding to it, then fork."""
PREPARED: list[str] = []
"""Every `prepare` that really ran (a fork replays it from its record instead)."""


def _prepare(order_id: str) -> str:
    PREPARED.append(order_id)
    return f"prepared {order_id}"


def _charge(order_id: str) -> str:
    if order_id not in FIXED_ORDERS:
        raise RuntimeError(f"the card service rejects {order_id}")
    return f"charged {order_id}"


@task("checkout", version=1, retry=RetryPolicy.none())
async def checkout(ctx: TaskContext[Order]) -> str:
    prepared = await ctx.step.run("prepare", _prepare, ctx.input.order_id)
    charged = await ctx.step.run("charge", _charge, ctx.input.order_id)
    return f"{prepared}, {charged}"


registry = Registry(
    [
        greet,
        greet_v2,
        nap,
        approval,
        boom,
        plain_nested,
        sync_tenant,
        sync_all,
        order_report,
        checkout,
    ]
)
not_a_registry = [greet]
