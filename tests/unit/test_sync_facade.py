"""`connect_sync`: the blocking facade, driven from plain code, with its own loop thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from uuid import uuid4

import attrs
import pytest

from umt_sdk import (
    Engine,
    PayloadError,
    Registry,
    RunCanceledError,
    RunNotFoundError,
    SyncEngine,
    TaskContext,
    connect_sync,
    task,
)
from umt_sdk.exceptions import BackendNotFoundError, UsageError


@attrs.frozen
class Ticket:
    key: str


@task("sync.approval")
async def approval(ctx: TaskContext[Ticket]) -> dict[str, Any]:
    payload: dict[str, Any] = await ctx.step.wait_for_fact("approved")
    return {"key": ctx.input.key, **payload}


@task("sync.other")
async def other(ctx: TaskContext[Ticket]) -> str:
    return ctx.input.key


@task("sync.report")
async def report(ctx: TaskContext[Ticket]) -> int:
    await ctx.stream.write("progress", 1)
    await ctx.step.wait_for_fact("go")
    return await ctx.stream.write("progress", 2)


REGISTRY = Registry([approval, other, report])


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "umt-sync-engine"]


def _eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_client_calls_work_from_plain_code() -> None:
    before = _loop_threads()
    with connect_sync("memory://", registry=REGISTRY) as facade:
        assert isinstance(facade, SyncEngine)
        assert isinstance(facade.engine, Engine)
        assert len(_loop_threads()) == len(before) + 1

        first = facade.enqueue(approval, Ticket(key="a"))
        second = facade.enqueue("sync.other", {"key": "b"}, priority=5, idempotency_key="k-b")
        assert facade.enqueue(other, Ticket(key="b"), idempotency_key="k-b") == second

        info = facade.get(first)
        assert (info.status, info.task_name, info.task_version) == ("pending", "sync.approval", 1)
        assert [r.run_id for r in facade.list()] == [second, first]
        assert [r.run_id for r in facade.list(task_name="sync.other")] == [second]
        assert len(facade.list(status="completed")) == 0

        assert facade.signal(first, "approved", {"by": "ops"}) is True
        assert facade.signal(first, "approved", {"by": "someone else"}) is False
        assert facade.broadcast("maintenance", None) is True

        assert facade.cancel(second, reason="not needed") == "canceled"
        assert facade.cancel(second) == "already_finished"
        with pytest.raises(RunCanceledError, match="not needed"):
            facade.result(second, timeout=2)

        with pytest.raises(RunNotFoundError):
            facade.get(uuid4())
        with pytest.raises(RunNotFoundError):
            facade.signal(uuid4(), "approved")
        with pytest.raises(PayloadError, match=r"input\.key"):
            facade.enqueue(approval, {"key": 5})
    assert _loop_threads() == before, "close() stops the loop thread"


def test_a_worker_on_the_facades_loop_finishes_a_run_signaled_from_plain_code() -> None:
    facade = connect_sync("memory://", registry=REGISTRY)
    try:
        worker = facade.engine.worker(
            versions=["sync.approval@1"], poll_interval=timedelta(milliseconds=50)
        )
        # The engine belongs to the facade's loop: start the worker there.
        asyncio.run_coroutine_threadsafe(worker.start(), facade._loop).result(timeout=5)
        run_id = facade.enqueue(approval, Ticket(key="w"))
        _eventually(lambda: facade.get(run_id).status == "waiting")
        assert facade.get(run_id).waiting_for == "approved"
        assert facade.signal(run_id, "approved", {"by": "ops"})
        assert facade.result(run_id, timeout=5) == {"key": "w", "by": "ops"}
        assert facade.get(run_id).status == "completed"
    finally:
        facade.close()
    assert not facade._thread.is_alive()
    assert worker.running_runs == []


def test_streams_are_read_and_followed_from_plain_code() -> None:
    facade = connect_sync("memory://", registry=REGISTRY)
    try:
        worker = facade.engine.worker(
            versions=["sync.report@1"], poll_interval=timedelta(milliseconds=50)
        )
        asyncio.run_coroutine_threadsafe(worker.start(), facade._loop).result(timeout=5)
        run_id = facade.enqueue(report, Ticket(key="s"))
        items = facade.stream(run_id, "progress")
        assert next(items).value == 1
        last = facade.stream_last(run_id, "progress")
        assert last is not None
        assert (last.seq, last.value) == (1, 1)
        assert facade.signal(run_id, "go")
        assert [item.value for item in items] == [2], "followed until the run ended"
        assert facade.result(run_id, timeout=5) == 2
        assert facade.stream_heads([run_id])[run_id]["progress"].seq == 2
        early = facade.stream(run_id, "progress", since=1)
        assert next(early).seq == 2
        early.close()  # left early: its async iterator is closed on the facade's loop
        assert facade.stream_last(run_id, "log") is None
        with pytest.raises(RunNotFoundError):
            facade.stream_last(uuid4(), "progress")
    finally:
        facade.close()


def test_a_closed_facade_refuses_calls_cleanly() -> None:
    facade = connect_sync("memory://", registry=REGISTRY)
    run_id = facade.enqueue(other, Ticket(key="x"))
    facade.close()
    facade.close()  # closing twice is harmless
    # No "coroutine was never awaited" warning either: pytest turns warnings into errors.
    with pytest.raises(RuntimeError, match="SyncEngine is closed"):
        facade.get(run_id)
    with pytest.raises(RuntimeError, match="SyncEngine is closed"):
        facade.enqueue(other, Ticket(key="y"))


def test_a_failed_connect_leaves_no_thread_behind() -> None:
    before = _loop_threads()
    with pytest.raises(BackendNotFoundError):
        connect_sync("nosuch://x")
    with pytest.raises(UsageError, match="takes no options"):  # was a TypeError
        connect_sync("memory://", bogus=True)
    assert _loop_threads() == before


def test_enqueue_many_returns_one_id_per_input_in_order() -> None:
    with connect_sync("memory://", registry=REGISTRY) as facade:
        stored = facade.enqueue(other, Ticket(key="b"), idempotency_key="k-b")
        ids = facade.enqueue_many(
            other,
            [Ticket(key="a"), Ticket(key="b"), {"key": "c"}],
            idempotency_keys=[None, "k-b", "k-c"],
            priority=3,
        )
        assert ids[1] == stored
        assert len(set(ids)) == 3
        assert [facade.get(run_id).priority for run_id in (ids[0], ids[2])] == [3, 3]
        assert [facade.get(run_id).input for run_id in ids] == [{"key": k} for k in "abc"]


@task("sync.on_order", on_event="sync.order")
async def on_order(ctx: TaskContext[Any]) -> Any:
    return ctx.input


def test_events_are_published_and_listed_from_plain_code() -> None:
    with connect_sync("memory://", registry=Registry([on_order])) as facade:
        event_id = facade.publish("sync.order", {"n": 1}, key="order-1")
        assert facade.publish("sync.order", {"n": 1}, key="order-1") == event_id
        [event] = facade.events(name="sync.order")
        assert event.event_id == event_id
        assert [run.task_name for run in event.runs] == ["sync.on_order"]
        assert facade.events(name="sync.other") == []
        with pytest.raises(UsageError) as caught:
            facade.events(limit=0)
        assert caught.value.argument == "limit"
