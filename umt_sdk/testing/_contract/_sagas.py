"""Compensation (sagas): a run that gives up undoes its completed steps, newest first, each
compensation a durable step of its own, and ends `compensated` (or `failed`, naming the
compensation that could not run)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    Compensate,
    Engine,
    RetryPolicy,
    RunCompensatedError,
    RunFailedError,
    RunPrunedError,
    TaskContext,
    TaskDefinition,
    task,
)
from umt_sdk.testing._contract._base import Job, current_tally
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["SagasContract"]

_QUICK = RetryPolicy(max_attempts=3, initial=timedelta(milliseconds=50), backoff=1.0)


def _did(key: str, what: str) -> None:
    tally = current_tally()
    tally.body_runs[(key, what)] += 1
    tally.business.setdefault(key, []).append(what)


@task("contract.saga", version=1, retry=_QUICK)
async def saga_task(ctx: TaskContext[Job]) -> str:
    """Three steps with compensations; `n` says how it ends: 0 completes, 1 raises
    `Compensate`, 2 makes the compensation of `book` fail once (retried), 3 makes it fail
    for good."""
    key, n = ctx.input.key, ctx.input.n

    def act(name: str) -> Any:
        def body() -> str:
            _did(key, name)
            return f"{name}-id"

        return body

    def undo(name: str) -> Any:
        def compensation(output: str) -> None:
            _did(key, f"undo {name} {output}")
            if name == "book" and n >= 2:
                failures = current_tally().body_runs[(key, "undo book failed")]
                if n == 3 or failures == 0:
                    current_tally().body_runs[(key, "undo book failed")] += 1
                    raise ConnectionError("the booking service is down")

        return compensation

    await ctx.step.run("reserve", act("reserve"), compensate=undo("reserve"))
    await ctx.step.run("notify", act("notify"))  # nothing to undo
    await ctx.step.run("book", act("book"), compensate=undo("book"))
    await ctx.step.run("charge", act("charge"), compensate=lambda: _did(key, "refund"))
    if n >= 1:
        raise Compensate("out of stock")
    return "done"


@task("contract.saga_on_failure", version=1, retry=RetryPolicy.none(), on_failure="compensate")
async def saga_on_failure_task(ctx: TaskContext[Job]) -> str:
    """`reserve` completes; `ship` fails for good: only `reserve` is undone."""
    key = ctx.input.key

    def ship() -> None:
        _did(key, "ship")
        raise OSError("no truck")

    await ctx.step.run("reserve", lambda: _did(key, "reserve"), compensate=lambda: _did(key, "r"))
    await ctx.step.run("ship", ship, compensate=lambda: _did(key, "unship"))
    return "unreachable"


@task("contract.saga_bad_compensation", version=1, retry=RetryPolicy.none())
async def saga_bad_compensation_task(ctx: TaskContext[Job]) -> None:
    refund: Any = "refund"  # not a callable: refused before anything is stored
    await ctx.step.run("charge", lambda: _did(ctx.input.key, "charge"), compensate=refund)


@task("contract.saga_reserved_name", version=1, retry=RetryPolicy.none())
async def saga_reserved_name_task(ctx: TaskContext[Job]) -> None:
    await ctx.step.run("umt.compensate:charge", lambda: _did(ctx.input.key, "x"))


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    saga_task,
    saga_on_failure_task,
    saga_bad_compensation_task,
    saga_reserved_name_task,
)
"""The tasks of this topic that the suite's engine registers."""


class SagasContract:
    """What a saga promises, on every backend."""

    async def test_compensate_undoes_completed_steps_newest_first(self, engine: Engine) -> None:
        done = await engine.enqueue(saga_task, Job(key="s0"))
        gave_up = await engine.enqueue(saga_task, Job(key="s1", n=1))
        async with engine.worker():
            assert await done.result(timeout=15) == "done"
            with pytest.raises(RunCompensatedError) as caught:
                await gave_up.result(timeout=15)
        assert isinstance(caught.value, RunFailedError), "a compensated run failed too"
        assert caught.value.error_type == "umt_sdk.Compensate"
        assert caught.value.error_message == "out of stock"
        tally = current_tally()
        assert tally.business["s0"] == ["reserve", "notify", "book", "charge"]
        assert tally.business["s1"] == [
            "reserve",
            "notify",
            "book",
            "charge",
            "refund",
            "undo book book-id",
            "undo reserve reserve-id",
        ], "each compensation once, newest first, given its step's output"
        info = await engine.get(gave_up.run_id)
        assert info.status == "compensated"
        assert info.finished_at is not None
        assert [s.name for s in info.timeline if s.name.startswith("umt.compensate:")] == [
            "umt.compensate:charge",
            "umt.compensate:book",
            "umt.compensate:reserve",
        ]
        assert (await engine.get(done.run_id)).status == "completed"
        listed = await engine.list(status="compensated")
        assert [r.run_id for r in listed] == [gave_up.run_id]

    async def test_a_compensation_is_retried_as_a_step(self, engine: Engine) -> None:
        handle = await engine.enqueue(saga_task, Job(key="s2", n=2))
        async with engine.worker():
            with pytest.raises(RunCompensatedError):
                await handle.result(timeout=15)
        tally = current_tally()
        assert tally.business["s2"][4:] == [
            "refund",
            "undo book book-id",
            "undo book book-id",
            "undo reserve reserve-id",
        ], "the failed attempt is retried; the compensation before it does not run again"
        info = await engine.get(handle.run_id)
        assert [(s.name, s.status) for s in info.timeline if s.name == "umt.compensate:book"] == [
            ("umt.compensate:book", "retrying"),
            ("umt.compensate:book", "completed"),
        ]

    async def test_a_compensation_that_cannot_run_fails_the_run_naming_it(
        self, engine: Engine
    ) -> None:
        handle = await engine.enqueue(saga_task, Job(key="s3", n=3))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert not isinstance(caught.value, RunCompensatedError)
        assert caught.value.error_type == "umt_sdk.CompensationFailedError"
        assert "of step 'book'" in caught.value.error_message
        assert "the booking service is down" in caught.value.error_message
        assert current_tally().business["s3"][4:] == ["refund"] + ["undo book book-id"] * 3, (
            "the compensations after the one that failed did not run"
        )
        assert (await engine.get(handle.run_id)).status == "failed"

    async def test_on_failure_compensate_undoes_what_completed(self, engine: Engine) -> None:
        handle = await engine.enqueue(saga_on_failure_task, Job(key="f"))
        async with engine.worker():
            with pytest.raises(RunCompensatedError) as caught:
                await handle.result(timeout=15)
        assert caught.value.error_type == "umt_sdk.StepFailedError"
        assert "no truck" in caught.value.error_message
        assert current_tally().business["f"] == ["reserve", "ship", "r"], (
            "the failed step is not undone: it did not complete"
        )

    async def test_a_compensation_that_is_not_callable_is_refused(self, engine: Engine) -> None:
        bad = await engine.enqueue(saga_bad_compensation_task, Job(key="b"))
        reserved = await engine.enqueue(saga_reserved_name_task, Job(key="r"))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await bad.result(timeout=15)
            with pytest.raises(RunFailedError) as named:
                await reserved.result(timeout=15)
        assert caught.value.error_type == "umt_sdk.UsageError"
        assert "compensate" in caught.value.error_message
        assert "'refund'" in caught.value.error_message
        assert named.value.error_type == "umt_sdk.UsageError"
        assert "'umt.'" in named.value.error_message
        for run_id in (bad.run_id, reserved.run_id):
            info = await engine.get(run_id)
            assert info.timeline == (), "nothing stored"
        assert "b" not in current_tally().business

    async def test_a_compensated_run_is_finished_for_retention(
        self, engine: Engine, harness: BackendHarness
    ) -> None:
        handle = await engine.enqueue(saga_task, Job(key="p", n=1))
        async with engine.worker():
            with pytest.raises(RunCompensatedError):
                await handle.result(timeout=15)
        assert (await engine.prune(older_than=timedelta(seconds=2))).pruned == 0, "not old yet"
        await harness.advance(timedelta(seconds=3))
        assert (await engine.prune(older_than=timedelta(seconds=2))).pruned == 1
        with pytest.raises(RunPrunedError) as caught:
            await engine.get(handle.run_id)
        assert caught.value.status == "compensated"
