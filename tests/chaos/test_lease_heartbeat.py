"""Heartbeats keep a lease for as long as its step runs, with a second worker waiting to take
over (real worker processes, a 1 s lease, steps that outlast it several times).

These fail if the Postgres heartbeat stops extending the lease (neither `lease_expires_at` nor
`available_at`): the second worker takes the run over, or a cancel finds the lease expired and
ends the run at once instead of letting the handler's abort fire.
"""

from __future__ import annotations

import asyncio

from tests._procs.support import Spawner, finished
from tests.chaos.lease_tasks import Busy, busy, log_rows
from umt_sdk import Engine


async def test_a_step_held_for_several_leases_keeps_its_lease(
    lease_engine: Engine, lease_spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    workers = [lease_spawner.start(group=g, concurrency=1) for g in ("a", "b")]
    for worker in workers:
        await worker.wait_ready()
    # Whichever worker claims it holds it for ~4.5 leases; the other polls every 0.2 s.
    handle = await lease_engine.enqueue(busy, Busy(key="long", hold=4.5))
    info = await finished(lease_engine, handle.run_id)
    assert info.status == "completed", f"{info.status} {info.error}"
    assert info.lease_expirations == 0
    assert info.attempts == 1, "one claim: the polling worker never took the run over"
    assert [e.outcome for e in info.executions] == ["completed"]
    bodies = [r for r in await log_rows(pg_url, pg_schema, "long") if r["event"] == "body"]
    assert len(bodies) == 1, f"the step body ran {len(bodies)} times: {bodies}"
    started = [w for w in workers if w.events("BUSY_STARTED", "long")]
    assert len(started) == 1, [w.describe() for w in workers]


async def test_cancel_of_a_step_that_outlasts_its_lease_fires_the_abort(
    lease_engine: Engine, lease_spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    workers = [lease_spawner.start(group=g, concurrency=1) for g in ("a", "b")]
    for worker in workers:
        await worker.wait_ready()
    handle = await lease_engine.enqueue(busy, Busy(key="cancel-me"))  # held until aborted
    holder = None
    while holder is None:
        holder = next((w for w in workers if w.events("BUSY_STARTED", "cancel-me")), None)
        await asyncio.sleep(0.02)
    await asyncio.sleep(3)  # three leases into the step, heartbeats running
    outcome = await lease_engine.cancel(handle.run_id, reason="operator stop")
    assert outcome == "requested", "the holder is alive: the cancel is handed to its handler"
    token = await holder.printed("ABORT_SEEN", "cancel-me")
    info = await finished(lease_engine, handle.run_id)
    assert info.status == "canceled"
    assert info.cancel_reason == "operator stop"
    assert info.lease_expirations == 0
    assert [(e.fencing_token, e.outcome) for e in info.executions] == [(token, "canceled")]
    events = [r["event"] for r in await log_rows(pg_url, pg_schema, "cancel-me")]
    assert events == ["body", "abort-seen"], events
