"""What the SDK makes of the store's counts: a worker's health, the last hour's buckets."""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime, timedelta

from tests.fixtures.dashboard import Browser, browser_for
from umt_sdk import connect
from umt_sdk._insight import (
    BUCKET,
    BUCKETS,
    WORKER_FORGOTTEN_AFTER,
    WORKER_SILENT_AFTER,
    hour_buckets,
)
from umt_sdk.backend import InsightStore, TaskPair, WorkerState
from umt_sdk.dashboard import create_app
from umt_sdk.testing import FakeClock


async def test_a_worker_that_stops_reporting_without_a_goodbye_reads_silent() -> None:
    clock = FakeClock()
    engine = await connect("memory://", clock=clock)
    try:
        store = engine.backend
        assert isinstance(store, InsightStore)
        state = WorkerState(
            worker_id="w",
            host="h",
            pid=7,
            pairs=(TaskPair(name="t", version=1),),
            concurrency=2,
            runs_held=1,
            started_at=clock.now(),
        )
        await store.record_worker(state)
        assert [w.health for w in await engine.workers()] == ["live"]
        clock.advance(WORKER_SILENT_AFTER)
        assert [w.health for w in await engine.workers()] == ["live"]
        clock.advance(timedelta(seconds=1))
        (silent,) = await engine.workers()
        assert silent.health == "silent"
        assert silent.silent_for == WORKER_SILENT_AFTER + timedelta(seconds=1)
        async with browser_for(create_app(engine)) as client:
            html = await Browser(client).page("/workers")
            assert "stopped heartbeating" in html
            assert 'class="health-silent"' in html
        await store.record_worker(
            WorkerState(
                worker_id="w",
                host="h",
                pid=7,
                pairs=(),
                concurrency=2,
                runs_held=0,
                started_at=state.started_at,
                stopped=True,
            )
        )
        clock.advance(timedelta(hours=1))
        assert [w.health for w in await engine.workers()] == ["stopped"]
    finally:
        await engine.close()


def test_the_last_hour_is_twelve_aligned_buckets_ending_with_now() -> None:
    now = datetime(2026, 1, 31, 12, 7, 30, tzinfo=UTC)
    starts = hour_buckets(now)
    assert len(starts) == BUCKETS
    assert starts[-1] == datetime(2026, 1, 31, 12, 5, tzinfo=UTC)
    assert starts[0] == datetime(2026, 1, 31, 11, 10, tzinfo=UTC)
    assert all(b - a == BUCKET for a, b in itertools.pairwise(starts))


async def test_a_starting_worker_forgets_workers_not_heard_from_for_a_week() -> None:
    clock = FakeClock()
    engine = await connect("memory://", clock=clock)
    try:
        store = engine.backend
        assert isinstance(store, InsightStore)
        for name in ("old", "recent"):
            await store.record_worker(
                WorkerState(
                    worker_id=name,
                    host="h",
                    pid=1,
                    pairs=(),
                    concurrency=1,
                    runs_held=0,
                    started_at=clock.now(),
                )
            )
            clock.advance(WORKER_FORGOTTEN_AFTER)
        async with engine.worker(worker_id="new"):
            for _ in range(200):
                names = {w.worker_id for w in await engine.workers()}
                if "new" in names and "old" not in names:
                    break
                await asyncio.sleep(0.01)
        assert {w.worker_id for w in await engine.workers()} == {"recent", "new"}
    finally:
        await engine.close()


async def test_a_worker_stopped_during_its_first_report_ends_every_loop() -> None:
    """stop() cancels the worker's loops; the report loop's first report and forget pass
    complete at once on the memory store, and a cancellation arriving then was swallowed (on
    Python 3.11 `asyncio.wait_for` returns the result of a call that completed as it was
    cancelled): the loop went on to sleep, and stop() returned with it still running after
    waiting five seconds for it."""
    engine = await connect("memory://")
    try:
        worker = engine.worker(worker_id="brief")
        await worker.start()
        loops = list(worker._tasks)
        await asyncio.sleep(0)  # the report loop is inside its first report
        await worker.stop()
        assert [t.get_name() for t in loops if not t.done()] == []
        # Each ended by its cancellation, none by running out its sleep first.
        assert [t.get_name() for t in loops if not t.cancelled()] == []
    finally:
        await engine.close()
