"""Schedules: cron expressions that start runs, declared in code or made at run time.

A schedule lives in the store (`umt_sdk.backend.ScheduleStore`), so it outlives every process;
declaring it again from every process changes nothing but what the declaration changed. The
SDK decides everything here, the store keeps the rows:

- which ticks are due: from the stored `next_tick` and the store's clock (`observed_at`),
  through `umt_sdk._cron` (cronsim; DST gaps and repeats are said there);
- which of them start a run: the overlap policy against the schedule's previous run, and the
  catch-up window after downtime (by default only the last missed tick starts);
- one run per tick: each run is enqueued with the key `umt.schedule:<name>:<tick>`, first, and
  only then is the schedule moved on with a compare-and-set on its version. A crash in between
  leaves the tick due, and the next scheduler's enqueue finds the same run; of schedulers
  racing for one tick, every enqueue lands on one run and one compare-and-set wins.

The workers run the scheduler loop (`Worker`), each for the schedules whose task it serves:
`Schedules.declare` once, then `Schedules.run_due` every poll interval.
"""

from __future__ import annotations

import builtins
import collections
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, Protocol, TypeVar
from uuid import UUID

from attrs import evolve, frozen

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._cron import CronSpec, tick_key
from umt_sdk._spi import (
    TERMINAL_STATUSES,
    Backend,
    CancelOutcome,
    OverlapPolicy,
    ScheduleQuery,
    ScheduleRecord,
    ScheduleState,
    ScheduleStore,
)
from umt_sdk._task import Registry, Schedule, TaskDefinition, check_schedule_name
from umt_sdk.exceptions import (
    BackendError,
    ScheduleNotFoundError,
    UnknownTaskError,
    UsageError,
)

__all__ = [
    "MAX_TICKS_AT_ONCE",
    "ScheduleInfo",
    "Schedules",
    "TickReport",
    "scheduler_enqueue",
]


class Started(Protocol):
    """What starting a tick's run gives back (the engine's `RunHandle`)."""

    @property
    def run_id(self) -> UUID: ...


H = TypeVar("H", bound=Started)

_log = logging.getLogger("umt.schedules")

MAX_TICKS_AT_ONCE = 10_000
"""The most runs one catch-up or one backfill starts (a catch-up keeps the newest)."""

_CAS_TRIES = 20
_WALK_STEPS = 1000
"""Due ticks are walked one by one up to this many; past it (a long downtime), the scheduler
jumps to the ticks around now instead."""

scheduler_enqueue: ContextVar[bool] = ContextVar("umt_scheduler_enqueue", default=False)
"""Set while a schedule enqueues: only then may an idempotency key be a tick's key."""


@frozen(kw_only=True)
class ScheduleInfo:
    """A stored schedule: its definition and where it stands. Times are UTC."""

    name: str
    task_name: str
    cron: str
    timezone: str
    input: Any
    """The input of its runs, as JSON (dicts, lists, ...)."""
    overlap: OverlapPolicy
    catchup_window: timedelta
    paused: bool
    next_tick: datetime
    """The next tick to handle (once the clock reaches it, unless paused)."""
    last_tick: datetime | None
    """The newest tick handled: started, skipped or buffered."""
    last_run_id: UUID | None
    """The newest run the schedule started."""
    buffered_tick: datetime | None
    """Under `buffer_one`: the tick that starts when the previous run ends."""
    created_at: datetime
    updated_at: datetime
    version: int

    @classmethod
    def of(cls, record: ScheduleRecord) -> ScheduleInfo:
        state = record.state
        return cls(
            name=state.name,
            task_name=state.task_name,
            cron=state.cron,
            timezone=state.timezone,
            input=json.loads(state.input_json),
            overlap=state.overlap,
            catchup_window=state.catchup_window,
            paused=state.paused,
            next_tick=state.next_tick,
            last_tick=state.last_tick,
            last_run_id=state.last_run_id,
            buffered_tick=state.buffered_tick,
            created_at=record.created_at,
            updated_at=record.updated_at,
            version=record.version,
        )


@frozen(kw_only=True)
class TickReport:
    """What one pass of the scheduler did (`Schedules.run_due`)."""

    started: int = 0
    """Runs it enqueued (found already made by a racing scheduler included)."""
    skipped: int = 0
    """Due ticks that started nothing: the previous run was still going (`skip`), or a newer
    tick replaced a buffered one (`buffer_one`)."""
    buffered: int = 0
    """Due ticks kept for when the previous run ends (`buffer_one`)."""
    canceled: int = 0
    """Previous runs whose cancel it requested (`cancel_previous`)."""
    lost_races: int = 0
    """Schedules another scheduler moved on first (their runs are the same: by key)."""

    def __add__(self, other: TickReport) -> TickReport:
        return TickReport(
            started=self.started + other.started,
            skipped=self.skipped + other.skipped,
            buffered=self.buffered + other.buffered,
            canceled=self.canceled + other.canceled,
            lost_races=self.lost_races + other.lost_races,
        )


class Schedules(Generic[H]):
    """`engine.schedules`: create, read, pause, resume, delete, trigger and backfill schedules,
    and the scheduler's own pass (`run_due`) that the workers run.

    `H` is what starting a run gives back: the engine's `RunHandle[Any]`."""

    def __init__(
        self,
        *,
        backend: Backend,
        registry: Registry,
        start: Callable[[TaskDefinition[Any, Any], Any, str], Awaitable[H]],
        # How the engine starts the run of a tick: (definition, input as JSON, the tick's key).
        cancel: Callable[[UUID, str], Awaitable[CancelOutcome]],
    ) -> None:
        self._backend = backend
        self._registry = registry
        self._start_run = start
        self._cancel = cancel
        self._supported: bool | None = None

    # -- the store --------------------------------------------------------------------------

    @property
    def supported(self) -> bool:
        """Whether the engine's backend stores schedules (`umt_sdk.backend.ScheduleStore`)."""
        if self._supported is None:  # a protocol's isinstance is slow: ask once
            self._supported = isinstance(self._backend, ScheduleStore)
        return self._supported

    def _store(self) -> ScheduleStore:
        backend = self._backend
        if not self.supported:
            raise UsageError(
                f"the backend {type(backend).__name__} does not store schedules (it does not "
                "implement umt_sdk.backend.ScheduleStore); use the memory or Postgres backend, "
                "or add the five schedule methods to it"
            )
        return backend  # type: ignore[return-value]  # checked by `supported`

    def _now(self) -> datetime:
        clock = self._backend.clock
        return clock.now() if clock is not None else datetime.now(UTC)

    async def _record(self, name: str) -> ScheduleRecord:
        check_schedule_name(name, where="schedules")
        record = await self._store().get_schedule(name)
        if record is None:
            raise ScheduleNotFoundError(
                f"no schedule named {name!r} (engine.schedules.list() shows them)",
                schedule_name=name,
            )
        return record

    def _definition(self, task_name: str, *, schedule: str) -> TaskDefinition[Any, Any]:
        try:
            return self._registry.latest(task_name)
        except UnknownTaskError as exc:
            raise UnknownTaskError(
                f"schedule {schedule!r}: its task {task_name!r} is not registered in this "
                f"engine's registry ({exc}); add the @task definition to Registry([...])",
                task_name=task_name,
            ) from None

    async def _change(self, name: str, change: Any, *, what: str) -> ScheduleRecord:
        """Apply `change(record) -> new state` with compare-and-set, again on a lost race."""
        store = self._store()
        for _ in range(_CAS_TRIES):
            record = await self._record(name)
            state = change(record)
            if state == record.state:
                return record
            if await store.update_schedule(state, expected_version=record.version):
                return await self._record(name)
        raise BackendError(
            f"could not {what} schedule {name!r}: it changed under every one of {_CAS_TRIES} "
            "tries; try again"
        )

    # -- managing ----------------------------------------------------------------------------

    async def create(self, schedule: Schedule[Any]) -> ScheduleInfo:
        """Store `schedule`, or bring the stored one of that name up to it; idempotent.

        A schedule that exists keeps where it stands (paused or not, its last run, its next
        tick); only what the declaration changed is written. When the cron expression or the
        time zone changes, the next tick is recomputed from now with the new expression:
        ticks of the old one that were due are not started, and no tick of the new one in
        the past is caught up. A `UsageError` names what is wrong (an unregistered task, an
        input that does not fit it).
        """
        if not isinstance(schedule, Schedule):
            check.refuse(
                "schedule",
                "a Schedule(name=..., task=..., cron=..., input=...)",
                schedule,
                where="schedules.create()",
            )
        definition = self._definition(schedule.task_name, schedule=schedule.name)
        input_json, _ = _serde.encode_input(
            schedule.input, definition.input_type, what=f"input of schedule {schedule.name!r}"
        )
        spec = schedule._spec
        store = self._store()
        for _ in range(_CAS_TRIES):
            record = await store.get_schedule(schedule.name)
            if record is None:
                state = ScheduleState(
                    name=schedule.name,
                    task_name=definition.name,
                    cron=spec.expression,
                    timezone=spec.timezone,
                    input_json=input_json,
                    overlap=schedule.overlap,
                    catchup_window=schedule.catchup_window,
                    paused=schedule.paused,
                    next_tick=spec.next_after(self._now()),
                )
                if await store.create_schedule(state):
                    return ScheduleInfo.of(await self._record(schedule.name))
                continue
            current = record.state
            same_input = json.loads(current.input_json) == json.loads(input_json)
            state = evolve(
                current,
                task_name=definition.name,
                cron=spec.expression,
                timezone=spec.timezone,
                input_json=current.input_json if same_input else input_json,
                overlap=schedule.overlap,
                catchup_window=schedule.catchup_window,
            )
            if (current.cron, current.timezone) != (spec.expression, spec.timezone):
                state = evolve(state, next_tick=spec.next_after(record.observed_at))
            if state == current:
                return ScheduleInfo.of(record)
            if await store.update_schedule(state, expected_version=record.version):
                return ScheduleInfo.of(await self._record(schedule.name))
        raise BackendError(
            f"could not store schedule {schedule.name!r}: it changed under every one of "
            f"{_CAS_TRIES} tries; try again"
        )

    async def declare(self, *, task_names: Iterable[str] | None = None) -> list[ScheduleInfo]:
        """Store every schedule of the registry (of these tasks only, when given): what each
        worker does when it starts. Idempotent (see `create`)."""
        wanted = None if task_names is None else set(task_names)
        return [
            await self.create(schedule)
            for schedule in self._registry.schedules()
            if wanted is None or schedule.task_name in wanted
        ]

    async def get(self, name: str) -> ScheduleInfo:
        """The schedule `name` (`ScheduleNotFoundError` when there is none)."""
        return ScheduleInfo.of(await self._record(name))

    async def list(self, *, task_name: str | None = None) -> builtins.list[ScheduleInfo]:
        """Every stored schedule (of `task_name` only, when given), by name."""
        if task_name is not None:
            check.text(task_name, "task_name", expected="a task name (a string) or None")
        query = ScheduleQuery(task_names=None if task_name is None else [task_name])
        return [ScheduleInfo.of(r) for r in await self._store().list_schedules(query)]

    async def pause(self, name: str) -> ScheduleInfo:
        """Stop starting runs; ticks that pass while paused are not run later."""
        record = await self._change(name, lambda r: evolve(r.state, paused=True), what="pause")
        return ScheduleInfo.of(record)

    async def resume(self, name: str) -> ScheduleInfo:
        """Start runs again from the next tick after now (the ticks missed while paused are
        not caught up)."""

        def resumed(record: ScheduleRecord) -> ScheduleState:
            state = record.state
            if not state.paused:
                return state
            next_tick = state.next_tick
            if next_tick <= record.observed_at:
                spec = CronSpec.parse(state.cron, state.timezone)
                next_tick = spec.next_after(record.observed_at)
            return evolve(state, paused=False, next_tick=next_tick)

        return ScheduleInfo.of(await self._change(name, resumed, what="resume"))

    async def delete(self, name: str) -> bool:
        """Delete the schedule (its runs stay); False when there was none. A schedule still
        declared in a registry is stored again by the next worker that starts."""
        check_schedule_name(name, where="schedules.delete()")
        return await self._store().delete_schedule(name)

    async def trigger(self, name: str) -> H:
        """Start a run of the schedule now, whatever its overlap policy and even when paused;
        `ctx.scheduled_at` reads the time of the trigger (whole seconds). It becomes the
        schedule's previous run, which later ticks' overlap policy looks at."""
        record = await self._record(name)
        definition = self._definition(record.state.task_name, schedule=name)
        tick = record.observed_at.astimezone(UTC).replace(microsecond=0)
        handle = await self._start(record.state, tick, definition)
        await self._change(
            name, lambda r: evolve(r.state, last_run_id=handle.run_id), what="trigger"
        )
        return handle

    async def backfill(self, name: str, start: datetime, end: datetime) -> builtins.list[H]:
        """Start a run for every tick in [`start`, `end`) that has none yet (by its key, a
        tick that already ran is not run again), whatever the overlap policy; the schedule
        itself does not move. At most `MAX_TICKS_AT_ONCE` ticks at once."""
        check.aware_datetime(start, "start", where="schedules.backfill()")
        check.aware_datetime(end, "end", where="schedules.backfill()")
        if end <= start:
            raise UsageError(
                f"schedules.backfill(): end ({end.isoformat()}) must be after start "
                f"({start.isoformat()})",
                argument="end",
            )
        record = await self._record(name)
        state = record.state
        definition = self._definition(state.task_name, schedule=name)
        spec = CronSpec.parse(state.cron, state.timezone)
        ticks = [t for t in spec.between(start, end, limit=MAX_TICKS_AT_ONCE + 1) if t < end]
        if len(ticks) > MAX_TICKS_AT_ONCE:
            raise UsageError(
                f"schedules.backfill(): [{start.isoformat()}, {end.isoformat()}) holds more "
                f"than {MAX_TICKS_AT_ONCE} ticks of {state.cron!r}; backfill a shorter range at "
                "a time",
                argument="end",
            )
        return [await self._start(state, tick, definition) for tick in ticks]

    # -- the scheduler ----------------------------------------------------------------------

    async def run_due(self, *, task_names: Iterable[str] | None = None) -> TickReport:
        """One pass of the scheduler: start the runs of every due tick of the schedules of
        `task_names` (every registered task when None), and move each schedule on.

        The workers call it every poll interval; call it yourself to drive schedules from a
        loop of your own, or in a test on a `FakeClock`. Safe to run from any number of
        processes at once: each tick makes one run (see the module docstring).
        """
        names = sorted({d.name for d in self._registry} if task_names is None else set(task_names))
        if not names:
            return TickReport()
        records = await self._store().list_schedules(ScheduleQuery(task_names=names, due_only=True))
        report = TickReport()
        for record in records:
            report += await self._handle(record)
        return report

    async def _unfinished(self, run_id: UUID | None) -> bool:
        if run_id is None:
            return False
        head = await self._backend.get_run_head(run_id)
        return head is not None and head.status not in TERMINAL_STATUSES

    async def _handle(self, record: ScheduleRecord) -> TickReport:
        state = record.state
        now = record.observed_at
        if state.paused:
            return TickReport()
        definition = self._definition(state.task_name, schedule=state.name)
        spec = CronSpec.parse(state.cron, state.timezone, where=f"schedule {state.name!r}")
        policy = state.overlap
        previous = state.last_run_id
        running = policy != "allow_all" and await self._unfinished(previous)
        buffered, last_tick, next_tick = state.buffered_tick, state.last_tick, state.next_tick
        started = skipped = kept = canceled = 0
        if buffered is not None and not running:
            previous = (await self._start(state, buffered, definition)).run_id
            buffered, running, started = None, policy != "allow_all", started + 1
        if next_tick <= now:
            due, next_tick = self._due_ticks(spec, state, now)
            for tick in due:
                last_tick = tick
                if running and policy == "skip":
                    skipped += 1
                    continue
                if running and policy == "buffer_one":
                    skipped += buffered is not None
                    buffered, kept = tick, kept + 1
                    continue
                if running and policy == "cancel_previous" and previous is not None:
                    await self._cancel(
                        previous,
                        f"schedule {state.name!r}: the tick of {tick.isoformat()} replaces it",
                    )
                    canceled += 1
                previous = (await self._start(state, tick, definition)).run_id
                running, started = policy != "allow_all", started + 1
        moved = evolve(
            state,
            next_tick=next_tick,
            last_tick=last_tick,
            last_run_id=previous,
            buffered_tick=buffered,
        )
        won = moved == state or await self._store().update_schedule(
            moved, expected_version=record.version
        )
        return TickReport(
            started=started,
            skipped=skipped,
            buffered=kept,
            canceled=canceled,
            lost_races=0 if won else 1,
        )

    @staticmethod
    def _due_ticks(
        spec: CronSpec, state: ScheduleState, now: datetime
    ) -> tuple[builtins.list[datetime], datetime]:
        """The ticks to handle now (the last one due, and those within the catch-up window),
        and the first tick after now (the schedule's next)."""
        window_start = now - max(state.catchup_window, timedelta(0))
        recent: collections.deque[datetime] = collections.deque(maxlen=MAX_TICKS_AT_ONCE)
        latest: datetime | None = None
        for steps, tick in enumerate(spec.walk_from(state.next_tick)):
            if tick > now:
                if latest is not None and (not recent or recent[-1] != latest):
                    recent.append(latest)
                return builtins.list(recent), tick
            if steps >= _WALK_STEPS:  # a long downtime: jump to now instead of walking there
                break
            latest = tick
            if tick >= window_start:
                recent.append(tick)
        recent.clear()
        recent.extend(spec.between(max(state.next_tick, window_start), now, limit=2**62))
        latest = spec.last_at_or_before(now)
        if not recent or recent[-1] != latest:
            recent.append(latest)
        return builtins.list(recent), spec.next_after(now)

    async def _start(
        self, state: ScheduleState, tick: datetime, definition: TaskDefinition[Any, Any]
    ) -> H:
        """Start the run of `tick` under its key: made once, whoever asks."""
        return await self._start_run(
            definition, json.loads(state.input_json), tick_key(state.name, tick)
        )
