"""The crash explorer: it finds the workflow bugs a crash exposes, names each where it happens,
gives a reproducer, and passes the same workflows written correctly."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from attrs import frozen

from umt_backend_memory import MemoryStore
from umt_sdk import (
    AttemptInfo,
    RetryPolicy,
    StepFailedError,
    SyncTaskContext,
    TaskContext,
    UsageError,
    task,
    with_attempt_token,
)
from umt_sdk.testing import CrashPoint, explore_crashes


@frozen
class Order:
    id: str
    cents: int


class Bank:
    """The outside world of the tests: payments made, and a business table for fenced
    commits. Compares by value, as the explorer's default snapshot needs."""

    def __init__(self) -> None:
        self.payments: list[str] = []
        self.charges: dict[str, str] = {}
        self.failures_left = 0
        self.store = MemoryStore()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Bank)
            and self.payments == other.payments
            and self.charges == other.charges
            and self.store.rows("receipts") == other.store.rows("receipts")
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Bank:
        copied = Bank()
        copied.payments = list(self.payments)
        copied.charges = dict(self.charges)
        for key, value in self.store.rows("receipts").items():
            copied.store.put("receipts", key, value)
        return copied


BANK = Bank()


def fresh_bank() -> Bank:
    global BANK
    BANK = Bank()
    return BANK


def one_payment(bank: Bank) -> None:
    assert len(bank.payments) == 1, f"{len(bank.payments)} payments for o-1"


def plain_step(value: int) -> int:
    return value


async def _preparation(ctx: TaskContext[Order]) -> None:
    for i in range(4):
        await ctx.step.run(f"prep{i}", plain_step, i)


async def _wrap_up(ctx: TaskContext[Order]) -> None:
    for i in range(4):
        await ctx.step.run(f"post{i}", plain_step, i)


@task("charge_outside_fence")
async def charge_outside_fence(ctx: TaskContext[Order]) -> str:
    await _preparation(ctx)

    async def charge() -> str:
        BANK.payments.append(ctx.input.id)
        return "receipt-1"

    receipt = await ctx.step.run("charge", charge)
    await _wrap_up(ctx)
    return receipt


async def _fenced_charge(order: Order, *, reconcile: bool, op_key: str) -> str:
    async def act(info: AttemptInfo) -> str:
        if reconcile and info.resumed and order.id in BANK.payments:
            return "receipt-1"  # the earlier attempt charged: look it up, do not charge again
        BANK.payments.append(order.id)
        return "receipt-1"

    async def commit(tx: Any, receipt: str) -> None:
        tx.put("receipts", order.id, receipt)

    return await with_attempt_token(BANK.store, op_key, act, commit=commit)


@task("charge_fenced")
async def charge_fenced(ctx: TaskContext[Order]) -> str:
    await _preparation(ctx)
    receipt = await ctx.step.run(
        "charge", _fenced_charge, ctx.input, reconcile=True, op_key=f"charge:{ctx.input.id}"
    )
    await _wrap_up(ctx)
    return receipt


@task("charge_fenced_no_reconcile")
async def charge_fenced_no_reconcile(ctx: TaskContext[Order]) -> str:
    await _preparation(ctx)
    receipt = await ctx.step.run(
        "charge", _fenced_charge, ctx.input, reconcile=False, op_key=f"charge:{ctx.input.id}"
    )
    await _wrap_up(ctx)
    return receipt


@task("charge_key_per_attempt")
async def charge_key_per_attempt(ctx: TaskContext[Order]) -> str:
    # A bug users write: the op key changes with every attempt, so nothing fences it.
    key = f"charge:{ctx.input.id}:{ctx.attempt_token}"
    return await ctx.step.run("charge", _fenced_charge, ctx.input, reconcile=True, op_key=key)


async def test_a_charge_outside_with_attempt_token_is_caught_where_it_happens() -> None:
    report = await explore_crashes(
        charge_outside_fence, Order("o-1", 42), setup=fresh_bank, invariant=one_payment
    )
    assert not report.ok
    [failure] = report.failures
    assert [c.id for c in failure.crashes] == ["after:charge"]
    assert failure.step_starts["charge"] == 2
    assert failure.step_starts["prep0"] == 1
    text = report.explain()
    assert "crash after step 'charge' returned, before its record was stored" in text
    assert "step 'charge' ran twice and changed the state twice" in text
    assert "invariant failed: 2 payments for o-1" in text
    assert "reproduce: explore_crashes(..., only='after:charge')" in text

    again = await explore_crashes(
        charge_outside_fence,
        Order("o-1", 42),
        setup=fresh_bank,
        invariant=one_payment,
        only="after:charge",
    )
    assert [e.crashes for e in again.explorations] == [failure.crashes]
    assert again.failures[0].problems == failure.problems


async def test_the_same_charge_behind_with_attempt_token_passes_every_point() -> None:
    report = await explore_crashes(
        charge_fenced, Order("o-1", 42), setup=fresh_bank, invariant=one_payment
    )
    assert report.ok, report.explain()
    ids = [p.id for p in report.points]
    op = "charge:o-1"
    assert ids == [
        *(f"{where}:prep{i}" for i in range(4) for where in ("before", "after")),
        "before:charge",
        f"begin:{op}",
        f"action:{op}",
        f"acted:{op}",
        f"commit:{op}",
        f"committed:{op}",
        "after:charge",
        *(f"{where}:post{i}" for i in range(4) for where in ("before", "after")),
        "end:completed",
    ]
    assert [e.crashes[0].id for e in report.explorations] == ids
    assert "every one ended as the crash-free run did" in report.explain()
    # A crash between the action and its commit makes the body run again, once.
    acted = next(e for e in report.explorations if e.crashes[0].id == f"acted:{op}")
    assert acted.step_starts["charge"] == 2


async def test_an_action_that_does_not_reconcile_after_a_crash_is_caught() -> None:
    report = await explore_crashes(
        charge_fenced_no_reconcile, Order("o-1", 42), setup=fresh_bank, invariant=one_payment
    )
    failed = {e.crashes[0].id: e for e in report.failures}
    # The action ran, the commit did not land (or never ran): the retry charges again.
    assert set(failed) == {"acted:charge:o-1", "commit:charge:o-1"}
    text = report.explain()
    assert (
        "crash inside the commit of with_attempt_token('charge:o-1'), before its result was "
        "recorded in step 'charge'"
    ) in text
    assert "invariant failed: 2 payments for o-1" in text


async def test_an_op_key_that_changes_with_the_attempt_is_caught() -> None:
    report = await explore_crashes(
        charge_key_per_attempt, Order("o-1", 42), setup=fresh_bank, invariant=one_payment
    )
    assert not report.ok
    text = report.explain()
    assert "with_attempt_token('charge:o-1:1') committed 0 times, not exactly once" in text


@task("draw_a_number")
async def draw_a_number(ctx: TaskContext[None]) -> float:
    drawn = await ctx.step.run("draw", random.random)
    await ctx.step.run("store", plain_step, 1)
    return drawn


def _wall_clock() -> str:
    return datetime.now(UTC).isoformat()


@task("stamp_with_the_wall_clock")
async def stamp_with_the_wall_clock(ctx: TaskContext[None]) -> str:
    return await ctx.step.run("stamp", _wall_clock)


async def test_a_step_output_drawn_at_random_is_caught_across_a_crash() -> None:
    state_before = random.getstate()
    report = await explore_crashes(draw_a_number, None)
    assert random.getstate() == state_before  # the caller's random state is left as it was
    assert report.baseline.ok  # seeded alike, two runs without a crash agree
    [failure] = report.failures
    assert [c.id for c in failure.crashes] == ["after:draw"]
    text = report.explain()
    assert "the run ended differently from the crash-free run" in text
    assert "step 'draw' recorded" in text
    assert "(it ran twice)" in text
    assert "depends on the clock, randomness or outside state" in text


async def test_a_step_output_read_from_the_wall_clock_is_caught() -> None:
    report = await explore_crashes(stamp_with_the_wall_clock, None)
    assert not report.baseline.ok
    text = report.explain()
    assert "two runs without a crash ended differently" in text
    assert "step 'stamp' returned" in text
    assert "or pass check_output=False" in text
    quiet = await explore_crashes(stamp_with_the_wall_clock, None, check_output=False)
    assert quiet.ok, quiet.explain()


@task("charge_reconciling_previous_token_only")
async def charge_reconciling_previous_token_only(ctx: TaskContext[Order]) -> str:
    order = ctx.input

    async def act(info: AttemptInfo) -> str:
        if info.resumed:
            # The bug: it looks up only the attempt just before this one. After one crash
            # that is the one that charged; after two, it may be one that never did.
            earlier = BANK.charges.get(f"{info.op_key}:{info.attempt_token - 1}")
            if earlier is not None:
                return earlier
        BANK.payments.append(order.id)
        BANK.charges[f"{info.op_key}:{info.attempt_token}"] = "receipt-1"
        return "receipt-1"

    async def charge() -> str:
        return await with_attempt_token(BANK.store, f"charge:{order.id}", act)

    await ctx.step.run("prepare", plain_step, 1)
    receipt = await ctx.step.run("charge", charge)
    await ctx.step.run("notify", plain_step, 2)
    return receipt


async def test_a_bug_that_needs_two_crashes_is_found_at_depth_two_only() -> None:
    args: dict[str, Any] = {"setup": fresh_bank, "invariant": one_payment}
    order = Order("o-1", 1)
    shallow = await explore_crashes(charge_reconciling_previous_token_only, order, **args)
    assert shallow.ok, shallow.explain()
    deep = await explore_crashes(charge_reconciling_previous_token_only, order, depth=2, **args)
    schedules = [[c.id for c in e.crashes] for e in deep.failures]
    op = "charge:o-1"
    # The first crash leaves a charge behind (after the action, or inside its commit); the
    # second cuts off the recovery before it recorded the result.
    # (A point's id counts its passes over the whole run: the recovery after a crash at
    # `acted` reaches `commit` for the first time.)
    recovery = ["before:charge[2]", f"begin:{op}[2]", f"action:{op}[2]", f"acted:{op}[2]"]
    assert schedules == [
        *([f"acted:{op}", second] for second in [*recovery, f"commit:{op}"]),
        *([f"commit:{op}", second] for second in [*recovery, f"commit:{op}[2]"]),
    ]
    text = deep.explain()
    assert (
        f"crash after the action of with_attempt_token({op!r}), before its commit in step "
        f"'charge', then crash after the action of with_attempt_token({op!r}), before its "
        "commit in step 'charge':"
    ) in text
    assert "invariant failed: 2 payments for o-1" in text
    assert f"only=['acted:{op}', 'acted:{op}[2]']" in text
    # Each point of each recovery after the first crash is tried.
    assert len(deep.explorations) > 2 * len(deep.points)


@task("plain_charge")
def plain_charge(ctx: SyncTaskContext[Order]) -> str:
    def charge() -> str:
        BANK.payments.append(ctx.input.id)
        return "receipt-1"

    ctx.step.run("look-up", plain_step, 1)
    receipt = ctx.step.run("charge", charge)
    ctx.step.sleep("settle", timedelta(days=1))
    return receipt


async def test_plain_handlers_are_explored_too() -> None:
    report = await explore_crashes(
        plain_charge, Order("o-1", 42), setup=fresh_bank, invariant=one_payment
    )
    assert [c.id for e in report.failures for c in e.crashes] == ["after:charge"]
    assert "park:settle" in [p.id for p in report.points]


@task("flaky_approval", retry=RetryPolicy(max_attempts=3, initial=timedelta(minutes=1)))
async def flaky_approval(ctx: TaskContext[Order]) -> str:
    async def reserve() -> str:
        if BANK.failures_left:
            BANK.failures_left -= 1
            raise ConnectionError("inventory service unavailable")
        return "reserved"

    await ctx.step.run(
        "reserve", reserve, retry=RetryPolicy(max_attempts=3, initial=timedelta(seconds=5))
    )
    await ctx.step.sleep("cool-down", timedelta(days=2))
    approval = await ctx.step.wait_for_fact("approved", payload_type=dict)
    await ctx.step.run(
        "charge", _fenced_charge, ctx.input, reconcile=True, op_key=f"charge:{ctx.input.id}"
    )
    return f"approved by {approval['by']}"


def bank_with_one_outage() -> Bank:
    bank = fresh_bank()
    bank.failures_left = 1
    return bank


async def test_retries_sleeps_and_facts_are_explored_deterministically() -> None:
    def explore() -> Any:
        return explore_crashes(
            flaky_approval,
            Order("o-1", 42),
            setup=bank_with_one_outage,
            invariant=one_payment,
            facts={"approved": {"by": "ops"}},
        )

    report = await explore()
    assert report.ok, report.explain()
    ids = [p.id for p in report.points]
    assert ids[:4] == ["before:reserve", "park:reserve", "before:reserve[2]", "after:reserve"]
    assert "park:cool-down" in ids
    assert "park:approved" in ids
    assert report.baseline.outcome == 'completed with "approved by ops"'
    again = await explore()
    assert [p.id for p in again.points] == ids
    assert [e.problems for e in again.explorations] == [e.problems for e in report.explorations]


async def test_a_fact_nobody_sends_is_reported_not_hung_on() -> None:
    report = await explore_crashes(flaky_approval, Order("o-1", 42), setup=fresh_bank)
    assert not report.baseline.ok
    assert "pass facts={'approved': payload}" in report.explain()


class Opaque:
    """State that compares by identity, as most classes do."""

    def __init__(self) -> None:
        self.payments: list[str] = []


OPAQUE = Opaque()


@task("charge_opaque")
async def charge_opaque(ctx: TaskContext[None]) -> None:
    await ctx.step.run("charge", lambda: OPAQUE.payments.append("o-1"))


def fresh_opaque() -> Opaque:
    global OPAQUE
    OPAQUE = Opaque()
    return OPAQUE


async def test_state_that_does_not_compare_by_value_is_said_and_snapshot_fixes_it() -> None:
    blind = await explore_crashes(charge_opaque, None, setup=fresh_opaque)
    assert blind.ok
    assert "does not compare by value" in blind.explain()
    seeing = await explore_crashes(
        charge_opaque,
        None,
        setup=fresh_opaque,
        snapshot=lambda state: list(state.payments),
    )
    assert "step 'charge' ran twice and changed the state twice" in seeing.explain()


async def test_wrong_arguments_say_what_is_wrong() -> None:
    with pytest.raises(UsageError, match="depth"):
        await explore_crashes(charge_fenced, Order("o-1", 1), depth=3)
    with pytest.raises(UsageError, match="a @task definition"):
        await explore_crashes(plain_step, 1)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"names no crash point.*before:charge"):
        await explore_crashes(charge_fenced, Order("o-1", 1), setup=fresh_bank, only="after:pay")
    with pytest.raises(UsageError, match=r"integer >= 1"):
        await explore_crashes(charge_fenced, Order("o-1", 1), only="before:charge[0]")
    with pytest.raises(UsageError, match="setup"):
        await explore_crashes(charge_fenced, Order("o-1", 1), setup="bank")  # type: ignore[arg-type]


def test_crash_point_ids_name_later_passes() -> None:
    assert CrashPoint(label="before:charge").id == "before:charge"
    assert str(CrashPoint(label="before:charge", occurrence=2)) == "before:charge[2]"


async def test_a_failing_step_fails_the_same_way_after_every_crash() -> None:
    @task("always_fails", retry=RetryPolicy(max_attempts=1))
    async def always_fails(ctx: TaskContext[None]) -> None:
        def boom() -> None:
            raise ValueError("no such account")

        await ctx.step.run("boom", boom, retry=RetryPolicy(max_attempts=2))

    report = await explore_crashes(always_fails, None)
    assert report.ok, report.explain()
    assert report.baseline.outcome.startswith(f"failed with {StepFailedError.__module__}")
    assert "end:failed" in [p.id for p in report.points]
