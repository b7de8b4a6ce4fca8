"""Streams on Postgres across processes: a worker process writes, the test process follows.

The follower is woken by the stream's NOTIFY (sent by the writer's process after its commit)
and by the run's ending notification, never by its own clock: each test makes a follower's
fallback read 60 s long, so values that reach it within the tests' 20 s could only have come
through LISTEN. A worker SIGKILLed in the middle of a step that wrote leaves the values it
wrote; the worker that takes the run over runs the step again and finds them (no duplicate).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests._procs.support import Process, Spawner, q
from tests.integration.stream_tasks import TASKS, Progress, progress
from umt_backend_pg import _wakeups as wakeups
from umt_backend_pg._sql import queries, render
from umt_sdk import Engine, Registry, StreamItem, connect
from umt_sdk import _streams as streams
from umt_sdk.backend import NewRun, TaskPair, new_run_id

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def slow_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wakeups, "RUN_POLL_LISTENING", 60.0)
    monkeypatch.setattr(streams, "FOLLOW_WAIT", 60.0)


@pytest.fixture
def workers(pg_url: str, pg_schema: str, tmp_path: Path) -> Iterator[Spawner]:
    fields = {"url": pg_url, "schema": pg_schema, "poll": 0.2}
    with Spawner.under(tmp_path, tasks="tests.integration.stream_tasks", **fields) as spawned:
        yield spawned


@pytest.fixture
async def engine(pg_url: str, pg_schema: str) -> AsyncIterator[Engine]:
    client = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema)
    try:
        yield client
    finally:
        await client.close()


async def _next(items: AsyncIterator[StreamItem], worker: Process) -> StreamItem:
    try:
        return await asyncio.wait_for(anext(items), 20)
    except TimeoutError:
        raise AssertionError(f"no stream value within 20 s\n{worker.describe()}") from None


def _switch(workers: Spawner, key: str, done: int) -> None:
    (workers.workdir / f"{key}.{done}").touch()


def _values(items: list[StreamItem]) -> list[Any]:
    return [item.value for item in items]


async def test_a_follower_in_another_process_sees_each_value_as_it_is_written(
    engine: Engine, workers: Spawner
) -> None:
    worker = workers.start(concurrency=1)
    await worker.wait_ready()
    handle = await engine.enqueue(progress, Progress(key="live", total=3))
    items = engine.stream(handle.run_id, "progress")
    seen = []
    for done in (1, 2, 3):
        item = await _next(items, worker)
        seen.append(item)
        assert item.value == {"done": done, "total": 3}
        if done < 3:
            assert (await engine.get(handle.run_id)).status == "running", "followed live"
        _switch(workers, "live", done)  # the worker writes the next value
    # The run ends; its ending notification ends the follow.
    with pytest.raises(StopAsyncIteration):
        await _next(items, worker)
    assert (await engine.get(handle.run_id)).status == "completed"
    assert [item.seq for item in seen] == [1, 2, 3]
    last = await engine.stream_last(handle.run_id, "progress")
    assert last is not None
    assert last.value == {"done": 3, "total": 3}


async def test_a_step_run_again_after_sigkill_does_not_write_twice(
    engine: Engine, workers: Spawner
) -> None:
    first = workers.start(concurrency=1, lease=1.0)
    await first.wait_ready()
    handle = await engine.enqueue(progress, Progress(key="kill", total=3))
    items = engine.stream(handle.run_id, "progress")
    assert (await _next(items, first)).value == {"done": 1, "total": 3}
    _switch(workers, "kill", 1)
    assert (await _next(items, first)).value == {"done": 2, "total": 3}
    await first.printed("wrote", "kill")
    first.signal(signal.SIGKILL)  # in the step, after two values, before its record
    first.kill()
    _switch(workers, "kill", 2)
    _switch(workers, "kill", 3)
    second = workers.start(concurrency=1, lease=1.0)
    last = await _next(items, second)
    assert last.value == {"done": 3, "total": 3}
    with pytest.raises(StopAsyncIteration):
        await _next(items, second)
    # The step ran again from its first value: its writes found the entries of the first.
    assert [event[2] for event in second.events("wrote", "kill")] == ["1", "2", "3"]
    everything = [item async for item in engine.stream(handle.run_id, "progress")]
    assert _values(everything) == [{"done": done, "total": 3} for done in (1, 2, 3)]
    assert [item.seq for item in everything] == [1, 2, 3]
    info = await engine.get(handle.run_id)
    assert info.status == "completed"
    assert info.lease_expirations == 1


async def test_an_append_reads_as_much_at_the_first_value_as_at_the_ten_thousandth(
    engine: Engine, pg_url: str, pg_schema: str
) -> None:
    """Work, not time: the buffers one append touches (EXPLAIN (ANALYZE, BUFFERS), the run's
    row, the stream's row, the key and seq indexes) do not grow with the stream's length
    beyond an index level; the figures are in docs/performance.md."""
    backend = engine.backend
    run_id = new_run_id()
    await backend.enqueue(
        NewRun(run_id=run_id, task_name="streams.bench", task_version=1, input_json="null",
               input_hash="bench")
    )  # fmt: skip
    (claimed,) = await backend.claim(
        worker_id="bench", pairs=[TaskPair(name="streams.bench", version=1)], limit=1,
        lease=timedelta(seconds=60),
    )  # fmt: skip
    statement = render(queries()["append_stream"], pg_schema)

    async def buffers(key: str) -> int:
        params = {"run_id": run_id, "token": claimed.fencing_token, "name": "progress",
                  "key": key, "value": '{"done": 1, "total": 2}'}  # fmt: skip
        async with await psycopg.AsyncConnection.connect(pg_url) as conn:
            cur = await conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement,  # our own statement
                params,
            )
            ((plan,),) = await cur.fetchall()
            await conn.commit()
        top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
        return int(top["Shared Hit Blocks"] + top["Shared Read Blocks"])

    await buffers("warm-up")  # the catalog and the first pages, read once
    first = await buffers("first")
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(
            q(
                "INSERT INTO {schema}.stream_entries (run_id, name, seq, key, value)"
                " SELECT %s, 'progress', g, 'filler:' || g, '{{\"done\": 1}}'::jsonb"
                " FROM generate_series(3, 10002) AS g",
                pg_schema,
            ),
            (run_id,),
        )
        await conn.execute(
            q("UPDATE {schema}.streams SET last_seq = 10002 WHERE run_id = %s", pg_schema),
            (run_id,),
        )
        await conn.execute(q("ANALYZE {schema}.stream_entries", pg_schema))
    later = await buffers("later")
    print(f"buffers per append: {first} at the 2nd value, {later} at the 10,003rd")
    assert later <= first + 8, (first, later)  # a scan of the stream would be 100s
    items = [item async for item in engine.stream(run_id, "progress", follow=False)]
    assert [item.seq for item in items[:2]] == [1, 2]
    assert items[-1].seq == 10003
