"""A worker frozen (SIGSTOP) or slow inside `with_attempt_token`'s commit callback holds up
nothing: not the takeover of its run, not `engine.cancel()`, not the leases of its other runs.
And the fence still holds: the frozen attempt's commit, once it goes on, is refused, so the
business table has exactly one write per operation (real processes, Postgres, a 1 s lease).
"""

from __future__ import annotations

import asyncio
import signal

from tests._procs.support import Spawner, eventually, fetch, finished, q
from tests.chaos.lease_tasks import Busy, Fenced, bookings, busy, fenced, log_rows
from umt_sdk import Engine


async def test_a_worker_frozen_in_its_commit_holds_up_neither_takeover_nor_cancel(
    lease_engine: Engine, lease_spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    frozen = lease_spawner.start(group="frozen", concurrency=2)
    await frozen.wait_ready()
    taken = await lease_engine.enqueue(fenced, Fenced(key="taken", hold_takeover=True))
    canceled = await lease_engine.enqueue(fenced, Fenced(key="canceled"))
    stale_tokens = {key: await frozen.printed("IN_COMMIT", key) for key in ("taken", "canceled")}
    # Both runs are inside their commit callbacks, their business rows written, uncommitted.
    await frozen.freeze()

    outcome = await asyncio.wait_for(
        lease_engine.cancel(canceled.run_id, reason="operator"), timeout=10
    )
    assert outcome in ("requested", "canceled"), outcome
    assert frozen.stopped(), "cancel() returned while the worker is frozen in its commit"
    rescuer = lease_spawner.start(group="rescuer", concurrency=2)
    await rescuer.wait_ready()

    # The takeover claims the run and begins the operation (raising the op's token).
    new_token = await rescuer.printed("IN_ACT", "taken")
    assert new_token > stale_tokens["taken"]
    done = await finished(lease_engine, canceled.run_id, timeout=20)
    assert done.status == "canceled"
    assert frozen.stopped(), "taken over and canceled while the old worker is still frozen"

    # The frozen attempts go on: their commits are refused by the ledger's fence, or (if the
    # worker's first heartbeat comes back first and finds the leases lost) stopped before they
    # get there; either way the rows they wrote roll back.
    for key in ("taken", "canceled"):
        (lease_spawner.workdir / f"release-{key}").touch()
    frozen.signal(signal.SIGCONT)

    async def ends() -> dict[str, list[int]] | None:
        found = {
            key: [int(line[2]) for e in ("FENCED", "STOPPED") for line in frozen.events(e, key)]
            for key in stale_tokens
        }
        return found if all(found.values()) else None

    ended = await eventually(
        ends, timeout=30, what="the frozen attempts to end", on_timeout=frozen.describe
    )
    assert ended == {key: [token] for key, token in stale_tokens.items()}, ended
    assert not frozen.events("COMMITTED")
    assert await bookings(pg_url, pg_schema) == [], "nothing committed yet"

    (lease_spawner.workdir / "release2-taken").touch()  # the newer attempt commits
    info = await finished(lease_engine, taken.run_id)
    assert info.status == "completed", f"{info.status} {info.error}"
    assert await lease_engine.result(taken.run_id) == f"receipt-{new_token}"
    rows = await bookings(pg_url, pg_schema)
    assert [(r["key"], r["token"], r["pid"]) for r in rows] == [
        ("taken", new_token, rescuer.pid)
    ], rows
    ledger = await fetch(
        pg_url, q("SELECT op_key, fencing_token FROM {schema}.op_ledger ORDER BY 1", pg_schema)
    )
    assert {r["op_key"]: r["fencing_token"] for r in ledger} == {
        "book:canceled": stale_tokens["canceled"],
        "book:taken": new_token,
    }
    assert [e.outcome for e in info.executions] == ["interrupted", "completed"]


async def test_a_slow_commit_does_not_cost_the_workers_other_runs_their_leases(
    lease_engine: Engine, lease_spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    holder = lease_spawner.start(group="holder", concurrency=4, lease=2.0)
    await holder.wait_ready()
    # The slow commit first, so that it heads the worker's heartbeat statement.
    slow = await lease_engine.enqueue(fenced, Fenced(key="slow", slow_commit=5.0))
    await eventually(
        lambda: log_rows(pg_url, pg_schema, "slow"), timeout=30, what="the slow run's action"
    )
    others = [await lease_engine.enqueue(busy, Busy(key=f"other-{i}")) for i in range(2)]
    for i in range(2):
        await holder.printed("BUSY_STARTED", f"other-{i}")
    thief = lease_spawner.start(group="thief", concurrency=4, lease=2.0)
    await thief.wait_ready()  # polls every 0.2 s: any lease that lapses is taken over

    (lease_spawner.workdir / "go-slow").touch()  # the commit callback now takes 5 s
    await holder.printed("SLOW_COMMIT", "slow")
    await holder.printed("COMMITTED", "slow", timeout=60)
    for i in range(2):
        (lease_spawner.workdir / f"done-other-{i}").touch()
    for handle in (slow, *others):
        info = await finished(lease_engine, handle.run_id)
        assert info.status == "completed", f"{handle.run_id}: {info.status} {info.error}"
        assert info.lease_expirations == 0, f"{info.task_name} lost its lease"
        assert [e.worker_id.split("-")[0] for e in info.executions] == ["holder"]
    assert not thief.events("BUSY_STARTED"), thief.describe()
    rows = await bookings(pg_url, pg_schema)
    assert [(r["key"], r["pid"]) for r in rows] == [("slow", holder.pid)]
