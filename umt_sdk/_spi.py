"""The backend SPI: the records that cross the boundary and the protocol a backend implements.

The rule of the seam: **the SDK decides, the backend stores.** Everything that is a decision
lives in `umt_sdk`: replay, retries and their timing, whether a failure retries the step, the
run or nothing, what an ending means (`Ending` carries the status, the execution's outcome, the
time the run is next due, the error and whether it counts as a failure), when a run has lost its
lease too often, which fact a wait receives (the run's own before the broadcast one), whether an
idempotency key may be reused (the backend reports the stored hash and version), and how a
stored execution reads (`running` past its lease reads `interrupted`: `umt_sdk._views`).

A backend author must store, atomically and durably before returning:
- what it is given, as given (runs, step records, facts, endings, cancel requests), and read it
  back unchanged (payloads cross the boundary as JSON text);
- the fencing token: each claim takes a new, strictly larger one (never reused, even after a
  crash or a failover of the store), and every write on an execution's behalf carries its
  `Lease` and is refused with `FencingError` when the run's token is no longer the lease's;
- the few conditions only the store can check atomically with a write, each named where it
  applies: first write wins for a fact and for an idempotency key; a park onto a fact already
  stored is refused (no lost wake-up); a hand-back of a run whose cancel was requested is
  refused; a claim takes only available runs, in the one order `claim` documents.
It may not decide anything else: no retry policy, no limits of its own, no rewriting of what it
was given. `umt_sdk.testing.BackendContract` checks all of this against a real store.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol
from uuid import UUID

from attrs import field, frozen

from umt_sdk import _check as check
from umt_sdk.exceptions import UsageError

__all__ = [
    "Backend",
    "Beat",
    "CancelOutcome",
    "ClaimedRun",
    "Clock",
    "EndResult",
    "EndStatus",
    "Ending",
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
    "RunQuery",
    "RunRecord",
    "RunStatus",
    "SimulatedCrash",
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


def _pair_name(_: object, __: object, value: str) -> None:
    check.text(value, "name", empty=False, max_length=200, where="TaskPair")


def _pair_version(_: object, __: object, value: int) -> None:
    check.integer(value, "version", at_least=1, where="TaskPair")


@frozen(kw_only=True, order=True)
class TaskPair:
    """A task name and version: the unit a worker group claims."""

    name: str = field(validator=_pair_name)
    version: int = field(validator=_pair_version)

    @classmethod
    def parse(cls, text: str) -> TaskPair:
        """Parse `"name@version"` (else `UsageError`, a ValueError)."""
        check.text(
            text, "text", expected="a string such as 'submit_download@2'", where="TaskPair.parse"
        )
        match = _PAIR.match(text.strip())
        if match is None:
            raise UsageError(
                "TaskPair.parse(text): expected 'task_name@version' such as 'submit_download@2', "
                f"got {text!r}",
                argument="text",
            )
        return cls(name=match["name"], version=int(match["version"]))

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


class SimulatedCrash(BaseException):
    """Raised by test backends to make an execution vanish as if its process were SIGKILLed."""


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
    cancel_reason: str | None = None
    """Set (the stored reason, "" if none) when the run's cancel was requested before this
    claim: an execution that held it was cut off before it could end it. The worker ends the
    run canceled without running the handler."""


EndStatus = Literal["completed", "failed", "canceled", "pending", "waiting"]
EndResult = Literal["ended", "fact_present", "cancel_requested"]


@frozen(kw_only=True)
class Ending:
    """How an execution ends: decided by `umt_sdk`, stored by the backend as given.

    The backend decides none of it. It stores, in one write under the lease: `step` (if any)
    as `record_step` would; `status` as the run's status; `available_at` as when the run may
    next be claimed (for `pending` and `waiting`; None while it waits for `wait_for` with no
    deadline; ignored for the terminal statuses, which set `finished_at` instead); `wait_for`
    as the fact that wakes the run; `output_json` and `error` as the run's output and error
    when given (None keeps what is stored); one more failure when `count_failure`; and
    `outcome` on the execution, whose lease ends. An execution that ends `canceled` keeps the
    step it was in (`current_step`, from its heartbeats), so the timeline shows it canceled;
    every other ending clears it.
    """

    status: EndStatus
    outcome: ExecutionOutcome
    available_at: datetime | None = field(default=None, validator=_tz_aware)
    wait_for: str | None = None
    step: StepRecord | None = None
    output_json: str | None = None
    error: ErrorInfo | None = None
    count_failure: bool = False

    @property
    def finishes(self) -> bool:
        """Whether the run ends with this execution (a terminal status)."""
        return self.status in TERMINAL_STATUSES


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
    """One claim of a run, and how it ended, as stored: a backend reports the outcome it
    wrote (`running` until the execution's ending write or a takeover marks it). Whether a
    `running` one reads `interrupted` (it lost the run, or its lease lapsed) is the SDK's
    rule (`umt_sdk._views.execution_outcome`), not the backend's."""

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
        """Store a run (inside the caller's transaction `conn` when given; a `conn` this
        backend cannot join is refused with `UsageError`).

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
        Runs whose lease expired are available. A run whose cancel was requested is claimed
        like any other, with `ClaimedRun.cancel_reason` set: the SDK decides what that means.

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

    async def end_execution(self, lease: Lease, ending: Ending) -> EndResult:
        """Store how the execution under `lease` ended, as the SDK decided it, in one write.

        Fenced like every write. Two conditions refuse the ending and change nothing, because
        only the store can see them atomically with the write: `"fact_present"` when
        `ending.wait_for` names a fact already stored for the run or broadcast (no lost
        wake-up), and `"cancel_requested"` when the ending does not finish the run (`pending`
        or `waiting`) and the run's cancel was requested (it must not be parked or handed back
        as if nobody had asked). Otherwise every field of `ending` is stored as given and
        `"ended"` is returned; see `Ending` for what each one means.
        """
        ...

    async def signal(self, *, run_id: UUID | None, name: str, payload_json: str) -> bool:
        """Store a fact (run-scoped, or broadcast when `run_id` is None) and wake its waiters.
        First write wins: returns False when the fact already existed. The engine passes None
        only from `broadcast`; `signal` refuses a missing run id before it gets here."""
        ...

    async def get_facts(self, *, run_id: UUID, name: str) -> Sequence[Fact]:
        """The stored facts of that name that the run can see: its own and the broadcast one
        (none, either or both, in any order; the SDK decides which one a wait receives)."""
        ...

    async def cancel(self, run_id: UUID, *, reason: str) -> CancelOutcome:
        """Request cancellation durably; finish at once a run that is not running."""
        ...

    async def get_run(self, run_id: UUID) -> RunRecord | None:
        """The run with its steps and executions, or None."""
        ...

    async def get_run_head(self, run_id: UUID) -> RunRecord | None:
        """The run without its steps and executions (one read, whatever the run's length), or
        None: what `result()` polls and what reading one field of a run needs."""
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
        """The operation ledger on the business connection `conn` (`UsageError` if this
        backend cannot use it)."""
        ...

    async def close(self) -> None:
        """Release connections and background tasks."""
        ...
