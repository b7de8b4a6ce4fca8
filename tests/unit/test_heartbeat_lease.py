"""How a heartbeat's answer moves an execution's lease (`Execution.heard`), on a run the
memory backend claimed. A run the beat found locked (`HeartbeatResult.unrenewed`) is not lost,
and its lease counts as renewed only while the execution's own transactional step holds the
row; locked by anything else (a takeover, a cancel in flight), the lease ends when it would
have. The answers are made here, so each path is met whatever the backend's timing (the
integration tests meet only the own-transaction one, with Postgres)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest

from umt_sdk import Registry, TaskContext, TaskPair, connect, task
from umt_sdk._execution import Execution
from umt_sdk.backend import HeartbeatResult
from umt_sdk.testing import FakeClock

LEASE = timedelta(seconds=10)


@task("lease.held", version=1)
async def held(ctx: TaskContext[int]) -> int:
    return ctx.input


@pytest.mark.parametrize(
    ("unrenewed", "own_transaction", "stops_at_the_claim_s_lease_end"),
    [
        (False, False, False),
        (True, False, True),
        (True, True, False),
    ],
    ids=["renewed", "unrenewed-row-held-by-another", "unrenewed-row-held-by-its-own-step"],
)
async def test_an_unrenewed_beat_keeps_the_lease_only_under_the_execution_s_own_transaction(
    unrenewed: bool, own_transaction: bool, stops_at_the_claim_s_lease_end: bool
) -> None:
    engine = await connect("memory://", registry=Registry([held]), clock=FakeClock())
    await engine.enqueue(held, 1)
    [claimed] = await engine.backend.claim(
        worker_id="w", pairs=[TaskPair(name="lease.held", version=1)], limit=1, lease=LEASE
    )
    # Half the claim's lease is gone when the beat is sent: a beat that renews it moves its end
    # on by at least half a lease (5 s), past the moment checked below.
    claim_started = time.monotonic() - LEASE.total_seconds() / 2
    claim_lease_end = claim_started + LEASE.total_seconds()
    execution = Execution(
        backend=engine.backend,
        claimed=claimed,
        definition=engine.registry.get("lease.held", 1),
        worker_id="w",
        lease_duration=LEASE,
        loop=asyncio.get_running_loop(),
        telemetry=engine.telemetry,
        claim_started=claim_started,
    )
    assert execution.beat() is not None
    answer = HeartbeatResult(unrenewed=frozenset({claimed.run_id}) if unrenewed else frozenset())
    if own_transaction:
        with execution.own_transaction():
            execution.heard(answer)
    else:
        execution.heard(answer)
    # Not lost: it goes on until the claim's lease ends, whatever the beat's answer.
    execution.check_lease(claim_lease_end - 1)
    assert not execution.stopped
    execution.check_lease(claim_lease_end + 1)
    assert execution.stopped is stops_at_the_claim_s_lease_end
    if stops_at_the_claim_s_lease_end:
        assert execution.abort_kind == "lease_lost"
    await engine.close()
