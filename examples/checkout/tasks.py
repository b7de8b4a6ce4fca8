"""The checkout service's tasks, as the release about to ship has them: an example project
whose CI runs `umt check` against the histories of the runs in flight (see README.md).

The release before this one had no fraud check; this one adds it for new runs with
`ctx.patched("fraud-check")`, so the runs already past that point keep the old code.
"""

from __future__ import annotations

from datetime import timedelta

import attrs

from umt_sdk import Registry, TaskContext, task


@attrs.frozen
class Order:
    order_id: str
    amount_cents: int


@attrs.frozen
class Quote:
    amount_cents: int
    currency: str


async def price(order: Order) -> Quote:
    return Quote(amount_cents=order.amount_cents, currency="EUR")


async def score_fraud(order: Order) -> float:
    return 0.1 if order.amount_cents < 100_000 else 0.9


async def ship(order_id: str) -> str:
    return f"shipped {order_id}"


@task("checkout", version=1)
async def checkout(ctx: TaskContext[Order]) -> str:
    quote = await ctx.step.run("quote", price, ctx.input)
    if await ctx.patched("fraud-check"):  # new in this release, for runs not yet past here
        risk = await ctx.step.run("fraud-check", score_fraud, ctx.input)
        if risk > 0.5:
            return f"held {ctx.input.order_id} for review"
    await ctx.step.wait_for_fact("paid", timeout=timedelta(days=2))
    label = await ctx.step.run("ship", ship, ctx.input.order_id)
    return f"{label} ({quote.amount_cents} {quote.currency})"


registry = Registry([checkout])
