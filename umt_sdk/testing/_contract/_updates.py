"""Updates and queries: an update's result comes back once recorded, replays see it at the
same point, updates apply in the order they were sent (racing callers each get their own
result), bad names and refused arguments store nothing, a handler that raises fails only its
update, `update_with_start` makes one run per key, and a query reads the run's state
without a worker."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    Engine,
    TaskContext,
    TaskDefinition,
    UpdateFailedError,
    UpdateTimeoutError,
    UsageError,
    query,
    task,
    update,
)
from umt_sdk.testing._contract._base import Job, Tally, current_tally, wait_until

__all__ = ["UpdatesContract"]


def _positive(amount: int) -> None:
    if amount <= 0:
        raise ValueError("amount must be > 0")


@update("add", validator=_positive)
async def add_item(ctx: TaskContext[Job], amount: int) -> int:
    """Add to the cart's total and return it; 13 is refused by the handler itself."""
    current_tally().body_runs[(ctx.input.key, "add")] += 1
    if amount == 13:
        raise ValueError("13 is unlucky")
    state = ctx.query_state or {"total": 0, "adds": 0}
    state = {"total": state["total"] + amount, "adds": state["adds"] + 1}
    await ctx.set_query_state(state)
    return int(state["total"])


@update("close")
async def close_cart(ctx: TaskContext[Job], note: str) -> str:
    return f"closed: {note}"


@query("total")
def total_of(state: dict[str, int] | None) -> int:
    return 0 if state is None else state["total"]


@query("adds")
def adds_of(state: dict[str, int] | None) -> int | None:
    return None if state is None else state["adds"]


@task("contract.cart", version=1, updates=[add_item, close_cart], queries=[total_of, adds_of])
async def cart_task(ctx: TaskContext[Job]) -> dict[str, Any]:
    """Keep a total that `add` updates change, until `close`; `n` = 1 first waits for the
    fact `<key>.go` (so updates arrive before the run waits for them), `n` = 3 too, then ends
    without waiting for updates; `n` = 2 waits for
    updates at most 300 ms, else without a timeout (with `FakeClock(auto_advance=True)` a
    caller waiting for an update's result lets the clock jump to the run's next timer, as a
    caller of `result()` does)."""
    await ctx.set_query_state({"total": 0, "adds": 0})
    if ctx.input.n in (1, 3):
        await ctx.step.wait_for_fact(f"{ctx.input.key}.go")
    if ctx.input.n == 3:  # ends without waiting for updates
        return {"total": 0, "note": "never waited"}
    timeout = timedelta(milliseconds=300) if ctx.input.n == 2 else None
    try:
        closed = await ctx.step.wait_for_update("close", timeout=timeout)
    except UpdateTimeoutError:
        return {"total": ctx.query_state["total"], "note": "timed out"}
    return {"total": ctx.query_state["total"], "note": closed.arg, "said": closed.result}


TASKS: tuple[TaskDefinition[Any, Any], ...] = (cart_task,)
"""The tasks of this topic that the suite's engine registers."""


async def _waiting(engine: Engine, run_id: Any) -> None:
    await wait_until(engine, run_id, lambda i: i.status == "waiting", what="a wait")


class UpdatesContract:
    """`engine.update`, `ctx.step.wait_for_update`, `engine.query`, `update_with_start`."""

    async def test_an_update_returns_its_recorded_result_and_replays_keep_it(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(cart_task, Job(key="cart"))
        async with engine.worker():
            await _waiting(engine, handle.run_id)
            assert await handle.query("total") == 0
            assert await handle.update("add", 5, timeout=15) == 5
            assert await engine.update(handle.run_id, "add", 7, timeout=15) == 12
            assert await handle.query("total") == 12
            assert await handle.query("adds") == 2
            assert await handle.update("close", "bye", timeout=15) == "closed: bye"
            result = await handle.result(timeout=15)
        # The last execution replayed both adds (the run parked after each): same total.
        assert result == {"total": 12, "note": "bye", "said": "closed: bye"}
        assert tally.body_runs[("cart", "add")] >= 2
        info = await engine.get(handle.run_id)
        names = [s.name for s in info.timeline if s.status == "completed"]
        assert names == [
            "umt.update:1",
            "umt.update-result:1",
            "umt.update:2",
            "umt.update-result:2",
            "umt.update:3",
            "umt.update-result:3",
        ]
        # A query answers after the run ended too, from what it recorded.
        assert await handle.query("total") == 12

    async def test_updates_sent_before_the_wait_apply_in_order_one_result_each(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(cart_task, Job(key="early", n=1))
        async with engine.worker():
            await _waiting(engine, handle.run_id)  # on the fact, not on updates
            calls = [
                asyncio.ensure_future(engine.update(handle.run_id, "add", i, timeout=30))
                for i in (1, 2, 3, 4)
            ]
            await asyncio.sleep(0)
            assert await engine.signal(handle.run_id, "early.go")
            results = await asyncio.gather(*calls)
            assert await handle.update("close", "done", timeout=15) == "closed: done"
            result = await handle.result(timeout=15)
        # Each caller got its own running total: the totals of one order of 1, 2, 3, 4.
        assert sorted(results) == sorted(set(results))
        assert max(results) == 10
        assert result["total"] == 10

    async def test_bad_names_and_refused_arguments_store_nothing(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(cart_task, Job(key="bad"))
        async with engine.worker():
            await _waiting(engine, handle.run_id)
            with pytest.raises(UsageError, match="no update 'nope'") as caught:
                await handle.update("nope", 1)
            assert caught.value.argument == "name"
            with pytest.raises(UsageError, match="add") as caught:
                await handle.update("add", "five")
            assert caught.value.argument == "arg"
            with pytest.raises(UsageError, match="amount must be > 0") as caught:
                await handle.update("add", -1)
            assert caught.value.argument == "arg"
            with pytest.raises(UsageError, match="no query 'nope'") as caught:
                await handle.query("nope")
            assert caught.value.argument == "name"
            with pytest.raises(UsageError, match="reserved"):
                await engine.signal(handle.run_id, "umt.update:1", {"name": "add", "arg": 1})
            with pytest.raises(UsageError, match="reserved"):
                await engine.broadcast("umt.update:1", {"name": "add", "arg": 1})
            # Nothing was stored: the first real update is update 1, and the only one.
            assert not await engine.backend.get_facts(run_id=handle.run_id, name="umt.update:1")
            assert await handle.update("add", 2, timeout=15) == 2
            assert await handle.update("close", "x", timeout=15) == "closed: x"
            assert (await handle.result(timeout=15))["total"] == 2
        assert not await engine.backend.get_facts(run_id=handle.run_id, name="umt.update:3")

    async def test_a_handler_that_raises_fails_its_update_only(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(cart_task, Job(key="raises"))
        async with engine.worker():
            await _waiting(engine, handle.run_id)
            with pytest.raises(UpdateFailedError, match="13 is unlucky") as caught:
                await handle.update("add", 13, timeout=15)
            assert caught.value.reason == "failed"
            assert caught.value.error_type.endswith("ValueError")
            assert await handle.update("add", 1, timeout=15) == 1
            assert await handle.update("close", "ok", timeout=15) == "closed: ok"
            assert (await handle.result(timeout=15))["total"] == 1

    async def test_a_finished_run_takes_no_updates(self, engine: Engine, tally: Tally) -> None:
        handle = await engine.enqueue(cart_task, Job(key="late", n=2))
        async with engine.worker():
            assert await handle.result(timeout=15) == {"total": 0, "note": "timed out"}
        with pytest.raises(UpdateFailedError, match="has ended") as caught:
            await handle.update("add", 1, timeout=15)
        assert caught.value.reason == "finished"
        assert await handle.query("total") == 0

    async def test_a_run_that_ends_without_applying_an_update_says_so(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(cart_task, Job(key="never", n=3))
        async with engine.worker():
            await _waiting(engine, handle.run_id)
            caller = asyncio.ensure_future(handle.update("add", 1, timeout=30))
            while not await engine.backend.get_facts(run_id=handle.run_id, name="umt.update:1"):
                assert not caller.done()
                await asyncio.sleep(0.01)
            assert await engine.signal(handle.run_id, "never.go")
            with pytest.raises(UpdateFailedError, match="before it applied") as caught:
                await caller
            assert caught.value.reason == "finished"
            assert (await handle.result(timeout=15))["note"] == "never waited"

    async def test_update_with_start_makes_one_run_per_key(
        self, engine: Engine, tally: Tally
    ) -> None:
        with pytest.raises(UsageError) as caught:
            await engine.update_with_start(cart_task, Job(key="uws"), key="cart:1", update="nope")
        assert caught.value.argument == "update"
        with pytest.raises(UsageError) as caught:
            await engine.update_with_start(
                cart_task, Job(key="uws"), key="cart:1", update="add", arg=0
            )
        assert caught.value.argument == "arg"
        assert (await engine.list(task_name="contract.cart", idempotency_key="cart:1")).runs == ()
        async with engine.worker():
            outcomes = await asyncio.gather(
                *(
                    engine.update_with_start(
                        cart_task, Job(key="uws", n=10 + i), key="cart:1", update="add", arg=i + 1
                    )
                    for i in range(3)
                )
            )
            run_ids = {h.run_id for h, _ in outcomes}
            assert len(run_ids) == 1
            assert sum(h.created for h, _ in outcomes) == 1
            assert max(r for _, r in outcomes) == 6
            handle = outcomes[0][0]
            assert await handle.update("close", "k", timeout=15) == "closed: k"
            assert (await handle.result(timeout=15))["total"] == 6
        assert (
            len((await engine.list(task_name="contract.cart", idempotency_key="cart:1")).runs) == 1
        )
