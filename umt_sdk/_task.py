"""`@task`, `@step` and the `Registry`: definitions validated when decorated."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from datetime import timedelta
from typing import (
    Any,
    Concatenate,
    Generic,
    Literal,
    ParamSpec,
    Protocol,
    TypeVar,
    get_args,
    overload,
)

from attrs import field, frozen

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._attention import check_uncertain_on
from umt_sdk._check import shown
from umt_sdk._concurrency import Concurrency, check_concurrency
from umt_sdk._context import Runner, SyncTaskContext, TaskContext, current_execution
from umt_sdk._cron import CronSpec
from umt_sdk._definition import DEFAULT_MAX_LOST_LEASES, OnFailure, TaskDefinition
from umt_sdk._events import check_event_name
from umt_sdk._handlers import QueryDefinition, UpdateDefinition, check_handlers
from umt_sdk._names import check_name, check_retry, check_storable, hints, unwrap_awaitable
from umt_sdk._rate_limits import RateLimit, check_rate_limit
from umt_sdk._retry import RetryPolicy
from umt_sdk._spi import OverlapPolicy, TaskPair
from umt_sdk._steps import StepCall
from umt_sdk.exceptions import (
    NotInTaskError,
    TaskDefinitionError,
    UnknownTaskError,
    UsageError,
)

__all__ = [
    "DEFAULT_MAX_LOST_LEASES",
    "AsyncStep",
    "Registry",
    "Schedule",
    "SyncStep",
    "TaskDefinition",
    "check_schedule_name",
    "step",
    "task",
]

I = TypeVar("I")
O = TypeVar("O")
R = TypeVar("R")
P = ParamSpec("P")


class _TaskDecorator(Protocol):
    @overload
    def __call__(
        self, fn: Callable[[TaskContext[I]], Coroutine[Any, Any, O]]
    ) -> TaskDefinition[I, O]: ...
    @overload
    def __call__(self, fn: Callable[[SyncTaskContext[I]], O]) -> TaskDefinition[I, O]: ...


def task(
    name: str,
    *,
    version: int = 1,
    retry: RetryPolicy | None = None,
    max_lost_leases: int = DEFAULT_MAX_LOST_LEASES,
    retention: timedelta | None = None,
    concurrency: Concurrency[Any] | None = None,
    timeout: timedelta | None = None,
    rate_limit: RateLimit[Any] | None = None,
    on_failure: OnFailure = "fail",
    updates: Iterable[UpdateDefinition[Any, Any]] | None = None,
    queries: Iterable[QueryDefinition[Any, Any]] | None = None,
    on_event: str | None = None,
) -> _TaskDecorator:
    """Declare a durable task.

    The handler takes one argument, annotated `TaskContext[Input]` (async handler) or
    `SyncTaskContext[Input]` (plain handler, run in a thread); its return annotation is the
    output type. Bump `version` for any incompatible change and keep the old one registered
    until its runs drain.

    Args:
        name: stable name of the task.
        version: integer >= 1.
        retry: retry policy for the task and, unless they override it, its steps.
        max_lost_leases: a run fails with `LeaseLostTooOftenError` once it has lost its lease
            this many times since it last recorded a step (a worker crashed, was OOM-killed or
            froze past the lease while running it), instead of being started again: a fault
            that repeats must not loop forever. Default 10; must be >= 1.
        retention: how long this task's finished runs are kept before the workers delete
            them (a timedelta > 0); None (the default) uses `connect(retention=...)`. The
            longest of a task's versions applies to all its runs. See docs/retention.md.
        concurrency: at most `limit` runs with the same key running at once, across all
            workers (`Concurrency(key=lambda inp: inp.tenant_id, limit=2)`); the others wait
            their turn. See docs/flow-control.md.
        timeout: a run still not finished this long after its enqueue ends `failed` with
            `DeadlineExceededError`, whether it is running (its handler gets the abort
            signal, its step in progress is cut off), sleeping, waiting for a fact or still
            pending; never retried. `enqueue(deadline=...)` can set an earlier one. None (the
            default): no limit.
        rate_limit: a run starts only when a token of this limit is free, across all
            workers (`RateLimit("openai", limit=600, per=timedelta(minutes=1))`); without one
            it waits, pending and unharmed, until the next token is due. See
            docs/flow-control.md.
        on_failure: `"fail"` (the default): a run that fails for good (its retries spent)
            ends `failed`; `"compensate"`: it first runs the compensations of its completed
            steps (`ctx.step.run(..., compensate=fn)`) in reverse order and ends
            `compensated`. See docs/sagas.md.
        updates: update handlers (`@update(name)`), applied where the run calls
            `ctx.step.wait_for_update`; callers send them with `engine.update`. See
            docs/writing-tasks.md.
        queries: query handlers (`@query(name)`) over the run's query state
            (`ctx.set_query_state`); callers read them with `engine.query`.
        on_event: an event name (`"order.placed"`): every `engine.publish` of it starts one
            run of this task, with the event's payload as its input. See
            docs/writing-tasks.md#event-triggers.
    """
    check_name("task", name)
    if on_event is not None:
        check_event_name(on_event, "on_event", where=f"task {name!r}", error=TaskDefinitionError)
    if on_failure not in ("fail", "compensate"):
        raise TaskDefinitionError(
            f"task {name!r}: on_failure must be 'fail' or 'compensate', got {shown(on_failure)}",
            argument="on_failure",
        )
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise TaskDefinitionError(
            f"task {name!r}: version must be an integer >= 1, got {shown(version)}",
            argument="version",
        )
    policy = check_retry(retry, where=f"task {name!r}", error=TaskDefinitionError)
    if policy is None:
        policy = RetryPolicy()
    if (
        isinstance(max_lost_leases, bool)
        or not isinstance(max_lost_leases, int)
        or max_lost_leases < 1
    ):
        raise TaskDefinitionError(
            f"task {name!r}: max_lost_leases must be an integer >= 1 (lost leases without "
            f"progress before a run fails), got {shown(max_lost_leases)}",
            argument="max_lost_leases",
        )
    if retention is not None and (
        not isinstance(retention, timedelta)
        or retention <= timedelta(0)
        or retention > check.MAX_DURATION
    ):
        raise TaskDefinitionError(
            f"task {name!r}: retention must be a timedelta > 0 such as timedelta(days=30) "
            "(at most 36500 days: how long finished runs are kept), or None; got "
            f"{shown(retention)}",
            argument="retention",
        )
    concurrency = check_concurrency(concurrency, task_name=name)
    if on_event is not None and concurrency is not None and concurrency.strategy != "queue":
        raise TaskDefinitionError(
            f"task {name!r}: on_event needs concurrency strategy 'queue' (a publish may run in "
            f"your transaction, which cannot cancel other runs), got {concurrency.strategy!r}",
            argument="on_event",
        )
    rate_limit = check_rate_limit(rate_limit, task_name=name)

    if timeout is not None:
        _check_timeout(timeout, where=f"task {name!r}")

    def decorate(fn: Callable[..., Any]) -> TaskDefinition[Any, Any]:
        if isinstance(fn, TaskDefinition):
            raise TaskDefinitionError(f"{fn!r} is already a task; apply @task once", argument="fn")
        if not callable(fn):
            raise TaskDefinitionError(
                f"@task({name!r}) must decorate a function (fn), got {shown(fn)}", argument="fn"
            )
        is_async = inspect.iscoroutinefunction(fn)
        params = list(inspect.signature(fn).parameters.values())
        if len(params) != 1:
            raise TaskDefinitionError(
                f"task {name!r}: the handler takes exactly one parameter, the context "
                f"(ctx: TaskContext[Input]); {fn.__qualname__} takes {len(params)}"
            )
        found = hints(fn)
        ctx_hint = found.get(params[0].name)
        expected = TaskContext if is_async else SyncTaskContext
        origin = typing.get_origin(ctx_hint) or ctx_hint
        if origin is not expected:
            raise TaskDefinitionError(
                f"task {name!r}: annotate the parameter as "
                f"{expected.__name__}[YourInput] ({'async' if is_async else 'plain'} handler); "
                f"got {ctx_hint!r}"
            )
        args = typing.get_args(ctx_hint)
        input_type = args[0] if args else Any
        output_type = found.get("return", Any)
        check_storable(input_type, f"task {name!r}: the input type of {fn.__qualname__}")
        check_storable(output_type, f"task {name!r}: the output type of {fn.__qualname__}")
        by_update, by_query = check_handlers(name, is_async, updates, queries)
        return TaskDefinition(
            name=name,
            version=version,
            fn=fn,
            is_async=is_async,
            input_type=input_type,
            output_type=output_type,
            retry=policy,
            max_lost_leases=max_lost_leases,
            retention=retention,
            concurrency=concurrency,
            timeout=timeout,
            rate_limit=rate_limit,
            on_failure=on_failure,
            updates=by_update,
            queries=by_query,
            on_event=on_event,
        )

    return typing.cast(_TaskDecorator, decorate)


def _check_timeout(timeout: object, *, where: str) -> None:
    """A timeout of a declaration: a positive timedelta, else `TaskDefinitionError`."""
    try:
        check.duration(
            timeout,
            "timeout",
            positive=True,
            expected="a timedelta > 0 such as timedelta(minutes=5), or None",
            where=where,
        )
    except UsageError as exc:
        raise TaskDefinitionError(str(exc), argument="timeout") from None


class _StepBase(Generic[P, R]):
    def __init__(
        self,
        name: str,
        fn: Callable[P, Any],
        retry: RetryPolicy | None,
        timeout: timedelta | None = None,
        transactional: bool = False,
        uncertain_on: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.name = name
        self.fn = fn
        self.retry = retry
        self.timeout = timeout
        self.transactional = transactional
        self.uncertain_on = uncertain_on
        self.output_type = unwrap_awaitable(hints(fn).get("return", Any))
        check_storable(self.output_type, f"step {name!r}: the return type of {fn.__qualname__}")
        functools.update_wrapper(typing.cast(Any, self), fn)
        # What `ctx.step.run(name, this, ...)` runs instead (see `_names.inline_target`).
        self.__umt_step__ = (fn, self.output_type, retry, timeout)
        self.__umt_uncertain_on__ = uncertain_on
        # Which of `ctx.step.run` / `ctx.step.transaction` may run it (`_names.check_step_kind`).
        self.__umt_transactional__ = transactional

    def __repr__(self) -> str:
        return f"<step {self.name!r} ({self.fn.__qualname__})>"

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepCall:
        return StepCall(
            name=self.name,
            fn=self.fn,
            args=args,
            kwargs=kwargs,
            retry=self.retry,
            output_type=self.output_type,
            timeout=self.timeout,
            transactional=self.transactional,
            uncertain_on=self.uncertain_on,
        )


def _current_or_raise(step_name: str) -> Runner:
    execution = current_execution()
    if execution is None:
        raise NotInTaskError(
            f"step {step_name!r} was called outside a running task; steps run only inside a "
            "@task handler (call the plain function directly if you need it elsewhere)"
        )
    return execution


class AsyncStep(_StepBase[P, R]):
    """A step over an async function: `await` it inside an async task."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R]:
        execution = _current_or_raise(self.name)
        if execution.in_handler_thread():
            raise TaskDefinitionError(
                f"async step {self.name!r} called from a plain task; use "
                "ctx.step.run(name, fn, ...) there, which runs it on the event loop"
            )
        result: Awaitable[R] = execution.steps.run(self._call(args, kwargs))
        return result


class SyncStep(_StepBase[P, R]):
    """A step over a plain function.

    From a plain task, call it: `fetch(x)`. From an async task, await it: `await fetch.aio(x)`
    (typed), or `await fetch(x)` (works the same; its body runs in a thread).
    """

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        execution = _current_or_raise(self.name)
        steps = execution.steps
        if execution.in_handler_thread():
            value: R = steps.from_thread(steps.run(self._call(args, kwargs)))
            return value
        # From an async task the result is awaited (see the class docstring).
        return typing.cast(R, steps.run(self._call(args, kwargs)))

    def aio(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R]:
        """The typed form for async tasks: the body runs in a thread, the result is awaited."""
        execution = _current_or_raise(self.name)
        result: Awaitable[R] = execution.steps.run(self._call(args, kwargs))
        return result


class _StepDecorator(Protocol):
    @overload
    def __call__(  # type: ignore[overload-overlap]  # async functions match the first
        self, fn: Callable[P, Coroutine[Any, Any, R]]
    ) -> AsyncStep[P, R]: ...
    @overload
    def __call__(self, fn: Callable[P, R]) -> SyncStep[P, R]: ...


class _TransactionalStepDecorator(Protocol):
    def __call__(
        self, fn: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]
    ) -> AsyncStep[P, R]: ...


@overload
def step(
    name: str,
    *,
    retry: RetryPolicy | None = None,
    timeout: timedelta | None = None,
    transactional: Literal[False] = False,
    uncertain_on: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> _StepDecorator: ...
@overload
def step(
    name: str,
    *,
    retry: RetryPolicy | None = None,
    timeout: timedelta | None = None,
    transactional: Literal[True],
    uncertain_on: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> _TransactionalStepDecorator: ...
def step(
    name: str,
    *,
    retry: RetryPolicy | None = None,
    timeout: timedelta | None = None,
    transactional: bool = False,
    uncertain_on: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> _StepDecorator | _TransactionalStepDecorator:
    """Declare a named step. Inside a task it runs once per run; replays return its record.

    Args:
        name: stable within the task's version: replay matches steps by name. Calling the same
            name again in one execution records `name#2`, `name#3`, ...
        retry: overrides the task's retry policy for this step.
        timeout: how long one attempt may run: past it an async body is cancelled, a plain
            one (a thread cannot be killed) is left to finish on its own and its result
            ignored, and the attempt fails with `StepTimeoutError`, retried per the step's
            policy. None (the default): no limit.
        transactional: the step's writes on the engine's own database commit in the
            transaction that records it (`ctx.step.transaction`): the function is async and
            takes that transaction (`tx`) first, and callers pass the rest:
            `@step("debit", transactional=True) async def debit(tx, account, amount)` is
            called `await debit(account, amount)`.
        uncertain_on: an exception class (or a tuple of them, such as `(TimeoutError,)`)
            after which the step's outcome is unknown: an attempt that fails so parks the run
            in `needs_attention` until an operator settles it (`engine.settle`), instead of
            being retried or failed.
    """
    check_name("step", name)
    uncertain = (
        check_uncertain_on(uncertain_on, where=f"step {name!r}", error=TaskDefinitionError)
        if uncertain_on != ()
        else ()
    )
    check_retry(retry, where=f"step {name!r}", error=TaskDefinitionError)
    if timeout is not None:
        _check_timeout(timeout, where=f"step {name!r}")
    if not isinstance(transactional, bool):
        raise TaskDefinitionError(
            f"@step({name!r}): transactional must be True or False, got {shown(transactional)}",
            argument="transactional",
        )
    if transactional and uncertain:
        raise TaskDefinitionError(
            f"@step({name!r}): uncertain_on= cannot go with transactional=True: a transactional "
            "step's writes commit with its record or not at all, so its outcome is never "
            "unknown; drop uncertain_on=",
            argument="uncertain_on",
        )

    def decorate(fn: Callable[..., Any]) -> _StepBase[Any, Any]:
        if isinstance(fn, _StepBase | TaskDefinition) or not callable(fn):
            raise TaskDefinitionError(
                f"@step({name!r}) must decorate a plain or async function (fn), got {shown(fn)}",
                argument="fn",
            )
        if transactional:
            if not inspect.iscoroutinefunction(fn):
                raise TaskDefinitionError(
                    f"@step({name!r}, transactional=True) must decorate an async function "
                    f"taking the transaction first (async def {getattr(fn, '__name__', 'fn')}(tx, "
                    "...)), got "
                    f"{shown(fn)}",
                    argument="fn",
                )
            return AsyncStep(name, fn, retry, timeout, transactional=True)
        if inspect.iscoroutinefunction(fn):
            return AsyncStep(name, fn, retry, timeout, uncertain_on=uncertain)
        return SyncStep(name, fn, retry, timeout, uncertain_on=uncertain)

    if transactional:
        return typing.cast(_TransactionalStepDecorator, decorate)
    return typing.cast(_StepDecorator, decorate)


class Registry:
    """The tasks a process knows: used to validate enqueues and to serve workers; and the
    schedules it declares (`schedules=[Schedule(...)]`), which its workers store and run."""

    def __init__(
        self,
        tasks: Iterable[TaskDefinition[Any, Any]] = (),
        *,
        schedules: Iterable[Schedule[Any]] = (),
    ) -> None:
        self._tasks: dict[TaskPair, TaskDefinition[Any, Any]] = {}
        # The same definitions by plain (name, version): `get` runs twice per run.
        self._by_key: dict[tuple[str, int], TaskDefinition[Any, Any]] = {}
        self._schedules: dict[str, Schedule[Any]] = {}
        if isinstance(tasks, TaskDefinition):
            raise TaskDefinitionError(
                f"Registry(tasks) takes a list of definitions, got one ({tasks!r}): wrap it in "
                "a list",
                argument="tasks",
            )
        try:
            definitions = check.collection(
                tasks, "tasks", expected="a list of @task-decorated definitions", where="Registry"
            )
        except UsageError as exc:  # a declaration: the registry's own error class
            raise TaskDefinitionError(str(exc), argument="tasks") from None
        for definition in definitions:
            if not isinstance(definition, TaskDefinition):
                raise TaskDefinitionError(
                    "Registry(tasks) takes @task-decorated definitions, got "
                    f"{shown(definition)} in tasks; decorate the function with "
                    "@task(name, version=...)",
                    argument="tasks",
                )
            self.add(definition)
        if isinstance(schedules, str) or not isinstance(schedules, Iterable):
            raise TaskDefinitionError(
                "Registry(schedules=...) takes a list of Schedule(...) declarations, got "
                f"{shown(schedules)}",
                argument="schedules",
            )
        for declared in schedules:
            self.add_schedule(declared)

    def add_schedule(self, schedule: Schedule[Any]) -> None:
        """Declare a `Schedule` of a registered task (its workers store it and run it)."""
        if not isinstance(schedule, Schedule):
            raise TaskDefinitionError(
                f"Registry: schedules must be Schedule(...) declarations, got {shown(schedule)}",
                argument="schedules",
            )
        task = schedule.task
        if isinstance(task, TaskDefinition):
            if self._tasks.get(task.pair) is not task:
                raise TaskDefinitionError(
                    f"schedule {schedule.name!r}: its task {task.pair} is not registered; add "
                    "its @task definition to the registry's tasks",
                    argument="schedules",
                )
        else:
            self.latest(task)  # UnknownTaskError, naming what is registered
        existing = self._schedules.get(schedule.name)
        if existing is not None and existing != schedule:
            raise TaskDefinitionError(
                f"schedule {schedule.name!r} is declared twice, differently; give each "
                "schedule its own name",
                argument="schedules",
            )
        self._schedules[schedule.name] = schedule

    def schedules(self) -> list[Schedule[Any]]:
        """The declared schedules (`Schedule`), by name."""
        return [self._schedules[name] for name in sorted(self._schedules)]

    def add(self, definition: TaskDefinition[Any, Any]) -> None:
        """Register a task definition."""
        if not isinstance(definition, TaskDefinition):
            raise TaskDefinitionError(
                f"Registry.add(definition) takes @task-decorated definitions, got "
                f"{shown(definition)}; "
                "decorate the function with @task(name, version=...)",
                argument="definition",
            )
        existing = self._tasks.get(definition.pair)
        if existing is not None and existing is not definition:
            raise TaskDefinitionError(
                f"{definition.pair} is registered twice ({existing.fn.__qualname__} and "
                f"{definition.fn.__qualname__}); bump the version of the new one"
            )
        self._tasks[definition.pair] = definition
        self._by_key[(definition.name, definition.version)] = definition

    def __iter__(self) -> typing.Iterator[TaskDefinition[Any, Any]]:
        return iter(sorted(self._tasks.values(), key=lambda d: (d.name, d.version)))

    def __len__(self) -> int:
        return len(self._tasks)

    def pairs(self) -> list[TaskPair]:
        return sorted(self._tasks)

    def get(self, name: str, version: int) -> TaskDefinition[Any, Any]:
        if type(name) is str and type(version) is int:
            found = self._by_key.get((name, version))
            if found is not None:  # a registered pair: the checks below pass for it
                return found
        check.text(name, "name", empty=False, max_length=200, where="Registry.get")
        check.integer(version, "version", at_least=1, where="Registry.get")
        definition = self._tasks.get(TaskPair(name=name, version=version))
        if definition is None:
            known = ", ".join(str(p) for p in self.pairs()) or "none"
            raise UnknownTaskError(
                f"task {name}@{version} is not registered (registered: {known})", task_name=name
            )
        return definition

    def latest(self, name: str) -> TaskDefinition[Any, Any]:
        check.text(name, "name", where="Registry.latest")
        versions = [d for p, d in self._tasks.items() if p.name == name]
        if not versions:
            known = ", ".join(sorted({p.name for p in self._tasks})) or "none"
            raise UnknownTaskError(
                f"no task named {name!r} is registered (registered: {known})", task_name=name
            )
        return max(versions, key=lambda d: d.version)

    def resolve(
        self, ref: TaskDefinition[Any, Any] | str, version: int | None = None
    ) -> TaskDefinition[Any, Any]:
        """The definition new runs of `ref` use: the newest version unless `version` pins one.

        `ref` is a definition, `"name"` or `"name@version"`. A definition that is not the newest
        registered version is refused unless pinned with `version=`, so a stale import cannot
        start runs on old code by accident.
        """
        if version is not None:
            check.integer(version, "version", at_least=1, where="Registry.resolve")
        if isinstance(ref, TaskDefinition):
            if version is None:
                newest = self.latest(ref.name)
                if newest.version != ref.version:
                    raise TaskDefinitionError(
                        f"{ref.pair} is not the newest registered version of {ref.name!r} "
                        f"({newest.pair}); new runs use the newest. Pass version="
                        f"{ref.version} to pin the old one on purpose"
                    )
            elif version != ref.version:
                raise TaskDefinitionError(
                    f"version={version} conflicts with the definition passed ({ref.pair}); "
                    f"pass the @{version} definition itself, or '{ref.name}@{version}'"
                )
            return self.get(ref.name, ref.version)
        if not isinstance(ref, str):
            raise TaskDefinitionError(
                f"Registry.resolve(ref): expected a task definition or a task name, got "
                f"{shown(ref)}",
                argument="ref",
            )
        if "@" in ref:
            try:
                pair = TaskPair.parse(ref)
            except ValueError as exc:  # as in select(): a misused reference, not a bad value
                raise TaskDefinitionError(_reference_error(ref), argument="ref") from exc
            if version is not None and version != pair.version:
                raise TaskDefinitionError(f"{ref!r} conflicts with version={version}")
            return self.get(pair.name, pair.version)
        return self.latest(ref) if version is None else self.get(ref, version)

    def select(
        self, versions: Sequence[str | TaskDefinition[Any, Any] | TaskPair] | None
    ) -> list[TaskPair]:
        """The pairs a worker serves: all registered, or exactly those named (each checked)."""
        if versions is None:
            return self.pairs()
        if isinstance(versions, str):
            raise TaskDefinitionError(
                f"versions must be a list such as [{versions!r}], not a single string",
                argument="versions",
            )
        try:
            items = check.collection(
                versions,
                "versions",
                expected="a list of 'name@version' strings, task definitions or TaskPairs, or "
                "None for every registered one",
            )
        except UsageError as exc:
            raise TaskDefinitionError(str(exc), argument="versions") from None
        selected: set[TaskPair] = set()
        for item in items:
            if isinstance(item, TaskDefinition):
                pair = item.pair
            elif isinstance(item, TaskPair):
                pair = item
            elif isinstance(item, str):
                try:
                    pair = TaskPair.parse(item)
                except ValueError as exc:
                    raise TaskDefinitionError(
                        f"versions: {_reference_error(item)}", argument="versions"
                    ) from exc
            else:
                raise TaskDefinitionError(
                    "versions must hold 'name@version' strings, task definitions or TaskPairs, "
                    f"got {shown(item)} in it",
                    argument="versions",
                )
            self.get(pair.name, pair.version)
            selected.add(pair)
        if not selected:
            raise TaskDefinitionError("a worker needs at least one task@version to serve")
        return sorted(selected)


def _reference_error(text: str) -> str:
    return f"expected 'task_name@version' such as 'submit_download@2', got {text!r}"


# -- schedules ------------------------------------------------------------------------------------


_OVERLAPS: frozenset[str] = frozenset(get_args(OverlapPolicy))


def check_schedule_name(name: object, *, where: str) -> str:
    try:
        return check_name("schedule", name, argument="name")
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}", argument="name") from None


@frozen(kw_only=True)
class Schedule(Generic[I]):
    """A cron schedule that starts runs of `task`: declared in code or created at run time.

    Declare it in the registry, `Registry([sync_all], schedules=[nightly])`, and every worker
    that serves the task stores it (idempotently) and starts its runs; or create it at run time
    with `await engine.schedules.create(nightly)`. Everything is checked here, at construction.

    Args:
        name: the schedule's unique, stable name (letters, digits and `_ . : - /`).
        task: the `@task` definition its runs start (the newest registered version is used),
            or a task name (checked against the registry when the schedule is stored).
        cron: a cron expression, five fields (`"0 3 * * *"`: 03:00 every day), or six with
            seconds first; parsed by cronsim.
        input: the input of every run (an instance of the task's input type, or its JSON form).
        timezone: the IANA time zone the expression is read in (`"Europe/Paris"`); DST gaps
            and repeats are handled as `umt_sdk._cron` says (docs/schedules.md).
        overlap: what a tick does while the previous run of the schedule has not finished:
            `skip` (default), `buffer_one`, `allow_all` or `cancel_previous`.
        catchup_window: after downtime, missed ticks this recent are all started; the last
            missed tick always is. `timedelta(0)` (default): only the last one.
        paused: create it paused (a later declaration never pauses or resumes it).
    """

    name: str
    task: TaskDefinition[I, Any] | str
    cron: str
    input: I
    timezone: str = "UTC"
    overlap: OverlapPolicy = "skip"
    catchup_window: timedelta = timedelta(0)
    paused: bool = False
    _spec: CronSpec = field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        where = f"Schedule({self.name!r})" if isinstance(self.name, str) else "Schedule"
        check_schedule_name(self.name, where="Schedule")
        if not isinstance(self.task, TaskDefinition | str):
            check.refuse("task", "a @task definition or a task name", self.task, where=where)
        if isinstance(self.task, str):
            check_name("task", self.task, argument="task")
        spec = CronSpec.parse(self.cron, self.timezone, where=where)
        check.choice(self.overlap, "overlap", _OVERLAPS, where=where)
        check.duration(self.catchup_window, "catchup_window", where=where)
        check.flag(self.paused, "paused", where=where)
        if isinstance(self.task, TaskDefinition):
            _serde.encode_input(
                self.input, self.task.input_type, what=f"input of schedule {self.name!r}"
            )
        object.__setattr__(self, "_spec", spec)

    @property
    def task_name(self) -> str:
        return self.task.name if isinstance(self.task, TaskDefinition) else self.task
