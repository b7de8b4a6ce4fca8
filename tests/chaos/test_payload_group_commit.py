"""Poison payloads in a group commit: one run's bad value never fails or charges its neighbours.

Two walls. The SDK refuses a value Postgres cannot store where it is produced (a PayloadError
for that step only), on every backend. Behind it, the Postgres backend's group commit writes
the members of a failed batch one by one, so that a value that gets past the SDK still fails
only its own writer; that wall is tested by calling `record_step` directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from umt_sdk import Engine, Registry, RetryPolicy, RunFailedError, TaskContext, connect, task
from umt_sdk.backend import ErrorInfo, Lease, StepRecord, TaskPair
from umt_sdk.exceptions import BackendError
from umt_sdk.testing import FakeClock

RUNS = 20
BAD_INDEX = 7


@attrs.frozen
class Item:
    index: int
    bad: str = ""


_ARRIVED: list[int] = []
_ALL_ARRIVED: list[asyncio.Event] = []


async def _together() -> None:
    """Hold each step body until all runs' bodies are in, so their checkpoints share a batch."""
    _ARRIVED.append(1)
    if len(_ARRIVED) >= RUNS:
        _ALL_ARRIVED[0].set()
    with contextlib.suppress(TimeoutError):  # a slow claim: go on, the assertions still hold
        await asyncio.wait_for(_ALL_ARRIVED[0].wait(), timeout=10)


@task(
    "chaos.payload_batch",
    version=1,
    retry=RetryPolicy(max_attempts=3, initial=timedelta(milliseconds=100), backoff=1.0),
)
async def payload_batch(ctx: TaskContext[Item]) -> str:
    async def produce() -> Any:
        await _together()
        if ctx.input.bad == "nul":
            return {"text": "x\x00y"}
        if ctx.input.bad == "surrogate":
            return {"text": "x\ud800y"}
        if ctx.input.bad == "raise":
            raise ValueError("bad \x00 message \ud800")
        return {"text": f"ok-{ctx.input.index}"}

    once = RetryPolicy.none() if ctx.input.bad == "raise" else None
    value = await ctx.step.run("produce", produce, retry=once)
    await ctx.step.run("after", lambda: None)
    return str(value["text"])


@pytest.fixture(params=["memory", "pg"])
async def engine(
    request: pytest.FixtureRequest, pg_url: str, pg_schema: str
) -> AsyncIterator[Engine]:
    _ARRIVED.clear()
    _ALL_ARRIVED[:] = [asyncio.Event()]
    registry = Registry([payload_batch])
    if request.param == "memory":
        engine = await connect("memory://", registry=registry, clock=FakeClock(auto_advance=True))
    else:
        engine = await connect(
            pg_url, registry=registry, schema=pg_schema, run_migrations=False, max_size=8
        )
    async with engine:
        yield engine


@pytest.mark.parametrize("bad", ["nul", "surrogate", "raise"])
async def test_one_bad_step_output_fails_only_its_own_run(engine: Engine, bad: str) -> None:
    handles = [
        await engine.enqueue(payload_batch, Item(index=i, bad=bad if i == BAD_INDEX else ""))
        for i in range(RUNS)
    ]
    async with engine.worker(concurrency=RUNS, lease=timedelta(seconds=5)):
        for i, handle in enumerate(handles):
            if i == BAD_INDEX:
                with pytest.raises(RunFailedError) as caught:
                    await handle.result(timeout=60)
            else:
                assert await handle.result(timeout=60) == f"ok-{i}"
    infos = await engine.wait_idle([h.run_id for h in handles])
    charged = {
        i: (info.status, info.failures, info.error)
        for i, info in enumerate(infos)
        if i != BAD_INDEX and (info.status != "completed" or info.failures or info.attempts != 1)
    }
    assert charged == {}, f"innocent runs failed or were charged: {charged}"
    assert caught.value.error_type.endswith("StepFailedError")
    poisoned = infos[BAD_INDEX]
    assert (poisoned.status, poisoned.failures, poisoned.attempts) == ("failed", 1, 1)
    (record,) = poisoned.timeline
    assert (record.name, record.status, record.attempt) == ("produce", "failed", 1)
    assert record.error is not None
    if bad == "raise":  # our own text: stored escaped, the step failed as any other
        assert record.error.type == "ValueError"
        assert record.error.message == "bad \\x00 message \\ud800"
    else:
        assert record.error.type == "umt_sdk.PayloadError"
        assert "output of step 'produce'.text" in record.error.message


# -- the second wall: Postgres's group commit, behind the SDK ------------------------------------


BAD_RECORDS: dict[str, dict[str, Any]] = {
    "nul escape": {"output_json": '{"text":"x\\u0000y"}'},
    "lone surrogate escape": {"output_json": '{"text":"x\\ud800y"}'},
    "lone surrogate": {"output_json": '{"text":"x\ud800y"}'},
    "nul in an error": {
        "status": "failed",
        "error": ErrorInfo(type="ValueError", message="bad \x00 message", traceback=""),
    },
}


@pytest.mark.parametrize("bad", sorted(BAD_RECORDS))
async def test_a_failed_batch_charges_only_its_offending_member(
    pg_url: str, pg_schema: str, bad: str
) -> None:
    engine = await connect(
        pg_url, registry=Registry([payload_batch]), schema=pg_schema, run_migrations=False
    )
    async with engine:
        for i in range(RUNS):
            await engine.enqueue(payload_batch, Item(index=i))
        backend = engine.backend
        lease = timedelta(seconds=60)
        claimed = await backend.claim(
            worker_id="w",
            pairs=[TaskPair(name="chaos.payload_batch", version=1)],
            limit=RUNS,
            lease=lease,
        )
        assert len(claimed) == RUNS
        now = datetime.now(UTC)

        def record(index: int) -> StepRecord:
            fields: dict[str, Any] = {"status": "completed", "output_json": f'"ok-{index}"'}
            if index == BAD_INDEX:
                fields.update(BAD_RECORDS[bad])
            return StepRecord(
                name="produce",
                kind="step",
                attempt=1,
                fencing_token=claimed[index].fencing_token,
                started_at=now,
                finished_at=now,
                **fields,
            )

        # All at once: the first write starts the flush, the 19 others queue behind it and
        # share the next statement with the bad one.
        results = await asyncio.gather(
            *(
                backend.record_step(
                    Lease(
                        run_id=c.run_id,
                        fencing_token=c.fencing_token,
                        worker_id="w",
                        duration=lease,
                    ),
                    record(i),
                )
                for i, c in enumerate(claimed)
            ),
            return_exceptions=True,
        )
    failed = {i: r for i, r in enumerate(results) if r is not None}
    assert list(failed) == [BAD_INDEX], f"writers that got an error: {failed}"
    assert isinstance(failed[BAD_INDEX], BackendError), repr(failed[BAD_INDEX])
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        cur = await conn.execute(
            sql.SQL("SELECT run_id, output FROM {}.steps").format(sql.Identifier(pg_schema))
        )
        stored = dict(await cur.fetchall())
        cur = await conn.execute(
            sql.SQL(
                "SELECT count(*) FROM {}.runs WHERE status = 'running' AND failures = 0"
            ).format(sql.Identifier(pg_schema))
        )
        row = await cur.fetchone()
    expected = {c.run_id: f"ok-{i}" for i, c in enumerate(claimed) if i != BAD_INDEX}
    assert stored == expected, "every innocent checkpoint is stored, the bad one is not"
    assert row is not None
    assert row[0] == RUNS, "no run was failed or charged"
