"""Step semantics over a run's `History`: run a step or replay its record, durable sleeps and
fact waits, step retries.

A step that completed returns its record (decoded as every replay decodes it, the first
execution included), one that failed raises it, and the first unrecorded one runs and is
recorded under the execution's lease. What a step needs of the execution running it (its
lease, its abort state, its fenced writes, the one ending write that parks the run) is the
small `StepHost` protocol: this module never imports the execution.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar
from uuid import UUID

from attrs import evolve, field, frozen

from umt_sdk import _probe, _serde
from umt_sdk._abort import Aborts, Release, Stop, Suspend, Verdict
from umt_sdk._attention import attention_envelope, attention_fact, attention_of, settlement_of
from umt_sdk._callbacks import (
    callback_envelope,
    find_minted,
    mint_token,
    minted_for,
    minted_of,
    parse_token,
)
from umt_sdk._concurrency import apply_strategy, key_fields
from umt_sdk._definition import TaskDefinition
from umt_sdk._error_info import error_info
from umt_sdk._history import History
from umt_sdk._ids import new_run_id
from umt_sdk._lifecycle import CHILD_KEY_PREFIX, MAP_KEY_PREFIX
from umt_sdk._names import check_name, declared_transactional, inline_target
from umt_sdk._patches import CallSite, PatchDecisions, marker_envelope, marker_name, went_past
from umt_sdk._rate_limits import RateLimit, ensure_defined, rate_limit_fields, rate_limit_store
from umt_sdk._retry import RetryPolicy
from umt_sdk._sagas import COMPENSATE_PREFIX, Saga
from umt_sdk._spi import (
    Backend,
    ChildGroup,
    ChildGroupStore,
    ClaimedRun,
    ControllableClock,
    ErrorInfo,
    ExecutionOutcome,
    Fact,
    Lease,
    NewRun,
    RunRecord,
    SimulatedCrash,
    StepKind,
    StepRecord,
    TokenRequest,
    TransactionStore,
)
from umt_sdk._streams import StepScope, step_scope
from umt_sdk._telemetry import ExecutionTelemetry, StepTrace, Telemetry
from umt_sdk._timers import wait_until
from umt_sdk.exceptions import (
    CallbackTimeoutError,
    CanceledError,
    ChildCanceledError,
    ChildFailedError,
    ChildrenFailedError,
    DeadlineExceededError,
    FactTimeoutError,
    IdempotencyConflictError,
    NonDeterminismError,
    PayloadError,
    StepFailedError,
    StepTimeoutError,
    TransactionConflictError,
    UsageError,
)

__all__ = [
    "PAUSED_TOKEN_RECHECK",
    "SHORT_TOKEN_WAIT",
    "TRANSACTION_CONFLICT_RETRIES",
    "StepCall",
    "StepHost",
    "Steps",
    "UnstorableOutput",
    "error_info",
    "group_fact",
    "transaction_store",
]

SHORT_TOKEN_WAIT = timedelta(seconds=1)
"""A step whose rate limit's next token is due within this waits for it in the worker; a
longer wait parks the run (its slot freed) until the token is due."""
PAUSED_TOKEN_RECHECK = timedelta(minutes=5)
"""A step whose rate limit is paused parks its run this long, then asks again (its resume
wakes the run at once: this only covers a wake-up that was lost)."""

T = TypeVar("T")


@frozen(kw_only=True)
class StepCall:
    """One call of a step, built once where the user's call enters (`ctx.step.run`, a
    decorated step) and read by `Steps.run`: a new step option is one more field here and
    its two ends, not one more parameter on every signature in between."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(factory=dict)
    retry: RetryPolicy | None = None
    """The step's own retry policy; None: the task's."""
    output_type: Any = Any
    """What the output decodes to, on the first execution and on every replay."""
    timeout: timedelta | None = None
    """How long one attempt may run before it fails with `StepTimeoutError`; None: no limit."""
    rate_limit: str | RateLimit[Any] | None = None
    """The rate limit each attempt takes a token of before its body runs; None: none."""
    rate_limit_key: str | None = None
    """With `rate_limit`: its bucket (None: the limit's one bucket)."""
    compensate: Callable[..., Any] | None = None
    """What undoes the step once it completed, when the run compensates; None: nothing."""
    transactional: bool = False
    """`fn` runs as `fn(tx, *args, **kwargs)` inside the transaction that records the step
    (`TransactionStore`): its writes and the step's record commit together (`_transactions`)."""
    uncertain_on: tuple[type[BaseException], ...] = ()
    """The failures after which the step's outcome is unknown: the run parks in
    `needs_attention` instead of retrying or failing (`_attention`)."""

    @classmethod
    def inline(
        cls,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        retry: RetryPolicy | None,
        output_type: Any,
        timeout: timedelta | None = None,
        rate_limit: str | RateLimit[Any] | None = None,
        rate_limit_key: str | None = None,
        compensate: Callable[..., Any] | None = None,
        transactional: bool = False,
        uncertain_on: tuple[type[BaseException], ...] | None = None,
    ) -> StepCall:
        """`ctx.step.run(name, fn, *args, retry=..., output_type=..., timeout=..., **kwargs)`:
        the name checked, and a decorated `fn` replaced by its plain function, its output type
        and (unless `retry` / `timeout` override them) its retry policy and timeout
        (`_names.inline_target`)."""
        check_name("step", name)
        if uncertain_on is None:  # a decorated step's own (`@step(uncertain_on=...)`)
            uncertain_on = getattr(fn, "__umt_uncertain_on__", ())
        fn, declared, retry, timeout = inline_target(fn, retry, timeout)
        return cls(
            name=name,
            fn=fn,
            args=args,
            kwargs=kwargs,
            retry=retry,
            output_type=declared if output_type is None else output_type,
            timeout=timeout,
            rate_limit=rate_limit,
            rate_limit_key=rate_limit_key,
            compensate=compensate,
            transactional=transactional,
            uncertain_on=uncertain_on,
        )


TRANSACTION_CONFLICT_RETRIES = 5
"""How many times a transactional step's transaction is run again at once after a conflict
(a serialization failure, a deadlock) before the step's retry policy sees the error."""


class UnstorableOutput(Exception):
    """A transactional step returned a value no backend can store (its `PayloadError` in
    `error`): the transaction rolls back, and the step fails, not retried (as a plain step's
    output does)."""

    def __init__(self, error: PayloadError) -> None:
        super().__init__(str(error))
        self.error = error


def transaction_store(backend: Backend, step_name: str) -> TransactionStore:
    """The backend as a `TransactionStore`, or the `UsageError` a transactional step on a
    backend that cannot honour it raises (before anything of the step is stored)."""
    if not isinstance(backend, TransactionStore):
        raise UsageError(
            f"step {step_name!r} is transactional, but the backend {type(backend).__name__} "
            "cannot commit a step's writes with its record (it does not implement "
            "TransactionStore); use the Postgres or the memory backend, or make it a plain "
            "step with with_attempt_token for its side effect",
            argument="transactional",
        )
    return backend


def _check_wait_arguments(name: str, *, timeout: object, check: object, poll: object) -> None:
    """`wait_for_fact`'s arguments are a call of the API: a wrong one is a UsageError (the run
    fails at once, never retried), not arithmetic failing later."""
    for argument, value, least in (("timeout", timeout, "0"), ("poll_interval", poll, "> 0")):
        if value is None:
            continue
        if (
            not isinstance(value, timedelta)
            or value < timedelta(0)
            or (argument == "poll_interval" and value == timedelta(0))
        ):
            raise UsageError(
                f"wait_for_fact {name!r}: {argument} must be a timedelta (>= {least}) such as "
                f"timedelta(seconds=30), or None; got {value!r}",
                argument=argument,
            )
    if check is not None and not callable(check):
        raise UsageError(
            f"wait_for_fact {name!r}: check must be a function returning the fact or None, "
            f"got {check!r}",
            argument="check",
        )


def _cancelled_by_worker() -> bool:
    """The running task has a cancellation pending: the worker cancelled the execution."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class StepHost(Protocol):
    """What the steps ask of the execution running them; the one arrow runs from the
    execution to the steps."""

    @property
    def claimed(self) -> ClaimedRun: ...
    @property
    def lease(self) -> Lease: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def default_retry(self) -> RetryPolicy: ...
    @property
    def aborts(self) -> Aborts: ...

    def now(self) -> datetime: ...
    def check_before_step(self) -> None: ...
    def deadline_came(self) -> None: ...
    def go_live(self) -> None: ...
    def fenced(self) -> None: ...
    def call_from_thread(self, coro: Coroutine[Any, Any, T]) -> T: ...
    async def in_thread(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T: ...
    async def guard(self, awaitable: Awaitable[T]) -> T: ...
    def own_transaction(self) -> AbstractContextManager[None]: ...
    async def park(
        self,
        *,
        outcome: ExecutionOutcome,
        step: StepRecord | None,
        available_at: datetime | None,
        wait_for: str | None = None,
    ) -> bool: ...


class Steps:
    """The steps of one execution: replay from `history`, run and record the rest."""

    def __init__(
        self,
        host: StepHost,
        history: History,
        telemetry: ExecutionTelemetry,
        *,
        records: Sequence[StepRecord] = (),
        on_step_start: Callable[[], None] | None = None,
    ) -> None:
        """`records`: the run's step records as claimed, in the order first recorded."""
        self._host = host
        self.history = history
        self.saga = Saga.of(records)
        self._telemetry = telemetry
        self.current_step: str | None = None
        self.current_step_started_at: datetime | None = None
        # The step a cancel cut off (the handler may still be cleaning up): heartbeats keep
        # naming it, so the timeline shows it as canceled.
        self.canceled_step: tuple[str, datetime] | None = None
        # Who wants to know when a step starts (the worker, to name it in a prompt beat).
        self._on_step_start = on_step_start
        # How many updates this execution has received so far (`umt_sdk._updates`).
        self.updates_received = 0
        self.patches = PatchDecisions()

    def step_for_beat(self) -> tuple[str, datetime] | None:
        """The step a heartbeat names: the one running, else the one a cancel cut off."""
        if self.current_step is not None and self.current_step_started_at is not None:
            return (self.current_step, self.current_step_started_at)
        return self.canceled_step

    async def _record(self, record: StepRecord) -> None:
        await self._host.guard(self._host.backend.record_step(self._host.lease, record))
        self.history.remember(record)
        self.saga.remember(record)

    async def record(self, record: StepRecord) -> None:
        """Store a record of umt's own (a compensation's plan) under the lease."""
        await self._record(record)

    async def _fact_arrived(
        self,
        full: str,
        name: str,
        started: datetime,
        now: datetime,
        payload_json: str,
        source: str,
        payload_type: Any,
    ) -> Any:
        """Record the fact a wait received (from a signal or its `check()`) and return it as a
        replay will see it."""
        output = _fact_envelope(payload_json, source)
        await self._record(
            self._step_record(
                full,
                "fact",
                status="completed",
                started_at=started,
                finished_at=now,
                output_json=output,
            )
        )
        self._telemetry.event(
            "umt.fact.received", **{"umt.fact.name": name, "umt.fact.source": source}
        )
        return _fact_outcome(full, name, output, payload_type)

    def _step_record(self, name: str, kind: StepKind, **fields: Any) -> StepRecord:
        return StepRecord(
            name=name, kind=kind, fencing_token=self._host.lease.fencing_token, **fields
        )

    def from_thread(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` (a step, a sleep, a fact wait) on the worker's loop from a plain
        handler's thread and wait for it."""
        return self._host.call_from_thread(coro)

    async def run(self, call: StepCall) -> Any:
        """Replay `call`'s record, or run it and record how it went."""
        full = self.history.occurrence(call.name)
        last = self.history.last(full, "step")
        replayed = last is not None and last.status in ("completed", "failed")
        _probe.report(
            "call", full, step_kind="step", replayed=replayed, output_type=call.output_type
        )
        if last is not None:
            if last.status == "completed":
                self._telemetry.replayed(last)
                value = _serde.decode(
                    last.output_json or "null", call.output_type, what=f"output of step {full!r}"
                )
                if call.compensate is not None:
                    self.saga.register(full, call.compensate, value)
                return value
            if last.status == "failed":
                self._telemetry.replayed(last)
                raise _step_failed(full, last.error)
            if attention_of(last) is not None:  # its outcome is unknown: settled yet?
                done, value = await self._settled(call, full, last, look_first=True)
                if done:
                    return value
        attempt = (last.attempt + 1) if last is not None else 1
        self._host.check_before_step()
        if call.transactional:
            transaction_store(self._host.backend, full)  # refused before anything is stored
        if call.compensate is not None and declared_transactional(call.compensate):
            transaction_store(self._host.backend, f"{COMPENSATE_PREFIX}{full}")
        self._host.go_live()
        if call.compensate is not None:
            registration = self.saga.registration(
                full, call.compensate, self._host.lease.fencing_token
            )
            if registration is not None:  # before the body: a crash never loses it
                await self._record(registration)
        if call.rate_limit is not None:
            await self._take_token(call, full, attempt)
        with self._telemetry.step(full, attempt) as step_trace:
            try:
                value = await self._execute_step(call, full, attempt, step_trace)
                if call.compensate is not None:
                    self.saga.register(full, call.compensate, value)
                return value
            except Stop:  # a write refused or given up (`guard`): the lease is lost, or a crash
                step_trace.ended(self._stop_outcome())
                raise
            finally:
                # Only now: a refused write of its record still names the step.
                self.current_step = self.current_step_started_at = None

    async def patch(self, patch_id: str, site: CallSite, *, call: str) -> bool:
        """`ctx.patched` (`call="patched"`) and `ctx.deprecate_patch`: the run's decision at
        this point, recording the patch's marker when the run reaches it first (`_patches`)."""
        check_name("patch", patch_id, argument="patch_id")
        known = self.patches.known(patch_id, site, call)
        if known is not None:
            return known
        full = marker_name(patch_id)
        last = self.history.last(full, "step")
        if last is not None and last.status == "completed":
            self.history.occurrence(full)
            _probe.report("call", full, step_kind="step", replayed=True)
            self._telemetry.replayed(last)
            return self.patches.decide(patch_id, site, call, True)
        if went_past(self.history):
            return self.patches.decide(patch_id, site, call, False)
        self.history.occurrence(full)
        _probe.report("call", full, step_kind="step", replayed=False)
        self._host.check_before_step()
        self._host.go_live()
        now = self._host.now()
        await self._record(
            self._step_record(
                full,
                "step",
                status="completed",
                started_at=now,
                finished_at=now,
                output_json=marker_envelope(patch_id, deprecated=call == "deprecate_patch"),
            )
        )
        self._telemetry.event(
            "umt.patch.recorded", **{"umt.patch.id": patch_id, "umt.patch.call": call}
        )
        return self.patches.decide(patch_id, site, call, True)

    async def _take_token(self, call: StepCall, full: str, attempt: int) -> None:
        """One token of the step's rate limit for this attempt (once: a run taken over asks
        again and is granted the token its attempt took). Without a free token: wait here
        for one due within `SHORT_TOKEN_WAIT` (on a clock a test moves, never), else park the
        run until it is due (a paused limit: `PAUSED_TOKEN_RECHECK`) and ask again then."""
        host = self._host
        limit = call.rate_limit
        assert limit is not None
        if isinstance(limit, RateLimit):
            await host.guard(ensure_defined(host.backend, limit, f"step {full!r}"))
            name = limit.name
        else:
            name = limit
        store = rate_limit_store(host.backend, f"step {full!r} with a rate_limit")
        request = TokenRequest(
            limit=name, key=call.rate_limit_key or "", step=full, attempt=attempt
        )
        while True:
            grant = await host.guard(store.take_rate_token(host.lease, request))
            if grant.status == "granted":
                return
            if grant.status == "unknown":
                raise UsageError(
                    f"step {full!r}: no rate limit {name!r} is stored; store it with "
                    f"engine.rate_limits.set({name!r}, limit=..., per=...) (or `umt limits set`), "
                    "or pass a RateLimit(...) as the step's rate_limit",
                    argument="rate_limit",
                )
            wait = (
                grant.next_at - grant.observed_at
                if grant.status == "wait" and grant.next_at is not None
                else PAUSED_TOKEN_RECHECK
            )
            until = host.now() + max(wait, timedelta(0))
            clock = host.backend.clock
            in_place = wait <= SHORT_TOKEN_WAIT and not isinstance(clock, ControllableClock)
            deadline = host.claimed.deadline_at
            if not in_place and deadline is not None and until > deadline:
                until = deadline  # the deadline ends the run then
            self._telemetry.rate_limit_wait(
                full,
                attempt,
                limit=name,
                key=request.key,
                until=until,
                paused=grant.status == "paused",
                parked=not in_place,
            )
            if in_place:
                await wait_until(host.now, until, clock)
                host.check_before_step()
                continue
            _probe.reach(host.aborts, "park", full, attempt=attempt, step_kind="step")
            await host.park(outcome="waiting", step=None, available_at=until)
            raise Suspend

    def _stop_outcome(self) -> str:
        """How a step cut off by a stop ended: its lease was lost, or the process is going
        away (a crash)."""
        return "lease_lost" if self._host.aborts.kind == "lease_lost" else "interrupted"

    async def _execute_step(
        self, call: StepCall, full: str, attempt: int, step_trace: StepTrace
    ) -> Any:
        _probe.reach(self._host.aborts, "step.before", full, attempt=attempt)
        started = self._host.now()
        self.current_step, self.current_step_started_at = full, started
        if self._on_step_start is not None:
            self._on_step_start()
        try:
            if call.timeout is None and self._host.claimed.deadline_at is None:
                value = await self._body(call, full, attempt)
            else:
                value = await self._bounded(call, full, attempt, started)
        except (Exception, asyncio.CancelledError, Stop, Suspend, Release, SimulatedCrash) as exc:
            verdict = self._host.aborts.classify(exc, cancelled_by_worker=_cancelled_by_worker())
            if verdict is Verdict.EXPIRE:
                # The run's deadline came: the step is cut off, not recorded; the run fails.
                step_trace.ended("deadline")
                if isinstance(exc, DeadlineExceededError):
                    raise
                raise DeadlineExceededError(
                    f"step {full!r} was cut off by the run's deadline",
                    run_id=self._host.claimed.run_id,
                    deadline_at=self._host.claimed.deadline_at,
                ) from None
            if verdict in (Verdict.SUSPEND, Verdict.STOP):
                if verdict is Verdict.STOP:
                    step_trace.ended(self._stop_outcome())
                if isinstance(exc, (Stop, Suspend, asyncio.CancelledError, SimulatedCrash)):
                    raise
                raise Stop from None
            if verdict is Verdict.FENCED:
                step_trace.ended("lease_lost")
                self._host.fenced()
                raise Stop from None
            if verdict is Verdict.RELEASE:
                step_trace.ended("released")
                raise Release from None
            if verdict is Verdict.CANCEL and isinstance(
                exc, (CanceledError, asyncio.CancelledError)
            ):
                step_trace.ended("canceled")
                self.canceled_step = (full, started)
                raise  # the run ends canceled; the step is not recorded as failed
            if isinstance(exc, UnstorableOutput):  # a transactional step's output: as below
                raise await self._record_failed(
                    full, attempt, started, exc.error, step_trace
                ) from exc.error
            if (
                call.uncertain_on
                and isinstance(exc, call.uncertain_on)
                and not self._host.aborts.canceling
            ):
                return await self._uncertain(call, full, attempt, started, exc, step_trace)
            # A failure of the step's code (while canceling: recorded, never retried).
            policy = call.retry or self._host.default_retry
            if policy.should_retry(exc, attempt) and not self._host.aborts.canceling:
                now = self._host.now()
                record = self._step_record(
                    full,
                    "step",
                    status="retrying",
                    attempt=attempt,
                    error=error_info(exc),
                    started_at=started,
                    finished_at=now,
                )
                retry_at = now + policy.delay_before(attempt + 1)
                _probe.reach(self._host.aborts, "park", full, attempt=attempt, step_kind="step")
                try:
                    await self._host.park(outcome="retrying", step=record, available_at=retry_at)
                except CanceledError:
                    step_trace.failed(exc, "canceled")
                    self.canceled_step = (full, started)
                    raise
                except BaseException:
                    step_trace.failed(exc, self._stop_outcome())
                    raise
                step_trace.failed(exc, "retrying")
                self._telemetry.retry_scheduled(full, attempt, retry_at.isoformat(), exc)
                raise Suspend from None
            raise await self._record_failed(full, attempt, started, exc, step_trace) from exc
        if call.transactional:  # recorded with its writes, in their transaction
            _probe.report("step.recorded", full, attempt=attempt)
            return value
        try:
            # The value every replay decodes is the one this execution returns too.
            output_json, value = _serde.encode_output(
                value, call.output_type, what=f"output of step {full!r}"
            )
        except PayloadError as exc:
            # Deterministic: the same body would return the same value, so no retry.
            raise await self._record_failed(full, attempt, started, exc, step_trace) from exc
        _probe.reach(self._host.aborts, "step.returned", full, attempt=attempt, output=output_json)
        await self._record(
            self._step_record(
                full,
                "step",
                status="completed",
                attempt=attempt,
                output_json=output_json,
                started_at=started,
                finished_at=self._host.now(),
            )
        )
        _probe.report("step.recorded", full, attempt=attempt)
        return value

    async def _record_failed(
        self, full: str, attempt: int, started: datetime, exc: BaseException, trace: StepTrace
    ) -> StepFailedError:
        """Record `attempt` of the step `full` as failed for good with `exc` (its trace ended
        so), and return the `StepFailedError` the caller raises, from `exc`."""
        trace.failed(exc, "failed")
        info = error_info(exc)
        await self._record(
            self._step_record(
                full,
                "step",
                status="failed",
                attempt=attempt,
                error=info,
                started_at=started,
                finished_at=self._host.now(),
            )
        )
        return _step_failed(full, info)

    # -- outcomes an operator settles (`_attention`) ------------------------------------------

    async def _uncertain(
        self,
        call: StepCall,
        full: str,
        attempt: int,
        started: datetime,
        exc: BaseException,
        step_trace: StepTrace,
    ) -> Any:
        """The attempt failed in a way that leaves its outcome unknown: record it so (the
        durable point: from here a replay never runs this attempt's body again), then park the
        run in `needs_attention` until it is settled."""
        host = self._host
        record = self._step_record(
            full,
            "step",
            status="waiting",
            attempt=attempt,
            error=error_info(exc),
            started_at=started,
            finished_at=host.now(),
            output_json=attention_envelope(call.output_type),
        )
        try:
            await self._record(record)
            _probe.reach(host.aborts, "park", full, attempt=attempt, step_kind="step")
            self._telemetry.needs_attention(full, attempt, exc)
            done, value = await self._settled(call, full, record, look_first=False)
        except Suspend:
            step_trace.failed(exc, "needs_attention")
            raise
        except CanceledError:
            step_trace.failed(exc, "canceled")
            self.canceled_step = (full, started)
            raise
        except BaseException:
            step_trace.failed(exc, self._stop_outcome())
            raise
        # Settled before the run could park (a fork carries its old run's facts).
        if done:
            return value
        return await self._execute_step(call, full, attempt + 1, step_trace)

    async def _settled(
        self, call: StepCall, full: str, parked: StepRecord, *, look_first: bool
    ) -> tuple[bool, Any]:
        """The settlement of the uncertain attempt `parked`, applied: (True, the step's
        value) when it was done, (False, None) when it was not (the step runs again). Parks
        the run (raises `Suspend`) until there is one. `look_first`: read the stored fact
        before trying to park (a replay after the run was woken)."""
        host = self._host
        name = attention_fact(full, parked.attempt)
        recorded = self.history.last(name, "fact")
        payload = recorded.output_json if recorded is not None else None
        while payload is None:
            if look_first:
                facts = await host.guard(
                    host.backend.get_facts(run_id=host.claimed.run_id, name=name)
                )
                own = [f for f in facts if f.run_id == host.claimed.run_id]
                if own:
                    payload = own[0].payload_json
                    break
            look_first = True
            if await host.park(outcome="waiting", step=None, available_at=None, wait_for=name):
                raise Suspend
        settlement = settlement_of(payload)
        if settlement is None:  # only `settle` stores this fact; a guard
            raise UsageError(f"step {full!r}: the fact {name!r} holds no settlement")
        host.check_before_step()
        host.go_live()
        now = host.now()
        if recorded is None:  # the settlement, with who settled it, in the run's history
            await self._record(
                self._step_record(
                    name,
                    "fact",
                    status="completed",
                    started_at=parked.finished_at,
                    finished_at=now,
                    output_json=payload,
                )
            )
        self._telemetry.event(
            "umt.step.settled",
            **{
                "umt.step.name": full,
                "umt.step.attempt": parked.attempt,
                "umt.settled.as": "done" if settlement.done else "not-done",
                "umt.settled.by": settlement.by,
            },
        )
        if not settlement.done:
            await self._record(evolve(parked, status="retrying", output_json=None))
            return False, None
        output_json = settlement.output_json or "null"
        what = f"output of step {full!r} (settled by {settlement.by})"
        try:
            value = _serde.decode(output_json, call.output_type, what=what)
        except PayloadError as exc:
            info = error_info(exc)
            await self._record(
                evolve(parked, status="failed", output_json=None, error=info, finished_at=now)
            )
            raise _step_failed(full, info) from exc
        await self._record(evolve(parked, status="completed", output_json=output_json, error=None))
        if call.compensate is not None:
            self.saga.register(full, call.compensate, value)
        return True, value

    async def _body(self, call: StepCall, full: str, attempt: int) -> Any:
        """Run the step's body, its stream writes keyed by this attempt (`_streams`)."""
        fn = call.fn
        scope = step_scope.set(StepScope(full, attempt))
        try:
            if call.transactional:
                return await self._transaction(call, full, attempt)
            if inspect.iscoroutinefunction(fn):
                return await fn(*call.args, **call.kwargs)
            # Plain bodies run in a thread (the handler's own thread already, for plain
            # tasks: the loop never blocks on user code), with the scope: it is copied there.
            value = await self._host.in_thread(fn, *call.args, **call.kwargs)
            if inspect.isawaitable(value):
                value = await value
            return value
        finally:
            step_scope.reset(scope)

    async def _transaction(self, call: StepCall, full: str, attempt: int) -> Any:
        """Run a transactional step's body and record it in one transaction of the backend's
        (`TransactionStore.run_step_transaction`): fenced before the body and at the commit.
        A conflict with a concurrent transaction runs it again at once, a few times, before
        the step's retry policy sees it. Returns the output as every replay decodes it."""
        host = self._host
        store = transaction_store(host.backend, full)
        started = self.current_step_started_at or host.now()
        outcome: list[tuple[StepRecord, Any]] = []

        async def body(tx: Any) -> StepRecord:
            outcome.clear()
            value = call.fn(tx, *call.args, **call.kwargs)
            if inspect.isawaitable(value):
                value = await value
            try:
                output_json, decoded = _serde.encode_output(
                    value, call.output_type, what=f"output of step {full!r}"
                )
            except PayloadError as exc:
                raise UnstorableOutput(exc) from exc
            _probe.reach(host.aborts, "step.returned", full, attempt=attempt, output=output_json)
            record = self._step_record(
                full,
                "step",
                status="completed",
                attempt=attempt,
                output_json=output_json,
                started_at=started,
                finished_at=host.now(),
            )
            outcome.append((record, decoded))
            return record

        conflicts = 0
        while True:
            try:
                with host.own_transaction():
                    await host.guard(store.run_step_transaction(host.lease, body))
                break
            except TransactionConflictError:
                conflicts += 1
                if conflicts > TRANSACTION_CONFLICT_RETRIES:
                    raise
                self._telemetry.event(
                    "umt.step.transaction_conflict",
                    **{"umt.step.name": full, "umt.step.conflicts": conflicts},
                )
                # Real time, not the backend's clock: the other transaction must get ahead.
                await asyncio.sleep(random.uniform(0, 0.005 * 2**conflicts))
                host.check_before_step()
        record, decoded = outcome[0]
        self.history.remember(record)
        self.saga.remember(record)
        return decoded

    async def _bounded(self, call: StepCall, full: str, attempt: int, started: datetime) -> Any:
        """The step's body, cut off at its timeout (`StepTimeoutError`) or at the run's
        deadline (`DeadlineExceededError`), on the backend's clock. An async body is
        cancelled; a plain one's thread cannot be: it finishes on its own, its result unread.
        """
        host = self._host
        body = asyncio.ensure_future(self._body(call, full, attempt))
        body.add_done_callback(_consume)
        clock = host.backend.clock
        limits: dict[asyncio.Future[Any], str] = {}
        if call.timeout is not None:
            limits[asyncio.ensure_future(wait_until(host.now, started + call.timeout, clock))] = (
                "timeout"
            )
        deadline = host.claimed.deadline_at
        if deadline is not None:
            limits[asyncio.ensure_future(wait_until(host.now, deadline, clock))] = "deadline"
        try:
            done, _ = await asyncio.wait({body, *limits}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for limit in limits:
                limit.cancel()
            if not body.done():
                body.cancel()
        if body in done:
            return body.result()
        if any(limits[limit] == "deadline" for limit in done):
            host.deadline_came()
            host.check_before_step()  # raises what the run's abort state says
        assert call.timeout is not None
        seconds = call.timeout.total_seconds()
        cut = (
            "its body was cancelled"
            if inspect.iscoroutinefunction(call.fn)
            else "its thread cannot be killed: it finishes on its own, its result ignored"
        )
        raise StepTimeoutError(
            f"step {full!r} ran past its timeout of {seconds:g} s ({cut})",
            step_name=full,
            timeout_seconds=seconds,
        )

    async def start_child(
        self,
        name: str,
        definition: TaskDefinition[Any, Any],
        input: Any,
        *,
        priority: int | None,
        cancel_with_parent: bool,
    ) -> UUID:
        """A step that enqueues a run of `definition` as this run's child, once: its
        idempotency key is this run and the step's recorded name, so a step that runs again
        after a crash finds the child it created. Returns the child's run id (recorded)."""
        check_name("step", name)
        parent = self._host.claimed
        key = f"{CHILD_KEY_PREFIX}{parent.run_id}:{self.history.next_occurrence(name)}"
        input_json, input_hash = _serde.encode_input(
            input, definition.input_type, what=f"input of child {name!r}"
        )
        keyed = key_fields(
            definition.concurrency,
            task_name=definition.name,
            input_type=definition.input_type,
            input_json=input_json,
        )
        limited = rate_limit_fields(
            definition.rate_limit,
            task_name=definition.name,
            input_type=definition.input_type,
            input_json=input_json,
        )

        async def enqueue_child() -> UUID:
            child_id = new_run_id()
            if definition.rate_limit is not None:
                await self._host.guard(
                    ensure_defined(self._host.backend, definition.rate_limit, "start_child()")
                )
            result = await self._host.guard(
                self._host.backend.enqueue(
                    NewRun(
                        run_id=child_id,
                        task_name=definition.name,
                        task_version=definition.version,
                        input_json=input_json,
                        input_hash=input_hash,
                        priority=parent.priority if priority is None else priority,
                        idempotency_key=key,
                        trace_context=Telemetry.inject(),
                        parent_run_id=parent.run_id,
                        parent_fact=child_fact(child_id),
                        cancel_with_parent=cancel_with_parent,
                        **keyed,
                        **limited,
                        timeout=definition.timeout,
                    )
                )
            )
            if result.created and keyed:
                await self._host.guard(
                    apply_strategy(
                        self._host.backend,
                        definition.concurrency,
                        task_name=definition.name,
                        run_id=result.run_id,
                        key=keyed["concurrency_key"],
                    )
                )
            if not result.created and result.input_hash not in (None, input_hash):
                raise IdempotencyConflictError(
                    f"step {name!r} started child run {result.run_id} with another input "
                    "when it ran before a crash: the child's input must not depend on the "
                    "clock, randomness or outside state read outside a step",
                    idempotency_key=key,
                    run_id=result.run_id,
                )
            return result.run_id

        child_id: UUID = await self.run(
            StepCall(name=name, fn=enqueue_child, output_type=UUID, retry=_CHILD_RETRY)
        )
        return child_id

    async def child_result(self, start_name: str, child_id: UUID, output_type: Any) -> Any:
        """Wait, parked, until the child run `child_id` (started by step `start_name`)
        finishes; record how it ended (a step `<start_name>.result`, kind `fact`) and return
        its output, or raise `ChildFailedError` / `ChildCanceledError`; a replay returns or
        raises the same from the record. The child's finishing write stores the fact that
        wakes this run (`child_fact`), so nothing polls."""
        full = self.history.occurrence(f"{start_name}.result")
        last = self.history.last(full, "fact")
        replayed = last is not None and last.status == "completed"
        _probe.report("call", full, step_kind="fact", replayed=replayed)
        if last is not None and last.status == "completed":
            self._telemetry.replayed(last)
            return _child_outcome(start_name, child_id, last.output_json, output_type)
        self._host.check_before_step()
        self._host.go_live()
        started = last.started_at if last is not None and last.started_at else self._host.now()
        fact_name = child_fact(child_id)
        backend = self._host.backend
        while True:
            facts = await self._host.guard(
                backend.get_facts(run_id=self._host.claimed.run_id, name=fact_name)
            )
            if facts:
                child = await self._host.guard(backend.get_run_head(child_id))
                output = _child_envelope(child)
                await self._record(
                    self._step_record(
                        full,
                        "fact",
                        status="completed",
                        started_at=started,
                        finished_at=self._host.now(),
                        output_json=output,
                    )
                )
                return _child_outcome(start_name, child_id, output, output_type)
            waiting = (
                None
                if last is not None
                else self._step_record(full, "fact", status="waiting", started_at=started)
            )
            _probe.reach(self._host.aborts, "park", full, step_kind="fact")
            if await self._host.park(
                outcome="waiting", step=waiting, available_at=None, wait_for=fact_name
            ):
                self._telemetry.event(
                    "umt.child.wait", **{"umt.step.name": full, "umt.child.run_id": str(child_id)}
                )
                raise Suspend
            # The child finished between our look and the park: go round again.

    def _group_store(self, what: str) -> ChildGroupStore:
        backend = self._host.backend
        if not isinstance(backend, ChildGroupStore):
            raise UsageError(
                f"{what}: the backend {type(backend).__name__} does not store child groups "
                "(ChildGroupStore); use a backend that does (memory, Postgres), or start the "
                "children with start_child and await each handle",
                argument="task" if what.startswith("map") else "handles",
            )
        return backend

    async def map(
        self,
        name: str,
        definition: TaskDefinition[Any, Any],
        inputs: Sequence[Any],
        *,
        max_concurrency: int | None,
        priority: int | None,
        cancel_with_parent: bool,
        return_exceptions: bool,
    ) -> list[Any]:
        """Start one child of `definition` per input (the step `name`, once: each child's
        idempotency key is this run, the step's recorded name and the input's index), at most
        `max_concurrency` of them running or claimable at once (the store lets the next one
        run in the write that finishes one), then wait, parked, until all of them finished:
        the last one's finishing write wakes this run, once. Outcomes in input order."""
        check_name("step", name)
        store = self._group_store(f"map {name!r}")
        if definition.concurrency is not None:
            raise UsageError(
                f"map {name!r}: task {definition.name!r} has a concurrency key, which map does "
                "not combine with its own held children; use max_concurrency, or start_child "
                "and gather",
                argument="task",
            )
        parent = self._host.claimed
        full = self.history.next_occurrence(name)
        group = ChildGroup(
            parent_run_id=parent.run_id, name=group_fact(full), max_concurrency=max_concurrency
        )
        encoded = [
            _serde.encode_input(item, definition.input_type, what=f"input {i} of map {name!r}")
            for i, item in enumerate(inputs)
        ]
        child_priority = parent.priority if priority is None else priority
        limited = [
            rate_limit_fields(
                definition.rate_limit,
                task_name=definition.name,
                input_type=definition.input_type,
                input_json=input_json,
            )
            for input_json, _ in encoded
        ]

        async def start_children() -> list[UUID]:
            if definition.rate_limit is not None:
                await self._host.guard(
                    ensure_defined(self._host.backend, definition.rate_limit, f"map {name!r}")
                )
            runs = [
                NewRun(
                    run_id=new_run_id(),
                    task_name=definition.name,
                    task_version=definition.version,
                    input_json=input_json,
                    input_hash=input_hash,
                    priority=child_priority,
                    idempotency_key=f"{MAP_KEY_PREFIX}{parent.run_id}:{full}:{i}",
                    trace_context=Telemetry.inject(),
                    parent_run_id=parent.run_id,
                    cancel_with_parent=cancel_with_parent,
                    timeout=definition.timeout,
                    **limited[i],
                )
                for i, (input_json, input_hash) in enumerate(encoded)
            ]
            if not runs:
                return []
            results = await self._host.guard(store.start_group(group, runs))
            if len(results) != len(runs):
                raise IdempotencyConflictError(
                    f"map {name!r} started {len(results)} children when it ran before a crash, "
                    f"not {len(runs)}: its inputs must not depend on the clock, randomness or "
                    "outside state read outside a step",
                    idempotency_key=runs[0].idempotency_key or "",
                )
            for new, result in zip(runs, results, strict=True):
                if not result.created and result.input_hash not in (None, new.input_hash):
                    raise IdempotencyConflictError(
                        f"map {name!r} started child run {result.run_id} with another input "
                        "when it ran before a crash: the inputs must not depend on the clock, "
                        "randomness or outside state read outside a step",
                        idempotency_key=new.idempotency_key or "",
                        run_id=result.run_id,
                    )
            return [result.run_id for result in results]

        child_ids: list[UUID] = await self.run(
            StepCall(name=name, fn=start_children, output_type=list[UUID], retry=_CHILD_RETRY)
        )
        names = [f"{name}[{i}]" for i in range(len(child_ids))]
        return await self._wait_group(
            f"{name}.result",
            group,
            child_ids,
            names,
            definition.output_type,
            return_exceptions=return_exceptions,
            join=False,
        )

    async def gather(
        self,
        name: str,
        handles: Sequence[tuple[str, UUID, Any]],
        *,
        return_exceptions: bool,
    ) -> list[Any]:
        """Wait, parked, until every child of `handles` (start step name, run id, output
        type) finished; woken once, by the write that finishes the last one. Outcomes in the
        order of `handles`. The children join a group `name` (`ChildGroupStore.join_group`)
        before this run parks; a replay returns or raises from the record."""
        check_name("step", name)
        self._group_store(f"gather {name!r}")
        full = self.history.next_occurrence(name)
        group = ChildGroup(parent_run_id=self._host.claimed.run_id, name=group_fact(full))
        return await self._wait_group(
            name,
            group,
            [run_id for _, run_id, _ in handles],
            [start for start, _, _ in handles],
            Any,
            return_exceptions=return_exceptions,
            join=True,
            output_types=[t for _, _, t in handles],
        )

    async def _wait_group(
        self,
        result_name: str,
        group: ChildGroup,
        child_ids: list[UUID],
        names: list[str],
        output_type: Any,
        *,
        return_exceptions: bool,
        join: bool,
        output_types: list[Any] | None = None,
    ) -> list[Any]:
        """Park on the group's fact until its last member finished, then record every
        member's outcome, in order, as the step `result_name` (kind `fact`) and return them
        (or raise `ChildrenFailedError`); a replay does the same from the record."""
        types = output_types or [output_type] * len(child_ids)
        full = self.history.occurrence(result_name)
        label = full.removesuffix(".result")  # the map's or gather's name, as errors say it
        last = self.history.last(full, "fact")
        replayed = last is not None and last.status == "completed"
        _probe.report("call", full, step_kind="fact", replayed=replayed)
        if last is not None and last.status == "completed":
            self._telemetry.replayed(last)
            return _group_outcome(
                label, child_ids, names, last.output_json, types, return_exceptions
            )
        if not child_ids:
            return []
        self._host.check_before_step()
        self._host.go_live()
        store = self._group_store(f"wait {result_name!r}")
        started = last.started_at if last is not None and last.started_at else self._host.now()
        backend = self._host.backend
        run_id = self._host.claimed.run_id
        if join:
            await self._host.guard(store.join_group(group, child_ids))
        while True:
            facts = await self._host.guard(backend.get_facts(run_id=run_id, name=group.name))
            if facts:
                members = await self._host.guard(
                    store.group_runs(parent_run_id=run_id, name=group.name)
                )
                by_id = {member.run_id: member for member in members}
                output = "[" + ",".join(_child_envelope(by_id.get(c)) for c in child_ids) + "]"
                await self._record(
                    self._step_record(
                        full,
                        "fact",
                        status="completed",
                        started_at=started,
                        finished_at=self._host.now(),
                        output_json=output,
                    )
                )
                return _group_outcome(label, child_ids, names, output, types, return_exceptions)
            waiting = (
                None
                if last is not None
                else self._step_record(full, "fact", status="waiting", started_at=started)
            )
            _probe.reach(self._host.aborts, "park", full, step_kind="fact")
            if await self._host.park(
                outcome="waiting", step=waiting, available_at=None, wait_for=group.name
            ):
                self._telemetry.event(
                    "umt.children.wait",
                    **{"umt.step.name": full, "umt.children.count": len(child_ids)},
                )
                raise Suspend
            # The last child finished between our look and the park: go round again.

    async def sleep(self, name: str, duration: timedelta) -> None:
        check_name("sleep", name, argument="name")
        if not isinstance(duration, timedelta):
            raise UsageError(
                f"sleep {name!r}: duration must be a timedelta such as timedelta(minutes=5), "
                f"got {duration!r}",
                argument="duration",
            )
        full = self.history.occurrence(name)
        last = self.history.last(full, "sleep")
        replayed = last is not None and last.status == "completed"
        _probe.report("call", full, step_kind="sleep", replayed=replayed)
        if last is not None and last.status == "completed":
            self._telemetry.replayed(last)
            return
        self._host.check_before_step()
        self._host.go_live()
        now = self._host.now()
        if last is None:
            if duration <= timedelta(0):
                await self._record(
                    self._step_record(
                        full,
                        "sleep",
                        status="completed",
                        started_at=now,
                        finished_at=now,
                        wake_at=now,
                    )
                )
                return
            wake_at = now + duration
            waiting = self._step_record(
                full, "sleep", status="waiting", started_at=now, wake_at=wake_at
            )
            _probe.reach(self._host.aborts, "park", full, step_kind="sleep")
            await self._host.park(outcome="waiting", step=waiting, available_at=wake_at)
            self._telemetry.event(
                "umt.sleep", **{"umt.step.name": full, "umt.sleep.until": wake_at.isoformat()}
            )
            raise Suspend
        wake_at = last.wake_at or now
        if wake_at <= now:
            await self._record(
                self._step_record(
                    full,
                    "sleep",
                    status="completed",
                    started_at=last.started_at,
                    finished_at=now,
                    wake_at=wake_at,
                )
            )
            self._telemetry.event("umt.sleep.done", **{"umt.step.name": full})
            return
        _probe.reach(self._host.aborts, "park", full, step_kind="sleep")
        await self._host.park(outcome="waiting", step=None, available_at=wake_at)
        self._telemetry.event(
            "umt.sleep", **{"umt.step.name": full, "umt.sleep.until": wake_at.isoformat()}
        )
        raise Suspend

    async def wait_for_fact(
        self,
        name: str,
        *,
        timeout: timedelta | None,
        check: Callable[[], Any] | None,
        payload_type: Any,
        poll: timedelta | None,
    ) -> Any:
        check_name("fact", name, argument="name")
        _check_wait_arguments(name, timeout=timeout, check=check, poll=poll)
        return await self._wait_for(
            self.history.occurrence(name),
            name,
            timeout=timeout,
            deadline_at=None,
            check=check,
            payload_type=payload_type,
            poll=poll,
        )

    async def callback_token(self, name: str, timeout: timedelta) -> str:
        """Mint the callback `name`'s token, once: a step whose record keeps the token, so a
        replay returns the same one (see `_callbacks`)."""
        full = self.history.occurrence(name)
        run_id = self._host.claimed.run_id
        last = self.history.last(full, "step")
        if last is not None and last.status == "completed" and not minted_for(last, run_id):
            last = None  # copied from the run this one was forked from: mint its own token
        replayed = last is not None and last.status == "completed"
        _probe.report("call", full, step_kind="step", replayed=replayed)
        if last is not None and last.status == "completed":
            minted = minted_of(last)
            if minted is None:
                raise NonDeterminismError(
                    f"step {full!r} of run {self._host.claimed.run_id} was recorded as a "
                    "plain step but the code now makes it a callback token; bump the task's "
                    "version for incompatible changes",
                    step_name=full,
                )
            self._telemetry.replayed(last)
            return minted.token
        self._host.check_before_step()
        self._host.go_live()
        now = self._host.now()
        token = mint_token(run_id)
        await self._record(
            self._step_record(
                full,
                "step",
                status="completed",
                started_at=now,
                finished_at=now,
                output_json=callback_envelope(full, token, now + timeout),
            )
        )
        self._telemetry.event("umt.callback.minted", **{"umt.step.name": full})
        return token

    async def wait_for_callback(self, token: str, payload_type: Any) -> Any:
        """Wait durably for `token`'s completion: a fact wait on the callback's fact, with the
        token's expiry as its deadline (then `CallbackTimeoutError`, recorded)."""
        run_id = self._host.claimed.run_id
        bound_to = parse_token(token, where="wait_for_callback()")
        minted = find_minted(self.history.latest(), token) if bound_to == run_id else None
        if minted is None:
            raise UsageError(
                "wait_for_callback(): the token was not minted by this run's "
                "ctx.step.callback_token(); a run waits only for its own callbacks",
                argument="token",
            )
        try:
            return await self._wait_for(
                self.history.occurrence(minted.fact),
                minted.fact,
                timeout=None,
                deadline_at=minted.expires_at,
                check=None,
                payload_type=payload_type,
                poll=None,
            )
        except FactTimeoutError as exc:
            raise CallbackTimeoutError(
                f"callback {minted.step_name!r} was not completed before its token expired "
                f"at {minted.expires_at.isoformat()}",
                callback_name=minted.step_name,
            ) from exc

    async def _wait_for(
        self,
        full: str,
        name: str,
        *,
        timeout: timedelta | None,
        deadline_at: datetime | None,
        check: Callable[[], Any] | None,
        payload_type: Any,
        poll: timedelta | None,
    ) -> Any:
        """Wait for the fact `name` as the step `full`: until `timeout` from the wait's start,
        or `deadline_at`, or for ever when both are None."""
        last = self.history.last(full, "fact")
        replayed = last is not None and last.status == "completed"
        _probe.report("call", full, step_kind="fact", replayed=replayed)
        if last is not None and last.status == "completed":
            self._telemetry.replayed(last)
            return _fact_outcome(full, name, last.output_json, payload_type)
        self._host.check_before_step()
        self._host.go_live()
        started = last.started_at if last is not None and last.started_at else self._host.now()
        deadline: datetime | None
        if last is not None:
            deadline = last.wake_at
        else:
            deadline = started + timeout if timeout is not None else deadline_at
        while True:
            now = self._host.now()
            if check is not None:
                if inspect.iscoroutinefunction(check):
                    value = await check()
                else:
                    value = await self._host.in_thread(check)
                    if inspect.isawaitable(value):
                        value = await value
                if value is not None:
                    text = _serde.encode(value, payload_type, what=f"fact {name!r} from check()")
                    return await self._fact_arrived(
                        full, name, started, now, text, "check", payload_type
                    )
            fact = _visible_fact(
                await self._host.guard(
                    self._host.backend.get_facts(run_id=self._host.claimed.run_id, name=name)
                )
            )
            if fact is not None:
                return await self._fact_arrived(
                    full, name, started, now, fact.payload_json, "signal", payload_type
                )
            if deadline is not None and now >= deadline:
                await self._record(
                    self._step_record(
                        full,
                        "fact",
                        status="completed",
                        started_at=started,
                        finished_at=now,
                        wake_at=deadline,
                        output_json='{"timeout":true}',
                    )
                )
                self._telemetry.event("umt.fact.timeout", **{"umt.fact.name": name})
                return _fact_outcome(full, name, '{"timeout":true}', payload_type)
            wake_at = deadline
            if poll is not None:
                wake_at = now + poll if wake_at is None else min(wake_at, now + poll)
            waiting = (
                None
                if last is not None
                else self._step_record(
                    full, "fact", status="waiting", started_at=started, wake_at=deadline
                )
            )
            _probe.reach(self._host.aborts, "park", full, step_kind="fact")
            if await self._host.park(
                outcome="waiting", step=waiting, available_at=wake_at, wait_for=name
            ):
                self._telemetry.event(
                    "umt.wait_for_fact",
                    **{
                        "umt.fact.name": name,
                        "umt.fact.deadline": deadline.isoformat() if deadline else None,
                    },
                )
                raise Suspend
            # The fact arrived between our look and the park: go round again.


_CHILD_RETRY = RetryPolicy(
    max_attempts=5,
    initial=timedelta(seconds=1),
    max_interval=timedelta(seconds=60),
    non_retryable=(IdempotencyConflictError, PayloadError, UsageError),
)
"""Starting a child is an enqueue: retried like a network call when the backend fails, never
when the child's input is refused."""


def child_fact(child_id: UUID) -> str:
    """The fact a child run stores for its parent when it finishes (`NewRun.parent_fact`)."""
    return f"{CHILD_KEY_PREFIX}{child_id}"


def _child_envelope(child: RunRecord | None) -> str:
    """How a child ended, as its parent records it: `{"status": ..., "output": ...}` with the
    output verbatim, or the error, or the cancel's reason."""
    if child is None:  # pruned before the parent read it: say so rather than hang
        return json.dumps(
            {
                "status": "failed",
                "error": {"type": "RunNotFoundError", "message": "the child run is gone"},
            }
        )
    if child.status == "completed":
        return '{"status":"completed","output":' + (child.output_json or "null") + "}"
    if child.status in ("failed", "compensated"):  # a compensated child failed too
        error = child.error
        return json.dumps(
            {
                "status": "failed",
                "error": {
                    "type": error.type if error else "",
                    "message": error.message if error else "",
                },
            }
        )
    return json.dumps({"status": "canceled", "reason": child.cancel_reason or ""})


def _child_outcome(
    start_name: str, child_id: UUID, output_json: str | None, output_type: Any
) -> Any:
    return _child_outcome_of(start_name, child_id, json.loads(output_json or "{}"), output_type)


def _child_outcome_of(start_name: str, child_id: UUID, raw: Any, output_type: Any) -> Any:
    status = raw.get("status")
    if status == "completed":
        return _serde.from_raw(
            raw.get("output"), output_type, what=f"output of child {start_name!r}"
        )
    if status == "canceled":
        reason = str(raw.get("reason", ""))
        raise ChildCanceledError(
            f"child run {child_id} (step {start_name!r}) was canceled: {reason}",
            run_id=child_id,
            step_name=start_name,
            reason=reason,
        )
    error = raw.get("error") or {}
    error_type, message = str(error.get("type", "")), str(error.get("message", ""))
    raise ChildFailedError(
        f"child run {child_id} (step {start_name!r}) failed: {error_type}: {message}",
        run_id=child_id,
        step_name=start_name,
        error_type=error_type,
        error_message=message,
    )


def _consume(task: asyncio.Future[Any]) -> None:
    """Read a cut-off body's ending so asyncio never reports it as unread."""
    if not task.cancelled():
        task.exception()


def group_fact(full_name: str) -> str:
    """The fact a child group stores for its parent when its last member finishes: named
    after the map's or gather's recorded step name. It holds a space, which no fact sent with
    `signal` can (their names are checked), so only the group's last member can store it."""
    return f"umt.group {full_name}"


def _group_outcome(
    step_name: str,
    child_ids: list[UUID],
    names: list[str],
    output_json: str | None,
    output_types: list[Any],
    return_exceptions: bool,
) -> list[Any]:
    envelopes = json.loads(output_json or "[]")
    results: list[Any] = []
    errors: dict[int, ChildFailedError | ChildCanceledError] = {}
    for i, (child_id, start_name, envelope, output_type) in enumerate(
        zip(child_ids, names, envelopes, output_types, strict=True)
    ):
        try:
            results.append(_child_outcome_of(start_name, child_id, envelope, output_type))
        except (ChildFailedError, ChildCanceledError) as exc:
            results.append(exc)
            errors[i] = exc
    if errors and not return_exceptions:
        first = errors[min(errors)]
        raise ChildrenFailedError(
            f"{len(errors)} of the {len(results)} children of {step_name!r} did not complete "
            f"(the first: {first}); the error's `results` has every child's outcome in order, "
            "its `errors` each failure by index (or pass return_exceptions=True)",
            step_name=step_name,
            results=results,
            errors=errors,
        )
    return results


def _step_failed(name: str, error: ErrorInfo | None) -> StepFailedError:
    error_type = error.type if error else "Error"
    message = error.message if error else ""
    return StepFailedError(
        f"step {name!r} failed after its last attempt: {error_type}: {message}",
        step_name=name,
        error_type=error_type,
        error_message=message,
    )


def _visible_fact(facts: Sequence[Fact]) -> Fact | None:
    """The fact a wait receives: the run's own, else the broadcast one."""
    for fact in facts:
        if fact.run_id is not None:
            return fact
    return facts[0] if facts else None


def _fact_envelope(payload_json: str, source: str) -> str:
    """The stored output of a fact wait that received one: the payload verbatim, and where it
    came from (`signal` or `check`). Parsed only by `_fact_outcome`."""
    return '{"fact":' + payload_json + ',"source":"' + source + '"}'


def _fact_outcome(
    step_name: str, fact_name: str, output_json: str | None, payload_type: Any
) -> Any:
    raw = json.loads(output_json or "{}")
    if raw.get("timeout"):
        raise FactTimeoutError(
            f"no fact {fact_name!r} arrived before the wait {step_name!r} timed out",
            fact_name=fact_name,
        )
    return _serde.from_raw(raw.get("fact"), payload_type, what=f"fact {fact_name!r}")
