"""`/metrics` in the Prometheus text format: what the store says now (runs per task, version and
status; the oldest claimable run's age; the last hour's endings; workers by health), then every
metric of the process's default Prometheus registry, where the OpenTelemetry Prometheus
exporter puts the engine's own OpenTelemetry metrics (`umt dashboard` connects its engine with
one; an app that mounts the dashboard does so with its own `MeterProvider`).

The store is read once per scrape, before the text is made (the collectors only read that
snapshot), so a scrape costs the same few reads as the tasks page.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from umt_sdk._engine import Engine
from umt_sdk._insight import TaskStats, WorkerInfo
from umt_sdk._spi import InsightStore

__all__ = ["CONTENT_TYPE", "StoreMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Snapshot(Collector):
    def __init__(self) -> None:
        self.stats: Sequence[TaskStats] = ()
        self.workers: Sequence[WorkerInfo] = ()
        self.available = True

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily(
            "umt_store_insight_up",
            "1 when the backend reports workers and task activity (InsightStore), else 0",
        )
        up.add_metric([], 1.0 if self.available else 0.0)
        yield up
        runs = GaugeMetricFamily(
            "umt_runs_unfinished",
            "Runs pending, running or waiting, by task, version and status",
            labels=["task", "version", "status"],
        )
        age = GaugeMetricFamily(
            "umt_runs_oldest_pending_age_seconds",
            "How long the oldest claimable pending run has waited for a worker",
            labels=["task", "version"],
        )
        finished = GaugeMetricFamily(
            "umt_runs_finished_last_hour",
            "Runs finished in the last hour, by task, version and status",
            labels=["task", "version", "status"],
        )
        for s in self.stats:
            version = str(s.task_version)
            for status, n in (
                ("pending", s.pending),
                ("running", s.running),
                ("waiting", s.waiting),
            ):
                runs.add_metric([s.task_name, version, status], float(n))
            age.add_metric(
                [s.task_name, version],
                s.oldest_pending_age.total_seconds() if s.oldest_pending_age else 0.0,
            )
            for status, n in (
                ("completed", s.completed_last_hour),
                ("failed", s.failed_last_hour),
                ("canceled", s.canceled_last_hour),
            ):
                finished.add_metric([s.task_name, version, status], float(n))
        yield runs
        yield age
        yield finished
        workers = GaugeMetricFamily(
            "umt_workers", "Workers that reported, by health", labels=["health"]
        )
        for health in ("live", "silent", "stopped"):
            workers.add_metric([health], float(sum(w.health == health for w in self.workers)))
        yield workers


class StoreMetrics:
    """The `/metrics` text of one dashboard."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._snapshot = _Snapshot()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._snapshot)

    async def render(self) -> bytes:
        workers: list[WorkerInfo] = []
        stats: list[TaskStats] = []
        self._snapshot.available = isinstance(self.engine.backend, InsightStore)
        if self._snapshot.available:
            workers = await self.engine.workers()
            stats = await self.engine.task_stats()
        self._snapshot.workers, self._snapshot.stats = workers, stats
        return generate_latest(self._registry) + generate_latest(REGISTRY)
