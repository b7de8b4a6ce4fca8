"""The rows of the telemetry table (docs/operations.md) that need Postgres: a worker process
SIGKILLed mid-step and taken over by another process, whose metric counts the expiration; and
an `enqueue(conn=...)` whose transaction rolls back, which the counters must not call a run.
The rest of the table is driven in tests/unit/test_telemetry_truth.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import psycopg
from opentelemetry.trace import StatusCode

from tests._procs.support import Spawner, eventually
from tests.integration.telemetry_tasks import TASKS, Hold, hold
from tests.unit.test_telemetry_truth import Key, Otel, attrs_of, events, noop
from umt_sdk import Registry, connect


async def test_a_sigkilled_worker_is_counted_by_the_process_that_takes_its_run_over(
    pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    otel = Otel()
    engine = await connect(
        pg_url,
        registry=Registry(TASKS),
        schema=pg_schema,
        run_migrations=False,
        tracer_provider=otel.tracer_provider,
        meter_provider=otel.meter_provider,
    )
    folder = tmp_path / "marks"
    folder.mkdir()
    fields = {"url": pg_url, "schema": pg_schema, "poll": 0.2}
    try:
        with Spawner.under(tmp_path, tasks="tests.integration.telemetry_tasks", **fields) as spawn:
            doomed = spawn.start(lease=1.0, concurrency=1)
            await doomed.wait_ready()
            handle = await engine.enqueue(hold, Hold(str(folder)))
            await eventually(
                (folder / "started-1").exists, timeout=30, what="the step to start in the worker"
            )
            doomed.kill()  # SIGKILL: no heartbeat, no ending, nothing counted there
        async with engine.worker(lease=timedelta(seconds=1), poll_interval=timedelta(seconds=0.2)):
            assert await handle.result(timeout=60) == "taken over"
        info = await engine.get(handle.run_id)
    finally:
        await engine.close()

    assert info.lease_expirations == 1
    assert [e.outcome for e in info.executions] == ["interrupted", "completed"]
    assert otel.total("umt.lease.expirations", umt__task__name="telemetry.hold") == 1
    assert otel.total("umt.lease.lost") == 0, "this process lost no lease"
    (execution,) = otel.spans("umt.run telemetry.hold")
    assert attrs_of(execution)["umt.attempt"] == 2
    (taken,) = events(execution, "umt.lease_taken_over")
    assert taken["umt.lease.lost_since_step"] == 1
    assert execution.status.status_code == StatusCode.UNSET


async def test_an_enqueue_whose_transaction_rolls_back_is_a_request_not_a_run(
    pg_url: str, pg_schema: str
) -> None:
    otel = Otel()
    engine = await connect(
        pg_url,
        registry=Registry([noop]),
        schema=pg_schema,
        run_migrations=False,
        tracer_provider=otel.tracer_provider,
        meter_provider=otel.meter_provider,
    )
    try:
        async with await psycopg.AsyncConnection.connect(pg_url) as conn:
            async with conn.transaction(force_rollback=True):
                for key in ("a", "b", "c"):
                    await engine.enqueue(noop, Key(key), conn=conn)
            async with conn.transaction():
                kept = await engine.enqueue(noop, Key("kept"), conn=conn)
        page = await engine.list(task_name="tel.noop")
    finally:
        await engine.close()

    assert [r.run_id for r in page.runs] == [kept.run_id], "only the committed run exists"
    assert otel.total("umt.runs.enqueued") == 0, "the SDK never saw a commit"
    assert otel.total("umt.enqueue.requests", umt__enqueue__transaction="caller") == 4
    spans = otel.spans("umt.enqueue tel.noop")
    assert len(spans) == 4
    for span in spans:
        attributes = attrs_of(span)
        assert attributes["umt.enqueue.transaction"] == "caller"
        assert attributes["umt.run.created_if_committed"] is True
        assert "umt.run.created" not in attributes, "created is said only of a known commit"
