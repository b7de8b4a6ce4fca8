"""The worker: claim runs of its (name, version) pairs, execute them, heartbeat their leases."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._execution import Execution
from umt_sdk._insight import (
    WORKER_FORGOTTEN_AFTER,
    WORKER_REPORT_INTERVAL,
    store_now,
    worker_state,
)
from umt_sdk._spi import Backend, ClaimedRun, ControllableClock, InsightStore, TaskPair
from umt_sdk._task import Registry
from umt_sdk._telemetry import Telemetry
from umt_sdk.exceptions import BackendError, BackendUnavailableError

if TYPE_CHECKING:
    from umt_sdk._events import EventStarter
    from umt_sdk._retention import Pruner
    from umt_sdk._schedules import Schedules

__all__ = ["Worker"]

T = TypeVar("T")

_log = logging.getLogger("umt.worker")

MAX_CONCURRENCY = 10_000
"""The most runs one worker executes at once (each may hold two threads)."""

# The shortest time between two heartbeats that cancel hints asked for: a flood of hints (a
# forged NOTIFY storm, say) costs the database at most this rate of heartbeat statements.
_MIN_LOOK_INTERVAL = 0.05


class _Outage:
    """Log a loop's failures once per outage (not once per retry), and its recovery."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.since: float | None = None
        self.failures = 0

    def failed(self, exc: BaseException, retry_in: float) -> None:
        self.failures += 1
        if self.since is None:
            self.since = time.monotonic()
            # A BackendError is an outage the loop waits out. A FencingError is not one of them
            # (claims and heartbeats are not fenced: a lost lease comes back in `lost`), so
            # like any other error it is logged with its traceback.
            unexpected = not isinstance(exc, BackendError)
            _log.log(
                logging.ERROR if unexpected else logging.WARNING,
                "%s failed (%s: %s); retrying with backoff (up to 5 s) until it works",
                self.what,
                type(exc).__name__,
                exc,
                exc_info=exc if unexpected else None,
            )
        else:
            _log.debug("%s failed again (%s); retrying in %.1f s", self.what, exc, retry_in)

    def succeeded(self) -> None:
        if self.since is not None:
            _log.info(
                "%s works again after %.1f s (%d failed attempts)",
                self.what,
                time.monotonic() - self.since,
                self.failures,
            )
        self.since = None
        self.failures = 0

    def backoff(self) -> float:
        return float(min(0.1 * 2**self.failures, 5.0))


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
        schedules: Schedules[Any] | None = None,
        pruner: Pruner | None = None,
        prune_interval: timedelta = timedelta(minutes=1),
        events: EventStarter | None = None,
        event_interval: timedelta = timedelta(seconds=30),
    ) -> None:
        check.integer(
            concurrency,
            "concurrency",
            at_least=1,
            at_most=MAX_CONCURRENCY,
            expected=f">= 1 (an integer, at most {MAX_CONCURRENCY})",
            where="worker",
        )
        check.duration(
            lease,
            "lease",
            at_least=timedelta(milliseconds=100),
            expected="at least 100 ms (a timedelta such as timedelta(seconds=10), at most "
            "36500 days)",
            where="worker",
        )
        if worker_id is not None:
            check.text(worker_id, "worker_id", empty=False, max_length=200, where="worker")
            if _serde.clean_text(worker_id) != worker_id:
                check.refuse(
                    "worker_id",
                    "text a database can store (no NUL, no lone surrogate)",
                    worker_id,
                    where="worker",
                )
        check.duration(poll_interval, "poll_interval", positive=True, where="worker")
        check.duration(shutdown_grace, "shutdown_grace", where="worker")
        check.duration(prune_interval, "prune_interval", positive=True, where="worker")
        check.duration(event_interval, "event_interval", positive=True, where="worker")
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
        self._look_now = asyncio.Event()
        """Set by a cancel hint: heartbeat now (the heartbeat reads the runs' cancel state)."""
        self._remove_listener: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Plain handlers, plain step bodies and `check=` functions run here, never in the
        # loop's default pool (min(32, cores + 4) threads): a plain handler holds a thread
        # while its plain step needs another, so at most two per slot, and a pool smaller than
        # that deadlocks once every thread is a handler waiting for its step.
        self._threads = ThreadPoolExecutor(
            max_workers=2 * concurrency + 4, thread_name_prefix="umt-worker"
        )
        self.crashed = False
        self.schedules = schedules if schedules is not None and schedules.supported else None
        """Whose due ticks this worker starts (the scheduler loop), for the tasks it serves."""
        self.pruner = pruner
        """What deletes old finished runs in the background (None: no retention)."""
        self.prune_interval = prune_interval
        self.events = events
        """What starts the served subscribers' events they have no run for (None: none)."""
        self.event_interval = event_interval
        self._started_at = datetime.now(UTC)

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        """Started and not yet stopped: it claims runs."""
        return bool(self._tasks) and not self._stopping

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
        if self.schedules is not None:
            self._tasks.append(
                asyncio.create_task(
                    self._schedule_loop(self.schedules), name=f"umt-schedules-{self.worker_id}"
                )
            )
        if self.pruner is not None:
            self._tasks.append(
                asyncio.create_task(
                    self._prune_loop(self.pruner), name=f"umt-prune-{self.worker_id}"
                )
            )
        if self.events is not None:
            self._tasks.append(
                asyncio.create_task(
                    self._event_loop(self.events), name=f"umt-events-{self.worker_id}"
                )
            )
        if isinstance(self.backend, InsightStore):
            self._started_at = store_now(self.backend)
            self._tasks.append(
                asyncio.create_task(
                    self._report_loop(self.backend), name=f"umt-report-{self.worker_id}"
                )
            )

    async def stop(self, *, grace: timedelta | None = None) -> None:
        """Stop claiming; let handlers reach a step boundary; give back what is still held."""
        if grace is not None:
            check.duration(grace, "grace", where="Worker.stop()")
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
        if self._tasks and isinstance(self.backend, InsightStore) and not self.crashed:
            await self._report(self.backend, stopped=True)
        self._tasks = []
        # Threads still running a handler that ignored the shutdown finish on their own.
        self._threads.shutdown(wait=False)

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

    # Each loop survives any failure of the backend (a restart, a cut connection, an error of
    # its own): it logs once per outage, backs off (capped) and resumes. Only `_stopping` or a
    # cancellation ends it.

    async def _claim_loop(self) -> None:
        outage = _Outage("claiming runs")
        while not self._stopping:
            free = self.concurrency - len(self._executions)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            started = time.monotonic()
            try:
                claimed = await self._within_lease(
                    "claiming runs",
                    self.backend.claim(
                        worker_id=self.worker_id, pairs=self.pairs, limit=free, lease=self.lease
                    ),
                )
                outage.succeeded()
            except Exception as exc:
                if self._stopping:
                    return
                delay = outage.backoff()
                outage.failed(exc, delay)
                await asyncio.sleep(delay)
                continue
            if self._stopping:
                for run in claimed:  # claimed while stopping: give back at once
                    self._spawn(run, started)
                    self._executions[run.run_id].abort("shutdown", "worker shutting down")
                return
            for run in claimed:
                self._spawn(run, started)
            # A short batch may only mean that a concurrent claim took some candidates: ask
            # again at once, and wait only when a claim finds nothing.
            if not claimed:
                try:
                    await self.backend.wait_for_work(
                        pairs=self.pairs, timeout=self.poll_interval.total_seconds()
                    )
                except Exception as exc:  # a backend's wait is a hint too: poll instead
                    _log.debug("waiting for work failed (%s); polling", exc)
                    await asyncio.sleep(self.poll_interval.total_seconds())

    def _spawn(self, claimed: ClaimedRun, claim_started: float) -> None:
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
            threads=self._threads,
            claim_started=claim_started,
            on_step_start=self._step_started.set,
        )
        self._executions[claimed.run_id] = execution
        task = execution.start()

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

    async def _next_beat(self, interval: float, last: float) -> None:
        """Wait for the next heartbeat: `interval` after the last one, or sooner when a cancel
        hint asks to look (but never within `_MIN_LOOK_INTERVAL` of the last one), or when a
        step that started has run a quarter interval (at most 250 ms) and no heartbeat has
        named it yet."""
        prompt = min(interval / 4, 0.25)
        while not self._stopping and not self._look_now.is_set():
            remaining = interval - (time.monotonic() - last)
            if remaining <= 0:
                break
            waits = {
                asyncio.ensure_future(self._look_now.wait()),
                asyncio.ensure_future(self._step_started.wait()),
            }
            try:
                await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waits:
                    waiter.cancel()
                await asyncio.gather(*waits, return_exceptions=True)
            if self._look_now.is_set() or not self._step_started.is_set():
                continue
            self._step_started.clear()
            await asyncio.sleep(max(0.0, min(prompt, interval - (time.monotonic() - last))))
            if any(e.needs_step_beat() for e in list(self._executions.values())):
                break
        early = _MIN_LOOK_INTERVAL - (time.monotonic() - last)
        if early > 0:
            await asyncio.sleep(early)
        self._look_now.clear()

    async def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_interval.total_seconds()
        outage = _Outage("heartbeat")
        last = time.monotonic()
        while not self._stopping:
            await self._next_beat(interval, last)
            last = time.monotonic()
            if self._heartbeats_paused:
                continue
            self._stop_expired_leases()
            beating = [(e, b) for e in self._executions.values() if (b := e.beat()) is not None]
            if not beating:
                continue
            try:
                result = await self._within_lease(
                    "heartbeat",
                    self.backend.heartbeat(
                        worker_id=self.worker_id,
                        beats=[beat for _, beat in beating],
                        lease=self.lease,
                    ),
                )
                outage.succeeded()
            except Exception as exc:  # leases may expire meanwhile; fencing keeps that safe
                if self._stopping:
                    return
                outage.failed(exc, interval)
                self._stop_expired_leases()
                continue
            for execution, _ in beating:
                execution.heard(result)

    async def _within_lease(self, what: str, call: Awaitable[T]) -> T:
        """A backend call of the worker's own loops, answered within the lease or given up: a
        connection that went silent (a dropped NAT or firewall entry) must not hold the
        worker forever. The backend's driver cleans up the connection it leaves."""
        try:
            async with asyncio.timeout(self.lease.total_seconds()):
                return await call
        except TimeoutError:
            raise BackendUnavailableError(
                f"{what} got no answer within the lease ({self.lease.total_seconds():g} s)"
            ) from None

    def _stop_expired_leases(self) -> None:
        """Every execution whose lease no heartbeat renewed in time stops (see
        `Execution.check_lease`)."""
        now = time.monotonic()
        for execution in list(self._executions.values()):
            execution.check_lease(now)

    async def _report(self, store: InsightStore, *, stopped: bool = False) -> None:
        """Tell the store who this worker is (for operators); never fails the worker."""
        state = worker_state(
            worker_id=self.worker_id,
            pairs=self.pairs,
            concurrency=self.concurrency,
            runs_held=len(self._executions),
            started_at=self._started_at,
            stopped=stopped,
        )
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
            # that arrives as the call completes (an in-memory store completes at once), and a
            # stop() then waited out the loop's next sleep.
            async with asyncio.timeout(5):
                await store.record_worker(state)
        except Exception as exc:
            _log.debug("worker report failed: %s", exc)

    async def _report_loop(self, store: InsightStore) -> None:
        """Report this worker every `WORKER_REPORT_INTERVAL` (the workers page reads it), and
        about once an hour forget the workers not heard from for `WORKER_FORGOTTEN_AFTER`."""
        forget_every = int(timedelta(hours=1) / WORKER_REPORT_INTERVAL)
        reports = 0
        while not self._stopping:
            await self._report(store)
            if reports % forget_every == 0:
                try:
                    seen_before = store_now(self.backend) - WORKER_FORGOTTEN_AFTER
                    async with asyncio.timeout(5):
                        await store.forget_workers(seen_before=seen_before)
                except Exception as exc:
                    _log.debug("forgetting old workers failed: %s", exc)
            reports += 1
            await asyncio.sleep(WORKER_REPORT_INTERVAL.total_seconds())

    async def _depth_loop(self) -> None:
        """Refresh the queue-depth gauge of this worker's pairs (cheap, every 10 s)."""
        while not self._stopping:
            try:
                self.telemetry.set_depths(await self.backend.queue_depths(self.pairs))
            except Exception as exc:
                _log.debug("queue depth refresh failed: %s", exc)
            await asyncio.sleep(10)

    async def _schedule_loop(self, schedules: Schedules[Any]) -> None:
        """The scheduler loop: store the declared schedules of the tasks this worker serves,
        then start the runs of their due ticks every poll interval (at once when a test's
        clock moves). Every worker runs it; the ticks' keys make one run per tick."""
        names = sorted({pair.name for pair in self.pairs})
        outage = _Outage("starting scheduled runs")
        moved = asyncio.Event()
        clock = self.backend.clock
        loop = asyncio.get_running_loop()
        unsubscribe = None

        def wake() -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(moved.set)

        if isinstance(clock, ControllableClock):
            unsubscribe = clock.subscribe(wake)
        declared = False
        try:
            while not self._stopping:
                delay = self.poll_interval.total_seconds()
                try:
                    if not declared:
                        await schedules.declare(task_names=names)
                        declared = True
                    await schedules.run_due(task_names=names)
                    outage.succeeded()
                except Exception as exc:
                    if self._stopping:
                        return
                    delay = outage.backoff()
                    outage.failed(exc, delay)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await moved.wait()
                moved.clear()
        finally:
            if unsubscribe is not None:
                unsubscribe()

    async def _prune_loop(self, pruner: Pruner) -> None:
        """The retention loop: a pass every `prune_interval` (at once when a test's clock
        moves). Every worker runs it; the store lets one pruner at a time delete, and a
        worker that finds another at work skips its turn."""
        outage = _Outage("deleting old finished runs")
        moved = asyncio.Event()
        clock = self.backend.clock
        loop = asyncio.get_running_loop()
        unsubscribe = None

        def wake() -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(moved.set)

        if isinstance(clock, ControllableClock):
            unsubscribe = clock.subscribe(wake)
        try:
            while not self._stopping:
                delay = self.prune_interval.total_seconds()
                try:
                    done = await pruner.run_pass()
                    if done["pruned"] or done["forgotten"]:
                        _log.info(
                            "retention deleted %d finished runs and %d tombstones",
                            done["pruned"],
                            done["forgotten"],
                        )
                    outage.succeeded()
                except Exception as exc:
                    if self._stopping:
                        return
                    # The backoff the log announces, not a whole interval (an hour, say)
                    # with the runs left undeleted; after a success, the interval again.
                    delay = min(delay, outage.backoff())
                    outage.failed(exc, delay)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await moved.wait()
                moved.clear()
        finally:
            if unsubscribe is not None:
                unsubscribe()

    async def _event_loop(self, events: EventStarter) -> None:
        """The events' pass: at start, then every `event_interval` (at once when a test's clock
        moves), start the events of the window the served subscribers have no run for, and
        delete older events. Every worker runs it; the runs' keys make one run per pair."""
        outage = _Outage("starting the runs of published events")
        moved = asyncio.Event()
        clock = self.backend.clock
        loop = asyncio.get_running_loop()
        unsubscribe = None

        def wake() -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(moved.set)

        if isinstance(clock, ControllableClock):
            unsubscribe = clock.subscribe(wake)
        try:
            while not self._stopping:
                delay = self.event_interval.total_seconds()
                try:
                    done = await events.run_pass()
                    if done["started"] or done["refused"]:
                        _log.info(
                            "started %d runs of earlier events (%d refused by their input type)",
                            done["started"],
                            done["refused"],
                        )
                    outage.succeeded()
                except Exception as exc:
                    if self._stopping:
                        return
                    # A pass cut off midway left events unstarted: try again soon, not a
                    # whole interval later.
                    delay = min(delay, outage.backoff())
                    outage.failed(exc, delay)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await moved.wait()
                moved.clear()
        finally:
            if unsubscribe is not None:
                unsubscribe()

    def _on_cancel(self, run_id: UUID, reason: str) -> None:
        """A backend's hint that a cancel may have been requested: look now. Never acted on
        by itself (a NOTIFY can be forged or replayed by any role of the database): the
        heartbeat it triggers reads each run's stored cancel state, and only that aborts."""
        del reason  # the stored reason is the one that counts
        loop = self._loop
        if run_id in self._executions and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._look_now.set)
