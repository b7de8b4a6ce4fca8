"""The backend contract suite: every backend must pass it unchanged.

Subclass `BackendContract` in a test module and provide a `harness` fixture (an object
satisfying `BackendHarness`). Durations are short and real-time-safe: the same tests run on
the memory backend with a `FakeClock` and on Postgres with the wall clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID

import attrs
import pytest

from umt_sdk import (
    AttemptInfo,
    CanceledError,
    Engine,
    ErrorInfo,
    FactTimeoutError,
    IdempotencyConflictError,
    PayloadError,
    Registry,
    RetryPolicy,
    RunCanceledError,
    RunFailedError,
    RunInfo,
    StepFailedError,
    SyncTaskContext,
    TaskContext,
    TaskDefinition,
    step,
    task,
    with_attempt_token,
)
from umt_sdk._engine import new_run_id
from umt_sdk._spi import Ending, Lease, StepRecord
from umt_sdk.exceptions import FencingError, NotInTaskError, RunNotFoundError, UsageError
from umt_sdk.testing._contract_spi import SpiMeaningsContract
from umt_sdk.testing._helpers import BackendHarness, freeze_heartbeats, simulate_crash

__all__ = ["BackendContract"]

# Bodies count how often they really ran, per test key: replay must never run them again.
BODY_RUNS: Counter[tuple[str, str]] = Counter()
GATES: dict[str, asyncio.Event] = {}
ORDER: list[str] = []
BUSINESS: dict[str, Any] = {}


@attrs.frozen
class Job:
    key: str
    n: int = 0


def _gate(name: str) -> asyncio.Event:
    if name not in GATES:
        GATES[name] = asyncio.Event()
    return GATES[name]


@step("first")
async def first(key: str) -> int:
    BODY_RUNS[(key, "first")] += 1
    return 1


@step("second")
async def second(key: str) -> int:
    BODY_RUNS[(key, "second")] += 1
    gate = GATES.get(key)
    if gate is not None:
        await gate.wait()
    return 2


@task("contract.steps", version=1)
async def steps_task(ctx: TaskContext[Job]) -> int:
    a = await first(ctx.input.key)
    b = await second(ctx.input.key)
    c = await ctx.step.run("third", lambda: 3)
    return a + b + c


@task("contract.echo", version=1)
async def echo_task(ctx: TaskContext[Job]) -> Job:
    ORDER.append(ctx.input.key)
    return Job(key=ctx.input.key.upper(), n=ctx.input.n + 1)


@task("contract.echo", version=2)
async def echo_task_v2(ctx: TaskContext[Job]) -> Job:
    ORDER.append(f"v2:{ctx.input.key}")
    return Job(key=ctx.input.key, n=ctx.input.n + 2)


@task("contract.other", version=1)
async def other_task(ctx: TaskContext[Job]) -> str:
    ORDER.append(f"other:{ctx.input.key}")
    return "other"


@task("contract.sleeper", version=1)
async def sleeper_task(ctx: TaskContext[Job]) -> str:
    BODY_RUNS[(ctx.input.key, "before-sleep")] += 1
    await ctx.step.run("before", lambda: None)
    await ctx.step.sleep("nap", timedelta(milliseconds=ctx.input.n or 300))
    BODY_RUNS[(ctx.input.key, "after-sleep")] += 1
    return "rested"


@task("contract.waiter", version=1)
async def waiter_task(ctx: TaskContext[Job]) -> dict[str, Any]:
    payload: dict[str, Any] = await ctx.step.wait_for_fact(
        ctx.input.key, timeout=timedelta(seconds=ctx.input.n) if ctx.input.n else None
    )
    return payload


@task("contract.gated_waiter", version=1)
async def gated_waiter_task(ctx: TaskContext[Job]) -> str:
    async def gated() -> None:
        _gate(ctx.input.key + ":in").set()
        await _gate(ctx.input.key).wait()

    await ctx.step.run("gated", gated)
    try:
        await ctx.step.wait_for_fact(ctx.input.key + ":never-sent")
    except CanceledError:
        BODY_RUNS[(ctx.input.key, "saw-cancel")] += 1
        raise
    return "woken"


@task("contract.wait_or_timeout", version=1)
async def wait_or_timeout_task(ctx: TaskContext[Job]) -> str:
    try:
        await ctx.step.wait_for_fact("never", timeout=timedelta(milliseconds=400))
    except FactTimeoutError:
        return "timed out"
    return "got it"


@task("contract.checked", version=1)
async def checked_task(ctx: TaskContext[Job]) -> str:
    def approved_in_db() -> str | None:
        value: str | None = BUSINESS.get(ctx.input.key)
        return value

    value: str = await ctx.step.wait_for_fact(
        "approved", check=approved_in_db, poll_interval=timedelta(milliseconds=200)
    )
    return value


@task("contract.cancellable", version=1)
async def cancellable_task(ctx: TaskContext[Job]) -> str:
    await ctx.step.run("started", lambda: None)

    async def wait_for_abort() -> None:
        BODY_RUNS[(ctx.input.key, "waiting")] += 1
        _gate(ctx.input.key + ":started").set()
        await asyncio.wait_for(ctx.abort_event.wait(), timeout=20)
        if ctx.input.n == 1:
            raise ValueError("cleanup failed while stopping")
        ctx.throw_if_canceled()

    await ctx.step.run("long", wait_for_abort)
    BODY_RUNS[(ctx.input.key, "after")] += 1
    await ctx.step.run("after", lambda: None)
    return "not canceled"


@task(
    "contract.flaky",
    version=1,
    retry=RetryPolicy(max_attempts=3, initial=timedelta(milliseconds=200), backoff=1.0),
)
async def flaky_task(ctx: TaskContext[Job]) -> int:
    async def flaky() -> int:
        BODY_RUNS[(ctx.input.key, "flaky")] += 1
        if BODY_RUNS[(ctx.input.key, "flaky")] <= ctx.input.n:
            raise ConnectionError(f"attempt {BODY_RUNS[(ctx.input.key, 'flaky')]} failed")
        return BODY_RUNS[(ctx.input.key, "flaky")]

    value: int = await ctx.step.run("call", flaky)
    return value


@task(
    "contract.flaky_handler",
    version=1,
    retry=RetryPolicy(
        max_attempts=3,
        initial=timedelta(milliseconds=200),
        backoff=1.0,
        non_retryable=(KeyError,),
    ),
)
async def flaky_handler_task(ctx: TaskContext[Job]) -> str:
    await ctx.step.run("once", lambda: BODY_RUNS.update({(ctx.input.key, "once"): 1}))
    BODY_RUNS[(ctx.input.key, "handler")] += 1
    if ctx.input.n == -1:
        raise KeyError("not retryable")
    if BODY_RUNS[(ctx.input.key, "handler")] <= ctx.input.n:
        raise RuntimeError("handler failed")
    return "ok"


@task("contract.step_gives_up", version=1, retry=RetryPolicy.none())
async def step_gives_up_task(ctx: TaskContext[Job]) -> str:
    def boom() -> None:
        raise OSError("disk on fire")

    try:
        await ctx.step.run("boom", boom)
    except StepFailedError as exc:
        if ctx.input.n == 1:
            return f"handled {exc.error_type}"
        raise
    return "unreachable"


@task("contract.shape", version=1)
async def shape_a(ctx: TaskContext[Job]) -> str:
    await ctx.step.run("x", lambda: 1)
    await ctx.step.wait_for_fact("go")
    return "a"


@task("contract.shape", version=1)
async def shape_b(ctx: TaskContext[Job]) -> str:
    await ctx.step.sleep("x", timedelta(milliseconds=1))
    return "b"


@task("contract.repeats", version=1)
async def repeats_task(ctx: TaskContext[Job]) -> list[int]:
    return [await ctx.step.run("tick", lambda i=i: i) for i in range(3)]


@step("sync-double")
def sync_double(x: int) -> int:
    return x * 2


@task("contract.plain", version=1)
def plain_task(ctx: SyncTaskContext[Job]) -> int:
    doubled = sync_double(ctx.input.n)
    tripled = ctx.step.run("triple", lambda: ctx.input.n * 3)
    ctx.step.sleep("tiny", timedelta(milliseconds=50))
    return doubled + tripled


@task("contract.mixed", version=1)
async def mixed_task(ctx: TaskContext[Job]) -> int:
    a = await sync_double.aio(ctx.input.n)
    b: int = await sync_double(ctx.input.n)  # type: ignore[misc]  # runtime form, untyped
    return a + b


@task("contract.fenced", version=1)
async def fenced_task(ctx: TaskContext[Job]) -> str:
    harness: BackendHarness = BUSINESS["harness"]

    async def submit() -> str:
        async def act(info: AttemptInfo) -> str:
            BUSINESS.setdefault("resumed", []).append(info.resumed)
            BODY_RUNS[(ctx.input.key, "act")] += 1
            gate = GATES.get(f"{ctx.input.key}:attempt{ctx.attempt}")
            if gate is not None:
                await gate.wait()
            return f"receipt-{info.attempt_token}"

        async def commit(tx: Any, receipt: str) -> None:
            BUSINESS.setdefault("commits", []).append(ctx.attempt_token)
            BODY_RUNS[(ctx.input.key, "precommit")] += 1
            gate = GATES.get(f"{ctx.input.key}:precommit{ctx.attempt}")
            if gate is not None:  # frozen inside the commit, before its business write
                await gate.wait()
            await harness.business_insert(tx, ctx.input.key, receipt)
            BODY_RUNS[(ctx.input.key, "commit")] += 1
            gate = GATES.get(f"{ctx.input.key}:commit{ctx.attempt}")
            if gate is not None:  # frozen inside the commit, its business row written
                await gate.wait()

        conn = await harness.business_connection()
        try:
            return await with_attempt_token(conn, f"submit:{ctx.input.key}", act, commit=commit)
        except FencingError:
            BUSINESS.setdefault("fenced", []).append(ctx.attempt_token)
            raise
        finally:
            await harness.business_release(conn)

    receipt: str = await ctx.step.run("submit", submit)
    return receipt


@task("contract.dies", version=1, max_lost_leases=3)
async def dies_task(ctx: TaskContext[Job]) -> str:
    """Its worker dies inside `doomed` every time (the test crashes it there)."""
    await ctx.step.run("before", lambda: None)

    async def doomed() -> str:
        BODY_RUNS[(ctx.input.key, "doomed")] += 1
        await _gate(f"{ctx.input.key}:never").wait()
        return "survived"

    value: str = await ctx.step.run("doomed", doomed)
    return value


@task("contract.inching", version=1, max_lost_leases=2)
async def inching_task(ctx: TaskContext[Job]) -> list[str]:
    """Each execution records one more step, then its worker dies in the next one."""
    key = ctx.input.key

    async def part(name: str) -> str:
        BODY_RUNS[(key, name)] += 1
        if name != "p1" and BODY_RUNS[(key, name)] == 1:
            BODY_RUNS[(key, "dying")] += 1
            await _gate(f"{key}:never").wait()
        return name

    return [await ctx.step.run(name, part, name) for name in ("p1", "p2", "p3", "p4")]


# -- the abort table: how each handler shape ends under each abort --------------------------------

ABORT_SHAPES = ("ignores", "throws", "catches", "sync")
"""ignores: waits for its go-ahead without looking at the abort; throws: awaits the abort
signal (or the go-ahead), then calls throw_if_canceled(); catches: the same, but catches
CanceledError and returns; sync: a plain handler that polls throw_if_canceled()."""


async def _abort_or_go(ctx: TaskContext[Job]) -> None:
    go = asyncio.ensure_future(_gate(f"{ctx.input.key}:go").wait())
    abort = asyncio.ensure_future(ctx.abort_event.wait())
    try:
        await asyncio.wait({go, abort}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        go.cancel()
        abort.cancel()


@task("contract.aborts", version=1)
async def aborts_task(ctx: TaskContext[Job]) -> str:
    key, shape = ctx.input.key, ABORT_SHAPES[ctx.input.n]

    def body(name: str) -> str:
        BODY_RUNS[(key, name)] += 1
        return name

    await ctx.step.run("a", body, "a")
    _gate(f"{key}:in").set()
    if shape == "ignores":
        await _gate(f"{key}:go").wait()
    else:
        await _abort_or_go(ctx)
        if shape == "catches":
            try:
                ctx.throw_if_canceled()
            except CanceledError:
                return "caught"
        else:
            ctx.throw_if_canceled()
    await ctx.step.run("b", body, "b")
    return "done"


@task("contract.aborts_sync", version=1)
def aborts_sync_task(ctx: SyncTaskContext[Job]) -> str:
    key = ctx.input.key

    def body(name: str) -> str:
        BODY_RUNS[(key, name)] += 1
        return name

    ctx.step.run("a", body, "a")
    BUSINESS[f"{key}:in"] = True
    while not BUSINESS.get(f"{key}:go"):
        ctx.throw_if_canceled()
        time.sleep(0.01)
    ctx.step.run("b", body, "b")
    return "done"


@task("contract.plain_nested", version=1)
def plain_nested_task(ctx: SyncTaskContext[Job]) -> int:
    """The shape docs/writing-tasks.md shows: a plain handler calling a plain step."""
    doubled: int = ctx.step.run("double", lambda n: 2 * n, ctx.input.n)
    return doubled + 1


@task("contract.own_cancelled_error", version=1, retry=RetryPolicy.none())
async def own_cancelled_error_task(ctx: TaskContext[Job]) -> str:
    """A step whose code raises `asyncio.CancelledError` itself (a library cancelling a future
    of its own): a failure of that step, not the worker stopping the execution."""

    async def body() -> str:
        BODY_RUNS[(ctx.input.key, "inner")] += 1
        inner: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        inner.cancel()
        return await inner

    try:
        await ctx.step.run("inner", body, retry=RetryPolicy.none())
    except StepFailedError as exc:
        return f"step failed: {exc.error_type}"
    return "not reached"


class Unprintable(Exception):
    """An error whose `__str__` and `__repr__` raise: umt still records it."""

    def __str__(self) -> str:
        raise RuntimeError("no str for you")

    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


@task("contract.unprintable", version=1, retry=RetryPolicy.none())
async def unprintable_task(ctx: TaskContext[Job]) -> str:
    def body() -> str:
        BODY_RUNS[(ctx.input.key, "boom")] += 1
        raise Unprintable

    try:
        await ctx.step.run("boom", body, retry=RetryPolicy.none())
    except StepFailedError as exc:
        return exc.error_type
    return "not reached"


@task("contract.bad_wait", version=1, retry=RetryPolicy(max_attempts=3))
async def bad_wait_task(ctx: TaskContext[Job]) -> str:
    """Arguments of the wrong type, as users write them: seconds where a timedelta goes."""
    BODY_RUNS[(ctx.input.key, "handler")] += 1
    if ctx.input.n == 0:
        await ctx.step.wait_for_fact("go", timeout=30)  # type: ignore[arg-type]  # under test
    else:
        await ctx.step.wait_for_fact("go", poll_interval=5)  # type: ignore[arg-type]  # under test
    return "not reached"


ALL_TASKS: list[TaskDefinition[Any, Any]] = [
    bad_wait_task,
    plain_nested_task,
    own_cancelled_error_task,
    unprintable_task,
    aborts_task,
    aborts_sync_task,
    steps_task,
    echo_task,
    echo_task_v2,
    other_task,
    sleeper_task,
    waiter_task,
    gated_waiter_task,
    wait_or_timeout_task,
    checked_task,
    cancellable_task,
    flaky_task,
    flaky_handler_task,
    step_gives_up_task,
    repeats_task,
    plain_task,
    mixed_task,
    fenced_task,
]


async def wait_until(
    engine: Engine,
    run_id: UUID,
    predicate: Callable[[RunInfo], bool],
    *,
    timeout: float = 15.0,
    what: str = "condition",
) -> RunInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = await engine.get(run_id)
        if predicate(info):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id}: timed out waiting for {what}; last: {info}")
        await asyncio.sleep(0.01)


async def _eventually(check: Callable[[], Awaitable[bool]], *, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for a condition")
        await asyncio.sleep(0.01)


class BackendContract(SpiMeaningsContract):
    """The rules every backend keeps. Provide a `harness` fixture in the subclass."""

    @pytest.fixture
    async def engine(self, harness: BackendHarness) -> Any:
        BODY_RUNS.clear()
        GATES.clear()
        ORDER.clear()
        BUSINESS.clear()
        BUSINESS["harness"] = harness
        engine = await harness.connect(Registry(ALL_TASKS))
        yield engine
        for gate in GATES.values():
            gate.set()
        await engine.close()

    # -- basics ---------------------------------------------------------------------------------

    async def test_enqueue_run_and_result(self, engine: Engine) -> None:
        handle = await engine.enqueue(echo_task_v2, Job(key="a", n=1))
        assert handle.created
        assert handle.task_version == 2, "new runs use the newest registered version"
        async with engine.worker(concurrency=2):
            result = await handle.result(timeout=15)
        assert result == Job(key="a", n=3)
        info = await engine.get(handle.run_id)
        assert info.status == "completed"
        assert info.attempts == 1
        assert info.failures == 0
        assert info.output == {"key": "a", "n": 3}

    async def test_invalid_input_is_rejected_and_nothing_stored(self, engine: Engine) -> None:
        with pytest.raises(PayloadError) as caught:
            await engine.enqueue(echo_task_v2, {"key": 5})
        assert "key" in str(caught.value)
        with pytest.raises(PayloadError):
            await engine.enqueue(echo_task_v2, {"key": "a", "extra": 1})
        page = await engine.list()
        assert len(page) == 0

    async def test_get_unknown_run(self, engine: Engine) -> None:
        with pytest.raises(RunNotFoundError):
            await engine.get(new_run_id())

    async def test_step_outside_task_is_an_error(self, engine: Engine) -> None:
        with pytest.raises(NotInTaskError):
            await first("x")

    # -- replay -----------------------------------------------------------------------------------

    async def test_replay_by_name_after_crash(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _gate("r1")
        handle = await engine.enqueue(steps_task, Job(key="r1"))
        worker_a = engine.worker(concurrency=1, lease=harness.lease)
        await worker_a.start()
        await _eventually(lambda: _true(BODY_RUNS[("r1", "second")] == 1))
        await asyncio.sleep(worker_a.heartbeat_interval.total_seconds() * 2)
        simulate_crash(worker_a)
        await worker_a.stop()
        await harness.advance(harness.lease * 2)
        GATES["r1"].set()
        async with engine.worker(concurrency=1, lease=harness.lease):
            assert await handle.result(timeout=20) == 6
        assert BODY_RUNS[("r1", "first")] == 1, "a completed step never runs again"
        assert BODY_RUNS[("r1", "second")] == 2, "the interrupted step re-runs"
        info = await engine.get(handle.run_id)
        assert info.attempts == 2
        assert info.lease_expirations == 1
        statuses = [(s.name, s.status) for s in info.timeline]
        assert ("second", "interrupted") in statuses, statuses
        assert statuses.count(("second", "completed")) == 1
        assert all(s.status != "running" for s in info.timeline)

    async def test_a_cancel_its_crashed_holder_never_saw_ends_the_run_at_the_next_claim(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _gate("cc")
        handle = await engine.enqueue(steps_task, Job(key="cc"))
        worker_a = engine.worker(concurrency=1, lease=harness.lease)
        await worker_a.start()
        await _eventually(lambda: _true(BODY_RUNS[("cc", "second")] == 1))
        simulate_crash(worker_a)
        await worker_a.stop()
        assert await engine.cancel(handle.run_id, reason="while it was down") == "requested"
        await harness.advance(harness.lease * 2)
        GATES["cc"].set()
        async with engine.worker(concurrency=1, lease=harness.lease):
            with pytest.raises(RunCanceledError) as caught:
                await handle.result(timeout=20)
        assert caught.value.reason == "while it was down"
        assert BODY_RUNS[("cc", "second")] == 1, "the handler does not start again"
        info = await engine.get(handle.run_id)
        assert [e.outcome for e in info.executions] == ["interrupted", "canceled"]
        assert info.lease_expirations == 1

    async def test_repeated_step_names_get_occurrence_suffix(self, engine: Engine) -> None:
        handle = await engine.enqueue(repeats_task, Job(key="rep"))
        async with engine.worker():
            assert await handle.result(timeout=15) == [0, 1, 2]
        names = [s.name for s in (await engine.get(handle.run_id)).timeline]
        assert names == ["tick", "tick#2", "tick#3"]

    async def test_non_determinism_is_detected(self, engine: Engine) -> None:
        original = Engine(engine.backend, Registry([shape_a]))
        handle = await original.enqueue(shape_a, Job(key="nd"))
        async with original.worker():
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting", what="waiting")
        changed = Engine(engine.backend, Registry([shape_b]))
        await engine.signal(handle.run_id, "go")
        async with changed.worker():
            with pytest.raises(RunFailedError) as caught:
                await changed.result(handle.run_id, timeout=15)
        assert caught.value.error_type.endswith("NonDeterminismError")
        assert "'step'" in caught.value.error_message
        assert "'sleep'" in caught.value.error_message

    async def test_plain_task_and_plain_steps(self, engine: Engine) -> None:
        plain = await engine.enqueue(plain_task, Job(key="p", n=5))
        mixed = await engine.enqueue(mixed_task, Job(key="m", n=4))
        async with engine.worker():
            assert await plain.result(timeout=15) == 25
            assert await mixed.result(timeout=15) == 16
        names = [s.name for s in (await engine.get(plain.run_id)).timeline]
        assert names == ["sync-double", "triple", "tiny"]

    # -- sleep and facts --------------------------------------------------------------------------

    async def test_sleep_releases_the_slot(self, engine: Engine) -> None:
        one = await engine.enqueue(sleeper_task, Job(key="s1", n=500))
        two = await engine.enqueue(sleeper_task, Job(key="s2", n=500))
        async with engine.worker(concurrency=1):
            for handle in (one, two):
                await wait_until(
                    engine, handle.run_id, lambda i: i.status == "waiting", what="sleep"
                )
            assert await one.result(timeout=15) == "rested"
            assert await two.result(timeout=15) == "rested"
        assert BODY_RUNS[("s1", "after-sleep")] == 1
        info = await engine.get(one.run_id)
        assert [(s.name, s.status) for s in info.timeline] == [
            ("before", "completed"),
            ("nap", "completed"),
        ]

    async def test_fact_sent_before_its_waiter_is_not_lost(self, engine: Engine) -> None:
        handle = await engine.enqueue(
            waiter_task, Job(key="approved"), delay=timedelta(milliseconds=300)
        )
        assert await engine.signal(handle.run_id, "approved", {"by": "ops"})
        async with engine.worker():
            assert await handle.result(timeout=15) == {"by": "ops"}

    async def test_first_write_wins(self, engine: Engine) -> None:
        handle = await engine.enqueue(waiter_task, Job(key="f"))
        assert await engine.signal(handle.run_id, "f", {"v": 1}) is True
        assert await engine.signal(handle.run_id, "f", {"v": 2}) is False
        async with engine.worker():
            assert await handle.result(timeout=15) == {"v": 1}

    async def test_several_runs_wait_for_one_broadcast_fact(self, engine: Engine) -> None:
        handles = [await engine.enqueue(waiter_task, Job(key="go", n=0)) for _ in range(3)]
        async with engine.worker(concurrency=1):
            for h in handles:
                await wait_until(engine, h.run_id, lambda i: i.status == "waiting", what="parked")
            assert await engine.broadcast("go", {"all": True})
            for h in handles:
                assert await h.result(timeout=15) == {"all": True}

    async def test_signal_without_a_run_id_is_refused_not_broadcast(self, engine: Engine) -> None:
        # A run id of None (a failed lookup, say) must never reach every waiting run.
        handle = await engine.enqueue(waiter_task, Job(key="only-mine"))
        for bad in (None, str(handle.run_id), 7):
            with pytest.raises(UsageError, match="run id") as caught:
                await engine.signal(bad, "only-mine", {"leaked": True})  # type: ignore[arg-type]  # bad call under test
            assert caught.value.argument == "run_id"
            assert isinstance(caught.value, ValueError)
        with pytest.raises(UsageError, match=r"engine\.broadcast"):
            await engine.signal(None, "only-mine", {"leaked": True})  # type: ignore[arg-type]  # bad call under test
        assert await engine.backend.get_facts(run_id=handle.run_id, name="only-mine") == []
        with pytest.raises(UsageError, match="run id"):
            await engine.cancel(None)  # type: ignore[arg-type]  # bad call under test
        with pytest.raises(UsageError, match="run id"):
            await engine.get(None)  # type: ignore[arg-type]  # bad call under test
        with pytest.raises(UsageError, match="run id"):
            await engine.result(None)  # type: ignore[arg-type]  # bad call under test
        assert await engine.signal(handle.run_id, "only-mine", {"mine": True})
        async with engine.worker():
            assert await handle.result(timeout=15) == {"mine": True}

    async def test_fact_wait_times_out_durably(self, engine: Engine) -> None:
        handle = await engine.enqueue(wait_or_timeout_task, Job(key="t"))
        async with engine.worker():
            assert await handle.result(timeout=15) == "timed out"
        info = await engine.get(handle.run_id)
        assert [(s.name, s.status) for s in info.timeline] == [("never", "completed")]

    async def test_check_reads_business_state(self, engine: Engine) -> None:
        handle = await engine.enqueue(checked_task, Job(key="plan-9"))
        async with engine.worker():
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting", what="parked")
            BUSINESS["plan-9"] = "approved-by-alice"
            assert await handle.result(timeout=15) == "approved-by-alice"

    async def test_the_head_of_a_run_is_the_run_without_its_steps(self, engine: Engine) -> None:
        """`get_run_head`: what `result()` polls, one read whatever the run's length."""
        assert await engine.backend.get_run_head(new_run_id()) is None
        handle = await engine.enqueue(steps_task, Job(key="head"))
        pending = await engine.backend.get_run_head(handle.run_id)
        assert pending is not None
        assert (pending.status, pending.steps, pending.executions) == ("pending", (), ())
        async with engine.worker():
            await handle.result(timeout=15)
        full = await engine.backend.get_run(handle.run_id)
        head = await engine.backend.get_run_head(handle.run_id)
        assert full is not None
        assert head is not None
        assert full.steps, "the full read has the steps"
        assert (head.steps, head.executions) == ((), ())
        assert attrs.evolve(head, observed_at=None) == attrs.evolve(
            full, steps=(), executions=(), observed_at=None
        )

    # -- execution semantics under user code ------------------------------------------------------

    async def test_plain_handlers_calling_plain_steps_never_deadlock(self, engine: Engine) -> None:
        """Each plain handler holds a thread while its plain step needs another: with more
        slots than the default thread pool has threads, every run must still finish."""
        handles = [
            await engine.enqueue(plain_nested_task, Job(key=f"p{i}", n=i)) for i in range(70)
        ]
        async with engine.worker(concurrency=64):
            results = [await h.result(timeout=60) for h in handles]
        assert results == [2 * i + 1 for i in range(70)]

    async def test_a_cancelled_error_raised_by_step_code_fails_the_step(
        self, engine: Engine
    ) -> None:
        handle = await engine.enqueue(own_cancelled_error_task, Job(key="own-cancel"))
        async with engine.worker():
            result = await handle.result(timeout=15)
        assert result == "step failed: asyncio.exceptions.CancelledError"
        assert BODY_RUNS[("own-cancel", "inner")] == 1
        info = await engine.get(handle.run_id)
        assert [e.outcome for e in info.executions] == ["completed"]
        (record,) = [s for s in info.timeline if s.name == "inner"]
        assert record.status == "failed"

    async def test_an_error_that_cannot_be_printed_is_still_recorded(self, engine: Engine) -> None:
        handle = await engine.enqueue(unprintable_task, Job(key="unprintable"))
        async with engine.worker():
            result = await handle.result(timeout=15)
        assert result.endswith("Unprintable")
        assert BODY_RUNS[("unprintable", "boom")] == 1
        info = await engine.get(handle.run_id)
        (record,) = [s for s in info.timeline if s.name == "boom"]
        assert record.status == "failed"
        assert record.error is not None
        assert "unprintable" in record.error.message

    @pytest.mark.parametrize(("n", "argument"), [(0, "timeout"), (1, "poll_interval")])
    async def test_a_wrong_type_argument_fails_the_run_at_once(
        self, engine: Engine, n: int, argument: str
    ) -> None:
        handle = await engine.enqueue(bad_wait_task, Job(key=f"bad-{argument}", n=n))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert caught.value.error_type == "umt_sdk.UsageError"
        assert argument in caught.value.error_message
        assert BODY_RUNS[(f"bad-{argument}", "handler")] == 1, "a refused argument is not retried"

    # -- the abort table --------------------------------------------------------------------------

    async def _start_abort_shape(self, engine: Engine, key: str, shape: str) -> UUID:
        if shape == "sync":
            handle = await engine.enqueue(aborts_sync_task, Job(key=key))
        else:
            handle = await engine.enqueue(aborts_task, Job(key=key, n=ABORT_SHAPES.index(shape)))
        return handle.run_id

    async def _inside(self, key: str, shape: str) -> None:
        if shape == "sync":
            await _eventually(lambda: _true(bool(BUSINESS.get(f"{key}:in"))))
        else:
            await asyncio.wait_for(_gate(f"{key}:in").wait(), 15)

    def _go(self, key: str) -> None:
        _gate(f"{key}:go").set()
        BUSINESS[f"{key}:go"] = True

    @pytest.mark.parametrize("shape", ABORT_SHAPES)
    async def test_a_worker_shutting_down_hands_the_run_back_uncharged(
        self, engine: Engine, shape: str
    ) -> None:
        """A deploy: the worker stops gracefully while a handler is between steps. Whatever the
        handler does with the abort signal, the run is released (never failed, never charged
        a failure), and the next worker finishes it without running a completed step again."""
        key = f"shutdown-{shape}"
        run_id = await self._start_abort_shape(engine, key, shape)
        async with engine.worker(shutdown_grace=timedelta(milliseconds=300)):
            await self._inside(key, shape)
        info = await engine.get(run_id)
        assert info.status == "pending", (shape, info.status, info.error)
        assert info.failures == 0
        assert [e.outcome for e in info.executions] == ["released"]
        self._go(key)
        async with engine.worker():
            assert await engine.result(run_id, timeout=15) == "done"
        info = await engine.get(run_id)
        assert (info.status, info.failures) == ("completed", 0)
        assert [e.outcome for e in info.executions] == ["released", "completed"]
        assert BODY_RUNS[(key, "a")] == 1
        assert BODY_RUNS[(key, "b")] == 1

    @pytest.mark.parametrize("shape", ["throws", "catches", "sync"])
    async def test_a_cancel_ends_the_run_as_the_handler_answers_it(
        self, engine: Engine, shape: str
    ) -> None:
        """The run's cancel: a handler that lets `CanceledError` out ends canceled, one that
        catches it and returns completes with what it returned."""
        key = f"cancel-{shape}"
        run_id = await self._start_abort_shape(engine, key, shape)
        async with engine.worker():
            await self._inside(key, shape)
            assert await engine.cancel(run_id, reason="no longer wanted") == "requested"
            if shape == "catches":
                assert await engine.result(run_id, timeout=15) == "caught"
            else:
                with pytest.raises(RunCanceledError) as caught:
                    await engine.result(run_id, timeout=15)
                assert caught.value.reason == "no longer wanted"
        info = await engine.get(run_id)
        assert info.status == ("completed" if shape == "catches" else "canceled")
        assert info.failures == 0
        assert info.error is None
        assert BODY_RUNS[(key, "b")] == 0

    async def test_a_cancel_during_a_shutdown_ends_the_run_canceled(self, engine: Engine) -> None:
        """Both at once: the cancel wins; the run is not handed back to be started again."""
        key = "cancel-and-shutdown"
        run_id = await self._start_abort_shape(engine, key, "ignores")
        async with engine.worker(shutdown_grace=timedelta(milliseconds=300)):
            await self._inside(key, "ignores")
            assert await engine.cancel(run_id, reason="both") == "requested"
        info = await engine.get(run_id)
        assert info.status == "canceled", (info.status, info.error)
        assert info.failures == 0

    # -- cancel -----------------------------------------------------------------------------------

    async def test_cancel_waiting_run_ends_it_at_once(self, engine: Engine) -> None:
        handle = await engine.enqueue(waiter_task, Job(key="never-sent"))
        async with engine.worker():
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting", what="parked")
            assert await engine.cancel(handle.run_id, reason="user asked") == "canceled"
            with pytest.raises(RunCanceledError) as caught:
                await handle.result(timeout=5)
        assert caught.value.reason == "user asked"
        assert await engine.cancel(handle.run_id, reason="again") == "already_finished"

    async def test_cancel_running_fires_abort_and_stops_later_steps(self, engine: Engine) -> None:
        handle = await engine.enqueue(cancellable_task, Job(key="c1"))
        async with engine.worker():
            await asyncio.wait_for(_gate("c1:started").wait(), 15)
            started = time.monotonic()
            assert await engine.cancel(handle.run_id, reason="stop it") == "requested"
            with pytest.raises(RunCanceledError):
                await handle.result(timeout=15)
            assert time.monotonic() - started < 2.0, "abort must fire within about a second"
        assert BODY_RUNS[("c1", "after")] == 0
        info = await engine.get(handle.run_id)
        assert info.status == "canceled"
        assert info.cancel_reason == "stop it"
        assert [s.name for s in info.timeline if s.status == "completed"] == ["started"]

    async def test_a_run_whose_cancel_was_requested_is_never_parked(self, engine: Engine) -> None:
        """The store refuses to hand back a run whose cancel was requested (the heartbeat
        that would have told the worker may not have come yet): the cancel reaches the
        handler at the wait instead, and the run ends canceled rather than waiting forever."""
        handle = await engine.enqueue(gated_waiter_task, Job(key="cp"))
        async with engine.worker() as worker:
            await asyncio.wait_for(_gate("cp:in").wait(), 15)
            freeze_heartbeats(worker)  # the cancel is stored, and no heartbeat reports it
            assert await engine.cancel(handle.run_id, reason="no more") == "requested"
            _gate("cp").set()
            with pytest.raises(RunCanceledError) as caught:
                await handle.result(timeout=15)
        assert caught.value.reason == "no more"
        assert BODY_RUNS[("cp", "saw-cancel")] == 1, "the handler saw the cancel at the wait"
        info = await engine.get(handle.run_id)
        assert [e.outcome for e in info.executions] == ["canceled"]

    async def test_end_execution_refusals_change_nothing(self, engine: Engine) -> None:
        """`end_execution` refuses a park onto a fact already stored and any hand-back of a
        run whose cancel was requested, and stores nothing then; a finishing ending lands."""
        handle = await engine.enqueue(waiter_task, Job(key="refusals"))
        [claimed] = await engine.backend.claim(
            worker_id="w", pairs=[waiter_task.pair], limit=1, lease=timedelta(seconds=30)
        )
        lease = Lease(
            run_id=handle.run_id,
            fencing_token=claimed.fencing_token,
            worker_id="w",
            duration=timedelta(seconds=30),
        )
        waiting = StepRecord(name="refusals", kind="fact", status="waiting")
        await engine.signal(handle.run_id, "refusals", {"early": True})
        park = Ending(status="waiting", outcome="waiting", wait_for="refusals", step=waiting)
        assert await engine.backend.end_execution(lease, park) == "fact_present"
        assert await engine.cancel(handle.run_id, reason="stop") == "requested"
        elsewhere = Ending(status="waiting", outcome="waiting", wait_for="other", step=waiting)
        retry = Ending(status="pending", outcome="retrying", count_failure=True)
        for ending in (elsewhere, retry, Ending(status="pending", outcome="released")):
            assert await engine.backend.end_execution(lease, ending) == "cancel_requested"
        record = await engine.backend.get_run(handle.run_id)
        assert record is not None
        assert (record.status, record.failures, tuple(record.steps)) == ("running", 0, ())
        assert record.fencing_token == claimed.fencing_token
        canceled = Ending(status="canceled", outcome="canceled")
        assert await engine.backend.end_execution(lease, canceled) == "ended"
        info = await engine.get(handle.run_id)
        assert (info.status, [e.outcome for e in info.executions]) == ("canceled", ["canceled"])
        with pytest.raises(FencingError):
            await engine.backend.end_execution(lease, canceled)

    async def test_errors_of_a_canceled_handler_are_recorded(self, engine: Engine) -> None:
        handle = await engine.enqueue(cancellable_task, Job(key="c2", n=1))
        async with engine.worker():
            await asyncio.wait_for(_gate("c2:started").wait(), 15)
            await engine.cancel(handle.run_id, reason="stop")
            with pytest.raises(RunCanceledError):
                await handle.result(timeout=15)
        info = await engine.get(handle.run_id)
        assert info.status == "canceled"
        assert info.error is not None
        assert "cleanup failed while stopping" in info.error.message

    # -- idempotency and priority -----------------------------------------------------------------

    async def test_idempotent_enqueue_and_conflict(self, engine: Engine) -> None:
        one = await engine.enqueue(echo_task_v2, Job(key="i"), idempotency_key="plan:i")
        two = await engine.enqueue(echo_task_v2, {"key": "i", "n": 0}, idempotency_key="plan:i")
        assert two.run_id == one.run_id
        assert one.created
        assert not two.created
        with pytest.raises(
            IdempotencyConflictError,
            match=r"'plan:i' of task 'contract.echo' already names run .* with a "
            "different input; use a new key",
        ) as caught:
            await engine.enqueue(echo_task_v2, Job(key="other"), idempotency_key="plan:i")
        assert caught.value.run_id == one.run_id
        assert len(await engine.list()) == 1

    async def test_idempotency_key_of_another_version_is_refused(self, engine: Engine) -> None:
        # The handle of an idempotency hit must not claim a version the run does not have.
        one = await engine.enqueue(echo_task, Job(key="v"), idempotency_key="plan:v", version=1)
        assert one.task_version == 1
        for again in (
            engine.enqueue(echo_task_v2, Job(key="v"), idempotency_key="plan:v"),
            engine.enqueue("contract.echo", {"key": "v", "n": 0}, idempotency_key="plan:v"),
            engine.enqueue("contract.echo", Job(key="v"), idempotency_key="plan:v", version=2),
        ):
            with pytest.raises(IdempotencyConflictError, match="version 1, not version 2") as c:
                await again
            assert c.value.run_id == one.run_id
            assert (c.value.existing_version, c.value.requested_version) == (1, 2)
            assert c.value.idempotency_key == "plan:v"
        same = await engine.enqueue(
            "contract.echo", Job(key="v"), idempotency_key="plan:v", version=1
        )
        assert (same.run_id, same.created, same.task_version) == (one.run_id, False, 1)
        two = await engine.enqueue(echo_task_v2, Job(key="w"), idempotency_key="plan:w")
        with pytest.raises(IdempotencyConflictError, match="version 2, not version 1"):
            await engine.enqueue(echo_task, Job(key="w"), idempotency_key="plan:w", version=1)
        assert {r.run_id for r in (await engine.list()).runs} == {one.run_id, two.run_id}

    async def test_priority_first_then_fifo(self, engine: Engine) -> None:
        plan = [("low-1", 0), ("high-1", 5), ("low-2", 0), ("top", 9), ("high-2", 5), ("neg", -1)]
        handles = []
        for key, priority in plan:
            handles.append(
                await engine.enqueue(echo_task, Job(key=key), priority=priority, version=1)
            )
        async with engine.worker(versions=["contract.echo@1"], concurrency=1):
            for handle in handles:
                await handle.result(timeout=15)
        assert ORDER == ["top", "high-1", "high-2", "low-1", "low-2", "neg"]

    # -- versions ---------------------------------------------------------------------------------

    async def test_worker_claims_only_its_pairs(self, engine: Engine) -> None:
        v1 = await engine.enqueue(echo_task, Job(key="old"), version=1)
        v2 = await engine.enqueue(echo_task_v2, Job(key="new"))
        other = await engine.enqueue(other_task, Job(key="o"))
        async with engine.worker(versions=["contract.echo@2"]):
            await v2.result(timeout=15)
            await asyncio.sleep(0.3)
        assert ORDER == ["v2:new"]
        for handle in (v1, other):
            info = await engine.get(handle.run_id)
            assert info.status == "pending", "an unserved pair waits without failing"
            assert info.attempts == 0
            assert info.failures == 0
        async with engine.worker(versions=["contract.echo@1", "contract.other@1"]):
            await v1.result(timeout=15)
            await other.result(timeout=15)
        assert sorted(ORDER) == ["old", "other:o", "v2:new"]

    # -- leases and fencing -----------------------------------------------------------------------

    async def test_lease_expiry_takeover_rejects_the_stale_attempt(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _gate("l1")
        handle = await engine.enqueue(steps_task, Job(key="l1"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await _eventually(lambda: _true(BODY_RUNS[("l1", "second")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        stale_execution = stale._executions[handle.run_id]
        async with engine.worker(concurrency=1, lease=harness.lease) as fresh:
            await _eventually(lambda: _true(BODY_RUNS[("l1", "second")] == 2))
            # The fresh attempt holds the run (inside `second`): the stale attempt's writes are
            # refused, whatever they are, and leave nothing behind.
            held = await engine.get(handle.run_id)
            stale_token, fresh_token = (e.fencing_token for e in held.executions)
            assert fresh_token > stale_token, "a takeover gets a new, larger fencing token"
            stale_lease = Lease(
                run_id=handle.run_id,
                fencing_token=stale_token,
                worker_id=stale.worker_id,
                duration=harness.lease,
            )
            with pytest.raises(FencingError):
                await engine.backend.record_step(
                    stale_lease,
                    StepRecord(
                        name="second",
                        kind="step",
                        status="completed",
                        fencing_token=stale_token,
                        output_json="2",
                    ),
                )
            with pytest.raises(FencingError):
                await engine.backend.end_execution(
                    stale_lease, Ending(status="completed", outcome="completed", output_json="0")
                )
            with pytest.raises(FencingError):
                await engine.backend.end_execution(
                    stale_lease,
                    Ending(
                        status="failed",
                        outcome="failed",
                        error=ErrorInfo(type="Stale", message="stale"),
                        count_failure=True,
                    ),
                )
            record = await engine.backend.get_run(handle.run_id)
            assert record is not None
            assert record.status == "running"
            assert record.fencing_token == fresh_token
            assert [(s.name, s.fencing_token) for s in record.steps] == [("first", stale_token)]
            GATES["l1"].set()  # both attempts proceed; only the holder may record
            assert await handle.result(timeout=20) == 6
            await _eventually(lambda: _true(not stale.running_runs))
            del fresh
        await stale.stop()
        assert stale_execution.abort_kind == "lease_lost", "the stale attempt's write was refused"
        info = await engine.get(handle.run_id)
        tokens = {
            s.fencing_token for s in info.timeline if s.name == "second" and s.status == "completed"
        }
        assert len(tokens) == 1
        assert max(e.fencing_token for e in info.executions) in tokens
        assert [e.outcome for e in info.executions] == ["interrupted", "completed"]
        record = await engine.backend.get_run(handle.run_id)
        assert record is not None
        assert {s.name: s.fencing_token for s in record.steps} == {
            "first": stale_token,
            "second": fresh_token,
            "third": fresh_token,
        }, "no step record under the stale token after the takeover"

    async def test_fenced_side_effect_commits_once(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _gate("op1:attempt1")  # the first attempt blocks inside its side effect
        handle = await engine.enqueue(fenced_task, Job(key="op1"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await _eventually(lambda: _true(BODY_RUNS[("op1", "act")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        async with engine.worker(concurrency=1, lease=harness.lease):
            receipt = await handle.result(timeout=20)
            stale_token, fresh_token = (
                e.fencing_token for e in (await engine.get(handle.run_id)).executions
            )
            await _assert_ledger_refuses(engine, harness, "submit:op1", handle.run_id, stale_token)
            GATES["op1:attempt1"].set()
            await _eventually(lambda: _true(not stale.running_runs))
        await stale.stop()
        info = await engine.get(handle.run_id)
        rows = await harness.business_rows()
        assert rows == {"op1": receipt}, f"business rows: {rows}"
        assert BUSINESS["resumed"] == [False, True], "the takeover sees the earlier start"
        assert receipt == f"receipt-{info.executions[-1].fencing_token}"
        assert [e.outcome for e in info.executions] == ["interrupted", "completed"]
        assert BUSINESS["fenced"] == [stale_token], "the stale attempt's commit got FencingError"
        assert BUSINESS["commits"] == [fresh_token], "fence first: its callback never ran"

    async def test_fenced_op_returns_the_recorded_result(self, engine: Engine) -> None:
        first_run = await engine.enqueue(fenced_task, Job(key="op2"))
        async with engine.worker():
            receipt = await first_run.result(timeout=15)
            again = await engine.enqueue(fenced_task, Job(key="op2", n=1))
            assert await again.result(timeout=15) == receipt
        assert BODY_RUNS[("op2", "act")] == 1

    # -- retries ----------------------------------------------------------------------------------

    async def test_step_retries_durably_with_backoff(self, engine: Engine) -> None:
        handle = await engine.enqueue(flaky_task, Job(key="fl", n=2))
        async with engine.worker():
            assert await handle.result(timeout=15) == 3
        info = await engine.get(handle.run_id)
        assert [(s.name, s.status, s.attempt) for s in info.timeline] == [
            ("call", "retrying", 1),
            ("call", "retrying", 2),
            ("call", "completed", 3),
        ]
        assert info.attempts == 3, "each retry releases the slot and is claimed again"
        assert info.failures == 0
        first_try, second_try = info.timeline[0], info.timeline[1]
        assert second_try.started_at is not None
        assert first_try.finished_at is not None
        assert second_try.started_at - first_try.finished_at >= timedelta(milliseconds=190)

    async def test_step_gives_up_after_its_attempts(self, engine: Engine) -> None:
        failing = await engine.enqueue(step_gives_up_task, Job(key="g0"))
        handled = await engine.enqueue(step_gives_up_task, Job(key="g1", n=1))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await failing.result(timeout=15)
            assert await handled.result(timeout=15) == "handled OSError"
        assert "disk on fire" in caught.value.error_message
        info = await engine.get(failing.run_id)
        assert info.failures == 1
        assert [(s.name, s.status) for s in info.timeline] == [("boom", "failed")]

    async def test_handler_failures_retry_the_run(self, engine: Engine) -> None:
        flaky = await engine.enqueue(flaky_handler_task, Job(key="h", n=2))
        final = await engine.enqueue(flaky_handler_task, Job(key="k", n=-1))
        async with engine.worker():
            assert await flaky.result(timeout=15) == "ok"
            with pytest.raises(RunFailedError) as caught:
                await final.result(timeout=15)
        assert caught.value.error_type == "KeyError"
        info = await engine.get(flaky.run_id)
        assert info.failures == 2
        assert info.attempts == 3
        assert [s.name for s in info.timeline] == ["once"], "completed steps are not re-run"
        assert (await engine.get(final.run_id)).failures == 1

    # -- listing ----------------------------------------------------------------------------------

    async def test_list_filters_and_pages(self, engine: Engine) -> None:
        handles = [await engine.enqueue(echo_task_v2, Job(key=str(i))) for i in range(5)]
        await engine.enqueue(other_task, Job(key="x"))
        page = await engine.list(task_name="contract.echo", limit=3)
        assert [r.run_id for r in page] == [h.run_id for h in reversed(handles)][:3]
        assert page.next_cursor is not None
        rest = await engine.list(task_name="contract.echo", limit=3, before=page.next_cursor)
        assert [r.run_id for r in rest] == [h.run_id for h in reversed(handles)][3:]
        assert rest.next_cursor is None
        assert len(await engine.list(status="pending")) == 6
        assert len(await engine.list(status="completed")) == 0
        assert len(await engine.list(task_name="contract.echo", version=1)) == 0

    # -- a frozen commit, the ledger's fence, lost leases ----------------------------------------

    async def test_a_commit_frozen_in_its_callback_does_not_hold_up_the_takeover(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _gate("op3:commit1")  # the first attempt freezes inside its commit, its row written
        handle = await engine.enqueue(fenced_task, Job(key="op3"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await _eventually(lambda: _true(BODY_RUNS[("op3", "commit")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        async with engine.worker(concurrency=1, lease=harness.lease):
            # No lock of the frozen commit holds the run: the takeover claims it and its new
            # attempt begins the operation (raising the op's token) while the old one is frozen.
            await _eventually(lambda: _true(BODY_RUNS[("op3", "act")] == 2))
            GATES["op3:commit1"].set()  # the stale commit goes on: refused, rolled back
            receipt = await handle.result(timeout=20)
            await _eventually(lambda: _true(not stale.running_runs))
        await stale.stop()
        info = await engine.get(handle.run_id)
        stale_token, fresh_token = (e.fencing_token for e in info.executions)
        assert receipt == f"receipt-{fresh_token}"
        assert await harness.business_rows() == {"op3": receipt}
        assert BUSINESS["fenced"] == [stale_token]
        assert BUSINESS["commits"] == [stale_token, fresh_token]
        assert BUSINESS["resumed"] == [False, True]
        assert [e.outcome for e in info.executions] == ["interrupted", "completed"]

    async def test_a_stale_commit_after_a_newer_attempt_began_is_refused_before_its_callback(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _gate("op5:attempt1")  # the first attempt blocks inside its action
        _gate("op5:attempt2")  # the takeover too, once it has begun the operation
        handle = await engine.enqueue(fenced_task, Job(key="op5"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await _eventually(lambda: _true(BODY_RUNS[("op5", "act")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        async with engine.worker(concurrency=1, lease=harness.lease):
            await _eventually(lambda: _true(BODY_RUNS[("op5", "act")] == 2))
            GATES["op5:attempt1"].set()  # the stale attempt tries to commit: refused
            await _eventually(lambda: _true(not stale.running_runs))
            assert BUSINESS.get("commits", []) == [], "fence first: its callback never ran"
            assert await harness.business_rows() == {}
            GATES["op5:attempt2"].set()
            receipt = await handle.result(timeout=20)
        await stale.stop()
        info = await engine.get(handle.run_id)
        stale_token, fresh_token = (e.fencing_token for e in info.executions)
        assert BUSINESS["fenced"] == [stale_token]
        assert BUSINESS["commits"] == [fresh_token]
        assert await harness.business_rows() == {"op5": receipt}
        assert receipt == f"receipt-{fresh_token}"

    async def test_a_stale_callback_that_fails_on_the_newer_commit_raises_fencing_error(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _gate("op6:precommit1")  # fenced in, then frozen before its insert
        handle = await engine.enqueue(fenced_task, Job(key="op6"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await _eventually(lambda: _true(BODY_RUNS[("op6", "precommit")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        async with engine.worker(concurrency=1, lease=harness.lease):
            receipt = await handle.result(timeout=20)  # the newer attempt's row is committed
            GATES["op6:precommit1"].set()  # the stale insert hits its unique key
            await _eventually(lambda: _true(not stale.running_runs))
        await stale.stop()
        info = await engine.get(handle.run_id)
        stale_token = info.executions[0].fencing_token
        assert BUSINESS["fenced"] == [stale_token], "FencingError, not the duplicate-key error"
        assert await harness.business_rows() == {"op6": receipt}

    async def test_cancel_is_not_held_up_by_a_frozen_commit_which_then_writes_nothing(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _gate("op4:commit1")
        handle = await engine.enqueue(fenced_task, Job(key="op4"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await _eventually(lambda: _true(BODY_RUNS[("op4", "commit")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        outcome = await asyncio.wait_for(engine.cancel(handle.run_id, reason="operator"), 10)
        assert outcome == "canceled", "its holder is gone (lease expired): canceled at once"
        GATES["op4:commit1"].set()
        await _eventually(lambda: _true(not stale.running_runs))
        await stale.stop()
        info = await engine.get(handle.run_id)
        assert info.status == "canceled"
        assert BUSINESS["fenced"] == [info.executions[0].fencing_token]
        assert await harness.business_rows() == {}, "the frozen commit landed nowhere"

    async def test_a_run_that_keeps_losing_its_lease_fails_with_the_reason(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        dying = Engine(engine.backend, Registry([dies_task]))
        handle = await dying.enqueue(dies_task, Job(key="d1"))
        for lost in range(1, dies_task.max_lost_leases + 1):
            worker = dying.worker(concurrency=1, lease=harness.lease)
            await worker.start()
            await _eventually(_counted(("d1", "doomed"), lost))
            await _eventually(_heartbeat_names(engine, handle.run_id, "doomed"))
            simulate_crash(worker)  # the worker dies in `doomed`, every time
            await worker.stop()
            await harness.advance(harness.lease * 2)
        async with dying.worker(concurrency=1, lease=harness.lease):
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=20)
        assert caught.value.error_type == "umt_sdk.LeaseLostTooOftenError"
        message = caught.value.error_message
        assert "lost its lease 3 times without recording a step" in message, message
        assert "'doomed'" in message, message
        assert "max_lost_leases=3" in message, message
        assert BODY_RUNS[("d1", "doomed")] == 3, "the claim after the third loss does not run it"
        info = await engine.get(handle.run_id)
        assert info.status == "failed"
        assert info.lease_expirations == 3
        assert info.attempts == 4
        assert info.failures == 1
        assert [e.outcome for e in info.executions] == ["interrupted"] * 3 + ["failed"]
        assert info.error is not None
        assert info.error.type == caught.value.error_type

    async def test_lost_leases_count_since_the_last_step_record(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        inching = Engine(engine.backend, Registry([inching_task]))
        handle = await inching.enqueue(inching_task, Job(key="in"))
        for died in range(1, 4):  # more losses in all than max_lost_leases=2, one per step
            worker = inching.worker(concurrency=1, lease=harness.lease)
            await worker.start()
            await _eventually(_counted(("in", "dying"), died))
            simulate_crash(worker)
            await worker.stop()
            await harness.advance(harness.lease * 2)
        async with inching.worker(concurrency=1, lease=harness.lease):
            assert await handle.result(timeout=20) == ["p1", "p2", "p3", "p4"]
        info = await engine.get(handle.run_id)
        assert info.lease_expirations == 3, "each execution made progress before it died"
        assert info.failures == 0

    # -- payloads a backend cannot store --------------------------------------------------------

    @pytest.mark.parametrize(
        ("bad", "path"),
        [
            ("nul", "output of step 'fetch'"),
            ("surrogate", "output of step 'fetch'"),
            ("nested-nul", "output of step 'fetch'.a.b[1]"),
            ("key-nul", "output of step 'fetch'.a['k\\x00']"),
        ],
    )
    async def test_payload_step_output_that_cannot_be_stored_fails_the_step(
        self, engine: Engine, bad: str, path: str
    ) -> None:
        engine.registry.add(payload_bad_step_task)
        handle = await engine.enqueue(payload_bad_step_task, Job(key=bad))
        good = await engine.enqueue(payload_bad_step_task, Job(key="good"))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
            assert await good.result(timeout=15) == "ok"
        assert caught.value.error_type.endswith("StepFailedError")
        assert "PayloadError" in caught.value.error_message
        assert path in caught.value.error_message
        info = await engine.get(handle.run_id)
        assert info.attempts == 1, "a value that cannot be stored is not retried"
        assert info.failures == 1
        (record,) = info.timeline
        assert (record.name, record.status, record.attempt) == ("fetch", "failed", 1)
        assert record.error is not None
        assert record.error.type == "umt_sdk.PayloadError"
        assert path in record.error.message
        assert "\x00" not in record.error.message, "the stored error holds no NUL itself"
        assert BODY_RUNS[(bad, "fetch")] == 1
        assert BODY_RUNS[(bad, "after")] == 0
        assert (await engine.get(good.run_id)).failures == 0

    @pytest.mark.parametrize("bad", ["a\x00b", "a\ud800b", "\udfff"])
    async def test_payload_task_output_that_cannot_be_stored_fails_the_run_at_once(
        self, engine: Engine, bad: str
    ) -> None:
        engine.registry.add(payload_bad_output_task)
        BUSINESS["output"] = bad
        handle = await engine.enqueue(payload_bad_output_task, Job(key="out"))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert caught.value.error_type == "umt_sdk.PayloadError"
        assert "task output" in caught.value.error_message
        info = await engine.get(handle.run_id)
        assert info.status == "failed"
        assert info.output is None, "nothing is stored"
        assert (info.attempts, info.failures, info.lease_expirations) == (1, 1, 0)
        assert BODY_RUNS[("out", "handler")] == 1

    async def test_payload_input_and_fact_payload_that_cannot_be_stored_are_refused(
        self, engine: Engine
    ) -> None:
        cases: list[tuple[Any, str]] = [
            (Job(key="a\x00b"), "input.key"),
            ({"key": "x\ud800", "n": 1}, "input.key"),
        ]
        for bad, field in cases:
            with pytest.raises(PayloadError) as caught:
                await engine.enqueue(echo_task_v2, bad)
            assert caught.value.field == field
            assert field in str(caught.value)
        with pytest.raises(PayloadError) as caught:
            await engine.enqueue(echo_task_v2, Job(key="k"), idempotency_key="key\x00")
        assert caught.value.field == "idempotency_key"
        assert len(await engine.list()) == 0, "nothing is stored"
        handle = await engine.enqueue(waiter_task, Job(key="f"))
        for payload, field in [
            ({"note": ["ok", "x\x00"]}, "payload of fact 'f'.note[1]"),
            ("\ud800", "payload of fact 'f'"),
            ({"k\x00": 1}, "payload of fact 'f'['k\\x00']"),
        ]:
            with pytest.raises(PayloadError) as caught:
                await engine.signal(handle.run_id, "f", payload)
            assert caught.value.field == field
        with pytest.raises(PayloadError):
            await engine.cancel(handle.run_id, reason="no\x00")
        assert await engine.signal(handle.run_id, "f", {"v": "ok"}), "no refused fact was kept"
        async with engine.worker():
            assert await handle.result(timeout=15) == {"v": "ok"}

    async def test_payload_deep_input_is_refused_with_a_payload_error(self, engine: Engine) -> None:
        engine.registry.add(payload_any_task)
        for levels in (65, 10_000):
            deep: list[Any] = []
            inner = deep
            for _ in range(levels - 1):
                inner.append([])
                inner = inner[0]
            with pytest.raises(PayloadError) as caught:
                await engine.enqueue(payload_any_task, deep)
            assert caught.value.field.startswith("input[0]")
            assert "64 levels" in str(caught.value)
            with pytest.raises(PayloadError):
                await engine.enqueue(echo_task_v2, {"key": deep})
        assert len(await engine.list()) == 0
        at_limit: list[Any] = []
        inner = at_limit
        for _ in range(63):
            inner.append([])
            inner = inner[0]
        handle = await engine.enqueue(payload_any_task, at_limit)
        async with engine.worker():
            assert await handle.result(timeout=15) == at_limit

    async def test_payload_first_execution_sees_what_every_replay_sees(
        self, engine: Engine
    ) -> None:
        engine.registry.add(payload_types_task)
        handle = await engine.enqueue(payload_types_task, Job(key="types"))
        async with engine.worker():
            assert await handle.result(timeout=15) == "ok"
        first, replayed = BUSINESS["seen"]
        assert _shape(first) == _shape(replayed), "a replay sees other values or types"
        assert _shape(first) == _shape(PAYLOAD_TYPES_EXPECTED)
        info = await engine.get(handle.run_id)
        assert info.attempts == 2, "the sleep parked the run: the second execution replayed"

    async def test_payload_untyped_step_returning_a_non_json_value_is_refused(
        self, engine: Engine
    ) -> None:
        engine.registry.add(payload_untyped_task)
        handle = await engine.enqueue(payload_untyped_task, Job(key="untyped"))
        async with engine.worker():
            assert await handle.result(timeout=15) == "refused"
        info = await engine.get(handle.run_id)
        (record,) = info.timeline
        assert record.status == "failed"
        assert record.error is not None
        assert record.error.type == "umt_sdk.PayloadError"
        assert "output of step 'now' is a datetime" in record.error.message
        assert "output_type=" in record.error.message, "the error says how to fix it"

    async def test_payload_error_messages_holding_nul_are_recorded_escaped(
        self, engine: Engine
    ) -> None:
        engine.registry.add(payload_nul_error_task)
        handle = await engine.enqueue(payload_nul_error_task, Job(key="err"))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert caught.value.error_type == "RuntimeError"
        assert caught.value.error_message == "handler \\x00 gave up \\ud800"
        info = await engine.get(handle.run_id)
        (record,) = info.timeline
        assert (record.name, record.status) == ("boom", "failed")
        assert record.error is not None
        assert record.error.message == "disk \\x00 on fire"
        assert info.error is not None
        assert "\x00" not in info.error.traceback

    # -- claim order across pairs (appended) ------------------------------------------------------

    async def test_one_slot_goes_by_priority_across_pairs(self, engine: Engine) -> None:
        # contract.echo@1 is served (and listed) before contract.other@1; its runs are newer
        # and of lower priority, so with one slot every run of the other pair goes first.
        others = [await engine.enqueue(other_task, Job(key=f"b{i}"), priority=0) for i in range(4)]
        echoes = [
            await engine.enqueue(echo_task, Job(key=f"a{i}"), priority=-5, version=1)
            for i in range(4)
        ]
        runs: list[Any] = [*others, *echoes]
        async with engine.worker(versions=["contract.echo@1", "contract.other@1"], concurrency=1):
            for run in runs:
                await run.result(timeout=15)
        assert ORDER == ["other:b0", "other:b1", "other:b2", "other:b3", "a0", "a1", "a2", "a3"]

    async def test_one_slot_is_fifo_across_pairs_at_equal_priority(self, engine: Engine) -> None:
        handles: list[Any] = []
        for i in range(3):
            handles.append(await engine.enqueue(other_task, Job(key=f"b{i}")))
            handles.append(await engine.enqueue(echo_task, Job(key=f"a{i}"), version=1))
        async with engine.worker(versions=["contract.echo@1", "contract.other@1"], concurrency=1):
            for handle in handles:
                await handle.result(timeout=15)
        assert ORDER == ["other:b0", "a0", "other:b1", "a1", "other:b2", "a2"]

    async def test_a_batch_shares_slots_across_pairs_by_turns(self, engine: Engine) -> None:
        # Turn 1 holds each pair's best run, turn 2 each pair's second best, ...: a busy pair
        # with higher priorities does not take the whole batch; within a turn priority leads.
        busy = [await engine.enqueue(other_task, Job(key=f"b{i}"), priority=9) for i in range(6)]
        quiet = [await engine.enqueue(echo_task, Job(key=f"a{i}"), version=1) for i in range(2)]
        worker = engine.worker(versions=["contract.echo@1", "contract.other@1"], concurrency=3)
        claimed = await worker.backend.claim(
            worker_id="probe", pairs=worker.pairs, limit=3, lease=timedelta(seconds=30)
        )
        taken = {c.run_id for c in claimed}
        assert taken == {busy[0].run_id, busy[1].run_id, quiet[0].run_id}, claimed

    # -- the timeline of runs that did not end well (appended) ---------------------------------

    async def test_a_canceled_run_shows_the_step_the_cancel_stopped(self, engine: Engine) -> None:
        handle = await engine.enqueue(cancellable_task, Job(key="tc"))
        async with engine.worker():
            await asyncio.wait_for(_gate("tc:started").wait(), 15)
            await engine.cancel(handle.run_id, reason="stop it")
            with pytest.raises(RunCanceledError):
                await handle.result(timeout=15)
        info = await engine.get(handle.run_id)
        assert [(v.name, v.status) for v in info.timeline] == [
            ("started", "completed"),
            ("long", "canceled"),
        ]
        long = info.timeline[1]
        assert long.fencing_token == info.executions[-1].fencing_token
        assert long.started_at is not None
        assert not long.inferred

    async def test_a_failed_run_leaves_no_step_waiting(self, engine: Engine) -> None:
        original = Engine(engine.backend, Registry([shape_a]))
        handle = await original.enqueue(shape_a, Job(key="nd2"))
        async with original.worker():
            await wait_until(engine, handle.run_id, lambda i: i.status == "waiting", what="waiting")
        assert [(v.name, v.status) for v in (await engine.get(handle.run_id)).timeline] == [
            ("x", "completed"),
            ("go", "waiting"),
        ]
        changed = Engine(engine.backend, Registry([shape_b]))
        await engine.signal(handle.run_id, "go")
        async with changed.worker():
            with pytest.raises(RunFailedError) as caught:
                await changed.result(handle.run_id, timeout=15)
        assert caught.value.error_type.endswith("NonDeterminismError")
        info = await engine.get(handle.run_id)
        assert [(v.name, v.status) for v in info.timeline] == [
            ("x", "completed"),
            ("go", "abandoned"),
        ]

    async def test_a_step_cut_off_before_any_heartbeat_shows_as_interrupted(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _gate("nb")
        handle = await engine.enqueue(steps_task, Job(key="nb"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        freeze_heartbeats(stale)  # not one heartbeat: nothing ever names the step
        await stale.start()
        await _eventually(lambda: _true(BODY_RUNS[("nb", "second")] == 1))
        simulate_crash(stale)
        await stale.stop()
        await harness.advance(harness.lease * 2)
        GATES["nb"].set()
        async with engine.worker(concurrency=1, lease=harness.lease):
            assert await handle.result(timeout=20) == 6
        info = await engine.get(handle.run_id)
        first_token, second_token = (e.fencing_token for e in info.executions)
        assert [(v.name, v.status, v.fencing_token) for v in info.timeline] == [
            ("first", "completed", first_token),
            ("second", "interrupted", first_token),
            ("second", "completed", second_token),
            ("third", "completed", second_token),
        ]
        cut = info.timeline[1]
        assert cut.inferred, "no heartbeat named it: inferred from the next attempt"
        assert cut.started_at is None
        assert cut.attempt == 1

    async def test_a_step_is_named_by_a_prompt_heartbeat(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _gate("pb")
        handle = await engine.enqueue(steps_task, Job(key="pb"))
        stale = engine.worker(concurrency=1, lease=harness.lease)
        stale.heartbeat_interval = timedelta(hours=1)  # no regular beat during this test
        await stale.start()
        await wait_until(
            engine,
            handle.run_id,
            lambda i: bool(i.executions) and i.executions[-1].current_step == "second",
            what="a heartbeat that names the running step",
        )
        simulate_crash(stale)
        await stale.stop()
        await harness.advance(harness.lease * 2)
        GATES["pb"].set()
        async with engine.worker(concurrency=1, lease=harness.lease):
            assert await handle.result(timeout=20) == 6
        info = await engine.get(handle.run_id)
        cut = [v for v in info.timeline if v.status == "interrupted"]
        assert [(v.name, v.inferred) for v in cut] == [("second", False)]
        assert cut[0].started_at is not None

    async def test_an_expired_lease_reads_lease_expired(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _gate("le")
        handle = await engine.enqueue(steps_task, Job(key="le"))
        pending = await engine.get(handle.run_id)
        assert (pending.lease_expired, pending.display_status) == (False, "pending")
        stale = engine.worker(concurrency=1, lease=harness.lease)
        await stale.start()
        await _eventually(lambda: _true(BODY_RUNS[("le", "second")] == 1))
        freeze_heartbeats(stale)
        await harness.advance(harness.lease * 2)
        info = await engine.get(handle.run_id)
        assert info.status == "running", "the data model keeps the stored status"
        assert info.lease_expired
        assert info.display_status == "running (lease expired)"
        assert info.lease_expires_at is not None
        listed = [r for r in await engine.list() if r.run_id == handle.run_id]
        assert [r.display_status for r in listed] == ["running (lease expired)"]
        simulate_crash(stale)
        await stale.stop()
        GATES["le"].set()
        async with engine.worker(concurrency=1, lease=harness.lease):
            assert await handle.result(timeout=20) == 6
        done = await engine.get(handle.run_id)
        assert (done.lease_expired, done.display_status) == (False, "completed")


async def _true(value: bool) -> bool:
    return value


def _heartbeat_names(engine: Engine, run_id: UUID, step_name: str) -> Callable[[], Awaitable[bool]]:
    """Whether a heartbeat of the run's current execution has reported it inside `step_name`."""

    async def check() -> bool:
        executions = (await engine.get(run_id)).executions
        return bool(executions) and executions[-1].current_step == step_name

    return check


def _counted(key: tuple[str, str], count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return BODY_RUNS[key] == count

    return check


async def _assert_ledger_refuses(
    engine: Engine, harness: BackendHarness, op_key: str, run_id: UUID, stale_token: int
) -> None:
    """The ledger refuses a stale attempt directly: no begin, no commit, the callback uncalled."""
    stale_lease = Lease(
        run_id=run_id, fencing_token=stale_token, worker_id="stale", duration=harness.lease
    )
    called: list[Any] = []

    async def commit(tx: Any) -> None:
        called.append(tx)

    conn = await harness.business_connection()
    try:
        ledger = engine.backend.ledger(conn)
        with pytest.raises(FencingError):
            await ledger.finish(
                op_key=op_key, lease=stale_lease, result_json='"stale"', commit=commit
            )
        assert called == [], "fence first: a stale attempt's commit callback never runs"
        with pytest.raises(FencingError):
            await ledger.begin(op_key=op_key, lease=stale_lease)
    finally:
        await harness.business_release(conn)


# -- payloads (tasks registered by the tests that use them) ------------------------------------

PAYLOAD_BAD_VALUES: dict[str, Any] = {
    "nul": "x\x00y",
    "surrogate": "x\ud800y",
    "nested-nul": {"a": {"b": ["ok", "x\x00y"]}},
    "key-nul": {"a": {"k\x00": 1}},
    "good": {"a": "fine"},
}


@task(
    "contract.payload_bad_step",
    version=1,
    retry=RetryPolicy(max_attempts=3, initial=timedelta(milliseconds=50), backoff=1.0),
)
async def payload_bad_step_task(ctx: TaskContext[Job]) -> str:
    def fetch() -> Any:
        BODY_RUNS[(ctx.input.key, "fetch")] += 1
        return PAYLOAD_BAD_VALUES[ctx.input.key]

    await ctx.step.run("fetch", fetch)
    BODY_RUNS[(ctx.input.key, "after")] += 1
    return "ok"


@task(
    "contract.payload_bad_output",
    version=1,
    retry=RetryPolicy(max_attempts=3, initial=timedelta(milliseconds=50), backoff=1.0),
)
async def payload_bad_output_task(ctx: TaskContext[Job]) -> str:
    BODY_RUNS[(ctx.input.key, "handler")] += 1
    value: str = BUSINESS["output"]
    return value


@task("contract.payload_any", version=1)
async def payload_any_task(ctx: TaskContext[Any]) -> Any:
    return ctx.input


@dataclasses.dataclass(frozen=True)
class Shipment:
    when: datetime
    tags: tuple[str, ...]


_WHEN = datetime(2030, 1, 2, 3, 4, 5, 6, tzinfo=timezone(timedelta(hours=5, minutes=30)))
_IDENT = UUID("0190f4d4-1b2c-7a00-8b00-000000000001")


def _now() -> datetime:
    return _WHEN


def _day() -> date:
    return _WHEN.date()


def _ratio() -> float:
    return 3  # an int where a float is declared: every execution must see 3.0


def _numbers() -> list[int]:
    return (1, 2, 3)  # type: ignore[return-value]  # a tuple where a list is declared


def _mixed() -> dict[str, Any]:
    return {"when": _WHEN, "n": [1, {"x": None}]}  # Any inside: JSON's form on every execution


def _shipment() -> Shipment:
    return Shipment(when=_WHEN, tags=("a", "b"))


@task("contract.payload_types", version=1)
async def payload_types_task(ctx: TaskContext[Job]) -> str:
    seen: dict[str, Any] = {
        "datetime": await ctx.step.run("datetime", _now),
        "datetime-lambda": await ctx.step.run("dt-lambda", lambda: _WHEN, output_type=datetime),
        "date": await ctx.step.run("date", _day),
        "uuid": await ctx.step.run("uuid", lambda: _IDENT, output_type=UUID),
        "decimal": await ctx.step.run("decimal", lambda: Decimal("10.50"), output_type=Decimal),
        "timedelta": await ctx.step.run(
            "timedelta", lambda: timedelta(days=2, microseconds=7), output_type=timedelta
        ),
        "attrs": await ctx.step.run("attrs", lambda: Job(key="j", n=2), output_type=Job),
        "dataclass": await ctx.step.run("dataclass", _shipment),
        "tuple": await ctx.step.run("tuple", lambda: (1, "a"), output_type=tuple[int, str]),
        "float": await ctx.step.run("float", _ratio),
        "list": await ctx.step.run("list", _numbers),
        "mixed": await ctx.step.run("mixed", _mixed),
        "plain": await ctx.step.run("plain", lambda: {"a": [1, 2.5, "x", True, None], "b": {}}),
        "none": await ctx.step.run("none", lambda: None),
    }
    BUSINESS.setdefault("seen", []).append(seen)
    await ctx.step.sleep("nap", timedelta(milliseconds=50))
    return "ok"


PAYLOAD_TYPES_EXPECTED: dict[str, Any] = {
    "datetime": _WHEN,
    "datetime-lambda": _WHEN,
    "date": _WHEN.date(),
    "uuid": _IDENT,
    "decimal": Decimal("10.50"),
    "timedelta": timedelta(days=2, microseconds=7),
    "attrs": Job(key="j", n=2),
    "dataclass": Shipment(when=_WHEN, tags=("a", "b")),
    "tuple": (1, "a"),
    "float": 3.0,
    "list": [1, 2, 3],
    "mixed": {"when": _WHEN.isoformat(), "n": [1, {"x": None}]},
    "plain": {"a": [1, 2.5, "x", True, None], "b": {}},
    "none": None,
}


def _shape(value: Any) -> Any:
    """`value` with the exact type of every part beside it (3 == 3.0, tuple == list otherwise).
    The order of an object's keys is not kept (Postgres's jsonb orders them its own way)."""
    if isinstance(value, dict):
        return ("dict", sorted((k, _shape(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, [_shape(v) for v in value])
    if isinstance(value, datetime):
        return ("datetime", value, value.utcoffset())
    if isinstance(value, Decimal):
        return ("Decimal", str(value))
    return (type(value).__qualname__, value)


@task("contract.payload_untyped", version=1)
async def payload_untyped_task(ctx: TaskContext[Job]) -> str:
    try:
        await ctx.step.run("now", lambda: _WHEN)
    except StepFailedError as exc:
        return "refused" if exc.error_type.endswith("PayloadError") else exc.error_type
    return "accepted"


@task("contract.payload_nul_error", version=1, retry=RetryPolicy.none())
async def payload_nul_error_task(ctx: TaskContext[Job]) -> str:
    def boom() -> None:
        raise OSError("disk \x00 on fire")

    try:
        await ctx.step.run("boom", boom)
    except StepFailedError:
        raise RuntimeError("handler \x00 gave up \ud800") from None
    return "unreachable"
