"""The task of the `umt runs settle` tests: a card charge whose gateway call times out once."""

from __future__ import annotations

from collections import Counter

import attrs

from umt_sdk import Registry, TaskContext, task

CALLS: Counter[str] = Counter()
"""How often the gateway was called, by order id."""


@attrs.frozen
class Receipt:
    ref: str
    cents: int


async def call_gateway(order_id: str, cents: int) -> Receipt:
    CALLS[order_id] += 1
    if CALLS[order_id] == 1:
        raise TimeoutError("the card gateway did not answer within 30 s")
    return Receipt(ref=f"gw-{order_id}", cents=cents)


@task("charge_card", version=1)
async def charge_card(ctx: TaskContext[str]) -> str:
    receipt = await ctx.step.run(
        "charge", call_gateway, ctx.input, 1250, uncertain_on=(TimeoutError,)
    )
    return f"{receipt.ref} {receipt.cents}"


registry = Registry([charge_card])
