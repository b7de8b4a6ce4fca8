"""The worker: claim runs of its (name, version) pairs, execute them, heartbeat their leases."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from umt_sdk._execution import Execution
from umt_sdk._spi import Backend, Beat, ClaimedRun, TaskPair
from umt_sdk._telemetry import Telemetry
from umt_sdk.exceptions import BackendError, TaskDefinitionError

if TYPE_CHECKING:
    from umt_sdk._task import Registry

__all__ = ["Worker"]

_log = logging.getLogger("umt.worker")


def _default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Worker:
    """Serves runs of some (name, version) pairs. Use as `async with engine.worker(...)`.

    Claims up to `concurrency` runs at once; each claim gets a lease of `lease` that a heartbeat
    renews every `min(lease / 3, 1 s)`. A heartbeat also names the step each run is in (for
    the timeline of an attempt cut off by a crash); a step still running a quarter interval
    (at most 250 ms) after it started, that no heartbeat named yet, brings the next heartbeat
    forward: one statement for all the worker's runs, none for steps shorter than that.
    Stopping (leaving the `async with`) stops claiming,
    lets running handlers reach their next step boundary for up to `shutdown_grace`, and
    gives back the runs still held.
    """

    def __init__(
        self,
        *,
        backend: Backend,
        registry: Registry,
        pairs: Sequence[TaskPair],
        concurrency: int = 16,
        lease: timedelta = timedelta(seconds=10),
        worker_id: str | None = None,
        poll_interval: timedelta = timedelta(seconds=1),
        shutdown_grace: timedelta = timedelta(seconds=10),
        telemetry: Telemetry | None = None,
    ) -> None:
        if concurrency < 1:
            raise TaskDefinitionError(f"worker concurrency must be >= 1, got {concurrency}")
        if lease < timedelta(milliseconds=100):
            raise TaskDefinitionError(f"worker lease must be at least 100 ms, got {lease}")
        self.backend = backend
        self.telemetry = telemetry or Telemetry()
        self.registry = registry
        self.pairs = list(pairs)
        self.concurrency = concurrency
        self.lease = lease
        self.worker_id = worker_id or _default_worker_id()
        self.poll_interval = poll_interval
        self.shutdown_grace = shutdown_grace
        self.heartbeat_interval = min(lease / 3, timedelta(seconds=1))
        self._executions: dict[UUID, Execution] = {}
        self._slot_freed = asyncio.Event()
        self._step_started = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._heartbeats_paused = False
        self._remove_listener: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.crashed = False

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Begin claiming and heartbeating."""
        if self._tasks:
            return
        self._loop = asyncio.get_running_loop()
        self._remove_listener = self.backend.add_cancel_listener(self._on_cancel)
        self._tasks = [
            asyncio.create_task(self._claim_loop(), name=f"umt-claim-{self.worker_id}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"umt-heartbeat-{self.worker_id}"),
            asyncio.create_task(self._depth_loop(), name=f"umt-depths-{self.worker_id}"),
        ]

    async def stop(self, *, grace: timedelta | None = None) -> None:
        """Stop claiming; let handlers reach a step boundary; give back what is still held."""
        self._stopping = True
        self._slot_freed.set()
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None
        grace = self.shutdown_grace if grace is None else grace
        running = [e.task for e in self._executions.values() if e.task is not None]
        if running and not self.crashed:
            for execution in list(self._executions.values()):
                execution.abort("shutdown", "worker shutting down")
            _, pending = await asyncio.wait(running, timeout=grace.total_seconds())
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)
        for task in self._tasks:
            task.cancel()
        # Bounded: a driver may turn a cancellation into an error of its own (psycopg does),
        # so the loops also check `_stopping`; never hang a shutdown on one of them.
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        self._tasks = []

    # -- testing hooks (used through umt_sdk.testing) -----------------------------------------

    def _simulate_crash(self) -> None:
        """Vanish like a SIGKILLed process: no more writes, leases left to expire."""
        self.crashed = True
        self._stopping = True
        for execution in list(self._executions.values()):
            execution.abort("crash", "simulated crash")
        for task in self._tasks:
            task.cancel()

    def _pause_heartbeats(self, paused: bool) -> None:
        self._heartbeats_paused = paused

    @property
    def running_runs(self) -> list[UUID]:
        """The runs this worker is executing now."""
        return list(self._executions)

    # -- loops ----------------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        failures = 0
        while not self._stopping:
            free = self.concurrency - len(self._executions)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                claimed = await self.backend.claim(
                    worker_id=self.worker_id, pairs=self.pairs, limit=free, lease=self.lease
                )
                failures = 0
            except BackendError as exc:
                failures += 1
                delay = min(0.1 * 2**failures, 5.0)
                _log.warning("claim failed (%s); retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                continue
            if self._stopping:
                for run in claimed:  # claimed while stopping: give back at once
                    self._spawn(run)
                    self._executions[run.run_id].abort("shutdown", "worker shutting down")
                return
            for run in claimed:
                self._spawn(run)
            # A short batch may only mean that a concurrent claim took some candidates: ask
            # again at once, and wait only when a claim finds nothing.
            if not claimed:
                await self.backend.wait_for_work(
                    pairs=self.pairs, timeout=self.poll_interval.total_seconds()
                )

    def _spawn(self, claimed: ClaimedRun) -> None:
        assert self._loop is not None
        definition = self.registry.get(claimed.task_name, claimed.task_version)
        execution = Execution(
            backend=self.backend,
            claimed=claimed,
            definition=definition,
            worker_id=self.worker_id,
            lease_duration=self.lease,
            loop=self._loop,
            telemetry=self.telemetry,
        )
        execution.on_step_start = self._step_started.set
        self._executions[claimed.run_id] = execution
        task = asyncio.create_task(execution.execute(), name=f"umt-run-{claimed.run_id}")
        execution.task = task

        def done(_: asyncio.Task[None]) -> None:
            if self._executions.get(claimed.run_id) is execution:
                del self._executions[claimed.run_id]
            self._slot_freed.set()
            if not task.cancelled() and task.exception() is not None:
                _log.error(
                    "execution of run %s ended with an unexpected error",
                    claimed.run_id,
                    exc_info=task.exception(),
                )

        task.add_done_callback(done)

    async def _until_next_beat(self, interval: float) -> None:
        """Sleep until the next heartbeat is due: `interval` after the last one, or sooner when
        a step that started has run a quarter interval (at most 250 ms) and no heartbeat has
        named it yet."""
        loop = asyncio.get_running_loop()
        due = loop.time() + interval
        prompt = min(interval / 4, 0.25)
        while not self._stopping:
            remaining = due - loop.time()
            if remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._step_started.wait(), remaining)
            if not self._step_started.is_set():
                continue
            self._step_started.clear()
            await asyncio.sleep(max(0.0, min(prompt, due - loop.time())))
            if any(e.needs_step_beat() for e in list(self._executions.values())):
                return

    async def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_interval.total_seconds()
        while not self._stopping:
            await self._until_next_beat(interval)
            if self._heartbeats_paused:
                continue
            live = [e for e in self._executions.values() if not e.stopped and not e.letting_go]
            if not live:
                continue
            steps = [e.step_for_beat() for e in live]
            beats = [
                Beat(
                    run_id=e.claimed.run_id,
                    fencing_token=e.lease.fencing_token,
                    current_step=step[0] if step else None,
                    step_started_at=step[1] if step else None,
                )
                for e, step in zip(live, steps, strict=True)
            ]
            try:
                result = await self.backend.heartbeat(
                    worker_id=self.worker_id, beats=beats, lease=self.lease
                )
            except BackendError as exc:
                _log.warning("heartbeat failed (%s); leases may expire", exc)
                continue
            for execution, step in zip(live, steps, strict=True):
                execution.beaten_step = step
            for execution in live:
                run_id = execution.claimed.run_id
                if execution.letting_go:
                    continue  # it handed the run back while the heartbeat was on its way
                if run_id in result.lost:
                    _log.warning("lost the lease of run %s; stopping its execution", run_id)
                    self.telemetry.lease_expirations.add(1, execution.attributes)
                    execution.abort("lease_lost", "lease lost: another attempt holds the run")
                elif run_id in result.cancel_requested:
                    execution.abort("cancel", result.cancel_requested[run_id] or "canceled")

    async def _depth_loop(self) -> None:
        """Refresh the queue-depth gauge of this worker's pairs (cheap, every 10 s)."""
        while not self._stopping:
            try:
                self.telemetry.set_depths(await self.backend.queue_depths(self.pairs))
            except BackendError as exc:
                _log.debug("queue depth refresh failed: %s", exc)
            await asyncio.sleep(10)

    def _on_cancel(self, run_id: UUID, reason: str) -> None:
        execution = self._executions.get(run_id)
        if execution is not None:
            execution.abort("cancel", reason or "canceled")
