"""Enqueue and read back: input checks, idempotency keys, `get`, the run's head, listing."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from umt_sdk import Engine, IdempotencyConflictError, PayloadError, TaskDefinition
from umt_sdk._engine import new_run_id
from umt_sdk.exceptions import RunNotFoundError
from umt_sdk.testing._contract._base import Job, echo_task, echo_task_v2, other_task, steps_task

__all__ = ["RunsContract"]


TASKS: tuple[TaskDefinition[Any, Any], ...] = ()
"""None of its own: these tests run the shared tasks of `_base`."""


class RunsContract:
    """A run is stored as enqueued, read back whole or by its head, listed and paged; an
    idempotency key names one run of one input and one version."""

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
