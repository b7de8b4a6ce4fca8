"""The engine: the client API (enqueue, signal, cancel, get, list, result) and worker factory."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar, get_args, overload
from uuid import UUID

from attrs import field, frozen
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._attention import ATTENTION_FACT_PREFIX, Settlement, settle_run
from umt_sdk._callbacks import CALLBACK_FACT_PREFIX, find_minted, parse_token
from umt_sdk._check import shown
from umt_sdk._codec import PayloadCodec, check_codec
from umt_sdk._codec_backend import codec_of, wrap_backend
from umt_sdk._concurrency import apply_strategy, key_fields
from umt_sdk._cron import TICK_KEY_PREFIX
from umt_sdk._event_list import EventInfo, list_events
from umt_sdk._event_spi import EventRefusal, EventStore
from umt_sdk._events import (
    DEFAULT_EVENT_WINDOW,
    EVENT_KEY_PREFIX,
    EventStarter,
    check_event_name,
    check_window,
    event_run,
    event_store,
    new_event,
    subscribers,
)
from umt_sdk._export import RunHistory, history_of
from umt_sdk._fairness import FAIR_SLOTS, fairness_fields
from umt_sdk._flow_keys import Debounce, Singleton, flow_key_fields, per_input
from umt_sdk._handlers import known
from umt_sdk._ids import new_run_id
from umt_sdk._insight import (
    TaskStats,
    WorkerInfo,
    insight_store,
    store_now,
    task_stats,
    worker_infos,
)
from umt_sdk._lifecycle import (
    CHILD_KEY_PREFIX,
    MAP_KEY_PREFIX,
    ForkPlan,
    children_of,
    lifecycle_store,
    pause_target,
    plan_fork,
    restartable,
)
from umt_sdk._names import check_name, check_type_argument
from umt_sdk._plugins import PluginHost
from umt_sdk._rate_limits import RateLimits, ensure_defined, rate_limit_fields
from umt_sdk._retention import (
    DEFAULT_BATCH_SIZE,
    Pruner,
    PruneReport,
    RetentionPolicy,
    check_retention,
    check_tags,
    missing_run,
    retention_store,
)
from umt_sdk._schedules import Schedules, scheduler_enqueue
from umt_sdk._spi import (
    TERMINAL_STATUSES,
    Backend,
    BatchEnqueueStore,
    CancelOutcome,
    Clock,
    EnqueueResult,
    KeyUsage,
    NewRun,
    PausedTask,
    RetentionStore,
    RunQuery,
    RunRecord,
    RunStatus,
    TaskPair,
)
from umt_sdk._streams import StreamItem, follow_stream, heads_by_run, item_of, stream_store
from umt_sdk._task import Registry, TaskDefinition
from umt_sdk._telemetry import Telemetry
from umt_sdk._updates import QUERY_STATE_STREAM, UPDATE_FACT_PREFIX, send_update
from umt_sdk._views import RunInfo, RunPage, build_run_info
from umt_sdk._worker import Worker
from umt_sdk.exceptions import (
    BackendError,
    CallbackTokenError,
    IdempotencyConflictError,
    ResultTimeoutError,
    RunCanceledError,
    RunCompensatedError,
    RunFailedError,
    RunNotFoundError,
    UpdateFailedError,
    UsageError,
)

__all__ = ["Engine", "RunHandle", "connect", "new_run_id"]

I = TypeVar("I")
O = TypeVar("O")

_STATUSES: frozenset[str] = frozenset(get_args(RunStatus))


_RESERVED_KEYS = {
    CHILD_KEY_PREFIX: "name the children that ctx.step.start_child starts (the parent run and "
    "the step name make the key); start a child with ctx.step.start_child",
    MAP_KEY_PREFIX: "name the children that ctx.step.map starts (the parent run, the step name "
    "and the input's index make the key); fan out with ctx.step.map",
    EVENT_KEY_PREFIX: "name the runs an event starts (the event makes the key); start them "
    "with engine.publish",
}
"""The idempotency-key prefixes umt makes for runs it starts itself, and why: a caller's key
with one of them could take a child's place (the parent would adopt the caller's run)."""


def _refuse_reserved_key(key: str) -> None:
    """Refuse an `enqueue` key that umt makes itself: children's, and a schedule tick's (unless
    the scheduler is the caller)."""
    if key.startswith(TICK_KEY_PREFIX) and not scheduler_enqueue.get():
        raise UsageError(
            f"idempotency_key {key!r}: keys starting with {TICK_KEY_PREFIX!r} name the ticks of "
            "schedules and are made by umt only; use another key, or "
            "engine.schedules.trigger/backfill to start a schedule's run",
            argument="idempotency_key",
        )
    for prefix, why in _RESERVED_KEYS.items():
        if key.startswith(prefix):
            raise UsageError(
                f"idempotency_key {key!r}: keys starting with {prefix!r} are reserved by umt: "
                f"they {why}; use a key of your own without that prefix",
                argument="idempotency_key",
            )


def _refuse_child_fact(name: str) -> None:
    """Refuse a fact name umt stores itself: a child's ending tells its parent with the fact
    `umt.child:<child id>`, and a fact sent under that name would wake the parent as if the
    child had finished; a callback's fact (`umt.callback:<step>`) is stored only by
    `complete_callback`, with the token."""
    if name.startswith(UPDATE_FACT_PREFIX):
        raise UsageError(
            f"fact name {name!r}: names starting with {UPDATE_FACT_PREFIX!r} are reserved by "
            "umt (an update is sent with engine.update(run_id, name, arg))",
            argument="name",
        )
    if name.startswith(CALLBACK_FACT_PREFIX):
        raise UsageError(
            f"fact name {name!r}: names starting with {CALLBACK_FACT_PREFIX!r} are reserved by "
            "umt (a callback is completed with engine.complete_callback(token, payload))",
            argument="name",
        )
    if name.startswith(ATTENTION_FACT_PREFIX):
        raise UsageError(
            f"fact name {name!r}: names starting with {ATTENTION_FACT_PREFIX!r} are reserved by "
            "umt (a step that needs attention is settled with engine.settle(...))",
            argument="name",
        )
    if name.startswith(CHILD_KEY_PREFIX):
        raise UsageError(
            f"fact name {name!r}: names starting with {CHILD_KEY_PREFIX!r} are reserved by umt "
            "(a child's ending stores one for its parent); use a name of your own",
            argument="name",
        )


def _check_run_id(run_id: object, call: str) -> UUID:
    """A run id must be a UUID: None (a failed lookup, say) never means "every run"."""
    if isinstance(run_id, UUID):
        return run_id
    hint = ""
    if run_id is None and call == "signal":
        hint = "; to send a fact to every run that waits for it, use engine.broadcast(name, ...)"
    elif isinstance(run_id, str):
        hint = "; convert text with uuid.UUID(text)"
    raise UsageError(
        f"{call}() needs a run id (a uuid.UUID such as handle.run_id), got {shown(run_id)}{hint}",
        argument="run_id",
    )


@frozen(kw_only=True)
class RunHandle(Generic[O]):
    """A run that `enqueue` stored (`created`) or found under its idempotency key."""

    run_id: UUID
    task_name: str
    task_version: int
    created: bool
    _engine: Engine = field(repr=False, eq=False, alias="engine")
    _output_type: Any = field(repr=False, eq=False, default=Any, alias="output_type")

    @property
    def id(self) -> UUID:
        return self.run_id

    async def result(self, *, timeout: float | None = None) -> O:
        """Wait for the run to finish and return its output (see `Engine.result`)."""
        # The definition's output type, checked when it was decorated.
        value: O = await self._engine._result(
            self.run_id, timeout=timeout, output_type=self._output_type
        )
        return value

    async def update(self, name: str, arg: Any = None, *, timeout: float | None = None) -> Any:
        """Send the run the update `name` and return its handler's result (see
        `Engine.update`)."""
        return await self._engine.update(self.run_id, name, arg, timeout=timeout)

    async def query(self, name: str) -> Any:
        """The answer of the run's query `name` (see `Engine.query`)."""
        return await self._engine.query(self.run_id, name)


@frozen(kw_only=True)
class PublishedEvent:
    """What `engine.publish` did: the event's id, whether this call stored it, and the runs
    it started (one per subscriber the publishing engine knows; empty for a repeat)."""

    event_id: UUID
    name: str
    key: str
    created: bool
    runs: tuple[RunHandle[Any], ...] = ()


class Engine:
    """The client of one backend. Build it with `await connect(url, registry=...)`."""

    def __init__(
        self,
        backend: Backend,
        registry: Registry,
        *,
        telemetry: Telemetry | None = None,
        retention: timedelta | None = None,
        idempotency_retention: timedelta | None = None,
        event_window: timedelta = DEFAULT_EVENT_WINDOW,
    ) -> None:
        self.backend = backend
        self.event_window = check_window(event_window, "event_window")
        """How long a published event waits for subscribers registered after it."""
        self.registry = registry
        self.telemetry = telemetry or Telemetry()
        self.retention = RetentionPolicy.build(
            registry,
            default=check_retention(retention, "retention"),
            idempotency=check_retention(idempotency_retention, "idempotency_retention"),
        )
        """What the workers delete, and when (`connect(retention=...)`, `@task(retention=)`)."""
        if self.retention.default is not None or self.retention.idempotency is not None:
            retention_store(backend, "connect(retention=...)")
        self._workers: list[Worker] = []
        self.schedules: Schedules[RunHandle[Any]] = Schedules(
            backend=backend, registry=registry, start=self._start_tick, cancel=self._cancel_for
        )
        """Create, list, pause, resume, delete, trigger and backfill schedules."""
        self.rate_limits = RateLimits(backend)
        """Set, read, list, pause and resume the stored rate limits (`RateLimit`)."""

    @property
    def codec(self) -> PayloadCodec | None:
        """The codec every stored payload passes through (`connect(..., codec=...)`), or None."""
        return codec_of(self.backend)

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the workers this engine made and close the backend."""
        for worker in self._workers:
            await worker.stop()
        self._workers.clear()
        await self.backend.close()

    # -- producing --------------------------------------------------------------------------

    @overload
    async def enqueue(
        self,
        task: TaskDefinition[I, O],
        input: I | Mapping[str, Any],
        *,
        idempotency_key: str | None = None,
        priority: int = 0,
        delay: timedelta | None = None,
        version: int | None = None,
        conn: Any = None,
        tags: Mapping[str, str] | None = None,
        deadline: datetime | timedelta | None = None,
        start_within: timedelta | None = None,
        singleton: Singleton | None = None,
        debounce: Debounce | None = None,
        sequence: str | None = None,
        fairness_key: str | None = None,
        weight: int | None = None,
    ) -> RunHandle[O]: ...
    @overload
    async def enqueue(
        self,
        task: str,
        input: Any,
        *,
        idempotency_key: str | None = None,
        priority: int = 0,
        delay: timedelta | None = None,
        version: int | None = None,
        conn: Any = None,
        tags: Mapping[str, str] | None = None,
        deadline: datetime | timedelta | None = None,
        start_within: timedelta | None = None,
        singleton: Singleton | None = None,
        debounce: Debounce | None = None,
        sequence: str | None = None,
        fairness_key: str | None = None,
        weight: int | None = None,
    ) -> RunHandle[Any]: ...
    async def enqueue(
        self,
        task: TaskDefinition[Any, Any] | str,
        input: Any,
        *,
        idempotency_key: str | None = None,
        priority: int = 0,
        delay: timedelta | None = None,
        version: int | None = None,
        conn: Any = None,
        tags: Mapping[str, str] | None = None,
        deadline: datetime | timedelta | None = None,
        start_within: timedelta | None = None,
        singleton: Singleton | None = None,
        debounce: Debounce | None = None,
        sequence: str | None = None,
        fairness_key: str | None = None,
        weight: int | None = None,
    ) -> RunHandle[Any]:
        """Start a run of `task` (the newest registered version unless `version` pins one).

        Args:
            input: an instance of the task's input type, or its JSON form (a dict). It is
                checked before anything is stored; a field that does not fit raises
                `PayloadError` naming it.
            idempotency_key: the same key with the same input returns the existing run; with a
                different input, or for another version of the task than the run it names,
                raises `IdempotencyConflictError` (the handle would misstate the run's version
                and output type). Keys are per task name and never expire silently: a key
                whose run retention deleted still names that run (`RunPrunedError` on its
                result) until its tombstone is dropped (`connect(idempotency_retention=)`).
            priority: higher runs first (-32768..32767); FIFO among equals.
            delay: do not start before this much time has passed.
            deadline: when the run must be finished by: a timezone-aware datetime, or a
                timedelta from now (the backend's clock). Past it the run ends `failed` with
                `DeadlineExceededError`, whatever it is doing; the task's own `timeout`, if
                earlier, wins. None: only the task's timeout.
            start_within: how long after it becomes claimable (now, plus `delay`) the run may
                still start: a run not claimed by then ends `failed` with
                `StartDeadlineExceededError` without running. None: no limit.
            conn: the caller's open database transaction: the run exists if and only if it
                commits (backends that support it).
            tags: labels to find the run by (`list(tags={"tenant": "t7"})`): at most 16 keys
                of letters, digits and `_.:-/`, text values of at most 256 characters.
            singleton: `Singleton(key, mode)`: while a run of the key is active (not
                terminal), `"skip"` stores nothing and returns its handle (`created=False`);
                `"replace"` cancels it and stores this run, which starts once it stopped.
            debounce: `Debounce(key, period, max_wait)`: a burst of triggers within `period`
                of each other makes one run, with the last input, started `period` after the
                last trigger and at the latest `max_wait` after the first (`created=False`
                for the triggers that joined the run).
            sequence: a key: the runs of the task with this key start one at a time, in
                enqueue order (each once the one before it has ended, or waits out a retry
                backoff).
            fairness_key: the run's tenant (or any key): the task's keys take turns in the
                claim, least recently served first, so one key's backlog delays another
                key's run by one turn at most. Runs without a key are ordered as usual.
            weight: how many runs of `fairness_key` one turn takes (1 to 1000, default 1):
                its share while keys have a backlog. Needs `fairness_key`.

        Only one of `singleton`, `debounce` and `sequence` per enqueue, and `singleton` and
        `sequence` not on a task with `concurrency=` (they make the run's concurrency key);
        `fairness_key` with none of the three (a run has one key).

        An argument it refuses (a priority out of range, a negative delay, a `conn` the
        backend cannot join) raises `UsageError` naming it, before anything is stored.
        """
        if not isinstance(task, TaskDefinition | str):
            check.refuse(
                "task", "a @task definition or a task name ('name' or 'name@version')", task
            )
        if version is not None:
            check.integer(version, "version", at_least=1, expected="an integer >= 1 or None")
        definition = self.registry.resolve(task, version)
        check.integer(priority, "priority", at_least=-32768, at_most=32767)
        if idempotency_key is not None:
            check.text(idempotency_key, "idempotency_key", empty=False, max_length=512)
            _serde.check_text(idempotency_key, what="idempotency_key")
            _refuse_reserved_key(idempotency_key)
        if delay is not None:
            check.duration(delay, "delay")
        run_tags = check_tags(tags)
        deadline_at, timeout = _deadline(deadline, definition.timeout)
        if start_within is not None:
            check.duration(
                start_within,
                "start_within",
                positive=True,
                expected="a timedelta > 0 such as timedelta(minutes=5), or None",
            )
        input_json, input_hash = _serde.encode_input(input, definition.input_type, what="input")
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
        flow = flow_key_fields(
            task_name=definition.name,
            concurrency=definition.concurrency,
            singleton=singleton,
            debounce=debounce,
            sequence=sequence,
            idempotency_key=idempotency_key,
            delay=delay,
            start_within=start_within,
            conn=conn,
        )
        delay = flow.pop("delay", delay)
        fair = fairness_fields(
            task_name=definition.name,
            fairness_key=fairness_key,
            weight=weight,
            concurrency=definition.concurrency,
            flow=flow,
        )
        if definition.rate_limit is not None:
            await ensure_defined(self.backend, definition.rate_limit, "enqueue()")
        strategy = definition.concurrency.strategy if definition.concurrency else "queue"
        if conn is not None and strategy != "queue":
            raise UsageError(
                f"task {definition.name!r} has concurrency strategy {strategy!r}, which "
                "cancels other runs of the key once the new run is stored: enqueue it without "
                "conn= (the strategy cannot wait for your transaction to commit)",
                argument="conn",
            )
        run_id = new_run_id()
        attributes = {
            **Telemetry.task_attributes(definition.name, definition.version),
            "messaging.operation.type": "send",
            "messaging.destination.name": definition.name,
            "umt.priority": priority,
        }
        with self.telemetry.producer_span(f"umt.enqueue {definition.name}", attributes) as span:
            new = NewRun(
                run_id=run_id,
                task_name=definition.name,
                task_version=definition.version,
                input_json=input_json,
                input_hash=input_hash,
                priority=priority,
                idempotency_key=idempotency_key,
                delay=delay,
                trace_context=self.telemetry.inject(),
                tags=run_tags,
                **keyed,
                **limited,
                **flow,
                **fair,
                deadline_at=deadline_at,
                timeout=timeout,
                start_within=start_within,
            )
            result = await self.backend.enqueue(new, conn=conn)
            # On the caller's transaction the run exists only if that commits, which the SDK
            # never sees: such an enqueue is counted and traced as a request, not as a run.
            transaction = "own" if conn is None else "caller"
            if span.is_recording():
                span.set_attribute("umt.enqueue.transaction", transaction)
                span.set_attribute("umt.run.id", str(result.run_id))
                span.set_attribute("messaging.message.id", str(result.run_id))
                span.set_attribute(
                    "umt.run.created" if conn is None else "umt.run.created_if_committed",
                    result.created,
                )
            task_attributes = Telemetry.task_attributes(definition.name, definition.version)
            self.telemetry.enqueue_requests.add(
                1, {**task_attributes, "umt.enqueue.transaction": transaction}
            )
            if not result.created and not (result.skipped or result.debounced):
                self._check_key_input(result, new)
                await self._check_key_version(result, definition, idempotency_key)
        if result.created and conn is None:
            self.telemetry.runs_enqueued.add(1, task_attributes)
            if new.concurrency_key is not None:
                await apply_strategy(
                    self.backend,
                    definition.concurrency,
                    task_name=definition.name,
                    run_id=result.run_id,
                    key=new.concurrency_key,
                )
            for replaced in result.replaced:
                await self.backend.cancel(
                    replaced,
                    reason=f"singleton key {new.concurrency_key!r} replaced by run {run_id}",
                )
        if result.skipped and result.task_version not in (None, definition.version):
            # The active run is of another version: the handle says so, with its output type.
            pair = TaskPair(name=definition.name, version=result.task_version)
            found = {d.pair: d for d in self.registry}.get(pair)
            return RunHandle(
                run_id=result.run_id,
                task_name=definition.name,
                task_version=result.task_version,
                created=False,
                engine=self,
                output_type=Any if found is None else found.output_type,
            )
        return RunHandle(
            run_id=result.run_id,
            task_name=definition.name,
            task_version=definition.version,
            created=result.created,
            engine=self,
            output_type=definition.output_type,
        )

    @overload
    async def enqueue_many(
        self,
        task: TaskDefinition[I, O],
        inputs: Iterable[I | Mapping[str, Any]],
        *,
        idempotency_keys: Sequence[str | None] | None = None,
        priority: int = 0,
        delay: timedelta | None = None,
        version: int | None = None,
        conn: Any = None,
        tags: Mapping[str, str] | None = None,
        deadline: datetime | timedelta | None = None,
        start_within: timedelta | None = None,
        singleton: Singleton | Sequence[Singleton | None] | None = None,
        debounce: Debounce | Sequence[Debounce | None] | None = None,
        sequence: str | Sequence[str | None] | None = None,
        fairness_key: str | Sequence[str | None] | None = None,
        weight: int | Sequence[int | None] | None = None,
    ) -> list[RunHandle[O]]: ...
    @overload
    async def enqueue_many(
        self,
        task: str,
        inputs: Iterable[Any],
        *,
        idempotency_keys: Sequence[str | None] | None = None,
        priority: int = 0,
        delay: timedelta | None = None,
        version: int | None = None,
        conn: Any = None,
        tags: Mapping[str, str] | None = None,
        deadline: datetime | timedelta | None = None,
        start_within: timedelta | None = None,
        singleton: Singleton | Sequence[Singleton | None] | None = None,
        debounce: Debounce | Sequence[Debounce | None] | None = None,
        sequence: str | Sequence[str | None] | None = None,
        fairness_key: str | Sequence[str | None] | None = None,
        weight: int | Sequence[int | None] | None = None,
    ) -> list[RunHandle[Any]]: ...
    async def enqueue_many(
        self,
        task: TaskDefinition[Any, Any] | str,
        inputs: Iterable[Any],
        *,
        idempotency_keys: Sequence[str | None] | None = None,
        priority: int = 0,
        delay: timedelta | None = None,
        version: int | None = None,
        conn: Any = None,
        tags: Mapping[str, str] | None = None,
        deadline: datetime | timedelta | None = None,
        start_within: timedelta | None = None,
        singleton: Singleton | Sequence[Singleton | None] | None = None,
        debounce: Debounce | Sequence[Debounce | None] | None = None,
        sequence: str | Sequence[str | None] | None = None,
        fairness_key: str | Sequence[str | None] | None = None,
        weight: int | Sequence[int | None] | None = None,
    ) -> list[RunHandle[Any]]:
        """Start one run of `task` per input, stored in one write (one statement on Postgres).

        The outcome is that of `enqueue` called once per input, in order, with the same
        arguments (`idempotency_keys[i]` the key of `inputs[i]`; None: no key): one handle per
        input, in order. A key that names a stored run, or a key given twice in the batch,
        gives that run's handle (`created=False`); a key whose run holds a different input or
        another version raises `IdempotencyConflictError`. Every input and key is checked
        before anything is stored, and a key given twice with different inputs is refused
        then; a conflict with an already stored run is found by the store's write, so the
        batch's other runs are stored when it is raised (without `conn`). With `conn`, the
        runs exist if and only if the caller's transaction commits.

        Runs of one batch are claimed in the order given among equal priorities.

        `singleton`, `debounce`, `sequence`, `fairness_key` and `weight` take one value for
        every input, or a list with one per input (None: none for that input), each checked as
        `enqueue` checks it (with the input's idempotency key, `delay`, `start_within` and
        `conn`) before anything is stored. `sequence` and fairness keys are stored in the
        batch's one write, so a batch's runs of one sequence key start one at a time in the
        order given. A batch with a singleton or a debounce is
        stored one `enqueue` per input, in order, each decided under its key's lock as
        `enqueue` decides it (a later input of a key sees the runs the earlier ones stored:
        one debounced run with the last input, one singleton run): the same outcome, but not
        one write, so an error of the store part-way leaves the earlier runs stored.
        """
        if not isinstance(task, TaskDefinition | str):
            check.refuse(
                "task", "a @task definition or a task name ('name' or 'name@version')", task
            )
        if not isinstance(inputs, Iterable) or isinstance(inputs, str | bytes | Mapping):
            check.refuse("inputs", "an iterable of inputs (a list)", inputs)
        items = list(inputs)
        if version is not None:
            check.integer(version, "version", at_least=1, expected="an integer >= 1 or None")
        definition = self.registry.resolve(task, version)
        check.integer(priority, "priority", at_least=-32768, at_most=32767)
        if idempotency_keys is None:
            keys: list[str | None] = [None] * len(items)
        else:
            if isinstance(idempotency_keys, str) or not isinstance(idempotency_keys, Sequence):
                check.refuse(
                    "idempotency_keys",
                    "a sequence of keys (str or None), one per input",
                    idempotency_keys,
                )
            keys = list(idempotency_keys)
            if len(keys) != len(items):
                raise UsageError(
                    f"idempotency_keys has {len(keys)} keys for {len(items)} inputs: give one "
                    "per input (None for no key)",
                    argument="idempotency_keys",
                )
            for key in keys:
                if key is not None:
                    check.text(key, "idempotency_keys", empty=False, max_length=512)
                    _serde.check_text(key, what="idempotency_key")
                    _refuse_reserved_key(key)
        if delay is not None:
            check.duration(delay, "delay")
        run_tags = check_tags(tags)
        deadline_at, timeout = _deadline(deadline, definition.timeout)
        if start_within is not None:
            check.duration(
                start_within,
                "start_within",
                positive=True,
                expected="a timedelta > 0 such as timedelta(minutes=5), or None",
            )
        singletons = per_input(singleton, "singleton", len(items), Singleton)
        debounces = per_input(debounce, "debounce", len(items), Debounce)
        sequences = per_input(sequence, "sequence", len(items), str)
        fairness_keys = per_input(fairness_key, "fairness_key", len(items), str)
        weights = per_input(weight, "weight", len(items), int)
        flows = [
            flow_key_fields(
                task_name=definition.name,
                concurrency=definition.concurrency,
                singleton=singletons[i],
                debounce=debounces[i],
                sequence=sequences[i],
                idempotency_key=keys[i],
                delay=delay,
                start_within=start_within,
                conn=conn,
            )
            for i in range(len(items))
        ]
        fairs = [
            fairness_fields(
                task_name=definition.name,
                fairness_key=fairness_keys[i],
                weight=weights[i],
                concurrency=definition.concurrency,
                flow=flows[i],
            )
            for i in range(len(items))
        ]
        if any(s is not None for s in singletons) or any(d is not None for d in debounces):
            for item in items:  # every input checked before the first is stored
                _serde.encode_input(item, definition.input_type, what="input")
            return [
                await self.enqueue(
                    definition,
                    item,
                    idempotency_key=keys[i],
                    priority=priority,
                    delay=delay,
                    conn=conn,
                    tags=tags,
                    deadline=deadline,
                    start_within=start_within,
                    singleton=singletons[i],
                    debounce=debounces[i],
                    sequence=sequences[i],
                    fairness_key=fairness_keys[i],
                    weight=weights[i],
                )
                for i, item in enumerate(items)
            ]
        if definition.rate_limit is not None:
            await ensure_defined(self.backend, definition.rate_limit, "enqueue_many()")
        strategy = definition.concurrency.strategy if definition.concurrency else "queue"
        if conn is not None and strategy != "queue":
            raise UsageError(
                f"task {definition.name!r} has concurrency strategy {strategy!r}, which "
                "cancels other runs of the key once the new run is stored: enqueue it without "
                "conn= (the strategy cannot wait for your transaction to commit)",
                argument="conn",
            )
        task_attributes = Telemetry.task_attributes(definition.name, definition.version)
        attributes = {
            **task_attributes,
            "messaging.operation.type": "send",
            "messaging.destination.name": definition.name,
            "messaging.batch.message_count": len(items),
            "umt.priority": priority,
        }
        with self.telemetry.producer_span(f"umt.enqueue {definition.name}", attributes) as span:
            trace_context = self.telemetry.inject()
            news: list[NewRun] = []
            first_of_key: dict[str, int] = {}  # a key's run, by its index in `news`
            first_input: dict[str, int] = {}  # a key's first input, by its index in `items`
            same_as: list[int | None] = []  # per input: the earlier input of the same key
            for item, key, flow, fair in zip(items, keys, flows, fairs, strict=True):
                input_json, input_hash = _serde.encode_input(
                    item, definition.input_type, what="input"
                )
                new = NewRun(
                    run_id=new_run_id(),
                    task_name=definition.name,
                    task_version=definition.version,
                    input_json=input_json,
                    input_hash=input_hash,
                    priority=priority,
                    idempotency_key=key,
                    delay=delay,
                    trace_context=trace_context,
                    tags=run_tags,
                    **key_fields(
                        definition.concurrency,
                        task_name=definition.name,
                        input_type=definition.input_type,
                        input_json=input_json,
                    ),
                    **rate_limit_fields(
                        definition.rate_limit,
                        task_name=definition.name,
                        input_type=definition.input_type,
                        input_json=input_json,
                    ),
                    **flow,
                    **fair,
                    deadline_at=deadline_at,
                    timeout=timeout,
                    start_within=start_within,
                )
                earlier = None if key is None else first_of_key.get(key)
                if earlier is not None and news[earlier].input_hash != input_hash:
                    raise IdempotencyConflictError(
                        f"idempotency key {key!r} of task {definition.name!r} is given twice "
                        "in this batch with different inputs; use a new key for a different "
                        "input",
                        idempotency_key=key or "",
                    )
                if key is not None and earlier is None:
                    first_of_key[key] = len(news)
                    first_input[key] = len(same_as)
                # The handle list is per input: a repeat names its key's first input there (an
                # index into `news` would be off by the repeats before it).
                same_as.append(None if earlier is None or key is None else first_input[key])
                if earlier is None:
                    news.append(new)
            stored: Sequence[EnqueueResult]
            if isinstance(self.backend, BatchEnqueueStore):
                stored = await self.backend.enqueue_many(news, conn=conn) if news else ()
                if len(stored) != len(news):
                    raise BackendError(
                        f"the backend stored {len(stored)} results for {len(news)} runs"
                    )
            else:  # one at a time: the same outcome, one write per run
                stored = [await self.backend.enqueue(new, conn=conn) for new in news]
            transaction = "own" if conn is None else "caller"
            span.set_attribute("umt.enqueue.transaction", transaction)
            self.telemetry.enqueue_requests.add(
                len(items), {**task_attributes, "umt.enqueue.transaction": transaction}
            )
            created = sum(1 for result in stored if result.created)
            span.set_attribute(
                "umt.runs.created" if conn is None else "umt.runs.created_if_committed", created
            )
            for new, result in zip(news, stored, strict=True):
                if not result.created:
                    self._check_key_input(result, new)
                    await self._check_key_version(result, definition, new.idempotency_key)
        if conn is None:
            if created:
                self.telemetry.runs_enqueued.add(created, task_attributes)
            for new, result in zip(news, stored, strict=True):
                if result.created and new.concurrency_key is not None:
                    await apply_strategy(
                        self.backend,
                        definition.concurrency,
                        task_name=definition.name,
                        run_id=result.run_id,
                        key=new.concurrency_key,
                    )
        handles: list[RunHandle[Any]] = []
        position = 0
        for earlier in same_as:
            if earlier is None:
                result = stored[position]
                position += 1
                handles.append(
                    RunHandle(
                        run_id=result.run_id,
                        task_name=definition.name,
                        task_version=definition.version,
                        created=result.created,
                        engine=self,
                        output_type=definition.output_type,
                    )
                )
            else:
                first = handles[earlier]
                handles.append(
                    RunHandle(
                        run_id=first.run_id,
                        task_name=definition.name,
                        task_version=definition.version,
                        created=False,
                        engine=self,
                        output_type=definition.output_type,
                    )
                )
        return handles

    async def publish(
        self, name: str, payload: Any = None, *, key: str | None = None, conn: Any = None
    ) -> PublishedEvent:
        """Publish the event `name`: every task subscribed to it (`@task(on_event=name)`)
        gets one run, with `payload` decoded into its input type as its input.

        The event is stored, with its publish time, once per (name, `key`): a second publish
        with the same key stores and starts nothing (`created=False`); with another payload
        it raises `IdempotencyConflictError`. None (the default): a new key, every publish is
        a new event. The runs of the subscribers this engine's registry knows are stored in
        the same write as the event (with `conn`, in your transaction: they exist if and only
        if it commits); workers start the subscribers registered later for the events of the
        last `connect(event_window=...)` (24 h by default). Each (event, task) starts once.

        A `name` outside `[A-Za-z0-9._:-]` and a `key` that is not text raise `UsageError`
        naming it; a payload JSON has no form for raises `PayloadError` naming its path, and a
        payload a known subscriber's input type refuses raises `PayloadError` naming the task:
        nothing is stored.
        """
        check_event_name(name, "name", where="publish()")
        if key is not None:
            check.text(key, "key", empty=False, max_length=512, where="publish()")
            _serde.check_text(key, what="key")
        store = event_store(self.backend, "publish()")
        payload_json = _serde.encode_payload(payload, what="payload")
        definitions = subscribers(self.registry, name)
        for definition in definitions:
            if definition.rate_limit is not None:
                await ensure_defined(self.backend, definition.rate_limit, "publish()")
        event_id = new_run_id()
        attributes = {
            "messaging.operation.type": "send",
            "messaging.destination.name": name,
            "umt.event.name": name,
            "umt.event.subscribers": len(definitions),
        }
        with self.telemetry.producer_span(f"umt.publish {name}", attributes) as span:
            trace_context = self.telemetry.inject()
            news = [
                event_run(
                    definition,
                    event_id=event_id,
                    event_name=name,
                    payload_json=payload_json,
                    trace_context=trace_context,
                    run_id=new_run_id(),
                )
                for definition in definitions
            ]
            event = new_event(
                event_id=event_id,
                name=name,
                key=str(event_id) if key is None else key,
                payload_json=payload_json,
                trace_context=trace_context,
            )
            outcome = await store.publish_event(event, news, conn=conn)
            if span.is_recording():
                span.set_attribute("umt.event.id", str(outcome.event_id))
                span.set_attribute("messaging.message.id", str(outcome.event_id))
                span.set_attribute(
                    "umt.event.created" if conn is None else "umt.event.created_if_committed",
                    outcome.created,
                )
            if not outcome.created and outcome.payload_hash != event.payload_hash:
                raise IdempotencyConflictError(
                    f"event {name!r} with key {event.key!r} was published with a different "
                    "payload; use a new key for a different event",
                    idempotency_key=event.key,
                )
        handles: list[RunHandle[Any]] = []
        for definition, new, result in zip(definitions, news, outcome.runs, strict=False):
            if result.created and conn is None:
                self.telemetry.runs_enqueued.add(
                    1, Telemetry.task_attributes(definition.name, definition.version)
                )
            handles.append(
                RunHandle(
                    run_id=result.run_id,
                    task_name=new.task_name,
                    task_version=new.task_version
                    if result.task_version is None
                    else result.task_version,
                    created=result.created,
                    engine=self,
                    output_type=definition.output_type,
                )
            )
        return PublishedEvent(
            event_id=outcome.event_id,
            name=name,
            key=event.key,
            created=outcome.created,
            runs=tuple(handles),
        )

    async def event_refusals(self, *, limit: int = 200) -> builtins.list[EventRefusal]:
        """The events a subscriber registered after their publish did not start because its
        input type refused the payload, with the reason, newest first."""
        check.integer(limit, "limit", at_least=1, at_most=10_000)
        store = event_store(self.backend, "event_refusals()")
        return builtins.list(await store.event_refusals(limit=limit))

    async def events(
        self, *, name: str | None = None, before: UUID | None = None, limit: int = 50
    ) -> builtins.list[EventInfo]:
        """The stored events, newest first, each with the runs it started (one per
        subscribing task that has one so far: the publish's, and those workers started for
        subscribers registered later). Events older than the event window are gone.

        Args:
            name: only the events of this name.
            before: an event id from a previous page: the events after it (older).
            limit: at most this many (1 to 500).

        A bad argument raises `UsageError` naming it; a backend that cannot list events
        (no `umt_sdk.backend.EventListStore`) raises `UsageError`.
        """
        return await list_events(self.backend, name=name, before=before, limit=limit)

    @staticmethod
    def _check_key_input(result: EnqueueResult, new: NewRun) -> None:
        """An idempotency hit must hold the same input: a key names one run of one input."""
        if result.input_hash is not None and result.input_hash != new.input_hash:
            raise IdempotencyConflictError(
                f"idempotency key {new.idempotency_key!r} of task {new.task_name!r} already "
                f"names run {result.run_id} with a different input; use a new key for a "
                "different input",
                idempotency_key=new.idempotency_key or "",
                run_id=result.run_id,
            )

    async def _check_key_version(
        self, result: EnqueueResult, definition: TaskDefinition[Any, Any], key: str | None
    ) -> None:
        """An idempotency hit must name a run of the version asked for, or the handle lies."""
        existing = result.task_version
        if existing is None:  # the backend does not say: read the run
            record = await self.backend.get_run_head(result.run_id)
            if record is None:
                return  # not visible here (inside the caller's transaction, say)
            existing = record.task_version
        if existing != definition.version:
            raise IdempotencyConflictError(
                f"idempotency key {key!r} of task {definition.name!r} already names run "
                f"{result.run_id} of version {existing}, not version {definition.version}; "
                "a key names one run of one version: use a new key for the other version",
                idempotency_key=key or "",
                run_id=result.run_id,
                existing_version=existing,
                requested_version=definition.version,
            )

    async def _start_tick(
        self, definition: TaskDefinition[Any, Any], input: Any, key: str
    ) -> RunHandle[Any]:
        """The run of a schedule's tick, under the tick's key (see `umt_sdk._schedules`)."""
        token = scheduler_enqueue.set(True)
        try:
            return await self.enqueue(
                definition, input, idempotency_key=key, version=definition.version
            )
        except IdempotencyConflictError as exc:
            # The tick's run exists with another version or input (a racing process runs
            # other code): it is the tick's run all the same.
            if exc.run_id is None:
                raise
            return RunHandle(
                run_id=exc.run_id,
                task_name=definition.name,
                task_version=exc.existing_version or definition.version,
                created=False,
                engine=self,
            )
        finally:
            scheduler_enqueue.reset(token)

    async def _cancel_for(self, run_id: UUID, reason: str) -> CancelOutcome:
        return await self.cancel(run_id, reason=reason)

    async def signal(self, run_id: UUID, name: str, payload: Any = None) -> bool:
        """Store the fact `name` for the run (first write wins), then wake it if it waits.

        A fact sent before its waiter reaches `wait_for_fact` is kept, not lost. Returns False
        when the run already had a fact of that name (the first payload stays). `run_id` must
        be a run's UUID (`UsageError` otherwise, None included); `broadcast` sends to all.
        """
        run_id = _check_run_id(run_id, "signal")
        check_name("fact", name, argument="name")
        _refuse_child_fact(name)
        payload_json = _serde.encode(payload, what=f"payload of fact {name!r}")
        attributes = {"umt.run.id": str(run_id), "umt.fact.name": name}
        with self.telemetry.producer_span(f"umt.signal {name}", attributes) as span:
            stored = await self.backend.signal(run_id=run_id, name=name, payload_json=payload_json)
            span.set_attribute("umt.fact.stored", stored)
        return stored

    async def complete_callback(self, token: str, payload: Any = None) -> None:
        """Complete the callback that `token` (from `ctx.step.callback_token`) names, exactly
        once: its run's `wait_for_callback` returns `payload`, now or when it gets there.

        Refused with `CallbackTokenError`, nothing stored, when the token is malformed, when
        no callback of its run has it (forged, or bound to another run), when it expired,
        when it was already completed (the first payload stays), or when its run has ended.
        Two racing completions: one wins, the other is refused as already completed.
        """
        where = "complete_callback()"
        run_id = parse_token(token, where=where)  # shape and size first: nothing read yet
        payload_json = _serde.encode(payload, what="payload of a callback")
        run = await self.backend.get_run(run_id)
        minted = find_minted(run.steps, token) if run is not None else None
        if run is None or minted is None:
            raise CallbackTokenError(
                f"{where}: no callback of run {run_id} has this token (forged, bound to "
                "another run, or its run was deleted)",
                reason="unknown",
            )
        attributes = {"umt.run.id": str(run_id), "umt.step.name": minted.step_name}
        with self.telemetry.producer_span(f"umt.complete_callback {minted.step_name}", attributes):
            used = await self.backend.get_facts(run_id=run_id, name=minted.fact)
            if any(fact.run_id == run_id for fact in used):
                raise CallbackTokenError(
                    f"{where}: callback {minted.step_name!r} of run {run_id} was already "
                    "completed; a token completes its callback once (the first payload stays)",
                    reason="completed",
                )
            now = run.observed_at or datetime.now(UTC)  # every backend sets it; a guard
            if now >= minted.expires_at:
                raise CallbackTokenError(
                    f"{where}: the token of callback {minted.step_name!r} of run {run_id} "
                    f"expired at {minted.expires_at.isoformat()}",
                    reason="expired",
                )
            if run.status in ("completed", "failed", "canceled", "compensated"):
                raise CallbackTokenError(
                    f"{where}: run {run_id} has ended ({run.status}); its callback "
                    f"{minted.step_name!r} can no longer be completed",
                    reason="finished",
                )
            stored = await self.backend.signal(
                run_id=run_id, name=minted.fact, payload_json=payload_json
            )
        if not stored:  # a racing completion stored it between our look and our write
            raise CallbackTokenError(
                f"{where}: callback {minted.step_name!r} of run {run_id} was already "
                "completed; a token completes its callback once (the first payload stays)",
                reason="completed",
            )

    async def settle(
        self,
        run_id: UUID,
        *,
        step: str,
        done: bool,
        output: Any = None,
        by: str | None = None,
    ) -> Settlement:
        """Settle the step of a run in `needs_attention` (its attempt failed in a way its
        `uncertain_on` declares: the outcome is unknown), once, and wake the run.

        Args:
            run_id: the run, in `needs_attention` (`RunInfo.needs_attention` names the step).
            step: the step it waits on, as named in its timeline (`name#2` for a repeat).
            done: True: the step's work was done and `output` is its result: the run goes on
                and the step does not run again. False: it was not done: the step runs again
                (its next attempt).
            output: with `done=True`, the step's result (its output type's value, or the JSON
                form of one); it must decode into the step's output type.
            by: who settles it, kept in the run's history (default: the OS user).

        Returns the settlement as stored. Refused with `UsageError`, nothing stored, when the
        run is not in `needs_attention`, waits on another step, was already settled, or the
        output does not decode into the step's output type.
        """
        run_id = _check_run_id(run_id, "settle")
        return await settle_run(
            self.backend, self.telemetry, run_id, step=step, done=done, output=output, by=by
        )

    async def update(
        self, run_id: UUID, name: str, arg: Any = None, *, timeout: float | None = None
    ) -> Any:
        """Send the run the update `name` with `arg`, and return its handler's result once the
        run has applied it and recorded the result in its history.

        The update is stored for the run at once and applied, in the order updates were
        sent, where the run waits for updates (`ctx.step.wait_for_update`). Refused with
        `UsageError`, nothing stored, when the run's task declares no update `name`
        (`argument="name"`) or when `arg` does not fit the handler's argument type or its
        validator refuses it (`argument="arg"`). `UpdateFailedError` when the handler raised
        (`reason="failed"`) or the run ended before applying it (`"finished"`, also when it
        had ended already). `ResultTimeoutError` after `timeout` seconds: the update stays
        stored and is still applied later.
        """
        run_id = _check_run_id(run_id, "update")
        check_name("update", name, argument="name")
        seconds = None
        if timeout is not None:
            seconds = check.seconds(
                timeout, "timeout", expected="a finite number of seconds >= 0, or None"
            )
        record = await self.backend.get_run(run_id)
        if record is None:
            raise await self._not_found(run_id)
        definition = self.registry.get(record.task_name, record.task_version)
        handler = definition.updates.get(name)
        if handler is None:
            raise UsageError(
                f"update(): task {definition.pair} declares no update {name!r} (it declares "
                f"{known(definition.updates)})",
                argument="name",
            )
        arg_json = handler.check_arg(arg, where="update()")
        if record.status in TERMINAL_STATUSES:
            raise UpdateFailedError(
                f"run {run_id} has ended ({record.status}); it takes no more updates",
                run_id=run_id,
                update_name=name,
                reason="finished",
            )
        attributes = {"umt.run.id": str(run_id), "umt.update.name": name}
        with self.telemetry.producer_span(f"umt.update {name}", attributes):
            return await send_update(self.backend, record, handler, arg_json, timeout=seconds)

    async def query(self, run_id: UUID, name: str) -> Any:
        """The answer of the run's query `name`: its handler (`@query`) called here, in this
        process, with the newest value the run gave `ctx.set_query_state` (None before it set
        one). No worker is involved and nothing is written; it works while the run runs,
        sleeps or waits, and after it ended. `UsageError` (`argument="name"`) when the run's
        task declares no such query."""
        run_id = _check_run_id(run_id, "query")
        check_name("query", name, argument="name")
        head = await self.backend.get_run_head(run_id)
        if head is None:
            raise await self._not_found(run_id)
        definition = self.registry.get(head.task_name, head.task_version)
        handler = definition.queries.get(name)
        if handler is None:
            raise UsageError(
                f"query(): task {definition.pair} declares no query {name!r} (it declares "
                f"{known(definition.queries)})",
                argument="name",
            )
        entries = await stream_store(self.backend).last_stream_entries([run_id], QUERY_STATE_STREAM)
        return handler.answer(entries[0].value_json if entries else None)

    async def update_with_start(
        self,
        task: TaskDefinition[Any, Any] | str,
        input: Any,
        *,
        key: str,
        update: str,
        arg: Any = None,
        version: int | None = None,
        timeout: float | None = None,
    ) -> tuple[RunHandle[Any], Any]:
        """Start a run of `task` under the idempotency key `key` unless the key names one
        already, then send it the update `update` (see `update`), in one call: two callers
        racing on a key get the same run, and each its own update's result. Returns the
        run's handle (`created` says whether this call started it) and the result.

        The update's name and argument are checked against `task` first: when refused,
        nothing is stored, not even the run. The key's run is used whatever its input (the
        input is only for a run this call starts); a key that names a run which has ended
        gives `UpdateFailedError` (`reason="finished"`).
        """
        check_name("update", update, argument="update")
        definition = self.registry.resolve(task, version)
        handler = definition.updates.get(update)
        if handler is None:
            raise UsageError(
                f"update_with_start(): task {definition.pair} declares no update {update!r} "
                f"(it declares {known(definition.updates)})",
                argument="update",
            )
        handler.check_arg(arg, where="update_with_start()")
        try:
            handle = await self.enqueue(
                definition, input, idempotency_key=key, version=definition.version
            )
        except IdempotencyConflictError as exc:  # the key's run, started with another input
            if exc.run_id is None:
                raise
            head = await self.backend.get_run_head(exc.run_id)
            if head is None:
                raise await self._not_found(exc.run_id) from exc
            handle = RunHandle(
                run_id=head.run_id,
                task_name=head.task_name,
                task_version=head.task_version,
                created=False,
                engine=self,
                output_type=self._output_type(head.task_name, head.task_version),
            )
        result = await self.update(handle.run_id, update, arg, timeout=timeout)
        return handle, result

    async def broadcast(self, name: str, payload: Any = None) -> bool:
        """Store a fact every run can wait for by `name` (first write wins), and wake them."""
        check_name("fact", name, argument="name")
        _refuse_child_fact(name)
        payload_json = _serde.encode(payload, what=f"payload of fact {name!r}")
        with self.telemetry.producer_span(f"umt.broadcast {name}", {"umt.fact.name": name}) as span:
            stored = await self.backend.signal(run_id=None, name=name, payload_json=payload_json)
            span.set_attribute("umt.fact.stored", stored)
        return stored

    async def cancel(self, run_id: UUID, *, reason: str = "") -> CancelOutcome:
        """Cancel a run: waiting and pending runs end at once; a running one gets its abort
        signal and starts no further step. Returns what happened."""
        run_id = _check_run_id(run_id, "cancel")
        check.text(reason, "reason", where="cancel()")
        _serde.check_text(reason, what="reason")
        attributes = {"umt.run.id": str(run_id), "umt.cancel.reason": reason}
        with self.telemetry.client_span("umt.cancel", attributes) as span:
            outcome = await self.backend.cancel(run_id, reason=reason)
            span.set_attribute("umt.cancel.outcome", outcome)
        return outcome

    # -- pause and resume, rerun and fork ---------------------------------------------------

    async def pause(self, task: str | TaskPair) -> bool:
        """Pause a task: no worker starts a run of it until `resume`, on any host.

        Its runs wait unharmed (pending, or waiting with their timers), and new ones can be
        enqueued; a run already executing goes on until its execution ends (it finishes, or
        parks on a sleep or a fact, and then waits too). Durable: the pause is stored, and every
        claim checks it.

        Args:
            task: `"name@version"` pauses that version, `"name"` every version (a `TaskPair`
                names one version).

        Returns False when that pause was stored already. A backend that cannot store pauses
        (`umt_sdk.backend.LifecycleStore`) raises `UsageError`.
        """
        name, version = pause_target(task, "pause")
        store = lifecycle_store(self.backend, "pause")
        with self.telemetry.client_span("umt.pause", {"umt.task.name": str(task)}):
            return await store.pause_task(task_name=name, task_version=version)

    async def resume(self, task: str | TaskPair) -> bool:
        """Resume a paused task: its waiting runs are claimed again, in their usual order.

        `"name"` removes every pause of the task (the whole task's and each version's);
        `"name@version"` that version's, and is refused (`UsageError`) while the whole task is
        paused (it would resume nothing). Returns False when nothing was paused.
        """
        name, version = pause_target(task, "resume")
        store = lifecycle_store(self.backend, "resume")
        if version is not None:
            paused = await store.list_paused_tasks()
            if any(p.task_name == name and p.task_version is None for p in paused):
                raise UsageError(
                    f"resume({str(task)!r}): task {name!r} is paused as a whole (every version); "
                    f"resume({name!r}) resumes it, then pause the versions to keep paused",
                    argument="task",
                )
        with self.telemetry.client_span("umt.resume", {"umt.task.name": str(task)}):
            return await store.resume_task(task_name=name, task_version=version)

    async def paused(self) -> builtins.list[PausedTask]:
        """The stored pauses, by task name then version (a whole task's first)."""
        return builtins.list(await lifecycle_store(self.backend, "paused").list_paused_tasks())

    async def rerun(self, run_id: UUID, *, version: int | None = None) -> RunHandle[Any]:
        """Start a finished run again from the start: a new run with the same input and
        priority, linked to the old one (`RunInfo.rerun_of`), with no steps and no facts.

        Args:
            version: run it on this version (the run's own by default; not an older one).
                When the registry has that version, the input is checked against its input
                type first (`PayloadError` naming the field that does not fit).

        A run that has not finished is refused (`UsageError`): cancel it first. The new run has
        no idempotency key (a key names one run) and no parent. It keeps the run's concurrency
        key; a run started with `singleton=` or `sequence=` keeps that key as a sequence: the
        new run waits for the key's active run to end (it never skips or replaces).
        """
        run_id = _check_run_id(run_id, "rerun")
        lifecycle_store(self.backend, "rerun")
        record = await self._finished_record(run_id)
        run_on = restartable(record, version, "rerun")
        return await self._start_again(record, run_on, rerun=True, plan=None)

    async def fork(
        self, run_id: UUID, from_step: str, *, version: int | None = None
    ) -> RunHandle[Any]:
        """Start a finished run again from its step `from_step`: a new run that keeps the
        step records before it (their outputs are replayed, not run again) and executes from
        there, on the run's version or a newer one. For "the bug is fixed: resume the failed
        runs from the broken step".

        The fork keeps every step record first recorded before the first record of
        `from_step` (retries included), and the facts the old run was sent; it starts again
        the child runs those steps started that did not complete (their records are dropped),
        and reads the result of those that did. It is linked to the old run
        (`RunInfo.forked_from`, `forked_at_step`); it has no idempotency key and no parent,
        and keeps the run's concurrency key as `rerun` does.

        Args:
            from_step: the name of a step the run recorded (as the timeline shows it: the
                second use of a step in a loop is `name#2`); `UsageError` listing the recorded
                ones otherwise.
            version: as `rerun`'s. The kept records replay on that version's code: it must
                make the same steps before `from_step` (else `NonDeterminismError`).
        """
        run_id = _check_run_id(run_id, "fork")
        check.text(from_step, "from_step", empty=False, max_length=200, where="fork()")
        lifecycle_store(self.backend, "fork")
        record = await self._finished_record(run_id, full=True)
        run_on = restartable(record, version, "fork")
        plan = await self._fork_plan(record, from_step)
        if isinstance(plan, str):
            raise UsageError(f"fork(): {plan}", argument="from_step")
        return await self._start_again(record, run_on, rerun=False, plan=plan)

    async def _fork_plan(self, record: RunRecord, from_step: str) -> ForkPlan | str:
        """What a fork of `record` (read with its steps) from `from_step` keeps, or why it
        cannot be forked from there (for a dry run)."""
        children = await children_of(self.backend, record.run_id)
        return plan_fork(record, from_step, children)

    async def _finished_record(self, run_id: UUID, *, full: bool = False) -> RunRecord:
        record = await (self.backend.get_run(run_id) if full else self.backend.get_run_head(run_id))
        if record is None:
            raise await self._not_found(run_id)
        return record

    async def _start_again(
        self, record: RunRecord, version: int, *, rerun: bool, plan: ForkPlan | None
    ) -> RunHandle[Any]:
        """Enqueue the new run of a rerun or a fork (the input checked against `version`'s
        input type when the registry has it)."""
        try:
            definition: TaskDefinition[Any, Any] | None = self.registry.get(
                record.task_name, version
            )
        except LookupError:
            definition = None
        if definition is not None and version != record.task_version:
            input_json, input_hash = _serde.encode_input(
                json.loads(record.input_json), definition.input_type, what="input"
            )
        else:
            input_json, input_hash = record.input_json, _serde.input_hash(record.input_json)
        keyed = (
            key_fields(
                definition.concurrency,
                task_name=definition.name,
                input_type=definition.input_type,
                input_json=input_json,
            )
            if definition is not None
            else {}
        )
        if not keyed and record.fairness_weight is not None and definition is not None:
            # A fairness key's run: the new run joins the key's turns with its weight.
            assert record.concurrency_key is not None
            keyed = {
                "concurrency_key": record.concurrency_key,
                "concurrency_limit": FAIR_SLOTS,
                "fairness_weight": record.fairness_weight,
            }
        elif not keyed and record.concurrency_key is not None and definition is not None:
            # A singleton's or a sequence's key (limit 1, given at the enqueue): the new run
            # joins that key's line and waits its turn; it neither skips nor replaces.
            keyed = {
                "concurrency_key": record.concurrency_key,
                "concurrency_limit": 1,
                "count_waiting": True,
            }
        limited: dict[str, Any] = {}
        if definition is not None and definition.rate_limit is not None:
            limited = rate_limit_fields(
                definition.rate_limit,
                task_name=definition.name,
                input_type=definition.input_type,
                input_json=input_json,
            )
            await ensure_defined(self.backend, definition.rate_limit, "rerun()")
        call = "rerun" if rerun else "fork"
        attributes = {
            **Telemetry.task_attributes(record.task_name, version),
            "messaging.operation.type": "send",
            "messaging.destination.name": record.task_name,
            f"umt.{call}.of": str(record.run_id),
        }
        with self.telemetry.producer_span(f"umt.{call} {record.task_name}", attributes) as span:
            new = NewRun(
                run_id=new_run_id(),
                task_name=record.task_name,
                task_version=version,
                input_json=input_json,
                input_hash=input_hash,
                priority=record.priority,
                trace_context=self.telemetry.inject(),
                rerun_of=record.run_id if rerun else None,
                forked_from=None if plan is None else record.run_id,
                forked_at_step=None if plan is None else plan.from_step,
                kept_steps=() if plan is None else plan.kept_steps,
                tags=dict(record.tags),  # found by the same tags as the run it starts again
                **keyed,
                **limited,
                # A new run: the task's timeout counts from now (a definition this process
                # does not register sets none).
                timeout=definition.timeout if definition is not None else None,
            )
            result = await self.backend.enqueue(new)
            span.set_attribute("umt.run.id", str(result.run_id))
        self.telemetry.runs_enqueued.add(1, Telemetry.task_attributes(record.task_name, version))
        return RunHandle(
            run_id=result.run_id,
            task_name=record.task_name,
            task_version=version,
            created=result.created,
            engine=self,
            output_type=definition.output_type if definition is not None else Any,
        )

    # -- reading ----------------------------------------------------------------------------

    async def get(self, run_id: UUID) -> RunInfo:
        """The run's status, attempts, last error and step timeline."""
        run_id = _check_run_id(run_id, "get")
        record = await self.backend.get_run(run_id)
        if record is None:
            raise await self._not_found(run_id)
        return build_run_info(record)

    async def _not_found(self, run_id: UUID) -> RunNotFoundError:
        return await missing_run(self.backend, run_id)

    async def export_history(self, run_id: UUID) -> RunHistory:
        """The run's recorded history (task, version, input, status, each step record) as a
        `RunHistory`: `to_json()` gives the documented, versioned line `umt runs export`
        prints, and `umt_sdk.testing.Replayer` replays it against today's code."""
        run_id = _check_run_id(run_id, "export_history")
        record = await self.backend.get_run(run_id)
        if record is None:
            raise await self._not_found(run_id)
        return history_of(record)

    async def list(
        self,
        *,
        task_name: str | None = None,
        version: int | None = None,
        status: RunStatus | None = None,
        parent: UUID | None = None,
        limit: int = 100,
        before: UUID | None = None,
        idempotency_key: str | None = None,
        tags: Mapping[str, str] | None = None,
        created_after: datetime | None = None,
        created_before: datetime | None = None,
        finished_after: datetime | None = None,
        finished_before: datetime | None = None,
        concurrency_key: str | None = None,
        worker_id: str | None = None,
        needs_attention: bool = False,
    ) -> RunPage:
        """Runs, newest first (by run id, which grows with time), matching every filter given;
        page with `before=page.next_cursor`.

        Args:
            task_name: only runs of this task (`version`: of this version).
            status: only runs in this status.
            parent: only the children of this run.
            idempotency_key: only the run enqueued under this key; keys are per task, so it
                needs `task_name` too (`UsageError` otherwise).
            tags: only runs carrying all of these tags (`enqueue(..., tags=...)`).
            concurrency_key: only runs of this concurrency key (`@task(concurrency=...)`);
                keys are per task, so give `task_name` too.
            worker_id: only runs that an execution of this worker claimed (the ids on the
                run's timeline; `engine.workers()` lists them).
            needs_attention: only runs in `needs_attention`, waiting for an operator to
                settle a step (`RunInfo.needs_attention` names it; `settle`).
            created_after: only runs created at or after this time (timezone-aware);
                `created_before`: strictly before it.
            finished_after: only finished runs, finished at or after this time;
                `finished_before`: strictly before it.
            limit: at most this many runs (1..10000).
            before: the cursor, `next_cursor` of the previous page.

        A filter of the wrong type (a `version` that is not an int, a `before` that is not a
        UUID, a naive datetime) raises `UsageError` naming it.
        """
        if task_name is not None:
            check.text(task_name, "task_name", expected="a task name (a string) or None")
        if version is not None:
            check.integer(version, "version", at_least=1, expected="an integer >= 1 or None")
        if status is not None:
            check.choice(status, "status", _STATUSES)
        if parent is not None:
            check.uuid(parent, "parent", expected="a run id (uuid.UUID) such as handle.run_id")
        check.integer(limit, "limit", at_least=1, at_most=10_000, expected="in 1..10000")
        if before is not None:
            check.uuid(before, "before", expected="a run id (uuid.UUID) such as page.next_cursor")
        if idempotency_key is not None:
            check.text(idempotency_key, "idempotency_key", empty=False, max_length=512)
            _serde.check_text(idempotency_key, what="idempotency_key")
            if task_name is None:
                raise UsageError(
                    "list(idempotency_key=...) needs task_name=... too: a key names one run "
                    "of one task (and is found through that task's index of keys)",
                    argument="idempotency_key",
                )
        wanted_tags = check_tags(tags, where="list()")
        if concurrency_key is not None:
            check.text(concurrency_key, "concurrency_key", empty=False, max_length=255)
        if worker_id is not None:
            check.text(worker_id, "worker_id", empty=False, max_length=200)
            _serde.check_text(worker_id, what="worker_id")
        times = {
            "created_after": created_after,
            "created_before": created_before,
            "finished_after": finished_after,
            "finished_before": finished_before,
        }
        for argument, value in times.items():
            if value is not None:
                check.aware_datetime(value, argument, where="list()")
        if not isinstance(needs_attention, bool):
            check.refuse("needs_attention", "True or False", needs_attention, where="list()")
        records = await self.backend.list_runs(
            RunQuery(
                task_name=task_name,
                task_version=version,
                status=status,
                parent_run_id=parent,
                limit=limit + 1,
                before=before,
                idempotency_key=idempotency_key,
                tags=wanted_tags,
                created_after=created_after,
                created_before=created_before,
                finished_after=finished_after,
                finished_before=finished_before,
                concurrency_key=concurrency_key,
                worker_id=worker_id,
                needs_attention=needs_attention,
            )
        )
        page = [build_run_info(r) for r in records[:limit]]
        cursor = page[-1].run_id if len(records) > limit else None
        return RunPage(runs=tuple(page), next_cursor=cursor)

    async def prune(
        self,
        *,
        older_than: timedelta,
        task: str | Sequence[str] | None = None,
        dry_run: bool = False,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> PruneReport:
        """Delete the runs that finished more than `older_than` ago, now, by hand.

        Runs of `task` (a name or a list of names; None: every task), `batch_size` at a time
        (1..10000), until none is left. Pending, running and waiting runs are never touched;
        nor are finished runs with an unfinished child, or whose parent has not finished. Each
        pruned run leaves a tombstone: its idempotency key stays taken, and `get` / `result`
        raise `RunPrunedError`. With `dry_run`, nothing is deleted and `pruned` counts what
        would be. A `task`'s own `@task(retention=)` does not apply here: you said how old.
        If workers are pruning at the same moment, this stops early with `busy` set (they
        delete the rest). `UsageError` on a backend that cannot delete runs.
        """
        check.duration(
            older_than,
            "older_than",
            expected="a timedelta >= 0 such as timedelta(days=30)",
            where="prune()",
        )
        names: list[str] | None = None
        if task is not None:
            raw = (
                [task]
                if isinstance(task, str)
                else check.collection(
                    task, "task", expected="a task name or a list of task names", where="prune()"
                )
            )
            names = [
                check.text(n, "task", empty=False, expected="task names (strings)", where="prune()")
                for n in raw
            ]
        dry_run = check.flag(dry_run, "dry_run", where="prune()")
        check.integer(batch_size, "batch_size", at_least=1, at_most=10_000, where="prune()")
        store = retention_store(self.backend, "prune()")
        pruner = Pruner(store=store, policy=self.retention)
        return await pruner.prune(
            older_than=older_than, task_names=names, dry_run=dry_run, batch_size=batch_size
        )

    async def result(
        self, run_id: UUID, *, timeout: float | None = None, output_type: Any = None
    ) -> Any:
        """Wait until the run finishes; return its output, decoded to the task's output type.

        Raises `RunFailedError` / `RunCanceledError` for runs that did not complete
        (`RunCompensatedError`, a `RunFailedError`, for a run that ended compensated), and
        `ResultTimeoutError` after `timeout` seconds (a finite number >= 0, or None to wait
        without limit). `output_type` overrides the registered one; it must be a type umt can
        decode to.
        """
        run_id = _check_run_id(run_id, "result")
        if output_type is not None:
            check_type_argument(output_type, "output_type", where="result()")
        return await self._result(run_id, timeout=timeout, output_type=output_type)

    async def _result(self, run_id: UUID, *, timeout: float | None, output_type: Any) -> Any:
        deadline = None
        if timeout is not None:
            seconds = check.seconds(
                timeout, "timeout", expected="a finite number of seconds >= 0, or None"
            )
            deadline = time.monotonic() + seconds
        while True:
            record = await self.backend.get_run_head(run_id)
            if record is None:
                raise await self._not_found(run_id)
            if record.status in TERMINAL_STATUSES:
                break
            remaining = 5.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise ResultTimeoutError(f"run {run_id} is still {record.status} after {timeout} s")
            await self.backend.wait_for_run(run_id, timeout=min(remaining, 5.0))
        if record.status == "completed":
            if output_type is None:
                output_type = self._output_type(record.task_name, record.task_version)
            return _serde.decode(record.output_json or "null", output_type, what="run output")
        if record.status == "canceled":
            reason = record.cancel_reason or ""
            raise RunCanceledError(
                f"run {run_id} was canceled: {reason}", run_id=run_id, reason=reason
            )
        error = record.error
        kind, message = (error.type, error.message) if error else ("?", "")
        if record.status == "compensated":
            raise RunCompensatedError(
                f"run {run_id} failed and was compensated: {kind}: {message}",
                run_id=run_id,
                error_type=error.type if error else "",
                error_message=error.message if error else "",
            )
        raise RunFailedError(
            f"run {run_id} failed: {kind}: {message}",
            run_id=run_id,
            error_type=error.type if error else "",
            error_message=error.message if error else "",
        )

    def _output_type(self, name: str, version: int) -> Any:
        try:
            return self.registry.get(name, version).output_type
        except LookupError:
            return Any

    # -- what operators look at -------------------------------------------------------------

    async def workers(self, *, limit: int = 200) -> builtins.list[WorkerInfo]:
        """The workers that reported themselves (every few seconds while they run), the most
        recently seen first: live, stopped (a clean shutdown), or silent (no report for
        `WORKER_SILENT_AFTER` without a goodbye: crashed, frozen or cut off). A backend that
        does not keep them (`umt_sdk.backend.InsightStore`) raises `UsageError`."""
        check.integer(limit, "limit", at_least=1, at_most=10_000, expected="in 1..10000")
        return await worker_infos(insight_store(self.backend, "workers()"), limit=limit)

    async def task_stats(self) -> builtins.list[TaskStats]:
        """Per (task, version) pair, by task name then version: its pending, running and
        waiting runs, how many finished in the last hour (per 5 minutes, and failed), the age
        of its oldest claimable pending run, and which live workers serve it. Every pair with
        unfinished or recently finished runs, and every pair of the registry."""
        store = insight_store(self.backend, "task_stats()")
        workers = await worker_infos(store, limit=1000)
        return await task_stats(
            store, now=store_now(self.backend), known=self.registry.pairs(), workers=workers
        )

    async def key_usage(self, *, limit: int = 500) -> builtins.list[KeyUsage]:
        """The concurrency keys in use (a run holding or wanting a slot), by task then key:
        each key's limit and its holding and wanting runs."""
        check.integer(limit, "limit", at_least=1, at_most=10_000, expected="in 1..10000")
        store = insight_store(self.backend, "key_usage()")
        return builtins.list(await store.key_usage(limit=limit))

    # -- streams ----------------------------------------------------------------------------

    def stream(
        self,
        run_id: UUID,
        name: str,
        *,
        since: int = 0,
        follow: bool = True,
        value_type: Any = Any,
    ) -> AsyncGenerator[StreamItem, None]:
        """The values the run wrote to its stream `name` (`ctx.stream.write`), in order:
        `async for item in engine.stream(run_id, "progress"): ...`.

        Gives what was written after seq `since` (0: from the first), then, with `follow`
        (the default), waits for new values as they are written (woken by the store: LISTEN
        on Postgres) and ends once the run has ended and its last value was given. Without
        `follow`, it ends after what is stored now. Values are decoded as JSON, or to
        `value_type`. `RunNotFoundError` (when iterated) if there is no such run.
        """
        run_id = _check_run_id(run_id, "stream")
        check_name("stream", name, argument="name")
        check.integer(since, "since", at_least=0, expected="a seq (an int >= 0): 0 for all")
        check.flag(follow, "follow")
        if value_type is not Any:
            check_type_argument(value_type, "value_type", where="stream()")
        stream_store(self.backend)
        return follow_stream(
            self.backend, run_id, name, since=since, follow=follow, value_type=value_type
        )

    async def stream_last(
        self, run_id: UUID, name: str, *, value_type: Any = Any
    ) -> StreamItem | None:
        """The newest value of the run's stream `name` (a progress bar's need), or None when
        the run has written none there yet. `RunNotFoundError` if there is no such run."""
        run_id = _check_run_id(run_id, "stream_last")
        check_name("stream", name, argument="name")
        if value_type is not Any:
            check_type_argument(value_type, "value_type", where="stream_last()")
        entries = await stream_store(self.backend).last_stream_entries([run_id], name)
        if entries:
            return item_of(entries[0], value_type)
        if await self.backend.get_run_head(run_id) is None:
            raise await self._not_found(run_id)
        return None

    async def stream_heads(
        self, run_ids: Sequence[UUID], *, name: str | None = None
    ) -> Mapping[UUID, Mapping[str, StreamItem]]:
        """The newest value of each stream of these runs (only the stream `name` when given),
        by run id then stream name, in one read: what `umt runs watch` shows. A run with no
        stream (or no such run) is left out."""
        if isinstance(run_ids, UUID):
            check.refuse("run_ids", "a list of run ids (uuid.UUID)", run_ids, hint="use [run_id]")
        ids = check.collection(run_ids, "run_ids", expected="a list of run ids (uuid.UUID)")
        checked = [_check_run_id(run_id, "stream_heads") for run_id in ids]
        if name is not None:
            check_name("stream", name, argument="name")
        if not checked:
            return {}
        return heads_by_run(await stream_store(self.backend).last_stream_entries(checked, name))

    # -- consuming --------------------------------------------------------------------------

    def worker(
        self,
        *,
        versions: Sequence[str | TaskDefinition[Any, Any] | TaskPair] | None = None,
        concurrency: int = 16,
        lease: timedelta = timedelta(seconds=10),
        worker_id: str | None = None,
        poll_interval: timedelta = timedelta(seconds=1),
        shutdown_grace: timedelta = timedelta(seconds=10),
        schedules: bool = True,
        prune_interval: timedelta = timedelta(minutes=1),
    ) -> Worker:
        """A worker for `versions` (`["name@1", "name@2"]`; all registered when None).

        It claims only those (name, version) pairs; runs of other pairs are never touched.
        With `schedules` (the default, on a backend that stores them) it also runs the
        scheduler loop for the tasks it serves: it stores the registry's declared schedules
        of those tasks, then starts the runs of their due ticks every `poll_interval`.
        With a retention (`connect(retention=...)`, `@task(retention=...)`) it also deletes
        old finished runs every `prune_interval`, in small batches; when several workers try
        at once, one deletes and the others skip their turn.
        Use it as `async with engine.worker(...):`. A wrong option (a `concurrency` that is not
        an int in 1..10000, a `lease` under 100 ms, a number where a timedelta goes) raises
        `UsageError` naming it.
        """
        worker_pairs = self.registry.select(versions)
        worker = Worker(
            backend=self.backend,
            registry=self.registry,
            pairs=worker_pairs,
            concurrency=concurrency,
            lease=lease,
            worker_id=worker_id,
            poll_interval=poll_interval,
            shutdown_grace=shutdown_grace,
            telemetry=self.telemetry,
            schedules=self.schedules if check.flag(schedules, "schedules") else None,
            pruner=self._pruner(),
            prune_interval=prune_interval,
            events=self._event_starter(worker_pairs),
        )
        self._workers.append(worker)
        return worker

    def _event_starter(self, pairs: Sequence[TaskPair]) -> EventStarter | None:
        """What starts the served subscribers' events published before they were known."""
        served = {pair.name for pair in pairs}
        names = frozenset(
            d.name for d in self.registry if d.on_event is not None and d.name in served
        )
        if not isinstance(self.backend, EventStore) or not (names or self.retention.active):
            return None  # with no subscriber, only a worker with a retention deletes events
        window = self.event_window
        if self.retention.idempotency is not None:
            # An event must not outlive the keys of its runs: once a pruned run's key is
            # forgotten, the event would start that subscriber again.
            window = min(window, self.retention.idempotency)
        return EventStarter(
            backend=self.backend,
            registry=self.registry,
            task_names=names,
            window=window,
            new_run_id=new_run_id,
        )

    def _pruner(self) -> Pruner | None:
        if not self.retention.active or not isinstance(self.backend, RetentionStore):
            return None
        return Pruner(store=self.backend, policy=self.retention)

    async def wait_idle(
        self, run_ids: Iterable[UUID], *, timeout: float = 30.0
    ) -> builtins.list[RunInfo]:
        """Wait until every run in `run_ids` is finished; return their infos."""
        if isinstance(run_ids, UUID):
            check.refuse("run_ids", "a list of run ids (uuid.UUID)", run_ids, hint="use [run_id]")
        ids = check.collection(run_ids, "run_ids", expected="a list of run ids (uuid.UUID)")
        for run_id in ids:
            _check_run_id(run_id, "wait_idle")
        timeout = check.seconds(timeout, "timeout")
        return builtins.list(await asyncio.gather(*(self._wait_terminal(r, timeout) for r in ids)))

    async def _wait_terminal(self, run_id: UUID, timeout: float) -> RunInfo:
        with contextlib.suppress(RunFailedError, RunCanceledError):
            await self.result(run_id, timeout=timeout)
        return await self.get(run_id)


async def connect(
    url: str,
    *,
    registry: Registry | None = None,
    clock: Clock | None = None,
    plugins: Iterable[object] = (),
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
    codec: PayloadCodec | None = None,
    retention: timedelta | None = None,
    idempotency_retention: timedelta | None = None,
    event_window: timedelta = DEFAULT_EVENT_WINDOW,
    **options: Any,
) -> Engine:
    """Open an engine on the backend that serves `url` (`memory://`, `postgresql://...`).

    Backends are pluggy plugins found through the `umt` entry-point group; `plugins` adds
    more without installing them. `clock` is for tests (a `umt_sdk.testing.FakeClock`);
    `tracer_provider` / `meter_provider` default to the global OpenTelemetry ones; other
    keyword arguments go to the backend.

    `codec` (a `PayloadCodec` such as `AesGcmCodec`, `ZlibCodec` or a `CodecChain` of them)
    encodes every payload before it is stored and decodes it when it is read: inputs, outputs,
    step records, facts, schedules' inputs, ledger results, error messages and tracebacks
    (see docs/codecs.md). Every process that reads the store needs the same codec (or one
    holding the same keys); idempotency keys compare the plaintext input's hash, so they keep
    working under encryption.
    `retention` (a timedelta, None: keep for ever): the engine's workers delete finished runs
    older than that (a task's `@task(retention=...)` wins for its runs), in small batches.
    `idempotency_retention` (None: for ever): how long the tombstone of a pruned run keeps its
    idempotency key taken. See docs/retention.md.
    `event_window` (default 24 h): how long a published event waits for subscribers
    registered after it; the workers delete older events (docs/writing-tasks.md).
    """
    if not isinstance(url, str) or not url:
        raise UsageError(
            f"connect() needs a backend URL such as 'memory://' (url), got {shown(url)}",
            argument="url",
        )
    check.optional(
        registry, Registry, "registry", "a Registry such as Registry([my_task])", where="connect()"
    )
    if clock is not None:
        check.clock(clock, "clock", where="connect()")
    plugins = check.collection(
        plugins, "plugins", expected="a list of plugin modules or objects", where="connect()"
    )
    check.optional(
        tracer_provider,
        TracerProvider,
        "tracer_provider",
        "an OpenTelemetry TracerProvider",
        where="connect()",
    )
    check.optional(
        meter_provider,
        MeterProvider,
        "meter_provider",
        "an OpenTelemetry MeterProvider",
        where="connect()",
    )
    if codec is not None:
        check_codec(codec)
    retention = check_retention(retention, "retention")
    idempotency_retention = check_retention(idempotency_retention, "idempotency_retention")
    event_window = check_window(event_window, "event_window")
    host = PluginHost(plugins)
    backend = await host.open_backend(url, clock=clock, options=options)
    if codec is not None:
        backend = wrap_backend(backend, codec)
    telemetry = Telemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)
    try:
        return Engine(
            backend,
            registry if registry is not None else Registry(),
            telemetry=telemetry,
            retention=retention,
            idempotency_retention=idempotency_retention,
            event_window=event_window,
        )
    except BaseException:
        await backend.close()
        raise


def _deadline(
    deadline: object, task_timeout: timedelta | None
) -> tuple[datetime | None, timedelta | None]:
    """`enqueue(deadline=...)` and the task's timeout as `NewRun.deadline_at` / `timeout`: a
    relative deadline counts, like the timeout, from the enqueue on the backend's clock."""
    if deadline is None:
        return None, task_timeout
    if isinstance(deadline, datetime):
        check.aware_datetime(deadline, "deadline")
        return deadline, task_timeout
    relative = check.duration(
        deadline,
        "deadline",
        positive=True,
        expected="a timezone-aware datetime, or a timedelta > 0 such as timedelta(hours=1), "
        "or None",
    )
    return None, relative if task_timeout is None else min(relative, task_timeout)
