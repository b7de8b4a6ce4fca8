"""What operators look at (`InsightStore`, optional): workers' reports, the load per pair, the
runs finished per time bucket, the concurrency keys in use; and listing runs by worker (the
`RunQuery.worker_id` filter every backend keeps)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest

from umt_sdk import Engine, TaskDefinition
from umt_sdk._insight import store_now
from umt_sdk.backend import (
    Backend,
    Ending,
    ErrorInfo,
    InsightStore,
    Lease,
    NewRun,
    TaskPair,
    WorkerState,
    new_run_id,
)
from umt_sdk.testing._contract._base import Job, Tally, eventually, steps_task

TASKS: tuple[TaskDefinition[Any, Any], ...] = ()
"""The topic runs the shared `contract.steps` task and stores the rest through the SPI."""

PAIR = TaskPair(name="contract.insight", version=1)
OTHER = TaskPair(name="contract.insight", version=2)
LONG = timedelta(seconds=60)


def _store(engine: Engine) -> InsightStore:
    backend = engine.backend
    if not isinstance(backend, InsightStore):
        pytest.skip(f"{type(backend).__name__} does not implement InsightStore (optional)")
    return backend


async def _enqueue(
    backend: Backend,
    pair: TaskPair = PAIR,
    *,
    delay: timedelta | None = None,
    key: str | None = None,
) -> UUID:
    run_id = new_run_id()
    await backend.enqueue(
        NewRun(
            run_id=run_id,
            task_name=pair.name,
            task_version=pair.version,
            input_json="null",
            input_hash="contract-insight",
            delay=delay,
            concurrency_key=key,
            concurrency_limit=None if key is None else 3,
        )
    )
    return run_id


async def _claim(
    backend: Backend, worker: str, pair: TaskPair = PAIR, limit: int = 1
) -> list[Lease]:
    claimed = await backend.claim(worker_id=worker, pairs=[pair], limit=limit, lease=LONG)
    return [
        Lease(run_id=c.run_id, fencing_token=c.fencing_token, worker_id=worker, duration=LONG)
        for c in claimed
    ]


def _state(worker_id: str, *, stopped: bool = False, held: int = 0, now: Any) -> WorkerState:
    return WorkerState(
        worker_id=worker_id,
        host="host-a",
        pid=4242,
        pairs=(PAIR, OTHER),
        concurrency=8,
        runs_held=held,
        started_at=now,
        stopped=stopped,
    )


class InsightContract:
    """Workers' reports, load counts and listing by worker agree on every backend."""

    async def test_a_worker_report_is_stored_replaced_and_forgotten(self, engine: Engine) -> None:
        store = _store(engine)
        now = store_now(engine.backend)
        await store.record_worker(_state("w-1", now=now, held=2))
        await store.record_worker(_state("w-2", now=now))
        await store.record_worker(_state("w-1", now=now, held=5))
        workers = {w.worker_id: w for w in await store.list_workers(limit=10)}
        assert set(workers) == {"w-1", "w-2"}
        assert len(await store.list_workers(limit=1)) == 1
        one = workers["w-1"]
        assert (one.host, one.pid, one.concurrency, one.runs_held) == ("host-a", 4242, 8, 5)
        assert list(one.pairs) == [PAIR, OTHER]
        assert one.stopped_at is None
        assert one.last_seen_at <= one.observed_at
        await store.record_worker(_state("w-2", now=now, stopped=True))
        stopped = {w.worker_id: w for w in await store.list_workers(limit=10)}["w-2"]
        assert stopped.stopped_at is not None
        forgotten = await store.forget_workers(seen_before=stopped.observed_at + timedelta(days=1))
        assert forgotten == 2
        assert list(await store.list_workers(limit=10)) == []

    async def test_a_worker_reports_itself_while_it_runs_and_says_goodbye(
        self, engine: Engine
    ) -> None:
        _store(engine)
        worker = engine.worker(worker_id="contract-reporter", versions=[steps_task])
        async with worker:

            async def listed() -> bool:
                return any(w.worker_id == "contract-reporter" for w in await engine.workers())

            await eventually(listed)
            (info,) = [w for w in await engine.workers() if w.worker_id == "contract-reporter"]
            assert info.health == "live"
            assert list(info.pairs) == [steps_task.pair]
        (after,) = [w for w in await engine.workers() if w.worker_id == "contract-reporter"]
        assert after.health == "stopped"

    async def test_runs_are_listed_by_the_worker_that_executed_them(self, engine: Engine) -> None:
        backend = engine.backend
        mine = await _enqueue(backend)
        theirs = await _enqueue(backend)
        (lease,) = await _claim(backend, "worker-a")
        assert lease.run_id == mine
        (other,) = await _claim(backend, "worker-b")
        assert other.run_id == theirs
        # worker-a's lease is taken over by worker-c: the run is listed for both.
        await backend.end_execution(lease, Ending(status="pending", outcome="released"))
        (again,) = await _claim(backend, "worker-c")
        assert again.run_id == mine
        listed = {
            worker: [r.run_id for r in await engine.list(worker_id=worker)]
            for worker in ("worker-a", "worker-b", "worker-c", "nobody")
        }
        assert listed == {
            "worker-a": [mine],
            "worker-b": [theirs],
            "worker-c": [mine],
            "nobody": [],
        }
        tagged = await engine.list(worker_id="worker-a", task_name=PAIR.name, tags={})
        assert [r.run_id for r in tagged] == [mine]

    async def test_the_unfinished_runs_are_counted_per_pair(self, engine: Engine) -> None:
        store = _store(engine)
        backend = engine.backend
        for _ in range(3):
            await _enqueue(backend)
        await _enqueue(backend, delay=timedelta(hours=1))  # pending, but not due yet
        await _enqueue(backend, OTHER)
        leases = await _claim(backend, "worker-a", limit=2)
        await backend.end_execution(
            leases[0],
            Ending(status="waiting", outcome="waiting", wait_for="go"),
        )
        activity = {(a.task_name, a.task_version): a for a in await store.pair_activity()}
        mine = activity[(PAIR.name, PAIR.version)]
        assert (mine.pending, mine.running, mine.waiting) == (2, 1, 1)
        assert mine.oldest_due_at is not None
        assert mine.oldest_due_at <= mine.observed_at
        other = activity[(OTHER.name, OTHER.version)]
        assert (other.pending, other.running, other.waiting) == (1, 0, 0)
        delayed_only = await _enqueue(
            backend, TaskPair(name="contract.insight.later", version=1), delay=timedelta(hours=1)
        )
        assert delayed_only
        later = {(a.task_name, a.task_version): a for a in await store.pair_activity()}[
            ("contract.insight.later", 1)
        ]
        assert later.pending == 1
        assert later.oldest_due_at is None

    async def test_finished_runs_are_counted_per_status_and_bucket(self, engine: Engine) -> None:
        store = _store(engine)
        backend = engine.backend
        for _ in range(3):
            await _enqueue(backend)
        leases = await _claim(backend, "worker-a", limit=3)
        await backend.end_execution(
            leases[0], Ending(status="completed", outcome="completed", output_json="1")
        )
        await backend.end_execution(
            leases[1], Ending(status="completed", outcome="completed", output_json="2")
        )
        await backend.end_execution(
            leases[2],
            Ending(
                status="failed",
                outcome="failed",
                error=ErrorInfo(type="ValueError", message="no"),
                count_failure=True,
            ),
        )
        now = store_now(backend)
        since = now - timedelta(minutes=30)
        counts = await store.finished_counts(since=since, bucket=timedelta(minutes=5))
        mine = [c for c in counts if (c.task_name, c.task_version) == (PAIR.name, PAIR.version)]
        by_status: dict[str, int] = {}
        for count in mine:
            by_status[count.status] = by_status.get(count.status, 0) + count.runs
            offset = count.bucket_start - since
            assert offset >= timedelta(0)
            assert offset % timedelta(minutes=5) == timedelta(0)
        assert by_status == {"completed": 2, "failed": 1}
        later = await store.finished_counts(
            since=now + timedelta(minutes=1), bucket=timedelta(minutes=5)
        )
        assert [c for c in later if c.task_name == PAIR.name] == []

    async def test_the_concurrency_keys_in_use_are_listed_with_their_counts(
        self, engine: Engine
    ) -> None:
        store = _store(engine)
        backend = engine.backend
        for _ in range(4):
            await _enqueue(backend, key="tenant-1")
        await _enqueue(backend, key="tenant-2")
        leases = await _claim(backend, "worker-a", limit=10)
        assert len(leases) == 4  # three of tenant-1 (its limit) and tenant-2's one
        usage = {
            u.concurrency_key: u
            for u in await store.key_usage(limit=100)
            if u.task_name == PAIR.name
        }
        assert (usage["tenant-1"].limit, usage["tenant-1"].holding, usage["tenant-1"].wanting) == (
            3,
            3,
            1,
        )
        assert (usage["tenant-2"].holding, usage["tenant-2"].wanting) == (1, 0)
        for lease in leases:
            await backend.end_execution(
                lease, Ending(status="completed", outcome="completed", output_json="null")
            )
        await asyncio.sleep(0)
        left = [u for u in await store.key_usage(limit=100) if u.task_name == PAIR.name]
        assert [(u.concurrency_key, u.holding, u.wanting) for u in left] == [("tenant-1", 0, 1)]

    async def test_task_stats_put_the_counts_together(self, engine: Engine, tally: Tally) -> None:
        _store(engine)
        run = await engine.enqueue(steps_task, Job(key="insight-stats"))
        async with engine.worker(versions=[steps_task], worker_id="stats-worker"):
            await run.result(timeout=30)

            async def served() -> bool:
                stats = {s.pair: s for s in await engine.task_stats()}
                return "stats-worker" in stats[steps_task.pair].workers

            await eventually(served)
        stats = {s.pair: s for s in await engine.task_stats()}[steps_task.pair]
        assert stats.completed_last_hour >= 1
        assert sum(stats.finished_per_bucket) == stats.completed_last_hour + stats.failed_last_hour
        assert stats.failure_rate == stats.failed_last_hour / (
            stats.completed_last_hour + stats.failed_last_hour
        )
        assert len(stats.finished_per_bucket) == 12
