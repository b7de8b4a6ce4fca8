"""A parent whose worker process is SIGKILLed between starting a child and recording that it
did starts exactly one child: the step that starts it runs again in the next worker and finds
the child by its idempotency key (the parent run and the step's name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._procs.support import Spawner, killed_itself
from tests.chaos.child_tasks import KILLED, TASKS, Family, parent
from umt_sdk import Registry, connect


async def test_a_parent_killed_after_starting_its_child_starts_it_once(
    pg_url: str, pg_schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UMT_TEST_KILL_AFTER_START", "1")  # for the worker processes
    fields = {"url": pg_url, "schema": pg_schema, "poll": 0.2}
    engine = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema, run_migrations=False)
    with Spawner.under(tmp_path, tasks="tests.chaos.child_tasks", **fields) as spawner:
        try:
            handle = await engine.enqueue(parent, Family("k1"))
            first = spawner.start(group="w0", lease=1.0)
            await killed_itself(first, spawner.workdir / KILLED)
            # It died after the child was stored and before the parent's step was recorded.
            children = (await engine.list(parent=handle.run_id)).runs
            assert len(children) == 1
            dead = await engine.get(handle.run_id)
            assert [s for s in dead.timeline if s.status == "completed"] == []

            second = spawner.start(group="w1", lease=1.0)
            assert await handle.result(timeout=60) == "leaf k1", second.describe()
            children = (await engine.list(parent=handle.run_id)).runs
            assert len(children) == 1, "the step that ran again found the same child"
            child = await engine.get(children[0].run_id)
            assert child.status == "completed"
            assert child.attempts == 1
            info = await engine.get(handle.run_id)
            assert info.lease_expirations == 1
            assert [(s.name, s.status) for s in info.timeline] == [
                ("start", "interrupted"),
                ("start", "completed"),
                ("start.result", "completed"),
            ]
            # The code after the step runs once per execution that reaches it: once, or twice
            # when the child was not done at the first look and the parent parked and replayed
            # (a slow machine). Each time it holds the one child, which the step found again.
            assert first.events("STARTED") == [], first.describe()
            started = second.events("STARTED", "k1")
            assert started, second.describe()
            assert {tuple(line) for line in started} == {("STARTED", "k1", str(child.run_id))}, (
                second.describe()
            )
        finally:
            await engine.close()
