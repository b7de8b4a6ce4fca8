"""Concurrency keys: a claim never takes more runs of a key than its free slots; the others
wait unharmed, in order within the key, without holding up other keys; every write that ends
a slot's hold frees it; the strategies drop the runs they say.

Most tests drive the backend through the SPI, as the worker does, so what a claim may take is
exact, not timed; a few run real workers end to end.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest

from umt_sdk import (
    Concurrency,
    Engine,
    RunCanceledError,
    TaskContext,
    TaskDefinition,
    UsageError,
    task,
)
from umt_sdk.backend import (
    Backend,
    ClaimedRun,
    Ending,
    Lease,
    NewRun,
    RunQuery,
    TaskPair,
    new_run_id,
)
from umt_sdk.exceptions import TaskDefinitionError
from umt_sdk.testing._contract._base import Job, Tally, current_tally, eventually, wait_until
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["ConcurrencyContract"]

PAIR = TaskPair(name="contract.keyed_spi", version=1)
"""No worker serves it: every claim of it in these tests is the test's own."""
OTHER = TaskPair(name="contract.keyed_spi", version=2)
LONG = timedelta(seconds=60)
WORKER = "contract-keys"


def _tenant(job: Job) -> str:
    return job.key.split(":")[0]


async def _gate_or_abort(ctx: TaskContext[Job], gate: asyncio.Event) -> None:
    """Wait for the gate; a cancel's abort signal ends the wait (and the step) first."""
    opened = asyncio.ensure_future(gate.wait())
    aborted = asyncio.ensure_future(ctx.abort_event.wait())
    try:
        await asyncio.wait({opened, aborted}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
    finally:
        opened.cancel()
        aborted.cancel()
    ctx.throw_if_canceled()


@task("contract.keyed", version=1, concurrency=Concurrency(key=_tenant, limit=2))
async def keyed_task(ctx: TaskContext[Job]) -> str:
    """Counts how many runs of its key are inside at once; waits on the gate of its key."""
    tally = current_tally()
    tenant = _tenant(ctx.input)
    inside: Counter[str] = tally.business.setdefault("inside", Counter())
    most: Counter[str] = tally.business.setdefault("most", Counter())

    async def body() -> None:
        inside[tenant] += 1
        most[tenant] = max(most[tenant], inside[tenant])
        try:
            gate = tally.gates.get(tenant)
            if gate is not None:
                await _gate_or_abort(ctx, gate)
            await asyncio.sleep(0.01)
        finally:
            inside[tenant] -= 1

    await ctx.step.run("body", body)
    return ctx.input.key


@task(
    "contract.keyed_latest",
    version=1,
    concurrency=Concurrency(key=_tenant, limit=1, strategy="cancel_in_progress"),
)
async def latest_task(ctx: TaskContext[Job]) -> str:
    """Waits on its own gate (its key) until released or canceled."""
    tally = current_tally()

    async def body() -> None:
        tally.gate(ctx.input.key + ":in").set()
        await _gate_or_abort(ctx, tally.gate(ctx.input.key))

    await ctx.step.run("body", body)
    return ctx.input.key


@task(
    "contract.keyed_newest",
    version=1,
    concurrency=Concurrency(key=_tenant, limit=1, strategy="keep_newest"),
)
async def newest_task(ctx: TaskContext[Job]) -> str:
    return ctx.input.key


TASKS: tuple[TaskDefinition[Any, Any], ...] = (keyed_task, latest_task, newest_task)
"""The tasks of this topic that the suite's engine registers."""


async def _enqueue(
    backend: Backend,
    key: str | None,
    *,
    limit: int = 2,
    priority: int = 0,
    delay: timedelta | None = None,
    count_waiting: bool = False,
    pair: TaskPair = PAIR,
) -> UUID:
    run_id = new_run_id()
    result = await backend.enqueue(
        NewRun(
            run_id=run_id,
            task_name=pair.name,
            task_version=pair.version,
            input_json="null",
            input_hash="contract-keys",
            priority=priority,
            delay=delay,
            concurrency_key=key,
            concurrency_limit=None if key is None else limit,
            count_waiting=count_waiting,
        )
    )
    assert result.created
    return run_id


async def _claim(
    backend: Backend,
    limit: int = 50,
    *,
    lease: timedelta = LONG,
    pairs: Sequence[TaskPair] = (PAIR,),
) -> dict[UUID, Lease]:
    claimed: Sequence[ClaimedRun] = await backend.claim(
        worker_id=WORKER, pairs=list(pairs), limit=limit, lease=lease
    )
    return {
        c.run_id: Lease(
            run_id=c.run_id, fencing_token=c.fencing_token, worker_id=WORKER, duration=lease
        )
        for c in claimed
    }


async def _claim_ids(backend: Backend, limit: int = 50) -> list[UUID]:
    claimed = await backend.claim(worker_id=WORKER, pairs=[PAIR], limit=limit, lease=LONG)
    return [c.run_id for c in claimed]


DONE = Ending(status="completed", outcome="completed", output_json="null")


class ConcurrencyContract:
    """At most `limit` runs of a key hold a slot; the rest wait their turn (mixed into
    `BackendContract`, whose `engine` and `harness` fixtures it uses)."""

    # -- the claim --------------------------------------------------------------------------

    async def test_a_claim_takes_no_more_runs_of_a_key_than_its_free_slots(
        self, engine: Engine
    ) -> None:
        backend = engine.backend
        a = [await _enqueue(backend, "a", limit=2) for _ in range(5)]
        b = [await _enqueue(backend, "b", limit=1) for _ in range(3)]
        plain = [await _enqueue(backend, None) for _ in range(2)]
        leases = await _claim(backend)
        assert set(leases) == {*a[:2], b[0], *plain}, "FIFO within each key, up to its limit"
        assert await _claim(backend) == {}, "every key is full"
        # An ending frees a slot: the key's next run, and only one.
        assert await backend.end_execution(leases[a[0]], DONE) == "ended"
        more = await _claim(backend)
        assert set(more) == {a[2]}
        assert await backend.end_execution(leases[b[0]], DONE) == "ended"
        assert await backend.end_execution(leases[a[1]], DONE) == "ended"
        assert set(await _claim(backend, limit=1)) <= {a[3], b[1]}
        assert len(await _claim(backend)) == 1, "the other freed slot"
        assert await _claim(backend) == {}

    async def test_runs_of_a_key_go_by_priority_then_fifo(self, engine: Engine) -> None:
        backend = engine.backend
        low1 = await _enqueue(backend, "k", limit=1)
        high = await _enqueue(backend, "k", limit=1, priority=5)
        low2 = await _enqueue(backend, "k", limit=1)
        order = []
        for _ in range(3):
            leases = await _claim(backend)
            assert len(leases) == 1
            (run_id,) = leases
            order.append(run_id)
            assert await backend.end_execution(leases[run_id], DONE) == "ended"
        assert order == [high, low1, low2]
        assert await _claim(backend) == {}

    async def test_a_full_key_holds_up_no_other_key_and_no_run_without_one(
        self, engine: Engine
    ) -> None:
        backend = engine.backend
        first = await _enqueue(backend, "busy", limit=1)
        backlog = [await _enqueue(backend, "busy", limit=1) for _ in range(60)]
        assert set(await _claim(backend, limit=1)) == {first}
        other = await _enqueue(backend, "quiet", limit=1)
        plain = await _enqueue(backend, None)
        # One slot at a time: the busy key's backlog is never offered ahead of the others.
        got = set(await _claim(backend, limit=1)) | set(await _claim(backend, limit=1))
        assert got == {other, plain}
        assert await _claim(backend) == {}
        for run_id in backlog[:3]:
            assert (await backend.get_run_head(run_id)).status == "pending"  # type: ignore[union-attr]

    async def test_a_claim_serves_only_its_pairs_and_counts_the_key_across_versions(
        self, engine: Engine
    ) -> None:
        backend = engine.backend
        v2 = await _enqueue(backend, "shared", limit=1, pair=OTHER)
        v1 = await _enqueue(backend, "shared", limit=1)
        assert set(await _claim(backend)) == {v1}, "a v1 worker takes no v2 run"
        assert await _claim(backend, pairs=[OTHER]) == {}, "the key (per task name) is full"
        assert (await backend.get_run_head(v2)).status == "pending"  # type: ignore[union-attr]

    async def test_every_ending_and_cancel_gives_the_slot_back(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        backend = engine.backend
        runs = [await _enqueue(backend, "k", limit=1) for _ in range(4)]
        # Handed back (a retry's backoff, a release): the slot is free, the run waits again.
        leases = await _claim(backend)
        assert set(leases) == {runs[0]}
        back = Ending(status="pending", outcome="released")
        assert await backend.end_execution(leases[runs[0]], back) == "ended"
        leases = await _claim(backend)
        assert len(leases) == 1
        assert set(leases) <= {runs[0], runs[1]}
        # Failed: free.
        (failed,) = leases
        assert (
            await backend.end_execution(leases[failed], Ending(status="failed", outcome="failed"))
            == "ended"
        )
        # A pending run canceled: its place in the queue is gone, nothing else changes.
        waiting = [r for r in runs if r != failed]
        assert await backend.cancel(waiting[0], reason="not needed") == "canceled"
        leases = await _claim(backend, lease=harness.lease)
        assert set(leases) == {waiting[1]}
        # A held run's cancel is only recorded: it keeps its slot until its holder ends it.
        assert await backend.cancel(waiting[1], reason="stop") == "requested"
        assert await _claim(backend) == {}
        # Its holder is gone: the lease lapses, the cancel ends it and frees the slot.
        await harness.advance(harness.lease * 2)
        assert await backend.cancel(waiting[1], reason="stop") == "canceled"
        assert set(await _claim(backend)) == {waiting[2]}

    async def test_a_lapsed_lease_is_taken_over_in_the_slot_it_holds(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        backend = engine.backend
        held = await _enqueue(backend, "k", limit=1)
        queued = await _enqueue(backend, "k", limit=1)
        assert set(await _claim(backend, lease=harness.lease)) == {held}
        await harness.advance(harness.lease * 2)
        taken: dict[UUID, Lease] = {}
        await eventually(lambda: _claim_into(backend, taken))
        assert set(taken) == {held}, "the takeover keeps the slot; the queue still waits"
        assert await _claim(backend) == {}
        assert await backend.end_execution(taken[held], DONE) == "ended"
        assert set(await _claim(backend)) == {queued}

    async def test_a_waiting_run_gives_its_slot_back_unless_it_counts_waiting(
        self, engine: Engine
    ) -> None:
        backend = engine.backend
        sleeper = await _enqueue(backend, "k", limit=1)
        after = await _enqueue(backend, "k", limit=1)
        leases = await _claim(backend)
        park = Ending(status="waiting", outcome="waiting", wait_for="contract-keys-fact")
        assert await backend.end_execution(leases[sleeper], park) == "ended"
        leases = await _claim(backend)
        assert set(leases) == {after}, "the parked run gave its slot back"
        # Woken while the key is full: it waits for a slot, unharmed.
        assert await backend.signal(run_id=sleeper, name="contract-keys-fact", payload_json="1")
        assert await _claim(backend) == {}
        assert (await backend.get_run_head(sleeper)).status == "waiting"  # type: ignore[union-attr]
        assert await backend.end_execution(leases[after], DONE) == "ended"
        assert set(await _claim(backend)) == {sleeper}

        holder = await _enqueue(backend, "cw", limit=1, count_waiting=True)
        blocked = await _enqueue(backend, "cw", limit=1, count_waiting=True)
        leases = await _claim(backend)
        assert set(leases) == {holder}
        park = Ending(status="waiting", outcome="waiting", wait_for="contract-keys-cw")
        assert await backend.end_execution(leases[holder], park) == "ended"
        assert await _claim(backend) == {}, "count_waiting: the parked run keeps its slot"
        assert await backend.signal(run_id=holder, name="contract-keys-cw", payload_json="1")
        leases = await _claim(backend)
        assert set(leases) == {holder}, "woken, it runs in the slot it kept"
        assert await backend.end_execution(leases[holder], DONE) == "ended"
        assert set(await _claim(backend)) == {blocked}

    async def test_a_delayed_run_waits_for_its_time_and_a_slot(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        backend = engine.backend
        later = await _enqueue(backend, "k", limit=1, delay=harness.lease)
        now = await _enqueue(backend, "k", limit=1)
        leases = await _claim(backend)
        assert set(leases) == {now}
        await harness.advance(harness.lease * 2)
        assert await _claim(backend) == {}, "due, but the key is full"
        assert await backend.end_execution(leases[now], DONE) == "ended"
        assert set(await _claim(backend)) == {later}

    async def test_runs_list_by_key_and_read_back_their_key(self, engine: Engine) -> None:
        backend = engine.backend
        keyed = await _enqueue(backend, "tenant-7", limit=3)
        await _enqueue(backend, "tenant-8", limit=3)
        await _enqueue(backend, None)
        listed = await backend.list_runs(RunQuery(task_name=PAIR.name, concurrency_key="tenant-7"))
        assert [r.run_id for r in listed] == [keyed]
        head = await backend.get_run_head(keyed)
        assert head is not None
        assert head.concurrency_key == "tenant-7"

    async def test_engine_lists_runs_by_key_and_shows_it(self, engine: Engine) -> None:
        first = await engine.enqueue(keyed_task, Job(key="lister:1"))
        await engine.enqueue(keyed_task, Job(key="other:1"))
        second = await engine.enqueue(keyed_task, Job(key="lister:2"))
        page = await engine.list(task_name=keyed_task.name, concurrency_key="lister")
        assert [r.run_id for r in page.runs] == [second.run_id, first.run_id]
        assert {r.concurrency_key for r in page.runs} == {"lister"}
        assert (await engine.get(first.run_id)).concurrency_key == "lister"
        with pytest.raises(UsageError, match="concurrency_key"):
            await engine.list(concurrency_key="")

    # -- end to end -------------------------------------------------------------------------

    async def test_workers_run_at_most_the_limit_of_a_key_and_every_run_completes(
        self, engine: Engine, tally: Tally
    ) -> None:
        handles = [
            await engine.enqueue(keyed_task, Job(key=f"{tenant}:{i}"))
            for i in range(4)
            for tenant in ("t1", "t2", "t3")
        ]
        async with engine.worker(concurrency=12):
            results = [await h.result(timeout=30) for h in handles]
        assert sorted(results) == sorted(f"{t}:{i}" for i in range(4) for t in ("t1", "t2", "t3"))
        most = tally.business["most"]
        assert set(most) == {"t1", "t2", "t3"}
        assert max(most.values()) <= 2, f"a key ran over its limit of 2: {dict(most)}"

    async def test_a_canceled_running_run_frees_its_slot_for_the_next(
        self, engine: Engine, tally: Tally
    ) -> None:
        gate = tally.gate("g")
        del gate  # the first run of key g waits on it; nobody opens it
        first = await engine.enqueue(keyed_task, Job(key="g:1"))
        second = await engine.enqueue(keyed_task, Job(key="g:2"))
        third = await engine.enqueue(keyed_task, Job(key="g:3"))
        async with engine.worker(concurrency=4):
            await wait_until(engine, first.run_id, lambda i: i.status == "running")
            await wait_until(engine, second.run_id, lambda i: i.status == "running")
            assert (await engine.get(third.run_id)).status == "pending"
            await engine.cancel(first.run_id, reason="operator")
            with pytest.raises(RunCanceledError):
                await first.result(timeout=15)
            await wait_until(engine, third.run_id, lambda i: i.status == "running")
            tally.gate("g").set()
            assert await third.result(timeout=15) == "g:3"
            assert await second.result(timeout=15) == "g:2"

    # -- strategies -------------------------------------------------------------------------

    async def test_keep_newest_cancels_the_older_queued_runs_of_the_key(
        self, engine: Engine
    ) -> None:
        old = [await engine.enqueue(newest_task, Job(key=f"n:{i}")) for i in range(3)]
        other = await engine.enqueue(newest_task, Job(key="m:0"))
        for handle in old[:2]:
            info = await engine.get(handle.run_id)
            assert info.status == "canceled"
            assert "keep_newest" in (info.cancel_reason or "")
        async with engine.worker():
            assert await old[2].result(timeout=15) == "n:2"
            assert await other.result(timeout=15) == "m:0"

    async def test_cancel_in_progress_cancels_the_running_run_of_the_key(
        self, engine: Engine, tally: Tally
    ) -> None:
        first = await engine.enqueue(latest_task, Job(key="x:1"))
        async with engine.worker(concurrency=4):
            await asyncio.wait_for(tally.gate("x:1:in").wait(), timeout=15)
            second = await engine.enqueue(latest_task, Job(key="x:2"))
            with pytest.raises(RunCanceledError) as caught:
                await first.result(timeout=15)
            assert "cancel_in_progress" in caught.value.reason
            await asyncio.wait_for(tally.gate("x:2:in").wait(), timeout=15)
            tally.gate("x:2").set()
            assert await second.result(timeout=15) == "x:2"

    # -- bad input --------------------------------------------------------------------------

    async def test_bad_concurrency_settings_and_keys_are_refused_clearly(
        self, engine: Engine
    ) -> None:
        with pytest.raises(UsageError, match="limit"):
            Concurrency(key=_tenant, limit=0)
        with pytest.raises(UsageError, match="strategy"):
            Concurrency(key=_tenant, limit=1, strategy="drop")  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="key"):
            Concurrency(key="tenant", limit=1)  # type: ignore[arg-type]
        with pytest.raises(TaskDefinitionError, match="concurrency must be"):
            task("contract.bad_keys", concurrency=2)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="non-empty str"):
            await engine.enqueue(keyed_task, Job(key=""))
        with pytest.raises(ValueError, match="go together"):
            NewRun(
                run_id=new_run_id(),
                task_name="t",
                task_version=1,
                input_json="null",
                input_hash="h",
                concurrency_key="k",
            )


async def _claim_into(backend: Backend, into: dict[UUID, Lease]) -> bool:
    into.update(await _claim(backend))
    return bool(into)
