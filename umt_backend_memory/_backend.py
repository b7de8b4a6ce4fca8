"""The in-memory backend: the whole SPI in plain structures under one lock.

Claimable runs sit in per-pair heaps ordered by (-priority, available_at, sequence); runs that
become claimable later (retries, sleeps, wait timeouts, lease expiries) sit in one timer heap
and are promoted when their time comes. Heap entries carry the run's `version` and are dropped
when it has changed since (lazy deletion), so every operation is O(log n).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import threading
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from attrs import define, evolve, field

from umt_backend_memory._events import MemoryEvents
from umt_backend_memory._store import MemoryStore
from umt_sdk.backend import (
    ATTENTION_WAIT_PREFIX,
    HELD_WAIT,
    TERMINAL_STATUSES,
    Beat,
    CancelOutcome,
    ChildGroup,
    ClaimedRun,
    Clock,
    ControllableClock,
    Ending,
    EndResult,
    EnqueueResult,
    ErrorInfo,
    ExecutionOutcome,
    ExecutionRecord,
    Fact,
    FinishedCount,
    HeartbeatResult,
    KeyUsage,
    Lease,
    LedgerEntry,
    NewRun,
    PairActivity,
    PausedTask,
    PruneBatch,
    PrunedRun,
    PruneQuery,
    RateLimitInfo,
    RunQuery,
    RunRecord,
    RunStatus,
    ScheduleQuery,
    ScheduleRecord,
    ScheduleState,
    SimulatedCrash,
    StepRecord,
    StreamAppend,
    StreamEntry,
    TaskPair,
    TokenGrant,
    TokenRequest,
    WorkerRecord,
    WorkerState,
    park_slot,
    take_tokens,
    unstorable_json_reason,
    unstorable_reason,
)
from umt_sdk.exceptions import (
    BackendError,
    FencingError,
    RunNotFoundError,
    TransactionConflictError,
    UsageError,
)

__all__ = ["CrashHook", "MemoryBackend"]

CrashHook = Callable[[str, UUID, str], bool]
"""`hook(operation, run_id, phase)` -> True to crash there; phase is "before" or "after"."""


def _storable_text(text: str | None, what: str) -> None:
    """Refuse what Postgres could not store (the SDK refuses it first; this keeps the memory
    backend from accepting what the real one cannot): the SDK's one rule."""
    reason = None if text is None else unstorable_reason(text)
    if reason is not None:
        raise BackendError(f"{what} cannot be stored: it {reason} (refused as Postgres would)")


def _storable_new(new: NewRun) -> None:
    """Refuse what Postgres could not store in a new run, as Postgres would."""
    _storable_json(new.input_json, "input")
    _storable_text(new.idempotency_key, "idempotency key")
    for key, value in new.tags.items():
        _storable_text(key, "tag key")
        _storable_text(value, f"tag {key!r}")


def _storable_json(text: str | None, what: str) -> None:
    """The same for JSON text, escapes included (jsonb refuses `\\u0000` and escaped
    surrogates)."""
    reason = None if text is None else unstorable_json_reason(text)
    if reason is not None:
        raise BackendError(f"{what} cannot be stored: it {reason} (refused as Postgres would)")


def _storable_error(error: ErrorInfo | None, what: str) -> None:
    if error is not None:
        for text in (error.type, error.message, error.traceback):
            _storable_text(text, what)


def _storable_step(step: StepRecord | None) -> None:
    if step is None:
        return
    # Checked first, the message built only for a refusal: this runs for every step.
    if step.output_json is not None and unstorable_json_reason(step.output_json) is not None:
        _storable_json(step.output_json, f"output of step {step.name!r}")
    if step.error is not None:
        _storable_error(step.error, f"error of step {step.name!r}")


def _tells_time(clock: object) -> bool:
    now = getattr(clock, "now", None)
    if not callable(now) or isinstance(clock, type):
        return False
    try:
        sample = now()
    except Exception:
        return False
    return isinstance(sample, datetime) and sample.utcoffset() is not None


_Order = tuple[int, int, datetime, int, datetime, int]
"""A run's place in the claim's order: -priority; its round (a fairness key's runs go in
rounds of its weight: the runs this claim took of the key // weight; 0 for other runs); when
it became ready and its sequence number (a fairness key's run: when its key was last served,
and that claim's number); then when it became ready and its sequence number."""

_NEVER = datetime.min.replace(tzinfo=UTC)
"""When a fairness key that no claim has taken a run of was last served: before any time."""


def _after(when: datetime, duration: timedelta | None) -> datetime | None:
    return None if duration is None else when + duration


@define(eq=False)
class _Execution:
    fencing_token: int
    worker_id: str
    claimed_at: datetime
    ended_at: datetime | None = None
    outcome: ExecutionOutcome = "running"
    current_step: str | None = None
    step_started_at: datetime | None = None


@define(eq=False)
class _Run:
    run_id: UUID
    seq: int
    task_name: str
    task_version: int
    input_json: str
    input_hash: str
    priority: int
    idempotency_key: str | None
    trace_context: dict[str, str]
    status: RunStatus
    created_at: datetime
    updated_at: datetime
    available_at: datetime | None
    version: int = 0
    claims: int = 0
    failures: int = 0
    lease_expirations: int = 0
    fencing_token: int = 0
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    output_json: str | None = None
    error: ErrorInfo | None = None
    finished_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    cancel_reason: str | None = None
    wait_for: str | None = None
    parent_run_id: UUID | None = None
    parent_fact: str | None = None
    cancel_with_parent: bool = False
    group: str | None = None
    """The child group (of its parent) it is a member of, if any."""
    rerun_of: UUID | None = None
    forked_from: UUID | None = None
    forked_at_step: str | None = None
    tags: dict[str, str] = field(factory=dict)
    concurrency_key: str | None = None
    count_waiting: bool = False
    deadline_at: datetime | None = None
    start_by: datetime | None = None
    rate_limit: str | None = None
    rate_limit_key: str = ""
    debounce_key: str | None = None
    debounce_until: datetime | None = None
    """A debounced run (`NewRun.debounce_key`): the latest it may start (None: no bound)."""
    waits_for_limit: str | None = None
    """The rate limit it waits for a token of (parked by a claim, or by a step that found
    none): made claimable at once when that limit is changed or resumed."""
    token_grants: set[tuple[str, int]] = field(factory=set)
    """The step attempts that took a token of a rate limit (`take_rate_token`)."""
    steps: dict[tuple[str, int], StepRecord] = field(factory=dict)
    executions: list[_Execution] = field(factory=list)

    @property
    def pair(self) -> TaskPair:
        return TaskPair(name=self.task_name, version=self.task_version)

    @property
    def key(self) -> tuple[str, str] | None:
        """Its concurrency key, per task name (None without one)."""
        return None if self.concurrency_key is None else (self.task_name, self.concurrency_key)

    @property
    def holds_slot(self) -> bool:
        """A keyed run holds a slot while running, and while waiting with count_waiting."""
        return self.concurrency_key is not None and (
            self.status == "running" or (self.status == "waiting" and self.count_waiting)
        )

    def needs_token(self, now: datetime) -> bool:
        """Whether a claim of the run now must take a token of its rate limit: its start (a
        first claim, or a pending run's), unless the SDK will end it without running it."""
        return (
            self.rate_limit is not None
            and (self.status == "pending" or (self.status == "waiting" and self.claims == 0))
            and self.cancel_requested_at is None
            and (self.deadline_at is None or self.deadline_at > now)
            and (self.claims > 0 or self.start_by is None or self.start_by > now)
        )

    @property
    def wants_slot(self) -> bool:
        """A keyed run wants a slot while pending, and while waiting without count_waiting."""
        return self.concurrency_key is not None and (
            self.status == "pending" or (self.status == "waiting" and not self.count_waiting)
        )


@define(eq=False)
class _Limit:
    limit: int
    per: timedelta
    created_at: datetime
    updated_at: datetime
    paused: bool = False

    def info(self, name: str) -> RateLimitInfo:
        return RateLimitInfo(
            name=name,
            limit=self.limit,
            per=self.per,
            paused=self.paused,
            created_at=self.created_at,
            updated_at=self.updated_at,
        )


@define(eq=False)
class _Group:
    """A child group: its members in order, and how many have not finished."""

    members: list[UUID]
    remaining: int


@define(eq=False)
class _Schedule:
    state: ScheduleState
    version: int
    created_at: datetime
    updated_at: datetime


@define(eq=False)
class _Stream:
    entries: list[StreamEntry] = field(factory=list)
    by_key: dict[str, StreamEntry] = field(factory=dict)


@define(eq=False)
class _LedgerRow:
    run_id: UUID
    fencing_token: int
    result_json: str | None = None


class MemoryBackend(MemoryEvents):
    """A complete, in-process backend. Fast, deterministic with a `FakeClock`, not durable.

    Test helpers: `crash_hook` (make any write vanish before or after it applies, like a
    SIGKILL), `runs()` / `facts()` / `ledger_entries()` to inspect, `reset()` to start over.
    """

    def __init__(self, *, clock: Clock) -> None:
        if not _tells_time(clock):
            raise UsageError(
                "MemoryBackend: clock must be a clock (an object whose now() returns a "
                "timezone-aware datetime, such as umt_sdk.testing.FakeClock()), got "
                f"{type(clock).__name__}",
                argument="clock",
            )
        self.clock = clock
        # A clock a test moves (FakeClock), found once: its moves wake the waiters, and it may
        # be jumped to the next timer (`_maybe_auto_advance`). A plain clock: real time.
        self._controls = clock if isinstance(clock, ControllableClock) else None
        self.crash_hook: CrashHook | None = None
        self._lock = threading.RLock()
        self._unsubscribe: Callable[[], None] | None = None
        if self._controls is not None:
            self._unsubscribe = self._controls.subscribe(self._on_clock_advance)
        self._listeners: list[Callable[[UUID, str], None]] = []
        self.store = MemoryStore()
        """The engine's own database, in memory: what transactional steps write through
        their `tx` (a serializable `MemoryTransaction` on it)."""
        self.reset()

    def reset(self) -> None:
        """Forget every run, fact and ledger entry, and the rows of `store`."""
        with self._lock:
            self.store.clear()
            self._runs: dict[UUID, _Run] = {}
            self._by_key: dict[tuple[str, str], UUID] = {}
            self._facts: dict[tuple[UUID | None, str], Fact] = {}
            self._waiters: dict[str, set[UUID]] = {}
            self._children: dict[UUID, list[UUID]] = {}
            self._groups: dict[tuple[UUID, str], _Group] = {}
            self._requested: list[tuple[UUID, str]] = []
            self._ledger: dict[str, _LedgerRow] = {}
            self._ready: dict[TaskPair, list[tuple[int, datetime, int, UUID, int]]] = {}
            # Keyed runs that want a slot and are due, per pair and key (never in `_ready`);
            # the runs holding a slot, and the limit, per (task name, key).
            self._keyed: dict[TaskPair, dict[str, list[tuple[int, datetime, int, UUID, int]]]] = {}
            self._holders: dict[tuple[str, str], set[UUID]] = {}
            self._limits: dict[tuple[str, str], int] = {}
            # Fairness keys (`NewRun.fairness_weight`): the weight, per (task name, key), and
            # when a claim last took a run of a key (a fairness key's turn comes by it), with
            # a number of the runs' sequence (the clock may stand still: a fake clock).
            self._weights: dict[tuple[str, str], int] = {}
            self._served: dict[tuple[str, str], tuple[datetime, int]] = {}
            # Every keyed run, per (task name, key), in enqueue order (singletons read the
            # active ones); the newest debounced run, per (task name, version, key).
            self._key_runs: dict[tuple[str, str], list[UUID]] = {}
            self._debounced: dict[tuple[str, int, str], UUID] = {}
            self._timers: list[tuple[datetime, int, UUID, int]] = []
            self._running: set[UUID] = set()
            self._seq = itertools.count(1)
            self._tokens = itertools.count(1)
            self._active_pairs: set[TaskPair] = set()
            self._work_waiters: list[asyncio.Future[None]] = []
            self._run_waiters: dict[UUID, list[asyncio.Future[None]]] = {}
            self._drivers = 0
            self._schedules: dict[str, _Schedule] = {}
            self._paused: dict[tuple[str, int | None], datetime] = {}
            self._tombstones: dict[UUID, PrunedRun] = {}
            self._tombstone_keys: dict[tuple[str, str], UUID] = {}
            self._streams: dict[UUID, dict[str, _Stream]] = {}
            self._workers: dict[str, WorkerRecord] = {}
            self._rate_limits: dict[str, _Limit] = {}
            self._buckets: dict[tuple[str, str], datetime] = {}
            self._parked_until: dict[tuple[str, str], datetime] = {}
            self._reset_events()

    # -- inspection ------------------------------------------------------------------------------

    def runs(self) -> list[RunRecord]:
        """Every run, oldest first, with steps and executions."""
        with self._lock:
            return [
                self._record(r, full=True) for r in sorted(self._runs.values(), key=lambda r: r.seq)
            ]

    def facts(self) -> list[Fact]:
        with self._lock:
            return list(self._facts.values())

    def ledger_entries(self) -> dict[str, str | None]:
        """op_key -> recorded result JSON (None while begun and unfinished)."""
        with self._lock:
            return {k: v.result_json for k, v in self._ledger.items()}

    # -- internals --------------------------------------------------------------------------------

    def _crash(self, operation: str, run_id: UUID, phase: str) -> None:
        hook = self.crash_hook
        if hook is not None and hook(operation, run_id, phase):
            raise SimulatedCrash(f"simulated crash {phase} {operation} of run {run_id}")

    def _schedule(self, run: _Run) -> None:
        """Index the run after a state change (old heap entries go stale by version)."""
        run.version += 1
        now = self.clock.now()
        self._count_slot(run)
        if run.status in ("pending", "waiting") and run.available_at is not None:
            if run.available_at <= now:
                heapq.heappush(
                    self._ready_heap(run),
                    (-run.priority, run.available_at, run.seq, run.run_id, run.version),
                )
                self._notify_work()
            else:
                heapq.heappush(self._timers, (run.available_at, run.seq, run.run_id, run.version))
        elif run.status == "running" and run.lease_expires_at is not None:
            heapq.heappush(self._timers, (run.lease_expires_at, run.seq, run.run_id, run.version))

    def _promote(self, now: datetime) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, seq, run_id, version = heapq.heappop(self._timers)
            run = self._runs.get(run_id)
            if run is None or run.version != version:
                continue
            if run.status == "running":
                expires = run.lease_expires_at
                if self._held(run, now):  # extended since: look again then
                    assert expires is not None
                    heapq.heappush(self._timers, (expires, seq, run_id, version))
                    continue
                ready_at = expires or now
            else:
                ready_at = run.available_at or now
            heapq.heappush(self._ready_heap(run), (-run.priority, ready_at, seq, run_id, version))

    def _ready_heap(self, run: _Run) -> list[tuple[int, datetime, int, UUID, int]]:
        """Where the run waits once due: its key's heap if it wants a slot, else its pair's."""
        if run.wants_slot:
            assert run.concurrency_key is not None
            return self._keyed.setdefault(run.pair, {}).setdefault(run.concurrency_key, [])
        return self._ready.setdefault(run.pair, [])

    def _count_slot(self, run: _Run) -> None:
        """Keep the key's holders exact after a state change; a freed slot wakes the claims."""
        key = run.key
        if key is None:
            return
        holders = self._holders.setdefault(key, set())
        if run.holds_slot:
            holders.add(run.run_id)
        elif run.run_id in holders:
            holders.discard(run.run_id)
            self._notify_work()

    def _free_slot(self, key: tuple[str, str]) -> bool:
        return len(self._holders.get(key, ())) < self._limits[key]

    def _ready_head(self, pair: TaskPair, now: datetime) -> _Run | None:
        """The first claimable run of the pair: the head of its ready heap, or of the heap of
        one of its keys with a free slot, whichever the claim's order puts first."""
        found = self._head_entry(pair, now)
        return None if found is None else found[1]

    def _open_keys(
        self, pairs: Sequence[TaskPair], now: datetime, limit: int
    ) -> dict[tuple[str, str], int]:
        """The keys a claim of `limit` runs may take from, as the Postgres claim's `open_keys`
        picks them: per task, those with a free slot and a due run, least recently served
        first, at most `limit`; each with the most runs it offers (its free slots, at most
        `limit`; a fairness key, its weight's share of `limit` among the keys picked)."""
        served: dict[str, dict[str, tuple[datetime, int]]] = {}
        for pair in pairs:
            for key, heap in self._keyed.get(pair, {}).items():
                name_key = (pair.name, key)
                if self._free_slot(name_key) and self._heap_head(heap, now) is not None:
                    served.setdefault(pair.name, {})[key] = self._served.get(name_key, (_NEVER, 0))
        offers: dict[tuple[str, str], int] = {}
        for name, keys in served.items():
            picked = sorted(keys, key=lambda k: keys[k])[:limit]
            for key in picked:
                name_key = (name, key)
                free = self._limits[name_key] - len(self._holders.get(name_key, ()))
                offer = min(free, limit)
                weight = self._weights.get(name_key)
                if weight is not None:
                    offer = min(offer, weight * -(-limit // len(picked)))
                offers[name_key] = offer
        return offers

    def _head_entry(
        self,
        pair: TaskPair,
        now: datetime,
        taken: dict[tuple[str, str], int] | None = None,
        offers: dict[tuple[str, str], int] | None = None,
    ) -> tuple[_Order, _Run, list[tuple[int, datetime, int, UUID, int]]] | None:
        """The first claimable run of the pair in the claim's order (`_Order`). `taken`: the
        runs of each key this claim took so far (a fairness key's round); `offers`: the keys
        this claim may take from and how many runs each (`_open_keys`; None: any key)."""
        best = None
        run = self._heap_head(self._ready.get(pair), now)
        if run is not None:
            heap = self._ready[pair]
            priority, ready_at, seq = heap[0][:3]
            best = ((priority, 0, ready_at, seq, ready_at, seq), run, heap)
        for key, heap in self._keyed.get(pair, {}).items():
            name_key = (pair.name, key)
            if not heap or not self._free_slot(name_key):
                continue
            if offers is not None and (taken or {}).get(name_key, 0) >= offers.get(name_key, 0):
                continue
            run = self._heap_head(heap, now)
            if run is None:
                continue
            priority, ready_at, seq = heap[0][:3]
            weight = self._weights.get(name_key)
            if weight is None:
                order: _Order = (priority, 0, ready_at, seq, ready_at, seq)
            else:
                turn_at, turn = self._served.get(name_key, (_NEVER, 0))
                round_ = (taken or {}).get(name_key, 0) // weight
                order = (priority, round_, turn_at, turn, ready_at, seq)
            if best is None or order < best[0]:
                best = (order, run, heap)
        return best

    def _heap_head(
        self, heap: list[tuple[int, datetime, int, UUID, int]] | None, now: datetime
    ) -> _Run | None:
        """The first claimable run in a ready heap, dropping stale entries.

        A running run was promoted because its lease had expired; if its holder renewed the
        lease since (a heartbeat, a recorded step), it is not claimable: back to the timers.
        """
        while heap:
            *_, run_id, version = heap[0]
            run = self._runs.get(run_id)
            if run is None or run.version != version:
                heapq.heappop(heap)
                continue
            if self._held(run, now):
                assert run.lease_expires_at is not None
                heapq.heappop(heap)
                heapq.heappush(
                    self._timers, (run.lease_expires_at, run.seq, run.run_id, run.version)
                )
                continue
            return run
        return None

    def _pop_ready(
        self,
        pair: TaskPair,
        now: datetime,
        taken: dict[tuple[str, str], int] | None = None,
        offers: dict[tuple[str, str], int] | None = None,
    ) -> _Run | None:
        found = self._head_entry(pair, now, taken, offers)
        if found is None:
            return None
        _, run, heap = found
        heapq.heappop(heap)
        return run

    def _has_ready(self, pairs: Sequence[TaskPair], now: datetime) -> bool:
        return any(self._ready_head(pair, now) is not None for pair in self._unpaused(pairs))

    def _unpaused(self, pairs: Sequence[TaskPair]) -> list[TaskPair]:
        """The pairs a claim may take runs of: those no stored pause names (`LifecycleStore`)."""
        paused = self._paused
        if not paused:
            return list(pairs)
        return [
            p for p in pairs if (p.name, None) not in paused and (p.name, p.version) not in paused
        ]

    @staticmethod
    def _held(run: _Run, now: datetime) -> bool:
        """Running under a lease that has not lapsed (the one reading of a lease's time, for
        the claim and the cancel alike)."""
        expires = run.lease_expires_at
        return run.status == "running" and expires is not None and expires > now

    def _check(self, lease: Lease) -> _Run:
        run = self._runs.get(lease.run_id)
        if run is None or run.status != "running" or run.fencing_token != lease.fencing_token:
            current = run.fencing_token if run is not None else None
            raise FencingError(
                f"run {lease.run_id} is no longer held by attempt token {lease.fencing_token} "
                f"(current token {current}, status {run.status if run else 'missing'})",
                run_id=lease.run_id,
                fencing_token=lease.fencing_token,
            )
        return run

    def _store_step(self, run: _Run, lease: Lease, step: StepRecord) -> None:
        """Store a step record (`record_step`, an ending's step): under the lease's token,
        replacing the same try."""
        if step.fencing_token != lease.fencing_token:  # the SDK's records carry it already
            step = evolve(step, fencing_token=lease.fencing_token)
        run.steps[(step.name, step.attempt)] = step

    def _current_execution(self, run: _Run) -> _Execution | None:
        for execution in reversed(run.executions):
            if execution.fencing_token == run.fencing_token:
                return execution
        return None

    def _end_lease(self, run: _Run, outcome: ExecutionOutcome, now: datetime) -> None:
        execution = self._current_execution(run)
        if execution is not None and execution.outcome == "running":
            execution.outcome = outcome
            execution.ended_at = now
        run.lease_owner = None
        run.lease_expires_at = None
        self._running.discard(run.run_id)

    def _finish(self, run: _Run, status: RunStatus, now: datetime) -> None:
        """Finish the run, and do what a finishing write also does (the SPI's `finishing`):
        store its parent's fact, and cancel the children that asked for it when it failed or
        was canceled."""
        was_held = self._is_held_member(run)
        run.status = status
        run.finished_at = now
        run.updated_at = now
        run.available_at = None
        self._unwait(run)
        self._schedule(run)
        self._notify_run(run.run_id)
        if run.parent_run_id is not None and run.parent_fact is not None:
            self._store_fact(run.parent_run_id, run.parent_fact, "null", now)
        if run.parent_run_id is not None and run.group is not None:
            self._count_out(run.parent_run_id, run.group, released=not was_held, now=now)
        if status in ("failed", "canceled", "compensated"):
            reason = f"parent {run.run_id} {status}"
            for child_id in self._children.get(run.run_id, ()):
                child = self._runs[child_id]
                if child.cancel_with_parent and child.status not in TERMINAL_STATUSES:
                    self._cancel_run(child, reason, now)

    @staticmethod
    def _is_held_member(run: _Run) -> bool:
        """A group member held back by its group's `max_concurrency` (`HELD_WAIT`)."""
        return run.status == "waiting" and run.wait_for == HELD_WAIT and run.available_at is None

    def _count_out(self, parent_run_id: UUID, name: str, *, released: bool, now: datetime) -> None:
        """A member of the group finished (the SPI's `finishing`): one fewer remaining (at
        zero, the group's fact for the parent); one that had been let run lets the first held
        member run."""
        group = self._groups.get((parent_run_id, name))
        if group is None:
            return
        group.remaining -= 1
        if released:
            for member_id in group.members:
                member = self._runs[member_id]
                if member.group == name and self._is_held_member(member):
                    member.wait_for = None
                    member.available_at = now
                    member.updated_at = now
                    self._schedule(member)
                    self._notify_run(member.run_id)
                    break
        if group.remaining == 0:
            self._store_fact(parent_run_id, name, "null", now)

    def _store_fact(self, run_id: UUID | None, name: str, payload_json: str, now: datetime) -> bool:
        """Store a fact (first write wins) and wake the runs waiting for it."""
        if (run_id, name) in self._facts:
            return False
        self._facts[(run_id, name)] = Fact(
            name=name, run_id=run_id, payload_json=payload_json, created_at=now
        )
        waiting = self._waiters.get(name, set())
        targets = [run_id] if run_id is not None else list(waiting)
        for target in targets:
            if target in waiting:
                run = self._runs[target]
                if run.wait_for == name:
                    self._wake(run, now)
        return True

    def _cancel_run(self, run: _Run, reason: str, now: datetime) -> CancelOutcome:
        """`cancel` of an unfinished run, under the lock. A held run's request is announced to
        the cancel listeners by `_announce`, outside the lock."""
        if run.cancel_requested_at is None:
            run.cancel_requested_at = now
            run.cancel_reason = reason
        if self._held(run, now):
            self._requested.append((run.run_id, run.cancel_reason or ""))
            return "requested"
        if run.status == "running":  # its lease lapsed: counted as a takeover counts it
            run.lease_expirations += 1
            self._end_lease(run, "interrupted", now)
        self._finish(run, "canceled", now)
        return "canceled"

    def _announce(self) -> None:
        """Tell the cancel listeners of the requests made under the lock (call without it)."""
        with self._lock:
            requested, self._requested = self._requested, []
            listeners = list(self._listeners)
        for run_id, reason in requested:
            for listener in listeners:
                listener(run_id, reason)

    def _unwait(self, run: _Run) -> None:
        self._unlisten(run)
        run.wait_for = None

    def _unlisten(self, run: _Run) -> None:
        if run.wait_for is not None:
            waiters = self._waiters.get(run.wait_for)
            if waiters is not None:
                waiters.discard(run.run_id)

    def _wake(self, run: _Run, now: datetime) -> None:
        """The awaited fact arrived: claimable now. It still reads `wait_for` until a claim
        takes it (as on Postgres)."""
        if run.status == "waiting":
            run.available_at = now
            run.updated_at = now
            self._unlisten(run)
            self._schedule(run)
            self._notify_run(run.run_id)

    def _notify_work(self) -> None:
        waiters, self._work_waiters = self._work_waiters, []
        for future in waiters:
            _resolve(future)

    def _notify_run(self, run_id: UUID) -> None:
        for future in self._run_waiters.pop(run_id, []):
            _resolve(future)
        self._maybe_auto_advance()

    def _on_clock_advance(self) -> None:
        with self._lock:
            self._notify_work()
            for run_id in list(self._run_waiters):
                for future in self._run_waiters.pop(run_id, []):
                    _resolve(future)

    def _maybe_auto_advance(self) -> None:
        """Jump a FakeClock to the next timer when every run is blocked and someone waits."""
        controls = self._controls
        if controls is None or not controls.auto_advance or self._drivers == 0:
            return
        if not self._active_pairs:
            return
        now = self.clock.now()
        for run_id in self._running:
            run = self._runs[run_id]
            if run.lease_expires_at is not None and run.lease_expires_at > now:
                return
        self._promote(now)
        if self._has_ready(list(self._active_pairs), now):
            return
        while self._timers:
            when, _, timer_run_id, version = self._timers[0]
            timed = self._runs.get(timer_run_id)
            if timed is None or timed.version != version:
                heapq.heappop(self._timers)
                continue
            if when > now:
                controls.advance_to(when)
            return

    def _record(self, run: _Run, *, full: bool) -> RunRecord:
        now = self.clock.now()
        executions: list[ExecutionRecord] = []
        if full:
            for e in run.executions:
                outcome = e.outcome  # as stored: the SDK reads a lapsed `running` (`_views`)
                executions.append(
                    ExecutionRecord(
                        fencing_token=e.fencing_token,
                        worker_id=e.worker_id,
                        claimed_at=e.claimed_at,
                        ended_at=e.ended_at,
                        outcome=outcome,
                        current_step=e.current_step,
                        step_started_at=e.step_started_at,
                    )
                )
        return RunRecord(
            run_id=run.run_id,
            task_name=run.task_name,
            task_version=run.task_version,
            status=run.status,
            priority=run.priority,
            created_at=run.created_at,
            updated_at=run.updated_at,
            available_at=run.available_at,
            input_json=run.input_json,
            idempotency_key=run.idempotency_key,
            output_json=run.output_json,
            error=run.error,
            claims=run.claims,
            failures=run.failures,
            lease_expirations=run.lease_expirations,
            fencing_token=run.fencing_token,
            lease_owner=run.lease_owner,
            lease_expires_at=run.lease_expires_at,
            finished_at=run.finished_at,
            cancel_requested_at=run.cancel_requested_at,
            cancel_reason=run.cancel_reason,
            wait_for=run.wait_for,
            trace_context=dict(run.trace_context),
            parent_run_id=run.parent_run_id,
            rerun_of=run.rerun_of,
            forked_from=run.forked_from,
            forked_at_step=run.forked_at_step,
            tags=dict(run.tags),
            concurrency_key=run.concurrency_key,
            fairness_weight=None if run.key is None else self._weights.get(run.key),
            deadline_at=run.deadline_at,
            start_by=run.start_by,
            rate_limit=run.rate_limit,
            rate_limit_key=None if run.rate_limit is None else run.rate_limit_key,
            debounce_key=run.debounce_key,
            steps=tuple(run.steps.values()) if full else (),
            executions=tuple(executions),
            observed_at=now,
        )

    # -- the SPI ----------------------------------------------------------------------------------

    async def enqueue(self, new: NewRun, *, conn: Any = None) -> EnqueueResult:
        if conn is not None:
            raise UsageError(
                "the memory backend has no transactions to join; enqueue without conn=",
                argument="conn",
            )
        _storable_new(new)
        with self._lock:
            source = None
            if new.forked_from is not None:
                source = self._runs.get(new.forked_from)
                if source is None:
                    raise RunNotFoundError(f"no run {new.forked_from}", run_id=new.forked_from)
                missing = [key for key in new.kept_steps if key not in source.steps]
                if missing:
                    raise BackendError(
                        f"run {new.forked_from} has no step records {missing} to keep in its fork"
                    )
            return self._enqueue_locked(new, source)

    async def enqueue_many(
        self, runs: Sequence[NewRun], *, conn: Any = None
    ) -> Sequence[EnqueueResult]:
        if conn is not None:
            raise UsageError(
                "the memory backend has no transactions to join; enqueue without conn=",
                argument="conn",
            )
        for new in runs:
            _storable_new(new)
        with self._lock:  # one write: no claim sees part of the batch
            return [self._enqueue_locked(new, None) for new in runs]

    def _storable_runs(self, runs: Sequence[NewRun]) -> None:
        for new in runs:
            _storable_new(new)

    def _enqueue_locked(self, new: NewRun, source: _Run | None) -> EnqueueResult:
        """Store `new` (under the lock), or find the run its idempotency key names."""
        if new.idempotency_key is not None:
            existing_id = self._by_key.get((new.task_name, new.idempotency_key))
            if existing_id is not None:
                existing = self._runs[existing_id]
                return EnqueueResult(
                    run_id=existing_id,
                    created=False,
                    task_version=existing.task_version,
                    input_hash=existing.input_hash,
                )
            pruned_id = self._tombstone_keys.get((new.task_name, new.idempotency_key))
            if pruned_id is not None:
                tombstone = self._tombstones[pruned_id]
                return EnqueueResult(
                    run_id=pruned_id,
                    created=False,
                    task_version=tombstone.task_version,
                    input_hash=tombstone.input_hash,
                    pruned=True,
                )
        if new.singleton is not None:
            return self._enqueue_singleton(new, source)
        if new.debounce_key is not None:
            return self._enqueue_debounced(new, source)
        run = self._insert(new, held=False, source=source)
        return EnqueueResult(run_id=run.run_id, created=True, task_version=run.task_version)

    def _enqueue_singleton(self, new: NewRun, source: _Run | None) -> EnqueueResult:
        """A singleton's enqueue, under the lock: skip for, or store and list, the key's
        runs that are not terminal."""
        assert new.concurrency_key is not None  # NewRun checks it
        key = (new.task_name, new.concurrency_key)
        ids = self._key_runs.get(key, [])
        active = [
            run
            for run in (self._runs.get(run_id) for run_id in ids)
            if run is not None and run.status not in TERMINAL_STATUSES
        ]
        self._key_runs[key] = [run.run_id for run in active]  # the ended ones are done with
        if new.singleton == "skip" and active:
            newest = active[-1]
            return EnqueueResult(
                run_id=newest.run_id,
                created=False,
                task_version=newest.task_version,
                skipped=True,
            )
        run = self._insert(new, held=False, source=source)
        return EnqueueResult(
            run_id=run.run_id,
            created=True,
            task_version=run.task_version,
            replaced=tuple(r.run_id for r in active),
        )

    def _enqueue_debounced(self, new: NewRun, source: _Run | None) -> EnqueueResult:
        """A debounced enqueue, under the lock: the key's run that has not started takes the
        input and waits again (never past its debounce deadline), else a new run is stored."""
        assert new.debounce_key is not None
        key = (new.task_name, new.task_version, new.debounce_key)
        now = self.clock.now()
        found = self._runs.get(self._debounced.get(key) or new.run_id)
        if found is not None and found.status == "pending" and found.claims == 0:
            due = [now + (new.delay or timedelta(0)), found.debounce_until, found.deadline_at]
            found.input_json = new.input_json
            found.input_hash = new.input_hash
            found.available_at = min(d for d in due if d is not None)
            found.updated_at = now
            self._schedule(found)
            return EnqueueResult(
                run_id=found.run_id,
                created=False,
                task_version=found.task_version,
                debounced=True,
            )
        run = self._insert(new, held=False, source=source)
        run.debounce_key = new.debounce_key
        run.debounce_until = _after(now, new.debounce_max_wait)
        self._debounced[key] = run.run_id
        return EnqueueResult(run_id=run.run_id, created=True, task_version=run.task_version)

    def _insert(
        self, new: NewRun, *, held: bool, group: str | None = None, source: _Run | None = None
    ) -> _Run:
        """Store a new run, under the lock: pending (or `held`: a group member waiting for
        its turn)."""
        now = self.clock.now()
        available_at = None if held else now + (new.delay or timedelta(0))
        deadlines = [d for d in (new.deadline_at, _after(now, new.timeout)) if d is not None]
        deadline_at = min(deadlines) if deadlines else None
        if deadline_at is not None and available_at is not None:
            available_at = min(available_at, deadline_at)  # claimable then, to be ended
        run = _Run(
            run_id=new.run_id,
            seq=next(self._seq),
            task_name=new.task_name,
            task_version=new.task_version,
            input_json=new.input_json,
            input_hash=new.input_hash,
            priority=new.priority,
            idempotency_key=new.idempotency_key,
            trace_context=dict(new.trace_context),
            status="waiting" if held else "pending",
            created_at=now,
            updated_at=now,
            available_at=available_at,
            wait_for=HELD_WAIT if held else None,
            parent_run_id=new.parent_run_id,
            parent_fact=new.parent_fact,
            cancel_with_parent=new.cancel_with_parent,
            group=group,
            rerun_of=new.rerun_of,
            forked_from=new.forked_from,
            forked_at_step=new.forked_at_step,
            concurrency_key=new.concurrency_key,
            count_waiting=new.count_waiting,
            tags=dict(new.tags),
            rate_limit=new.rate_limit,
            rate_limit_key=new.rate_limit_key,
            deadline_at=deadline_at,
            start_by=_after(now + (new.delay or timedelta(0)), new.start_within),
        )
        if source is not None:  # a fork: its kept records and the old run's facts, as stored
            run.steps = {key: source.steps[key] for key in new.kept_steps}
            for (scope, name), fact in list(self._facts.items()):
                if scope == source.run_id:
                    self._facts[(run.run_id, name)] = evolve(fact, run_id=run.run_id)
        self._runs[run.run_id] = run
        if run.key is not None:
            assert new.concurrency_limit is not None  # NewRun checks they go together
            self._limits[run.key] = new.concurrency_limit
            if new.fairness_weight is None:
                self._weights.pop(run.key, None)
            else:
                self._weights[run.key] = new.fairness_weight
            self._key_runs.setdefault(run.key, []).append(run.run_id)
        if new.parent_run_id is not None:
            self._children.setdefault(new.parent_run_id, []).append(run.run_id)
        if new.idempotency_key is not None:
            self._by_key[(new.task_name, new.idempotency_key)] = run.run_id
        self._schedule(run)
        return run

    # -- child groups -----------------------------------------------------------------------------

    async def start_group(
        self, group: ChildGroup, runs: Sequence[NewRun]
    ) -> Sequence[EnqueueResult]:
        for new in runs:
            _storable_json(new.input_json, "input")
            _storable_text(new.idempotency_key, "idempotency key")
        key = (group.parent_run_id, group.name)
        with self._lock:
            existing = self._groups.get(key)
            if existing is not None:
                return [
                    EnqueueResult(
                        run_id=member_id,
                        created=False,
                        task_version=self._runs[member_id].task_version,
                        input_hash=self._runs[member_id].input_hash,
                    )
                    for member_id in existing.members
                ]
            limit = group.max_concurrency
            members = [
                self._insert(new, held=limit is not None and i >= limit, group=group.name)
                for i, new in enumerate(runs)
            ]
            self._groups[key] = _Group(members=[m.run_id for m in members], remaining=len(members))
            return [
                EnqueueResult(run_id=m.run_id, created=True, task_version=m.task_version)
                for m in members
            ]

    async def join_group(self, group: ChildGroup, run_ids: Sequence[UUID]) -> int:
        key = (group.parent_run_id, group.name)
        with self._lock:
            for run_id in run_ids:
                run = self._runs.get(run_id)
                if run is None or run.parent_run_id != group.parent_run_id:
                    raise RunNotFoundError(
                        f"no child run {run_id} of run {group.parent_run_id}", run_id=run_id
                    )
            remaining = 0
            for run_id in run_ids:
                run = self._runs[run_id]
                run.group = group.name
                if run.status not in TERMINAL_STATUSES:
                    remaining += 1
            self._groups[key] = _Group(members=list(run_ids), remaining=remaining)
            if remaining == 0:
                self._store_fact(group.parent_run_id, group.name, "null", self.clock.now())
            return remaining

    async def group_runs(self, *, parent_run_id: UUID, name: str) -> Sequence[RunRecord]:
        with self._lock:
            group = self._groups.get((parent_run_id, name))
            if group is None:
                return []
            return [self._record(self._runs[m], full=False) for m in group.members]

    async def claim(
        self, *, worker_id: str, pairs: Sequence[TaskPair], limit: int, lease: timedelta
    ) -> Sequence[ClaimedRun]:
        with self._lock:
            now = self.clock.now()
            self._active_pairs.update(pairs)
            self._promote(now)
            claimed: list[ClaimedRun] = []
            taken: dict[tuple[str, str], int] = {}  # the runs of each key that wanted a slot
            open_pairs = self._unpaused(list(dict.fromkeys(pairs)))
            offers = self._open_keys(open_pairs, now, limit)
            while len(claimed) < limit and open_pairs:
                # One turn (the Postgres claim's rule): every pair offers its next run, so one
                # busy pair cannot starve another; within the turn the higher priority goes
                # first, then the earlier ready, then the earlier enqueued.
                heads: list[tuple[_Order, TaskPair]] = []
                for pair in list(open_pairs):
                    found = self._head_entry(pair, now, taken, offers)
                    if found is None:
                        open_pairs.remove(pair)
                        continue
                    heads.append((found[0], pair))
                heads.sort(key=lambda head: head[0])
                for _, pair in heads:
                    if len(claimed) >= limit:
                        break
                    run = self._pop_ready(pair, now, taken, offers)
                    if run is None:
                        continue
                    if run.needs_token(now) and not self._take_run_token(run, now):
                        continue
                    if run.key is not None and run.wants_slot:
                        taken[run.key] = taken.get(run.key, 0) + 1
                    claimed.append(self._take(run, worker_id, lease, now))
            if taken:  # as the Postgres claim stamps the keys' rows it took from
                turn = next(self._seq)
                for key in taken:
                    self._served[key] = (now, turn)
            return claimed

    def _take_run_token(self, run: _Run, now: datetime) -> bool:
        """Take a token of the run's bucket for its start; without one, park the run until
        its slot (`park_slot`), or, under a paused limit, until its deadline or a resume."""
        assert run.rate_limit is not None
        limit = self._rate_limits.get(run.rate_limit)
        if limit is None:  # never stored (the SDK stores it first): no limit to keep
            return True
        bucket = (run.rate_limit, run.rate_limit_key)
        deadlines = [run.deadline_at] + ([run.start_by] if run.claims == 0 else [])
        if limit.paused:
            wake: datetime | None = min((d for d in deadlines if d is not None), default=None)
        else:
            took = take_tokens(
                tat=self._buckets.get(bucket), now=now, limit=limit.limit, per=limit.per, wanted=1
            )
            if took.taken:
                self._buckets[bucket] = took.tat
                return True
            slot = self._park(bucket, took.next_at, limit.info(run.rate_limit).interval)
            wake = min([slot] + [d for d in deadlines if d is not None])
        run.waits_for_limit = run.rate_limit
        run.available_at = wake
        run.updated_at = now
        self._schedule(run)
        return False

    def _park(self, bucket: tuple[str, str], next_at: datetime, interval: timedelta) -> datetime:
        """The bucket's next wait slot (`park_slot`), kept as its `parked_until`."""
        slot = park_slot(next_at, self._parked_until.get(bucket), interval)
        self._parked_until[bucket] = slot
        return slot

    def _take(self, run: _Run, worker_id: str, lease: timedelta, now: datetime) -> ClaimedRun:
        ready_at = run.lease_expires_at if run.status == "running" else run.available_at
        lost_leases = 0
        if run.status == "running":  # its lease expired: the holder is gone or frozen
            run.lease_expirations += 1
            self._end_lease(run, "interrupted", now)
            lost_leases = self._lost_leases(run)
        run.claims += 1
        run.fencing_token = next(self._tokens)
        run.status = "running"
        run.lease_owner = worker_id
        run.lease_expires_at = now + lease
        run.available_at = None
        run.updated_at = now
        run.waits_for_limit = None
        self._unwait(run)
        run.executions.append(_Execution(run.fencing_token, worker_id, now))
        self._running.add(run.run_id)
        self._schedule(run)
        self._notify_run(run.run_id)
        return ClaimedRun(
            run_id=run.run_id,
            task_name=run.task_name,
            task_version=run.task_version,
            input_json=run.input_json,
            priority=run.priority,
            fencing_token=run.fencing_token,
            claimed_at=now,
            claims=run.claims,
            failures=run.failures,
            trace_context=dict(run.trace_context),
            steps=tuple(run.steps.values()),
            ready_at=ready_at,
            lost_leases=lost_leases,
            cancel_reason=(None if run.cancel_requested_at is None else (run.cancel_reason or "")),
            idempotency_key=run.idempotency_key,
            deadline_at=run.deadline_at,
            start_by=run.start_by,
        )

    @staticmethod
    def _lost_leases(run: _Run) -> int:
        """Leases lost since the newest step record: interrupted executions from the one that
        wrote it on (as the Postgres claim counts them)."""
        newest = max((s.fencing_token for s in run.steps.values()), default=0)
        return sum(
            1 for e in run.executions if e.outcome == "interrupted" and e.fencing_token >= newest
        )

    async def heartbeat(
        self, *, worker_id: str, beats: Sequence[Beat], lease: timedelta
    ) -> HeartbeatResult:
        with self._lock:
            now = self.clock.now()
            lost: set[UUID] = set()
            cancels: dict[UUID, str] = {}
            for beat in beats:
                run = self._runs.get(beat.run_id)
                if (
                    run is None
                    or run.status != "running"
                    or run.fencing_token != beat.fencing_token
                ):
                    lost.add(beat.run_id)
                    continue
                run.lease_expires_at = now + lease
                execution = self._current_execution(run)
                if execution is not None:
                    execution.current_step = beat.current_step
                    execution.step_started_at = beat.step_started_at
                if run.cancel_requested_at is not None:
                    cancels[run.run_id] = run.cancel_reason or ""
            return HeartbeatResult(lost=frozenset(lost), cancel_requested=cancels)

    async def record_step(self, lease: Lease, step: StepRecord) -> None:
        _storable_step(step)
        self._crash("record_step", lease.run_id, "before")
        with self._lock:
            run = self._check(lease)
            now = self.clock.now()
            self._store_step(run, lease, step)
            run.lease_expires_at = now + lease.duration
            run.updated_at = now
            execution = self._current_execution(run)
            if execution is not None and execution.current_step == step.name:
                execution.current_step = execution.step_started_at = None
        self._crash("record_step", lease.run_id, "after")

    async def run_step_transaction(
        self, lease: Lease, body: Callable[[Any], Awaitable[StepRecord]]
    ) -> None:
        """`TransactionStore`: `body` gets a serializable `MemoryTransaction` on `store`; its
        writes and the step's record apply together, under the lock, only if the run is still
        held under the lease and no row it read was written since (else
        `TransactionConflictError`)."""
        self._crash("step_transaction", lease.run_id, "before")
        with self._lock:
            self._check(lease)  # fence first: a stale attempt's body never runs
        tx = self.store.transaction(serializable=True)
        try:
            step = await body(tx)  # writes are buffered: nothing lands unless applied below
        except Exception as exc:
            with self._lock:
                try:
                    self._check(lease)
                except FencingError as fenced:
                    raise fenced from exc
            raise
        _storable_step(step)
        with self._lock:
            run = self._check(lease)
            if tx.conflicts():
                raise TransactionConflictError(
                    f"step {step.name!r}: a row its transaction read was written by another "
                    "transaction since; nothing of it was stored",
                    sqlstate="40001",
                )
            now = self.clock.now()
            tx.apply()
            self._store_step(run, lease, step)
            run.lease_expires_at = now + lease.duration
            run.updated_at = now
            execution = self._current_execution(run)
            if execution is not None and execution.current_step == step.name:
                execution.current_step = execution.step_started_at = None
        self._crash("step_transaction", lease.run_id, "after")

    async def end_execution(self, lease: Lease, ending: Ending) -> EndResult:
        _storable_step(ending.step)
        _storable_json(ending.output_json, "task output")
        _storable_error(ending.error, "run error")
        operation = f"end_execution:{ending.outcome}"
        self._crash(operation, lease.run_id, "before")
        with self._lock:
            run = self._check(lease)
            if not ending.finishes and run.cancel_requested_at is not None:
                return "cancel_requested"
            name = ending.wait_for
            if name is not None and (
                (run.run_id, name) in self._facts or (None, name) in self._facts
            ):
                return "fact_present"
            now = self.clock.now()
            if ending.step is not None:
                self._store_step(run, lease, ending.step)
            if ending.output_json is not None:
                run.output_json = ending.output_json
            if ending.error is not None:
                run.error = ending.error
            if ending.count_failure:
                run.failures += 1
            execution = self._current_execution(run)
            if execution is not None and ending.outcome != "canceled":
                execution.current_step = execution.step_started_at = None
            self._end_lease(run, ending.outcome, now)
            if ending.finishes:
                self._finish(run, ending.status, now)
            else:
                run.status = ending.status
                run.available_at = (
                    now
                    if ending.status == "pending" and ending.available_at is None
                    else ending.available_at
                )
                run.updated_at = now
                if name is not None:
                    run.wait_for = name
                    self._waiters.setdefault(name, set()).add(run.run_id)
                self._schedule(run)
                self._notify_run(run.run_id)
        self._announce()
        self._crash(operation, lease.run_id, "after")
        return "ended"

    async def signal(self, *, run_id: UUID | None, name: str, payload_json: str) -> bool:
        _storable_json(payload_json, f"payload of fact {name!r}")
        with self._lock:
            if run_id is not None and run_id not in self._runs:
                raise RunNotFoundError(f"no run {run_id}", run_id=run_id)
            return self._store_fact(run_id, name, payload_json, self.clock.now())

    async def get_facts(self, *, run_id: UUID, name: str) -> Sequence[Fact]:
        with self._lock:
            found = (self._facts.get((run_id, name)), self._facts.get((None, name)))
            return [fact for fact in found if fact is not None]

    async def cancel(self, run_id: UUID, *, reason: str) -> CancelOutcome:
        _storable_text(reason, "cancel reason")
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                raise RunNotFoundError(f"no run {run_id}", run_id=run_id)
            if run.status in TERMINAL_STATUSES:
                return "already_finished"
            outcome = self._cancel_run(run, reason, self.clock.now())
        self._announce()
        return outcome

    async def get_run(self, run_id: UUID) -> RunRecord | None:
        with self._lock:
            run = self._runs.get(run_id)
            return None if run is None else self._record(run, full=True)

    async def get_run_head(self, run_id: UUID) -> RunRecord | None:
        with self._lock:
            run = self._runs.get(run_id)
            return None if run is None else self._record(run, full=False)

    async def list_runs(self, query: RunQuery) -> Sequence[RunRecord]:
        with self._lock:
            runs = sorted(self._runs.values(), key=lambda r: r.run_id, reverse=True)
            selected = [r for r in runs if _matches(r, query)]
            return [self._record(r, full=False) for r in selected[: query.limit]]

    async def queue_depths(self, pairs: Sequence[TaskPair]) -> dict[TaskPair, int]:
        with self._lock:
            wanted = set(pairs)
            depths = dict.fromkeys(wanted, 0)
            for run in self._runs.values():
                if run.status == "pending" and run.pair in wanted:
                    depths[run.pair] += 1
            return depths

    async def wait_for_work(self, *, pairs: Sequence[TaskPair], timeout: float) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            self._active_pairs.update(pairs)
            now = self.clock.now()
            self._promote(now)
            if self._has_ready(pairs, now):
                return
            future: asyncio.Future[None] = loop.create_future()
            self._work_waiters.append(future)
            if self._timers and self._controls is None:
                until_next = (self._timers[0][0] - now).total_seconds()
                timeout = max(0.0, min(timeout, until_next))
            self._maybe_auto_advance()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(future, timeout)

    async def wait_for_run(self, run_id: UUID, *, timeout: float) -> None:
        await self._wait_for_change(run_id, timeout=timeout)

    async def _wait_for_change(
        self, run_id: UUID, *, timeout: float, ready: Callable[[], bool] | None = None
    ) -> None:
        """Wait until the run's waiters are woken (a change of state, a stream entry), the
        clock moves or `timeout` passes; at once if `ready()` (under the lock) says so."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if ready is not None and ready():
                return
            self._run_waiters.setdefault(run_id, []).append(future)
            self._drivers += 1
            self._maybe_auto_advance()
        try:
            deadline = loop.time() + timeout
            while not future.done():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(asyncio.shield(future), min(remaining, 0.01))
                except TimeoutError:
                    with self._lock:
                        self._maybe_auto_advance()
        finally:
            with self._lock:
                self._drivers -= 1
                waiters = self._run_waiters.get(run_id)
                if waiters and future in waiters:
                    waiters.remove(future)

    def add_cancel_listener(self, listener: Callable[[UUID, str], None]) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(listener)

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove

    # -- streams (StreamStore) -------------------------------------------------------------------

    async def append_stream(
        self, lease: Lease, appends: Sequence[StreamAppend]
    ) -> Sequence[StreamEntry]:
        for append in appends:
            _storable_text(append.stream, "stream name")
            _storable_text(append.key, f"key of stream {append.stream!r}")
            _storable_json(append.value_json, f"value of stream {append.stream!r}")
        self._crash("append_stream", lease.run_id, "before")
        with self._lock:
            self._check(lease)
            now = self.clock.now()
            streams = self._streams.setdefault(lease.run_id, {})
            stored = []
            for append in appends:
                stream = streams.setdefault(append.stream, _Stream())
                entry = stream.by_key.get(append.key)
                if entry is None:
                    entry = StreamEntry(
                        run_id=lease.run_id,
                        stream=append.stream,
                        seq=len(stream.entries) + 1,
                        key=append.key,
                        value_json=append.value_json,
                        written_at=now,
                    )
                    stream.entries.append(entry)
                    stream.by_key[append.key] = entry
                stored.append(entry)
            self._notify_run(lease.run_id)
        self._crash("append_stream", lease.run_id, "after")
        return stored

    async def read_stream(
        self, run_id: UUID, stream: str, *, after: int, limit: int
    ) -> Sequence[StreamEntry]:
        with self._lock:
            found = self._streams.get(run_id, {}).get(stream)
            if found is None:
                return []
            # seq n sits at index n - 1: entries are never removed but with their run.
            return found.entries[max(after, 0) : max(after, 0) + limit]

    async def last_stream_entries(
        self, run_ids: Sequence[UUID], stream: str | None = None
    ) -> Sequence[StreamEntry]:
        with self._lock:
            found = []
            for run_id in dict.fromkeys(run_ids):
                for name, entries in self._streams.get(run_id, {}).items():
                    if (stream is None or name == stream) and entries.entries:
                        found.append(entries.entries[-1])
            return found

    async def wait_for_stream(
        self, run_id: UUID, stream: str, *, after: int, timeout: float
    ) -> None:
        def ready() -> bool:
            found = self._streams.get(run_id, {}).get(stream)
            run = self._runs.get(run_id)
            return (found is not None and len(found.entries) > after) or (
                run is None or run.status in TERMINAL_STATUSES
            )

        await self._wait_for_change(run_id, timeout=timeout, ready=ready)

    # -- schedules (ScheduleStore) ---------------------------------------------------------------

    def _schedule_record(self, row: _Schedule, now: datetime) -> ScheduleRecord:
        return ScheduleRecord(
            state=row.state,
            version=row.version,
            created_at=row.created_at,
            updated_at=row.updated_at,
            observed_at=now,
        )

    async def create_schedule(self, state: ScheduleState) -> bool:
        _storable_json(state.input_json, f"input of schedule {state.name!r}")
        with self._lock:
            if state.name in self._schedules:
                return False
            now = self.clock.now()
            self._schedules[state.name] = _Schedule(state, 1, now, now)
            return True

    async def get_schedule(self, name: str) -> ScheduleRecord | None:
        with self._lock:
            row = self._schedules.get(name)
            return None if row is None else self._schedule_record(row, self.clock.now())

    async def list_schedules(self, query: ScheduleQuery) -> Sequence[ScheduleRecord]:
        with self._lock:
            now = self.clock.now()
            names = None if query.task_names is None else set(query.task_names)
            found = []
            for name in sorted(self._schedules):
                row = self._schedules[name]
                state = row.state
                if names is not None and state.task_name not in names:
                    continue
                if query.due_only and (
                    state.paused or (state.next_tick > now and state.buffered_tick is None)
                ):
                    continue
                found.append(self._schedule_record(row, now))
            return found

    async def update_schedule(self, state: ScheduleState, *, expected_version: int) -> bool:
        _storable_json(state.input_json, f"input of schedule {state.name!r}")
        with self._lock:
            row = self._schedules.get(state.name)
            if row is None or row.version != expected_version:
                return False
            row.state = state
            row.version += 1
            row.updated_at = self.clock.now()
            return True

    async def delete_schedule(self, name: str) -> bool:
        with self._lock:
            return self._schedules.pop(name, None) is not None

    # -- pause (LifecycleStore) ------------------------------------------------------------------

    async def pause_task(self, *, task_name: str, task_version: int | None) -> bool:
        with self._lock:
            key = (task_name, task_version)
            if key in self._paused:
                return False
            self._paused[key] = self.clock.now()
            return True

    async def resume_task(self, *, task_name: str, task_version: int | None) -> bool:
        with self._lock:
            keys = [
                key
                for key in self._paused
                if key[0] == task_name and (task_version is None or key[1] == task_version)
            ]
            for key in keys:
                del self._paused[key]
            if keys:
                self._notify_work()
                self._maybe_auto_advance()
            return bool(keys)

    async def list_paused_tasks(self) -> Sequence[PausedTask]:
        with self._lock:
            keys = sorted(self._paused, key=lambda k: (k[0], k[1] or 0))
            return [
                PausedTask(
                    task_name=name, task_version=version, paused_at=self._paused[(name, version)]
                )
                for name, version in keys
            ]

    # -- what operators look at (InsightStore) -----------------------------------------------------

    async def record_worker(self, state: WorkerState) -> None:
        with self._lock:
            now = self.clock.now()
            self._workers[state.worker_id] = WorkerRecord(
                worker_id=state.worker_id,
                host=state.host,
                pid=state.pid,
                pairs=tuple(state.pairs),
                concurrency=state.concurrency,
                runs_held=state.runs_held,
                started_at=state.started_at,
                last_seen_at=now,
                stopped_at=now if state.stopped else None,
                observed_at=now,
            )

    async def list_workers(self, *, limit: int) -> Sequence[WorkerRecord]:
        with self._lock:
            now = self.clock.now()
            newest = sorted(
                self._workers.values(), key=lambda w: (w.last_seen_at, w.worker_id), reverse=True
            )
            return [evolve(w, observed_at=now) for w in newest[:limit]]

    async def forget_workers(self, *, seen_before: datetime) -> int:
        with self._lock:
            gone = [k for k, w in self._workers.items() if w.last_seen_at < seen_before]
            for key in gone:
                del self._workers[key]
            return len(gone)

    async def pair_activity(self) -> Sequence[PairActivity]:
        with self._lock:
            now = self.clock.now()
            counts: dict[tuple[str, int], dict[str, int]] = {}
            oldest: dict[tuple[str, int], datetime] = {}
            for run in self._runs.values():
                if run.status not in ("pending", "running", "waiting"):
                    continue
                pair = (run.task_name, run.task_version)
                by_status = counts.setdefault(pair, {"pending": 0, "running": 0, "waiting": 0})
                by_status[run.status] += 1
                due = run.available_at
                if run.status == "pending" and due is not None and due <= now:
                    oldest[pair] = min(oldest.get(pair, due), due)
            return [
                PairActivity(
                    task_name=name,
                    task_version=version,
                    pending=c["pending"],
                    running=c["running"],
                    waiting=c["waiting"],
                    oldest_due_at=oldest.get((name, version)),
                    observed_at=now,
                )
                for (name, version), c in sorted(counts.items())
            ]

    async def finished_counts(
        self, *, since: datetime, bucket: timedelta
    ) -> Sequence[FinishedCount]:
        with self._lock:
            counts: dict[tuple[str, int, str, datetime], int] = {}
            for run in self._runs.values():
                if run.finished_at is None or run.finished_at < since:
                    continue
                start = since + bucket * ((run.finished_at - since) // bucket)
                key = (run.task_name, run.task_version, run.status, start)
                counts[key] = counts.get(key, 0) + 1
            return [
                FinishedCount(
                    task_name=name,
                    task_version=version,
                    status=status,  # type: ignore[arg-type]  # a terminal status: finished
                    bucket_start=start,
                    runs=n,
                )
                for (name, version, status, start), n in sorted(counts.items())
            ]

    async def key_usage(self, *, limit: int) -> Sequence[KeyUsage]:
        with self._lock:
            usage: dict[tuple[str, str], list[int]] = {}
            for run in self._runs.values():
                key = run.key
                if key is None or not (run.holds_slot or run.wants_slot):
                    continue
                counts = usage.setdefault(key, [0, 0])
                counts[0 if run.holds_slot else 1] += 1
            return [
                KeyUsage(
                    task_name=name,
                    concurrency_key=key,
                    limit=self._limits.get((name, key), 1),
                    holding=holding,
                    wanting=wanting,
                )
                for (name, key), (holding, wanting) in sorted(usage.items())[:limit]
            ]

    # -- rate limits (RateLimitStore) ----------------------------------------------------------

    async def define_rate_limit(self, name: str, *, limit: int, per: timedelta) -> RateLimitInfo:
        with self._lock:
            stored = self._rate_limits.get(name)
            if stored is None:
                now = self.clock.now()
                stored = self._rate_limits[name] = _Limit(
                    limit=limit, per=per, created_at=now, updated_at=now
                )
            return stored.info(name)

    async def set_rate_limit(self, name: str, *, limit: int, per: timedelta) -> RateLimitInfo:
        with self._lock:
            now = self.clock.now()
            stored = self._rate_limits.get(name)
            if stored is None:
                stored = self._rate_limits[name] = _Limit(
                    limit=limit, per=per, created_at=now, updated_at=now
                )
            else:
                old = stored.info(name).interval
                stored.limit, stored.per, stored.updated_at = limit, per, now
                new = stored.info(name).interval
                for bucket, tat in self._buckets.items():
                    if bucket[0] == name and tat > now:  # the tokens owed, in the new interval
                        owed = (tat - now) // timedelta(microseconds=1)
                        self._buckets[bucket] = now + timedelta(microseconds=-(-owed * new // old))
                self._unpark(name, now)
            return stored.info(name)

    async def get_rate_limit(self, name: str) -> RateLimitInfo | None:
        with self._lock:
            stored = self._rate_limits.get(name)
            return None if stored is None else stored.info(name)

    async def list_rate_limits(self) -> Sequence[RateLimitInfo]:
        with self._lock:
            return [self._rate_limits[name].info(name) for name in sorted(self._rate_limits)]

    async def pause_rate_limit(self, name: str, *, paused: bool) -> bool:
        with self._lock:
            stored = self._rate_limits.get(name)
            if stored is None or stored.paused == paused:
                return False
            now = self.clock.now()
            stored.paused, stored.updated_at = paused, now
            if not paused:
                self._unpark(name, now)
            return True

    def _unpark(self, name: str, now: datetime) -> None:
        """The runs waiting for a token of the limit, claimable now (they take their token by
        its new rule, and wait in new slots)."""
        for bucket in [b for b in self._parked_until if b[0] == name]:
            del self._parked_until[bucket]
        for run in self._runs.values():
            if run.waits_for_limit == name and run.status in ("pending", "waiting"):
                run.waits_for_limit = None
                run.available_at = now
                run.updated_at = now
                self._schedule(run)
        self._notify_work()
        self._maybe_auto_advance()

    async def take_rate_token(self, lease: Lease, request: TokenRequest) -> TokenGrant:
        with self._lock:
            run = self._check(lease)
            now = self.clock.now()
            attempt = (request.step, request.attempt)
            if attempt in run.token_grants:
                return TokenGrant(status="granted", observed_at=now)
            stored = self._rate_limits.get(request.limit)
            if stored is None:
                return TokenGrant(status="unknown", observed_at=now)
            if stored.paused:
                run.waits_for_limit = request.limit
                return TokenGrant(status="paused", observed_at=now)
            bucket = (request.limit, request.key)
            took = take_tokens(
                tat=self._buckets.get(bucket),
                now=now,
                limit=stored.limit,
                per=stored.per,
                wanted=1,
            )
            if not took.taken:
                run.waits_for_limit = request.limit
                slot = self._park(bucket, took.next_at, stored.info(request.limit).interval)
                return TokenGrant(status="wait", next_at=slot, observed_at=now)
            self._buckets[bucket] = took.tat
            run.token_grants.add(attempt)
            return TokenGrant(status="granted", observed_at=now)

    # -- retention (RetentionStore) ----------------------------------------------------------------

    def _prunable(self, query: PruneQuery, now: datetime) -> list[_Run]:
        cutoff = now - query.older_than
        excluded = set(query.exclude_task_names)
        wanted = None if query.task_names is None else set(query.task_names)
        found = []
        for run in self._runs.values():
            if (
                run.status not in TERMINAL_STATUSES
                or run.finished_at is None
                or run.finished_at >= cutoff
                or run.task_name in excluded
                or (wanted is not None and run.task_name not in wanted)
            ):
                continue
            parent = None if run.parent_run_id is None else self._runs.get(run.parent_run_id)
            if parent is not None and parent.status not in TERMINAL_STATUSES:
                continue
            if any(
                self._runs[child].status not in TERMINAL_STATUSES
                for child in self._children.get(run.run_id, ())
                if child in self._runs
            ):
                continue
            found.append(run)
        found.sort(key=lambda r: (r.finished_at or now, r.run_id))
        return found

    async def prune_runs(self, query: PruneQuery) -> PruneBatch:
        with self._lock:
            now = self.clock.now()
            batch = self._prunable(query, now)[: query.limit]
            for run in batch:
                self._delete_run(run, now)
            return PruneBatch(pruned=len(batch))

    def _delete_run(self, run: _Run, now: datetime) -> None:
        """Delete a finished run with everything stored for it; leave its tombstone."""
        del self._runs[run.run_id]
        self._tombstones[run.run_id] = PrunedRun(
            run_id=run.run_id,
            task_name=run.task_name,
            task_version=run.task_version,
            status=run.status,
            idempotency_key=run.idempotency_key,
            input_hash=run.input_hash,
            created_at=run.created_at,
            finished_at=run.finished_at or now,
            pruned_at=now,
        )
        if run.idempotency_key is not None:
            key = (run.task_name, run.idempotency_key)
            self._by_key.pop(key, None)
            self._tombstone_keys[key] = run.run_id
        for fact_key in [k for k in self._facts if k[0] == run.run_id]:
            del self._facts[fact_key]
        self._children.pop(run.run_id, None)
        self._streams.pop(run.run_id, None)
        for group_key in [k for k in self._groups if k[0] == run.run_id]:
            del self._groups[group_key]
        if run.parent_run_id is not None:
            siblings = self._children.get(run.parent_run_id)
            if siblings is not None and run.run_id in siblings:
                siblings.remove(run.run_id)
        self._unwait(run)

    async def count_prunable(self, query: PruneQuery) -> int:
        with self._lock:
            return len(self._prunable(query, self.clock.now()))

    async def get_pruned(self, run_id: UUID) -> PrunedRun | None:
        with self._lock:
            return self._tombstones.get(run_id)

    async def forget_pruned(self, *, older_than: timedelta, limit: int) -> PruneBatch:
        with self._lock:
            cutoff = self.clock.now() - older_than
            old = sorted(
                (t for t in self._tombstones.values() if t.pruned_at < cutoff),
                key=lambda t: (t.pruned_at, t.run_id),
            )[:limit]
            for tombstone in old:
                del self._tombstones[tombstone.run_id]
                if tombstone.idempotency_key is not None:
                    key = (tombstone.task_name, tombstone.idempotency_key)
                    if self._tombstone_keys.get(key) == tombstone.run_id:
                        del self._tombstone_keys[key]
            return PruneBatch(pruned=len(old))

    def ledger(self, conn: Any) -> MemoryLedger:
        if not isinstance(conn, MemoryStore):
            raise UsageError(
                "the memory backend's with_attempt_token needs a umt_backend_memory.MemoryStore "
                f"as its connection (your business tables in memory), got {type(conn).__name__}",
                argument="conn",
            )
        return MemoryLedger(self, conn)

    async def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None


class MemoryLedger:
    """The operation ledger of the memory backend, committing into a `MemoryStore`.

    The same rules as Postgres: the fence is the ledger row of the op key (a begin raises its
    token, never lowers it); `finish` checks the run and the op before the commit callback
    runs (fence first) and again, atomically with applying the callback's buffered writes,
    after it. No lock is held while the callback runs.
    """

    def __init__(self, backend: MemoryBackend, store: MemoryStore) -> None:
        self._backend = backend
        self._store = store

    async def begin(self, *, op_key: str, lease: Lease) -> LedgerEntry:
        backend = self._backend
        backend._crash("ledger.begin", lease.run_id, "before")
        with backend._lock:
            backend._check(lease)
            row = backend._ledger.get(op_key)
            if row is not None and row.result_json is not None:
                return LedgerEntry(result_json=row.result_json, resumed=False)
            if row is not None and row.fencing_token > lease.fencing_token:
                raise self._stale(op_key, lease, "a newer attempt began it")
            backend._ledger[op_key] = _LedgerRow(lease.run_id, lease.fencing_token)
        backend._crash("ledger.begin", lease.run_id, "after")
        return LedgerEntry(result_json=None, resumed=row is not None)

    def _fence(self, op_key: str, lease: Lease) -> _LedgerRow:
        """The op's row if `lease` may still commit it; else FencingError. Hold the lock."""
        backend = self._backend
        backend._check(lease)
        row = backend._ledger.get(op_key)
        if row is None or row.fencing_token != lease.fencing_token:
            raise self._stale(op_key, lease, "a newer attempt began it")
        if row.result_json is not None:
            raise self._stale(op_key, lease, "it was already finished by another attempt")
        return row

    @staticmethod
    def _stale(op_key: str, lease: Lease, why: str) -> FencingError:
        return FencingError(
            f"operation {op_key!r}: attempt token {lease.fencing_token} may not commit it: {why}",
            run_id=lease.run_id,
            fencing_token=lease.fencing_token,
        )

    async def finish(
        self,
        *,
        op_key: str,
        lease: Lease,
        result_json: str,
        commit: Callable[[Any], Awaitable[None]],
    ) -> None:
        backend = self._backend
        backend._crash("ledger.finish", lease.run_id, "before")
        with backend._lock:
            self._fence(op_key, lease)  # fence first: a stale attempt's callback never runs
        tx = self._store.transaction()
        try:
            await commit(tx)  # writes are buffered; they apply below only if the fence holds
        except Exception as exc:
            with backend._lock:
                try:
                    self._fence(op_key, lease)
                except FencingError as fenced:  # it failed because a newer attempt took over
                    raise fenced from exc
            raise
        with backend._lock:
            row = self._fence(op_key, lease)
            tx.apply()
            row.result_json = result_json
        backend._crash("ledger.finish", lease.run_id, "after")


def _matches(run: _Run, query: RunQuery) -> bool:
    """Whether the run passes every filter of `query` (what Postgres's list_runs does)."""
    return (
        (query.before is None or run.run_id < query.before)
        and (query.task_name is None or run.task_name == query.task_name)
        and (query.task_version is None or run.task_version == query.task_version)
        and (query.status is None or run.status == query.status)
        and (query.parent_run_id is None or run.parent_run_id == query.parent_run_id)
        and (query.concurrency_key is None or run.concurrency_key == query.concurrency_key)
        and (query.idempotency_key is None or run.idempotency_key == query.idempotency_key)
        and (query.worker_id is None or any(e.worker_id == query.worker_id for e in run.executions))
        and (
            not query.needs_attention
            or (run.status == "waiting" and (run.wait_for or "").startswith(ATTENTION_WAIT_PREFIX))
        )
        and all(run.tags.get(key) == value for key, value in query.tags.items())
        and (query.created_after is None or run.created_at >= query.created_after)
        and (query.created_before is None or run.created_at < query.created_before)
        and (
            query.finished_after is None
            or (run.finished_at is not None and run.finished_at >= query.finished_after)
        )
        and (
            query.finished_before is None
            or (run.finished_at is not None and run.finished_at < query.finished_before)
        )
    )


def _resolve(future: asyncio.Future[None]) -> None:
    if future.done():
        return
    loop = future.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        future.set_result(None)
    else:
        loop.call_soon_threadsafe(lambda: None if future.done() else future.set_result(None))
