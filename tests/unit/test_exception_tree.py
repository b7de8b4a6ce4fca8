"""The exception tree: each class's place, the drawing in `umt_sdk.exceptions`, and the rule
that a refused argument is a `UsageError` (a ValueError) naming it."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any
from uuid import uuid4

import pytest

import umt_sdk.exceptions
from umt_backend_memory import MemoryStore
from umt_backend_pg import OutboxRelay, install_outbox, outbox_ddl
from umt_sdk import Registry, RetryPolicy, TaskContext, connect, task, with_attempt_token
from umt_sdk.backend import TaskPair
from umt_sdk.cli import parse_duration
from umt_sdk.exceptions import (
    BackendError,
    BackendNotFoundError,
    BackendUnavailableError,
    CallbackTimeoutError,
    CallbackTokenError,
    CanceledError,
    ChildCanceledError,
    ChildFailedError,
    ChildrenFailedError,
    CodecError,
    Compensate,
    CompensationFailedError,
    DeadlineExceededError,
    FactTimeoutError,
    FencingError,
    IdempotencyConflictError,
    LeaseLostTooOftenError,
    NonDeterminismError,
    NotInTaskError,
    PayloadError,
    ResultTimeoutError,
    RunCanceledError,
    RunCompensatedError,
    RunFailedError,
    RunNotFoundError,
    RunPrunedError,
    ScheduleNotFoundError,
    StartDeadlineExceededError,
    StepFailedError,
    StepTimeoutError,
    TaskDefinitionError,
    TransactionConflictError,
    UmtError,
    UnknownTaskError,
    UsageError,
)
from umt_sdk.testing import FakeClock

# Each class: its parent in the tree, and the built-in exceptions it also is.
TREE: dict[type[UmtError], tuple[type[UmtError] | None, tuple[type[Exception], ...]]] = {
    UmtError: (None, ()),
    UsageError: (UmtError, (ValueError,)),
    TaskDefinitionError: (UsageError, (ValueError,)),
    UnknownTaskError: (TaskDefinitionError, (ValueError, LookupError)),
    NotInTaskError: (UsageError, (ValueError,)),
    CallbackTokenError: (UsageError, (ValueError,)),
    PayloadError: (UmtError, (ValueError,)),
    CodecError: (UmtError, ()),
    BackendError: (UmtError, ()),
    BackendNotFoundError: (BackendError, ()),
    BackendUnavailableError: (BackendError, ()),
    TransactionConflictError: (BackendError, ()),
    FencingError: (UmtError, ()),
    IdempotencyConflictError: (UmtError, ()),
    RunNotFoundError: (UmtError, (LookupError,)),
    RunPrunedError: (RunNotFoundError, (LookupError,)),
    ScheduleNotFoundError: (UmtError, (LookupError,)),
    NonDeterminismError: (UmtError, ()),
    LeaseLostTooOftenError: (UmtError, ()),
    StepFailedError: (UmtError, ()),
    FactTimeoutError: (UmtError, (TimeoutError,)),
    CallbackTimeoutError: (FactTimeoutError, (TimeoutError,)),
    StepTimeoutError: (UmtError, (TimeoutError,)),
    DeadlineExceededError: (UmtError, (TimeoutError,)),
    StartDeadlineExceededError: (DeadlineExceededError, (TimeoutError,)),
    CanceledError: (UmtError, ()),
    RunFailedError: (UmtError, ()),
    RunCanceledError: (UmtError, ()),
    ChildFailedError: (RunFailedError, ()),
    RunCompensatedError: (RunFailedError, ()),
    Compensate: (UmtError, ()),
    CompensationFailedError: (UmtError, ()),
    ChildCanceledError: (RunCanceledError, ()),
    ChildrenFailedError: (UmtError, ()),
    ResultTimeoutError: (UmtError, (TimeoutError,)),
}
BUILTINS = (ValueError, TypeError, LookupError, TimeoutError)


def _umt_parent(cls: type[BaseException]) -> type[BaseException] | None:
    parents = [b for b in cls.__bases__ if issubclass(b, UmtError)]
    assert len(parents) <= 1, f"{cls.__name__} has two places in the tree: {parents}"
    return parents[0] if parents else None


def test_every_exported_exception_has_its_place() -> None:
    exported = {getattr(umt_sdk.exceptions, name) for name in umt_sdk.exceptions.__all__}
    assert exported == set(TREE)


@pytest.mark.parametrize("cls", list(TREE), ids=lambda c: c.__name__)
def test_the_tree(cls: type[UmtError]) -> None:
    parent, builtins = TREE[cls]
    assert _umt_parent(cls) is parent
    ancestors: set[type[UmtError]] = set()
    up = parent
    while up is not None:
        ancestors.add(up)
        up = TREE[up][0]
    for other in TREE:
        assert issubclass(cls, other) == (other is cls or other in ancestors), (cls, other)
    for builtin in BUILTINS:
        assert issubclass(cls, builtin) == (builtin in builtins), (cls, builtin)


def test_the_categories_that_callers_catch() -> None:
    # Bad arguments, decoration errors included, are one category, and ValueErrors.
    for cls in (TaskDefinitionError, UnknownTaskError, NotInTaskError):
        assert issubclass(cls, UsageError)
    assert not issubclass(NotInTaskError, TaskDefinitionError)
    assert not issubclass(UsageError, TypeError)
    # A fencing rejection is never taken for a failure a retry may fix.
    assert not issubclass(FencingError, BackendError)
    assert not issubclass(BackendError, FencingError)


def test_the_drawn_tree_is_the_real_one() -> None:
    doc = umt_sdk.exceptions.__doc__ or ""
    drawing = doc.split("```")[1].strip().splitlines()
    assert drawing[0] == "UmtError"
    parents: dict[str, str] = {}
    also: dict[str, set[str]] = {}
    path = ["UmtError"]
    for line in drawing[1:]:
        match = re.match(r"^(?P<indent>(?:│   |    )*)[├└]── (?P<name>\w+)\s*(?P<rest>.*)$", line)
        assert match is not None, line
        depth = len(match["indent"]) // 4 + 1
        path[depth:] = [match["name"]]
        parents[match["name"]] = path[depth - 1]
        found = re.match(r"\(also (?P<bases>[\w, ]+)\)", match["rest"])
        also[match["name"]] = set(found["bases"].split(", ")) if found else set()
    assert set(parents) == {cls.__name__ for cls in TREE if cls is not UmtError}
    for cls, (parent, builtins) in TREE.items():
        if parent is None:
            continue
        assert parents[cls.__name__] == parent.__name__, cls
        own = {b.__name__ for b in builtins} - {b.__name__ for b in TREE[parent][1]}
        assert also[cls.__name__] == own, cls


def test_signatures_and_attributes_are_kept() -> None:
    usage = UsageError("priority must be small", argument="priority")
    assert (str(usage), usage.argument) == ("priority must be small", "priority")
    assert str(TaskDefinitionError("bad task")) == "bad task"
    assert UnknownTaskError("no such task", task_name="t").task_name == "t"
    assert "inside a @task handler" in str(NotInTaskError())
    run_id = uuid4()
    fenced = FencingError("stale", run_id=run_id, fencing_token=7)
    assert (fenced.run_id, fenced.fencing_token) == (run_id, 7)
    assert UsageError().argument == ""


# -- converted call sites: a UsageError that names the argument -------------------------------


def _names(caught: pytest.ExceptionInfo[UsageError], argument: str, *, in_text: str = "") -> None:
    assert isinstance(caught.value, ValueError)
    assert not isinstance(caught.value, TaskDefinitionError), "a call, not a declaration"
    assert caught.value.argument == argument
    assert (in_text or argument) in str(caught.value)


def test_task_pair_parse() -> None:
    with pytest.raises(UsageError, match="expected 'task_name@version'") as caught:
        TaskPair.parse("report@latest")
    _names(caught, "text", in_text="'report@latest'")


def test_cli_durations() -> None:
    with pytest.raises(UsageError, match="such as 500ms") as caught:
        parse_duration("soon")
    _names(caught, "text", in_text="'soon'")


def test_fake_clock() -> None:
    with pytest.raises(UsageError, match="timezone-aware") as caught:
        FakeClock(datetime(2030, 1, 1))  # a naive start
    _names(caught, "start", in_text="FakeClock start")
    with pytest.raises(UsageError, match="cannot go backwards") as caught:
        FakeClock().advance(timedelta(seconds=-1))
    _names(caught, "delta", in_text="delta >= 0")


def test_retry_policy() -> None:
    with pytest.raises(UsageError) as caught:
        RetryPolicy(max_attempts=0)
    _names(caught, "max_attempts")


@task("errors.fenced")
async def fenced_with_bad_arguments(ctx: TaskContext[None]) -> list[str]:
    refused = []
    for conn, op_key in ((MemoryStore(), ""), (object(), "pay:1")):
        try:
            await with_attempt_token(conn, op_key, lambda info: 1)
        except UsageError as exc:
            refused.append(f"{type(exc).__name__} {exc.argument}: {exc}")
    return refused


async def test_with_attempt_token_arguments() -> None:
    async with await connect(
        "memory://", registry=Registry([fenced_with_bad_arguments]), clock=FakeClock()
    ) as engine:
        handle = await engine.enqueue(fenced_with_bad_arguments, None)
        async with engine.worker(poll_interval=timedelta(milliseconds=20)):
            op_key, conn = await handle.result(timeout=5)
    assert op_key.startswith("UsageError op_key: op_key must be a non-empty string")
    assert conn.startswith("UsageError conn: the memory backend's with_attempt_token needs")


async def test_backend_options() -> None:
    with pytest.raises(UsageError, match="unknown Postgres backend option") as caught:
        await connect("postgresql://nobody@localhost:1/none", bogus=True)
    _names(caught, "bogus")
    with pytest.raises(UsageError, match="it takes no clock") as caught:
        await connect("postgresql://nobody@localhost:1/none", clock=FakeClock())
    _names(caught, "clock")


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"concurrency": 1001}, "concurrency"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"mode": "both"}, "mode"),
        ({"poll_interval": timedelta(0)}, "poll_interval"),
        ({"routes": {"x": ("errors.fenced", "not callable")}}, "routes"),
        ({"conn_or_pool": 5}, "conn_or_pool"),
        ({"engine": object()}, "engine"),
        ({"table": "Bad-Name"}, "table"),
    ],
)
async def test_outbox_relay_arguments(kwargs: dict[str, Any], argument: str) -> None:
    async with await connect(
        "memory://", registry=Registry([fenced_with_bad_arguments]), clock=FakeClock()
    ) as engine:
        given: dict[str, Any] = {
            "conn_or_pool": "postgresql://nobody@localhost:1/none",
            "engine": engine,
            "routes": {},
            **kwargs,
        }
        conn_or_pool, on, routes = (
            given.pop("conn_or_pool"),
            given.pop("engine"),
            given.pop("routes"),
        )
        with pytest.raises(UsageError) as caught:
            OutboxRelay(conn_or_pool, on, routes, **given)
    texts = {"conn_or_pool": "OutboxRelay takes", "engine": "OutboxRelay needs", "routes": "mapper"}
    _names(caught, argument, in_text=texts.get(argument, ""))


async def test_outbox_names_and_connections() -> None:
    with pytest.raises(UsageError, match="lowercase identifier") as caught:
        outbox_ddl(schema="Public")
    _names(caught, "schema")
    with pytest.raises(UsageError, match="at most 56 characters") as caught:
        outbox_ddl(table="t" * 57)
    _names(caught, "table")
    with pytest.raises(UsageError, match=r"takes a psycopg\.AsyncConnection") as caught:
        await install_outbox(object())  # type: ignore[arg-type]  # the bad call under test
    _names(caught, "conn", in_text="install_outbox")
