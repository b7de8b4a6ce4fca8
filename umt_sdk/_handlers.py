"""`@update` and `@query`: the handlers a task declares for callers to change or read a run
while it runs (`@task(..., updates=[...], queries=[...])`), validated when decorated.

Declarations only; `umt_sdk._updates` applies updates inside a run and answers the engine.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from attrs import frozen

from umt_sdk import _serde
from umt_sdk._check import shown
from umt_sdk._names import check_name, check_storable, hints
from umt_sdk.exceptions import PayloadError, TaskDefinitionError, UsageError

__all__ = [
    "QueryDefinition",
    "UpdateDefinition",
    "check_handlers",
    "query",
    "update",
]

A = TypeVar("A")
R = TypeVar("R")
S = TypeVar("S")


@frozen(kw_only=True, eq=False)
class UpdateDefinition(Generic[A, R]):
    """An update handler as declared by `@update`: `async def fn(ctx, arg) -> result`."""

    name: str
    fn: Callable[[Any, A], Awaitable[R]]
    arg_type: Any
    result_type: Any
    validator: Callable[[A], object] | None = None

    def check_arg(self, arg: Any, *, where: str) -> str:
        """The argument's JSON text, if its type and the validator accept it; else
        `UsageError` naming `arg` (nothing is stored)."""
        what = f"argument of update {self.name!r}"
        try:
            arg_json = _serde.encode(arg, self.arg_type, what=what)
            decoded = _serde.decode(arg_json, self.arg_type, what=what)
        except PayloadError as exc:
            raise UsageError(f"{where}: {exc}", argument="arg") from exc
        if self.validator is not None:
            try:
                self.validator(decoded)
            except Exception as exc:  # the validator's refusal, whatever it raised
                raise UsageError(
                    f"{where}: update {self.name!r} refused its argument: "
                    f"{type(exc).__name__}: {exc}",
                    argument="arg",
                ) from exc
        return arg_json

    def __repr__(self) -> str:
        return f"<update {self.name} ({self.fn.__qualname__})>"


@frozen(kw_only=True, eq=False)
class QueryDefinition(Generic[S, R]):
    """A query handler as declared by `@query`: `def fn(state) -> answer`, pure, over the
    run's query state (`ctx.set_query_state`)."""

    name: str
    fn: Callable[[S], R]
    state_type: Any

    def answer(self, state_json: str | None) -> R:
        """The query's answer over the stored state (None before the run set one)."""
        state = _serde.decode(
            state_json or "null", self.state_type, what=f"query state of {self.name!r}"
        )
        return self.fn(state)

    def __repr__(self) -> str:
        return f"<query {self.name} ({self.fn.__qualname__})>"


def update(
    name: str, *, validator: Callable[[Any], object] | None = None
) -> Callable[[Callable[[Any, A], Awaitable[R]]], UpdateDefinition[A, R]]:
    """Declare an update handler: `async def approve(ctx: TaskContext[Order], arg: Approval)
    -> str`, listed in `@task(..., updates=[approve])`.

    A caller's `engine.update(run_id, "approve", arg)` is stored for the run, which applies
    it where it waits for updates (`ctx.step.wait_for_update`): the handler runs there, in
    the run (it may call steps), and its result is recorded in the run's history and
    returned to the caller. Replays run the handler again at the same point (keep it
    deterministic, like the task's own code) and return the recorded result.

    Args:
        name: the update's name, as callers give it.
        validator: called with the decoded argument in the caller's process before anything
            is stored; raising refuses the update (`UsageError` naming `arg`, nothing stored).
    """
    check_name("update", name)
    if validator is not None and not callable(validator):
        raise TaskDefinitionError(
            f"update {name!r}: validator must be a function of the argument, got "
            f"{shown(validator)}",
            argument="validator",
        )

    def decorate(fn: Callable[[Any, A], Awaitable[R]]) -> UpdateDefinition[A, R]:
        if not inspect.iscoroutinefunction(fn):
            raise TaskDefinitionError(
                f"update {name!r}: the handler must be an async function "
                "(async def handler(ctx: TaskContext[Input], arg: Arg) -> Result)",
                argument="fn",
            )
        params = list(inspect.signature(fn).parameters.values())
        if len(params) != 2:
            raise TaskDefinitionError(
                f"update {name!r}: the handler takes exactly two parameters, the context and "
                f"the argument; {fn.__qualname__} takes {len(params)}",
                argument="fn",
            )
        found = hints(fn)
        arg_type = found.get(params[1].name, Any)
        result_type = found.get("return", Any)
        check_storable(arg_type, f"update {name!r}: the argument type of {fn.__qualname__}")
        check_storable(result_type, f"update {name!r}: the result type of {fn.__qualname__}")
        return UpdateDefinition(
            name=name, fn=fn, arg_type=arg_type, result_type=result_type, validator=validator
        )

    return decorate


def query(name: str) -> Callable[[Callable[[S], R]], QueryDefinition[S, R]]:
    """Declare a query handler: `def progress(state: Progress | None) -> int`, listed in
    `@task(..., queries=[progress])`.

    `engine.query(run_id, "progress")` calls it in the caller's process with the newest
    value the run gave `ctx.set_query_state` (decoded to the parameter's annotation; None
    before the run set one): no worker is involved and nothing is written. Keep it pure.
    """
    check_name("query", name)

    def decorate(fn: Callable[[S], R]) -> QueryDefinition[S, R]:
        if not callable(fn) or inspect.iscoroutinefunction(fn):
            raise TaskDefinitionError(
                f"query {name!r}: the handler must be a plain function of the run's query "
                "state (def handler(state: State | None) -> Answer)",
                argument="fn",
            )
        params = list(inspect.signature(fn).parameters.values())
        if len(params) != 1:
            raise TaskDefinitionError(
                f"query {name!r}: the handler takes exactly one parameter, the run's query "
                f"state; {fn.__qualname__} takes {len(params)}",
                argument="fn",
            )
        state_type = hints(fn).get(params[0].name, Any)
        check_storable(state_type, f"query {name!r}: the state type of {fn.__qualname__}")
        return QueryDefinition(name=name, fn=fn, state_type=state_type)

    return decorate


def check_handlers(
    task_name: str,
    is_async: bool,
    updates: Iterable[object] | None,
    queries: Iterable[object] | None,
) -> tuple[Mapping[str, UpdateDefinition[Any, Any]], Mapping[str, QueryDefinition[Any, Any]]]:
    """The `@task`'s update and query handlers by name; `TaskDefinitionError` for anything
    that is not one, for a name given twice, and for updates on a plain handler."""
    by_update = _by_name(task_name, updates, UpdateDefinition, "update")
    if by_update and not is_async:
        raise TaskDefinitionError(
            f"task {task_name!r}: updates need an async handler (TaskContext), where "
            "ctx.step.wait_for_update applies them",
            argument="updates",
        )
    by_query = _by_name(task_name, queries, QueryDefinition, "query")
    return by_update, by_query


_Handler = TypeVar("_Handler", UpdateDefinition[Any, Any], QueryDefinition[Any, Any])


def _by_name(
    task_name: str, entries: Iterable[object] | None, kind: type[_Handler], decorator: str
) -> dict[str, _Handler]:
    """The handlers of the `@task`'s `updates=` or `queries=` (`decorator`: `update` or
    `query`) by name; `TaskDefinitionError` for anything else and for a name given twice."""
    argument = "updates" if decorator == "update" else "queries"
    by_name: dict[str, _Handler] = {}
    for entry in entries or ():
        if not isinstance(entry, kind):
            raise TaskDefinitionError(
                f"task {task_name!r}: {argument}= takes functions decorated with "
                f"@{decorator}(name), got {shown(entry)}",
                argument=argument,
            )
        if entry.name in by_name:
            raise TaskDefinitionError(
                f"task {task_name!r}: two {argument} are named {entry.name!r}", argument=argument
            )
        by_name[entry.name] = entry
    return by_name


def known(names: Iterable[str]) -> str:
    """`'a', 'b'` for an error message, or `none`."""
    listed = sorted(names)
    return ", ".join(json.dumps(n) for n in listed) if listed else "none"
