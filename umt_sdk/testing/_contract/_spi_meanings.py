"""The SPI says what it means: what a backend decides on its own, tested at the seam.

`SpiMeaningsContract` is a topic of `BackendContract` (its `engine` and `harness` fixtures):
each test drives the backend through the SPI directly, the way the SDK does, and reads back
what the `Backend` and record docstrings promise: an ending's step is stored as `record_step`
stores a step; a cancel ends at once a run nobody holds and only records it for a held one;
`available_at` says when a run may next be claimed, and nothing while it runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from uuid import UUID

import attrs
import pytest

from umt_sdk import Engine
from umt_sdk.backend import (
    Backend,
    Beat,
    ClaimedRun,
    Ending,
    ErrorInfo,
    Lease,
    NewRun,
    RunQuery,
    RunRecord,
    StepRecord,
    TaskPair,
    new_run_id,
)
from umt_sdk.cli._render import _run_json
from umt_sdk.exceptions import FencingError, RunNotFoundError
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["SpiMeaningsContract"]

PAIR = TaskPair(name="contract.spi", version=1)
"""No worker serves it: every claim in these tests is the test's own."""
LONG = timedelta(seconds=60)
WORKER = "contract-spi"


async def _enqueue(backend: Backend, *, delay: timedelta | None = None) -> UUID:
    run_id = new_run_id()
    created = await backend.enqueue(
        NewRun(
            run_id=run_id,
            task_name=PAIR.name,
            task_version=PAIR.version,
            input_json="null",
            input_hash="contract-spi",
            delay=delay,
        )
    )
    assert created.created
    return run_id


def _lease(claimed: ClaimedRun, duration: timedelta) -> Lease:
    return Lease(
        run_id=claimed.run_id,
        fencing_token=claimed.fencing_token,
        worker_id=WORKER,
        duration=duration,
    )


async def _claim(backend: Backend, count: int, *, lease: timedelta) -> dict[UUID, Lease]:
    """Claim `count` runs that are due now (a takeover may take the claim a moment to see)."""
    claimed = await _claim_until(backend, count, lease=lease)
    return {c.run_id: _lease(c, lease) for c in claimed}


async def _claim_until(
    backend: Backend, count: int, *, lease: timedelta, timeout: float = 15.0
) -> list[ClaimedRun]:
    deadline = time.monotonic() + timeout
    claimed: list[ClaimedRun] = []
    while len(claimed) < count:
        claimed += await backend.claim(
            worker_id=WORKER, pairs=[PAIR], limit=count - len(claimed), lease=lease
        )
        if len(claimed) < count:
            assert time.monotonic() < deadline, f"claimed {len(claimed)} of {count} runs"
            await asyncio.sleep(0.05)
    return claimed


async def _read(backend: Backend, run_id: UUID) -> RunRecord:
    record = await backend.get_run(run_id)
    assert record is not None, f"run {run_id} is gone"
    return record


async def _everywhere(engine: Engine, run_id: UUID) -> Sequence[RunRecord]:
    """The run as every read of the SPI reports it: `get_run`, `get_run_head`, `list_runs`."""
    backend = engine.backend
    head = await backend.get_run_head(run_id)
    assert head is not None
    listed = [
        r for r in await backend.list_runs(RunQuery(task_name=PAIR.name)) if r.run_id == run_id
    ]
    return [await _read(backend, run_id), head, *listed]


class SpiMeaningsContract:
    """What a backend decides on its own, as the SPI docstrings say it (mixed into
    `BackendContract`, whose `engine` and `harness` fixtures it uses)."""

    # -- an ending's step ---------------------------------------------------------------------

    async def test_an_endings_step_is_stored_as_record_step_stores_a_step(
        self, engine: Engine
    ) -> None:
        backend = engine.backend
        recorded, parked, slept = [await _enqueue(backend) for _ in range(3)]
        leases = await _claim(backend, 3, lease=LONG)
        now = (await _read(backend, recorded)).observed_at
        assert now is not None
        # The token is left at 0: the backend stores every record under its lease's token.
        retrying = StepRecord(
            name="charge",
            kind="step",
            status="retrying",
            attempt=2,
            error=ErrorInfo(type="Declined", message="card declined", traceback="tb"),
            started_at=now,
            finished_at=now,
        )
        await backend.record_step(leases[recorded], attrs.evolve(retrying, error=None))
        later = now + timedelta(hours=1)
        for run_id in (recorded, parked):  # the same try again, in the ending: it replaces it
            ending = Ending(status="pending", outcome="retrying", available_at=later, step=retrying)
            assert await backend.end_execution(leases[run_id], ending) == "ended"
        sleep = StepRecord(
            name="nap", kind="sleep", status="waiting", started_at=now, wake_at=later
        )
        ending = Ending(status="waiting", outcome="waiting", available_at=later, step=sleep)
        assert await backend.end_execution(leases[slept], ending) == "ended"
        for run_id, step in ((recorded, retrying), (parked, retrying), (slept, sleep)):
            stored = (await _read(backend, run_id)).steps
            assert list(stored) == [attrs.evolve(step, fencing_token=leases[run_id].fencing_token)]
        with pytest.raises(ValueError, match="never carries output"):
            Ending(
                status="pending",
                outcome="retrying",
                step=attrs.evolve(retrying, status="completed", output_json="1"),
            )

    # -- cancel -------------------------------------------------------------------------------

    async def test_a_cancel_ends_at_once_a_run_nobody_holds_a_lapsed_lease_included(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        backend = engine.backend
        pending = await _enqueue(backend, delay=timedelta(hours=1))
        waiting, lapsed = await _enqueue(backend), await _enqueue(backend)
        leases = await _claim(backend, 2, lease=harness.lease)
        park = Ending(status="waiting", outcome="waiting", wait_for="never-sent")
        assert await backend.end_execution(leases[waiting], park) == "ended"
        await harness.advance(harness.lease * 2)  # the holder of `lapsed` is gone
        for run_id in (pending, waiting, lapsed):
            assert await backend.cancel(run_id, reason="operator") == "canceled", run_id
            record = await _read(backend, run_id)
            assert record.status == "canceled"
            assert record.finished_at is not None
            assert (record.cancel_reason, record.cancel_requested_at is not None) == (
                "operator",
                True,
            )
            assert (record.available_at, record.wait_for) == (None, None)
            assert (record.lease_owner, record.lease_expires_at) == (None, None)
            assert await backend.cancel(run_id, reason="again") == "already_finished"
        record = await _read(backend, lapsed)
        assert (record.lease_expirations, record.claims) == (1, 1), "counted as a takeover"
        assert record.fencing_token == leases[lapsed].fencing_token, "no claim took it"
        assert [e.outcome for e in record.executions] == ["interrupted"]
        for run_id in (pending, waiting):
            assert (await _read(backend, run_id)).lease_expirations == 0
        # The gone holder's writes are refused, and its heartbeat hears it lost the run.
        with pytest.raises(FencingError):
            await backend.record_step(
                leases[lapsed], StepRecord(name="late", kind="step", status="completed")
            )
        beat = Beat(run_id=lapsed, fencing_token=leases[lapsed].fencing_token)
        heard = await backend.heartbeat(worker_id=WORKER, beats=[beat], lease=LONG)
        assert heard.lost == {lapsed}
        with pytest.raises(RunNotFoundError):
            await backend.cancel(new_run_id(), reason="nobody")

    async def test_a_cancel_of_a_held_run_is_only_recorded_and_read_by_its_heartbeat(
        self, engine: Engine
    ) -> None:
        backend = engine.backend
        run_id = await _enqueue(backend)
        [lease] = (await _claim(backend, 1, lease=LONG)).values()
        assert await backend.cancel(run_id, reason="first") == "requested"
        requested = await _read(backend, run_id)
        assert requested.status == "running"
        assert requested.fencing_token == lease.fencing_token
        assert (requested.lease_expirations, requested.finished_at) == (0, None)
        assert await backend.cancel(run_id, reason="second") == "requested"
        again = await _read(backend, run_id)
        assert (again.cancel_reason, again.cancel_requested_at) == (
            "first",
            requested.cancel_requested_at,
        ), "a later cancel keeps the first time and reason"
        beat = Beat(run_id=run_id, fencing_token=lease.fencing_token)
        heard = await backend.heartbeat(worker_id=WORKER, beats=[beat], lease=LONG)
        assert (heard.lost, dict(heard.cancel_requested)) == (frozenset(), {run_id: "first"})
        # The holder ends it (the store refuses to take it back), as the SDK decides.
        release = Ending(status="pending", outcome="released")
        assert await backend.end_execution(lease, release) == "cancel_requested"
        canceled = Ending(status="canceled", outcome="canceled")
        assert await backend.end_execution(lease, canceled) == "ended"
        assert await backend.cancel(run_id, reason="third") == "already_finished"

    async def test_a_cancel_its_holder_never_ended_is_handed_to_the_next_claim(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        backend = engine.backend
        run_id = await _enqueue(backend)
        await _claim(backend, 1, lease=harness.lease)
        assert await backend.cancel(run_id, reason="") == "requested"
        await harness.advance(harness.lease * 2)  # the holder is cut off before it saw it
        [claimed] = await _claim_until(backend, 1, lease=LONG)
        assert claimed.run_id == run_id
        assert claimed.cancel_reason == "", "requested, even without a reason"
        assert claimed.lost_leases == 1
        record = await _read(backend, run_id)
        assert record.status == "running", "the store never ends a run it hands out"
        assert [e.outcome for e in record.executions] == ["interrupted", "running"]
        ending = Ending(status="canceled", outcome="canceled")
        assert await backend.end_execution(_lease(claimed, LONG), ending) == "ended"

    # -- available_at -------------------------------------------------------------------------

    async def test_available_at_says_when_a_run_may_next_be_claimed_and_nothing_while_it_runs(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        backend = engine.backend
        delayed = await _enqueue(backend, delay=timedelta(hours=1))
        record = await _read(backend, delayed)
        assert record.available_at == record.created_at + timedelta(hours=1)
        runs = [await _enqueue(backend) for _ in range(4)]
        for run_id in runs:
            record = await _read(backend, run_id)
            assert record.available_at is not None
            assert record.observed_at is not None
            assert record.available_at <= record.observed_at, "due at once"
        leases = await _claim(backend, 4, lease=harness.lease)

        async def reads_nothing_while_running() -> None:
            for run_id in runs:
                for read in await _everywhere(engine, run_id):
                    assert (read.status, read.available_at) == ("running", None), read
                info = await engine.get(run_id)
                assert info.available_at is None
                assert _run_json(info, detail=True)["available_at"] is None

        await reads_nothing_while_running()  # claimed
        await harness.advance(harness.lease * 2)
        await reads_nothing_while_running()  # its lease lapsed, nobody took it over
        beats = [Beat(run_id=r, fencing_token=leases[r].fencing_token) for r in runs]
        heard = await backend.heartbeat(worker_id=WORKER, beats=beats, lease=LONG)
        assert heard.lost == frozenset(), "a lapsed lease nobody took over still beats"
        long_leases = {r: attrs.evolve(lease, duration=LONG) for r, lease in leases.items()}
        for run_id in runs:
            step = StepRecord(name="one", kind="step", status="completed", output_json="1")
            await backend.record_step(long_leases[run_id], step)
        await reads_nothing_while_running()  # heartbeat and record_step

        timer, fact, handed_back, done = runs
        now = (await _read(backend, timer)).observed_at
        assert now is not None
        wake = now + timedelta(hours=2)
        endings = {
            timer: Ending(status="waiting", outcome="waiting", available_at=wake),
            fact: Ending(status="waiting", outcome="waiting", wait_for="contract-spi-go"),
            handed_back: Ending(status="pending", outcome="released"),
            done: Ending(status="completed", outcome="completed", output_json="1"),
        }
        for run_id, ending in endings.items():
            assert await backend.end_execution(long_leases[run_id], ending) == "ended"
        assert (await _read(backend, timer)).available_at == wake
        info = await engine.get(timer)
        assert info.available_at == wake
        assert datetime.fromisoformat(_run_json(info, detail=True)["available_at"]) == wake
        assert (await _read(backend, fact)).available_at is None, "a wait with no deadline"
        record = await _read(backend, handed_back)
        assert record.available_at is not None
        assert record.observed_at is not None
        assert record.available_at <= record.observed_at, "handed back: due at once"
        assert (await _read(backend, done)).available_at is None, "finished"
        assert await backend.signal(run_id=fact, name="contract-spi-go", payload_json="1")
        woken = await _read(backend, fact)
        assert (woken.status, woken.wait_for) == ("waiting", "contract-spi-go")
        assert woken.available_at is not None
        assert woken.observed_at is not None
        assert woken.available_at <= woken.observed_at, "the fact arrived: due at once"
