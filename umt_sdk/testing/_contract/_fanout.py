"""Fan-out: `ctx.step.map` and `ctx.step.gather`. Outcomes in input order, the parent woken
once when its last child finishes (never once per child), partial failure reported per child,
`max_concurrency` held by the store, and a crash between the children's start and its record
that starts each child once."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    ChildCanceledError,
    ChildFailedError,
    ChildrenFailedError,
    Engine,
    RetryPolicy,
    TaskContext,
    TaskDefinition,
    task,
)
from umt_sdk._probe import Point, observing
from umt_sdk._spi import ChildGroupStore
from umt_sdk.testing._contract._base import (
    Job,
    Tally,
    current_tally,
    eventually,
    holds,
    wait_until,
)
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["FanOutContract"]

HELD = "umt turn"
"""How a child held back by `max_concurrency` reads: waiting for its turn."""


@task("contract.fan_child", version=1, retry=RetryPolicy(max_attempts=1))
async def fan_child(ctx: TaskContext[Job]) -> int:
    """Squares `n`; waits for the gate named by its key first (the test opens it), and fails
    when its key says so for its `n`."""
    tally = current_tally()
    key, n = ctx.input.key, ctx.input.n
    tally.body_runs[(key, f"child{n}")] += 1
    active = tally.business.setdefault(f"active:{key}", [0, 0])
    active[0] += 1
    active[1] = max(active[1], active[0])
    try:
        waits = [
            asyncio.ensure_future(tally.gate(key).wait()),
            asyncio.ensure_future(ctx.abort_event.wait()),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        ctx.throw_if_canceled()
    finally:
        active[0] -= 1
    if f"fail{n}" in key.split("-"):
        raise ValueError(f"child {n} cannot")
    return n * n


def _plan(key: str) -> tuple[int, int | None, bool]:
    """How many children a fan-out parent starts, its max_concurrency, return_exceptions: read
    from its key (`map-<count>[-limit<k>][-exc]...`)."""
    parts = key.split("-")
    count = int(parts[1])
    limit = next((int(p[5:]) for p in parts if p.startswith("limit")), None)
    return count, limit, "exc" in parts


@task("contract.map_parent", version=1, retry=RetryPolicy(max_attempts=1))
async def map_parent(ctx: TaskContext[Job]) -> list[str]:
    """Maps `fan_child` over `count` inputs and describes each outcome."""
    key = ctx.input.key
    count, limit, return_exceptions = _plan(key)
    inputs = [Job(key=key, n=i) for i in range(count)]
    outcomes: list[Any]
    if return_exceptions:
        outcomes = await ctx.step.map(
            "fan", fan_child, inputs, max_concurrency=limit, return_exceptions=True
        )
    else:
        try:
            outcomes = await ctx.step.map("fan", fan_child, inputs, max_concurrency=limit)
        except ChildrenFailedError as exc:
            current_tally().business.setdefault(f"raised:{key}", []).append(sorted(exc.errors))
            outcomes = exc.results
    if "replay" in key.split("-"):
        await ctx.step.sleep("again", timedelta(milliseconds=200))  # one more execution
    return [_describe(outcome) for outcome in outcomes]


@task("contract.gather_parent", version=1, retry=RetryPolicy(max_attempts=1))
async def gather_parent(ctx: TaskContext[Job]) -> list[str]:
    """Starts `n` children one by one, then gathers them."""
    key = ctx.input.key
    handles = [
        await ctx.step.start_child(f"start{i}", fan_child, Job(key=key, n=i))
        for i in range(ctx.input.n)
    ]
    outcomes = await ctx.step.gather("all", handles, return_exceptions=True)
    return [_describe(outcome) for outcome in outcomes]


def _require_groups(engine: Engine) -> None:
    if not isinstance(engine.backend, ChildGroupStore):
        pytest.skip(
            f"{type(engine.backend).__name__} does not implement ChildGroupStore (optional)"
        )


def _describe(outcome: object) -> str:
    if isinstance(outcome, ChildFailedError):
        return f"failed: {outcome.error_message}"
    if isinstance(outcome, ChildCanceledError):
        return f"canceled: {outcome.reason}"
    return str(outcome)


@task("contract.timed_leaf", version=1, timeout=timedelta(hours=1))
async def timed_leaf(ctx: TaskContext[int]) -> int:
    return ctx.input


@task("contract.timed_map", version=1, retry=RetryPolicy(max_attempts=1))
async def timed_map(ctx: TaskContext[int]) -> list[int]:
    """Maps a task with a run timeout over `n` inputs, one at a time."""
    return await ctx.step.map("timed", timed_leaf, list(range(ctx.input)), max_concurrency=1)


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    fan_child,
    map_parent,
    gather_parent,
    timed_leaf,
    timed_map,
)
"""The tasks of this topic that the suite's engine registers."""


class FanOutContract:
    """`map` and `gather` over children, on every backend."""

    async def _children(self, engine: Engine, parent_id: Any) -> list[Any]:
        return list((await engine.list(parent=parent_id, limit=500)).runs)

    async def test_map_returns_outputs_in_input_order_and_wakes_the_parent_once(
        self, engine: Engine, tally: Tally
    ) -> None:
        _require_groups(engine)
        key = "map-25"
        handle = await engine.enqueue(map_parent, Job(key=key))
        async with engine.worker(concurrency=8):
            parked = await wait_until(
                engine, handle.run_id, lambda i: i.status == "waiting", what="the parent parks"
            )
            assert parked.waiting_for == "umt.group fan"
            tally.gate(key).set()  # every child may finish now
            outcome = await handle.result(timeout=30)
        assert outcome == [str(i * i) for i in range(25)]
        info = await engine.get(handle.run_id)
        assert info.attempts == 2, "claimed once to start, woken once when all were done"
        assert [(s.name, s.kind, s.status) for s in info.timeline] == [
            ("fan", "step", "completed"),
            ("fan.result", "fact", "completed"),
        ]
        children = await self._children(engine, handle.run_id)
        assert len(children) == 25
        assert {c.status for c in children} == {"completed"}
        assert all(tally.body_runs[(key, f"child{i}")] == 1 for i in range(25))

    async def test_partial_failure_raises_with_every_childs_outcome(
        self, engine: Engine, tally: Tally
    ) -> None:
        _require_groups(engine)
        key = "map-6-fail1-fail4"
        handle = await engine.enqueue(map_parent, Job(key=key))
        tally.gate(key).set()
        async with engine.worker(concurrency=4):
            outcome = await handle.result(timeout=30)
        assert outcome == [
            "0",
            "failed: child 1 cannot",
            "4",
            "9",
            "failed: child 4 cannot",
            "25",
        ]
        assert tally.business[f"raised:{key}"] == [[1, 4]]

    async def test_return_exceptions_gives_each_failure_in_its_place(
        self, engine: Engine, tally: Tally
    ) -> None:
        _require_groups(engine)
        key = "map-3-exc-fail2"
        handle = await engine.enqueue(map_parent, Job(key=key))
        tally.gate(key).set()
        async with engine.worker(concurrency=4):
            assert await handle.result(timeout=30) == ["0", "1", "failed: child 2 cannot"]

    async def test_max_concurrency_holds_the_rest_in_the_store_in_input_order(
        self, engine: Engine, tally: Tally
    ) -> None:
        _require_groups(engine)
        key = "map-9-limit3"
        handle = await engine.enqueue(map_parent, Job(key=key))
        async with engine.worker(concurrency=12):
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting")
            await eventually(lambda: holds(tally.business.get(f"active:{key}", [0])[0] == 3))
            children = sorted(
                await self._children(engine, handle.run_id), key=lambda c: c.input["n"]
            )
            held = [c.input["n"] for c in children if c.waiting_for == HELD]
            assert held == [3, 4, 5, 6, 7, 8], "held back in the store, in input order"
            assert all(c.status == "waiting" and c.attempts == 0 for c in children[3:])
            tally.gate(key).set()
            assert await handle.result(timeout=30) == [str(i * i) for i in range(9)]
        assert tally.business[f"active:{key}"][1] == 3, "never more than 3 at once"
        assert (await engine.get(handle.run_id)).attempts == 2

    async def test_canceling_a_held_child_lets_the_others_finish(
        self, engine: Engine, tally: Tally
    ) -> None:
        _require_groups(engine)
        key = "map-4-limit1-exc"
        handle = await engine.enqueue(map_parent, Job(key=key))
        async with engine.worker(concurrency=4):
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting")
            await eventually(lambda: holds(tally.business.get(f"active:{key}", [0])[0] == 1))
            children = sorted(
                await self._children(engine, handle.run_id), key=lambda c: c.input["n"]
            )
            assert [c.waiting_for == HELD for c in children] == [False, True, True, True]
            assert await engine.cancel(children[2].run_id, reason="skip") == "canceled"
            tally.gate(key).set()
            outcome = await handle.result(timeout=30)
        assert outcome == ["0", "1", "canceled: skip", "9"]
        assert (await engine.get(handle.run_id)).attempts == 2

    async def test_cancels_of_held_children_racing_endings_never_strand_the_map(
        self, engine: Engine, tally: Tally
    ) -> None:
        """Held children canceled while their running siblings end (the writes that let the
        next one run): every child ends, never more than the limit at once, and the parent
        is woken once with every outcome in place."""
        _require_groups(engine)
        key = "map-8-limit2-exc"
        handle = await engine.enqueue(map_parent, Job(key=key))
        async with engine.worker(concurrency=8):
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting")
            await eventually(lambda: holds(tally.business.get(f"active:{key}", [0])[0] == 2))
            children = sorted(
                await self._children(engine, handle.run_id), key=lambda c: c.input["n"]
            )
            chosen = [3, 5, 6, 7]
            tally.gate(key).set()  # the running ones end while the cancels go in
            await asyncio.gather(
                *(engine.cancel(children[n].run_id, reason="skip") for n in chosen)
            )
            outcome = await handle.result(timeout=30)
        for n in range(8):
            if n in chosen:  # its turn may have come (and gone) before its cancel
                assert outcome[n] in (str(n * n), "canceled: skip"), outcome
            else:
                assert outcome[n] == str(n * n), outcome
        assert tally.business[f"active:{key}"][1] <= 2, "never more than 2 at once"
        assert (await engine.get(handle.run_id)).attempts == 2, "woken once"
        ended = await self._children(engine, handle.run_id)
        assert {c.status for c in ended} <= {"completed", "canceled"}

    async def test_gather_wakes_the_parent_once_and_keeps_the_handles_order(
        self, engine: Engine, tally: Tally
    ) -> None:
        _require_groups(engine)
        key = "gather-fail3"
        handle = await engine.enqueue(gather_parent, Job(key=key, n=5))
        async with engine.worker(concurrency=8):
            parked = await wait_until(engine, handle.run_id, lambda i: i.status == "waiting")
            assert parked.waiting_for == "umt.group all"
            tally.gate(key).set()
            outcome = await handle.result(timeout=30)
        assert outcome == ["0", "1", "4", "failed: child 3 cannot", "16"]
        info = await engine.get(handle.run_id)
        assert info.attempts == 2, "woken once, by the last child's ending"
        assert [s.name for s in info.timeline][-1] == "all"

    async def test_gather_with_one_worker_slot(self, engine: Engine, tally: Tally) -> None:
        _require_groups(engine)
        key = "gather-done"
        tally.gate(key).set()
        handle = await engine.enqueue(gather_parent, Job(key=key, n=3))
        async with engine.worker(concurrency=1):  # children run only once the parent parks
            assert await handle.result(timeout=30) == ["0", "1", "4"]

    async def test_an_empty_map_returns_at_once(self, engine: Engine) -> None:
        _require_groups(engine)
        handle = await engine.enqueue(map_parent, Job(key="map-0"))
        async with engine.worker(concurrency=1):
            assert await handle.result(timeout=15) == []
        assert (await engine.get(handle.run_id)).attempts == 1

    async def test_a_crash_after_the_children_were_stored_starts_each_once(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        _require_groups(engine)
        key = "map-5-limit2-replay"
        crashed: list[Point] = []

        def crash_once_after_start(point: Point) -> bool:
            if point.kind == "step.returned" and point.name == "fan" and not crashed:
                crashed.append(point)
                return True  # the children are stored; the step's record is not
            return False

        handle = await engine.enqueue(map_parent, Job(key=key))
        tally.gate(key).set()
        with observing(crash_once_after_start):
            worker = engine.worker(concurrency=4, lease=harness.lease)
            await worker.start()
        await eventually(lambda: holds(bool(crashed)))

        # The children go on without their parent: let them all end before the clock moves
        # past the lease, which must expire the crashed parent's lease only (on a FakeClock it
        # also expired a child's still in flight, and a child taken over runs its body again).
        async def children_ended() -> bool:
            children = await self._children(engine, handle.run_id)
            return len(children) == 5 and all(c.status == "completed" for c in children)

        await eventually(children_ended, timeout=30)
        await harness.advance(harness.lease * 2)
        assert await handle.result(timeout=30) == [str(i * i) for i in range(5)]
        await worker.stop()
        children = await self._children(engine, handle.run_id)
        assert len(children) == 5, "the step's second execution found the same children"
        assert all(tally.body_runs[(key, f"child{i}")] == 1 for i in range(5))
        info = await engine.get(handle.run_id)
        # The crash cost the parent one lease; a starved machine may cost it more (a 1 s lease
        # in the Postgres harness), which changes nothing here: the children and the steps
        # are counted directly.
        assert info.lease_expirations >= 1
        # The sleep's end replayed the map from its records: no child started again.
        completed = [s.name for s in info.timeline if s.status == "completed"]
        assert completed == ["fan", "fan.result", "again"]

    async def test_canceling_a_parked_map_parent_cancels_every_child_held_ones_included(
        self, engine: Engine, tally: Tally
    ) -> None:
        _require_groups(engine)
        key = "map-5-limit2"
        handle = await engine.enqueue(map_parent, Job(key=key))
        async with engine.worker(concurrency=4):
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting")
            await eventually(lambda: holds(tally.business.get(f"active:{key}", [0])[0] == 2))
            assert await engine.cancel(handle.run_id, reason="operator") == "canceled"
            children = await self._children(engine, handle.run_id)
            for child in children:  # the two running ones learn it from their heartbeat
                await wait_until(
                    engine, child.run_id, lambda i: i.status == "canceled", what="the cascade"
                )
        children = await self._children(engine, handle.run_id)
        assert sorted(c.status for c in children) == ["canceled"] * 5
        assert {c.cancel_reason for c in children} == {f"parent {handle.run_id} canceled"}
        assert sum(tally.body_runs[(key, f"child{i}")] for i in range(5)) == 2, (
            "the held children never ran"
        )

    async def test_each_child_of_a_map_carries_its_tasks_deadline(self, engine: Engine) -> None:
        _require_groups(engine)
        handle = await engine.enqueue(timed_map, 3)
        async with engine.worker(concurrency=2):
            assert await handle.result(timeout=30) == [0, 1, 2]
        parent = await engine.get(handle.run_id)
        for child in await self._children(engine, handle.run_id):
            info = await engine.get(child.run_id)
            assert info.deadline_at is not None, "the task's timeout, from the map's start"
            assert info.deadline_at <= parent.created_at + timedelta(hours=2)
