"""Rate limits: a bucket never gives more tokens than its rule allows, across claims; a run
with no token is parked until its bucket's next token and starts then; a paused limit holds
runs unharmed; a changed limit holds at once; each key is its own bucket.

The tests drive the backend through the SPI, as the worker does, so what a claim may take is
exact, not timed. A backend that stores rate limits implements
`umt_sdk.backend.RateLimitStore`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest

from umt_sdk import (
    Engine,
    RateLimit,
    RunFailedError,
    TaskContext,
    TaskDefinition,
    UsageError,
    task,
)
from umt_sdk.backend import (
    Backend,
    Ending,
    Lease,
    NewRun,
    RateLimitStore,
    TaskPair,
    TokenRequest,
    new_run_id,
)
from umt_sdk.exceptions import TaskDefinitionError
from umt_sdk.testing._contract._base import Job, Tally, current_tally, eventually, wait_until
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["RateLimitsContract"]

PAIR = TaskPair(name="contract.limited_spi", version=1)
"""No worker serves it: every claim of it in these tests is the test's own."""
LONG = timedelta(seconds=60)
WORKER = "contract-limits"
DONE = Ending(status="completed", outcome="completed", output_json="null")

LIMITED = RateLimit[Job](
    "contract.rl.task", limit=2, per=timedelta(minutes=10), key=lambda job: job.key.split(":")[0]
)


@task("contract.rate_limited", version=1, rate_limit=LIMITED)
async def limited_task(ctx: TaskContext[Job]) -> str:
    return ctx.input.key


STEP_LIMIT = "contract.rl.steps"
"""Stored by each test that runs `limited_step_task` (an unknown name fails the run)."""


@task("contract.rate_limited_step", version=1)
async def limited_step_task(ctx: TaskContext[Job]) -> str:
    """One step that takes a token of the tenant's bucket (the key's prefix) and counts its
    body's runs."""
    tally = current_tally()

    def call() -> str:
        tally.body_runs[(ctx.input.key, "call")] += 1
        return ctx.input.key

    return await ctx.step.run(
        "call", call, rate_limit=STEP_LIMIT, rate_limit_key=ctx.input.key.split(":")[0]
    )


@task("contract.rate_limited_step_unknown", version=1)
async def unknown_limit_task(ctx: TaskContext[Job]) -> str:
    return await ctx.step.run("call", lambda: "never", rate_limit="contract.rl.never-stored")


@task("contract.rate_limited_map", version=1)
async def limited_map_task(ctx: TaskContext[Job]) -> list[str]:
    """Maps three children of `limited_task` (tenant `ctx.input.key`), two at a time."""
    inputs = [Job(key=f"{ctx.input.key}:{i}") for i in range(3)]
    outcomes: list[str] = await ctx.step.map("fan", limited_task, inputs, max_concurrency=2)
    return outcomes


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    limited_task,
    limited_step_task,
    unknown_limit_task,
    limited_map_task,
)
"""The tasks of this topic that the suite's engine registers."""


def _store(engine: Engine) -> RateLimitStore:
    backend = engine.backend
    if not isinstance(backend, RateLimitStore):
        pytest.fail(f"{type(backend).__name__} does not implement RateLimitStore")
    return backend


async def _enqueue(
    backend: Backend,
    limit: str | None,
    key: str = "",
    *,
    priority: int = 0,
    deadline: timedelta | None = None,
) -> UUID:
    run_id = new_run_id()
    result = await backend.enqueue(
        NewRun(
            run_id=run_id,
            task_name=PAIR.name,
            task_version=PAIR.version,
            input_json="null",
            input_hash="contract-limits",
            priority=priority,
            rate_limit=limit,
            rate_limit_key=key,
            timeout=deadline,
        )
    )
    assert result.created
    return run_id


async def _claim(backend: Backend, limit: int = 50) -> dict[UUID, Lease]:
    claimed = await backend.claim(worker_id=WORKER, pairs=[PAIR], limit=limit, lease=LONG)
    return {
        c.run_id: Lease(
            run_id=c.run_id, fencing_token=c.fencing_token, worker_id=WORKER, duration=LONG
        )
        for c in claimed
    }


class RateLimitsContract:
    """Named token buckets, in the claim and for steps (mixed into `BackendContract`, whose
    `engine` and `harness` fixtures it uses)."""

    async def test_workers_start_runs_only_with_a_token_of_their_key(self, engine: Engine) -> None:
        handles = [await engine.enqueue(limited_task, Job(key=f"a:{i}")) for i in range(3)]
        other = await engine.enqueue(limited_task, Job(key="b:0"))
        stored = await engine.rate_limits.get("contract.rl.task")
        assert stored is not None
        assert (stored.limit, stored.per) == (2, timedelta(minutes=10)), "stored at enqueue"
        async with engine.worker(concurrency=8):
            for handle in (*handles[:2], other):
                await _completed(engine, handle.run_id)
            late = await engine.get(handles[2].run_id)
            assert late.status == "pending", "tenant a has no token left"
            assert (late.rate_limit, late.rate_limit_key) == ("contract.rl.task", "a")
            await engine.rate_limits.set("contract.rl.task", limit=3, per=timedelta(minutes=10))
            await _completed(engine, handles[2].run_id)

    async def test_a_maps_children_take_tokens_held_ones_too(self, engine: Engine) -> None:
        await engine.rate_limits.set(LIMITED)
        parent = await engine.enqueue(limited_map_task, Job(key="m"))
        async with engine.worker(concurrency=8):

            async def two_done_one_parked() -> bool:
                # The third was held by max_concurrency, let run when one finished, and
                # parked by the claim for want of a token: never started, still waiting.
                children = (await engine.list(parent=parent.run_id)).runs
                done = [c for c in children if c.status == "completed"]
                held = [c for c in children if c.status == "waiting" and c.attempts == 0]
                return len(done) == 2 and len(held) == 1 and held[0].available_at is not None

            await eventually(two_done_one_parked, timeout=30)
            assert (await engine.get(parent.run_id)).status == "waiting"
            await engine.rate_limits.set("contract.rl.task", limit=3, per=timedelta(minutes=10))
            await _completed(engine, parent.run_id)
        info = await engine.get(parent.run_id)
        assert info.output_json is not None
        assert json.loads(info.output_json) == ["m:0", "m:1", "m:2"]

    async def test_a_step_waits_parked_for_a_token_and_a_change_wakes_it(
        self, engine: Engine, tally: Tally
    ) -> None:
        await engine.rate_limits.set(STEP_LIMIT, limit=1, per=timedelta(minutes=10))
        first = await engine.enqueue(limited_step_task, Job(key="a:0"))
        second = await engine.enqueue(limited_step_task, Job(key="a:1"))
        other = await engine.enqueue(limited_step_task, Job(key="b:0"))
        async with engine.worker(concurrency=8):
            # Polled, not awaited with result(): a FakeClock that jumps to the next timer while
            # a result is awaited would give the parked step its token.
            await _completed(engine, other.run_id)  # another key, another bucket
            done = {first.run_id: "a:0", second.run_id: "a:1"}
            await eventually(
                lambda: _statuses(engine, list(done), {"completed", "waiting"}),
            )
            waiting = [run_id for run_id in done if (await engine.get(run_id)).status == "waiting"]
            assert len(waiting) == 1, "one token of bucket a: the other step waits, parked"
            (parked,) = waiting
            info = await engine.get(parked)
            assert [s.name for s in info.timeline] == [], "its step has not run"
            assert info.available_at is not None
            # Two per ten minutes now: the token taken still counts, one more is free.
            await engine.rate_limits.set(STEP_LIMIT, limit=2, per=timedelta(minutes=10))
            await wait_until(engine, parked, lambda i: i.status == "completed", timeout=30)
        for key in ("a:0", "a:1", "b:0"):
            assert tally.body_runs[(key, "call")] == 1

    async def test_a_paused_limit_parks_the_step_until_resumed(
        self, engine: Engine, tally: Tally
    ) -> None:
        await engine.rate_limits.set(STEP_LIMIT, limit=5, per=timedelta(minutes=10))
        assert await engine.rate_limits.pause(STEP_LIMIT)
        handle = await engine.enqueue(limited_step_task, Job(key="p:0"))
        async with engine.worker(concurrency=2):
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting", timeout=30)
            assert tally.body_runs[("p:0", "call")] == 0
            assert await engine.rate_limits.resume(STEP_LIMIT)
            await _completed(engine, handle.run_id)
        assert tally.body_runs[("p:0", "call")] == 1

    async def test_a_token_taken_before_a_crash_is_not_taken_again(
        self, engine: Engine, harness: BackendHarness, tally: Tally
    ) -> None:
        store = _store(engine)
        await engine.rate_limits.set(STEP_LIMIT, limit=1, per=timedelta(minutes=10))
        crashed = await engine.enqueue(limited_step_task, Job(key="c:0"))
        # A worker claims it and takes the step's token, then vanishes (its lease lapses).
        pair = [TaskPair(name="contract.rate_limited_step", version=1)]
        (claim,) = await engine.backend.claim(
            worker_id="gone", pairs=pair, limit=1, lease=harness.lease
        )
        lease = Lease(
            run_id=claim.run_id,
            fencing_token=claim.fencing_token,
            worker_id="gone",
            duration=harness.lease,
        )
        request = TokenRequest(limit=STEP_LIMIT, key="c", step="call", attempt=1)
        assert (await store.take_rate_token(lease, request)).status == "granted"
        await harness.advance(harness.lease * 2)
        later = await engine.enqueue(limited_step_task, Job(key="c:1"))
        async with engine.worker(concurrency=4):
            # Taken over: the step's attempt has its token and runs; the bucket's one token
            # is spent, so the other run of the key waits.
            await _completed(engine, crashed.run_id)
            await wait_until(engine, later.run_id, lambda i: i.status == "waiting", timeout=30)
        assert tally.body_runs[("c:0", "call")] == 1
        assert tally.body_runs[("c:1", "call")] == 0

    async def test_an_unknown_limit_in_a_step_fails_the_run_saying_how_to_fix_it(
        self, engine: Engine
    ) -> None:
        handle = await engine.enqueue(unknown_limit_task, Job(key="u"))
        async with engine.worker(concurrency=2):
            with pytest.raises(RunFailedError) as failed:
                await handle.result(timeout=30)
        info = await engine.get(handle.run_id)
        assert info.error is not None
        assert info.error.type.endswith("UsageError")
        assert "contract.rl.never-stored" in info.error.message
        assert "rate_limits.set" in info.error.message
        assert failed.value is not None

    async def test_a_limit_is_stored_once_and_changed_only_by_set(self, engine: Engine) -> None:
        store = _store(engine)
        first = await store.define_rate_limit("contract.rl.store", limit=5, per=LONG)
        assert (first.name, first.limit, first.per, first.paused) == (
            "contract.rl.store",
            5,
            LONG,
            False,
        )
        again = await store.define_rate_limit("contract.rl.store", limit=9, per=LONG * 2)
        assert (again.limit, again.per) == (5, LONG), "first write wins"
        changed = await engine.rate_limits.set("contract.rl.store", limit=9, per=LONG * 2)
        assert (changed.limit, changed.per) == (9, LONG * 2)
        got = await engine.rate_limits.get("contract.rl.store")
        assert got is not None
        assert (got.limit, got.per) == (9, LONG * 2)
        assert "contract.rl.store" in [i.name for i in await engine.rate_limits.list()]
        assert await engine.rate_limits.get("contract.rl.none") is None

    async def test_a_claim_starts_no_more_runs_than_the_bucket_has_tokens(
        self, engine: Engine
    ) -> None:
        backend = engine.backend
        await _store(engine).define_rate_limit("contract.rl.claim", limit=3, per=LONG)
        limited = [await _enqueue(backend, "contract.rl.claim") for _ in range(5)]
        plain = await _enqueue(backend, None)
        leases = await _claim(backend)
        assert set(leases) == {*limited[:3], plain}, "FIFO, up to the bucket's tokens"
        for run_id in limited[3:]:
            head = await backend.get_run_head(run_id)
            assert head is not None
            assert head.status == "pending"
            assert head.claims == 0
            assert head.rate_limit == "contract.rl.claim"
            assert head.rate_limit_key == ""
            assert head.available_at is not None
            assert head.observed_at is not None
            assert head.available_at > head.observed_at, "parked until its token is due"
        for _ in range(3):
            assert await _claim(backend) == {}, "no token: nothing more starts"
        # A run without a limit is never held up by a bucket with no token.
        other = await _enqueue(backend, None)
        assert set(await _claim(backend)) == {other}

    async def test_concurrent_claims_share_the_bucket(self, engine: Engine) -> None:
        backend = engine.backend
        await _store(engine).define_rate_limit("contract.rl.race", limit=4, per=LONG)
        runs = [await _enqueue(backend, "contract.rl.race") for _ in range(12)]
        taken: set[UUID] = set()
        for _ in range(3):
            batches = await asyncio.gather(*(_claim(backend, limit=3) for _ in range(4)))
            for batch in batches:
                assert not taken & set(batch)
                taken |= set(batch)
        assert len(taken) == 4, f"the bucket gave {len(taken)} tokens, its limit is 4"
        assert taken <= set(runs)

    async def test_parked_runs_start_when_their_tokens_come_due(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        backend = engine.backend
        per = harness.lease
        await _store(engine).define_rate_limit("contract.rl.due", limit=1, per=per)
        runs = [await _enqueue(backend, "contract.rl.due") for _ in range(3)]
        started: list[Any] = []

        async def claim_into() -> bool:
            claimed = await backend.claim(worker_id=WORKER, pairs=[PAIR], limit=10, lease=LONG)
            assert len(claimed) <= 1, "one token per interval"
            started.extend(claimed)
            return bool(claimed)

        assert await claim_into()
        assert not await claim_into()
        await harness.advance(per)
        await eventually(claim_into)
        await harness.advance(per)
        await eventually(claim_into)
        assert [c.run_id for c in started] == runs, "in order, one per token"
        for earlier, later in itertools.pairwise(started):
            assert later.claimed_at - earlier.claimed_at >= per, "never two in one interval"

    async def test_parked_runs_keep_their_order_and_a_newcomer_waits_behind_them(
        self, engine: Engine
    ) -> None:
        backend = engine.backend
        await _store(engine).define_rate_limit("contract.rl.order", limit=1, per=LONG)
        runs = [await _enqueue(backend, "contract.rl.order") for _ in range(3)]
        assert set(await _claim(backend)) == {runs[0]}
        newcomer = await _enqueue(backend, "contract.rl.order")
        assert await _claim(backend) == {}
        slots = []
        for run_id in (*runs[1:], newcomer):
            head = await backend.get_run_head(run_id)
            assert head is not None
            assert head.available_at is not None
            slots.append(head.available_at)
        assert slots == sorted(slots), "each waits for its own token, in order"
        assert len(set(slots)) == len(slots), "never two parked for the same token"
        assert slots[1] - slots[0] >= LONG, "one token per interval"

    async def test_a_paused_limit_holds_runs_unharmed_until_resumed(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        backend = engine.backend
        await _store(engine).define_rate_limit("contract.rl.pause", limit=10, per=LONG)
        assert await engine.rate_limits.pause("contract.rl.pause")
        assert not await engine.rate_limits.pause("contract.rl.pause"), "paused already"
        info = await engine.rate_limits.get("contract.rl.pause")
        assert info is not None
        assert info.paused
        runs = [await _enqueue(backend, "contract.rl.pause") for _ in range(2)]
        assert await _claim(backend) == {}
        await harness.advance(harness.lease)
        assert await _claim(backend) == {}
        for run_id in runs:
            head = await backend.get_run_head(run_id)
            assert head is not None
            assert head.status == "pending"
            assert head.claims == 0
            assert head.error is None
            assert head.failures == 0
        assert await engine.rate_limits.resume("contract.rl.pause")
        assert not await engine.rate_limits.resume("contract.rl.pause"), "not paused"
        assert set(await _claim(backend)) == set(runs), "claimable at once after the resume"

    async def test_a_changed_limit_takes_effect_at_once(self, engine: Engine) -> None:
        backend = engine.backend
        await _store(engine).define_rate_limit("contract.rl.change", limit=1, per=LONG)
        runs = [await _enqueue(backend, "contract.rl.change") for _ in range(5)]
        assert set(await _claim(backend)) == {runs[0]}
        assert await _claim(backend) == {}
        # Three per window now: the one taken still counts, two more are free at once.
        await engine.rate_limits.set("contract.rl.change", limit=3, per=LONG)
        assert set(await _claim(backend)) == set(runs[1:3])
        assert await _claim(backend) == {}
        # Lowered: the tokens taken stay taken; nothing more for a long while.
        await engine.rate_limits.set("contract.rl.change", limit=1, per=LONG)
        assert await _claim(backend) == {}

    async def test_each_key_is_its_own_bucket(self, engine: Engine) -> None:
        backend = engine.backend
        await _store(engine).define_rate_limit("contract.rl.keys", limit=1, per=LONG)
        a1 = await _enqueue(backend, "contract.rl.keys", "a")
        a2 = await _enqueue(backend, "contract.rl.keys", "a")
        b1 = await _enqueue(backend, "contract.rl.keys", "b")
        none = await _enqueue(backend, "contract.rl.keys")
        assert set(await _claim(backend)) == {a1, b1, none}
        assert await _claim(backend) == {}
        head = await backend.get_run_head(a2)
        assert head is not None
        assert head.status == "pending"
        assert head.rate_limit_key == "a"

    async def test_a_run_past_its_deadline_or_canceled_needs_no_token(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        backend = engine.backend
        await _store(engine).define_rate_limit("contract.rl.exempt", limit=1, per=LONG * 10)
        first = await _enqueue(backend, "contract.rl.exempt")
        doomed = await _enqueue(backend, "contract.rl.exempt", deadline=harness.lease)
        asked = await _enqueue(backend, "contract.rl.exempt")
        leases = await _claim(backend)
        assert set(leases) == {first}
        head = await backend.get_run_head(doomed)
        assert head is not None
        assert head.available_at is not None
        assert head.deadline_at is not None
        assert head.available_at <= head.deadline_at, "parked no later than its deadline"
        await harness.advance(harness.lease * 2)
        got: dict[UUID, Lease] = {}

        async def claim_into() -> bool:
            got.update(await _claim(backend))
            return doomed in got

        await eventually(claim_into)
        assert asked not in got
        assert await backend.cancel(asked, reason="not needed") == "canceled"

    async def test_steps_take_tokens_once_per_attempt(self, engine: Engine) -> None:
        backend = engine.backend
        store = _store(engine)
        await store.define_rate_limit("contract.rl.step", limit=2, per=LONG)
        holder = await _enqueue(backend, None)
        (lease,) = (await _claim(backend)).values()

        def ask(step: str, attempt: int = 1, limit: str = "contract.rl.step") -> TokenRequest:
            return TokenRequest(limit=limit, key="", step=step, attempt=attempt)

        assert (await store.take_rate_token(lease, ask("a"))).status == "granted"
        assert (await store.take_rate_token(lease, ask("a"))).status == "granted", "once"
        assert (await store.take_rate_token(lease, ask("b"))).status == "granted"
        waited = await store.take_rate_token(lease, ask("c"))
        assert waited.status == "wait"
        assert waited.next_at is not None
        assert waited.next_at > waited.observed_at
        assert (await store.take_rate_token(lease, ask("a"))).status == "granted", (
            "an attempt that has its token keeps it"
        )
        assert (await store.take_rate_token(lease, ask("a", 2))).status == "wait"
        assert (await store.take_rate_token(lease, ask("x", limit="contract.rl.nope"))).status == (
            "unknown"
        )
        assert await engine.rate_limits.pause("contract.rl.step")
        assert (await store.take_rate_token(lease, ask("d"))).status == "paused"
        assert await backend.end_execution(lease, DONE) == "ended"
        from umt_sdk.exceptions import FencingError

        with pytest.raises(FencingError):
            await store.take_rate_token(lease, ask("e"))
        assert holder

    async def test_bad_limits_are_refused_with_what_to_do(self, engine: Engine) -> None:
        for kwargs, argument in (
            ({"limit": 0, "per": LONG}, "limit"),
            ({"limit": -1, "per": LONG}, "limit"),
            ({"limit": 5, "per": timedelta(0)}, "per"),
            ({"limit": 5, "per": -LONG}, "per"),
            ({"limit": 5, "per": 60}, "per"),
        ):
            with pytest.raises(UsageError) as refused:
                RateLimit("contract.ok", **kwargs)
            assert refused.value.argument == argument
        for name in ("", "has space", "a" * 101, "semi;colon", 7):
            with pytest.raises(UsageError) as refused:
                RateLimit(name, limit=1, per=LONG)  # type: ignore[arg-type]
            assert refused.value.argument == "name"
            assert "letters, digits" in str(refused.value)
        with pytest.raises(UsageError):
            await engine.rate_limits.set("contract.rl.bad", limit=0, per=LONG)
        with pytest.raises(UsageError):
            await engine.rate_limits.pause("contract.rl.never-stored")
        from umt_sdk import task

        with pytest.raises(TaskDefinitionError):
            task("contract.rl.bad_task", rate_limit="openai")  # type: ignore[arg-type]


async def _statuses(engine: Engine, run_ids: Sequence[UUID], wanted: set[str]) -> bool:
    """Whether every run's status is one of `wanted`, and not all the same (one of each)."""
    found = [(await engine.get(run_id)).status for run_id in run_ids]
    return set(found) == wanted


async def _completed(engine: Engine, run_id: UUID) -> None:
    """Poll until the run completed (`result()` would let a FakeClock jump ahead)."""
    await wait_until(engine, run_id, lambda i: i.status == "completed", timeout=30)
