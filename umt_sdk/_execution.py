"""One execution of a run's handler: its lease, its abort state, and the one ending write.

An execution replays the run's recorded steps and runs the next ones (`_steps.Steps`, over the
run's `_history.History`), and ends in one of four ways, each stored by one `end_execution`
write that carries the SDK's decision (`Ending`): the handler returns (complete), raises (retry
later or fail, or canceled when its cancel was requested), parks (a sleep, a fact wait or a
step's retry backoff: the slot is released), or stops writing because the lease was lost or the
process is going away. Its telemetry lives behind one seam, `ExecutionTelemetry`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Executor
from datetime import datetime, timedelta
from typing import Any, TypeVar

from attrs import evolve

from umt_sdk import _probe, _serde
from umt_sdk._abort import AbortKind, Aborts, AbortState, Release, Stop, Suspend, Verdict
from umt_sdk._context import _CURRENT, SyncTaskContext, TaskContext
from umt_sdk._error_info import error_info
from umt_sdk._history import History
from umt_sdk._logging import RunLogger
from umt_sdk._names import declared_transactional, inline_target
from umt_sdk._retry import RetryPolicy
from umt_sdk._sagas import COMPENSATE_PREFIX, ResumeCompensation, compensation_args
from umt_sdk._spi import (
    Backend,
    Beat,
    ClaimedRun,
    Ending,
    EndResult,
    ExecutionOutcome,
    HeartbeatResult,
    Lease,
    SimulatedCrash,
    StepRecord,
)
from umt_sdk._steps import StepCall, Steps
from umt_sdk._streams import StreamWriter
from umt_sdk._task import TaskDefinition
from umt_sdk._telemetry import ExecutionTelemetry, Telemetry
from umt_sdk._timers import wait_until
from umt_sdk.exceptions import (
    BackendError,
    BackendUnavailableError,
    CanceledError,
    CodecError,
    Compensate,
    CompensationFailedError,
    DeadlineExceededError,
    FencingError,
    LeaseLostTooOftenError,
    PayloadError,
    StartDeadlineExceededError,
    StepFailedError,
)

__all__ = ["Execution"]

T = TypeVar("T")

_log = logging.getLogger("umt.worker")

UNREADABLE_BACKOFF = timedelta(seconds=30)
"""How long a run whose payloads this worker cannot read (`CodecError`) waits before it is
claimable again."""

_ANOTHER_HOLDS = "lease lost: another attempt holds the run"


class Execution:
    """The state of one claimed run while its handler runs in this process."""

    def __init__(
        self,
        *,
        backend: Backend,
        claimed: ClaimedRun,
        definition: TaskDefinition[Any, Any],
        worker_id: str,
        lease_duration: timedelta,
        loop: asyncio.AbstractEventLoop,
        telemetry: Telemetry,
        threads: Executor | None = None,
        claim_started: float | None = None,
        on_step_start: Callable[[], None] | None = None,
    ) -> None:
        """`claim_started`: when (monotonic) the claim that took the run was sent, which its
        lease counts from; `on_step_start`: called when a step starts (the worker names a new
        step in a prompt heartbeat)."""
        self.backend = backend
        self.claimed = claimed
        self.definition = definition
        self.loop = loop
        self._threads = threads
        self.lease = Lease(
            run_id=claimed.run_id,
            fencing_token=claimed.fencing_token,
            worker_id=worker_id,
            duration=lease_duration,
        )
        self.telemetry = ExecutionTelemetry(telemetry, claimed, worker_id)
        self.history = History(claimed.run_id, claimed.steps)
        self.steps = Steps(
            self,
            self.history,
            self.telemetry,
            records=claimed.steps,
            on_step_start=on_step_start,
        )
        self.streams = StreamWriter(self, self.history.calls)
        self._started_monotonic = time.monotonic()
        self._loop_thread = threading.get_ident()
        self.aborts = Aborts(loop)
        # What the last heartbeat that reached the backend said about the step.
        self._beaten_step: tuple[str, datetime] | None = None
        # The heartbeat on its way: the step it names, and when (monotonic) it was sent.
        self._beat_sent: tuple[tuple[str, datetime] | None, float] | None = None
        # Until when (monotonic) the lease is known held: the claim, then each heartbeat.
        self._lease_until = (
            float("inf")
            if claim_started is None
            else claim_started + lease_duration.total_seconds()
        )
        # Set while the write that hands the run back (the ending) is in flight: a heartbeat
        # racing with it may find the run released, which is not a lost lease.
        self._letting_go = False
        # Transactional steps of this execution in flight (`own_transaction`, `heard`).
        self._own_transactions = 0
        # Replaying until the first step the last execution did not finish: logs stay quiet.
        self.replaying = bool(claimed.steps)
        self.logger = RunLogger(
            logging.getLogger("umt.task"),
            {
                "umt_run_id": str(claimed.run_id),
                "umt_task": claimed.task_name,
                "umt_version": claimed.task_version,
                "umt_trace_id": self.trace_id,
            },
            context=self._log_context,
            replaying=lambda: self.replaying,
        )
        self.task: asyncio.Task[None] | None = None
        # Steps a plain handler's thread runs on the loop (`call_from_thread`): a deadline
        # cuts them off with the handler.
        self._from_thread: set[concurrent.futures.Future[Any]] = set()
        self._deadline_watch: asyncio.Task[None] | None = None

    # -- what others read ---------------------------------------------------------------------

    @property
    def trace_id(self) -> str:
        return self.telemetry.trace_id

    @property
    def stopped(self) -> bool:
        """No more writes: the lease is lost or the process is going away."""
        return self.aborts.stopped

    @property
    def abort_event(self) -> asyncio.Event:
        return self.aborts.event

    @property
    def abort_reason(self) -> str | None:
        return self.aborts.reason

    @property
    def abort_kind(self) -> AbortKind | None:
        return self.aborts.kind

    @property
    def attributes(self) -> dict[str, Any]:
        return self.telemetry.attributes

    @property
    def default_retry(self) -> RetryPolicy:
        return self.definition.retry

    def _log_context(self) -> dict[str, object]:
        return {
            "umt_step": self.steps.current_step,
            "umt_span_id": ExecutionTelemetry.current_span_id(),
        }

    def step_for_beat(self) -> tuple[str, datetime] | None:
        """The step a heartbeat names: the one running, else the one a cancel cut off."""
        return self.steps.step_for_beat()

    def needs_step_beat(self) -> bool:
        """A step runs that no heartbeat has named yet."""
        step = self.step_for_beat()
        return step is not None and step != self._beaten_step and not self.stopped

    # -- the heartbeat (the worker batches the beats of its executions) --------------------------

    def _beat(self, step: tuple[str, datetime] | None) -> Beat:
        return Beat(
            run_id=self.claimed.run_id,
            fencing_token=self.lease.fencing_token,
            current_step=step[0] if step else None,
            step_started_at=step[1] if step else None,
        )

    def beat(self) -> Beat | None:
        """What the next heartbeat says for this execution (its lease, the step it is in), or
        None when it needs none: it stopped writing, or its ending is handing the run back."""
        if self.stopped or self._letting_go:
            return None
        step = self.step_for_beat()
        self._beat_sent = (step, time.monotonic())
        return self._beat(step)

    def heard(self, result: HeartbeatResult) -> None:
        """The answer to the heartbeat that carried `beat()`: the lease is renewed from when
        the beat was sent, or lost (stop writing); a cancel requested takes effect here."""
        if self._beat_sent is None:
            return
        step, sent_at = self._beat_sent
        self._beat_sent = None
        run_id = self.claimed.run_id
        # A row the beat found locked (`unrenewed`) is still this execution's when its own
        # transactional step holds it (the record statement locks it until the commit);
        # locked by anything else (a takeover, a cancel in flight), the lease is not counted
        # as renewed: it ends when it would have.
        renewed = run_id not in result.lost and (
            run_id not in result.unrenewed or self._own_transactions > 0
        )
        if renewed:
            self._lease_until = max(
                self._lease_until, sent_at + self.lease.duration.total_seconds()
            )
        self._beaten_step = step
        if self._letting_go:
            return  # it handed the run back while the heartbeat was on its way
        if run_id in result.lost:
            _log.warning("lost the lease of run %s; stopping its execution", run_id)
            self.abort("lease_lost", _ANOTHER_HOLDS)
        elif run_id in result.cancel_requested:
            # The one place a cancel takes effect: the backend read it from what is stored,
            # for a run this execution still holds under its token.
            self.abort("cancel", result.cancel_requested[run_id] or "canceled")

    def check_lease(self, now: float) -> None:
        """Stop, as if told so, when no heartbeat renewed the lease by `now` (monotonic): the
        run may be another worker's by now, and its writes would be refused (or never
        answered) anyway."""
        if self.stopped or self._letting_go or now < self._lease_until:
            return
        _log.warning(
            "lost the lease of run %s: it expired before a heartbeat could renew it; "
            "stopping its execution (another worker takes the run over)",
            self.claimed.run_id,
        )
        self.abort("lease_lost", "lease expired: the backend did not answer in time")

    # -- time and signals -------------------------------------------------------------------

    def now(self) -> datetime:
        """The backend's clock: its own if it keeps one, else measured from the claim."""
        clock = self.backend.clock
        if clock is not None:
            return clock.now()
        return self.claimed.claimed_at + timedelta(
            seconds=time.monotonic() - self._started_monotonic
        )

    def abort(self, kind: AbortKind, reason: str) -> None:
        """Fire the abort signal (see `_abort`): once per change of state, so a cancel that
        every heartbeat reads again is announced once. A lost lease or a crash also cuts the
        handler off."""
        if not self.aborts.fire(kind, reason):
            return
        if kind == "cancel":
            self.telemetry.event("umt.cancel_requested", **{"umt.cancel.reason": reason})
        elif kind == "lease_lost":
            self.telemetry.lease_lost(reason)
        if self.aborts.stopped and self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)

    def check_before_step(self) -> None:
        """Raise what must happen instead of the next step: stop, the cancel, the deadline
        (a run past it never starts another step), or release."""
        deadline = self.claimed.deadline_at
        if deadline is not None and self.now() >= deadline:
            self.deadline_came()
        if self.aborts.state is not AbortState.RUNNING:  # the label only when it is needed
            self.aborts.raise_at_boundary(f"run {self.claimed.run_id}")

    # -- the deadline ---------------------------------------------------------------------------

    def deadline_came(self) -> None:
        """The run's deadline came: fire the abort signal (once), which the step in progress
        and the next step boundary obey, and cut the handler off after a short grace if it is
        still running (an async handler is cancelled; a plain one's thread cannot be, so it is
        left behind and what it does next is refused). Not once the ending write is on its
        way: that write decides."""
        deadline = self.claimed.deadline_at
        if deadline is None or self._letting_go or self.stopped:
            return
        if not self.aborts.fire("deadline", f"deadline {deadline.isoformat()} exceeded"):
            return
        self.telemetry.event(
            "umt.deadline", **{"umt.deadline.at": deadline.isoformat(), "umt.deadline.kind": "run"}
        )
        self.loop.call_later(self._deadline_grace(), self._cut_off)

    def _deadline_grace(self) -> float:
        """Real seconds a handler has to obey the deadline's abort signal before it is cut
        off: a third of the lease, at most a second."""
        return min(self.lease.duration.total_seconds() / 3, 1.0)

    def _cut_off(self) -> None:
        if self._letting_go or self.stopped or not self.aborts.expiring:
            return
        for future in list(self._from_thread):
            future.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    async def _watch_deadline(self, deadline: datetime) -> None:
        await wait_until(self.now, deadline, self.backend.clock)
        self.deadline_came()

    def _expired_at_claim(self) -> DeadlineExceededError | None:
        """The claim came after the run's start deadline (its first claim) or its deadline:
        the error it ends with, without running the handler."""
        claimed = self.claimed
        label = f"run {claimed.run_id} of {claimed.task_name}@{claimed.task_version}"
        start_by = claimed.start_by
        if start_by is not None and claimed.claims == 1 and claimed.claimed_at > start_by:
            return StartDeadlineExceededError(
                f"{label} was not started by its start deadline {start_by.isoformat()} "
                "(start_within); it never ran",
                run_id=claimed.run_id,
                deadline_at=start_by,
            )
        if claimed.deadline_at is not None and claimed.claimed_at >= claimed.deadline_at:
            return self._deadline_error()
        return None

    def _deadline_error(self) -> DeadlineExceededError:
        claimed = self.claimed
        deadline = claimed.deadline_at
        assert deadline is not None
        return DeadlineExceededError(
            f"run {claimed.run_id} of {claimed.task_name}@{claimed.task_version} was not "
            f"finished by its deadline {deadline.isoformat()}",
            run_id=claimed.run_id,
            deadline_at=deadline,
        )

    async def _finish_expired(self, exc: DeadlineExceededError) -> None:
        """End the run failed with `exc`: never retried, whatever the task's retry policy."""
        task = asyncio.current_task()
        if task is not None:
            while task.cancelling():  # our own cut-off: the ending write must still run
                task.uncancel()
        kind = "start" if isinstance(exc, StartDeadlineExceededError) else "run"
        if kind == "start" or not self.aborts.expiring:  # the claim found it expired
            at = exc.deadline_at.isoformat() if exc.deadline_at else ""
            self.telemetry.event(
                "umt.deadline", **{"umt.deadline.at": at, "umt.deadline.kind": kind}
            )
        await self._end(
            Ending(status="failed", outcome="failed", error=error_info(exc), count_failure=True)
        )
        self._outcome("failed", exc)

    def go_live(self) -> None:
        """The first step the last execution did not finish: from here on, logs speak. A run
        that already decided to compensate runs no new step of its handler: the handler is
        unwound here and the execution goes on compensating (`_sagas`)."""
        saga = self.steps.saga
        if saga.decided and not saga.active:
            raise ResumeCompensation
        self.replaying = False

    # -- threads --------------------------------------------------------------------------------

    async def in_thread(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run plain `fn` in the worker's threads (with the caller's context variables)."""
        context = contextvars.copy_context()
        call = functools.partial(context.run, fn, *args, **kwargs)
        return await self.loop.run_in_executor(self._threads, call)

    def in_handler_thread(self) -> bool:
        return threading.get_ident() != self._loop_thread

    def call_from_thread(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the worker's loop from a plain handler's thread and wait for it.

        A stopped execution (a crash, a lost lease) runs nothing more: the thread of a plain
        handler can outlive its execution, and even its loop, so `coro` is closed unrun rather
        than handed to a loop that may never run it."""
        wrapped = self._as_current(coro)
        try:
            if self.stopped:
                raise Stop
            future = asyncio.run_coroutine_threadsafe(wrapped, self.loop)
        except BaseException:
            wrapped.close()
            coro.close()
            raise
        self._from_thread.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:  # cut off by the run's deadline
            self.aborts.raise_at_boundary(f"run {self.claimed.run_id}")
            raise
        finally:
            self._from_thread.discard(future)

    async def _as_current(self, coro: Coroutine[Any, Any, T]) -> T:
        token = _CURRENT.set(self)
        try:
            return await coro
        finally:
            _CURRENT.reset(token)

    # -- writes ---------------------------------------------------------------------------------

    async def guard(self, awaitable: Awaitable[T], *, final: bool = False) -> T:
        """Await a fenced backend write; on a lost lease, stop this execution."""
        if self.stopped:
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # the write is not made; never leave it unawaited
            raise Stop
        if final:
            self._letting_go = True
        try:
            return await awaitable
        except FencingError:
            self.fenced()
            raise Stop from None
        except BackendUnavailableError as exc:
            # Whether the write landed is unknown, and an outage is not the handler's failure:
            # stop writing (like a crash); the run resumes from its records after its lease.
            _log.warning(
                "run %s: the backend is unavailable (%s); stopping this execution, the run "
                "resumes from its recorded steps when its lease expires",
                self.claimed.run_id,
                exc,
            )
            self.abort("crash", f"backend unavailable: {exc}")
            raise Stop from None
        except SimulatedCrash:
            self.abort("crash", "simulated crash")
            raise Stop from None

    @contextlib.contextmanager
    def own_transaction(self) -> Iterator[None]:
        """A transactional step of this execution is in flight (see `heard`)."""
        self._own_transactions += 1
        try:
            yield
        finally:
            self._own_transactions -= 1

    def fenced(self) -> None:
        """A write was refused: another attempt holds the run. Stop writing, and say so once:
        a worker cut off past its lease may learn it only here, when its late write lands."""
        if not self.stopped:
            _log.warning(
                "run %s: a write was refused, another worker holds the run now (this "
                "execution's lease lapsed); stopping this execution",
                self.claimed.run_id,
            )
        self.telemetry.fenced(self.steps.current_step)
        self.abort("lease_lost", _ANOTHER_HOLDS)

    async def _end(self, ending: Ending) -> EndResult:
        """The one ending write: the SDK's decision, stored by the backend as given."""
        if ending.finishes:
            _probe.reach(self.aborts, "end", ending.status)
        else:
            ending = self._until_deadline(ending)
        result = await self.guard(self.backend.end_execution(self.lease, ending), final=True)
        self._letting_go = result == "ended"
        if result == "ended" and ending.step is not None:
            self.history.remember(ending.step)
        return result

    def _until_deadline(self, ending: Ending) -> Ending:
        """A run parked or handed back is claimable again by its deadline at the latest, to
        be ended then (`_expired_at_claim`), whatever it waits for."""
        deadline = self.claimed.deadline_at
        if deadline is None:
            return ending
        if ending.available_at is None:
            if ending.status == "waiting":  # a fact wait with no timeout of its own
                return evolve(ending, available_at=deadline)
            return ending  # handed back: claimable at once
        return evolve(ending, available_at=min(ending.available_at, deadline))

    async def park(
        self,
        *,
        outcome: ExecutionOutcome,
        step: StepRecord | None,
        available_at: datetime | None,
        wait_for: str | None = None,
    ) -> bool:
        """Hand the run back until `available_at` (a sleep, a fact wait, a step's retry
        backoff). False: the awaited fact is already stored, so the wait goes on here. A run
        whose cancel was requested is never parked: the cancel is raised here instead."""
        result = await self._end(
            Ending(
                status="pending" if outcome == "retrying" else "waiting",
                outcome=outcome,
                available_at=available_at,
                wait_for=wait_for,
                step=step,
            )
        )
        if result == "cancel_requested":
            await self._learn_cancel()
            self.check_before_step()
        return result == "ended"

    async def _learn_cancel(self) -> None:
        """The store refused to park the run because its cancel was requested (no heartbeat
        said so yet): take the request, with its reason, as the heartbeat would have."""
        reason = "canceled"
        try:
            record = await self.backend.get_run_head(self.claimed.run_id)
        except BackendError as exc:  # the reason is for the error message; the cancel holds
            _log.debug("run %s: could not read the cancel reason: %s", self.claimed.run_id, exc)
        else:
            if record is not None and record.cancel_reason:
                reason = record.cancel_reason
        self.abort("cancel", reason)

    # -- the handler ------------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        """Run `execute()` in a task of its own: the one a lost lease or a crash cancels."""
        self.task = asyncio.create_task(self.execute(), name=f"umt-run-{self.claimed.run_id}")
        deadline = self.claimed.deadline_at
        if deadline is not None:
            watch = asyncio.create_task(
                self._watch_deadline(deadline), name=f"umt-deadline-{self.claimed.run_id}"
            )
            self._deadline_watch = watch
            self.task.add_done_callback(lambda _: watch.cancel())
        return self.task

    async def execute(self) -> None:
        """Run the handler to its next durable boundary and record how it ended."""
        token = _CURRENT.set(self)
        try:
            with self.telemetry.running():
                try:
                    await self._execute()
                except Suspend:
                    self.telemetry.parked()
                except (Stop, SimulatedCrash):
                    self.telemetry.outcome("stopped")
                except asyncio.CancelledError:
                    self.telemetry.outcome("stopped")
                    if not self.stopped:
                        raise
        finally:
            _CURRENT.reset(token)

    def _outcome(self, outcome: str, error: BaseException | None = None) -> None:
        self.telemetry.outcome(outcome, error)

    async def _execute(self) -> None:
        definition = self.definition
        if self.claimed.cancel_reason is not None:
            # Requested while an earlier execution held the run, which was cut off before it
            # could end it: the handler does not start again.
            self.abort("cancel", self.claimed.cancel_reason or "canceled")
            await self._end(Ending(status="canceled", outcome="canceled"))
            self._outcome("canceled")
            return
        expired = self._expired_at_claim()
        if expired is not None:
            await self._finish_expired(expired)
            return
        if self.claimed.lost_leases >= definition.max_lost_leases:
            await self._fail_lost_leases()
            return
        try:
            try:
                value = _serde.decode(self.claimed.input_json, definition.input_type, what="input")
            except CodecError as exc:
                await self._hand_back_unreadable(exc)
                return
            except PayloadError as exc:
                await self._finish_failed(exc)
                return
            try:
                if definition.is_async:
                    output = await definition.fn(TaskContext(self, value))
                else:
                    output = await self.in_thread(definition.fn, SyncTaskContext(self, value))
            except Compensate as exc:
                await self._compensate(exc)
                return
            except ResumeCompensation:
                await self._compensate(None)
                return
            if self.steps.saga.decided:  # the replay returned where it had given up before
                await self._compensate(None)
                return
            output_json = _serde.encode(output, definition.output_type, what="task output")
            if definition.output_type is not Any and not _serde.decodes_to_itself(
                output, definition.output_type
            ):  # what result() will decode: if that would fail, fail the run now
                _serde.decode(output_json, definition.output_type, what="task output")
        except (Exception, asyncio.CancelledError, Stop, Suspend, Release, SimulatedCrash) as exc:
            if isinstance(exc, CodecError):  # a step record it cannot read, on replay
                await self._hand_back_unreadable(exc)
                return
            await self._settle(exc, self._finish_failed)
            return
        deadline = self.claimed.deadline_at
        if self.aborts.expiring or (deadline is not None and self.now() >= deadline):
            # It returned once its deadline had come: it was not finished by then.
            self.deadline_came()
            await self._finish_expired(self._deadline_error())
            return
        await self._end(Ending(status="completed", outcome="completed", output_json=output_json))
        self._outcome("completed")

    async def _hand_back_unreadable(self, exc: CodecError) -> None:
        """This worker cannot read the run's payloads (it has no codec, or lacks the key they
        name): hand the run back uncharged, claimable again after `UNREADABLE_BACKOFF`, rather
        than fail it. A misconfigured worker must not destroy the runs it cannot read; one
        that has the codec will take it."""
        _log.error(
            "run %s: cannot read its payloads, handing it back for %s: %s",
            self.claimed.run_id,
            UNREADABLE_BACKOFF,
            exc,
        )
        ending = Ending(
            status="pending",
            outcome="released",
            available_at=self.claimed.claimed_at + UNREADABLE_BACKOFF,
        )
        if await self._end(ending) == "ended":
            self._outcome("released")
            return
        await self._end(Ending(status="canceled", outcome="canceled"))
        self._outcome("canceled")

    async def _release(self) -> None:
        """The worker is going away: hand the run back at once, uncharged. A run whose cancel
        was requested meanwhile is not handed back to be started again: it ends canceled."""
        if await self._end(Ending(status="pending", outcome="released")) == "ended":
            self._outcome("released")
            return
        await self._end(Ending(status="canceled", outcome="canceled"))
        self._outcome("canceled")

    async def _fail_lost_leases(self) -> None:
        """The run's executions keep dying without progress: fail it rather than start the
        same fault again (no retry: the retry policy is for errors a handler raises)."""
        claimed = self.claimed
        limit = self.definition.max_lost_leases
        step_name = await self._last_seen_step()
        where = f" (last seen in step {step_name!r})" if step_name else ""
        exc = LeaseLostTooOftenError(
            f"run {claimed.run_id} of {claimed.task_name}@{claimed.task_version} lost its lease "
            f"{claimed.lost_leases} times without recording a step{where}; its executions keep "
            "dying (a crash, an OOM kill, a freeze longer than the lease) on a fault that "
            f"repeats, so it is failed instead of started again (max_lost_leases={limit}). "
            "Fix the cause, then enqueue it again",
            run_id=claimed.run_id,
            lost_leases=claimed.lost_leases,
            max_lost_leases=limit,
            step_name=step_name,
        )
        _log.warning("%s", exc)
        await self._end(
            Ending(status="failed", outcome="failed", error=error_info(exc), count_failure=True)
        )
        self._outcome("failed", exc)

    async def _last_seen_step(self) -> str | None:
        """The step the last interrupted execution was in, as its heartbeats reported."""
        try:
            record = await self.backend.get_run(self.claimed.run_id)
        except BackendError:
            return None
        if record is None:
            return None
        for execution in reversed(record.executions):
            if execution.fencing_token != self.lease.fencing_token and execution.current_step:
                return execution.current_step
        return None

    async def _finish_failed(self, exc: BaseException) -> None:
        """The handler raised (or its input could not be decoded): retry later, or fail (or
        compensate, for a task declared `on_failure="compensate"`)."""
        info = error_info(exc)
        policy = self.definition.retry
        failures = self.claimed.failures + 1
        if self.steps.saga.decided:
            await self._compensate(exc)
            return
        if not policy.should_retry(exc, failures):
            if self.definition.on_failure == "compensate":
                await self._compensate(exc)
                return
            await self._end(
                Ending(status="failed", outcome="failed", error=info, count_failure=True)
            )
            self._outcome("failed", exc)
            return
        retry_at = self.now() + policy.delay_before(failures + 1)
        ending = Ending(
            status="pending",
            outcome="retrying",
            available_at=retry_at,
            error=info,
            count_failure=True,
        )
        if await self._end(ending) == "cancel_requested":
            await self._learn_cancel()
            await self._finish_canceled(exc)
            return
        self._outcome("retrying", exc)

    # -- compensation (`_sagas`) -------------------------------------------------------------

    async def _compensate(self, cause: BaseException | None) -> None:
        """The run gives up: store its plan (unless a former execution did), run the
        compensations of its completed steps in reverse order, each a durable step, and end
        `compensated`; or `failed` with `CompensationFailedError` naming the one that could
        not run. What stops it midway (a crash, a lost lease, a retry's backoff, a cancel, the
        worker going away) is handled as for any step."""
        try:
            await self._run_compensations(cause)
        except (Exception, asyncio.CancelledError, Stop, Suspend, Release, SimulatedCrash) as exc:
            # A compensation's code is not the handler's: no retry of the run.
            await self._settle(exc, self._fail_for_good)

    async def _fail_for_good(self, exc: BaseException) -> None:
        await self._end(
            Ending(status="failed", outcome="failed", error=error_info(exc), count_failure=True)
        )
        self._outcome("failed", exc)

    async def _settle(
        self, exc: BaseException, fail: Callable[[BaseException], Awaitable[None]]
    ) -> None:
        """What an exception out of the handler (or of the compensations) makes of the run,
        as the abort state classifies it: stop (`exc` raised again), fenced, released, canceled,
        expired, or `fail(exc)`."""
        task = asyncio.current_task()
        verdict = self.aborts.classify(
            exc, cancelled_by_worker=task is not None and task.cancelling() > 0
        )
        if verdict in (Verdict.SUSPEND, Verdict.STOP):
            if isinstance(exc, (Stop, Suspend, asyncio.CancelledError, SimulatedCrash)):
                raise exc
            raise Stop from None
        if verdict is Verdict.FENCED:
            self.fenced()
            raise Stop from None
        if verdict is Verdict.RELEASE:
            await self._release()
        elif verdict is Verdict.CANCEL:
            await self._finish_canceled(exc)
        elif verdict is Verdict.EXPIRE:
            await self._finish_expired(self._deadline_error())
        else:
            await fail(exc)

    async def _run_compensations(self, cause: BaseException | None) -> None:
        saga = self.steps.saga
        saga.active = True
        if not saga.decided:
            self.check_before_step()
            await self.steps.record(
                saga.new_plan(
                    self._completed_step,
                    None if cause is None else error_info(cause),
                    self.lease.fencing_token,
                )
            )
        entries, why = saga.plan()
        for entry in entries:
            if entry.fn is None:
                raise CompensationFailedError(
                    f"the compensation {entry.name!r} of step {entry.step!r} could not run: the "
                    "code that replayed the run no longer passes compensate= to that step "
                    "(restore it, or deploy it under a new task version)",
                    step_name=entry.step,
                    compensation=entry.name,
                )
            fn, output_type, retry, timeout = inline_target(entry.fn, None)
            # A compensation declared `@step(..., transactional=True)` undoes in a transaction.
            transactional = declared_transactional(entry.fn) is True
            call = StepCall(
                name=f"{COMPENSATE_PREFIX}{entry.step}",
                fn=fn,
                args=compensation_args(fn, entry.output, transactional=transactional),
                retry=retry,
                output_type=output_type,
                timeout=timeout,
                transactional=transactional,
            )
            try:
                await self.steps.run(call)
            except StepFailedError as exc:
                raise CompensationFailedError(
                    f"the compensation {entry.name!r} of step {entry.step!r} failed: "
                    f"{exc.error_type}: {exc.error_message}; the compensations after it did "
                    "not run",
                    step_name=entry.step,
                    compensation=entry.name,
                    error_type=exc.error_type,
                    error_message=exc.error_message,
                ) from exc
        await self._end(
            Ending(status="compensated", outcome="compensated", error=why, count_failure=True)
        )
        self._outcome("compensated")

    def _completed_step(self, name: str) -> bool:
        last = self.history.last(name, "step")
        return last is not None and last.status == "completed"

    async def _finish_canceled(self, exc: BaseException) -> None:
        """End canceled, keeping the handler's error unless it is the cancel itself."""
        itself = isinstance(exc, (CanceledError, asyncio.CancelledError))
        error = None if itself else error_info(exc)
        await self._name_canceled_step()
        await self._end(Ending(status="canceled", outcome="canceled", error=error))
        self._outcome("canceled", exc)

    async def _name_canceled_step(self) -> None:
        """Make sure the backend knows the step the cancel cut off before the run finishes
        (it keeps it on the canceled execution); one beat, only if no heartbeat said it."""
        step = self.steps.canceled_step
        if step is None or step == self._beaten_step or self.stopped:
            return
        try:
            result = await self.backend.heartbeat(
                worker_id=self.lease.worker_id, beats=[self._beat(step)], lease=self.lease.duration
            )
        except BackendError as exc:  # the timeline loses a step; finishing the run matters more
            _log.debug("run %s: could not name the canceled step: %s", self.claimed.run_id, exc)
            return
        if self.claimed.run_id not in result.lost:
            self._beaten_step = step
