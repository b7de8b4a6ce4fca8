"""A stateful model of parents and children on the memory backend.

Parents start one to four children (each `parent_close` "cancel" or "abandon") and wait for
their results, one handle at a time, or all at once with `ctx.step.gather`, or fan out with
`ctx.step.map` (with or without `max_concurrency`); children may wait for a fact `go`, fail,
or start children of their own. The
machine interleaves at random: executing one due run at a time (the inline driver, in this
loop, under a `FakeClock`), crashes of an execution at any point it reaches (a lost lease, as
after SIGKILL), leases lapsing, facts sent, and cancels of any run, of a map's child held back
by its `max_concurrency`, and of a map's parent while some of its children are held. After
every rule it checks:

- exactly once: no parent ever has two children for one start step;
- no parent waits forever: a parent parked on a child that has finished, or on a map or
  gather whose children have all finished, is claimable;
- woken once: a parent parked on a map or gather is not claimable while any of its children
  is unfinished (one wake-up for the whole group, never one per child);
- max_concurrency: a map's children neither finished nor held back number at most its limit,
  and exactly its limit while some are held back (a held child is never left behind);
- no orphan: a child that asked to be canceled with its parent, whose parent finished failed
  or canceled, is finished or has its cancel requested;

and at the end it drives every run to its end and checks each parent's output against what
its children did.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import attrs
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from umt_sdk import (
    ChildCanceledError,
    ChildFailedError,
    Engine,
    ParentClose,
    Registry,
    RetryPolicy,
    TaskContext,
    connect,
    task,
)
from umt_sdk._probe import Point, observing
from umt_sdk.backend import TERMINAL_STATUSES, RunQuery
from umt_sdk.testing import FakeClock
from umt_sdk.testing._inline import drive, execute_one

LEASE = timedelta(seconds=30)


@attrs.frozen
class Kid:
    tag: str
    waits: bool = False
    fails: bool = False
    grandchild: bool = False


@attrs.frozen
class Family:
    kids: tuple[Kid, ...]
    close: ParentClose = "cancel"
    mode: str = "each"
    """How the parent waits: "each" handle in turn, "gather" them, or "map" over the kids."""
    limit: int | None = None
    """A map's max_concurrency."""


@task("sm.kid", version=1, retry=RetryPolicy(max_attempts=1))
async def kid(ctx: TaskContext[Kid]) -> str:
    if ctx.input.waits:
        await ctx.step.wait_for_fact("go")
    if ctx.input.grandchild:
        inner = await ctx.step.start_child("inner", kid, Kid(tag=f"{ctx.input.tag}.inner"))
        await inner.result()
    await ctx.step.run("work", lambda: None)
    if ctx.input.fails:
        raise ValueError(f"{ctx.input.tag} fails")
    return ctx.input.tag


@task("sm.parent", version=1, retry=RetryPolicy(max_attempts=1))
async def parent(ctx: TaskContext[Family]) -> list[str]:
    family = ctx.input
    if family.mode == "map":
        outcomes = await ctx.step.map(
            "all",
            kid,
            list(family.kids),
            max_concurrency=family.limit,
            parent_close=family.close,
            return_exceptions=True,
        )
        return [_said(outcome) for outcome in outcomes]
    handles = [
        await ctx.step.start_child(f"start-{k.tag}", kid, k, parent_close=ctx.input.close)
        for k in ctx.input.kids
    ]
    if family.mode == "gather":
        gathered = await ctx.step.gather("all", handles, return_exceptions=True)
        return [_said(outcome) for outcome in gathered]
    outcome = []
    for handle in handles:
        try:
            outcome.append(await handle.result())
        except ChildFailedError:
            outcome.append("failed")
        except ChildCanceledError:
            outcome.append("canceled")
    return outcome


def _held(run: Any) -> bool:
    """A child of a map held back by its max_concurrency (waiting for its turn)."""
    return bool(run.status == "waiting" and run.wait_for == HELD and run.available_at is None)


def _said(outcome: object) -> str:
    if isinstance(outcome, ChildFailedError):
        return "failed"
    if isinstance(outcome, ChildCanceledError):
        return "canceled"
    return str(outcome)


kids = st.builds(
    Kid,
    tag=st.sampled_from(["a", "b", "c", "d"]),
    waits=st.booleans(),
    fails=st.booleans(),
    grandchild=st.booleans(),
)
families = st.builds(
    Family,
    kids=st.lists(kids, min_size=1, max_size=4, unique_by=lambda k: k.tag).map(tuple),
    close=st.sampled_from(["cancel", "abandon"]),
    mode=st.sampled_from(["each", "gather", "map"]),
    limit=st.one_of(st.none(), st.integers(min_value=1, max_value=2)),
)
limited_maps = st.builds(
    Family,
    kids=st.lists(kids, min_size=3, max_size=4, unique_by=lambda k: k.tag).map(tuple),
    close=st.sampled_from(["cancel", "abandon"]),
    mode=st.just("map"),
    limit=st.integers(min_value=1, max_value=2),
)
HELD = "umt turn"
point_kinds = st.sampled_from(["step.before", "step.returned", "park", "end"])


class ChildrenMachine(RuleBasedStateMachine):
    parents = Bundle("parents")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock(datetime(2030, 1, 1, tzinfo=UTC))
        self.engine: Engine = self.loop.run_until_complete(
            connect("memory://", registry=Registry([parent, kid]), clock=self.clock)
        )
        self.armed: tuple[str, int] | None = None
        self.crashes = 0

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def _observe(self, point: Point) -> bool:
        if self.armed is None or point.kind != self.armed[0]:
            return False
        kind, skip = self.armed
        if skip:
            self.armed = (kind, skip - 1)
            return False
        self.armed = None
        self.crashes += 1
        return True

    async def _all(self) -> list[Any]:
        return list(await self.engine.backend.list_runs(RunQuery(limit=10_000)))

    @rule(target=parents, family=families)
    def enqueue_parent(self, family: Family) -> UUID:
        handle = self._run(self.engine.enqueue(parent, family))
        run_id: UUID = handle.run_id
        return run_id

    @rule(target=parents, family=limited_maps)
    def enqueue_limited_map(self, family: Family) -> UUID:
        """A map with more children than its max_concurrency: some are held once it starts
        (what the cancel rules below act on)."""
        return self.enqueue_parent(family)

    @rule(executions=st.integers(min_value=1, max_value=4))
    def execute(self, executions: int) -> None:
        async def go() -> None:
            for _ in range(executions):
                await execute_one(self.engine, lease=LEASE)

        with observing(self._observe):
            self._run(go())

    @rule(kind=point_kinds, skip=st.integers(min_value=0, max_value=1))
    def arm_crash(self, kind: str, skip: int) -> None:
        self.armed = (kind, skip)

    @rule()
    def leases_lapse(self) -> None:
        self.clock.advance(LEASE * 2)

    @rule()
    def send_go(self) -> None:
        async def go() -> None:
            for run in await self._all():
                if run.status == "waiting" and run.wait_for == "go":
                    await self.engine.signal(run.run_id, "go", None)

        self._run(go())

    @rule(run=parents)
    def cancel_parent(self, run: UUID) -> None:
        self._run(self.engine.cancel(run, reason="chosen"))

    @rule(choice=st.integers(min_value=0, max_value=50))
    def cancel_any(self, choice: int) -> None:
        async def go() -> None:
            runs = await self._all()
            if runs:
                await self.engine.cancel(runs[choice % len(runs)].run_id, reason="chosen")

        self._run(go())

    @rule(choice=st.integers(min_value=0, max_value=50))
    def cancel_held_child(self, choice: int) -> None:
        """A child of a map held back by its max_concurrency gives up its turn: the others
        still run, the limit still holds, and the parent still wakes once."""

        async def go() -> None:
            held = [run for run in await self._all() if _held(run)]
            if held:
                event("a held child canceled")
                chosen = held[choice % len(held)].run_id
                assert await self.engine.cancel(chosen, reason="chosen") == "canceled"

        self._run(go())

    @rule(choice=st.integers(min_value=0, max_value=50))
    def cancel_parent_while_children_are_held(self, choice: int) -> None:
        """A map's parent canceled while some of its children wait for their turn: the held
        ones end canceled with the others (or, abandoned, run on and finish)."""

        async def go() -> None:
            runs = await self._all()
            holding = sorted({run.parent_run_id for run in runs if _held(run)}, key=str)
            if holding:
                event("a parent canceled while its children were held")
                parent_id = holding[choice % len(holding)]
                assert parent_id is not None
                await self.engine.cancel(parent_id, reason="chosen")

        self._run(go())

    @invariant()
    def families_hold(self) -> None:
        self._run(self._check())

    async def _check(self) -> None:
        runs = {run.run_id: run for run in await self._all()}
        per_step: Counter[tuple[UUID, str | None]] = Counter(
            (run.parent_run_id, run.idempotency_key)
            for run in runs.values()
            if run.parent_run_id is not None
        )
        twice = [key for key, count in per_step.items() if count > 1]
        assert not twice, f"a parent step started two children: {twice}"
        now = self.clock.now()
        self._check_groups(runs, now)
        for run in runs.values():
            if run.parent_run_id is None:
                continue
            up = runs[run.parent_run_id]
            if (
                run.status in TERMINAL_STATUSES
                and up.status == "waiting"
                and up.wait_for == f"umt.child:{run.run_id}"
            ):
                assert up.available_at is not None, "parent parked on a finished child"
                assert up.available_at <= now, "parent parked on a finished child"
            if up.status in ("failed", "canceled") and run.status not in TERMINAL_STATUSES:
                cancels_with_it = (
                    up.task_name == "sm.kid" or '"close":"abandon"' not in up.input_json
                )
                if cancels_with_it:
                    assert run.cancel_requested_at is not None, (
                        f"orphan: {run.run_id} runs on after its parent {up.status}"
                    )

    def _check_groups(self, runs: dict[UUID, Any], now: datetime) -> None:
        for up in runs.values():
            if up.task_name != "sm.parent":
                continue
            family = json.loads(up.input_json)
            if family.get("mode", "each") == "each":
                continue
            children = [r for r in runs.values() if r.parent_run_id == up.run_id]
            unfinished = [r for r in children if r.status not in TERMINAL_STATUSES]
            if up.status == "waiting" and up.wait_for == "umt.group all":
                if unfinished:
                    assert up.available_at is None, (
                        "woken before its last child finished: woken once per child?"
                    )
                else:
                    assert up.available_at is not None, "parent parked on a finished group"
                    assert up.available_at <= now, "parent parked on a finished group"
                    event("a group's parent woken")
            if family.get("mode") != "map":
                continue
            held = [r for r in unfinished if _held(r)]
            active = len(unfinished) - len(held)
            limit = family.get("limit")
            if limit is None:
                assert not held, "a map without max_concurrency held a child back"
                continue
            assert active <= limit, f"{active} children of a map limited to {limit} at once"
            if held:
                assert active == limit, "a held child was left behind with a free slot"
                event("a map's child held back")

    def teardown(self) -> None:
        try:
            self._run(self._drain_and_check())
        finally:
            self.loop.run_until_complete(self.engine.close())
            self.loop.close()

    async def _drain_and_check(self) -> None:
        """Every run ends once it is driven (facts sent), and each completed parent's output
        says what its children did, in its input's order."""
        for run in await self._all():
            if run.status not in TERMINAL_STATUSES:
                await drive(self.engine, run.run_id, facts={"go": True}, lease=LEASE)
        runs = await self._all()
        assert all(run.status in TERMINAL_STATUSES for run in runs), "a run never ended"
        event(f"crashes: {min(self.crashes, 3)}")
        cascaded = [r for r in runs if (r.cancel_reason or "").startswith("parent ")]
        event(f"children canceled with their parent: {min(len(cascaded), 2)}")
        for run in runs:
            if run.task_name != "sm.parent" or run.status != "completed":
                continue
            family = json.loads(run.input_json)
            children = {c.idempotency_key: c for c in runs if c.parent_run_id == run.run_id}
            expected = []
            for i, k in enumerate(family["kids"]):
                if family.get("mode") == "map":
                    child = children[f"umt.map:{run.run_id}:all:{i}"]
                else:
                    child = children[f"umt.child:{run.run_id}:start-{k['tag']}"]
                if child.status == "completed":
                    expected.append(k["tag"])
                else:
                    expected.append(child.status)
            assert json.loads(run.output_json or "null") == expected


TestChildrenStateMachine = ChildrenMachine.TestCase
TestChildrenStateMachine.settings = settings(deadline=None, stateful_step_count=40)
