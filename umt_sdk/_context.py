"""What a running handler sees: `TaskContext` (async handlers) and `SyncTaskContext` (plain)."""

from __future__ import annotations

import asyncio
import logging
import sys
import warnings
from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import Any, Generic, Literal, Protocol, TypeVar, overload
from uuid import UUID

from umt_sdk import _check as check
from umt_sdk._abort import Aborts, AbortState, Release
from umt_sdk._attention import check_uncertain_on
from umt_sdk._cron import tick_of_key
from umt_sdk._definition import TaskDefinition
from umt_sdk._names import (
    check_callback_arguments,
    check_name,
    check_run_arguments,
    check_sleep_arguments,
    check_type_argument,
    check_wait_arguments,
)
from umt_sdk._patches import CallSite, PatchCheck
from umt_sdk._rate_limits import RateLimit, check_step_rate_limit
from umt_sdk._retry import RetryPolicy
from umt_sdk._spi import ClaimedRun
from umt_sdk._steps import StepCall, Steps
from umt_sdk._streams import StreamApi, StreamWriter, SyncStreamApi
from umt_sdk._updates import QUERY_STATE_STREAM, AppliedUpdate, wait_for_update
from umt_sdk.exceptions import (
    CanceledError,
    ChildCanceledError,
    ChildFailedError,
    DeadlineExceededError,
    UsageError,
)

__all__ = [
    "ChildError",
    "ChildHandle",
    "ParentClose",
    "Runner",
    "SyncChildHandle",
    "StepApi",
    "SyncStepApi",
    "SyncTaskContext",
    "TaskContext",
    "current_execution",
]

I = TypeVar("I")
C = TypeVar("C")
O = TypeVar("O")
R = TypeVar("R")
T = TypeVar("T")


class Runner(Protocol):
    """What a task's context asks of the execution running it (`_execution.Execution`): the
    one arrow between the two runs from the execution to the context, never back. Steps,
    sleeps and fact waits go to the execution's `Steps` directly."""

    @property
    def claimed(self) -> ClaimedRun: ...
    @property
    def trace_id(self) -> str: ...
    @property
    def logger(self) -> logging.LoggerAdapter[logging.Logger]: ...
    @property
    def aborts(self) -> Aborts: ...
    @property
    def steps(self) -> Steps: ...
    @property
    def streams(self) -> StreamWriter: ...
    @property
    def definition(self) -> TaskDefinition[Any, Any]: ...

    def in_handler_thread(self) -> bool: ...


_CURRENT: ContextVar[Runner | None] = ContextVar("umt_current_execution", default=None)


def current_execution() -> Runner | None:
    """The execution running in this context, if any."""
    return _CURRENT.get()


class StepApi:
    """`ctx.step` in an async task: inline steps, durable sleeps and fact waits."""

    __slots__ = ("_context", "_steps")

    def __init__(self, steps: Steps, context: TaskContext[Any] | None = None) -> None:
        self._steps = steps
        self._context = context

    @overload
    def run(
        self,
        name: str,
        fn: Callable[..., Awaitable[R]],
        /,
        *args: Any,
        retry: RetryPolicy | None = None,
        output_type: Any = None,
        timeout: timedelta | None = None,
        rate_limit: str | RateLimit[Any] | None = None,
        rate_limit_key: str | None = None,
        compensate: Callable[..., Any] | None = None,
        uncertain_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        **kwargs: Any,
    ) -> Awaitable[R]: ...
    @overload
    def run(
        self,
        name: str,
        fn: Callable[..., R],
        /,
        *args: Any,
        retry: RetryPolicy | None = None,
        output_type: Any = None,
        timeout: timedelta | None = None,
        rate_limit: str | RateLimit[Any] | None = None,
        rate_limit_key: str | None = None,
        compensate: Callable[..., Any] | None = None,
        uncertain_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        **kwargs: Any,
    ) -> Awaitable[R]: ...
    def run(
        self,
        name: str,
        fn: Callable[..., Any],
        /,
        *args: Any,
        retry: RetryPolicy | None = None,
        output_type: Any = None,
        timeout: timedelta | None = None,
        rate_limit: str | RateLimit[Any] | None = None,
        rate_limit_key: str | None = None,
        compensate: Callable[..., Any] | None = None,
        uncertain_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        **kwargs: Any,
    ) -> Awaitable[Any]:
        """Run `fn(*args, **kwargs)` as the step `name` (a plain `fn` runs in a thread).

        The step returns what its record decodes to, the same on every execution: the output
        type is `fn`'s return annotation, or `output_type` (for a lambda); without either, only
        JSON's own types (str, int, float, bool, None, list, dict) may be returned.
        `timeout`: how long one attempt may run; past it an async `fn` is cancelled, a plain
        one (a thread cannot be killed) is left to finish on its own and its result ignored,
        and the attempt fails with `StepTimeoutError`, retried per the step's policy.
        `rate_limit`: a rate limit's name (stored: `engine.rate_limits.set`) or a `RateLimit`
        (stored if it is not): each attempt takes one token of it before `fn` runs, once, on
        any worker; without a free token the step waits for the next one (a wait of more
        than a second parks the run, freeing the worker's slot, and the step asks again when
        it is resumed). `rate_limit_key` names the bucket (one per tenant); without it, the
        limit's one bucket. An unknown name fails the run with `UsageError`.
        `compensate`: a function that undoes the step, registered with its record: when the
        run compensates (`raise Compensate(...)`, or `@task(on_failure="compensate")`), the
        compensations of its completed steps run in reverse order, each as the durable step
        `umt.compensate:<name>`, called with the step's output (or with nothing if it takes
        no parameter). See docs/sagas.md.
        `uncertain_on`: an exception class (or a tuple of them, such as `(TimeoutError,)`)
        after which the step's outcome is unknown (the call may have happened): an attempt
        that fails so is neither retried nor failed; the run parks in `needs_attention` until
        an operator settles it (`engine.settle`, `umt runs settle`): done with the step's
        output (the step is not run again), or not done (it runs again). See
        docs/writing-tasks.md.
        The keywords `retry`, `output_type`, `timeout`, `rate_limit`, `rate_limit_key`,
        `compensate` and `uncertain_on` are taken by umt; pass a lambda if `fn` has a
        parameter of one of those names. `fn` may be a step declared `@step(...)`, not one
        declared `@step(..., transactional=True)` (`UsageError`: use `transaction` for it).
        """
        check_run_arguments(name, fn, retry, output_type, timeout, compensate)
        check_step_rate_limit(name, rate_limit, rate_limit_key)
        call = StepCall.inline(
            name,
            fn,
            args,
            kwargs,
            retry=retry,
            output_type=output_type,
            timeout=timeout,
            rate_limit=rate_limit,
            rate_limit_key=rate_limit_key,
            compensate=compensate,
            uncertain_on=_uncertain_on(name, uncertain_on),
        )
        return self._steps.run(call)

    @overload
    def transaction(
        self,
        name: str,
        fn: Callable[..., Awaitable[R]],
        /,
        *args: Any,
        retry: RetryPolicy | None = None,
        output_type: Any = None,
        timeout: timedelta | None = None,
        rate_limit: str | RateLimit[Any] | None = None,
        rate_limit_key: str | None = None,
        compensate: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Awaitable[R]: ...
    @overload
    def transaction(
        self,
        name: str,
        fn: Callable[..., R],
        /,
        *args: Any,
        retry: RetryPolicy | None = None,
        output_type: Any = None,
        timeout: timedelta | None = None,
        rate_limit: str | RateLimit[Any] | None = None,
        rate_limit_key: str | None = None,
        compensate: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Awaitable[R]: ...
    def transaction(
        self,
        name: str,
        fn: Callable[..., Any],
        /,
        *args: Any,
        retry: RetryPolicy | None = None,
        output_type: Any = None,
        timeout: timedelta | None = None,
        rate_limit: str | RateLimit[Any] | None = None,
        rate_limit_key: str | None = None,
        compensate: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Awaitable[Any]:
        """Run `fn(tx, *args, **kwargs)` as the transactional step `name`: its writes through
        `tx` commit in the one transaction that records the step, so they land exactly once,
        with no op key (see docs/writing-tasks.md, "Transactional steps").

        `tx` is the transaction on the engine's own database: a `psycopg.AsyncConnection`
        inside it on Postgres (READ COMMITTED), a `MemoryTransaction` on the memory backend
        (`engine.backend.store`). The run is fenced before `fn` runs and again atomically
        with the commit: a stale execution gets `FencingError` and nothing of it lands. If
        `fn` raises, nothing lands and the step is retried by its policy; a serialization
        failure or a deadlock runs the transaction again at once (a few times). A replay
        returns the recorded output without calling `fn`. `retry`, `output_type`, `timeout`,
        `rate_limit`, `rate_limit_key` and `compensate` as for `run`: each attempt takes its
        token before its transaction begins (a transaction run again after a conflict is the
        same attempt and takes none), and the compensation runs only if the step's
        transaction committed; a compensation declared `@step(..., transactional=True)` runs
        as a transactional step too, so the undo commits exactly once as well. On a backend
        that cannot commit a step's writes with its record, the run fails with `UsageError`
        and nothing is stored. `fn` may be a function declared
        `@step(..., transactional=True)`, not a plain step (`UsageError`).
        """
        check_run_arguments(name, fn, retry, output_type, timeout, compensate, transactional=True)
        check_step_rate_limit(name, rate_limit, rate_limit_key)
        call = StepCall.inline(
            name,
            fn,
            args,
            kwargs,
            retry=retry,
            output_type=output_type,
            timeout=timeout,
            rate_limit=rate_limit,
            rate_limit_key=rate_limit_key,
            compensate=compensate,
            transactional=True,
        )
        return self._steps.run(call)

    async def sleep(self, name: str, duration: timedelta) -> None:
        """Sleep durably: the run is parked and its slot released until `duration` has passed."""
        check_sleep_arguments(name, duration)
        await self._steps.sleep(name, duration)

    async def wait_for_fact(
        self,
        name: str,
        *,
        timeout: timedelta | None = None,
        check: Callable[[], Any] | None = None,
        payload_type: type[T] | Any = Any,
        poll_interval: timedelta | None = None,
    ) -> T:
        """Wait durably for the fact `name` (sent with `engine.signal` or `engine.broadcast`).

        Each round first calls `check()` (plain or async; a non-None result is the fact, for
        facts that live in business tables), then looks for a stored fact, then parks the run
        until a fact arrives, `poll_interval` passes (to call `check` again) or `timeout` ends
        (then `FactTimeoutError`, recorded, so replays raise it too).
        """
        check_wait_arguments(
            name, timeout=timeout, check_fn=check, payload_type=payload_type, poll=poll_interval
        )
        value: T = await self._steps.wait_for_fact(
            name, timeout=timeout, check=check, payload_type=payload_type, poll=poll_interval
        )
        return value

    async def callback_token(self, name: str, *, timeout: timedelta) -> str:
        """Mint an unguessable, single-use token for the callback `name`, as a step: a replay
        returns the same token. Hand it to whoever completes it (`engine.complete_callback(
        token, payload)`), then `wait_for_callback(token)`. It expires `timeout` from now."""
        check_callback_arguments(name, timeout)
        return await self._steps.callback_token(name, timeout)

    async def wait_for_callback(self, token: str, *, payload_type: type[T] | Any = Any) -> T:
        """Wait durably (the run parked, no slot held) until `token` is completed, and return
        its payload; a completion that came first is kept and returned at once. Past the
        token's expiry: `CallbackTimeoutError` (recorded, so replays raise it too)."""
        check_type_argument(payload_type, "payload_type", where="wait_for_callback()")
        value: T = await self._steps.wait_for_callback(token, payload_type)
        return value

    async def wait_for_update(self, *names: str, timeout: timedelta | None = None) -> AppliedUpdate:
        """Apply the updates callers sent (`engine.update`), in the order they were sent,
        until one named in `names` (any update, when none is named) has been applied without
        its handler raising, and return it. The run is parked (slot freed) while no update is
        stored. Each update's handler runs here and its result is recorded, then returned to
        its caller; a replay applies them again at this same point. Past `timeout`, counted
        from this call: `UpdateTimeoutError` (recorded, so replays raise it too)."""
        for name in names:
            check_name("update", name, argument="names")
        if timeout is not None:
            check.duration(timeout, "timeout", positive=True, where="wait_for_update()")
        context = self._context
        assert context is not None  # set by TaskContext
        return await wait_for_update(
            context, self._steps, context._execution.definition, names, timeout
        )

    async def start_child(
        self,
        name: str,
        task: TaskDefinition[C, O],
        input: C | Any,
        *,
        priority: int | None = None,
        parent_close: ParentClose = "cancel",
    ) -> ChildHandle[O]:
        """Start a run of `task` as this run's child, exactly once: the step `name` enqueues
        it (its idempotency key is this run and the step's name, so a crash before the step
        was recorded finds the same child) and records its id. `priority` defaults to this
        run's. `parent_close="cancel"` (the default) requests the child's cancel when this
        run finishes failed or canceled; `"abandon"` lets it go on. Returns a handle:
        `await handle.result()` for the child's output."""
        definition, cancel_with_parent = _check_child_arguments(name, task, priority, parent_close)
        child_id = await self._steps.start_child(
            name,
            definition,
            input,
            priority=priority,
            cancel_with_parent=cancel_with_parent,
        )
        return ChildHandle(self._steps, name, child_id, definition.output_type)

    @overload
    async def map(
        self,
        name: str,
        task: TaskDefinition[C, O],
        inputs: Iterable[C],
        *,
        max_concurrency: int | None = None,
        priority: int | None = None,
        parent_close: ParentClose = "cancel",
        return_exceptions: Literal[False] = False,
    ) -> list[O]: ...
    @overload
    async def map(
        self,
        name: str,
        task: TaskDefinition[C, O],
        inputs: Iterable[C],
        *,
        max_concurrency: int | None = None,
        priority: int | None = None,
        parent_close: ParentClose = "cancel",
        return_exceptions: Literal[True],
    ) -> list[O | ChildError]: ...
    async def map(
        self,
        name: str,
        task: TaskDefinition[C, O],
        inputs: Iterable[C],
        *,
        max_concurrency: int | None = None,
        priority: int | None = None,
        parent_close: ParentClose = "cancel",
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Run `task` once per input as children of this run and return their outputs in
        input order.

        The step `name` starts every child exactly once (a crash before it was recorded finds
        the same children); then this run parks, its worker slot freed, and is woken **once**,
        by the write that finishes the last child. `max_concurrency`: at most that many
        children running or claimable at once; the others wait their turn, in input order,
        and the store lets the next one run in the write that finishes one (nothing in this
        run polls or wakes for it). When some children fail or are canceled,
        `ChildrenFailedError` carries every child's outcome (`results`, `errors`); with
        `return_exceptions=True` the list holds the `ChildFailedError` or `ChildCanceledError`
        of those children instead. `priority` and `parent_close` as for `start_child`.
        """
        definition, items, cancel_with_parent = _check_map_arguments(
            name, task, inputs, max_concurrency, priority, parent_close, return_exceptions
        )
        return await self._steps.map(
            name,
            definition,
            items,
            max_concurrency=max_concurrency,
            priority=priority,
            cancel_with_parent=cancel_with_parent,
            return_exceptions=return_exceptions,
        )

    @overload
    async def gather(
        self,
        name: str,
        handles: Iterable[ChildHandle[O]],
        *,
        return_exceptions: Literal[False] = False,
    ) -> list[O]: ...
    @overload
    async def gather(
        self, name: str, handles: Iterable[ChildHandle[O]], *, return_exceptions: Literal[True]
    ) -> list[O | ChildError]: ...
    async def gather(
        self, name: str, handles: Iterable[ChildHandle[O]], *, return_exceptions: bool = False
    ) -> list[Any]:
        """Wait for every child of `handles` (from `start_child`) and return their outputs in
        the order of `handles`: this run parks once and is woken once, by the write that
        finishes the last of them (not once per child). Failures as for `map`. The wait is
        the step `name` (replays return or raise from its record). A child may be in one
        gather at a time."""
        members = _check_gather_arguments(name, handles, return_exceptions)
        return await self._steps.gather(name, members, return_exceptions=return_exceptions)


class ChildHandle(Generic[O]):
    """A child run started by `ctx.step.start_child`: `await handle.result()` parks this run
    until the child finishes (its slot is freed meanwhile) and returns the child's output, or
    raises `ChildFailedError` / `ChildCanceledError`; replays return or raise the same."""

    __slots__ = ("_name", "_output_type", "_steps", "run_id")

    def __init__(self, steps: Steps, name: str, run_id: UUID, output_type: Any) -> None:
        self._steps = steps
        self._name = name
        self._output_type = output_type
        self.run_id = run_id

    async def result(self) -> O:
        value: O = await self._steps.child_result(self._name, self.run_id, self._output_type)
        return value

    def __repr__(self) -> str:
        return f"<child run {self.run_id} started by step {self._name!r}>"


class SyncChildHandle(Generic[O]):
    """`ChildHandle` in a plain task: `handle.result()` blocks the handler's thread while the
    run is parked."""

    __slots__ = ("_handle", "run_id")

    def __init__(self, handle: ChildHandle[O]) -> None:
        self._handle = handle
        self.run_id = handle.run_id

    def result(self) -> O:
        value: O = self._handle._steps.from_thread(self._handle.result())
        return value

    def __repr__(self) -> str:
        return repr(self._handle)


ParentClose = Literal["cancel", "abandon"]
"""What a child does when its parent finishes failed or canceled: `cancel` (its cancel is
requested) or `abandon` (it goes on)."""


def _uncertain_on(name: str, value: object) -> tuple[type[BaseException], ...] | None:
    """`ctx.step.run(..., uncertain_on=...)`: None keeps a decorated step's own."""
    if value is None:
        return None
    return check_uncertain_on(value, where=f"step {name!r}", error=UsageError)


def _check_child_arguments(
    name: str, task: object, priority: object, parent_close: object
) -> tuple[TaskDefinition[Any, Any], bool]:
    check_name("step", name)
    if not isinstance(task, TaskDefinition):
        check.refuse("task", "a @task definition", task, where=f"start_child({name!r})")
    if priority is not None:
        check.integer(priority, "priority", at_least=-32768, at_most=32767)
    check.choice(parent_close, "parent_close", ("cancel", "abandon"))
    return task, parent_close == "cancel"


ChildError = ChildFailedError | ChildCanceledError
"""How a child that did not complete ends up in the results of `map` or `gather` with
`return_exceptions=True`."""


def _check_map_arguments(
    name: str,
    task: object,
    inputs: object,
    max_concurrency: object,
    priority: object,
    parent_close: object,
    return_exceptions: object,
) -> tuple[TaskDefinition[Any, Any], list[Any], bool]:
    definition, cancel_with_parent = _check_child_arguments(name, task, priority, parent_close)
    where = f"map({name!r})"
    if isinstance(inputs, (str, bytes, dict)) or not isinstance(inputs, Iterable):
        check.refuse(
            "inputs", "a list (or another iterable) of the children's inputs", inputs, where=where
        )
    if max_concurrency is not None:
        check.integer(max_concurrency, "max_concurrency", at_least=1, where=where)
    check.flag(return_exceptions, "return_exceptions", where=where)
    return definition, list(inputs), cancel_with_parent


def _check_gather_arguments(
    name: str, handles: object, return_exceptions: object
) -> list[tuple[str, UUID, Any]]:
    check_name("step", name)
    where = f"gather({name!r})"
    if isinstance(handles, (str, bytes, dict)) or not isinstance(handles, Iterable):
        check.refuse("handles", "a list of child handles from start_child", handles, where=where)
    members: list[tuple[str, UUID, Any]] = []
    seen: set[UUID] = set()
    for handle in handles:
        inner = handle._handle if isinstance(handle, SyncChildHandle) else handle
        if not isinstance(inner, ChildHandle):
            check.refuse("handles", "child handles from start_child", handle, where=where)
        if inner.run_id in seen:
            check.refuse(
                "handles",
                "distinct child handles",
                handle,
                where=where,
                hint="each child may appear once",
            )
        seen.add(inner.run_id)
        members.append((inner._name, inner.run_id, inner._output_type))
    check.flag(return_exceptions, "return_exceptions", where=where)
    return members


class SyncStepApi:
    """`ctx.step` in a plain (sync) task: the same operations, blocking the handler's thread."""

    __slots__ = ("_steps",)

    def __init__(self, steps: Steps) -> None:
        self._steps = steps

    def run(
        self,
        name: str,
        fn: Callable[..., R],
        /,
        *args: Any,
        retry: RetryPolicy | None = None,
        output_type: Any = None,
        timeout: timedelta | None = None,
        rate_limit: str | RateLimit[Any] | None = None,
        rate_limit_key: str | None = None,
        compensate: Callable[..., Any] | None = None,
        uncertain_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        **kwargs: Any,
    ) -> R:
        """Run `fn(*args, **kwargs)` as the step `name` and return its result (see
        `StepApi.run`, also for `output_type`)."""
        check_run_arguments(name, fn, retry, output_type, timeout, compensate)
        check_step_rate_limit(name, rate_limit, rate_limit_key)
        call = StepCall.inline(
            name,
            fn,
            args,
            kwargs,
            retry=retry,
            output_type=output_type,
            timeout=timeout,
            rate_limit=rate_limit,
            rate_limit_key=rate_limit_key,
            compensate=compensate,
            uncertain_on=_uncertain_on(name, uncertain_on),
        )
        value: R = self._steps.from_thread(self._steps.run(call))
        return value

    def transaction(
        self,
        name: str,
        fn: Callable[..., Awaitable[R]] | Callable[..., R],
        /,
        *args: Any,
        retry: RetryPolicy | None = None,
        output_type: Any = None,
        timeout: timedelta | None = None,
        rate_limit: str | RateLimit[Any] | None = None,
        rate_limit_key: str | None = None,
        compensate: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> R:
        """Run `fn(tx, *args, **kwargs)` as the transactional step `name` and return its
        result (see `StepApi.transaction`). `fn` runs on the worker's event loop, where `tx`
        lives: make it async on Postgres (an async connection)."""
        check_run_arguments(name, fn, retry, output_type, timeout, compensate, transactional=True)
        check_step_rate_limit(name, rate_limit, rate_limit_key)
        call = StepCall.inline(
            name,
            fn,
            args,
            kwargs,
            retry=retry,
            output_type=output_type,
            timeout=timeout,
            rate_limit=rate_limit,
            rate_limit_key=rate_limit_key,
            compensate=compensate,
            transactional=True,
        )
        value: R = self._steps.from_thread(self._steps.run(call))
        return value

    def sleep(self, name: str, duration: timedelta) -> None:
        """Sleep durably (see `StepApi.sleep`)."""
        check_sleep_arguments(name, duration)
        self._steps.from_thread(self._steps.sleep(name, duration))

    def wait_for_fact(
        self,
        name: str,
        *,
        timeout: timedelta | None = None,
        check: Callable[[], Any] | None = None,
        payload_type: type[T] | Any = Any,
        poll_interval: timedelta | None = None,
    ) -> T:
        """Wait durably for a fact (see `StepApi.wait_for_fact`)."""
        check_wait_arguments(
            name, timeout=timeout, check_fn=check, payload_type=payload_type, poll=poll_interval
        )
        value: T = self._steps.from_thread(
            self._steps.wait_for_fact(
                name, timeout=timeout, check=check, payload_type=payload_type, poll=poll_interval
            )
        )
        return value

    def callback_token(self, name: str, *, timeout: timedelta) -> str:
        """Mint a callback token, once (see `StepApi.callback_token`)."""
        check_callback_arguments(name, timeout)
        token: str = self._steps.from_thread(self._steps.callback_token(name, timeout))
        return token

    def wait_for_callback(self, token: str, *, payload_type: type[T] | Any = Any) -> T:
        """Wait durably for a callback (see `StepApi.wait_for_callback`)."""
        check_type_argument(payload_type, "payload_type", where="wait_for_callback()")
        value: T = self._steps.from_thread(self._steps.wait_for_callback(token, payload_type))
        return value

    def start_child(
        self,
        name: str,
        task: TaskDefinition[C, O],
        input: C | Any,
        *,
        priority: int | None = None,
        parent_close: ParentClose = "cancel",
    ) -> SyncChildHandle[O]:
        """Start a child run, exactly once (see `StepApi.start_child`)."""
        definition, cancel_with_parent = _check_child_arguments(name, task, priority, parent_close)
        child_id: UUID = self._steps.from_thread(
            self._steps.start_child(
                name,
                definition,
                input,
                priority=priority,
                cancel_with_parent=cancel_with_parent,
            )
        )
        return SyncChildHandle(ChildHandle(self._steps, name, child_id, definition.output_type))

    @overload
    def map(
        self,
        name: str,
        task: TaskDefinition[C, O],
        inputs: Iterable[C],
        *,
        max_concurrency: int | None = None,
        priority: int | None = None,
        parent_close: ParentClose = "cancel",
        return_exceptions: Literal[False] = False,
    ) -> list[O]: ...
    @overload
    def map(
        self,
        name: str,
        task: TaskDefinition[C, O],
        inputs: Iterable[C],
        *,
        max_concurrency: int | None = None,
        priority: int | None = None,
        parent_close: ParentClose = "cancel",
        return_exceptions: Literal[True],
    ) -> list[O | ChildError]: ...
    def map(
        self,
        name: str,
        task: TaskDefinition[C, O],
        inputs: Iterable[C],
        *,
        max_concurrency: int | None = None,
        priority: int | None = None,
        parent_close: ParentClose = "cancel",
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Fan out one child per input and wait for all of them (see `StepApi.map`)."""
        definition, items, cancel_with_parent = _check_map_arguments(
            name, task, inputs, max_concurrency, priority, parent_close, return_exceptions
        )
        value: list[Any] = self._steps.from_thread(
            self._steps.map(
                name,
                definition,
                items,
                max_concurrency=max_concurrency,
                priority=priority,
                cancel_with_parent=cancel_with_parent,
                return_exceptions=return_exceptions,
            )
        )
        return value

    @overload
    def gather(
        self,
        name: str,
        handles: Iterable[SyncChildHandle[O]],
        *,
        return_exceptions: Literal[False] = False,
    ) -> list[O]: ...
    @overload
    def gather(
        self,
        name: str,
        handles: Iterable[SyncChildHandle[O]],
        *,
        return_exceptions: Literal[True],
    ) -> list[O | ChildError]: ...
    def gather(
        self,
        name: str,
        handles: Iterable[SyncChildHandle[O]],
        *,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Wait for every child of `handles`, woken once (see `StepApi.gather`)."""
        members = _check_gather_arguments(name, handles, return_exceptions)
        value: list[Any] = self._steps.from_thread(
            self._steps.gather(name, members, return_exceptions=return_exceptions)
        )
        return value


def _call_site() -> CallSite:
    """Where the handler called `ctx.patched` / `ctx.deprecate_patch` (two frames up)."""
    frame = sys._getframe(2)
    return (frame.f_code.co_filename, frame.f_lineno)


class _BaseContext(Generic[I]):
    __slots__ = ("_execution", "_input")

    def __init__(self, execution: Runner, input: I) -> None:
        self._execution = execution
        self._input = input

    @property
    def input(self) -> I:
        """The run's input, decoded to the task's input type."""
        return self._input

    @property
    def run_id(self) -> UUID:
        return self._execution.claimed.run_id

    @property
    def task_name(self) -> str:
        return self._execution.claimed.task_name

    @property
    def task_version(self) -> int:
        return self._execution.claimed.task_version

    @property
    def priority(self) -> int:
        return self._execution.claimed.priority

    @property
    def attempt(self) -> int:
        """How many times this run has been claimed, this execution included (1 at first)."""
        return self._execution.claimed.claims

    @property
    def attempt_token(self) -> int:
        """This execution's fencing token: new and larger for every execution of the handler."""
        return self._execution.claimed.fencing_token

    @property
    def scheduled_at(self) -> datetime | None:
        """The tick (UTC) a schedule started this run for; None for a run no schedule
        started. The same on every execution of the run: read from its idempotency key."""
        return tick_of_key(self._execution.claimed.idempotency_key)

    @property
    def trace_id(self) -> str:
        """The W3C trace id (32 hex digits) this run belongs to."""
        return self._execution.trace_id

    @property
    def logger(self) -> logging.LoggerAdapter[logging.Logger]:
        """A logger whose records carry the run id, task, version and trace id."""
        return self._execution.logger

    @property
    def canceled(self) -> bool:
        """True once the run's cancel was requested (or this attempt lost its lease). A
        worker shutting down is not a cancel: the run goes on elsewhere."""
        return self._execution.aborts.state >= AbortState.CANCELING

    @property
    def cancelled(self) -> bool:
        """Deprecated spelling of `canceled` (umt writes "canceled" everywhere)."""
        warnings.warn(
            "ctx.cancelled is deprecated: use ctx.canceled", DeprecationWarning, stacklevel=2
        )
        return self.canceled

    @property
    def abort_reason(self) -> str | None:
        """Why the abort signal fired, or None."""
        return self._execution.aborts.reason

    @property
    def abort_event(self) -> asyncio.Event:
        """Set when the abort signal fires (the run's cancel, its deadline, a lost lease, or
        the worker shutting down): await it to react at once, then call
        `throw_if_canceled()`."""
        return self._execution.aborts.event

    def throw_if_canceled(self) -> None:
        """Stop the handler if the abort signal has fired: `CanceledError` (with the reason)
        when the run's cancel was requested or this attempt lost its lease,
        `DeadlineExceededError` when the run's deadline came. When the worker
        is shutting down it raises the engine's release signal instead (a `BaseException`:
        let it through), and the run is handed back, uncharged, for another worker to
        finish."""
        aborts = self._execution.aborts
        if aborts.state is AbortState.RELEASING:
            raise Release
        if aborts.state >= AbortState.CANCELING:
            reason = aborts.reason or "canceled"
            raise CanceledError(f"run {self.run_id} aborted: {reason}", reason=reason)
        if aborts.state is AbortState.EXPIRING:
            raise DeadlineExceededError(
                f"run {self.run_id}: {aborts.reason or 'deadline exceeded'}", run_id=self.run_id
            )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.task_name}@{self.task_version} run={self.run_id}>"


class TaskContext(_BaseContext[I]):
    """The context of an async task: `ctx.input`, `ctx.step.run / sleep / wait_for_fact`,
    `ctx.stream.write`, ...

    It has no public constructor; umt builds one for each execution.
    """

    __slots__ = ("_query_state", "step", "stream")

    def __init__(self, execution: Runner, input: I) -> None:
        super().__init__(execution, input)
        self._query_state: Any = None
        self.step = StepApi(execution.steps, self)
        self.stream = StreamApi(execution.streams)
        """Write to the run's streams: `await ctx.stream.write("progress", {...})`."""

    async def set_query_state(self, state: Any) -> None:
        """Keep `state` as what the task's queries (`@query`) answer from: `engine.query`
        reads the newest value, in the caller's process, without a worker. Durable, like a
        stream write (it is one, to the stream `umt.query-state`): a replay does not write
        it again."""
        await self.stream.write(QUERY_STATE_STREAM, state)
        self._query_state = state

    @property
    def query_state(self) -> Any:
        """The value last given to `set_query_state` in this execution (None before): where
        update handlers keep what the run has been sent. A replay sets it again at the same
        points, so it is the same on every execution."""
        return self._query_state

    def patched(self, patch_id: str) -> PatchCheck:
        """Await it: True where this run takes the new code at this point, False where it
        was already past the point on code without the patch (docs/versioning.md).

        `if await ctx.patched("new-fraud-check"): ...new code... else: ...old code...`. The
        first run to reach the point on this code records the patch's marker, so every replay
        decides the same. One id marks one point: the same id asked elsewhere in the task
        fails the run with `UsageError`, and nothing is stored.
        """
        steps, site = self._execution.steps, _call_site()
        return PatchCheck(patch_id, lambda: steps.patch(patch_id, site, call="patched"))

    async def deprecate_patch(self, patch_id: str) -> None:
        """The release after `patched(patch_id)`, once no live run takes the old branch (see
        `umt check --unpatched`): the code keeps only the new branch, and the marker is still
        recorded for new runs, so workers of the previous release take the new branch too."""
        await self._execution.steps.patch(patch_id, _call_site(), call="deprecate_patch")


class SyncTaskContext(_BaseContext[I]):
    """The context of a plain (sync) task; its `step` API blocks the handler's thread."""

    __slots__ = ("step", "stream")

    def __init__(self, execution: Runner, input: I) -> None:
        super().__init__(execution, input)
        self.step = SyncStepApi(execution.steps)
        self.stream = SyncStreamApi(execution.streams, execution.steps.from_thread)
        """Write to the run's streams: `ctx.stream.write("progress", {...})`."""

    def set_query_state(self, state: Any) -> None:
        """Keep `state` for the task's queries (see `TaskContext.set_query_state`)."""
        self.stream.write(QUERY_STATE_STREAM, state)

    def patched(self, patch_id: str) -> bool:
        """True where this run takes the new code at this point, False where it was already
        past the point on code without the patch (see `TaskContext.patched`)."""
        steps = self._execution.steps
        decision: bool = steps.from_thread(steps.patch(patch_id, _call_site(), call="patched"))
        return decision

    def deprecate_patch(self, patch_id: str) -> None:
        """The release after `patched(patch_id)` (see `TaskContext.deprecate_patch`)."""
        steps = self._execution.steps
        steps.from_thread(steps.patch(patch_id, _call_site(), call="deprecate_patch"))
