"""What operators look at: the workers (live, stopped, or silent), and each task's load over the
last hour. The store counts (`InsightStore`); the SDK decides what the counts mean: when a
worker that stopped reporting is silent, the hour's buckets, the failure rate, which workers
serve a pair.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Literal

from attrs import frozen

from umt_sdk._spi import Backend, InsightStore, TaskPair, WorkerRecord, WorkerState
from umt_sdk.exceptions import UsageError

__all__ = [
    "BUCKET",
    "BUCKETS",
    "WORKER_FORGOTTEN_AFTER",
    "WORKER_REPORT_INTERVAL",
    "WORKER_SILENT_AFTER",
    "TaskStats",
    "WorkerInfo",
    "insight_store",
    "store_now",
    "task_stats",
    "worker_infos",
    "worker_state",
]

WORKER_REPORT_INTERVAL = timedelta(seconds=5)
"""How often a worker reports itself (`InsightStore.record_worker`)."""
WORKER_SILENT_AFTER = timedelta(seconds=30)
"""A worker not heard from for this long, that did not say it stopped, is `silent`: it
crashed, froze or lost the database (six reports missed)."""
WORKER_FORGOTTEN_AFTER = timedelta(days=7)
"""A worker's report older than this is deleted (by any worker, about once an hour): the
workers page shows a stopped or silent worker for a week."""
BUCKET = timedelta(minutes=5)
BUCKETS = 12
"""The last hour, in 5-minute buckets (the newest one still filling)."""

WorkerHealth = Literal["live", "stopped", "silent"]


def insight_store(backend: Backend, call: str) -> InsightStore:
    """The backend as an `InsightStore`, or a `UsageError` saying it cannot answer `call`."""
    if not isinstance(backend, InsightStore):
        raise UsageError(
            f"{call}: this backend ({type(backend).__name__}) does not report workers and task "
            "activity (umt_sdk.backend.InsightStore); the memory and Postgres backends do",
            argument="backend",
        )
    return backend


def store_now(backend: Backend) -> datetime:
    """The backend's clock (a test's FakeClock), else the wall clock."""
    clock = backend.clock
    return clock.now() if clock is not None else datetime.now(UTC)


def worker_state(
    *,
    worker_id: str,
    pairs: Sequence[TaskPair],
    concurrency: int,
    runs_held: int,
    started_at: datetime,
    stopped: bool = False,
) -> WorkerState:
    """What a worker of this process reports of itself."""
    return WorkerState(
        worker_id=worker_id,
        host=socket.gethostname(),
        pid=os.getpid(),
        pairs=tuple(pairs),
        concurrency=concurrency,
        runs_held=runs_held,
        started_at=started_at,
        stopped=stopped,
    )


@frozen(kw_only=True)
class WorkerInfo:
    """A worker as operators see it (`engine.workers()`)."""

    worker_id: str
    host: str
    pid: int
    pairs: Sequence[TaskPair]
    """The (task, version) pairs it serves."""
    concurrency: int
    runs_held: int
    """Runs it was executing at its last report."""
    started_at: datetime
    last_seen_at: datetime
    stopped_at: datetime | None
    health: WorkerHealth
    """`live`: reported within `WORKER_SILENT_AFTER`; `stopped`: it said it stopped (a clean
    shutdown); `silent`: it stopped reporting without saying so (crashed, frozen, cut off from
    the database): the runs it held are taken over once their leases lapse."""
    silent_for: timedelta
    """How long since its last report, at the read."""


def _info(record: WorkerRecord) -> WorkerInfo:
    silent_for = max(record.observed_at - record.last_seen_at, timedelta(0))
    health: WorkerHealth
    if record.stopped_at is not None:
        health = "stopped"
    elif silent_for > WORKER_SILENT_AFTER:
        health = "silent"
    else:
        health = "live"
    return WorkerInfo(
        worker_id=record.worker_id,
        host=record.host,
        pid=record.pid,
        pairs=tuple(record.pairs),
        concurrency=record.concurrency,
        runs_held=record.runs_held,
        started_at=record.started_at,
        last_seen_at=record.last_seen_at,
        stopped_at=record.stopped_at,
        health=health,
        silent_for=silent_for,
    )


async def worker_infos(store: InsightStore, *, limit: int) -> list[WorkerInfo]:
    """The workers that reported, the most recently seen first."""
    return [_info(r) for r in await store.list_workers(limit=limit)]


@frozen(kw_only=True)
class TaskStats:
    """One (task, version) pair's load (`engine.task_stats()`)."""

    task_name: str
    task_version: int
    pending: int
    running: int
    waiting: int
    completed_last_hour: int
    failed_last_hour: int
    canceled_last_hour: int
    finished_per_bucket: Sequence[int]
    """Runs finished (completed or failed) per `BUCKET` of the last hour, oldest first."""
    failed_per_bucket: Sequence[int]
    """Of those, the failed ones."""
    oldest_pending_age: timedelta | None
    """How long the oldest claimable pending run has waited (None: none waits)."""
    workers: Sequence[str]
    """The live workers that serve the pair."""
    bucket_starts: Sequence[datetime] = ()

    @property
    def pair(self) -> TaskPair:
        return TaskPair(name=self.task_name, version=self.task_version)

    @property
    def failure_rate(self) -> float | None:
        """Failed / (completed + failed) over the last hour; None with no run finished."""
        finished = self.completed_last_hour + self.failed_last_hour
        return None if finished == 0 else self.failed_last_hour / finished

    @property
    def throughput_per_minute(self) -> float:
        """Runs finished (completed or failed) per minute over the last hour."""
        return (self.completed_last_hour + self.failed_last_hour) / 60.0


def hour_buckets(now: datetime) -> list[datetime]:
    """The starts of the last hour's buckets, oldest first, the newest holding `now`."""
    epoch = datetime(2000, 1, 1, tzinfo=UTC)
    current = epoch + BUCKET * ((now - epoch) // BUCKET)
    return [current - BUCKET * i for i in range(BUCKETS - 1, -1, -1)]


async def task_stats(
    store: InsightStore,
    *,
    now: datetime,
    known: Sequence[TaskPair] = (),
    workers: Sequence[WorkerInfo] = (),
) -> list[TaskStats]:
    """Every pair with unfinished runs, runs finished in the last hour, or in `known` (a
    registry's pairs), by task name then version."""
    starts = hour_buckets(now)
    index = {start: i for i, start in enumerate(starts)}
    activity = {(a.task_name, a.task_version): a for a in await store.pair_activity()}
    finished: dict[tuple[str, int], dict[str, list[int]]] = {}
    for count in await store.finished_counts(since=starts[0], bucket=BUCKET):
        slot = index.get(count.bucket_start.astimezone(UTC))
        if slot is None:
            continue
        per_status = finished.setdefault(
            (count.task_name, count.task_version),
            {s: [0] * BUCKETS for s in ("completed", "failed", "canceled")},
        )
        # A compensated run failed (and undid its steps): counted with the failures.
        status = "failed" if count.status == "compensated" else count.status
        per_status[status][slot] += count.runs
    pairs = sorted(set(activity) | set(finished) | {(p.name, p.version) for p in known})
    serving: dict[tuple[str, int], list[str]] = {}
    for worker in workers:
        if worker.health != "live":
            continue
        for p in worker.pairs:
            serving.setdefault((p.name, p.version), []).append(worker.worker_id)
    stats: list[TaskStats] = []
    for name, version in pairs:
        open_runs = activity.get((name, version))
        counts = finished.get(
            (name, version), {s: [0] * BUCKETS for s in ("completed", "failed", "canceled")}
        )
        oldest = None
        if open_runs is not None and open_runs.oldest_due_at is not None:
            oldest = max(open_runs.observed_at - open_runs.oldest_due_at, timedelta(0))
        stats.append(
            TaskStats(
                task_name=name,
                task_version=version,
                pending=open_runs.pending if open_runs else 0,
                running=open_runs.running if open_runs else 0,
                waiting=open_runs.waiting if open_runs else 0,
                completed_last_hour=sum(counts["completed"]),
                failed_last_hour=sum(counts["failed"]),
                canceled_last_hour=sum(counts["canceled"]),
                finished_per_bucket=tuple(
                    c + f for c, f in zip(counts["completed"], counts["failed"], strict=True)
                ),
                failed_per_bucket=tuple(counts["failed"]),
                oldest_pending_age=oldest,
                workers=tuple(sorted(serving.get((name, version), []))),
                bucket_starts=tuple(starts),
            )
        )
    return stats
