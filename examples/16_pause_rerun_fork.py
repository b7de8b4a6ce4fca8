"""Pause a task during an incident, fix the bug, and fork the failed runs from the broken step.

Run it: `python examples/16_pause_rerun_fork.py` (the memory backend; on Postgres the same calls
hold across every worker and host, and `umt tasks pause|resume`, `umt runs fork|rerun` do the
same from a shell).

- `engine.pause("charge_order@1")`: no worker starts a run of that version; its runs wait,
  pending and unharmed, until `engine.resume(...)`;
- version 1 of `charge_order` has a bug in its `charge` step: the orders with cents fail;
- version 2 fixes it, and `engine.fork(run_id, "charge", version=2)` starts each failed run
  again from `charge`: the `reserve` step it recorded is kept (replayed, not run again: the
  stock is reserved once), and only `charge` onwards runs, on the fixed code;
- `engine.rerun(run_id)` starts a run again from the start, with the same input.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from attrs import frozen

from umt_sdk import Engine, Registry, RetryPolicy, RunFailedError, TaskContext, connect, task

RESERVED: Counter[str] = Counter()
"""How often each order's stock was really reserved (a fork must not reserve it again)."""


@frozen
class Order:
    order_id: str
    cents: int


def reserve(order: Order) -> str:
    RESERVED[order.order_id] += 1
    return f"reserved stock for {order.order_id}"


def charge_v1(order: Order) -> str:
    if order.cents % 100:
        raise ValueError(f"cannot charge {order.cents / 100} (the bug: cents are dropped)")
    return f"charged {order.cents // 100}.00"


def charge_v2(order: Order) -> str:
    return f"charged {order.cents // 100}.{order.cents % 100:02d}"


@task("charge_order", version=1, retry=RetryPolicy.none())
async def charge_order_v1(ctx: TaskContext[Order]) -> str:
    reserved = await ctx.step.run("reserve", reserve, ctx.input)
    charged = await ctx.step.run("charge", charge_v1, ctx.input)
    return f"{reserved}, {charged}"


@task("charge_order", version=2, retry=RetryPolicy.none())
async def charge_order_v2(ctx: TaskContext[Order]) -> str:
    reserved = await ctx.step.run("reserve", reserve, ctx.input)  # the same steps before
    charged = await ctx.step.run("charge", charge_v2, ctx.input)
    return f"{reserved}, {charged} (v2)"


registry = Registry([charge_order_v1, charge_order_v2])


async def main() -> None:
    engine: Engine = await connect("memory://", registry=registry)
    async with engine, engine.worker(concurrency=4):
        # An incident: stop starting charges while we look, without losing any order.
        await engine.pause("charge_order@1")
        orders = [Order("A-1", 2500), Order("A-2", 1999), Order("A-3", 4250)]
        handles = [await engine.enqueue(charge_order_v1, o, version=1) for o in orders]
        await asyncio.sleep(0.2)
        waiting = await engine.list(task_name="charge_order", status="pending")
        paused = ", ".join(str(p) for p in await engine.paused())
        print(f"paused {paused}: {len(waiting)} orders wait, none started")
        assert len(waiting) == 3
        assert not RESERVED

        await engine.resume("charge_order@1")
        failed = []
        for order, handle in zip(orders, handles, strict=True):
            try:
                print(f"{order.order_id}: {await handle.result(timeout=10)}")
            except RunFailedError as exc:
                print(f"{order.order_id}: failed ({exc.error_message})")
                failed.append(handle.run_id)
        assert len(failed) == 2

        # Version 2 is deployed: fork the failed runs from the broken step onto it.
        for run_id in failed:
            fork = await engine.fork(run_id, "charge", version=2)
            info = await engine.get(fork.run_id)
            print(
                f"fork of {str(run_id)[:8]} from {info.forked_at_step!r}: "
                f"{await fork.result(timeout=10)}"
            )
        assert all(count == 1 for count in RESERVED.values()), RESERVED
        print(f"stock reserved once per order: {dict(RESERVED)}")

        # A rerun starts from the start: it reserves again.
        again = await engine.rerun(handles[0].run_id)
        print(f"rerun of A-1: {await again.result(timeout=10)}")
        assert RESERVED["A-1"] == 2
        assert (await engine.get(again.run_id)).rerun_of == handles[0].run_id


if __name__ == "__main__":
    asyncio.run(main())
