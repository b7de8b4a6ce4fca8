"""A worker process SIGKILLed while it fans published events out to subscribers registered
after the publish (between two of its writes, each one committed) leaves every subscriber
started exactly once per event: the next worker starts what is missing and nothing twice,
since each run's idempotency key is the event's."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests._procs.support import Spawner, eventually, killed_itself
from tests.chaos.event_tasks import EVENT, KILLED, TASKS, Placed
from umt_sdk import Engine, Registry, RunInfo, connect

EVENTS = 250  # two writes per subscriber (200 + 50)


async def test_a_worker_killed_while_fanning_out_starts_each_subscriber_once(
    pg_url: str, pg_schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UMT_TEST_KILL_EVENT_FANOUT", "3")  # for the worker processes
    fields = {"url": pg_url, "schema": pg_schema, "poll": 0.2}
    # The publisher knows no subscriber: the workers start them all, from the window.
    publisher = await connect(pg_url, registry=Registry(), schema=pg_schema, run_migrations=False)
    reader = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema, run_migrations=False)
    with Spawner.under(tmp_path, tasks="tests.chaos.event_tasks", **fields) as spawner:
        try:
            published = [
                await publisher.publish(EVENT, Placed(n), key=f"order-{n}") for n in range(EVENTS)
            ]
            assert all(p.created and p.runs == () for p in published)
            first = spawner.start(group="w0", lease=1.0)
            await killed_itself(first, spawner.workdir / KILLED, timeout=120)
            started = {t.name: len(await _keys(reader, t.name)) for t in TASKS}
            # Subscribers in name order, 200 events a write: it died after its third write.
            assert started == {
                "chaos.events.receipt": 200,
                "chaos.events.stock": 0,
                "chaos.events.points": 250,
            }

            second = spawner.start(group="w1", lease=1.0)

            async def all_completed() -> bool:
                for definition in TASKS:
                    runs = await _runs(reader, definition.name)
                    if len(runs) < EVENTS or any(r.status != "completed" for r in runs):
                        return False
                return True

            await eventually(
                all_completed, timeout=180, what="every run completed", on_timeout=second.describe
            )
            want = {f"umt.event:{p.event_id}" for p in published}
            for definition in TASKS:
                keys = await _keys(reader, definition.name)
                assert Counter(keys).most_common(1)[0][1] == 1, definition.name
                assert set(keys) == want, definition.name
        finally:
            await publisher.close()
            await reader.close()


async def _runs(engine: Engine, task_name: str) -> list[RunInfo]:
    return list(await engine.list(task_name=task_name, limit=1000))


async def _keys(engine: Engine, task_name: str) -> list[str | None]:
    return [r.idempotency_key for r in await _runs(engine, task_name)]
