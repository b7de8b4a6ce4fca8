"""The backend SPI: the records that cross the boundary and the protocol a backend implements.

A backend stores and claims; everything else (replay, retries, timing, the worker loop) lives in
`umt_sdk`. Payloads cross the boundary as JSON text. Every write made on behalf of an execution
carries its `Lease` and must be rejected with `FencingError` when the run's current fencing token
is not the lease's (another attempt took over).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol
from uuid import UUID

from attrs import field, frozen

__all__ = [
    "Backend",
    "Beat",
    "CancelOutcome",
    "ClaimedRun",
    "Clock",
    "EnqueueResult",
    "ErrorInfo",
    "ExecutionOutcome",
    "ExecutionRecord",
    "Fact",
    "HeartbeatResult",
    "Lease",
    "Ledger",
    "LedgerEntry",
    "NewRun",
    "ParkStatus",
    "RunQuery",
    "RunRecord",
    "RunStatus",
    "StepKind",
    "StepRecord",
    "StepStatus",
    "TaskPair",
]

RunStatus = Literal["pending", "running", "waiting", "completed", "failed", "canceled"]
"""pending: runnable once `available_at` comes (new, or waiting out a retry backoff);
running: leased by a worker; waiting: parked on a durable sleep or a fact;
completed/failed/canceled: terminal."""

TERMINAL_STATUSES: frozenset[str] = frozenset({"completed", "failed", "canceled"})

StepKind = Literal["step", "sleep", "fact"]
StepStatus = Literal["completed", "failed", "retrying", "waiting"]
"""completed: output recorded; failed: no retries left (error recorded, replayed as an error);
retrying: this attempt failed and another is scheduled; waiting: a sleep or fact wait is parked."""

ParkStatus = Literal["waiting", "pending"]
ExecutionOutcome = Literal[
    "running", "completed", "failed", "retrying", "waiting", "canceled", "released", "interrupted"
]
CancelOutcome = Literal["canceled", "requested", "already_finished"]


def _tz_aware(_: object, attribute: Any, value: datetime | None) -> None:
    if value is not None and value.tzinfo is None:
        raise ValueError(f"{attribute.name} must be timezone-aware, got {value!r}")


def _tz_aware_required(_: object, attribute: Any, value: datetime) -> None:
    if value.tzinfo is None:
        raise ValueError(f"{attribute.name} must be timezone-aware, got {value!r}")


def _positive_token(_: object, __: object, value: int) -> None:
    if value < 1:
        raise ValueError(f"fencing_token must be >= 1, got {value}")


_PAIR = re.compile(r"^(?P<name>[A-Za-z0-9_.:\-/]+)@(?P<version>[0-9]+)$")


@frozen(kw_only=True, order=True)
class TaskPair:
    """A task name and version: the unit a worker group claims."""

    name: str
    version: int

    @classmethod
    def parse(cls, text: str) -> TaskPair:
        """Parse `"name@version"`."""
        match = _PAIR.match(text.strip())
        if match is None:
            raise ValueError(
                f"expected 'task_name@version' such as 'submit_download@2', got {text!r}"
            )
        return cls(name=match["name"], version=int(match["version"]))

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


class Clock(Protocol):
    """Where backends that keep their own time (the memory backend) read it."""

    def now(self) -> datetime: ...


@frozen(kw_only=True)
class ErrorInfo:
    """An error as recorded: its qualified type name, message and formatted traceback."""

    type: str
    message: str
    traceback: str = ""


@frozen(kw_only=True)
class NewRun:
    """What `enqueue` stores."""

    run_id: UUID
    task_name: str
    task_version: int
    input_json: str
    input_hash: str
    priority: int = 0
    idempotency_key: str | None = None
    delay: timedelta | None = None
    trace_context: Mapping[str, str] = field(factory=dict)


@frozen(kw_only=True)
class EnqueueResult:
    """The run that holds the input: a new one (`created`) or the one the idempotency key names."""

    run_id: UUID
    created: bool
    task_version: int | None = None
    """The version of the run (the existing one's when not `created`). None: the backend does
    not say, and the engine reads the run to check that the key names the version asked for."""
    input_hash: str | None = None
    """When not `created`: the stored input hash of the run the key names. The engine refuses
    the enqueue (`IdempotencyConflictError`) when it is not the new run's: the backend stores
    and reports, the SDK decides. None: the backend does not say."""


@frozen(kw_only=True)
class Lease:
    """An execution's hold on a run. Every write on the run's behalf carries it."""

    run_id: UUID
    fencing_token: int = field(validator=_positive_token)
    worker_id: str
    duration: timedelta


@frozen(kw_only=True)
class StepRecord:
    """One recorded step attempt."""

    name: str
    kind: StepKind
    status: StepStatus
    attempt: int = 1
    fencing_token: int = 0
    output_json: str | None = None
    error: ErrorInfo | None = None
    started_at: datetime | None = field(default=None, validator=_tz_aware)
    finished_at: datetime | None = field(default=None, validator=_tz_aware)
    wake_at: datetime | None = field(default=None, validator=_tz_aware)
    """For `waiting` sleeps and fact waits: when the sleep ends or the wait times out."""


@frozen(kw_only=True)
class ClaimedRun:
    """A run handed to a worker, with everything needed to replay it."""

    run_id: UUID
    task_name: str
    task_version: int
    input_json: str
    priority: int
    fencing_token: int = field(validator=_positive_token)
    claimed_at: datetime = field(validator=_tz_aware_required)
    """The backend's clock at the claim: the worker measures time from here."""
    claims: int
    failures: int
    trace_context: Mapping[str, str] = field(factory=dict)
    steps: Sequence[StepRecord] = ()
    ready_at: datetime | None = None
    """When the run became claimable (for the claim-latency metric)."""
    lost_leases: int = 0
    """When this claim takes over an expired lease: how many leases the run has lost since it
    last recorded a step, this one included (the executions whose lease expired, counting the
    one that recorded the newest step record and every later one); 0 for any other claim.
    The worker fails the run instead of executing it when this reaches the task's
    `max_lost_leases`."""


@frozen(kw_only=True)
class Beat:
    """One run in a heartbeat, with the step it is in (for the timeline of interrupted attempts)."""

    run_id: UUID
    fencing_token: int
    current_step: str | None = None
    step_started_at: datetime | None = None


@frozen(kw_only=True)
class HeartbeatResult:
    """Runs whose lease was lost (stop working on them) and runs whose cancel was requested."""

    lost: frozenset[UUID] = frozenset()
    cancel_requested: Mapping[UUID, str] = field(factory=dict)


@frozen(kw_only=True)
class Fact:
    """A durable fact: first write wins."""

    name: str
    run_id: UUID | None
    payload_json: str
    created_at: datetime


@frozen(kw_only=True)
class ExecutionRecord:
    """One claim of a run, and how it ended."""

    fencing_token: int
    worker_id: str
    claimed_at: datetime
    ended_at: datetime | None
    outcome: ExecutionOutcome
    current_step: str | None = None
    step_started_at: datetime | None = None


@frozen(kw_only=True)
class RunRecord:
    """A run as stored. `steps` and `executions` are filled by `get_run`, empty in lists."""

    run_id: UUID
    task_name: str
    task_version: int
    status: RunStatus
    priority: int
    created_at: datetime
    updated_at: datetime
    available_at: datetime | None
    """When the run may next be claimed; None while it waits for a fact with no deadline."""
    input_json: str
    idempotency_key: str | None = None
    output_json: str | None = None
    error: ErrorInfo | None = None
    claims: int = 0
    failures: int = 0
    lease_expirations: int = 0
    fencing_token: int = 0
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    finished_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    cancel_reason: str | None = None
    wait_for: str | None = None
    trace_context: Mapping[str, str] = field(factory=dict)
    steps: Sequence[StepRecord] = ()
    executions: Sequence[ExecutionRecord] = ()
    observed_at: datetime | None = field(default=None, validator=_tz_aware)
    """The backend's clock when it read the record (the database's `now()`, the memory
    backend's clock): what `lease_expires_at` is compared with to tell an expired lease."""


@frozen(kw_only=True)
class RunQuery:
    """Filters for `list_runs`; newest first; `before` is the cursor (a run id from a page)."""

    task_name: str | None = None
    task_version: int | None = None
    status: RunStatus | None = None
    limit: int = 100
    before: UUID | None = None


@frozen(kw_only=True)
class LedgerEntry:
    """What the operation ledger knows of an op key when an attempt begins it."""

    result_json: str | None
    """The recorded result: the operation is done, return it."""
    resumed: bool
    """An earlier attempt began this operation and left no result: reconcile first."""


class Ledger(Protocol):
    """The operation ledger behind `with_attempt_token`, bound to one business connection.

    The fence is the ledger row of the op key: it holds the token of the attempt that last
    began the operation, and a begin never lowers it. No lock on the engine's rows (the run) is
    ever held while user code runs: a frozen or slow commit callback must not delay a takeover,
    a cancel or another run's heartbeat.
    """

    async def begin(self, *, op_key: str, lease: Lease) -> LedgerEntry:
        """Record that `lease` begins `op_key` and say what is known of it.

        Refused (`FencingError`) when the run is no longer held under the lease's token, or a
        newer attempt has begun the op; otherwise the op's token is raised to the lease's.
        """
        ...

    async def finish(
        self,
        *,
        op_key: str,
        lease: Lease,
        result_json: str,
        commit: Callable[[Any], Awaitable[None]],
    ) -> None:
        """In one transaction: fence, run `commit(tx)`, fence again and record the result.

        Fence first: when the run or the op's token is no longer the lease's, or the op has a
        result, raise `FencingError` without calling `commit`; if `commit` raises and the
        attempt turns out stale, raise `FencingError` from that error. The result (and the
        writes of `commit`) land only if the op's token is still the lease's when it is
        recorded, atomically with that check, and the run is still held.
        """
        ...


class Backend(Protocol):
    """What a storage backend implements. See `umt_sdk.testing.BackendContract` for the rules."""

    @property
    def clock(self) -> Clock | None:
        """The backend's clock when it keeps time in process (the memory backend); None when
        time is the database's, and workers measure it from `ClaimedRun.claimed_at`."""
        ...

    async def enqueue(self, new: NewRun, *, conn: Any = None) -> EnqueueResult:
        """Store a run (inside the caller's transaction `conn` when given).

        Same idempotency key: same input hash returns the existing run (`created=False`,
        with its `task_version`), a different hash raises `IdempotencyConflictError`. Keys
        never expire silently. The engine refuses a key that names another version.
        """
        ...

    async def claim(
        self,
        *,
        worker_id: str,
        pairs: Sequence[TaskPair],
        limit: int,
        lease: timedelta,
    ) -> Sequence[ClaimedRun]:
        """Lease up to `limit` available runs of `pairs`, each with a new, larger fencing token.

        The order is one rule on every backend (the contract suite checks it). Within a pair,
        runs go highest priority first, then the earliest ready (`available_at`; for an expired
        lease, its expiry), FIFO among equals. Across pairs, runs are taken in turns: turn k
        holds the k-th run of every pair, so a batch of N over m busy pairs gives each about
        N/m and no pair starves another; within a turn, the higher priority goes first, then
        the earlier ready, whatever pair it belongs to. So a single slot (`limit=1`) goes to
        the highest-priority ready run of all the pairs, the earliest ready among equals; the
        order in which `pairs` (or a registry) lists them never matters.
        Runs whose lease expired are available. Never returns a run whose cancel was requested
        (such a run is finished as canceled instead).

        A claim that takes over an expired lease counts it (`RunRecord.lease_expirations`),
        marks the old execution `interrupted` and reports in `ClaimedRun.lost_leases` how many
        leases the run lost since its last step record; the SDK decides what that means (the
        task's `max_lost_leases`), so the backend needs no limit of its own."""
        ...

    async def heartbeat(
        self, *, worker_id: str, beats: Sequence[Beat], lease: timedelta
    ) -> HeartbeatResult:
        """Extend every lease in `beats` still held; report the lost ones and cancel requests."""
        ...

    async def record_step(self, lease: Lease, step: StepRecord) -> None:
        """Record a step attempt if `lease` still holds the run, and extend the lease."""
        ...

    async def park(
        self,
        lease: Lease,
        *,
        step: StepRecord | None,
        wake_at: datetime | None,
        wait_for: str | None,
        status: ParkStatus,
    ) -> bool:
        """Release the run until `wake_at` (None: until a fact wakes it), recording `step`.

        With `wait_for`, a fact of that name (for the run, or broadcast) wakes the run; if such a
        fact is already stored the run is not parked and False is returned (no lost wake-up).
        """
        ...

    async def complete(self, lease: Lease, *, output_json: str) -> None:
        """Finish the run as completed."""
        ...

    async def fail(self, lease: Lease, *, error: ErrorInfo, retry_at: datetime | None) -> None:
        """Count a failure; reschedule at `retry_at`, or finish as failed when None."""
        ...

    async def finish_canceled(self, lease: Lease, *, error: ErrorInfo | None) -> None:
        """Finish a run whose cancel was requested, keeping the handler's error if any."""
        ...

    async def release(self, lease: Lease) -> None:
        """Give the run back (worker shutdown) without charging a failure."""
        ...

    async def signal(self, *, run_id: UUID | None, name: str, payload_json: str) -> bool:
        """Store a fact (run-scoped, or broadcast when `run_id` is None) and wake its waiters.
        First write wins: returns False when the fact already existed. The engine passes None
        only from `broadcast`; `signal` refuses a missing run id before it gets here."""
        ...

    async def get_fact(self, *, run_id: UUID, name: str) -> Fact | None:
        """The run's fact of that name, else the broadcast fact of that name."""
        ...

    async def cancel(self, run_id: UUID, *, reason: str) -> CancelOutcome:
        """Request cancellation durably; finish at once a run that is not running."""
        ...

    async def get_run(self, run_id: UUID) -> RunRecord | None:
        """The run with its steps and executions, or None."""
        ...

    async def list_runs(self, query: RunQuery) -> Sequence[RunRecord]:
        """Runs matching `query`, newest first, without steps."""
        ...

    async def queue_depths(self, pairs: Sequence[TaskPair]) -> Mapping[TaskPair, int]:
        """How many runs of each pair are pending (for the queue-depth gauge; keep it cheap)."""
        ...

    async def wait_for_work(self, *, pairs: Sequence[TaskPair], timeout: float) -> None:
        """Return when runs of `pairs` may have become available, or after `timeout` seconds."""
        ...

    async def wait_for_run(self, run_id: UUID, *, timeout: float) -> None:
        """Return when the run may have changed state, or after `timeout` seconds."""
        ...

    def add_cancel_listener(self, listener: Callable[[UUID, str], None]) -> Callable[[], None]:
        """Call `listener(run_id, reason)` as soon as a cancel may have been requested, where
        the backend can (the heartbeat reports it otherwise). Returns a function that removes it.

        A call is only a hint to look: the worker acts on the heartbeat's answer (what is
        stored), never on the call itself, so a backend whose hints can be forged (Postgres
        NOTIFY) cannot be used to cancel a run."""
        ...

    def ledger(self, conn: Any) -> Ledger:
        """The operation ledger on the business connection `conn`."""
        ...

    async def close(self) -> None:
        """Release connections and background tasks."""
        ...
