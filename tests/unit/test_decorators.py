"""`@task` and `@step`: what they accept, what they refuse, and the types they extract."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

from umt_sdk import (
    AsyncStep,
    RetryPolicy,
    SyncStep,
    SyncTaskContext,
    TaskContext,
    TaskDefinition,
    step,
    task,
)
from umt_sdk.exceptions import NotInTaskError, TaskDefinitionError


@attrs.frozen
class Job:
    key: str


@attrs.frozen
class Receipt:
    ref: str


async def async_handler(ctx: TaskContext[Job]) -> Receipt:
    return Receipt(ref=ctx.input.key)


def plain_handler(ctx: SyncTaskContext[Job]) -> list[int]:
    return [len(ctx.input.key)]


# -- @task ------------------------------------------------------------------------------------


def test_an_async_task_records_its_types() -> None:
    definition = task("jobs.submit", version=3)(async_handler)
    assert isinstance(definition, TaskDefinition)
    assert (definition.name, definition.version) == ("jobs.submit", 3)
    assert definition.is_async
    assert definition.input_type is Job
    assert definition.output_type is Receipt
    assert definition.fn is async_handler
    assert str(definition.pair) == "jobs.submit@3"
    assert repr(definition) == "<task jobs.submit@3 (async_handler)>"
    assert definition.retry == RetryPolicy()


def test_a_plain_task_records_its_types() -> None:
    retry = RetryPolicy.network()
    definition = task("jobs.count", retry=retry)(plain_handler)
    assert not definition.is_async
    assert definition.version == 1
    assert definition.input_type is Job
    assert definition.output_type == list[int]
    assert definition.retry is retry


def test_unparameterized_context_and_no_return_mean_any() -> None:
    async def handler(ctx: TaskContext) -> None:  # type: ignore[type-arg]
        del ctx

    async def untyped_return(ctx: TaskContext[int]):  # type: ignore[no-untyped-def]
        return ctx.input

    assert task("t.any")(handler).input_type is Any
    assert task("t.any")(handler).output_type is type(None)
    assert task("t.untyped")(untyped_return).output_type is Any


@pytest.mark.parametrize(
    "name", ["a", "jobs.submit", "ns:task-1/x_y", "x" * 200, "UPPER.lower.123"]
)
def test_good_names(name: str) -> None:
    assert task(name)(async_handler).name == name


@pytest.mark.parametrize("name", ["", " ", "has space", "a#b", "x" * 201, "naïve", "a@1", 5, None])
def test_bad_names_are_refused(name: Any) -> None:
    with pytest.raises(TaskDefinitionError, match="task name must be"):
        task(name)


@pytest.mark.parametrize("version", [0, -1, True, False, 1.0, "1", None])
def test_bad_versions_are_refused(version: Any) -> None:
    with pytest.raises(TaskDefinitionError, match="version must be an integer >= 1"):
        task("t", version=version)


def test_retry_must_be_a_policy() -> None:
    with pytest.raises(TaskDefinitionError, match="retry must be a RetryPolicy"):
        task("t", retry=3)  # type: ignore[arg-type]


def _no_params() -> int:
    return 1


async def _two_params(ctx: TaskContext[Job], extra: int) -> int:
    return extra


async def _unannotated(ctx):  # type: ignore[no-untyped-def]
    return ctx


async def _wrong_annotation(ctx: Job) -> int:
    return 1


async def _async_with_sync_context(ctx: SyncTaskContext[Job]) -> int:
    return 1


def _sync_with_async_context(ctx: TaskContext[Job]) -> int:
    return 1


async def _unresolvable(ctx: TaskContext[NoSuchType]) -> int:  # type: ignore[name-defined]  # noqa: F821
    return 1


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_no_params, "takes exactly one parameter"),
        (_two_params, "takes exactly one parameter"),
        (_unannotated, r"annotate the parameter as TaskContext\[YourInput\]"),
        (_wrong_annotation, r"annotate the parameter as TaskContext\[YourInput\]"),
        (_async_with_sync_context, r"TaskContext\[YourInput\] \(async handler\)"),
        (_sync_with_async_context, r"SyncTaskContext\[YourInput\] \(plain handler\)"),
        (_unresolvable, "cannot resolve the type annotations"),
    ],
    ids=lambda v: getattr(v, "__name__", "msg"),
)
def test_bad_handlers_are_refused(fn: Callable[..., Any], message: str) -> None:
    with pytest.raises(TaskDefinitionError, match=message):
        task("t")(fn)


def test_task_applied_twice_is_refused() -> None:
    once = task("t.once")(async_handler)
    with pytest.raises(TaskDefinitionError, match="already a task; apply @task once"):
        task("t.twice")(once)  # type: ignore[call-overload]


def test_task_on_something_not_callable_is_refused() -> None:
    with pytest.raises(TaskDefinitionError, match="must decorate a function"):
        task("t")(42)  # type: ignore[call-overload]


# -- @step ------------------------------------------------------------------------------------


async def _fetch(url: str) -> bytes:
    return url.encode()


def _parse(text: str) -> dict[str, int]:
    """Parse it."""
    return {text: 1}


def test_step_on_an_async_function_is_an_async_step() -> None:
    fetch = step("fetch")(_fetch)
    assert isinstance(fetch, AsyncStep)
    assert fetch.name == "fetch"
    assert fetch.fn is _fetch
    assert fetch.output_type is bytes
    assert fetch.retry is None
    assert repr(fetch) == "<step 'fetch' (_fetch)>"


def test_step_on_a_plain_function_is_a_sync_step() -> None:
    policy = RetryPolicy.file()
    parse = step("parse", retry=policy)(_parse)
    assert isinstance(parse, SyncStep)
    assert not isinstance(parse, AsyncStep)
    assert parse.output_type == dict[str, int]
    assert parse.retry is policy
    assert parse.__name__ == "_parse"
    assert parse.__doc__ == "Parse it."


def test_unannotated_step_output_is_any() -> None:
    assert step("s")(lambda: 1).output_type is Any


@pytest.mark.parametrize("name", ["", "a b", "a#2", "x" * 201, 7])
def test_bad_step_names_are_refused(name: Any) -> None:
    with pytest.raises(TaskDefinitionError, match="step name must be"):
        step(name)


def test_step_retry_must_be_a_policy() -> None:
    with pytest.raises(TaskDefinitionError, match="retry must be a RetryPolicy"):
        step("s", retry=RetryPolicy)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "target",
    [step("inner")(_parse), step("inner")(_fetch), task("t")(async_handler), "not callable"],
    ids=["sync-step", "async-step", "task", "string"],
)
def test_step_refuses_steps_tasks_and_non_functions(target: Any) -> None:
    with pytest.raises(TaskDefinitionError, match="must decorate a plain or async function"):
        step("outer")(target)


def test_steps_outside_a_task_raise_not_in_task() -> None:
    fetch = step("fetch")(_fetch)
    parse = step("parse")(_parse)
    with pytest.raises(NotInTaskError, match="'fetch' was called outside a running task"):
        fetch("u")
    with pytest.raises(NotInTaskError):
        parse("t")
    with pytest.raises(NotInTaskError):
        parse.aio("t")
    assert _parse("t") == {"t": 1}, "the plain function still works on its own"


@pytest.mark.parametrize("limit", [0, -1, True, 2.5, "3", None])
def test_max_lost_leases_must_be_a_positive_integer(limit: Any) -> None:
    with pytest.raises(TaskDefinitionError, match="max_lost_leases must be an integer >= 1"):
        task("t.lost", version=1, max_lost_leases=limit)


def test_max_lost_leases_is_kept_on_the_definition() -> None:
    async def handler(ctx: TaskContext[int]) -> int:
        return ctx.input

    assert task("t.lost", version=1)(handler).max_lost_leases == 10
    assert task("t.lost", version=1, max_lost_leases=2)(handler).max_lost_leases == 2
