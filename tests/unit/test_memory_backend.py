"""The memory backend's own tools: `crash_hook`, `reset()`, inspection and its argument checks."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from uuid import UUID

import pytest

from umt_backend_memory import CrashHook, MemoryBackend, MemoryStore
from umt_sdk import Engine, Registry, TaskContext, connect, task
from umt_sdk.backend import (
    ControllableClock,
    Ending,
    Lease,
    NewRun,
    SystemClock,
    new_run_id,
    unstorable_json_reason,
)
from umt_sdk.exceptions import BackendError, FencingError, RunNotFoundError, UsageError
from umt_sdk.testing import FakeClock

LEASE = timedelta(seconds=5)
BODIES: Counter[str] = Counter()


def _completed(output_json: str) -> Ending:
    return Ending(status="completed", outcome="completed", output_json=output_json)


async def count(name: str, value: int) -> int:
    BODIES[name] += 1
    return value


@task("memory.three")
async def three_steps(ctx: TaskContext[str]) -> int:
    one = await ctx.step.run("one", count, "one", 1)
    two = await ctx.step.run("two", count, "two", 2)
    three = await ctx.step.run("three", count, "three", 3)
    return one + two + three


@task("memory.wait")
async def waits(ctx: TaskContext[str]) -> str:
    value: str = await ctx.step.wait_for_fact("go")
    return value


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def engine(clock: FakeClock) -> AsyncIterator[Engine]:
    BODIES.clear()
    engine = await connect("memory://", registry=Registry([three_steps, waits]), clock=clock)
    yield engine
    await engine.close()


def _backend(engine: Engine) -> MemoryBackend:
    assert isinstance(engine.backend, MemoryBackend)
    return engine.backend


async def _eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def crash_on(operation: str, phase: str, nth: int, fired: list[UUID]) -> CrashHook:
    """Crash at the `nth` call of `operation` in `phase`, once; note the run in `fired`."""
    calls = Counter[str]()

    def hook(op: str, run_id: UUID, at: str) -> bool:
        if op != operation or at != phase:
            return False
        calls[op] += 1
        if calls[op] == nth:
            fired.append(run_id)
            return True
        return False

    return hook


@pytest.mark.parametrize(
    ("phase", "recorded", "second_body_runs"),
    [("before", ["one"], 2), ("after", ["one", "two"], 1)],
)
async def test_crash_around_record_step_then_resume(
    engine: Engine, clock: FakeClock, phase: str, recorded: list[str], second_body_runs: int
) -> None:
    backend = _backend(engine)
    fired: list[UUID] = []
    backend.crash_hook = crash_on("record_step", phase, nth=2, fired=fired)
    handle = await engine.enqueue(three_steps, "r")

    crashed = engine.worker(lease=LEASE, poll_interval=timedelta(milliseconds=20))
    async with crashed:
        await _eventually(lambda: bool(fired) and not crashed.running_runs)
        assert fired == [handle.run_id]
        record = await backend.get_run(handle.run_id)
        assert record is not None
        # The execution vanished: no step beyond the crash point, no completion, no release.
        assert [s.name for s in record.steps] == recorded
        assert record.status == "running"
        assert record.lease_expires_at is not None
        assert record.lease_expires_at > clock.now()
        assert [e.outcome for e in record.executions] == ["running"]
        assert Counter({"one": 1, "two": 1}) == BODIES
    assert (await engine.get(handle.run_id)).status == "running", "its lease is left to expire"

    backend.crash_hook = None
    clock.advance(LEASE * 2)
    async with engine.worker(lease=LEASE, poll_interval=timedelta(milliseconds=20)):
        assert await handle.result(timeout=5) == 6
    assert Counter({"one": 1, "two": second_body_runs, "three": 1}) == BODIES
    info = await engine.get(handle.run_id)
    assert info.attempts == 2
    assert info.lease_expirations == 1
    assert [e.outcome for e in info.executions] == ["interrupted", "completed"]
    assert [(s.name, s.status) for s in info.timeline if s.status == "completed"] == [
        ("one", "completed"),
        ("two", "completed"),
        ("three", "completed"),
    ]


async def test_crash_before_complete_replays_every_step(engine: Engine, clock: FakeClock) -> None:
    backend = _backend(engine)
    fired: list[UUID] = []
    backend.crash_hook = crash_on("end_execution:completed", "before", nth=1, fired=fired)
    handle = await engine.enqueue(three_steps, "c")
    async with engine.worker(lease=LEASE, poll_interval=timedelta(milliseconds=20)) as worker:
        await _eventually(lambda: bool(fired) and not worker.running_runs)
    assert (await engine.get(handle.run_id)).status == "running"
    backend.crash_hook = None
    clock.advance(LEASE * 2)
    async with engine.worker(lease=LEASE, poll_interval=timedelta(milliseconds=20)):
        assert await handle.result(timeout=5) == 6
    assert Counter({"one": 1, "two": 1, "three": 1}) == BODIES, "nothing ran twice"


async def test_the_crashed_attempt_is_fenced_off(engine: Engine, clock: FakeClock) -> None:
    backend = _backend(engine)
    handle = await engine.enqueue(three_steps, "f")
    [first] = await backend.claim(
        worker_id="a", pairs=[three_steps.pair], limit=1, lease=timedelta(seconds=1)
    )
    clock.advance(timedelta(seconds=2))
    [second] = await backend.claim(
        worker_id="b", pairs=[three_steps.pair], limit=1, lease=timedelta(seconds=1)
    )
    assert second.fencing_token > first.fencing_token
    stale = Lease(
        run_id=handle.run_id,
        fencing_token=first.fencing_token,
        worker_id="a",
        duration=timedelta(seconds=1),
    )
    with pytest.raises(FencingError):
        await backend.end_execution(stale, _completed("0"))
    assert (await engine.get(handle.run_id)).status == "running"


async def test_reset_forgets_everything(engine: Engine) -> None:
    backend = _backend(engine)
    old = await engine.enqueue(waits, "x", idempotency_key="key-1")
    await engine.signal(old.run_id, "go", "now")
    await engine.broadcast("everyone", 1)
    [claimed] = await backend.claim(worker_id="w", pairs=[waits.pair], limit=1, lease=LEASE)
    lease = Lease(
        run_id=old.run_id, fencing_token=claimed.fencing_token, worker_id="w", duration=LEASE
    )
    await backend.ledger(MemoryStore()).begin(op_key="op-1", lease=lease)
    assert (len(backend.runs()), len(backend.facts()), len(backend.ledger_entries())) == (1, 2, 1)

    backend.reset()

    assert backend.runs() == []
    assert backend.facts() == []
    assert backend.ledger_entries() == {}
    assert len(await engine.list()) == 0
    with pytest.raises(RunNotFoundError):
        await engine.get(old.run_id)
    with pytest.raises(FencingError):
        await backend.end_execution(lease, _completed('"late"'))
    fresh = await engine.enqueue(waits, "y", idempotency_key="key-1")
    assert fresh.created, "idempotency keys are forgotten too"
    assert fresh.run_id != old.run_id
    assert await backend.claim(worker_id="w", pairs=[three_steps.pair], limit=5, lease=LEASE) == []


async def test_inspection_reports_runs_oldest_first_with_steps(engine: Engine) -> None:
    backend = _backend(engine)
    handles = [await engine.enqueue(three_steps, str(i)) for i in range(3)]
    async with engine.worker(poll_interval=timedelta(milliseconds=20)):
        for handle in handles:
            await handle.result(timeout=5)
    runs = backend.runs()
    assert [r.run_id for r in runs] == [h.run_id for h in handles]
    assert all([s.name for s in r.steps] == ["one", "two", "three"] for r in runs)


async def test_memory_backend_argument_checks(engine: Engine) -> None:
    backend = _backend(engine)
    # UsageErrors since the hierarchy change (they were TypeErrors; UsageError is not one).
    with pytest.raises(UsageError, match=r"needs a umt_backend_memory\.MemoryStore") as caught:
        backend.ledger(object())
    assert caught.value.argument == "conn"
    new = NewRun(
        run_id=new_run_id(),
        task_name="memory.three",
        task_version=1,
        input_json='"x"',
        input_hash="h",
    )
    with pytest.raises(UsageError, match="no transactions to join") as caught:
        await backend.enqueue(new, conn=object())
    assert caught.value.argument == "conn"
    assert backend.runs() == []


def test_the_memory_backend_finds_a_clock_it_can_move_once_and_by_its_protocol() -> None:
    fake = FakeClock()
    assert isinstance(fake, ControllableClock)
    controlled: ControllableClock = fake  # FakeClock satisfies the protocol for mypy too
    assert MemoryBackend(clock=controlled)._controls is fake
    assert not isinstance(SystemClock(), ControllableClock)
    assert MemoryBackend(clock=SystemClock())._controls is None, "a plain clock: real time"


@task("memory.nap")
async def naps(ctx: TaskContext[str]) -> str:
    await ctx.step.sleep("nap", timedelta(days=2))
    return ctx.input


async def test_a_fake_clock_is_jumped_to_the_next_timer_while_a_result_is_awaited() -> None:
    clock = FakeClock(auto_advance=True)
    engine = await connect("memory://", registry=Registry([naps]), clock=clock)
    try:
        start = clock.now()
        handle = await engine.enqueue(naps, "rested")
        async with engine.worker(poll_interval=timedelta(milliseconds=20)):
            assert await handle.result(timeout=5) == "rested"
        assert clock.now() - start >= timedelta(days=2)
    finally:
        await engine.close()


@pytest.mark.parametrize(
    "input_json", ['{"a":"x\\u0000y"}', '["\\ud800"]', '"x\ud800"'], ids=["nul", "esc", "raw"]
)
async def test_the_memory_backend_refuses_what_postgres_cannot_store_by_the_sdks_rule(
    engine: Engine, input_json: str
) -> None:
    """Whatever reaches it past the SDK (a third party calling the SPI): refused as the
    Postgres backend refuses it, by the one rule (`umt_sdk.backend.unstorable_json_reason`)."""
    backend = _backend(engine)
    new = NewRun(
        run_id=new_run_id(),
        task_name="memory.three",
        task_version=1,
        input_json=input_json,
        input_hash="h",
    )
    with pytest.raises(BackendError, match=r"^input cannot be stored: it holds a") as caught:
        await backend.enqueue(new)
    reason = unstorable_json_reason(input_json)
    assert reason is not None
    assert f"it {reason} (refused as Postgres would)" in str(caught.value)
    assert backend.runs() == []
