"""Transactional steps (`ctx.step.transaction`): the body's writes on the engine's own store
and the step's record commit together, once; a failed body rolls both back and the step is
retried by its policy; a replay never runs the body again; a stale execution's writes never
land. A backend that cannot honour it (no `TransactionStore`) refuses the step with
`UsageError` and stores nothing of it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    Compensate,
    Engine,
    RetryPolicy,
    RunCompensatedError,
    RunFailedError,
    TaskContext,
    TaskDefinition,
    step,
    task,
)
from umt_sdk._spi import Lease, StepRecord, TransactionStore
from umt_sdk.backend import RateLimitStore
from umt_sdk.exceptions import FencingError
from umt_sdk.testing._contract._base import (
    Job,
    Tally,
    current_tally,
    eventually,
    holds,
    wait_until,
)
from umt_sdk.testing._helpers import BackendHarness, freeze_heartbeats

__all__ = ["TransactionsContract"]

_QUICK = RetryPolicy(max_attempts=3, initial=timedelta(milliseconds=100), backoff=1.0)


@task("contract.tx_step", version=1, retry=_QUICK)
async def tx_task(ctx: TaskContext[Job]) -> str:
    """Books `key` in a transactional step: the row's value names the attempt's token. `n`
    first attempts of the body raise after their write; with `n == -1` the step then waits
    for the fact `key` (a replay follows)."""
    tally = current_tally()
    key = ctx.input.key

    async def book(tx: Any, token: int) -> str:
        tally.body_runs[(key, "book")] += 1
        runs = tally.body_runs[(key, "book")]
        value = f"booked-{token}"
        await tally.harness.business_insert(tx, key, value)
        gate = tally.gates.get(f"{key}:body{runs}")
        if gate is not None:  # held inside the transaction, its row written, not committed
            await gate.wait()
        if runs <= ctx.input.n:
            raise ConnectionError(f"body {runs} failed after its write")
        return value

    booked: str = await ctx.step.transaction("book", book, ctx.attempt_token)
    if ctx.input.n == -1:
        await ctx.step.wait_for_fact(key)
    return booked


@step("contract.tx_unbook", transactional=True)
async def unbook(tx: Any, booked: str) -> None:
    """A transactional compensation: books the undo of `booked` (`<key>@<token>`) as the row
    `<key>:undone`. Its first run raises after its write: the write must roll back (else the
    retry's insert would hit the key's uniqueness)."""
    tally = current_tally()
    key = booked.split("@")[0]
    tally.body_runs[(key, "unbook")] += 1
    await tally.harness.business_insert(tx, f"{key}:undone", booked)
    if tally.body_runs[(key, "unbook")] == 1:
        raise ConnectionError("unbook failed after its write")


@step("contract.tx_plain")
async def plain_step(value: str) -> str:
    current_tally().body_runs[(value, "plain")] += 1
    return value


@task("contract.tx_saga", version=1, retry=_QUICK)
async def tx_saga_task(ctx: TaskContext[Job]) -> str:
    """Two transactional steps with compensations (a plain one, a transactional one), then
    `Compensate`."""
    tally = current_tally()
    key = ctx.input.key

    async def hold(tx: Any, token: int) -> str:
        tally.body_runs[(key, "hold")] += 1
        await tally.harness.business_insert(tx, f"{key}:hold", f"held-{token}")
        return f"held-{token}"

    async def book(tx: Any, token: int) -> str:
        tally.body_runs[(key, "book")] += 1
        await tally.harness.business_insert(tx, key, f"{key}@{token}")
        return f"{key}@{token}"

    def unhold(held: str) -> None:
        tally.body_runs[(key, "unhold")] += 1
        tally.business.setdefault(key, []).append(f"unhold {held}")

    await ctx.step.transaction("hold", hold, ctx.attempt_token, compensate=unhold)
    await ctx.step.transaction("book", book, ctx.attempt_token, compensate=unbook)
    raise Compensate("the shipment failed")


TX_LIMIT = "contract.rl.tx"
"""Stored by the test that runs `tx_limited_task`."""


@task("contract.tx_limited", version=1)
async def tx_limited_task(ctx: TaskContext[Job]) -> str:
    """A transactional step that takes a token of its tenant's bucket (the key's prefix)."""
    tally = current_tally()
    key = ctx.input.key

    async def book(tx: Any) -> str:
        tally.body_runs[(key, "book")] += 1
        await tally.harness.business_insert(tx, key, "booked")
        return key

    booked: str = await ctx.step.transaction(
        "book", book, rate_limit=TX_LIMIT, rate_limit_key=key.split(":")[0]
    )
    return booked


@task("contract.tx_wrong_kind", version=1, retry=_QUICK)
async def tx_wrong_kind_task(ctx: TaskContext[Job]) -> None:
    """`n == 0`: a transactional step given to `ctx.step.run`; `n == 1`: a plain step given
    to `ctx.step.transaction`."""
    if ctx.input.n == 0:
        await ctx.step.run("book", unbook, f"{ctx.input.key}@0")
    else:
        await ctx.step.transaction("book", plain_step, ctx.input.key)


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    tx_task,
    tx_saga_task,
    tx_limited_task,
    tx_wrong_kind_task,
)
"""The tasks of this topic that the suite's engine registers."""


def _supports(engine: Engine) -> bool:
    return isinstance(engine.backend, TransactionStore)


async def _step_statuses(engine: Engine, run_id: Any) -> list[tuple[str, int, str]]:
    info = await engine.get(run_id)
    return [(s.name, s.attempt, s.status) for s in info.timeline]


class TransactionsContract:
    """What a transactional step writes lands with its record, exactly once."""

    async def test_a_transactional_step_commits_its_writes_with_its_record(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        handle = await engine.enqueue(tx_task, Job(key="tx1"))
        async with engine.worker(lease=harness.lease):
            if not _supports(engine):
                with pytest.raises(RunFailedError) as failed:
                    await handle.result(timeout=15)
                assert failed.value.error_type.endswith("UsageError")
                assert "TransactionStore" in failed.value.error_message
                assert tally.body_runs[("tx1", "book")] == 0
                assert (await engine.get(handle.run_id)).timeline == ()
                assert await harness.business_rows() == {}, "nothing stored"
                return
            booked = await handle.result(timeout=15)
        info = await engine.get(handle.run_id)
        token = info.executions[-1].fencing_token
        assert booked == f"booked-{token}"
        assert await harness.business_rows() == {"tx1": booked}
        assert [(s.name, s.status, s.fencing_token) for s in info.timeline] == [
            ("book", "completed", token)
        ]
        assert tally.body_runs[("tx1", "book")] == 1

    async def test_a_failing_body_rolls_its_writes_back_and_retries_by_policy(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        if not _supports(engine):
            return  # the refusal: test_a_transactional_step_commits_its_writes_with_its_record
        handle = await engine.enqueue(tx_task, Job(key="tx2", n=2))  # two bodies fail
        async with engine.worker(lease=harness.lease):
            booked = await handle.result(timeout=15)
        # Each failed body inserted the same key: had one landed, the next would have hit the
        # key's uniqueness instead of booking it.
        assert await harness.business_rows() == {"tx2": booked}
        assert tally.body_runs[("tx2", "book")] == 3
        assert await _step_statuses(engine, handle.run_id) == [
            ("book", 1, "retrying"),
            ("book", 2, "retrying"),
            ("book", 3, "completed"),
        ]

    async def test_a_body_that_fails_its_last_attempt_stores_nothing_but_the_failure(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        if not _supports(engine):
            return
        handle = await engine.enqueue(tx_task, Job(key="tx3", n=5))  # every body fails
        async with engine.worker(lease=harness.lease):
            with pytest.raises(RunFailedError) as failed:
                await handle.result(timeout=15)
        assert failed.value.error_type.endswith("StepFailedError")
        assert "ConnectionError: body 3 failed" in failed.value.error_message
        assert await harness.business_rows() == {}
        assert tally.body_runs[("tx3", "book")] == 3
        statuses = await _step_statuses(engine, handle.run_id)
        assert statuses[-1] == ("book", 3, "failed")

    async def test_a_replay_returns_the_recorded_value_without_running_the_body(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        if not _supports(engine):
            return
        handle = await engine.enqueue(tx_task, Job(key="tx4", n=-1))
        async with engine.worker(lease=harness.lease):
            await eventually(lambda: holds(tally.body_runs[("tx4", "book")] == 1))
            info = await engine.get(handle.run_id)
            while info.status != "waiting":  # parked on the fact after the step
                await harness.advance(timedelta(milliseconds=10))
                info = await engine.get(handle.run_id)
            await engine.signal(handle.run_id, "tx4", {"go": True})
            booked = await handle.result(timeout=15)
        info = await engine.get(handle.run_id)
        first = info.executions[0].fencing_token
        assert len(info.executions) == 2, "the fact's wake-up replayed the step"
        assert booked == f"booked-{first}", "the recorded value, not a new body's"
        assert tally.body_runs[("tx4", "book")] == 1
        assert await harness.business_rows() == {"tx4": booked}

    async def test_a_stale_execution_writes_nothing_and_the_fresh_one_books_once(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        if not _supports(engine):
            return
        tally.gate("tx5:body1")  # the first body holds its transaction open, its row written
        handle = await engine.enqueue(tx_task, Job(key="tx5"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await eventually(lambda: holds(tally.body_runs[("tx5", "book")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        async with engine.worker(concurrency=1, lease=harness.lease):
            # The takeover runs the step again while the stale transaction is still open
            # (on Postgres its insert waits for the stale row's transaction to end).
            await eventually(lambda: holds(tally.body_runs[("tx5", "book")] == 2))
            tally.gates["tx5:body1"].set()  # the stale body returns: its commit is fenced
            booked = await handle.result(timeout=20)
            await eventually(lambda: holds(not stale.running_runs))
        await stale.stop()
        info = await engine.get(handle.run_id)
        stale_token, fresh_token = (e.fencing_token for e in info.executions)
        assert booked == f"booked-{fresh_token}"
        assert await harness.business_rows() == {"tx5": booked}, "the stale write never landed"
        assert [e.outcome for e in info.executions] == ["interrupted", "completed"]
        assert [(s.name, s.status, s.fencing_token) for s in info.timeline] == [
            ("book", "interrupted", stale_token),
            ("book", "completed", fresh_token),
        ]
        await _assert_stale_refused(engine, harness, handle.run_id, stale_token)

    async def test_a_step_whose_run_is_taken_over_during_its_body_is_fenced_at_the_commit(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        if not _supports(engine):
            return
        tally.gate("tx6:body1")
        handle = await engine.enqueue(tx_task, Job(key="tx6"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await eventually(lambda: holds(tally.body_runs[("tx6", "book")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        # Its lease lapsed: the cancel ends the run at once, so no fresh body runs and the
        # stale one's commit meets a run it no longer holds.
        outcome = await engine.cancel(handle.run_id, reason="operator")
        assert outcome == "canceled"
        tally.gates["tx6:body1"].set()
        await eventually(lambda: holds(not stale.running_runs))
        await stale.stop()
        info = await engine.get(handle.run_id)
        assert info.status == "canceled"
        assert await harness.business_rows() == {}, "the stale body's write rolled back"
        assert not any(s.status == "completed" for s in info.timeline)

    async def test_compensations_of_transactional_steps_undo_what_committed_once(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        if not _supports(engine):
            return
        handle = await engine.enqueue(tx_saga_task, Job(key="tx7"))
        async with engine.worker(lease=harness.lease):
            with pytest.raises(RunCompensatedError):
                await handle.result(timeout=15)
        info = await engine.get(handle.run_id)
        token = info.executions[0].fencing_token
        assert info.status == "compensated"
        # The transactional compensation's first run raised after its write: rolled back,
        # retried, its undo landed once (a second insert of the key would have failed).
        assert await harness.business_rows() == {
            "tx7:hold": f"held-{token}",
            "tx7": f"tx7@{token}",
            "tx7:undone": f"tx7@{token}",
        }
        assert tally.body_runs[("tx7", "unbook")] == 2
        assert tally.business["tx7"] == [f"unhold held-{token}"], "the plain one, once"
        assert [
            (s.name, s.status) for s in info.timeline if s.name.startswith("umt.compensate:")
        ] == [
            ("umt.compensate:book", "retrying"),
            ("umt.compensate:book", "completed"),
            ("umt.compensate:hold", "completed"),
        ], "newest first, each a durable step"

    async def test_a_transactional_step_takes_its_rate_limit_token_before_its_transaction(
        self, engine: Engine, tally: Tally, harness: BackendHarness
    ) -> None:
        if not _supports(engine) or not isinstance(engine.backend, RateLimitStore):
            return
        await engine.rate_limits.set(TX_LIMIT, limit=1, per=timedelta(minutes=10))
        runs = {
            (await engine.enqueue(tx_limited_task, Job(key=key))).run_id: key
            for key in ("t:0", "t:1")
        }
        async with engine.worker(concurrency=4, lease=harness.lease):

            async def one_each() -> bool:
                found = {(await engine.get(run_id)).status for run_id in runs}
                return found == {"completed", "waiting"}

            await eventually(one_each)
            (parked,) = [r for r in runs if (await engine.get(r)).status == "waiting"]
            done = next(r for r in runs if r != parked)
            info = await engine.get(parked)
            assert info.timeline == (), "no token: its transaction never began"
            assert tally.body_runs[(runs[parked], "book")] == 0
            assert await harness.business_rows() == {runs[done]: "booked"}
            await engine.rate_limits.set(TX_LIMIT, limit=2, per=timedelta(minutes=10))
            await wait_until(engine, parked, lambda i: i.status == "completed", timeout=30)
        assert await harness.business_rows() == {"t:0": "booked", "t:1": "booked"}
        assert [tally.body_runs[(key, "book")] for key in ("t:0", "t:1")] == [1, 1]

    @pytest.mark.parametrize(
        ("n", "says"),
        [
            (0, "run it with ctx.step.transaction('book', unbook, ...)"),
            (1, "run it with ctx.step.run('book', plain_step, ...)"),
        ],
    )
    async def test_a_step_run_the_other_way_than_declared_is_refused(
        self, engine: Engine, tally: Tally, harness: BackendHarness, n: int, says: str
    ) -> None:
        key = f"tx8-{n}"
        handle = await engine.enqueue(tx_wrong_kind_task, Job(key=key, n=n))
        async with engine.worker(lease=harness.lease):
            with pytest.raises(RunFailedError) as failed:
                await handle.result(timeout=15)
        assert failed.value.error_type.endswith("UsageError")
        assert says in failed.value.error_message
        assert "'contract.tx_" in failed.value.error_message, "names the declared step"
        info = await engine.get(handle.run_id)
        assert info.timeline == (), "refused before anything of the step is stored"
        assert len(info.executions) == 1, "not retried"
        assert tally.body_runs[(key, "unbook")] == tally.body_runs[(key, "plain")] == 0
        assert await harness.business_rows() == {}


async def _assert_stale_refused(
    engine: Engine, harness: BackendHarness, run_id: Any, stale_token: int
) -> None:
    """The store itself refuses a stale lease before the body runs (fence first)."""
    store = engine.backend
    assert isinstance(store, TransactionStore)
    lease = Lease(
        run_id=run_id, fencing_token=stale_token, worker_id="stale", duration=harness.lease
    )
    called: list[Any] = []

    async def body(tx: Any) -> StepRecord:
        called.append(tx)
        return StepRecord(name="late", kind="step", status="completed", output_json='"x"')

    with pytest.raises(FencingError):
        await store.run_step_transaction(lease, body)
    assert called == [], "fence first: a stale attempt's body never runs"
