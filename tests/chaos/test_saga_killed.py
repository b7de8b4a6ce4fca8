"""A saga whose worker process is SIGKILLed in the middle of compensating resumes in the next
worker: the compensations already recorded do not run again, the rest run, newest first, and
the run ends `compensated`. Each compensation's outside effect happens exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._procs.support import Spawner, killed_itself
from tests.chaos.saga_tasks import KILLED, STEPS, TASKS, UNDONE, Trip, trip
from umt_sdk import Registry, RunCompensatedError, connect


async def test_a_saga_killed_while_compensating_undoes_each_step_once(
    pg_url: str, pg_schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UMT_TEST_KILL_WHILE_COMPENSATING", "1")  # for the worker processes
    fields = {"url": pg_url, "schema": pg_schema, "poll": 0.2}
    engine = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema, run_migrations=False)
    with Spawner.under(tmp_path, tasks="tests.chaos.saga_tasks", **fields) as spawner:
        try:
            handle = await engine.enqueue(trip, Trip("t1"))
            first = spawner.start(group="w0", lease=1.0)
            await killed_itself(first, spawner.workdir / KILLED)
            undone = spawner.workdir / UNDONE
            # It died after undoing book-3 and book-2 (both recorded), before book-1.
            assert [line.split()[0] for line in undone.read_text().splitlines()] == [
                "t1-3",
                "t1-2",
            ]
            dead = await engine.get(handle.run_id)
            assert dead.status == "running"

            second = spawner.start(group="w1", lease=1.0)
            with pytest.raises(RunCompensatedError) as caught:
                await handle.result(timeout=60)
            assert caught.value.error_message == "no flight home", second.describe()
            lines = [line.split() for line in undone.read_text().splitlines()]
            assert [booking for booking, _ in lines] == [f"t1-{i}" for i in reversed(range(STEPS))]
            assert {pid for _, pid in lines[:2]} == {str(first.pid)}
            assert {pid for _, pid in lines[2:]} == {str(second.pid)}, "resumed, not redone"
            assert second.events("BOOKED") == [], "no step of the handler ran again"
            info = await engine.get(handle.run_id)
            assert info.status == "compensated"
            assert info.lease_expirations == 1
            compensations = [
                (s.name, s.status) for s in info.timeline if s.name.startswith("umt.compensate:")
            ]
            assert compensations == [
                ("umt.compensate:book-3", "completed"),
                ("umt.compensate:book-2", "completed"),
                ("umt.compensate:book-1", "interrupted"),
                ("umt.compensate:book-1", "completed"),
                ("umt.compensate:book-0", "completed"),
            ]
        finally:
            await engine.close()
