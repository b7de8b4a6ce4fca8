"""The backend SPI: the records that cross the boundary and the protocol a backend implements.

The rule of the seam: **the SDK decides, the backend stores.** Everything that is a decision
lives in `umt_sdk`: replay, retries and their timing, whether a failure retries the step, the
run or nothing, what an ending means (`Ending` carries the status, the execution's outcome, the
time the run is next due, the error and whether it counts as a failure), when a run has lost its
lease too often, which fact a wait receives (the run's own before the broadcast one), whether an
idempotency key may be reused (the backend reports the stored hash and version), what a
claimed run whose cancel was requested does (`ClaimedRun.cancel_reason`), what may be stored at
all (`umt_sdk.backend.unstorable_reason`: the SDK refuses the rest first), and how a stored
execution reads (`running` past its lease reads `interrupted`: `umt_sdk._views`).

Leases, as every method below uses the words. A run is *held* under a fencing token while it is
`running` with that token. Its lease *lapses* at `lease_expires_at`, judged by the store's
clock (the database's `now()`, the memory backend's clock), never by the worker's. A lapsed
lease still writes: `record_step`, `heartbeat`, `end_execution` and the ledger judge the token,
not the time, until a claim takes the run over (any claim may, once the lease lapsed) or a
`cancel` ends it.

A backend author must store, atomically and durably before returning:
- what it is given, as given (runs, step records, facts, endings, cancel requests), and read it
  back unchanged (payloads cross the boundary as JSON text);
- the fencing token: each claim takes a new, strictly larger one (never reused, even after a
  crash or a failover of the store), and every write on an execution's behalf carries its
  `Lease` and is refused with `FencingError` when the run is no longer held under the lease's
  token;
- the few conditions only the store can check atomically with a write, each named where it
  applies: first write wins for a fact and for an idempotency key; a park onto a fact already
  stored is refused (no lost wake-up); a hand-back of a run whose cancel was requested is
  refused; a claim takes only available runs, in the one order `claim` documents, and never more
  runs of a concurrency key than its free slots; a cancel ends
  at once a run nobody holds, a lapsed lease included (`cancel`); a child run that finishes
  stores its parent's fact, and a run that finishes failed or canceled requests the cancel of
  its children that asked for it, each in the write that finishes it (`finishing`, below). A
  backend that stores schedules (`ScheduleStore`, optional) adds two: first write wins for a
  schedule's name, and an update lands only on the version it was made from (compare and set).
  A backend that stores the streams of runs (`StreamStore`, optional) adds two more: first
  write wins for an entry's key within its run's stream, and an entry becomes visible only
  after every earlier entry of its stream (a reader's cursor never skips one).

What a run's finishing write also stores (`finishing`), whichever write finishes it (an
ending, a cancel, a cascade): a run enqueued with `NewRun.parent_fact` stores that fact for
`NewRun.parent_run_id` (payload JSON `null`, first write wins; waking the parent if it waits
for it, as `signal` does); a run that finishes `failed` or `canceled` requests the cancel of
each of its unfinished children enqueued with `cancel_with_parent`, as `cancel` does (reason
`"parent <id> <status>"`: a child nobody holds ends canceled at once and finishes in turn).
A member of a child group (`ChildGroupStore`, optional) also counts itself out of its group
in that write: the group's `remaining` goes down by one; at zero, the group's fact is stored
for the parent (waking it, as above: the one wake-up of a fan-out); and a member that had been
let run (not `held` when it finished) lets the group's first held member run (in input order).
That release is never lost: a store that cannot make it at once (Postgres skips held members
another transaction has locked rather than wait for them) keeps it owed and makes it later (the
next member's finishing write, or a pass of its own), so a map never waits forever with a slot
free and a member held.
It may not decide anything else: no retry policy, no limits of its own, no rewriting of what it
was given. What a backend does on its own (its clock, the lease it extends, what it counts) is
said on each method and record below. `umt_sdk.testing.BackendContract` checks all of this
against a real store.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol, runtime_checkable
from uuid import UUID

from attrs import field, frozen

from umt_sdk import _check as check
from umt_sdk.exceptions import UsageError

__all__ = [
    "Backend",
    "BatchEnqueueStore",
    "Beat",
    "CancelOutcome",
    "ChildGroup",
    "ChildGroupStore",
    "ClaimedRun",
    "Clock",
    "ControllableClock",
    "EndResult",
    "EndStatus",
    "Ending",
    "EnqueueResult",
    "ErrorInfo",
    "ExecutionOutcome",
    "ExecutionRecord",
    "Fact",
    "FinishedCount",
    "HeartbeatResult",
    "InsightStore",
    "KeyUsage",
    "Lease",
    "Ledger",
    "LedgerEntry",
    "LifecycleStore",
    "NewRun",
    "OverlapPolicy",
    "PairActivity",
    "PausedTask",
    "PruneBatch",
    "PruneQuery",
    "PrunedRun",
    "RateLimitInfo",
    "RateLimitStore",
    "RetentionStore",
    "RunQuery",
    "RunRecord",
    "RunStatus",
    "ScheduleQuery",
    "ScheduleRecord",
    "ScheduleState",
    "ScheduleStore",
    "SimulatedCrash",
    "StepKind",
    "StepRecord",
    "StepStatus",
    "StreamAppend",
    "StreamEntry",
    "StreamStore",
    "TaskPair",
    "TokenGrant",
    "TokenRequest",
    "TransactionStore",
    "WorkerRecord",
    "WorkerState",
]

RunStatus = Literal[
    "pending", "running", "waiting", "completed", "failed", "canceled", "compensated"
]
"""pending: runnable once `available_at` comes (new, waiting out a backoff, or handed back);
running: leased by a worker (held while its lease has not lapsed); waiting: parked on a
durable sleep or a fact; completed/failed/canceled/compensated: terminal (compensated: the run
gave up and the compensations of its completed steps ran, see docs/sagas.md)."""

TERMINAL_STATUSES: frozenset[str] = frozenset({"completed", "failed", "canceled", "compensated"})

HELD_WAIT = "umt turn"
"""The `wait_for` of a member of a child group held back by its `max_concurrency`: `waiting`,
with no `available_at`, until a member that ran finishes and lets it run. No fact can wake it
(a fact's name has no space)."""

ATTENTION_WAIT_PREFIX = "umt.attention:"
"""The `wait_for` of a run in `needs_attention`: `umt.attention:<attempt>:<step>`, the fact that
settles that attempt of that step (`umt_sdk._attention`). Such a run is `waiting` with no
`available_at`; `RunQuery.needs_attention` lists them."""

StepKind = Literal["step", "sleep", "fact"]
StepStatus = Literal["completed", "failed", "retrying", "waiting"]
"""completed: output recorded; failed: no retries left (error recorded, replayed as an error);
retrying: this attempt failed and another is scheduled; waiting: a sleep or fact wait is parked."""

ExecutionOutcome = Literal[
    "running",
    "completed",
    "failed",
    "retrying",
    "waiting",
    "canceled",
    "compensated",
    "released",
    "interrupted",
]
CancelOutcome = Literal["canceled", "requested", "already_finished"]


def _tz_aware(_: object, attribute: Any, value: datetime | None) -> None:
    if value is not None and value.tzinfo is None:
        raise ValueError(f"{attribute.name} must be timezone-aware, got {value!r}")


def _tz_aware_required(_: object, attribute: Any, value: datetime) -> None:
    if value.tzinfo is None:
        raise ValueError(f"{attribute.name} must be timezone-aware, got {value!r}")


def _optional_limit(_: object, __: object, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"concurrency_limit must be an integer >= 1, got {value!r}")


def _optional_weight(_: object, __: object, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"fairness_weight must be an integer >= 1, got {value!r}")


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


@runtime_checkable
class ControllableClock(Clock, Protocol):
    """A clock a test moves by hand (`umt_sdk.testing.FakeClock`). A backend that keeps its
    own time checks for it once, when it is given its clock: with one, it wakes its waiters
    when the clock moves and, under `auto_advance`, jumps it to its next timer when every run
    is blocked and someone waits for a result; with a plain `Clock`, it does neither."""

    auto_advance: bool
    """Whether the backend may move the clock to its next timer by itself."""

    def advance_to(self, when: datetime) -> None:
        """Move the clock to `when` if that is later than now."""
        ...

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener()` after every move; returns the function that unsubscribes it."""
        ...


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
    parent_run_id: UUID | None = None
    """The run that started this one (a child run): kept as `RunRecord.parent_run_id`."""
    parent_fact: str | None = None
    """The fact stored for `parent_run_id` when this run finishes (see `finishing` in the
    module docstring): how a parent waiting for its child is woken."""
    cancel_with_parent: bool = False
    """Whether this run's cancel is requested when its parent finishes failed or canceled."""
    rerun_of: UUID | None = None
    """The run this one runs again (`engine.rerun`): kept as `RunRecord.rerun_of`."""
    forked_from: UUID | None = None
    """The run this one is a fork of (`engine.fork`): kept as `RunRecord.forked_from`. A
    backend that stores it (`LifecycleStore`) also copies, in the write that stores the run,
    the step records `kept_steps` names and every fact of that run (its own, not broadcast
    ones), as they are stored: their payloads never leave the store."""
    forked_at_step: str | None = None
    """The step the fork executes from: kept as `RunRecord.forked_at_step`."""
    kept_steps: Sequence[tuple[str, int]] = ()
    """For a fork: the (`name`, `attempt`) of each step record of `forked_from` to copy into
    this run, in the order to record them (the SDK chose them; the store copies them as
    stored, their `output_json`, error, times and token untouched)."""
    tags: Mapping[str, str] = field(factory=dict)
    """The caller's labels (`enqueue(..., tags={"tenant": "t7"})`), checked by the SDK: kept
    as `RunRecord.tags` and matched by `RunQuery.tags`."""
    concurrency_key: str | None = None
    """The run's concurrency key (the SDK computed it from the input): at most
    `concurrency_limit` runs of this task name and key hold a slot at once (see `claim`)."""
    concurrency_limit: int | None = field(default=None, validator=_optional_limit)
    """With `concurrency_key`: the key's limit, stored for the key (the newest enqueue's wins)."""
    count_waiting: bool = False
    """With `concurrency_key`: whether the run keeps its slot while `waiting` (a sleep, a
    wait for a fact); by default a waiting run gives its slot back and needs one again to run."""
    deadline_at: datetime | None = field(default=None, validator=_tz_aware)
    """When the run must be finished by (`enqueue(deadline=...)`), as given."""
    timeout: timedelta | None = None
    """How long the run may take from its enqueue (`@task(timeout=...)`, a relative
    `enqueue(deadline=...)`): the backend's clock at the enqueue plus this. The stored
    deadline (`RunRecord.deadline_at`) is the earlier of the two; None and None: no deadline."""
    start_within: timedelta | None = None
    """How long after it becomes claimable (the enqueue plus `delay`) the run may still be
    started: stored as `RunRecord.start_by`. None: no start deadline."""
    rate_limit: str | None = None
    """The rate limit the run's starts take a token of (`@task(rate_limit=...)`; the SDK
    stored the limit first, `RateLimitStore.define_rate_limit`): see `claim`. None: none."""
    rate_limit_key: str = ""
    """With `rate_limit`: the run's bucket of that limit ("" : the limit's one bucket)."""
    singleton: Literal["skip", "replace"] | None = None
    """With `concurrency_key` (`enqueue(singleton=Singleton(key, mode))`): the backend reads
    the runs of this task name and key that are not terminal under a lock of the key, held
    until the run is stored, so concurrent enqueues of the key are serialized. `"skip"`: when
    there is one, nothing is stored and the result names the newest (`created=False`,
    `skipped=True`, its `task_version`). `"replace"`: the run is stored and the result lists
    them (`EnqueueResult.replaced`); the SDK requests their cancel. The SDK never gives it
    with an idempotency key or `conn`."""
    debounce_key: str | None = None
    """`enqueue(debounce=Debounce(key, period, max_wait))`: under a lock of (task name, key),
    the key's run of this task version that has not started (pending, never claimed) takes
    this input (`input_json`, `input_hash`; nothing else of it changes) and becomes claimable
    at the earliest of the clock plus `delay` (the period), its debounce deadline, and its
    deadline; the result names it (`created=False`, `debounced=True`). Without such a run,
    this one is stored as usual (claimable after `delay`) with its debounce deadline, the
    clock plus `debounce_max_wait` (None: no bound). The SDK never gives it with an
    idempotency key, a start deadline or `conn`."""
    debounce_max_wait: timedelta | None = None
    """With `debounce_key`: how long after the first trigger the run may start at the latest."""
    fairness_weight: int | None = field(default=None, validator=_optional_weight)
    """With `concurrency_key` (`enqueue(fairness_key=..., weight=...)`): the key is a fairness
    key. Its due runs take turns with the other keys of the task name, least recently served
    key first (see `claim`), and a turn takes up to this many of them (the newest enqueue's
    weight is the key's). The SDK gives it with a limit no key reaches (`FAIR_SLOTS`). None:
    not a fairness key."""

    def __attrs_post_init__(self) -> None:
        if (self.concurrency_key is None) != (self.concurrency_limit is None):
            raise ValueError(
                "NewRun: concurrency_key and concurrency_limit go together (both or neither), "
                f"got key {self.concurrency_key!r} and limit {self.concurrency_limit!r}"
            )
        if self.fairness_weight is not None and self.concurrency_key is None:
            raise ValueError("NewRun: fairness_weight needs the key as concurrency_key")
        if self.singleton is not None and self.concurrency_key is None:
            raise ValueError("NewRun: singleton needs the key as concurrency_key")


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
    pruned: bool = False
    """When not `created`: the key names a run that retention deleted (its tombstone,
    `PrunedRun`, keeps the key, input hash and version): the key is still taken."""
    skipped: bool = False
    """When not `created`: the run is the active run of the new run's singleton key
    (`NewRun.singleton` `"skip"`), not the run of an idempotency key."""
    replaced: tuple[UUID, ...] = ()
    """When `created` with `NewRun.singleton` `"replace"`: the key's runs that were not
    terminal when it was stored (the SDK requests their cancel)."""
    debounced: bool = False
    """When not `created`: the run is the key's not yet started run that took the new input
    (`NewRun.debounce_key`)."""


@frozen(kw_only=True)
class Lease:
    """An execution's hold on a run. Every write on the run's behalf carries it."""

    run_id: UUID
    fencing_token: int = field(validator=_positive_token)
    worker_id: str
    duration: timedelta


@frozen(kw_only=True)
class StepRecord:
    """One recorded step attempt, keyed by (`name`, `attempt`) within its run: a record of
    the same try replaces the stored one. A backend stores it under the token of the lease
    that writes it: `fencing_token` reads back as that token, whatever the writer put there."""

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
    """How many times the run has been claimed, this claim included."""
    failures: int
    """As stored: the failures the run's endings counted (`Ending.count_failure`)."""
    trace_context: Mapping[str, str] = field(factory=dict)
    steps: Sequence[StepRecord] = ()
    """Every step record of the run, in the order each was first recorded."""
    ready_at: datetime | None = None
    """When the run became claimable (its `available_at`; for a takeover, when the lease
    lapsed): for the claim-latency metric."""
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
    idempotency_key: str | None = None
    """The run's idempotency key as stored (None without one): a scheduled run's key names
    its tick, which the SDK reads back as `ctx.scheduled_at`."""
    deadline_at: datetime | None = field(default=None, validator=_tz_aware)
    """The run's deadline as stored (`RunRecord.deadline_at`): the SDK ends the run failed
    when it comes (at once, without running the handler, when the claim is past it)."""
    start_by: datetime | None = field(default=None, validator=_tz_aware)
    """The run's start deadline as stored (`RunRecord.start_by`): a first claim past it ends
    the run failed without running the handler."""


EndStatus = Literal["completed", "failed", "canceled", "compensated", "pending", "waiting"]
EndResult = Literal["ended", "fact_present", "cancel_requested"]


def _parks(_: object, __: object, step: StepRecord | None) -> None:
    if step is not None and step.output_json is not None:
        raise ValueError(
            f"an ending's step never carries output, got step {step.name!r} with one: it is "
            "the record that parks the run (a retrying step, a waiting sleep or fact wait); "
            "record a step that finished with record_step"
        )


@frozen(kw_only=True)
class Ending:
    """How an execution ends: decided by `umt_sdk`, stored by the backend as given.

    The backend decides none of it. It stores, in one write under the lease:
    - `step` (if any) as `record_step` stores a step (under the lease's token, replacing the
      same try); it is the record that parks the run (a `retrying` step, a `waiting` sleep
      or fact wait) and never carries output (refused here, so a backend need not store one);
    - `status` as the run's status;
    - `available_at` as when the run may next be claimed, for `pending` and `waiting`: a
      `pending` ending without one is claimable at once (the backend's clock), a `waiting`
      one without one waits for `wait_for` with no deadline; the terminal statuses set
      `finished_at` instead and clear it;
    - `wait_for` as the fact that wakes the run;
    - `output_json` and `error` as the run's output and error when given (None keeps what is
      stored);
    - one more failure when `count_failure`;
    - `outcome` on the execution, whose lease ends (`lease_owner` and `lease_expires_at` are
      cleared). An execution that ends `canceled` keeps the step it was in (`current_step`,
      from its heartbeats), so the timeline shows it canceled; every other ending clears it.
    """

    status: EndStatus
    outcome: ExecutionOutcome
    available_at: datetime | None = field(default=None, validator=_tz_aware)
    wait_for: str | None = None
    step: StepRecord | None = field(default=None, validator=_parks)
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
    unrenewed: frozenset[UUID] = frozenset()
    """Runs still held under their token whose lease this beat could not move on (another
    transaction held the row: above all the worker's own transactional step committing). Not
    lost, but not renewed either: the worker keeps the lease it had, and stops at its end."""


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
    """When the run may next be claimed: for `pending`, when it becomes claimable (its
    enqueue's delay, a backoff's end; at once when handed back); for `waiting`, when its
    sleep ends or its wait times out, None while it waits for a fact with no deadline (a
    fact that arrives makes it the time of arrival). None while the run is `running` (a
    lapsed lease is claimable from `lease_expires_at`) and once it has finished."""
    input_json: str
    idempotency_key: str | None = None
    output_json: str | None = None
    error: ErrorInfo | None = None
    claims: int = 0
    failures: int = 0
    lease_expirations: int = 0
    """Leases that lapsed and were counted: by the claim that took the run over, or by the
    cancel that ended it (`cancel`)."""
    fencing_token: int = 0
    """The token of the newest claim (0 before the first)."""
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    """While `running`: when the lease lapses (a claim, a heartbeat and `record_step` move it
    on). None once the execution has ended."""
    finished_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    """When the cancel was first requested; a later request keeps it and its reason."""
    cancel_reason: str | None = None
    wait_for: str | None = None
    """The fact a `waiting` run was parked on, until a claim takes the run."""
    trace_context: Mapping[str, str] = field(factory=dict)
    parent_run_id: UUID | None = None
    """The run that started this one, if it is a child run."""
    rerun_of: UUID | None = None
    """The run this one runs again (`NewRun.rerun_of`)."""
    forked_from: UUID | None = None
    """The run this one is a fork of (`NewRun.forked_from`)."""
    forked_at_step: str | None = None
    """The step the fork executed from (`NewRun.forked_at_step`)."""
    tags: Mapping[str, str] = field(factory=dict)
    """The labels given at enqueue (`NewRun.tags`)."""
    concurrency_key: str | None = None
    """The run's concurrency key as stored (None without one)."""
    fairness_weight: int | None = None
    """When `concurrency_key` is a fairness key (`NewRun.fairness_weight`): the key's weight
    as stored, read by `get_run` and `get_run_head` (a backend may leave it None in
    `list_runs`); None for other keys."""
    deadline_at: datetime | None = None
    """When the run must be finished by (`NewRun.deadline_at` / `timeout`), None: never."""
    start_by: datetime | None = None
    """When the run must have been claimed by (`NewRun.start_within`), None: no limit."""
    rate_limit: str | None = None
    """The rate limit the run's starts take a token of (`NewRun.rate_limit`), None: none."""
    rate_limit_key: str | None = None
    """With `rate_limit`: the run's bucket ("" : the limit's one bucket)."""
    debounce_key: str | None = None
    """The key it was enqueued with as a debounced run (`NewRun.debounce_key`), None for any
    other run. Read by `get_run` (a list's records may leave it None)."""
    steps: Sequence[StepRecord] = ()
    executions: Sequence[ExecutionRecord] = ()
    observed_at: datetime | None = field(default=None, validator=_tz_aware)
    """The backend's clock when it read the record (the database's `now()`, the memory
    backend's clock): what `lease_expires_at` is compared with to tell an expired lease."""


@frozen(kw_only=True)
class RunQuery:
    """Filters for `list_runs`, all of them at once (None: any); newest first, by run id
    descending; `before` is the cursor: only runs whose id is smaller (a run id from a page,
    which need not exist any more)."""

    task_name: str | None = None
    task_version: int | None = None
    status: RunStatus | None = None
    parent_run_id: UUID | None = None
    """Only the children of this run."""
    concurrency_key: str | None = None
    """Only the runs of this concurrency key."""
    limit: int = 100
    before: UUID | None = None
    idempotency_key: str | None = None
    """Only the run(s) enqueued under this key (one per task name)."""
    tags: Mapping[str, str] = field(factory=dict)
    """Only runs carrying every one of these tags (key and value equal)."""
    created_after: datetime | None = field(default=None, validator=_tz_aware)
    """Only runs created at or after this time (`RunRecord.created_at`)."""
    created_before: datetime | None = field(default=None, validator=_tz_aware)
    """Only runs created strictly before this time."""
    finished_after: datetime | None = field(default=None, validator=_tz_aware)
    """Only finished runs, finished at or after this time (`RunRecord.finished_at`)."""
    finished_before: datetime | None = field(default=None, validator=_tz_aware)
    """Only finished runs, finished strictly before this time."""
    worker_id: str | None = None
    """Only the runs an execution of this worker claimed (`ExecutionRecord.worker_id`), still
    newest first by run id."""
    needs_attention: bool = False
    """Only the runs in `needs_attention`: `waiting` on a fact whose name starts with
    `ATTENTION_WAIT_PREFIX`."""


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

        The run is `pending`, claimable from the backend's clock plus `new.delay`
        (`available_at`), or from its deadline if that is earlier. It keeps its deadline:
        `deadline_at`, the earlier of `new.deadline_at` and the clock plus `new.timeout`
        (None if neither is given), and `start_by`, the clock plus `new.delay` plus
        `new.start_within` (None without it); the claim hands both out
        (`ClaimedRun.deadline_at`, `start_by`) and the SDK decides what they mean.
        Same idempotency key: same input hash returns the existing run
        (`created=False`, with its `task_version`), a different hash raises
        `IdempotencyConflictError`. Keys never expire silently. The engine refuses a key that
        names another version. A child run keeps `parent_run_id`, `parent_fact` and
        `cancel_with_parent` for its finishing write (`finishing`, module docstring).
        A singleton (`new.singleton`) or a debounced run (`new.debounce_key`) is decided under
        a lock of its key, as those fields say.
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

        A claim that takes over a lapsed lease counts it (`RunRecord.lease_expirations`),
        marks the old execution `interrupted` and reports in `ClaimedRun.lost_leases` how many
        leases the run lost since its last step record; the SDK decides what that means (the
        task's `max_lost_leases`), so the backend needs no limit of its own.

        Each claimed run becomes `running` under its new token, with a lease until the
        backend's clock plus `lease`, a new `running` execution, one more `claims`, and no
        `wait_for`.

        Concurrency keys (`NewRun.concurrency_key`): a run with a key *holds a slot* of its
        (task name, key) while it is `running`, and while it is `waiting` if it was enqueued
        with `count_waiting`. A claim takes a run that does not hold one (pending, or waiting
        without `count_waiting`) only while fewer runs than the key's limit hold a slot, and
        never more than the free slots, atomically with the other claims (across workers);
        the others of the key stay where they are, unharmed, in the order above, and runs of
        other keys and without a key are claimed as if they were not there. A run that holds
        a slot (a lapsed lease taken over, a `count_waiting` run woken) is claimed as any
        other. A write that frees a slot (an ending, a cancel) makes the key's next run
        claimable at once, and wakes `wait_for_work`.

        Fairness keys (`NewRun.fairness_weight`): the due runs of a fairness key are placed
        in the claim's order as if they became ready when a run of their key was last
        claimed (never: before everything), not when they were enqueued, and a claim takes
        at most `fairness_weight` runs of a key: so keys take turns, least recently served
        first, each with up to its weight's runs, and a key's backlog delays another key's
        run by one turn at most. Within a key: priority, then FIFO.

        Rate limits (`NewRun.rate_limit`, a backend that implements `RateLimitStore`): a
        claim that starts a run with a limit (its first claim, or a claim of a `pending` run:
        a retry, a hand-back) takes one token of the run's bucket (`rate_limit`,
        `rate_limit_key`) by `umt_sdk.backend.take_tokens`, atomically with the other claims
        of that bucket (across workers), unless the run's cancel was requested or its
        deadline (or, on a first claim, its start deadline) has passed: the SDK ends those
        without running them. A run that finds no token is not claimed and is *parked*: it
        stays as it is, its `available_at` moved to its bucket's next wait slot
        (`umt_sdk.backend.park_slot`, kept as the bucket's `parked_until`), never later than
        its deadline; under a paused limit, to its deadline or (without one) None, until a
        resume makes it claimable. A parked run may count in the claim's `limit` (a claim
        may return fewer runs). Takeovers and wake-ups (a sleep's end, a fact) take no
        token."""
        ...

    async def heartbeat(
        self, *, worker_id: str, beats: Sequence[Beat], lease: timedelta
    ) -> HeartbeatResult:
        """Extend the lease of every run in `beats` still held under the beat's token (lapsed
        or not: see the module docstring) to the backend's clock plus `lease`, and note on its
        execution the step the beat names (`ExecutionRecord.current_step`, `step_started_at`).

        Reports the runs not held (`lost`: taken over, ended, canceled, or unknown) and, for
        the held ones whose cancel was requested, the stored reason ("" when none was given).
        """
        ...

    async def record_step(self, lease: Lease, step: StepRecord) -> None:
        """Record a step attempt if the run is still held under `lease`'s token (else
        `FencingError`), and extend the lease.

        The record is stored under the lease's token, replacing the same try (`name`,
        `attempt`). The lease is moved on to the backend's clock plus `lease.duration`; a
        backend may skip that while more than half of it is left (the heartbeat keeps it
        fresh). An execution whose heartbeats named this step no longer names it."""
        ...

    async def end_execution(self, lease: Lease, ending: Ending) -> EndResult:
        """Store how the execution under `lease` ended, as the SDK decided it, in one write.

        Fenced like every write. Two conditions refuse the ending and change nothing, because
        only the store can see them atomically with the write: `"fact_present"` when
        `ending.wait_for` names a fact already stored for the run or broadcast (no lost
        wake-up), and `"cancel_requested"` when the ending does not finish the run (`pending`
        or `waiting`) and the run's cancel was requested (it must not be parked or handed back
        as if nobody had asked). Otherwise every field of `ending` is stored as given and
        `"ended"` is returned; see `Ending` for what each one means. An ending that finishes
        the run also does what a finishing write does (`finishing`, module docstring).
        """
        ...

    async def signal(self, *, run_id: UUID | None, name: str, payload_json: str) -> bool:
        """Store a fact (run-scoped, or broadcast when `run_id` is None) and wake its waiters.
        First write wins: returns False when the fact already existed. The engine passes None
        only from `broadcast`; `signal` refuses a missing run id before it gets here
        (`RunNotFoundError` for a run id the store does not know).

        A waiter is a `waiting` run whose `wait_for` is `name` (the run itself, or any run
        for a broadcast fact): it becomes claimable now (`available_at`), still `waiting`,
        until a claim takes it."""
        ...

    async def get_facts(self, *, run_id: UUID, name: str) -> Sequence[Fact]:
        """The stored facts of that name that the run can see: its own and the broadcast one
        (none, either or both, in any order; the SDK decides which one a wait receives)."""
        ...

    async def cancel(self, run_id: UUID, *, reason: str) -> CancelOutcome:
        """Request the run's cancel, durably, and end at once a run nobody holds.

        The request (`cancel_requested_at`, `cancel_reason`) is stored once: a later cancel
        keeps the first time and reason. Then, by what the run is now:
        - finished (completed, failed, canceled): nothing changes; `"already_finished"`;
        - `pending`, `waiting`, or `running` with a lapsed lease (its holder is gone: crashed,
          frozen, cut off): it ends `canceled` at once (`finished_at` set, no `available_at`,
          no `wait_for`), and a lapsed lease is counted as a takeover counts it
          (`lease_expirations`, its execution `interrupted`); `"canceled"`. It also does what
          a finishing write does (`finishing`, module docstring), in the same write; This is one of
          the conditions only the store can check: whether the lease lapsed with no claim
          taking the run over, atomically with the write;
        - held (`running`, its lease not lapsed): nothing else changes; `"requested"`. The
          holder reads the request from its heartbeat (a cancel listener may hint it to look
          at once) and ends the run. If the holder is cut off first, the next claim hands the
          run out with `ClaimedRun.cancel_reason`, and the SDK ends it: the store never ends a
          run it hands out.
        `RunNotFoundError` when there is no such run.
        """
        ...

    async def get_run(self, run_id: UUID) -> RunRecord | None:
        """The run with its steps (in the order each was first recorded) and its executions
        (by token), or None; `observed_at` is the backend's clock at the read."""
        ...

    async def get_run_head(self, run_id: UUID) -> RunRecord | None:
        """The run without its steps and executions (one read, whatever the run's length), or
        None: what `result()` polls and what reading one field of a run needs."""
        ...

    async def list_runs(self, query: RunQuery) -> Sequence[RunRecord]:
        """Runs matching `query`, newest first, without steps and executions."""
        ...

    async def queue_depths(self, pairs: Sequence[TaskPair]) -> Mapping[TaskPair, int]:
        """How many runs of each pair are `pending`, due or not (for the queue-depth gauge;
        keep it cheap)."""
        ...

    async def wait_for_work(self, *, pairs: Sequence[TaskPair], timeout: float) -> None:
        """Return when runs of `pairs` may have become available, or after `timeout` seconds."""
        ...

    async def wait_for_run(self, run_id: UUID, *, timeout: float) -> None:
        """Return when the run may have changed state, or after `timeout` seconds. Only a
        hint: a backend may simply sleep a short while (the caller reads the run again)."""
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


# -- schedules ----------------------------------------------------------------------------------

OverlapPolicy = Literal["skip", "buffer_one", "allow_all", "cancel_previous"]
"""What a tick does while the schedule's previous run has not finished: `skip` it (the
default), keep it in a buffer of one and start it when the previous run ends (`buffer_one`),
start it anyway (`allow_all`), or request the previous run's cancel and start it
(`cancel_previous`)."""


@frozen(kw_only=True)
class ScheduleState:
    """A schedule as the SDK writes it (`create_schedule`, `update_schedule`), stored as given.

    Every field is the SDK's: the cron expression and its time zone, the input of its runs,
    and where it stands (`next_tick`, `last_tick`, `last_run_id`, `buffered_tick`). The store
    computes none of them; it only checks, atomically, that an update was made from the
    version it replaces.
    """

    name: str
    task_name: str
    cron: str
    timezone: str
    input_json: str
    overlap: OverlapPolicy = "skip"
    catchup_window: timedelta = timedelta(0)
    """Missed ticks this recent are all started after downtime; 0: only the last missed one."""
    paused: bool = False
    next_tick: datetime = field(validator=_tz_aware_required)
    """The first tick not yet handled: due once the store's clock reaches it."""
    last_tick: datetime | None = field(default=None, validator=_tz_aware)
    """The newest tick handled (started, skipped or buffered)."""
    last_run_id: UUID | None = None
    """The newest run the schedule started: what the overlap policy looks at."""
    buffered_tick: datetime | None = field(default=None, validator=_tz_aware)
    """Under `buffer_one`: the tick waiting for the previous run to end."""


@frozen(kw_only=True)
class ScheduleRecord:
    """A schedule as stored: the SDK's state, the version an update must name, and times."""

    state: ScheduleState
    version: int
    """1 when created; one more at every update (the compare-and-set of `update_schedule`)."""
    created_at: datetime
    updated_at: datetime
    observed_at: datetime = field(validator=_tz_aware_required)
    """The store's clock when it read the record: the "now" a scheduler decides due ticks by."""


@frozen(kw_only=True)
class ScheduleQuery:
    """Filters for `list_schedules`; by name."""

    task_names: Sequence[str] | None = None
    """Only schedules of these tasks (None: all)."""
    due_only: bool = False
    """Only schedules that are not paused and whose `next_tick` is at or before the store's
    clock, or that hold a `buffered_tick`."""


@runtime_checkable
class ScheduleStore(Protocol):
    """What a backend implements to store schedules (`engine.schedules`, the workers'
    scheduler loop). Optional: an engine on a backend without it refuses schedules with a
    `UsageError` that says so. The SDK computes every time and decides every tick; the store
    keeps the rows and checks, atomically with the write, the two conditions below.
    """

    async def create_schedule(self, state: ScheduleState) -> bool:
        """Store a new schedule at version 1. First write wins: False (nothing written) when
        a schedule of that name exists."""
        ...

    async def get_schedule(self, name: str) -> ScheduleRecord | None:
        """The schedule, or None; `observed_at` is the store's clock at the read."""
        ...

    async def list_schedules(self, query: ScheduleQuery) -> Sequence[ScheduleRecord]:
        """The schedules matching `query`, by name, each with `observed_at`."""
        ...

    async def update_schedule(self, state: ScheduleState, *, expected_version: int) -> bool:
        """Compare and set: replace the schedule `state.name` with `state` and raise its
        version by one, only if its stored version is `expected_version`; False (nothing
        written) when it is not, or the schedule is gone."""
        ...

    async def delete_schedule(self, name: str) -> bool:
        """Delete the schedule; False when there was none. Its runs are kept."""
        ...


# -- retention ----------------------------------------------------------------------------------


@frozen(kw_only=True)
class PruneQuery:
    """Which finished runs a `prune_runs` batch may delete.

    A run is *prunable* when all of these hold, judged by the store's clock at the batch:
    - it finished (`completed`, `failed`, `canceled`) before the clock minus `older_than`;
    - its task is in `task_names` (None: any) and not in `exclude_task_names`;
    - it has no unfinished child (a child's finishing write stores a fact for its parent);
    - its parent, if it has one that is stored, is finished (a parent still running may
      read its child's result).
    Pending, running and waiting runs are never prunable.
    """

    older_than: timedelta
    task_names: Sequence[str] | None = None
    exclude_task_names: Sequence[str] = ()
    limit: int = 500
    """The most runs one batch deletes: batches stay small so no statement holds many locks
    or writes much WAL at once."""


@frozen(kw_only=True)
class PruneBatch:
    """What one `prune_runs` (or `forget_pruned`) batch did."""

    pruned: int
    """Rows deleted: runs (with everything stored for them), or tombstones."""
    busy: bool = False
    """Another pruner held the store's pruning lock: this batch did nothing (try later)."""


@frozen(kw_only=True)
class PrunedRun:
    """The tombstone a pruned run leaves: what its idempotency key and `get` still need."""

    run_id: UUID
    task_name: str
    task_version: int
    status: RunStatus
    idempotency_key: str | None
    input_hash: str
    created_at: datetime
    finished_at: datetime
    pruned_at: datetime


@runtime_checkable
class RetentionStore(Protocol):
    """What a backend implements to delete old finished runs (`connect(retention=...)`,
    `engine.prune`, `umt runs prune`). Optional: on a backend without it those refuse with a
    `UsageError`, and nothing is ever deleted.

    A pruned run is deleted with everything stored for it (steps, executions, its facts and
    tags, whatever else the backend keeps per run), and leaves a tombstone (`PrunedRun`) in
    the same write. Tombstones keep idempotency keys taken: `enqueue` under a key whose run
    was pruned returns that run (`EnqueueResult.pruned`, with its input hash and version),
    exactly as if it were still stored, until `forget_pruned` drops the tombstone.
    """

    async def prune_runs(self, query: PruneQuery) -> PruneBatch:
        """Delete up to `query.limit` prunable runs (see `PruneQuery`), each with its
        tombstone, in one write; fewer only when no more are prunable. Which ones a batch takes
        is the backend's choice (the memory backend: the oldest finished; Postgres: task by
        task, the oldest of each first), since every prunable run goes in the end.

        One pruner at a time: a batch that cannot have the store's pruning lock at once does
        nothing and says `busy`, so many workers pruning at once delete each run once and do
        not queue behind each other.
        """
        ...

    async def count_prunable(self, query: PruneQuery) -> int:
        """How many runs are prunable now (`query.limit` ignored): a dry run."""
        ...

    async def get_pruned(self, run_id: UUID) -> PrunedRun | None:
        """The tombstone of a pruned run, or None (never pruned, or its tombstone dropped)."""
        ...

    async def forget_pruned(self, *, older_than: timedelta, limit: int) -> PruneBatch:
        """Drop up to `limit` tombstones pruned before the store's clock minus `older_than`:
        their idempotency keys are free again (`connect(idempotency_retention=...)`)."""


# -- child groups (fan-out) --------------------------------------------------------------------


@frozen(kw_only=True)
class ChildGroup:
    """A group of a parent's child runs awaited together (`ctx.step.map`, `ctx.step.gather`):
    its last member to finish stores the fact `name` for the parent, once."""

    parent_run_id: UUID
    name: str
    """The group's name within its parent, and the fact stored for the parent when its last
    member finishes (the parent parks on it)."""
    max_concurrency: int | None = None
    """`start_group`: at most this many members not finished and not held; None: no limit."""


@runtime_checkable
class ChildGroupStore(Protocol):
    """What a backend implements for fan-out (`ctx.step.map`, `ctx.step.gather`). Optional: an
    engine on a backend without it refuses them with a `UsageError` that says so.

    A group row keeps `remaining`, the members not finished; each member's finishing write
    counts it out (`finishing`, module docstring), so the parent is woken once, by the write
    that finishes the last member, and nothing polls.
    """

    async def start_group(
        self, group: ChildGroup, runs: Sequence[NewRun]
    ) -> Sequence[EnqueueResult]:
        """Store the group and its members `runs` (children of `group.parent_run_id`, in input
        order), atomically. The first `group.max_concurrency` members (all of them without a
        limit) are `pending` as `enqueue` stores a run; the others are *held*: `waiting`, no
        `available_at`, `wait_for` `HELD_WAIT`, until a finishing member lets them run (a
        held member's deadline, `NewRun.timeout`, is enforced when its turn comes).
        First write wins: when the group exists, nothing is written and its stored members
        are returned in order (`created=False`, with `task_version` and `input_hash`); the SDK
        compares. Returns one result per member, in order."""
        ...

    async def join_group(self, group: ChildGroup, run_ids: Sequence[UUID]) -> int:
        """Make the children `run_ids` of `group.parent_run_id` (started one by one) the
        members of `group`, in that order, replacing a group of that name; `remaining` is how
        many of them are not finished, counted atomically with the membership (a member
        finishing concurrently is counted exactly once). At zero, the group's fact is stored
        at once. A run may be a member of one group at a time. Returns `remaining`."""
        ...

    async def group_runs(self, *, parent_run_id: UUID, name: str) -> Sequence[RunRecord]:
        """The group's members, in order, without steps and executions (one read)."""


# -- streams --------------------------------------------------------------------------------------


@frozen(kw_only=True)
class StreamAppend:
    """One value a run writes to one of its streams (`ctx.stream.write`), as the SDK made it."""

    stream: str
    """The stream's name (checked by the SDK: a step-like name, at most 200 characters)."""
    key: str
    """Where the writer stands (the step, its attempt and the write's position in it; see
    `umt_sdk._streams`): unique within the run's stream, so a write the SDK repeats after a
    crash finds the entry it made before (first write wins)."""
    value_json: str
    """The value as JSON text (at most `umt_sdk._streams.MAX_VALUE_BYTES`)."""


@frozen(kw_only=True)
class StreamEntry:
    """One entry of a run's stream, as stored."""

    run_id: UUID
    stream: str
    seq: int
    """The entry's place in its stream: 1 for the first, one more for each new entry, given by
    the store as it stores it. A reader that has seen `seq` n misses nothing by asking for the
    entries after n: an entry becomes visible only after every entry before it in the stream."""
    key: str
    value_json: str
    written_at: datetime = field(validator=_tz_aware_required)
    """The store's clock when the entry was first stored."""


@runtime_checkable
class StreamStore(Protocol):
    """What a backend implements to store the streams of runs (`ctx.stream.write`,
    `engine.stream`, `engine.stream_last`). Optional: an engine on a backend without it
    refuses streams with a `UsageError` that says so. The SDK decides the key of each write
    and reads the entries back; the store keeps them in order and checks, atomically with the
    write, the two conditions below. A run's entries go when the run goes.
    """

    async def append_stream(
        self, lease: Lease, appends: Sequence[StreamAppend]
    ) -> Sequence[StreamEntry]:
        """Append the values in order, each to its stream, if the run is still held under
        `lease`'s token (else `FencingError`, nothing written); returns the stored entry of
        each append, in order.

        First write wins on (run, stream, key): an append whose key is stored already stores
        nothing and returns the stored entry (with its own seq, value and time). A new entry
        takes the next seq of its stream, and becomes visible to readers only once every
        earlier entry of the stream is visible. The lease is neither extended nor changed.
        Waiters of the run (`wait_for_stream`) are woken."""
        ...

    async def read_stream(
        self, run_id: UUID, stream: str, *, after: int, limit: int
    ) -> Sequence[StreamEntry]:
        """Up to `limit` entries of the run's stream with a seq larger than `after`, by seq
        (none for a run or stream the store does not know)."""
        ...

    async def last_stream_entries(
        self, run_ids: Sequence[UUID], stream: str | None = None
    ) -> Sequence[StreamEntry]:
        """The newest entry of each stream of these runs (only of the stream named `stream`
        when given), in any order: what a progress bar, `umt runs watch` and `umt runs show`
        need, in one read whatever the number of runs."""
        ...

    async def wait_for_stream(
        self, run_id: UUID, stream: str, *, after: int, timeout: float
    ) -> None:
        """Return when the run's stream may have an entry after seq `after` or the run may
        have ended, or after `timeout` seconds. Only a hint, as `wait_for_run` is (the caller
        reads again); a backend may return at once when it knows of a newer entry."""
        ...


# -- pause, rerun and fork ----------------------------------------------------------------------


@frozen(kw_only=True)
class PausedTask:
    """A task paused by `engine.pause`: no claim starts its runs until it is resumed."""

    task_name: str
    task_version: int | None
    """The version paused; None: every version of the task."""
    paused_at: datetime = field(validator=_tz_aware_required)

    def __str__(self) -> str:
        return (
            self.task_name if self.task_version is None else f"{self.task_name}@{self.task_version}"
        )


@runtime_checkable
class LifecycleStore(Protocol):
    """What a backend implements to pause tasks and to rerun and fork runs (`engine.pause`,
    `engine.resume`, `engine.rerun`, `engine.fork`). Optional: an engine on a backend without
    it refuses those calls with a `UsageError` that says so.

    A backend that implements it keeps three more rules:
    - `claim` takes no run of a paused pair: a pair is paused when a pause names its task and
      version, or its task alone (every version). Its runs wait as they are (pending, or
      waiting with their timers), unharmed; a run already held goes on until its execution
      ends. The check is made in the claim's own statement, against what is stored, so a
      pause holds on every worker and host as soon as it is stored.
    - `enqueue` keeps `NewRun.rerun_of`, `forked_from` and `forked_at_step` (read back on
      `RunRecord`), and for a fork copies, in the same write, the step records
      `NewRun.kept_steps` names and every run-scoped fact of `forked_from`, as stored; the
      copied records are handed out with the run's first claim (`ClaimedRun.steps`).
    - the SDK decides which steps a fork keeps and what a resume of one version of a task
      paused as a whole means; the store only keeps the rows.
    """

    async def pause_task(self, *, task_name: str, task_version: int | None) -> bool:
        """Store the pause of `task_name@task_version` (None: every version). False (nothing
        written) when that exact pause is stored already."""
        ...

    async def resume_task(self, *, task_name: str, task_version: int | None) -> bool:
        """Delete the pause of `task_name@task_version`; with None, every pause of the task
        (the whole task's and each version's). Wakes the workers that may now claim its runs.
        False when there was nothing to delete."""
        ...

    async def list_paused_tasks(self) -> Sequence[PausedTask]:
        """Every stored pause, by task name then version (the whole task's first)."""
        ...


# -- what operators look at (the dashboard) -------------------------------------------------


@frozen(kw_only=True)
class WorkerState:
    """What a worker says of itself (`InsightStore.record_worker`), stored as given."""

    worker_id: str
    host: str
    pid: int
    pairs: Sequence[TaskPair]
    """The (task, version) pairs it serves."""
    concurrency: int
    runs_held: int
    """Runs it executes now."""
    started_at: datetime = field(validator=_tz_aware_required)
    stopped: bool = False
    """It stopped on purpose (a clean shutdown): its last report."""


@frozen(kw_only=True)
class WorkerRecord:
    """A worker's newest report, as stored, with when the store received it."""

    worker_id: str
    host: str
    pid: int
    pairs: Sequence[TaskPair]
    concurrency: int
    runs_held: int
    started_at: datetime = field(validator=_tz_aware_required)
    last_seen_at: datetime = field(validator=_tz_aware_required)
    """The store's clock when the newest report arrived."""
    stopped_at: datetime | None = field(default=None, validator=_tz_aware)
    """The store's clock when the worker reported it stopped; None while it has not."""
    observed_at: datetime = field(validator=_tz_aware_required)
    """The store's clock at the read: what `last_seen_at` is compared with to tell a worker
    that stopped heartbeating (the SDK's rule, `umt_sdk._insight`)."""


@frozen(kw_only=True)
class PairActivity:
    """The unfinished runs of one (task, version) pair, counted by the store at one read."""

    task_name: str
    task_version: int
    pending: int
    running: int
    waiting: int
    oldest_due_at: datetime | None = field(default=None, validator=_tz_aware)
    """The earliest `available_at` of its `pending` runs that were due at the read (None when
    none was): how long the oldest claimable run has waited for a worker."""
    observed_at: datetime = field(validator=_tz_aware_required)


@frozen(kw_only=True)
class FinishedCount:
    """How many runs of a pair finished with `status` in the time bucket starting at
    `bucket_start` (`finished_counts`)."""

    task_name: str
    task_version: int
    status: Literal["completed", "failed", "canceled", "compensated"]
    bucket_start: datetime = field(validator=_tz_aware_required)
    runs: int


@frozen(kw_only=True)
class KeyUsage:
    """A concurrency key as stored: its limit and how many runs hold or want a slot."""

    task_name: str
    concurrency_key: str
    limit: int
    holding: int
    """Runs holding a slot (running, or waiting with `count_waiting`)."""
    wanting: int
    """Runs waiting for a slot (pending, or waiting without `count_waiting`)."""


@runtime_checkable
class InsightStore(Protocol):
    """What a backend implements so that operators can see its workers and its load (the
    dashboard, `engine.workers()`, `engine.task_stats()`). Optional: without it those reads
    raise `UsageError` saying so. Reads only, but `record_worker`, whose row nothing else
    reads: no claim, lease or ending depends on any of it.
    """

    async def record_worker(self, state: WorkerState) -> None:
        """Store `state` as the worker's newest report (replacing the previous one), with the
        store's clock as `last_seen_at`, and as `stopped_at` when `state.stopped`."""
        ...

    async def list_workers(self, *, limit: int) -> Sequence[WorkerRecord]:
        """The workers that reported, the most recently seen first, at most `limit`."""
        ...

    async def forget_workers(self, *, seen_before: datetime) -> int:
        """Delete the reports of workers last seen before `seen_before`; how many."""
        ...

    async def pair_activity(self) -> Sequence[PairActivity]:
        """Per (task, version) pair with unfinished runs: how many are pending, running and
        waiting, and the oldest due pending one's `available_at`, by task name then version."""
        ...

    async def finished_counts(
        self, *, since: datetime, bucket: timedelta
    ) -> Sequence[FinishedCount]:
        """The runs finished at or after `since`, counted per pair, status and time bucket
        (`bucket_start` = `since` plus a whole number of `bucket`s)."""
        ...

    async def key_usage(self, *, limit: int) -> Sequence[KeyUsage]:
        """The concurrency keys with a run holding or wanting a slot, by task name then key,
        at most `limit`."""
        ...


# -- rate limits --------------------------------------------------------------------------------


@frozen(kw_only=True)
class RateLimitInfo:
    """A named rate limit as stored: `limit` tokens per `per`, and whether it is paused."""

    name: str
    limit: int
    per: timedelta
    paused: bool = False
    created_at: datetime = field(validator=_tz_aware_required)
    updated_at: datetime = field(validator=_tz_aware_required)

    @property
    def interval(self) -> timedelta:
        """How often a bucket gets a token back: `per / limit`, rounded up to the microsecond."""
        per_us = self.per // timedelta(microseconds=1)
        return timedelta(microseconds=-(-per_us // self.limit))


@frozen(kw_only=True)
class TokenRequest:
    """A step's request for one token (`ctx.step.run(..., rate_limit=...)`), as the SDK made
    it: the token is for the attempt `attempt` of the step `step` of the lease's run."""

    limit: str
    key: str = ""
    step: str
    attempt: int


@frozen(kw_only=True)
class TokenGrant:
    """What `take_rate_token` did."""

    status: Literal["granted", "wait", "paused", "unknown"]
    """`granted`: the attempt has its token (taken now, or by an earlier request of the same
    attempt); `wait`: no token free (`next_at` says when one is due); `paused`: the limit is
    paused; `unknown`: no limit of that name is stored."""
    next_at: datetime | None = field(default=None, validator=_tz_aware)
    observed_at: datetime = field(validator=_tz_aware_required)
    """The store's clock at the take."""


@runtime_checkable
class RateLimitStore(Protocol):
    """What a backend implements to store rate limits (`RateLimit`, `engine.rate_limits`).
    Optional: on a backend without it, tasks and steps with a rate limit are refused with a
    `UsageError` that says so.

    A backend that implements it keeps, per limit, its `limit`, `per` and pause, and per
    bucket (limit, key) the one time GCRA needs; it takes tokens only by
    `umt_sdk.backend.take_tokens`, atomically with the bucket's other takes (a row lock on
    Postgres), in the claim (see `Backend.claim`) and in `take_rate_token`; and, per bucket,
    the last wait slot it handed out (`parked_until`, see `umt_sdk.backend.park_slot`),
    forgotten when the limit is changed or resumed. A paused limit gives no token.
    """

    async def define_rate_limit(self, name: str, *, limit: int, per: timedelta) -> RateLimitInfo:
        """Store the limit if no limit of that name is stored (first write wins); return the
        stored one either way."""
        ...

    async def set_rate_limit(self, name: str, *, limit: int, per: timedelta) -> RateLimitInfo:
        """Store the limit, replacing `limit` and `per` of a stored one (its pause stays).
        The tokens taken stay taken: each bucket's time still ahead of now is rescaled to the
        new interval, `now + ceil((tat - now) * new interval / old interval)` (in
        microseconds), atomically with the bucket's takes. Runs parked by the limit become
        claimable now, so they take their token by the new rule. Returns the stored limit."""
        ...

    async def get_rate_limit(self, name: str) -> RateLimitInfo | None:
        """The stored limit, or None."""
        ...

    async def list_rate_limits(self) -> Sequence[RateLimitInfo]:
        """Every stored limit, by name."""
        ...

    async def pause_rate_limit(self, name: str, *, paused: bool) -> bool:
        """Pause (no token is given, runs wait unharmed) or resume the limit; resuming makes
        the runs it parked claimable now. False when no limit of that name is stored or it
        already was so."""
        ...

    async def take_rate_token(self, lease: Lease, request: TokenRequest) -> TokenGrant:
        """Take one token of `request`'s bucket for the step attempt it names, if the run is
        still held under `lease`'s token (else `FencingError`, nothing taken).

        Once per attempt: a request for an attempt that has its token is `granted` again
        without taking another (a run taken over after a crash between the take and the
        step's record asks again). The grant is stored atomically with the take and goes
        when the run goes. Without a token (`wait`), `next_at` is the bucket's next wait
        slot (`park_slot`, kept as its `parked_until`), and the run is noted as waiting for
        the limit, so a change or a resume makes it claimable at once."""
        ...


@runtime_checkable
class BatchEnqueueStore(Protocol):
    """What a backend implements to store many runs in one write (`engine.enqueue_many`).
    Optional: without it the engine stores a batch one `enqueue` at a time, with the same
    outcome."""

    async def enqueue_many(
        self, runs: Sequence[NewRun], *, conn: Any = None
    ) -> Sequence[EnqueueResult]:
        """Store `runs` as `Backend.enqueue` stores each (same rules: delays, deadlines,
        concurrency keys, rate limits, tags, pauses, idempotency keys and their tombstones),
        in one write, inside the caller's transaction `conn` when given. Returns one result
        per run, in order. The SDK never passes a fork (`forked_from`) or a child run, and
        never two runs with the same idempotency key in one call; a key that already names a
        run (a stored one, or one a racing enqueue stores first) gives that run's result, as
        `enqueue` does. Runs are claimable in the order given among equals (FIFO)."""
        ...


@runtime_checkable
class TransactionStore(Protocol):
    """What a backend implements for transactional steps (`ctx.step.transaction`,
    `@step(..., transactional=True)`): a step whose writes on the engine's own store commit in
    the one transaction that records the step. Optional: on a backend without it a
    transactional step fails its run with `UsageError`, and nothing of it is stored."""

    async def run_step_transaction(
        self, lease: Lease, body: Callable[[Any], Awaitable[StepRecord]]
    ) -> None:
        """In one transaction on the engine's own store: fence, `body(tx)`, store its record.

        Fence first: when the run is not held under `lease`'s token, raise `FencingError`
        without calling `body`. Then call `body(tx)` with the transaction's handle (what the
        backend documents: a psycopg connection inside the transaction on Postgres, a
        `MemoryTransaction` on the memory backend), and store the `StepRecord` it returns as
        `record_step` stores one (under the lease's token, the lease extended), in the same
        transaction, fenced again atomically with its commit: the record and every write of
        `body` land together, and only while the run is still held under the lease's token
        (else `FencingError`, and nothing lands). No lock on the run is held while `body`
        runs. When `body` raises, nothing lands and its error is raised (`FencingError` from
        it when the attempt turns out stale meanwhile). A conflict with a concurrent
        transaction (a serialization failure, a deadlock) raises `TransactionConflictError`,
        nothing stored: the SDK decides whether to try again.
        """
        ...
