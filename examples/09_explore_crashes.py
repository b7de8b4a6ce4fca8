"""Prove a workflow crash-safe: crash it at every point it passes, and see which ones hurt.

Run it: `python examples/09_explore_crashes.py`, or as tests:
`pytest examples/09_explore_crashes.py` (pytest-asyncio in auto mode).

`charge_order` charges a card. Written naively, the charge is a plain step: a crash after the
card was charged but before the step's record was stored makes the next worker charge it again.
`explore_crashes` finds that point, names it, and prints the line that reproduces it. Written
with `with_attempt_token` (the charge fenced by the run's lease, its receipt committed once, and
looked up instead of redone when an earlier attempt may have charged), every crash point
passes, in a fraction of a second for the whole task.
"""

from __future__ import annotations

import asyncio
from typing import Any

from attrs import define, frozen

from umt_backend_memory import MemoryStore
from umt_sdk import AttemptInfo, TaskContext, task, with_attempt_token
from umt_sdk.testing import explore_crashes


@frozen
class Order:
    id: str
    cents: int


@define
class CardNetwork:
    """The outside world: the charges the card network saw, and our receipts table."""

    charges: list[tuple[str, int]]
    receipts: MemoryStore

    def __eq__(self, other: object) -> bool:  # the explorer compares states by value
        return (
            isinstance(other, CardNetwork)
            and self.charges == other.charges
            and self.receipts.rows("receipts") == other.receipts.rows("receipts")
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> CardNetwork:
        copied = CardNetwork(list(self.charges), MemoryStore())
        for key, value in self.receipts.rows("receipts").items():
            copied.receipts.put("receipts", key, value)
        return copied

    def charged(self, order_id: str) -> bool:
        return any(charged_id == order_id for charged_id, _ in self.charges)


NETWORK = CardNetwork([], MemoryStore())


def fresh_network() -> CardNetwork:
    """Each exploration starts from an empty card network."""
    global NETWORK
    NETWORK = CardNetwork([], MemoryStore())
    return NETWORK


def charged_once(network: CardNetwork) -> None:
    assert len(network.charges) == 1, f"{len(network.charges)} charges for o-1"


async def reserve_stock(order: Order) -> str:
    return f"stock held for {order.id}"


async def send_receipt(order: Order, receipt: str) -> str:
    return f"mailed {receipt}"


@task("charge_order_naive")
async def charge_order_naive(ctx: TaskContext[Order]) -> str:
    order = ctx.input
    await ctx.step.run("reserve", reserve_stock, order)

    async def charge() -> str:
        NETWORK.charges.append((order.id, order.cents))  # not fenced, not looked up
        return f"receipt-{order.id}"

    receipt = await ctx.step.run("charge", charge)
    return await ctx.step.run("mail", send_receipt, order, receipt)


async def fenced_charge(order: Order) -> str:
    async def act(info: AttemptInfo) -> str:
        if info.resumed and NETWORK.charged(order.id):
            return f"receipt-{order.id}"  # an earlier attempt charged: do not charge again
        NETWORK.charges.append((order.id, order.cents))
        return f"receipt-{order.id}"

    async def commit(tx: Any, receipt: str) -> None:
        tx.put("receipts", order.id, receipt)

    return await with_attempt_token(NETWORK.receipts, f"charge:{order.id}", act, commit=commit)


@task("charge_order")
async def charge_order(ctx: TaskContext[Order]) -> str:
    order = ctx.input
    await ctx.step.run("reserve", reserve_stock, order)
    receipt = await ctx.step.run("charge", fenced_charge, order)
    return await ctx.step.run("mail", send_receipt, order, receipt)


async def test_the_naive_charge_is_caught_after_the_charge_returned() -> None:
    report = await explore_crashes(
        charge_order_naive, Order("o-1", 4200), setup=fresh_network, invariant=charged_once
    )
    assert not report.ok
    assert [c.id for f in report.failures for c in f.crashes] == ["after:charge"]
    print(report.explain())


async def test_the_fenced_charge_survives_every_crash_point() -> None:
    report = await explore_crashes(
        charge_order, Order("o-1", 4200), setup=fresh_network, invariant=charged_once
    )
    assert report.ok, report.explain()
    print(report.explain())
    print("  points:", ", ".join(p.id for p in report.points))


async def test_and_every_pair_of_crash_points() -> None:
    report = await explore_crashes(
        charge_order, Order("o-1", 4200), setup=fresh_network, invariant=charged_once, depth=2
    )
    assert report.ok, report.explain()
    print(report.explain())


if __name__ == "__main__":
    asyncio.run(test_the_naive_charge_is_caught_after_the_charge_returned())
    print()
    asyncio.run(test_the_fenced_charge_survives_every_crash_point())
    print()
    asyncio.run(test_and_every_pair_of_crash_points())
