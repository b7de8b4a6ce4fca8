"""Updates and queries: callers change a running run and get an answer back, or read it.

Run it: `python examples/22_updates_and_queries.py`. It prints what happened and exits 0.

A shopping cart is a run. It waits (parked, no worker slot held) for updates:

1. `engine.update_with_start(cart, ..., key="cart:alice", update="add_item", arg=...)`
   starts Alice's cart run if her key names none, then adds the item: two browser tabs
   racing on the same key get one run, and each tab its own answer;
2. `engine.query(run_id, "summary")` reads what the cart shows of itself (its query state),
   in this process: no worker runs anything for it, nothing is written;
3. a quantity the validator refuses, and an update the cart does not declare: `UsageError`
   naming the argument, and nothing is stored;
4. `handle.update("checkout", ...)` returns the order's total, recorded in the run's history
   (`umt.update:<n>`, the request, and `umt.update-result:<n>`, the answer), and the run ends.
"""

from __future__ import annotations

import asyncio

import attrs

from umt_sdk import (
    Registry,
    TaskContext,
    UsageError,
    connect,
    query,
    task,
    update,
)
from umt_sdk.testing import FakeClock


@attrs.frozen
class Item:
    sku: str
    quantity: int
    cents: int


@attrs.frozen
class CartState:
    items: list[Item]
    closed: bool = False


def positive_quantity(item: Item) -> None:
    """Runs in the caller's process before anything is stored: raising refuses the update."""
    if item.quantity <= 0:
        raise ValueError(f"quantity must be > 0, got {item.quantity}")


@update("add_item", validator=positive_quantity)
async def add_item(ctx: TaskContext[str], item: Item) -> int:
    """Applied in the run, where it waits for updates; returns the cart's item count."""
    state: CartState = ctx.query_state
    state = CartState(items=[*state.items, item])
    await ctx.set_query_state(state)  # what queries answer from
    return sum(i.quantity for i in state.items)


@update("checkout")
async def checkout(ctx: TaskContext[str], coupon: str) -> int:
    """Closes the cart; returns the total in cents (10% off with the coupon)."""
    state: CartState = ctx.query_state
    total = sum(i.quantity * i.cents for i in state.items)
    if coupon == "TENOFF":
        total = total * 9 // 10
    await ctx.set_query_state(CartState(items=state.items, closed=True))
    return total


@query("summary")
def summary(state: CartState | None) -> str:
    if state is None:
        return "not started"
    count = sum(i.quantity for i in state.items)
    return f"{count} item(s){' (checked out)' if state.closed else ''}"


@task("cart", version=1, updates=[add_item, checkout], queries=[summary])
async def cart(ctx: TaskContext[str]) -> str:
    await ctx.set_query_state(CartState(items=[]))
    # Apply updates in the order they were sent until a checkout has been applied; replays
    # after each park apply them again at this same point, with their recorded answers.
    done = await ctx.step.wait_for_update("checkout")
    return f"{ctx.input}'s order: {done.result} cents"


async def main() -> None:
    engine = await connect(
        "memory://", registry=Registry([cart]), clock=FakeClock(auto_advance=True)
    )
    async with engine.worker(concurrency=2):
        # 1. Two tabs add an item each to Alice's cart: one run, two answers.
        (tab1, count1), (tab2, count2) = await asyncio.gather(
            engine.update_with_start(
                cart, "alice", key="cart:alice", update="add_item", arg=Item("book", 2, 1500)
            ),
            engine.update_with_start(
                cart, "alice", key="cart:alice", update="add_item", arg=Item("pen", 1, 300)
            ),
        )
        assert tab1.run_id == tab2.run_id
        assert tab1.created != tab2.created
        assert sorted([count1, count2]) in ([2, 3], [1, 3])
        print(f"1. one cart run for both tabs; their answers: {count1} and {count2} item(s)")

        # 2. A query answers from the run's query state, without a worker.
        assert await tab1.query("summary") == "3 item(s)"
        print(f"2. summary: {await tab1.query('summary')}")

        # 3. Refused: nothing is stored.
        refused = []
        for name, arg in (("add_item", Item("mug", 0, 900)), ("remove_item", "book")):
            try:
                await tab1.update(name, arg)
            except UsageError as exc:
                refused.append(f"{name}: {exc.argument}")
        assert refused == ["add_item: arg", "remove_item: name"], refused
        print(f"3. refused, nothing stored: {', '.join(refused)}")

        # 4. Checkout: the answer is recorded in the run's history, then the run ends.
        total = await tab1.update("checkout", "TENOFF", timeout=10)
        assert total == (2 * 1500 + 300) * 9 // 10
        print(f"4. checkout answered {total} cents; {await tab1.result(timeout=10)}")
        info = await engine.get(tab1.run_id)
        recorded = [s.name for s in info.timeline if s.name.startswith("umt.update")]
        assert recorded[-2:] == ["umt.update:3", "umt.update-result:3"], recorded
        print(f"   history: {', '.join(recorded)}")
        print(f"   summary after the end: {await tab1.query('summary')}")
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
