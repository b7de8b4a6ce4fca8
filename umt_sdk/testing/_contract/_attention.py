"""Outcomes an operator must settle: a step declared `uncertain_on` whose attempt fails that
way parks its run in `needs_attention` (never retried, never failed, no lease held); `settle`
as done records the given output and the run goes on without running the step again, as not
done runs the step again; the settlement is in the run's history with who settled it; a
settle that does not fit the run is refused and stores nothing; a cancel ends such a run."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any
from uuid import UUID

import attrs
import pytest

from umt_sdk import (
    Concurrency,
    Engine,
    RetryPolicy,
    RunInfo,
    SyncTaskContext,
    TaskContext,
    TaskDefinition,
    step,
    task,
)
from umt_sdk.exceptions import TaskDefinitionError, UsageError
from umt_sdk.testing._contract._base import Job, Tally, current_tally, wait_until, waiter_task

__all__ = ["AttentionContract"]

_FAST_RETRIES = RetryPolicy(max_attempts=5, initial=timedelta(milliseconds=10), backoff=1.0)


@attrs.frozen
class Receipt:
    """What the payment gateway answers."""

    ref: str
    cents: int


async def charge(key: str, cents: int) -> Receipt:
    """A gateway call whose first `fail` calls (the tally's `<key>.fail`, default 1) time out,
    and whose `<key>.error` calls before that raise `ValueError` (a plain failure)."""
    tally = current_tally()
    tally.body_runs[(key, "charge")] += 1
    calls = tally.body_runs[(key, "charge")]
    errors = tally.business.get(f"{key}.error", 0)
    if calls <= errors:
        raise ValueError("the gateway refused the request")
    if calls <= errors + tally.business.get(f"{key}.fail", 1):
        raise TimeoutError("the gateway did not answer in time")
    return Receipt(ref=f"{key}-{calls}", cents=cents)


def mail(key: str) -> str:
    current_tally().body_runs[(key, "mail")] += 1
    return "sent"


@task("contract.attention", version=1, retry=_FAST_RETRIES)
async def attention_task(ctx: TaskContext[Job]) -> str:
    receipt = await ctx.step.run(
        "charge", charge, ctx.input.key, ctx.input.n, uncertain_on=(TimeoutError,)
    )
    await ctx.step.run("mail", mail, ctx.input.key)
    return f"{receipt.ref}:{receipt.cents}"


def _one_tenant(job: Job) -> str:
    return "tenant"


@task(
    "contract.attention_keyed",
    version=1,
    retry=_FAST_RETRIES,
    concurrency=Concurrency(key=_one_tenant, limit=1),
)
async def attention_keyed_task(ctx: TaskContext[Job]) -> str:
    """`attention_task` with one slot for all its runs (waiting runs give theirs back)."""
    result: str = await attention_task.fn(ctx)
    return result


@step("charge", uncertain_on=TimeoutError, retry=_FAST_RETRIES)
async def charge_step(key: str, cents: int) -> Receipt:
    return await charge(key, cents)


@task("contract.attention_decorated", version=1)
async def attention_decorated_task(ctx: TaskContext[Job]) -> str:
    receipt = await charge_step(ctx.input.key, ctx.input.n)
    return f"{receipt.ref}:{receipt.cents}"


def sync_charge(key: str, cents: int) -> Receipt:
    return asyncio.run(charge(key, cents))


@task("contract.attention_plain", version=1)
def attention_plain_task(ctx: SyncTaskContext[Job]) -> int:
    receipt = ctx.step.run(
        "charge", sync_charge, ctx.input.key, ctx.input.n, uncertain_on=(TimeoutError,)
    )
    return receipt.cents


@task("contract.attention_misuse", version=1, retry=_FAST_RETRIES)
async def attention_misuse_task(ctx: TaskContext[Job]) -> str:
    current_tally().body_runs[(ctx.input.key, "handler")] += 1
    await ctx.step.run("charge", charge, ctx.input.key, 1, uncertain_on=5)  # type: ignore[call-overload]  # under test
    return "not reached"


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    attention_task,
    attention_keyed_task,
    attention_decorated_task,
    attention_plain_task,
    attention_misuse_task,
)
"""The tasks of this topic that the suite's engine registers."""


def _parked(info: RunInfo) -> bool:
    return info.needs_attention is not None


def _entries(info: RunInfo, name: str) -> list[Any]:
    return [entry for entry in info.timeline if entry.name == name]


async def _park(engine: Engine, task_def: Any, key: str, cents: int = 500) -> RunInfo:
    """Enqueue a run of `task_def`, let a worker take it until it needs attention, then stop
    the worker: the parked run holds nothing of it."""
    handle = await engine.enqueue(task_def, Job(key=key, n=cents))
    async with engine.worker():
        return await wait_until(engine, handle.run_id, _parked, what="needs_attention")


class AttentionContract:
    """`uncertain_on`, `needs_attention` and `engine.settle`."""

    async def test_an_uncertain_failure_parks_the_run_needing_attention(
        self, engine: Engine, tally: Tally
    ) -> None:
        info = await _park(engine, attention_task, "park")
        assert info.needs_attention == "charge"
        assert info.display_status == "needs_attention"
        assert info.status == "waiting"
        assert info.available_at is None  # no timer: only a settlement or a cancel moves it
        assert info.lease_expires_at is None
        [charge_entry] = _entries(info, "charge")
        assert charge_entry.status == "waiting"
        assert charge_entry.attempt == 1
        assert charge_entry.error is not None
        assert charge_entry.error.type == "TimeoutError"
        # Neither retried (the policy had 4 attempts left) nor failed.
        assert tally.body_runs[("park", "charge")] == 1
        assert tally.body_runs[("park", "mail")] == 0
        assert info.failures == 0
        # Listed as needing attention, apart from the runs waiting for a fact or a sleep.
        other = await engine.enqueue(waiter_task, Job(key="park.fact"))
        async with engine.worker():
            await wait_until(engine, other.run_id, lambda i: i.status == "waiting")
        page = await engine.list(needs_attention=True)
        assert [(r.run_id, r.needs_attention) for r in page] == [(info.run_id, "charge")]
        assert {r.run_id for r in await engine.list(status="waiting")} == {
            info.run_id,
            other.run_id,
        }
        assert [r.run_id for r in await engine.list(needs_attention=True, task_name="x")] == []
        tagged = await engine.list(needs_attention=True, tags={"tenant": "t1"})
        assert [r.run_id for r in tagged] == []

    async def test_settled_done_records_the_output_and_goes_on_without_the_step(
        self, engine: Engine, tally: Tally
    ) -> None:
        parked = await _park(engine, attention_task, "done", cents=700)
        settlement = await engine.settle(
            parked.run_id,
            step="charge",
            done=True,
            output={"ref": "bank-77", "cents": 700},
            by="alice",
        )
        assert (settlement.step_name, settlement.done, settlement.by) == ("charge", True, "alice")
        async with engine.worker():
            result = await engine.result(parked.run_id, timeout=15)
        assert result == "bank-77:700"
        assert tally.body_runs[("done", "charge")] == 1  # never ran again
        assert tally.body_runs[("done", "mail")] == 1
        info = await engine.get(parked.run_id)
        [charge_entry] = _entries(info, "charge")
        assert charge_entry.status == "completed"
        assert json.loads(charge_entry.output_json or "null") == {"ref": "bank-77", "cents": 700}
        [settled] = _entries(info, "umt.attention:1:charge")
        assert settled.kind == "fact"
        body = json.loads(settled.output_json or "null")["umt_settled"]
        assert (body["as"], body["by"], body["step"], body["attempt"]) == (
            "done",
            "alice",
            "charge",
            1,
        )

    async def test_settled_not_done_runs_the_step_again(self, engine: Engine, tally: Tally) -> None:
        parked = await _park(engine, attention_task, "again", cents=300)
        settlement = await engine.settle(parked.run_id, step="charge", done=False, by="bob")
        assert not settlement.done
        assert settlement.output_json is None
        async with engine.worker():
            result = await engine.result(parked.run_id, timeout=15)
        assert result == "again-2:300"
        assert tally.body_runs[("again", "charge")] == 2
        info = await engine.get(parked.run_id)
        assert [(e.attempt, e.status) for e in _entries(info, "charge")] == [
            (1, "retrying"),
            (2, "completed"),
        ]
        [settled] = _entries(info, "umt.attention:1:charge")
        body = json.loads(settled.output_json or "null")["umt_settled"]
        assert (body["as"], body["by"], body["output"]) == ("not-done", "bob", None)

    async def test_an_attempt_after_not_done_can_need_attention_again(
        self, engine: Engine, tally: Tally
    ) -> None:
        tally.business["twice.fail"] = 2
        parked = await _park(engine, attention_task, "twice")
        await engine.settle(parked.run_id, step="charge", done=False)
        async with engine.worker():
            info = await wait_until(
                engine,
                parked.run_id,
                lambda i: i.waiting_for == "umt.attention:2:charge",
                what="the second attempt parked",
            )
        assert info.needs_attention == "charge"
        assert tally.body_runs[("twice", "charge")] == 2
        await engine.settle(
            parked.run_id, step="charge", done=True, output={"ref": "x", "cents": 1}
        )
        async with engine.worker():
            assert await engine.result(parked.run_id, timeout=15) == "x:1"
        assert tally.body_runs[("twice", "charge")] == 2

    async def test_other_failures_retry_as_usual(self, engine: Engine, tally: Tally) -> None:
        tally.business["plain.error"] = 2
        tally.business["plain.fail"] = 0
        handle = await engine.enqueue(attention_task, Job(key="plain", n=5))
        async with engine.worker():
            assert await handle.result(timeout=15) == "plain-3:5"
        info = await engine.get(handle.run_id)
        assert info.needs_attention is None
        assert [e.status for e in _entries(info, "charge")] == ["retrying", "retrying", "completed"]

    async def test_decorated_and_plain_steps(self, engine: Engine, tally: Tally) -> None:
        decorated = await _park(engine, attention_decorated_task, "deco", cents=9)
        plain = await _park(engine, attention_plain_task, "plain", cents=11)
        await engine.settle(decorated.run_id, step="charge", done=False)
        await engine.settle(
            plain.run_id, step="charge", done=True, output={"ref": "p", "cents": 12}
        )
        async with engine.worker():
            assert await engine.result(decorated.run_id, timeout=15) == "deco-2:9"
            assert await engine.result(plain.run_id, timeout=15) == 12
        assert tally.body_runs[("deco", "charge")] == 2
        assert tally.body_runs[("plain", "charge")] == 1

    async def test_a_settle_that_does_not_fit_is_refused_and_stores_nothing(
        self, engine: Engine, tally: Tally
    ) -> None:
        parked = await _park(engine, attention_task, "bad")
        run_id = parked.run_id
        with pytest.raises(UsageError, match="waits for step 'charge' to be settled, not 'mail'"):
            await engine.settle(run_id, step="mail", done=True, output={"ref": "a", "cents": 1})
        with pytest.raises(UsageError, match=r"does not decode into the step's output type"):
            await engine.settle(run_id, step="charge", done=True, output={"ref": "a"})
        with pytest.raises(UsageError, match=r"does not decode into the step's output type"):
            await engine.settle(run_id, step="charge", done=True, output="bank-1")
        with pytest.raises(UsageError, match="only with done=True"):
            await engine.settle(run_id, step="charge", done=False, output={"ref": "a", "cents": 1})
        with pytest.raises(UsageError, match="done must be"):
            await engine.settle(run_id, step="charge", done="yes")  # type: ignore[arg-type]  # under test
        with pytest.raises(UsageError, match="by must be"):
            await engine.settle(run_id, step="charge", done=False, by="")
        with pytest.raises(UsageError, match="needs a run id"):
            await engine.settle(str(run_id), step="charge", done=False)  # type: ignore[arg-type]  # under test
        with pytest.raises(UsageError, match="reserved"):
            await engine.signal(run_id, "umt.attention:1:charge", {"as": "done"})
        with pytest.raises(UsageError, match="reserved"):
            await engine.broadcast("umt.attention:1:charge")
        # Nothing stored: no settlement, the run still needs attention.
        assert not await engine.backend.get_facts(run_id=run_id, name="umt.attention:1:charge")
        info = await engine.get(run_id)
        assert info.needs_attention == "charge"
        assert _entries(info, "umt.attention:1:charge") == []
        # A run that is not in needs_attention: a completed one, an unknown one.
        done = await engine.enqueue(attention_task, Job(key="fine", n=1))
        tally.business["fine.fail"] = 0
        async with engine.worker():
            await done.result(timeout=15)
        with pytest.raises(UsageError, match="is completed, not needs_attention"):
            await engine.settle(done.run_id, step="charge", done=False)
        with pytest.raises(UsageError, match="there is no run"):
            await engine.settle(UUID(int=1), step="charge", done=False)
        # Then the right settle works.
        await engine.settle(run_id, step="charge", done=True, output={"ref": "ok", "cents": 2})
        async with engine.worker():
            assert await engine.result(run_id, timeout=15) == "ok:2"

    async def test_a_step_is_settled_once(self, engine: Engine, tally: Tally) -> None:
        parked = await _park(engine, attention_task, "race")
        outcomes = await asyncio.gather(
            *(
                engine.settle(
                    parked.run_id,
                    step="charge",
                    done=True,
                    output={"ref": f"by-{i}", "cents": i},
                    by=f"op-{i}",
                )
                for i in range(4)
            ),
            return_exceptions=True,
        )
        winners = [o for o in outcomes if not isinstance(o, BaseException)]
        assert len(winners) == 1, outcomes
        assert all(isinstance(o, UsageError) for o in outcomes if o not in winners), outcomes
        with pytest.raises(UsageError, match="already settled"):
            await engine.settle(parked.run_id, step="charge", done=False)
        async with engine.worker():
            result = await engine.result(parked.run_id, timeout=15)
        assert result == f"by-{winners[0].by[3:]}:{winners[0].by[3:]}"

    async def test_a_run_needing_attention_gives_its_concurrency_slot_back(
        self, engine: Engine, tally: Tally
    ) -> None:
        parked = await _park(engine, attention_keyed_task, "slot")
        tally.business["slot2.fail"] = 0
        second = await engine.enqueue(attention_keyed_task, Job(key="slot2", n=3))
        async with engine.worker():
            assert await second.result(timeout=15) == "slot2-1:3"  # the key's one slot was free
        assert (await engine.get(parked.run_id)).needs_attention == "charge"
        await engine.settle(parked.run_id, step="charge", done=False)
        async with engine.worker():
            assert await engine.result(parked.run_id, timeout=15) == "slot-2:500"

    async def test_a_run_needing_attention_can_be_canceled(
        self, engine: Engine, tally: Tally
    ) -> None:
        parked = await _park(engine, attention_task, "cancel")
        assert await engine.cancel(parked.run_id, reason="refunded by hand") == "canceled"
        info = await engine.get(parked.run_id)
        assert info.status == "canceled"
        assert info.needs_attention is None
        with pytest.raises(UsageError, match="is canceled, not needs_attention"):
            await engine.settle(parked.run_id, step="charge", done=False)
        assert tally.body_runs[("cancel", "charge")] == 1

    async def test_a_wrong_uncertain_on_fails_the_run(self, engine: Engine, tally: Tally) -> None:
        handle = await engine.enqueue(attention_misuse_task, Job(key="misuse"))
        async with engine.worker():
            info = await wait_until(engine, handle.run_id, lambda i: i.status == "failed")
        assert info.error is not None
        assert "uncertain_on must be an exception class" in info.error.message
        assert tally.body_runs[("misuse", "handler")] == 1  # a UsageError is never retried
        with pytest.raises(TaskDefinitionError, match="uncertain_on must be"):
            step("x", uncertain_on=(TimeoutError, "nope"))  # type: ignore[arg-type]  # under test
