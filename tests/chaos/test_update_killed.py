"""An update whose worker process is SIGKILLed after the run accepted it (the update is
stored, its handler ran and returned) and before its result was recorded: the caller, who
waited all along, gets exactly one result, from the next worker. The handler ran again
there, its recorded step replayed (its side effect done once), and one result is recorded."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests._procs.support import Spawner, killed_itself
from tests.chaos.update_tasks import KILLED, RESERVED, TASKS, Approval, Order, order
from umt_sdk import Registry, connect


async def test_an_update_cut_off_before_its_record_gives_one_result(
    pg_url: str, pg_schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UMT_TEST_KILL_UPDATE", "1")  # for the worker processes
    fields = {"url": pg_url, "schema": pg_schema, "poll": 0.2}
    engine = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema, run_migrations=False)
    with Spawner.under(tmp_path, tasks="tests.chaos.update_tasks", **fields) as spawner:
        try:
            handle = await engine.enqueue(order, Order("o1"))
            first = spawner.start(group="w0", lease=1.0)
            deadline = time.monotonic() + 60
            while (await engine.get(handle.run_id)).status != "waiting":
                assert time.monotonic() < deadline, first.describe()
                await asyncio.sleep(0.05)
            assert await handle.query("status") == "waiting"
            caller = asyncio.ensure_future(handle.update("approve", Approval("ops"), timeout=120))
            await killed_itself(first, spawner.workdir / KILLED)
            assert first.events("APPLIED"), first.describe()
            # Accepted (stored, applied once) but not recorded: the caller still waits.
            assert not caller.done()
            facts = await engine.backend.get_facts(run_id=handle.run_id, name="umt.update:1")
            assert len(facts) == 1
            dead = await engine.get(handle.run_id)
            assert "umt.update-result:1" not in [s.name for s in dead.timeline]

            second = spawner.start(group="w1", lease=1.0)
            result = await caller
            assert result == "approved by ops (slot-o1)", second.describe()
            assert await handle.result(timeout=60) == result
            stored = await engine.backend.get_run(handle.run_id)
            assert stored is not None
            results = [s for s in stored.steps if s.name.startswith("umt.update-result:")]
            assert [(s.name, s.status, s.attempt) for s in results] == [
                ("umt.update-result:1", "completed", 1)
            ]
            assert [s.name for s in stored.steps if s.name.startswith("umt.update:")] == [
                "umt.update:1"
            ]
            info = await engine.get(handle.run_id)
            assert [(s.name, s.status) for s in info.timeline if "update-result" in s.name] == [
                ("umt.update-result:1", "interrupted"),
                ("umt.update-result:1", "completed"),
            ]
            # The handler's step ran once: the next worker replayed its record.
            lines = (spawner.workdir / RESERVED).read_text().splitlines()
            assert len(lines) == 1, lines
            assert second.events("APPLIED"), second.describe()
            assert await handle.query("status") == "approved"
            assert info.lease_expirations == 1
        finally:
            await engine.close()
