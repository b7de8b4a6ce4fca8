"""No run loops forever on a fault that repeats: a task that SIGKILLs its own worker process
every time (think of an OOM kill on one input) ends `failed` with `LeaseLostTooOftenError`
after its `max_lost_leases`, with a supervisor restarting the killed worker each time.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests._procs.support import Process, Spawner
from tests.chaos.lease_tasks import KILLS_ITSELF_MAX_LOST_LEASES, Doomed, kills_itself, log_rows
from umt_sdk import Engine, RunFailedError


async def test_a_run_that_kills_its_worker_every_time_fails_after_the_bound(
    lease_engine: Engine, lease_spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    handle = await lease_engine.enqueue(kills_itself, Doomed(key="oom"))
    workers: list[Process] = []
    deadline = time.monotonic() + 120
    # The supervisor: whenever the worker is gone, start another one, until the run ends.
    while (await lease_engine.get(handle.run_id)).status not in ("completed", "failed"):
        if not workers or not workers[-1].alive:
            assert len(workers) <= KILLS_ITSELF_MAX_LOST_LEASES + 1, "restarted without end"
            workers.append(lease_spawner.start(group=f"w{len(workers)}", concurrency=1))
        assert time.monotonic() < deadline, "\n".join(w.describe() for w in workers)
        await asyncio.sleep(0.05)

    with pytest.raises(RunFailedError) as caught:
        await lease_engine.result(handle.run_id)
    assert caught.value.error_type == "umt_sdk.LeaseLostTooOftenError"
    message = caught.value.error_message
    assert f"lost its lease {KILLS_ITSELF_MAX_LOST_LEASES} times" in message, message
    assert "'oom'" in message, message
    info = await lease_engine.get(handle.run_id)
    assert info.status == "failed"
    assert info.lease_expirations == KILLS_ITSELF_MAX_LOST_LEASES
    assert info.attempts == KILLS_ITSELF_MAX_LOST_LEASES + 1
    assert [e.outcome for e in info.executions] == [
        "interrupted"
    ] * KILLS_ITSELF_MAX_LOST_LEASES + ["failed"]
    bodies = [r for r in await log_rows(pg_url, pg_schema, "oom") if r["event"] == "body"]
    assert len(bodies) == KILLS_ITSELF_MAX_LOST_LEASES, "the last claim fails it without a run"
    killed = [w for w in workers if w.events("DYING", "oom")]
    assert len(killed) == KILLS_ITSELF_MAX_LOST_LEASES
    assert {r["pid"] for r in bodies} == {w.pid for w in killed}
    assert all(w.popen.returncode == -9 for w in killed), [w.popen.returncode for w in killed]
    assert workers[-1].alive, "the worker that failed the run is alive and well"
