"""A worker process SIGKILLed right after a step failed uncertainly (the failure recorded, the
run not parked yet) leaves the run to the next worker, which parks it in `needs_attention`
without calling the step again: the promise spans the crash. Settled done, the run completes
with the given output and the gateway was called once; settled not done, it is called once
more."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from tests._procs.support import Spawner, killed_itself
from tests.chaos.attention_tasks import CALLS, KILLED, TASKS, charge
from umt_sdk import Registry, connect


@pytest.mark.parametrize("done", [True, False], ids=["settled-done", "settled-not-done"])
async def test_a_worker_killed_after_an_uncertain_failure_leaves_the_run_needing_attention(
    pg_url: str, pg_schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, done: bool
) -> None:
    monkeypatch.setenv("UMT_TEST_KILL_AFTER_UNCERTAIN", "1")  # for the worker processes
    fields = {"url": pg_url, "schema": pg_schema, "poll": 0.2}
    engine = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema, run_migrations=False)
    with Spawner.under(tmp_path, tasks="tests.chaos.attention_tasks", **fields) as spawner:
        try:
            handle = await engine.enqueue(charge, "o1")
            first = spawner.start(group="w0", lease=1.0)
            await killed_itself(first, spawner.workdir / KILLED)
            calls = spawner.workdir / CALLS
            assert calls.read_text().split() == ["o1", str(first.pid)]
            dead = await engine.get(handle.run_id)
            assert dead.status == "running"  # the park never happened
            [entry] = [s for s in dead.timeline if s.name == "charge" and s.kind == "step"]
            assert (entry.status, entry.attempt) == ("waiting", 1)  # the failure did

            second = spawner.start(group="w1", lease=1.0)
            deadline = time.monotonic() + 60
            while (info := await engine.get(handle.run_id)).needs_attention is None:
                assert time.monotonic() < deadline, f"{info.display_status}\n{second.describe()}"
                await asyncio.sleep(0.05)
            assert info.needs_attention == "charge"
            assert info.available_at is None, "no timer: never retried on its own"
            assert info.lease_expirations == 1
            assert [e.outcome for e in info.executions] == ["interrupted", "waiting"]
            assert second.events("CALLED") == [], "the next worker never called the gateway"
            assert len(calls.read_text().splitlines()) == 1

            output = {"ref": "gw-by-hand", "cents": 1250} if done else None
            await engine.settle(handle.run_id, step="charge", done=done, output=output, by="ops")
            result = await handle.result(timeout=60)
            if done:
                assert result == "gw-by-hand 1250"
                assert len(calls.read_text().splitlines()) == 1, "called once in all"
            else:
                assert result == f"gw-{second.pid} 1250"
                assert calls.read_text().splitlines() == [
                    f"o1 {first.pid}",
                    f"o1 {second.pid}",
                ]
            final = await engine.get(handle.run_id)
            settled = [s for s in final.timeline if s.name == "umt.attention:1:charge"]
            assert len(settled) == 1
            body = json.loads(settled[0].output_json or "null")["umt_settled"]
            assert (body["as"], body["by"]) == ("done" if done else "not-done", "ops")
        finally:
            await engine.close()
