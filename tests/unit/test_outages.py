"""Outages of the backend that a caller or a worker's loop must ride out, on the memory
backend behind a wrapper that makes chosen calls fail as an unreachable database does
(`BackendUnavailableError`), after or instead of the real call. The Postgres side of the same
promises, with a real crash: tests/chaos/test_newer_features_pg_crash.py."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any

import attrs

from umt_sdk import Engine, Registry, TaskContext, connect, task, update
from umt_sdk.backend import RetentionStore
from umt_sdk.exceptions import BackendUnavailableError
from umt_sdk.testing import FakeClock


class Unreachable:
    """The backend `inner`, except that `fail[name]` calls of `name`, after the first
    `spare[name]`, raise `BackendUnavailableError`: after the real call for the names in
    `landed` (the write happened, its answer was lost), instead of it for the others."""

    def __init__(
        self,
        inner: Any,
        fail: dict[str, int],
        *,
        spare: dict[str, int] | None = None,
        landed: frozenset[str] = frozenset(),
    ) -> None:
        self._inner = inner
        self.fail = Counter(fail)
        self.spare = Counter(spare or {})
        self.landed = landed
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._inner, name)
        if name not in self.fail:
            return real

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if self.calls[name] <= self.spare[name] or self.fail[name] <= 0:
                return await real(*args, **kwargs)
            self.fail[name] -= 1
            if name in self.landed:
                await real(*args, **kwargs)
            raise BackendUnavailableError(f"database unavailable: {name} (injected)")

        return call


@update("add")
async def add(ctx: TaskContext[int], by: int) -> int:
    total = int(ctx.query_state or ctx.input) + by
    await ctx.set_query_state(total)
    return total


@task("outage.counter", version=1, updates=[add])
async def counter(ctx: TaskContext[int]) -> int:
    applied = await ctx.step.wait_for_update("add")
    return int(applied.result)


async def test_an_update_caller_rides_out_an_outage_and_its_update_is_stored_once() -> None:
    engine = await connect("memory://", registry=Registry([counter]), clock=FakeClock())
    handle = await engine.enqueue(counter, 40)
    # The store's answer is lost once (the update was stored), then the caller's reads of the
    # result fail three times (its first read, before the store, works).
    flaky = Unreachable(
        engine.backend,
        {"signal": 1, "get_run": 3},
        spare={"get_run": 1},
        landed=frozenset({"signal"}),
    )
    caller = Engine(flaky, Registry([counter]), telemetry=engine.telemetry)
    async with engine.worker():
        for _ in range(2000):
            if (await engine.get(handle.run_id)).status == "waiting":
                break
            await asyncio.sleep(0.005)
        assert await caller.update(handle.run_id, "add", 2, timeout=10) == 42
        assert await handle.result(timeout=10) == 42
    # Sent again as update 1: refused (first write wins), and the stored id is this update's.
    assert flaky.calls["signal"] == 2
    assert flaky.fail["get_run"] == 0, "every injected failure was met"
    stored = await engine.backend.get_run(handle.run_id)
    assert stored is not None
    assert [s.name for s in stored.steps if s.name.startswith("umt.update")] == [
        "umt.update:1",
        "umt.update-result:1",
    ]
    assert await engine.backend.get_facts(run_id=handle.run_id, name="umt.update:2") == []
    await engine.close()


async def test_an_update_whose_store_failed_is_stored_when_the_database_is_back() -> None:
    engine = await connect("memory://", registry=Registry([counter]), clock=FakeClock())
    handle = await engine.enqueue(counter, 1)
    flaky = Unreachable(engine.backend, {"signal": 2})  # refused twice, nothing stored
    caller = Engine(flaky, Registry([counter]), telemetry=engine.telemetry)
    async with engine.worker():
        assert await caller.update(handle.run_id, "add", 1, timeout=10) == 2
        assert await handle.result(timeout=10) == 2
    assert flaky.calls["signal"] == 3
    await engine.close()


@attrs.frozen
class Placed:
    n: int


@task("outage.receipt", version=1, on_event="outage.placed")
async def receipt(ctx: TaskContext[Placed]) -> int:
    return ctx.input.n


async def test_an_event_pass_cut_off_by_an_outage_is_tried_again_soon() -> None:
    publisher = await connect("memory://", registry=Registry(), clock=FakeClock())
    await publisher.publish("outage.placed", Placed(7), key="o7")  # no subscriber known
    flaky = Unreachable(publisher.backend, {"events_to_start": 1})
    worker_engine = Engine(flaky, Registry([receipt]), telemetry=publisher.telemetry)
    # The passes' interval is 30 s, longer than this test waits: the run is started by the
    # retry after the failure.
    async with worker_engine.worker():
        for _ in range(2000):
            runs = list(await publisher.list(task_name="outage.receipt"))
            if runs and runs[0].status == "completed":
                break
            await asyncio.sleep(0.005)
    assert flaky.calls["events_to_start"] >= 2
    assert [(r.status, r.idempotency_key is not None) for r in runs] == [("completed", True)]
    await publisher.close()


@task("outage.done", version=1)
async def done(ctx: TaskContext[int]) -> int:
    return ctx.input


async def test_a_retention_pass_cut_off_by_an_outage_is_tried_again_soon() -> None:
    clock = FakeClock()
    keep = timedelta(days=1)
    engine = await connect("memory://", registry=Registry([done]), clock=clock, retention=keep)
    handle = await engine.enqueue(done, 1)
    async with engine.worker():
        assert await handle.result(timeout=10) == 1
    clock.advance(2 * keep)  # the run is prunable from here on; the clock moves no more
    store = engine.backend
    assert isinstance(store, RetentionStore)
    flaky = Unreachable(store, {"prune_runs": 1})
    worker_engine = Engine(flaky, Registry([done]), telemetry=engine.telemetry, retention=keep)
    # The passes' interval is an hour, longer than this test waits: the run is deleted by the
    # retry after the failure (a backoff of at most 5 s), and after that success the loop
    # waits the interval again.
    async with worker_engine.worker(prune_interval=timedelta(hours=1)):
        for _ in range(2000):
            if await store.get_pruned(handle.run_id) is not None:
                break
            await asyncio.sleep(0.005)
    assert await store.get_pruned(handle.run_id) is not None
    assert flaky.calls["prune_runs"] == 2
    await engine.close()
