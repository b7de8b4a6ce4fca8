"""Record `histories/in-flight.jsonl`: the runs in flight when this release ships, as
`umt runs export --status pending,running,waiting` would export them from production.

Run it from the repository's root after a deliberate change of the recorded releases:
`.venv/bin/python examples/checkout/record_histories.py`. On the memory backend with a fake
clock: three runs started on the previous release (no fraud check) and parked on their
payment, one started on this release (it passed the fraud check, its marker recorded), and one
not started yet.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import timedelta
from pathlib import Path

from umt_sdk import Engine, Registry, RunHistory, TaskContext, connect, task
from umt_sdk.testing import FakeClock

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tasks import Order, checkout, price, ship

HISTORIES = Path(__file__).resolve().parent / "histories" / "in-flight.jsonl"


@task("checkout", version=1)
async def checkout_previous(ctx: TaskContext[Order]) -> str:
    """The release before this one: no fraud check."""
    quote = await ctx.step.run("quote", price, ctx.input)
    await ctx.step.wait_for_fact("paid", timeout=timedelta(days=2))
    label = await ctx.step.run("ship", ship, ctx.input.order_id)
    return f"{label} ({quote.amount_cents} {quote.currency})"


async def park(engine: Engine, orders: list[Order]) -> list[RunHistory]:
    handles = [await engine.enqueue(checkout, order) for order in orders]
    async with engine.worker():
        for handle in handles:
            info = await engine.get(handle.run_id)
            while info.status != "waiting":  # parked on its payment
                await asyncio.sleep(0.01)
                info = await engine.get(handle.run_id)
    return [await engine.export_history(handle.run_id) for handle in handles]


async def record() -> list[RunHistory]:
    clock = FakeClock(auto_advance=True)
    previous = await connect("memory://", registry=Registry([checkout_previous]), clock=clock)
    histories = await park(previous, [Order(f"o-{n}", 2500 * n) for n in (1, 2, 3)])
    current = Engine(previous.backend, Registry([checkout]))
    histories += await park(current, [Order("o-4", 4200)])
    pending = await current.enqueue(checkout, Order("o-5", 990))
    histories.append(await current.export_history(pending.run_id))
    await previous.close()
    return histories


def main() -> None:
    histories = asyncio.run(record())
    HISTORIES.write_text("".join(h.to_json() + "\n" for h in histories), encoding="utf-8")
    print(f"wrote {len(histories)} histories to {HISTORIES}")


if __name__ == "__main__":
    main()
