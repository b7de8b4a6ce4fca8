"""Retention: finished runs older than asked are deleted (by hand or by the workers), pending,
running and waiting ones never; a pruned run's idempotency key stays taken and `get` says it
was pruned; a family is deleted only once every member has finished."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    Engine,
    IdempotencyConflictError,
    RunNotFoundError,
    RunPrunedError,
    TaskContext,
    TaskDefinition,
    UsageError,
    task,
)
from umt_sdk._engine import new_run_id
from umt_sdk.backend import NewRun, RetentionStore, StreamStore
from umt_sdk.testing._contract._base import (
    Job,
    Tally,
    echo_task,
    echo_task_v2,
    eventually,
    other_task,
    steps_task,
    wait_until,
    waiter_task,
)
from umt_sdk.testing._contract._streams import streams_task
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["PruningContract"]

OLD = timedelta(seconds=2)
"""The retention of these tests; `harness.advance(AGED)` makes what finished before old."""
AGED = timedelta(seconds=3)


@task("contract.kept", version=1, retention=timedelta(days=1))
async def kept_task(ctx: TaskContext[Job]) -> str:
    return ctx.input.key


TASKS: tuple[TaskDefinition[Any, Any], ...] = (kept_task,)
"""The tasks of this topic that the suite's engine registers."""


def _store(engine: Engine) -> RetentionStore:
    if not isinstance(engine.backend, RetentionStore):
        pytest.fail(f"{type(engine.backend).__name__} does not implement RetentionStore")
    return engine.backend


async def _finished(engine: Engine, *handles: Any) -> None:
    async with engine.worker():
        for handle in handles:
            await handle.result(timeout=15)


class PruningContract:
    """What `engine.prune`, `connect(retention=...)` and the workers delete, and what a
    pruned run leaves behind."""

    async def test_prune_deletes_old_finished_runs_and_nothing_else(
        self, engine: Engine, harness: BackendHarness, tally: Tally
    ) -> None:
        _store(engine)
        old = await engine.enqueue(echo_task_v2, Job(key="old"))
        await _finished(engine, old)
        # Delayed runs only once no result() waits: a FakeClock could jump to their timers.
        canceled = await engine.enqueue(echo_task_v2, Job(key="c"), delay=timedelta(days=1))
        assert await engine.cancel(canceled.run_id) == "canceled"
        pending = await engine.enqueue(other_task, Job(key="later"), delay=timedelta(days=1))
        waiting = await engine.enqueue(waiter_task, Job(key="never-sent"))
        held = await engine.enqueue(steps_task, Job(key="held"))
        tally.gate("held")
        async with engine.worker():
            await wait_until(engine, waiting.run_id, lambda r: r.status == "waiting")
            await wait_until(engine, held.run_id, lambda r: r.status == "running")
            await harness.advance(AGED)
            recent = await engine.enqueue(echo_task_v2, Job(key="recent"))
            await recent.result(timeout=15)
            report = await engine.prune(older_than=OLD)
            assert (report.pruned, report.dry_run, report.busy) == (2, False, False)
            for run_id, status in ((old.run_id, "completed"), (canceled.run_id, "canceled")):
                with pytest.raises(RunPrunedError, match="deleted by retention") as caught:
                    await engine.get(run_id)
                assert (caught.value.run_id, caught.value.status) == (run_id, status)
                with pytest.raises(RunPrunedError):
                    await engine.result(run_id, timeout=1)
                with pytest.raises(RunPrunedError):
                    await engine.export_history(run_id)
            statuses = {r.run_id: r.status for r in await engine.list()}
            assert statuses == {
                recent.run_id: "completed",
                held.run_id: "running",
                waiting.run_id: "waiting",
                pending.run_id: "pending",
            }
            assert (await engine.prune(older_than=OLD)).pruned == 0, "nothing is old enough"
            tally.gate("held").set()
            assert await held.result(timeout=15) == 6

    async def test_a_pruned_run_takes_its_facts_and_streams_with_it(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        store = _store(engine)
        if not isinstance(store, StreamStore):
            pytest.fail(f"{type(store).__name__} does not implement StreamStore")
        streamed = await engine.enqueue(streams_task, Job(key="s", n=2))
        waited = await engine.enqueue(waiter_task, Job(key="fact"))
        async with engine.worker():
            await wait_until(engine, waited.run_id, lambda r: r.status == "waiting")
            assert await engine.signal(waited.run_id, "fact", {"ok": 1})
            await streamed.result(timeout=15)
            await waited.result(timeout=15)
        assert await store.read_stream(streamed.run_id, "progress", after=0, limit=10)
        await harness.advance(AGED)
        assert (await engine.prune(older_than=OLD)).pruned == 2
        assert await store.read_stream(streamed.run_id, "progress", after=0, limit=10) == []
        assert await store.last_stream_entries([streamed.run_id]) == []
        with pytest.raises(RunPrunedError):
            async for _ in engine.stream(streamed.run_id, "progress"):
                pass
        with pytest.raises(RunPrunedError):
            await engine.stream_last(streamed.run_id, "progress")
        assert await engine.backend.get_facts(run_id=waited.run_id, name="fact") == []
        with pytest.raises(RunNotFoundError):
            await engine.signal(waited.run_id, "late", None)

    async def test_dry_run_counts_and_a_task_filter_narrows(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _store(engine)
        echoes = [await engine.enqueue(echo_task_v2, Job(key=str(i))) for i in range(3)]
        other = await engine.enqueue(other_task, Job(key="o"))
        await _finished(engine, *echoes, other)
        await harness.advance(AGED)
        dry = await engine.prune(older_than=OLD, dry_run=True)
        assert (dry.pruned, dry.batches, dry.dry_run) == (4, 0, True)
        assert len(await engine.list()) == 4, "a dry run deletes nothing"
        assert (await engine.prune(older_than=OLD, task="contract.other", dry_run=True)).pruned == 1
        report = await engine.prune(older_than=OLD, task=["contract.echo"], batch_size=2)
        assert (report.pruned, report.batches) == (3, 2)
        assert [r.run_id for r in await engine.list()] == [other.run_id]

    async def test_a_pruned_key_still_names_its_run(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _store(engine)
        first = await engine.enqueue(echo_task_v2, Job(key="k"), idempotency_key="order-1")
        await _finished(engine, first)
        await harness.advance(AGED)
        assert (await engine.prune(older_than=OLD)).pruned == 1
        again = await engine.enqueue(echo_task_v2, Job(key="k"), idempotency_key="order-1")
        assert (again.run_id, again.created) == (first.run_id, False)
        with pytest.raises(RunPrunedError):
            await again.result(timeout=1)
        with pytest.raises(IdempotencyConflictError, match="different input"):
            await engine.enqueue(echo_task_v2, Job(key="other"), idempotency_key="order-1")
        with pytest.raises(IdempotencyConflictError, match="version 2, not version 1"):
            await engine.enqueue(echo_task, Job(key="k"), idempotency_key="order-1", version=1)
        assert len(await engine.list()) == 0, "no run was created under the pruned key"
        fresh = await engine.enqueue(other_task, Job(key="k"), idempotency_key="order-1")
        assert fresh.created, "keys are per task name"

    async def test_a_family_is_pruned_once_every_member_finished(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _store(engine)

        async def child_of(parent: Any) -> Any:
            new = NewRun(
                run_id=new_run_id(),
                task_name="contract.other",
                task_version=1,
                input_json='{"key": "child", "n": 0}',
                input_hash="h",
                delay=timedelta(days=1),
                parent_run_id=parent.run_id,
            )
            return (await engine.backend.enqueue(new)).run_id

        later = timedelta(days=1)
        finished_parent = await engine.enqueue(other_task, Job(key="p1"), delay=later)
        open_child = await child_of(finished_parent)
        open_parent = await engine.enqueue(other_task, Job(key="p2"), delay=later)
        finished_child = await child_of(open_parent)
        await engine.cancel(finished_parent.run_id)
        await engine.cancel(finished_child)
        await harness.advance(AGED)
        report = await engine.prune(older_than=OLD)
        assert report.pruned == 0, (
            "a parent with an unfinished child, and a child whose parent has not finished, stay"
        )
        await engine.cancel(open_child)
        await engine.cancel(open_parent.run_id)
        await harness.advance(AGED)
        assert (await engine.prune(older_than=OLD)).pruned == 4
        assert len(await engine.list()) == 0

    async def test_workers_prune_by_the_engine_and_task_retention(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _store(engine)
        echo = await engine.enqueue(echo_task_v2, Job(key="e"))
        kept = await engine.enqueue(kept_task, Job(key="kept"))
        await _finished(engine, echo, kept)
        pending = await engine.enqueue(other_task, Job(key="later"), delay=timedelta(days=1))
        await harness.advance(AGED)
        # Another engine on the same store, with a retention (this one is closed by the fixture).
        retained = Engine(engine.backend, engine.registry, retention=OLD)
        assert retained.retention.per_task == {"contract.kept": timedelta(days=1)}

        async def echo_pruned() -> bool:
            try:
                await engine.get(echo.run_id)
            except RunPrunedError:
                return True
            return False

        async with retained.worker(prune_interval=timedelta(milliseconds=50)):
            await eventually(echo_pruned)
        assert (await engine.get(kept.run_id)).status == "completed", "its task keeps it a day"
        assert (await engine.get(pending.run_id)).status == "pending"

    async def test_idempotency_retention_frees_the_keys_of_pruned_runs(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        _store(engine)
        first = await engine.enqueue(echo_task_v2, Job(key="k"), idempotency_key="order-2")
        await _finished(engine, first)
        await harness.advance(AGED)
        assert (await engine.prune(older_than=OLD)).pruned == 1
        await harness.advance(AGED)
        retained = Engine(engine.backend, engine.registry, idempotency_retention=OLD)

        async def forgotten() -> bool:
            try:
                await engine.get(first.run_id)
            except RunPrunedError:
                return False
            except RunNotFoundError:
                return True
            return False

        async with retained.worker(prune_interval=timedelta(milliseconds=50)):
            await eventually(forgotten)
        again = await engine.enqueue(echo_task_v2, Job(key="new"), idempotency_key="order-2")
        assert again.created, "the key was freed, as idempotency_retention said"
        assert again.run_id != first.run_id

    async def test_bad_prune_arguments_are_refused(self, engine: Engine) -> None:
        for kwargs, argument in (
            ({"older_than": 30}, "older_than"),
            ({"older_than": timedelta(days=-1)}, "older_than"),
            ({"older_than": OLD, "task": 7}, "task"),
            ({"older_than": OLD, "task": [""]}, "task"),
            ({"older_than": OLD, "dry_run": "yes"}, "dry_run"),
            ({"older_than": OLD, "batch_size": 0}, "batch_size"),
        ):
            with pytest.raises(UsageError) as caught:
                await engine.prune(**kwargs)
            assert caught.value.argument == argument
        for bad in (timedelta(0), 30, "30d"):
            with pytest.raises(UsageError, match="retention"):
                Engine(engine.backend, engine.registry, retention=bad)  # type: ignore[arg-type]
