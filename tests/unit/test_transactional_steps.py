"""Transactional steps on the memory backend, beyond the contract suite: conflicts of its
serializable store run the transaction again (and say so in the trace), a backend without
`TransactionStore` refuses the step and stores nothing, plain tasks, unstorable outputs, and a
codec that seals the step's record."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from umt_backend_memory import MemoryBackend, MemoryTransaction
from umt_sdk import (
    AesGcmCodec,
    Compensate,
    Engine,
    Registry,
    RetryPolicy,
    RunCompensatedError,
    RunFailedError,
    SyncTaskContext,
    TaskContext,
    connect,
    step,
    task,
)
from umt_sdk._codec_backend import inner_backend
from umt_sdk.backend import TransactionStore
from umt_sdk.exceptions import TaskDefinitionError
from umt_sdk.testing import FakeClock

READ_BOTH = asyncio.Event()
READERS: list[str] = []


@task("tx.counter", version=1)
async def counter_task(ctx: TaskContext[str]) -> int:
    """Read-modify-write of one counter; the first reads of two runs wait for each other, so
    both read 0 and one commit must be refused (a lost update otherwise)."""

    async def bump(tx: MemoryTransaction) -> int:
        value: int = tx.get("counters", "c", 0)
        READERS.append(ctx.input)
        if len(READERS) == 2:
            READ_BOTH.set()
        if len(READERS) <= 2:
            await READ_BOTH.wait()
        tx.put("counters", "c", value + 1)
        return value + 1

    seen: int = await ctx.step.transaction("bump", bump)
    return seen


async def test_a_conflicting_transaction_runs_again_and_no_update_is_lost() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = await connect(
        "memory://",
        registry=Registry([counter_task]),
        clock=FakeClock(auto_advance=True),
        tracer_provider=provider,
    )
    async with engine:
        store = inner_backend(engine.backend).store
        a = await engine.enqueue(counter_task, "a")
        b = await engine.enqueue(counter_task, "b")
        async with engine.worker(concurrency=2):
            results = sorted([await a.result(timeout=10), await b.result(timeout=10)])
        assert results == [1, 2]
        assert store.get("counters", "c") == 2, "both increments landed, once each"
        assert len(READERS) == 3, "one body ran again after its conflict"
    events = [
        event
        for span in exporter.get_finished_spans()
        for event in span.events
        if event.name == "umt.step.transaction_conflict"
    ]
    assert [(e.attributes or {}).get("umt.step.conflicts") for e in events] == [1]
    assert [(e.attributes or {}).get("umt.step.name") for e in events] == ["bump"]


class _NoTransactions:
    """A backend that cannot commit a step's writes with its record: the memory backend with
    `run_step_transaction` hidden (as a third-party backend without `TransactionStore`)."""

    def __init__(self, inner: MemoryBackend) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "run_step_transaction":
            raise AttributeError(name)
        return getattr(self._inner, name)


BODIES: list[str] = []


@task("tx.refused", version=1, retry=RetryPolicy(max_attempts=3))
async def refused_task(ctx: TaskContext[str]) -> str:
    await ctx.step.run("before", lambda: "ok")

    async def write(tx: Any) -> str:
        BODIES.append(ctx.input)
        return "written"

    written: str = await ctx.step.transaction("write", write)
    return written


async def test_a_backend_without_transaction_store_refuses_and_stores_nothing() -> None:
    inner = MemoryBackend(clock=FakeClock(auto_advance=True))
    backend = _NoTransactions(inner)
    assert not isinstance(backend, TransactionStore)
    engine = Engine(backend, Registry([refused_task]))  # type: ignore[arg-type]  # a proxy
    async with engine:
        handle = await engine.enqueue(refused_task, "x")
        async with engine.worker():
            with pytest.raises(RunFailedError) as failed:
                await handle.result(timeout=10)
        assert failed.value.error_type.endswith("UsageError")
        assert "step 'write' is transactional" in failed.value.error_message
        assert "_NoTransactions" in failed.value.error_message
        info = await engine.get(handle.run_id)
        assert [(s.name, s.status) for s in info.timeline] == [("before", "completed")]
        assert info.failures == 1, "failed at once: a UsageError is never retried"
    assert BODIES == []
    assert inner.store.rows("receipts") == {}


@task("tx.plain", version=1)
def plain_task(ctx: SyncTaskContext[str]) -> str:
    def write(tx: MemoryTransaction, key: str) -> str:
        tx.insert("receipts", key, "plain")
        return "plain"

    value: str = ctx.step.transaction("write", write, ctx.input)
    return value


async def test_a_plain_task_runs_a_transactional_step() -> None:
    engine = await connect(
        "memory://", registry=Registry([plain_task]), clock=FakeClock(auto_advance=True)
    )
    async with engine:
        handle = await engine.enqueue(plain_task, "k")
        async with engine.worker():
            assert await handle.result(timeout=10) == "plain"
        assert inner_backend(engine.backend).store.rows("receipts") == {"k": "plain"}


@task("tx.unstorable", version=1, retry=RetryPolicy(max_attempts=5))
async def unstorable_task(ctx: TaskContext[str]) -> str:
    async def write(tx: MemoryTransaction) -> str:
        BODIES.append("unstorable")
        tx.insert("receipts", "u", "written")
        return "a\x00b"  # no backend can store a NUL

    value: str = await ctx.step.transaction("write", write)
    return value


async def test_an_unstorable_output_fails_the_step_at_once_and_rolls_its_writes_back() -> None:
    BODIES.clear()
    engine = await connect(
        "memory://", registry=Registry([unstorable_task]), clock=FakeClock(auto_advance=True)
    )
    async with engine:
        handle = await engine.enqueue(unstorable_task, "u")
        async with engine.worker():
            with pytest.raises(RunFailedError) as failed:
                await handle.result(timeout=10)
        assert "PayloadError" in failed.value.error_message
        info = await engine.get(handle.run_id)
        assert [(s.name, s.attempt, s.status) for s in info.timeline] == [("write", 1, "failed")]
        assert inner_backend(engine.backend).store.rows("receipts") == {}
    assert BODIES == ["unstorable"], "not retried: the same body would return the same value"


@task("tx.sealed", version=1)
async def sealed_task(ctx: TaskContext[str]) -> str:
    async def write(tx: MemoryTransaction) -> str:
        tx.insert("receipts", "s", "secret")
        return "secret output"

    value: str = await ctx.step.transaction("write", write)
    return value


async def test_a_codec_seals_the_record_of_a_transactional_step() -> None:
    codec = AesGcmCodec(keys={"k": bytes(32)}, current="k")
    engine = await connect(
        "memory://",
        registry=Registry([sealed_task]),
        clock=FakeClock(auto_advance=True),
        codec=codec,
    )
    async with engine:
        handle = await engine.enqueue(sealed_task, "s")
        async with engine.worker():
            assert await handle.result(timeout=10) == "secret output"
        inner = inner_backend(engine.backend)
        assert isinstance(inner, MemoryBackend)
        (run,) = inner.runs()
        (record,) = run.steps
        assert record.output_json is not None
        assert "secret output" not in record.output_json, "sealed at rest"
        info = await engine.get(handle.run_id)
        assert info.timeline[0].output_json == '"secret output"', "opened on the way out"
        assert inner.store.rows("receipts") == {"s": "secret"}


@step("credit", transactional=True)
async def credit(tx: MemoryTransaction, account: str, amount: int) -> int:
    balance: int = tx.get("accounts", account, 0) + amount
    tx.put("accounts", account, balance)
    return balance


@task("tx.decorated", version=1)
async def decorated_task(ctx: TaskContext[str]) -> int:
    await credit(ctx.input, 5)
    return await credit(ctx.input, 7)  # typed: (account: str, amount: int) -> int


async def test_a_decorated_transactional_step_is_called_without_its_transaction() -> None:
    engine = await connect(
        "memory://", registry=Registry([decorated_task]), clock=FakeClock(auto_advance=True)
    )
    async with engine:
        handle = await engine.enqueue(decorated_task, "acct")
        async with engine.worker():
            assert await handle.result(timeout=10) == 12
        info = await engine.get(handle.run_id)
        assert [(s.name, s.status) for s in info.timeline] == [
            ("credit", "completed"),
            ("credit#2", "completed"),
        ]
        assert inner_backend(engine.backend).store.rows("accounts") == {"acct": 12}


def test_a_transactional_step_must_be_async() -> None:
    def plain(tx: Any) -> None: ...

    with pytest.raises(TaskDefinitionError, match="must decorate an async function"):
        step("plain", transactional=True)(plain)  # type: ignore[arg-type]  # refused: plain
    with pytest.raises(TaskDefinitionError, match="transactional must be True or False"):
        step("x", transactional="yes")  # type: ignore[call-overload]  # refused: not a bool


def test_a_transactional_step_refuses_uncertain_on() -> None:
    """Its writes commit with its record or not at all: its outcome is never unknown."""
    with pytest.raises(TaskDefinitionError, match="uncertain_on= cannot go with transactional"):
        step("x", transactional=True, uncertain_on=TimeoutError)


@step("tx.void", transactional=True)
async def void_receipt(tx: MemoryTransaction, receipt: str) -> None:
    tx.insert("voids", receipt, "void")


@task("tx.refused_compensation", version=1, retry=RetryPolicy(max_attempts=3))
async def refused_compensation_task(ctx: TaskContext[str]) -> str:
    def write() -> str:
        BODIES.append(ctx.input)
        return "r-1"

    written: str = await ctx.step.run("write", write, compensate=void_receipt)
    return written


async def test_a_transactional_compensation_is_refused_where_it_could_not_run() -> None:
    """Refused when the step registers it, before its registration or body: not when the
    run compensates, after its other undos ran."""
    BODIES.clear()
    inner = MemoryBackend(clock=FakeClock(auto_advance=True))
    backend = _NoTransactions(inner)
    engine = Engine(backend, Registry([refused_compensation_task]))  # type: ignore[arg-type]  # a proxy
    async with engine:
        handle = await engine.enqueue(refused_compensation_task, "x")
        async with engine.worker():
            with pytest.raises(RunFailedError) as failed:
                await handle.result(timeout=10)
        assert failed.value.error_type.endswith("UsageError")
        assert "step 'umt.compensate:write' is transactional" in failed.value.error_message
        assert (await engine.get(handle.run_id)).timeline == ()
    assert BODIES == []


@task("tx.plain_saga", version=1)
def plain_saga_task(ctx: SyncTaskContext[str]) -> str:
    def write(tx: MemoryTransaction, key: str) -> str:
        tx.insert("receipts", key, "written")
        return key

    ctx.step.transaction("write", write, ctx.input, compensate=void_receipt)
    raise Compensate("the customer withdrew")


async def test_a_plain_task_compensates_a_transactional_step_in_a_transaction() -> None:
    engine = await connect(
        "memory://", registry=Registry([plain_saga_task]), clock=FakeClock(auto_advance=True)
    )
    async with engine:
        handle = await engine.enqueue(plain_saga_task, "k")
        async with engine.worker():
            with pytest.raises(RunCompensatedError):
                await handle.result(timeout=10)
        store = inner_backend(engine.backend).store
        assert store.rows("receipts") == {"k": "written"}
        assert store.rows("voids") == {"k": "void"}, "void_receipt(tx, 'k'), committed"
