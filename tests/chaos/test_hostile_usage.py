"""Hostile calls of the engine API (issue 11 parts 4 and 9), beyond the contract suite.

- `signal(None, ...)` is a usage error on the sync facade too, never a broadcast;
- a backend that does not report the version of an idempotency hit (`EnqueueResult` without
  `task_version`, as third-party backends written before it had one) is still checked: the
  engine reads the run and refuses a key that names another version.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from umt_backend_memory import MemoryBackend
from umt_sdk import (
    Engine,
    IdempotencyConflictError,
    Registry,
    TaskContext,
    connect_sync,
    task,
)
from umt_sdk.backend import EnqueueResult, NewRun
from umt_sdk.exceptions import TaskDefinitionError, UsageError
from umt_sdk.testing import FakeClock


@attrs.frozen
class Order:
    key: str


@task("hostile.vt", version=1)
async def vt_1(ctx: TaskContext[Order]) -> str:
    return "v1"


@task("hostile.vt", version=2)
async def vt_2(ctx: TaskContext[Order]) -> int:
    return 2


@task("hostile.waits")
async def waits(ctx: TaskContext[Order]) -> dict[str, Any]:
    payload: dict[str, Any] = await ctx.step.wait_for_fact("approved")
    return payload


REGISTRY = Registry([vt_1, vt_2, waits])


def test_sync_facade_refuses_a_signal_without_a_run_id() -> None:
    with connect_sync("memory://", registry=REGISTRY, clock=FakeClock()) as engine:
        run_id = engine.enqueue(waits, {"key": "a"})
        with pytest.raises(UsageError, match=r"engine\.broadcast") as caught:
            engine.signal(None, "approved", {"by": "nobody"})  # type: ignore[arg-type]  # the bad call under test
        # A usage error is a ValueError; a runtime argument is no TaskDefinitionError (the
        # task is declared fine), since UsageError became the top of that branch.
        assert not isinstance(caught.value, TaskDefinitionError)
        assert isinstance(caught.value, ValueError)
        assert caught.value.argument == "run_id"
        assert engine.get(run_id).status == "pending"
        assert engine.broadcast("approved", {"by": "everyone"}) is True


class _VersionlessBackend(MemoryBackend):
    """A backend that leaves `EnqueueResult.task_version` unset (the SPI's default)."""

    async def enqueue(self, new: NewRun, *, conn: Any = None) -> EnqueueResult:
        result = await super().enqueue(new, conn=conn)
        return EnqueueResult(run_id=result.run_id, created=result.created)


async def test_a_key_of_another_version_is_refused_when_the_backend_does_not_say() -> None:
    engine = Engine(_VersionlessBackend(clock=FakeClock()), REGISTRY)
    try:
        one = await engine.enqueue(vt_1, Order(key="k"), idempotency_key="k", version=1)
        with pytest.raises(IdempotencyConflictError, match="version 1, not version 2") as caught:
            await engine.enqueue("hostile.vt", Order(key="k"), idempotency_key="k", version=2)
        assert caught.value.run_id == one.run_id
        assert (caught.value.existing_version, caught.value.requested_version) == (1, 2)
        again = await engine.enqueue("hostile.vt", Order(key="k"), idempotency_key="k", version=1)
        assert (again.run_id, again.created, again.task_version) == (one.run_id, False, 1)
    finally:
        await engine.close()


def test_run_ids_drawn_back_to_back_are_strictly_increasing() -> None:
    # Runs list newest first by id: ids drawn within one millisecond must still be ordered.
    from umt_sdk._engine import new_run_id

    ids = [new_run_id() for _ in range(20_000)]
    assert ids == sorted(set(ids))
    assert {i.version for i in ids} == {7}
