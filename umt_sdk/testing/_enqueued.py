"""Assertions on the runs an engine holds, in the style of `Oban.Testing`: `assert_enqueued`,
`refute_enqueued`, `all_enqueued`.

They read through the public engine API (`engine.list`), so they work on every backend. A
failing one says what it looked for and lists what was there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from attrs import evolve, frozen

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._engine import Engine
from umt_sdk._spi import RunStatus, TaskPair
from umt_sdk._task import TaskDefinition
from umt_sdk._views import RunInfo
from umt_sdk.exceptions import UsageError

__all__ = ["all_enqueued", "assert_enqueued", "refute_enqueued"]

_STATUSES = ("pending", "running", "waiting", "completed", "failed", "canceled", "compensated")
_LISTED = 20
"""Runs a failure message lists; it counts the rest."""
_PAGE = 1000


class _Unset:
    def __repr__(self) -> str:
        return "<any input>"


_ANY_INPUT: Any = _Unset()


@frozen(kw_only=True)
class _Wanted:
    """What an assertion looks for."""

    task_name: str | None
    version: int | None
    input_json: Any  # the JSON form, or _ANY_INPUT
    input_contains: bool  # a dict given: a run's input must contain it, not equal it
    priority: int | None
    idempotency_key: str | None
    status: RunStatus | None

    def matches(self, run: RunInfo) -> bool:
        if self.task_name is not None and run.task_name != self.task_name:
            return False
        if self.version is not None and run.task_version != self.version:
            return False
        if self.priority is not None and run.priority != self.priority:
            return False
        if self.idempotency_key is not None and run.idempotency_key != self.idempotency_key:
            return False
        if self.input_json is _ANY_INPUT:
            return True
        if self.input_contains:
            return _contains(run.input, self.input_json)
        return _same(run.input, self.input_json)

    def describe(self) -> str:
        what = f"{self.status} run" if self.status else "run"
        name = "any task" if self.task_name is None else repr(self.task_name)
        if self.task_name is not None and self.version is not None:
            name = f"'{self.task_name}@{self.version}'"
        parts: list[str] = []
        if self.input_json is not _ANY_INPUT:
            how = "containing" if self.input_contains else "equal to"
            parts.append(f"input {how} {_short(_dumps(self.input_json))}")
        if self.priority is not None:
            parts.append(f"priority {self.priority}")
        if self.idempotency_key is not None:
            parts.append(f"idempotency key {self.idempotency_key!r}")
        return f"a {what} of {name}" + (f" with {', '.join(parts)}" if parts else "")


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}..."


def _same(actual: Any, expected: Any) -> bool:
    """JSON equality that tells `true` from `1` (Python's `True == 1` would not)."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and actual.keys() == expected.keys()
            and all(_same(actual[k], v) for k, v in expected.items())
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(expected)
            and all(_same(a, e) for a, e in zip(actual, expected, strict=True))
        )
    return bool(actual == expected)


def _contains(actual: Any, expected: Any) -> bool:
    """`actual` has every key of the dict `expected`, with a value that contains its value
    (nested dicts likewise); anything else must be equal."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            key in actual and _contains(actual[key], value) for key, value in expected.items()
        )
    return _same(actual, expected)


def _wanted(
    engine: Engine,
    task: TaskDefinition[Any, Any] | str | None,
    *,
    input: Any,
    priority: int | None,
    version: int | None,
    idempotency_key: str | None,
    status: RunStatus | None,
    where: str,
) -> _Wanted:
    if not isinstance(engine, Engine):
        check.refuse("engine", "an Engine (the umt_engine fixture, say)", engine, where=where)
    if version is not None:
        check.integer(version, "version", at_least=1, expected="an integer >= 1 or None")
    name: str | None = None
    input_type: Any = Any
    if isinstance(task, TaskDefinition):
        name, input_type = task.name, task.input_type
    elif isinstance(task, str):
        name = task
        if "@" in task:
            try:
                pair = TaskPair.parse(task)
            except ValueError as exc:
                raise UsageError(
                    f"{where}: task must be 'name' or 'name@version', got {task!r}",
                    argument="task",
                ) from exc
            if version is not None and version != pair.version:
                raise UsageError(
                    f"{where}: {task!r} conflicts with version={version}", argument="version"
                )
            name, version = pair.name, pair.version
        input_type = _registered_input_type(engine, name, version)
    elif task is not None:
        check.refuse(
            "task",
            "a @task definition, a task name ('name' or 'name@version') or None",
            task,
            where=where,
        )
    if priority is not None:
        check.integer(priority, "priority", at_least=-32768, at_most=32767)
    if idempotency_key is not None:
        check.text(idempotency_key, "idempotency_key", where=where)
    if status is not None:
        check.choice(status, "status", _STATUSES, where=where)
    expected: Any = _ANY_INPUT
    contains = False
    if input is not _ANY_INPUT:
        if isinstance(input, Mapping):
            expected, contains = json.loads(_serde.encode(dict(input), what="input")), True
        else:
            expected = json.loads(_serde.encode_input(input, input_type, what="input")[0])
    return _Wanted(
        task_name=name,
        version=version,
        input_json=expected,
        input_contains=contains,
        priority=priority,
        idempotency_key=idempotency_key,
        status=status,
    )


def _registered_input_type(engine: Engine, name: str, version: int | None) -> Any:
    try:
        if version is None:
            return engine.registry.latest(name).input_type
        return engine.registry.get(name, version).input_type
    except LookupError:  # not served here: compare the input's plain JSON form
        return Any


async def _runs(engine: Engine, status: RunStatus | None) -> list[RunInfo]:
    """Every run of `status` (all when None), oldest first."""
    found: list[RunInfo] = []
    cursor = None
    while True:
        page = await engine.list(status=status, limit=_PAGE, before=cursor)
        found.extend(page.runs)
        cursor = page.next_cursor
        if cursor is None:
            break
    found.reverse()
    return found


def _line(run: RunInfo) -> str:
    key = f" key={run.idempotency_key!r}" if run.idempotency_key is not None else ""
    return (
        f"  - {run.task_name}@{run.task_version} [{run.status}] priority={run.priority}"
        f"{key} input={_short(_dumps(run.input))} (run {run.run_id})"
    )


def _listing(title: str, runs: list[RunInfo]) -> str:
    if not runs:
        return f"{title}: none"
    lines = [f"{title} ({len(runs)}):", *(_line(r) for r in runs[:_LISTED])]
    if len(runs) > _LISTED:
        lines.append(f"  ... and {len(runs) - _LISTED} more")
    return "\n".join(lines)


async def _elsewhere(engine: Engine, wanted: _Wanted) -> str:
    """Matching runs in other statuses: a run a worker already took is a common surprise."""
    if wanted.status is None:
        return ""
    any_status = evolve(wanted, status=None)
    others = [
        r for r in await _runs(engine, None) if r.status != wanted.status and any_status.matches(r)
    ]
    if not others:
        return ""
    return "\n" + _listing("Matching runs in other statuses (status=None finds them)", others)


async def all_enqueued(
    engine: Engine,
    task: TaskDefinition[Any, Any] | str | None = None,
    *,
    input: Any = _ANY_INPUT,
    priority: int | None = None,
    version: int | None = None,
    idempotency_key: str | None = None,
    status: RunStatus | None = "pending",
) -> list[RunInfo]:
    """The runs that match, oldest first (see `assert_enqueued` for the filters)."""
    __tracebackhide__ = True  # pytest shows the test's line, not ours
    wanted = _wanted(
        engine,
        task,
        input=input,
        priority=priority,
        version=version,
        idempotency_key=idempotency_key,
        status=status,
        where="all_enqueued()",
    )
    return [r for r in await _runs(engine, status) if wanted.matches(r)]


async def assert_enqueued(
    engine: Engine,
    task: TaskDefinition[Any, Any] | str | None = None,
    *,
    input: Any = _ANY_INPUT,
    priority: int | None = None,
    version: int | None = None,
    idempotency_key: str | None = None,
    status: RunStatus | None = "pending",
) -> RunInfo:
    """Assert that a run matching every filter given is stored; return it (the oldest).

    Args:
        task: a `@task` definition or a task name (`"name"`, `"name@version"`); None: any.
        input: a dict matches runs whose input contains it (its keys with equal values,
            nested dicts likewise, as Oban matches `args`); any other value (an instance of
            the task's input type, say) must equal the run's input. Compared in JSON form.
        priority, version, idempotency_key: equal to the run's.
        status: `"pending"` (the default: enqueued and not yet started, delayed ones too),
            another status, or None for any.

    Raises:
        AssertionError: none matches; the message lists the runs of that status there were.
    """
    __tracebackhide__ = True  # pytest shows the test's line, not ours
    wanted = _wanted(
        engine,
        task,
        input=input,
        priority=priority,
        version=version,
        idempotency_key=idempotency_key,
        status=status,
        where="assert_enqueued()",
    )
    runs = await _runs(engine, status)
    for run in runs:
        if wanted.matches(run):
            return run
    title = f"{status.capitalize()} runs" if status else "Runs"
    raise AssertionError(
        f"expected {wanted.describe()}; found none.\n{_listing(title, runs)}"
        f"{await _elsewhere(engine, wanted)}"
    )


async def refute_enqueued(
    engine: Engine,
    task: TaskDefinition[Any, Any] | str | None = None,
    *,
    input: Any = _ANY_INPUT,
    priority: int | None = None,
    version: int | None = None,
    idempotency_key: str | None = None,
    status: RunStatus | None = "pending",
) -> None:
    """Assert that no run matches (the filters of `assert_enqueued`).

    Raises:
        AssertionError: some do; the message lists them.
    """
    __tracebackhide__ = True  # pytest shows the test's line, not ours
    wanted = _wanted(
        engine,
        task,
        input=input,
        priority=priority,
        version=version,
        idempotency_key=idempotency_key,
        status=status,
        where="refute_enqueued()",
    )
    found = [r for r in await _runs(engine, status) if wanted.matches(r)]
    if found:
        raise AssertionError(
            f"expected no {wanted.describe().removeprefix('a ')}; {_listing('found', found)}"
        )
