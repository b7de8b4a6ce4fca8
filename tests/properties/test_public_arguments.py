"""Every argument of the public API refuses a value of the wrong type, or out of its range, with a
`UsageError` that names it, in its message and its `argument`.

Never a TypeError, AttributeError or OverflowError from deep inside: inside a handler those are
retried like any failure, where a refused argument is final. Whatever the value: None, a bool
where a count goes, a number where a timedelta goes, NaN, a huge int, bytes, a list, an object
whose `__repr__`, `__eq__`, `__hash__` and `__bool__` raise.

Each case names one argument of one public callable and the values it takes; the property draws
any other value (`tests.strategies.any_values`) and expects the refusal. What a case takes is
left to the unit tests, which need runs, workers and databases for it. The ctx methods are
called on a context whose execution must never be reached: the arguments are checked first
(`tests/unit/test_handler_arguments.py` makes the same calls inside running handlers).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, NamedTuple, cast
from uuid import UUID, uuid4

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import Hostile, any_values
from umt_backend_memory import MemoryBackend, MemoryStore
from umt_backend_pg import (
    OutboxRelay,
    database_url,
    insert_outbox_event,
    install_ledger,
    install_outbox,
    migrate,
    outbox_ddl,
    pending_migrations_sql,
    start_embedded,
)
from umt_sdk import (
    Engine,
    Registry,
    RetryPolicy,
    RunHandle,
    RunHistory,
    StepApi,
    StreamApi,
    SyncStepApi,
    SyncStreamApi,
    TaskContext,
    TaskPair,
    Worker,
    connect,
    connect_sync,
    step,
    task,
    with_attempt_token,
)
from umt_sdk._context import Runner
from umt_sdk._streams import StreamWriter
from umt_sdk.exceptions import UsageError
from umt_sdk.testing import (
    FakeClock,
    Replayer,
    freeze_heartbeats,
    simulate_crash,
    thaw_heartbeats,
)

LONGEST = timedelta(days=36_500)
NOWHERE = "postgresql://nobody@localhost:1/none"
_NAME = re.compile(r"[A-Za-z0-9_.:\-/]{1,200}")
_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,62}")


@task("args.job")
async def job(ctx: TaskContext[None]) -> int:
    return 1


def _body() -> int:
    return 1


# -- what an argument takes -----------------------------------------------------------------------

Takes = Callable[[object], bool]


def nothing(value: object) -> bool:
    """No value of `any_values` (a connection, an engine, a worker is never drawn)."""
    return False


def none(value: object) -> bool:
    return value is None


def either(*takes: Takes) -> Takes:
    return lambda value: any(t(value) for t in takes)


def integer(low: int | None = None, high: int | None = None) -> Takes:
    return lambda v: (
        isinstance(v, int)
        and not isinstance(v, bool)
        and (low is None or v >= low)
        and (high is None or v <= high)
    )


def span(
    low: timedelta | None = timedelta(0), high: timedelta = LONGEST, *, positive: bool = False
) -> Takes:
    return lambda v: (
        isinstance(v, timedelta)
        and v <= high
        and (v > timedelta(0) if positive else low is None or v >= low)
    )


def seconds(value: object) -> bool:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    return math.isfinite(number) and number >= 0


def text(*, empty: bool = True, longest: int | None = None) -> Takes:
    return lambda v: (
        isinstance(v, str) and (empty or v != "") and (longest is None or len(v) <= longest)
    )


def matching(pattern: re.Pattern[str]) -> Takes:
    return lambda v: isinstance(v, str) and pattern.fullmatch(v) is not None


def instance(*types: type) -> Takes:
    return lambda v: isinstance(v, types)


def function(value: object) -> bool:
    return callable(value)


def flag(value: object) -> bool:
    return isinstance(value, bool)


_DECODABLE = (int, str, list[int], type(None), None)


def decodable_type(value: object) -> bool:
    """The types among `any_values` that payloads decode to (`object`, `Hostile`, `Exception`
    and every non-type value are not); None is NoneType."""
    return any(value is t or (type(value) is type(t) and value == t) for t in _DECODABLE)


def iterable(value: object) -> bool:
    """A collection a list argument takes (its items are another argument's business)."""
    return isinstance(value, list | tuple | dict)


_STATUSES = ("pending", "running", "waiting", "completed", "failed", "canceled", "compensated")
_START = datetime(2030, 1, 1, tzinfo=UTC)  # a FakeClock's


def _advances(value: object) -> bool:
    """A delta a new FakeClock moves by: >= 0, and not past the last datetime."""
    if not isinstance(value, timedelta) or value < timedelta(0):
        return False
    try:
        _START + value
    except OverflowError:
        return False
    return True


def aware(value: object) -> bool:
    return isinstance(value, datetime) and value.utcoffset() is not None


def hashable(value: object) -> bool:
    try:
        hash(value)
    except Exception:
        return False
    return True


def backoff(value: object) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value >= 1
    except OverflowError:
        return False


def directory(value: object) -> bool:
    return (isinstance(value, str) and value != "") or isinstance(value, Path)


# -- the cases ------------------------------------------------------------------------------------


class Env:
    """One engine on the memory backend, on a loop of its own, for every case."""

    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.engine: Engine = self.runner.run(
            connect("memory://", registry=Registry([job]), clock=FakeClock())
        )
        self.handle: RunHandle[int] = self.runner.run(self.engine.enqueue(job, None))
        self.worker: Worker = self.engine.worker()  # never started
        self.step = StepApi(cast(Runner, _Unreachable()))
        self.sync_step = SyncStepApi(cast(Runner, _Unreachable()))
        self.stream = StreamApi(cast(StreamWriter, _Unreachable()))
        self.sync_stream = SyncStreamApi(cast(StreamWriter, _Unreachable()), _Unreachable())
        self.clock = FakeClock()
        self.store = MemoryStore()
        self.registry = Registry([job])

    def call(self, result: object) -> object:
        if inspect.isawaitable(result):
            return self.runner.run(_awaited(result))
        return result

    def close(self) -> None:
        self.runner.run(self.engine.close())
        self.runner.close()


async def _awaited(awaitable: Any) -> object:
    return await awaitable


class _Unreachable:
    """The execution under a context in these cases: reaching it means a check let a wrong
    value through."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the execution was reached ({name}): an argument was not checked")


class Case(NamedTuple):
    callable: str
    argument: str
    takes: Takes
    call: Callable[[Env, Any], object]
    values: st.SearchStrategy[Any] = any_values
    """Where the wrong values are drawn from (filtered by `takes`)."""


def _relay(env: Env, **given: Any) -> OutboxRelay:
    arguments: dict[str, Any] = {"conn_or_pool": NOWHERE, "engine": env.engine, "routes": {}}
    arguments.update(given)
    return OutboxRelay(
        arguments.pop("conn_or_pool"), arguments.pop("engine"), arguments.pop("routes"), **arguments
    )


RETRY = either(none, instance(RetryPolicy))


def _histories(value: object) -> bool:
    """What `Replayer.replay_many` takes: an iterable of RunHistory (not text, not a mapping)."""
    if isinstance(value, str | bytes | bytearray | Mapping) or not isinstance(value, Iterable):
        return False
    return all(isinstance(item, RunHistory) for item in value)


RUN_ID = instance(UUID)
NAME = matching(_NAME)
SCHEMA = matching(_SCHEMA)

CASES: list[Case] = [
    # -- declarations
    Case("task", "name", NAME, lambda env, v: task(v)),
    Case("task", "version", integer(1), lambda env, v: task("t", version=v)),
    Case("task", "retry", RETRY, lambda env, v: task("t", retry=v)),
    Case("task", "max_lost_leases", integer(1), lambda env, v: task("t", max_lost_leases=v)),
    Case("task(...)", "fn", function, lambda env, v: task("t")(v)),
    Case("step", "name", NAME, lambda env, v: step(v)),
    Case("step", "retry", RETRY, lambda env, v: step("s", retry=v)),
    Case("step(...)", "fn", function, lambda env, v: step("s")(v)),
    Case("RetryPolicy", "max_attempts", integer(1), lambda env, v: RetryPolicy(max_attempts=v)),
    Case("RetryPolicy", "initial", span(positive=True), lambda env, v: RetryPolicy(initial=v)),
    Case(
        "RetryPolicy",
        "max_interval",
        span(positive=True),
        lambda env, v: RetryPolicy(max_interval=v),
    ),
    Case("RetryPolicy", "backoff", backoff, lambda env, v: RetryPolicy(backoff=v)),
    Case("RetryPolicy", "non_retryable", nothing, lambda env, v: RetryPolicy(non_retryable=v)),
    Case(
        "RetryPolicy.delay_before",
        "attempt",
        integer(),
        lambda env, v: RetryPolicy().delay_before(v),
    ),
    Case(
        "RetryPolicy.should_retry",
        "error",
        instance(BaseException),
        lambda env, v: RetryPolicy().should_retry(v, 1),
    ),
    Case(
        "RetryPolicy.should_retry",
        "failed_attempts",
        integer(),
        lambda env, v: RetryPolicy().should_retry(ValueError(), v),
    ),
    Case(
        "TaskPair",
        "name",
        text(empty=False, longest=200),
        lambda env, v: TaskPair(name=v, version=1),
    ),
    Case("TaskPair", "version", integer(1), lambda env, v: TaskPair(name="t", version=v)),
    Case("TaskPair.parse", "text", nothing, lambda env, v: TaskPair.parse(v)),
    Case("Registry", "tasks", iterable, lambda env, v: Registry(v)),
    Case("Registry([...])", "tasks", nothing, lambda env, v: Registry([v])),
    Case("Registry.add", "definition", nothing, lambda env, v: env.registry.add(v)),
    Case(
        "Registry.get",
        "name",
        text(empty=False, longest=200),
        lambda env, v: env.registry.get(v, 1),
    ),
    Case("Registry.get", "version", integer(1), lambda env, v: env.registry.get("args.job", v)),
    Case("Registry.latest", "name", text(), lambda env, v: env.registry.latest(v)),
    Case("Registry.resolve", "ref", text(), lambda env, v: env.registry.resolve(v)),
    Case(
        "Registry.resolve",
        "version",
        either(none, integer(1)),
        lambda env, v: env.registry.resolve("args.job", v),
    ),
    Case(
        "Registry.select", "versions", either(none, iterable), lambda env, v: env.registry.select(v)
    ),
    Case("Registry.select([...])", "versions", text(), lambda env, v: env.registry.select([v])),
    # -- connecting
    Case("connect", "url", text(empty=False), lambda env, v: connect(v)),
    Case(
        "connect",
        "registry",
        either(none, instance(Registry)),
        lambda env, v: connect("memory://", registry=v),
    ),
    Case(
        "connect",
        "clock",
        either(none, instance(FakeClock)),
        lambda env, v: connect("memory://", clock=v),
    ),
    Case("connect", "plugins", iterable, lambda env, v: connect("memory://", plugins=v)),
    Case(
        "connect", "tracer_provider", none, lambda env, v: connect("memory://", tracer_provider=v)
    ),
    Case("connect", "meter_provider", none, lambda env, v: connect("memory://", meter_provider=v)),
    # -- producing and reading
    Case("Engine.enqueue", "task", text(), lambda env, v: env.engine.enqueue(v, None)),
    Case(
        "Engine.enqueue",
        "version",
        either(none, integer(1)),
        lambda env, v: env.engine.enqueue("args.job", None, version=v),
    ),
    Case(
        "Engine.enqueue",
        "priority",
        integer(-32768, 32767),
        lambda env, v: env.engine.enqueue(job, None, priority=v),
    ),
    Case(
        "Engine.enqueue",
        "idempotency_key",
        either(none, text(empty=False, longest=512)),
        lambda env, v: env.engine.enqueue(job, None, idempotency_key=v),
    ),
    Case(
        "Engine.enqueue",
        "delay",
        either(none, span()),
        lambda env, v: env.engine.enqueue(job, None, delay=v),
    ),
    Case(
        "Engine.enqueue (memory)",
        "conn",
        none,
        lambda env, v: env.engine.enqueue(job, None, conn=v),
    ),
    Case("Engine.enqueue_many", "task", text(), lambda env, v: env.engine.enqueue_many(v, [])),
    Case(
        "Engine.enqueue_many",
        "inputs",
        lambda v: isinstance(v, Iterable) and not isinstance(v, str | bytes | Mapping),
        lambda env, v: env.engine.enqueue_many(job, v),
    ),
    Case(
        "Engine.enqueue_many",
        "idempotency_keys",
        lambda v: (
            v is None
            or (
                isinstance(v, list | tuple)
                and len(v) == 1
                and (v[0] is None or text(empty=False, longest=512)(v[0]))
            )
        ),
        lambda env, v: env.engine.enqueue_many(job, [None], idempotency_keys=v),
    ),
    Case(
        "Engine.enqueue_many",
        "priority",
        integer(-32768, 32767),
        lambda env, v: env.engine.enqueue_many(job, [None], priority=v),
    ),
    Case(
        "Engine.enqueue_many",
        "delay",
        either(none, span()),
        lambda env, v: env.engine.enqueue_many(job, [None], delay=v),
    ),
    Case("Engine.signal", "run_id", RUN_ID, lambda env, v: env.engine.signal(v, "go")),
    Case("Engine.signal", "name", NAME, lambda env, v: env.engine.signal(env.handle.run_id, v)),
    Case("Engine.broadcast", "name", NAME, lambda env, v: env.engine.broadcast(v)),
    Case("Engine.update", "run_id", RUN_ID, lambda env, v: env.engine.update(v, "go")),
    Case("Engine.update", "name", NAME, lambda env, v: env.engine.update(env.handle.run_id, v)),
    Case(
        "Engine.update",
        "timeout",
        either(none, seconds),
        lambda env, v: env.engine.update(uuid4(), "go", timeout=v),
    ),
    Case("Engine.query", "run_id", RUN_ID, lambda env, v: env.engine.query(v, "progress")),
    Case("Engine.query", "name", NAME, lambda env, v: env.engine.query(env.handle.run_id, v)),
    Case("Engine.cancel", "run_id", RUN_ID, lambda env, v: env.engine.cancel(v)),
    Case("Engine.cancel", "reason", text(), lambda env, v: env.engine.cancel(uuid4(), reason=v)),
    Case("Engine.get", "run_id", RUN_ID, lambda env, v: env.engine.get(v)),
    Case("Engine.export_history", "run_id", RUN_ID, lambda env, v: env.engine.export_history(v)),
    Case(
        "Engine.list",
        "task_name",
        either(none, text()),
        lambda env, v: env.engine.list(task_name=v),
    ),
    Case(
        "Engine.list",
        "version",
        either(none, integer(1)),
        lambda env, v: env.engine.list(version=v),
    ),
    Case(
        "Engine.list",
        "status",
        either(none, lambda v: isinstance(v, str) and v in _STATUSES),
        lambda env, v: env.engine.list(status=v),
    ),
    Case("Engine.list", "limit", integer(1, 10_000), lambda env, v: env.engine.list(limit=v)),
    Case(
        "Engine.list",
        "before",
        either(none, instance(UUID)),
        lambda env, v: env.engine.list(before=v),
    ),
    Case("Engine.result", "run_id", RUN_ID, lambda env, v: env.engine.result(v)),
    Case(
        "Engine.result",
        "timeout",
        either(none, seconds),
        lambda env, v: env.engine.result(uuid4(), timeout=v),
    ),
    Case(
        "Engine.result",
        "output_type",
        either(none, decodable_type),
        lambda env, v: env.engine.result(uuid4(), output_type=v),
    ),
    Case(
        "RunHandle.result",
        "timeout",
        either(none, seconds),
        lambda env, v: env.handle.result(timeout=v),
    ),
    Case("Engine.stream", "run_id", RUN_ID, lambda env, v: env.engine.stream(v, "progress")),
    Case("Engine.stream", "name", NAME, lambda env, v: env.engine.stream(env.handle.run_id, v)),
    Case(
        "Engine.stream",
        "since",
        integer(0),
        lambda env, v: env.engine.stream(env.handle.run_id, "progress", since=v),
    ),
    Case(
        "Engine.stream",
        "follow",
        flag,
        lambda env, v: env.engine.stream(env.handle.run_id, "progress", follow=v),
    ),
    Case("Engine.stream_last", "run_id", RUN_ID, lambda env, v: env.engine.stream_last(v, "p")),
    Case(
        "Engine.stream_last",
        "name",
        NAME,
        lambda env, v: env.engine.stream_last(env.handle.run_id, v),
    ),
    Case("Engine.stream_heads", "run_ids", iterable, lambda env, v: env.engine.stream_heads(v)),
    Case(
        "Engine.stream_heads([...])",
        "run_id",
        RUN_ID,
        lambda env, v: env.engine.stream_heads([v]),
    ),
    Case(
        "Engine.stream_heads",
        "name",
        either(none, NAME),
        lambda env, v: env.engine.stream_heads([], name=v),
    ),
    Case("Engine.wait_idle", "run_ids", iterable, lambda env, v: env.engine.wait_idle(v)),
    Case("Engine.wait_idle([...])", "run_id", RUN_ID, lambda env, v: env.engine.wait_idle([v])),
    Case(
        "Engine.wait_idle", "timeout", seconds, lambda env, v: env.engine.wait_idle([], timeout=v)
    ),
    # -- consuming
    Case(
        "Engine.worker",
        "versions",
        either(none, iterable),
        lambda env, v: env.engine.worker(versions=v),
    ),
    Case(
        "Engine.worker([...])", "versions", text(), lambda env, v: env.engine.worker(versions=[v])
    ),
    Case(
        "Engine.worker",
        "concurrency",
        integer(1, 10_000),
        lambda env, v: env.engine.worker(concurrency=v),
    ),
    Case(
        "Engine.worker",
        "lease",
        span(timedelta(milliseconds=100)),
        lambda env, v: env.engine.worker(lease=v),
    ),
    Case(
        "Engine.worker",
        "worker_id",
        either(none, text(empty=False, longest=200)),
        lambda env, v: env.engine.worker(worker_id=v),
    ),
    Case(
        "Engine.worker",
        "poll_interval",
        span(positive=True),
        lambda env, v: env.engine.worker(poll_interval=v),
    ),
    Case(
        "Engine.worker",
        "shutdown_grace",
        span(),
        lambda env, v: env.engine.worker(shutdown_grace=v),
    ),
    Case("Worker.stop", "grace", either(none, span()), lambda env, v: env.worker.stop(grace=v)),
    # -- inside a handler (the same for the plain context's blocking calls)
    *(
        case
        for where, api in (("ctx.step", "step"), ("sync ctx.step", "sync_step"))
        for case in (
            Case(f"{where}.run", "name", NAME, lambda env, v, a=api: getattr(env, a).run(v, _body)),
            Case(f"{where}.run", "fn", function, lambda env, v, a=api: getattr(env, a).run("s", v)),
            Case(
                f"{where}.run",
                "retry",
                RETRY,
                lambda env, v, a=api: getattr(env, a).run("s", _body, retry=v),
            ),
            Case(
                f"{where}.run",
                "output_type",
                either(none, decodable_type),
                lambda env, v, a=api: getattr(env, a).run("s", _body, output_type=v),
            ),
            Case(
                f"{where}.sleep",
                "name",
                NAME,
                lambda env, v, a=api: getattr(env, a).sleep(v, timedelta(1)),
            ),
            Case(
                f"{where}.sleep",
                "duration",
                span(None),
                lambda env, v, a=api: getattr(env, a).sleep("nap", v),
            ),
            Case(
                f"{where}.wait_for_fact",
                "name",
                NAME,
                lambda env, v, a=api: getattr(env, a).wait_for_fact(v),
            ),
            Case(
                f"{where}.wait_for_fact",
                "timeout",
                either(none, span()),
                lambda env, v, a=api: getattr(env, a).wait_for_fact("f", timeout=v),
            ),
            Case(
                f"{where}.wait_for_fact",
                "check",
                either(none, function),
                lambda env, v, a=api: getattr(env, a).wait_for_fact("f", check=v),
            ),
            Case(
                f"{where}.wait_for_fact",
                "payload_type",
                decodable_type,
                lambda env, v, a=api: getattr(env, a).wait_for_fact("f", payload_type=v),
            ),
            Case(
                f"{where}.wait_for_fact",
                "poll_interval",
                either(none, span(positive=True)),
                lambda env, v, a=api: getattr(env, a).wait_for_fact("f", poll_interval=v),
            ),
        )
    ),
    Case("ctx.stream.write", "name", NAME, lambda env, v: env.stream.write(v, 1)),
    Case("sync ctx.stream.write", "name", NAME, lambda env, v: env.sync_stream.write(v, 1)),
    Case(
        "with_attempt_token",
        "op_key",
        text(empty=False),
        lambda env, v: with_attempt_token(env.store, v, _body),
    ),
    Case(
        "with_attempt_token", "fn", function, lambda env, v: with_attempt_token(env.store, "op", v)
    ),
    Case(
        "with_attempt_token",
        "commit",
        either(none, function),
        lambda env, v: with_attempt_token(env.store, "op", _body, commit=v),
    ),
    Case(
        "with_attempt_token",
        "result_type",
        either(none, decodable_type),
        lambda env, v: with_attempt_token(env.store, "op", _body, result_type=v),
    ),
    # -- test kits
    Case("FakeClock", "start", either(none, aware), lambda env, v: FakeClock(v)),
    Case("FakeClock", "auto_advance", flag, lambda env, v: FakeClock(auto_advance=v)),
    Case("FakeClock.advance", "delta", _advances, lambda env, v: FakeClock().advance(v)),
    Case("FakeClock.advance_to", "when", aware, lambda env, v: FakeClock().advance_to(v)),
    Case("FakeClock.subscribe", "listener", function, lambda env, v: env.clock.subscribe(v)),
    Case("simulate_crash", "worker", nothing, lambda env, v: simulate_crash(v)),
    Case("freeze_heartbeats", "worker", nothing, lambda env, v: freeze_heartbeats(v)),
    Case("thaw_heartbeats", "worker", nothing, lambda env, v: thaw_heartbeats(v)),
    Case("Replayer", "registry", instance(Registry), lambda env, v: Replayer(v)),
    Case(
        "Replayer.replay",
        "history",
        instance(RunHistory),
        lambda env, v: Replayer(Registry([job])).replay(v),
    ),
    Case(
        "Replayer.replay_many",
        "histories",
        _histories,
        lambda env, v: Replayer(Registry([job])).replay_many(v),
    ),
    Case("MemoryBackend", "clock", instance(FakeClock), lambda env, v: MemoryBackend(clock=v)),
    Case("MemoryStore.put", "table", text(), lambda env, v: env.store.put(v, "k", 1)),
    Case(
        "MemoryStore.get",
        "key",
        hashable,
        lambda env, v: env.store.get("t", v),
        values=st.one_of(
            any_values,
            st.lists(st.integers(), max_size=2),
            st.sets(st.integers(), max_size=2),
            st.builds(Hostile),
            st.just(Decimal("sNaN")),
        ),
    ),
    # -- the Postgres backend: refused before anything connects
    Case("connect postgresql://", "schema", SCHEMA, lambda env, v: connect(NOWHERE, schema=v)),
    Case(
        "connect postgresql://",
        "run_migrations",
        flag,
        lambda env, v: connect(NOWHERE, run_migrations=v),
    ),
    Case(
        "connect postgresql://", "min_size", integer(0), lambda env, v: connect(NOWHERE, min_size=v)
    ),
    Case(
        "connect postgresql://", "max_size", integer(1), lambda env, v: connect(NOWHERE, max_size=v)
    ),
    Case("connect postgresql://", "listen", flag, lambda env, v: connect(NOWHERE, listen=v)),
    Case("migrate", "url", text(empty=False), lambda env, v: migrate(v)),
    Case("migrate", "schema", SCHEMA, lambda env, v: migrate(NOWHERE, schema=v)),
    Case(
        "pending_migrations_sql", "url", text(empty=False), lambda env, v: pending_migrations_sql(v)
    ),
    Case("install_ledger", "conn", nothing, lambda env, v: install_ledger(v)),
    Case("install_outbox", "conn", nothing, lambda env, v: install_outbox(v)),
    Case("outbox_ddl", "schema", SCHEMA, lambda env, v: outbox_ddl(schema=v)),
    Case(
        "outbox_ddl",
        "table",
        matching(re.compile(r"[a-z_][a-z0-9_]{0,55}")),
        lambda env, v: outbox_ddl(table=v),
    ),
    Case("insert_outbox_event", "conn", nothing, lambda env, v: insert_outbox_event(v, "created")),
    Case(
        "insert_outbox_event",
        "type",
        text(empty=False),
        lambda env, v: insert_outbox_event(None, v),
    ),  # type: ignore[arg-type]  # deliberately wrong: no connection, refused after `type`
    Case(
        "insert_outbox_event",
        "payload",
        either(none, instance(dict)),
        lambda env, v: insert_outbox_event(None, "t", v),  # type: ignore[arg-type]  # deliberately wrong: as above
    ),
    Case(
        "insert_outbox_event",
        "idempotency_key",
        either(none, text(empty=False)),
        lambda env, v: insert_outbox_event(None, "t", idempotency_key=v),  # type: ignore[arg-type]  # deliberately wrong: as above
    ),
    Case("OutboxRelay", "conn_or_pool", instance(str), lambda env, v: _relay(env, conn_or_pool=v)),
    Case("OutboxRelay", "engine", nothing, lambda env, v: _relay(env, engine=v)),
    Case("OutboxRelay", "routes", instance(dict), lambda env, v: _relay(env, routes=v)),
    Case("OutboxRelay({...})", "routes", text(), lambda env, v: _relay(env, routes={"created": v})),
    Case("OutboxRelay", "batch_size", integer(1, 10_000), lambda env, v: _relay(env, batch_size=v)),
    Case("OutboxRelay", "concurrency", integer(1, 1000), lambda env, v: _relay(env, concurrency=v)),
    Case("OutboxRelay", "max_attempts", integer(1), lambda env, v: _relay(env, max_attempts=v)),
    Case("OutboxRelay", "backoff", span(positive=True), lambda env, v: _relay(env, backoff=v)),
    Case(
        "OutboxRelay",
        "poll_interval",
        span(positive=True),
        lambda env, v: _relay(env, poll_interval=v),
    ),
    Case(
        "OutboxRelay",
        "mode",
        lambda v: isinstance(v, str) and v in ("auto", "same_database", "separate"),
        lambda env, v: _relay(env, mode=v),
    ),
    Case("OutboxRelay", "listen", flag, lambda env, v: _relay(env, listen=v)),
    Case("OutboxRelay", "tracer_provider", none, lambda env, v: _relay(env, tracer_provider=v)),
    Case(
        "OutboxRelay.default_key",
        "event_id",
        integer(1),
        lambda env, v: _relay(env).default_key(v),
    ),
    Case("start_embedded", "data_dir", directory, lambda env, v: start_embedded(v)),
    Case("database_url", "data_dir", directory, lambda env, v: database_url(v)),
]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    environment = Env()
    yield environment
    environment.close()


@functools.cache
def wrong_values(case: Case) -> st.SearchStrategy[Any]:
    """What the case's argument refuses (built once: a strategy is costly to build)."""
    return case.values.filter(lambda value: not case.takes(value))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.callable}.{c.argument}")
@given(data=st.data())
def test_a_wrong_argument_is_a_usage_error_naming_it(
    env: Env, case: Case, data: st.DataObject
) -> None:
    value = data.draw(wrong_values(case), label=case.argument)
    with pytest.raises(UsageError) as caught:
        env.call(case.call(env, value))
    assert caught.value.argument == case.argument, str(caught.value)
    assert case.argument in str(caught.value)


def test_the_blocking_facade_passes_the_refusals_through() -> None:
    """`connect_sync` and `SyncEngine` call the async engine: the same UsageError, from the
    loop thread to the caller's."""
    with pytest.raises(UsageError) as caught:
        connect_sync("memory://", registry=[job])  # type: ignore[arg-type]  # deliberately wrong: a list, not a Registry
    assert caught.value.argument == "registry"
    with connect_sync("memory://", registry=Registry([job]), clock=FakeClock()) as engine:
        for call, argument in (
            (lambda: engine.enqueue(job, None, priority=True), "priority"),
            (lambda: engine.enqueue(job, None, delay=5), "delay"),  # type: ignore[arg-type]  # deliberately wrong: seconds
            (lambda: engine.list(limit="10"), "limit"),  # type: ignore[arg-type]  # deliberately wrong: text
            (lambda: engine.result(uuid4(), timeout=float("nan")), "timeout"),
            (lambda: engine.cancel(str(uuid4())), "run_id"),  # type: ignore[arg-type]  # deliberately wrong: text
        ):
            with pytest.raises(UsageError) as refused:
                call()
            assert refused.value.argument == argument
