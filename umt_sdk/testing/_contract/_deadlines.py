"""Timeouts and deadlines: a step attempt cut off at its timeout and retried; a run ended
failed at its deadline whether it runs, sleeps, waits for a fact, waits out a retry's backoff
or was never claimed; a run not started by its start deadline ended without running.

Durations are a few seconds: `harness.advance` moves a `FakeClock` at once, and sleeps for real
on a backend that keeps the database's time.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from umt_sdk import (
    Engine,
    RetryPolicy,
    RunFailedError,
    SyncTaskContext,
    TaskContext,
    TaskDefinition,
    UsageError,
    step,
    task,
)
from umt_sdk.testing._contract._base import Job, Tally, current_tally, eventually, other_task
from umt_sdk.testing._helpers import BackendHarness

__all__ = ["DeadlinesContract"]

DEADLINE = timedelta(seconds=2)
"""The deadline of this topic's runs: short on real time, passed at once on a FakeClock."""


def _thread_gate(tally: Tally, key: str) -> threading.Event:
    """A gate a plain body blocks its thread on (an asyncio gate is for the loop's tasks)."""
    gate = tally.business.setdefault(f"thread:{key}", threading.Event())
    assert isinstance(gate, threading.Event)
    return gate


@task("contract.deadline_hang", version=1, timeout=DEADLINE)
async def hang_task(ctx: TaskContext[Job]) -> str:
    """Its step waits for a gate the test never opens: only the deadline ends it."""
    tally = current_tally()
    key = ctx.input.key

    async def hang() -> str:
        tally.body_runs[(key, "hang")] += 1
        tally.gate(f"{key}:in").set()
        await tally.gate(f"{key}:never").wait()
        return "unreachable"

    try:
        return await ctx.step.run("hang", hang)
    finally:
        tally.business[f"{key}:abort_seen"] = ctx.abort_event.is_set()


@task("contract.deadline_sleep", version=1)
async def sleep_task(ctx: TaskContext[Job]) -> str:
    """Sleeps an hour, then a step: a deadline sooner than that ends the run asleep."""
    tally = current_tally()
    key = ctx.input.key
    await ctx.step.sleep("nap", timedelta(hours=1))
    await ctx.step.run("woke", lambda: tally.body_runs.update({(key, "woke"): 1}))
    return "woke"


@task(
    "contract.deadline_backoff",
    version=1,
    retry=RetryPolicy(max_attempts=5, initial=timedelta(hours=1)),
)
async def backoff_task(ctx: TaskContext[Job]) -> str:
    """Fails every attempt, with an hour's backoff: a sooner deadline ends the run."""
    current_tally().body_runs[(ctx.input.key, "attempt")] += 1
    raise ConnectionError("the service is down")


@task("contract.deadline_fact", version=1)
async def fact_task(ctx: TaskContext[Job]) -> str:
    """Waits for a fact with no timeout of its own."""
    payload: str = await ctx.step.wait_for_fact(ctx.input.key, payload_type=str)
    return payload


@task(
    "contract.step_timeout",
    version=1,
    retry=RetryPolicy(max_attempts=2, initial=timedelta(milliseconds=100), backoff=1.0),
)
async def step_timeout_task(ctx: TaskContext[Job]) -> int:
    """Its step's first attempt hangs past the step's timeout (an async body when n == 0, a
    plain one in a thread when n == 1); the second attempt returns at once. n == 2: every
    attempt hangs, so the step fails."""
    tally = current_tally()
    key, shape = ctx.input.key, ctx.input.n

    async def slow_async() -> int:
        tally.body_runs[(key, "body")] += 1
        attempt = tally.body_runs[(key, "body")]
        if attempt == 1 or shape == 2:
            tally.gate(f"{key}:in:{attempt}").set()
            try:
                await tally.gate(f"{key}:never").wait()
            except asyncio.CancelledError:
                tally.business[f"{key}:cancelled"] = True
                raise
        return attempt

    def slow_plain() -> int:
        tally.body_runs[(key, "body")] += 1
        attempt = tally.body_runs[(key, "body")]
        if attempt == 1:
            tally.business[f"{key}:in:{attempt}"] = True
            _thread_gate(tally, key).wait(timeout=60)
            tally.business[f"{key}:thread_finished"] = True
            return -1  # ignored: the attempt was given up
        return attempt

    body = slow_plain if shape == 1 else slow_async
    value: int = await ctx.step.run("slow", body, timeout=timedelta(seconds=1))
    return value


@step("decorated_slow", timeout=timedelta(seconds=1), retry=RetryPolicy.none())
async def decorated_slow(key: str) -> str:
    tally = current_tally()
    tally.gate(f"{key}:in").set()
    await tally.gate(f"{key}:never").wait()
    return "unreachable"


@task("contract.step_timeout_decorated", version=1)
async def decorated_timeout_task(ctx: TaskContext[Job]) -> str:
    return await decorated_slow(ctx.input.key)


@task("contract.deadline_thread", version=1, timeout=DEADLINE)
def thread_task(ctx: SyncTaskContext[Job]) -> str:
    """A plain handler whose plain step hangs in its thread: threads cannot be killed."""
    tally = current_tally()
    key = ctx.input.key

    def stuck() -> str:
        tally.business[f"{key}:in"] = True
        _thread_gate(tally, key).wait(timeout=60)
        return "late"

    return ctx.step.run("stuck", stuck)


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    hang_task,
    sleep_task,
    backoff_task,
    fact_task,
    step_timeout_task,
    decorated_timeout_task,
    thread_task,
)
"""The tasks of this topic that the suite's engine registers."""


def _is_deadline(error_type: str, name: str = "DeadlineExceededError") -> bool:
    return error_type.rsplit(".", 1)[-1] == name


class DeadlinesContract:
    """A step attempt ends at its timeout; a run ends at its deadline, whatever it is doing."""

    async def test_a_running_run_ends_failed_at_its_deadline(
        self, engine: Engine, harness: BackendHarness, tally: Tally
    ) -> None:
        handle = await engine.enqueue(hang_task, Job(key="run"))
        async with engine.worker():
            await asyncio.wait_for(tally.gate("run:in").wait(), 15)
            await harness.advance(DEADLINE)
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert _is_deadline(caught.value.error_type)
        info = await engine.get(handle.run_id)
        assert info.status == "failed"
        assert info.deadline_at is not None
        assert info.deadline_at - info.created_at == DEADLINE
        assert info.failures == 1, "ended once, never retried"
        assert tally.business["run:abort_seen"] is True, "the handler got its abort signal"
        assert tally.body_runs[("run", "hang")] == 1
        assert [(s.name, s.status) for s in info.timeline] == [], "the cut-off step is unrecorded"

    async def test_a_pending_run_past_its_deadline_ends_without_running(
        self, engine: Engine, harness: BackendHarness, tally: Tally
    ) -> None:
        handle = await engine.enqueue(other_task, Job(key="late"), deadline=DEADLINE)
        assert (await engine.get(handle.run_id)).deadline_passed is False
        await harness.advance(DEADLINE)
        assert (await engine.get(handle.run_id)).deadline_passed is True
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert _is_deadline(caught.value.error_type)
        assert tally.order == [], "the handler never ran"
        assert (await engine.get(handle.run_id)).deadline_passed is False, "it is finished"

    async def test_a_sleeping_run_ends_at_its_deadline_not_at_its_wake(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(sleep_task, Job(key="nap"), deadline=DEADLINE)
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert _is_deadline(caught.value.error_type)
        info = await engine.get(handle.run_id)
        assert info.finished_at is not None
        assert info.deadline_at is not None
        assert info.finished_at < info.created_at + timedelta(hours=1)
        assert ("nap", "woke") not in tally.body_runs, "no step runs past the deadline"
        assert [(s.name, s.status) for s in info.timeline] == [("nap", "abandoned")]

    async def test_a_run_waiting_for_a_fact_ends_at_its_deadline(self, engine: Engine) -> None:
        handle = await engine.enqueue(fact_task, Job(key="never-comes"), deadline=DEADLINE)
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert _is_deadline(caught.value.error_type)

    async def test_a_retry_backoff_past_the_deadline_ends_the_run_at_the_deadline(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(backoff_task, Job(key="down"), deadline=DEADLINE)
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert _is_deadline(caught.value.error_type)
        assert tally.body_runs[("down", "attempt")] == 1, "the hour's retry never came"
        info = await engine.get(handle.run_id)
        assert info.finished_at is not None
        assert info.finished_at < info.created_at + timedelta(hours=1)

    async def test_a_run_not_started_by_its_start_deadline_ends_without_running(
        self, engine: Engine, harness: BackendHarness, tally: Tally
    ) -> None:
        missed = await engine.enqueue(other_task, Job(key="missed"), start_within=DEADLINE)
        started = await engine.enqueue(
            other_task, Job(key="in-time"), start_within=timedelta(hours=1)
        )
        info = await engine.get(missed.run_id)
        assert info.start_by is not None
        assert info.start_by - info.created_at == DEADLINE
        assert info.deadline_at is None
        await harness.advance(DEADLINE + timedelta(milliseconds=500))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await missed.result(timeout=15)
            assert await started.result(timeout=15) == "other"
        assert _is_deadline(caught.value.error_type, "StartDeadlineExceededError")
        assert tally.order == ["other:in-time"], "the missed run never ran"

    async def test_a_deadline_and_a_task_timeout_the_earlier_wins(self, engine: Engine) -> None:
        sooner = await engine.enqueue(hang_task, Job(key="a"), deadline=timedelta(seconds=1))
        later = await engine.enqueue(hang_task, Job(key="b"), deadline=timedelta(hours=1))
        sooner_info, later_info = await engine.get(sooner.run_id), await engine.get(later.run_id)
        assert sooner_info.deadline_at == sooner_info.created_at + timedelta(seconds=1)
        assert later_info.deadline_at == later_info.created_at + DEADLINE, "the task's timeout"
        for handle in (sooner, later):  # only their deadlines are looked at
            await engine.cancel(handle.run_id)
        absolute = datetime(2000, 1, 1, tzinfo=UTC)
        past = await engine.enqueue(other_task, Job(key="past"), deadline=absolute)
        assert (await engine.get(past.run_id)).deadline_at == absolute
        async with engine.worker():
            with pytest.raises(RunFailedError):
                await past.result(timeout=15)

    async def test_a_run_finished_before_its_deadline_is_unaffected(self, engine: Engine) -> None:
        handle = await engine.enqueue(other_task, Job(key="quick"), deadline=timedelta(hours=1))
        async with engine.worker():
            assert await handle.result(timeout=15) == "other"
        info = await engine.get(handle.run_id)
        assert info.status == "completed"
        assert info.deadline_passed is False

    @pytest.mark.parametrize("shape", ["async", "thread"])
    async def test_a_step_attempt_past_its_timeout_fails_and_is_retried(
        self, engine: Engine, harness: BackendHarness, tally: Tally, shape: str
    ) -> None:
        key = f"st-{shape}"
        handle = await engine.enqueue(step_timeout_task, Job(key=key, n=int(shape == "thread")))
        async with engine.worker():
            if shape == "async":
                await asyncio.wait_for(tally.gate(f"{key}:in:1").wait(), 15)
            else:
                await eventually(lambda: _holds(tally.business.get(f"{key}:in:1") is True))
            await harness.advance(timedelta(seconds=1))
            assert await handle.result(timeout=15) == 2
        info = await engine.get(handle.run_id)
        first, second = info.timeline
        assert (first.name, first.status, second.status) == ("slow", "retrying", "completed")
        assert first.error is not None
        assert first.error.type.rsplit(".", 1)[-1] == "StepTimeoutError"
        if shape == "async":
            assert tally.business[f"{key}:cancelled"] is True, "the async body was cancelled"
        else:
            assert f"{key}:thread_finished" not in tally.business, "the thread is left running"
            _thread_gate(tally, key).set()
            await eventually(lambda: _holds(tally.business.get(f"{key}:thread_finished") is True))
            assert (await engine.get(handle.run_id)).output == 2, "its late result is ignored"

    async def test_a_step_timing_out_on_its_last_attempt_fails_the_step(
        self, engine: Engine, harness: BackendHarness, tally: Tally
    ) -> None:
        handle = await engine.enqueue(decorated_timeout_task, Job(key="dec"))
        async with engine.worker():
            await asyncio.wait_for(tally.gate("dec:in").wait(), 15)
            await harness.advance(timedelta(seconds=1))
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert "StepTimeoutError" in caught.value.error_message
        info = await engine.get(handle.run_id)
        assert [(s.name, s.status) for s in info.timeline] == [("decorated_slow", "failed")]

    async def test_a_plain_step_hanging_in_its_thread_still_ends_at_the_deadline(
        self, engine: Engine, harness: BackendHarness, tally: Tally
    ) -> None:
        handle = await engine.enqueue(thread_task, Job(key="stuck"))
        after = await engine.enqueue(other_task, Job(key="next"))
        try:
            async with engine.worker(concurrency=1):
                await eventually(lambda: _holds(tally.business.get("stuck:in") is True))
                await harness.advance(DEADLINE)
                with pytest.raises(RunFailedError) as caught:
                    await handle.result(timeout=15)
                assert await after.result(timeout=15) == "other", "the slot was released"
        finally:
            _thread_gate(tally, "stuck").set()
        assert _is_deadline(caught.value.error_type)
        info = await engine.get(handle.run_id)
        assert info.lease_expires_at is None, "the lease is released"

    async def test_bad_deadline_arguments_are_refused(self, engine: Engine) -> None:
        with pytest.raises(UsageError, match="deadline"):
            await engine.enqueue(other_task, Job(key="x"), deadline=datetime(2030, 1, 1))
        with pytest.raises(UsageError, match="deadline"):
            await engine.enqueue(other_task, Job(key="x"), deadline=timedelta(0))
        with pytest.raises(UsageError, match="start_within"):
            await engine.enqueue(other_task, Job(key="x"), start_within=5)  # type: ignore[call-overload]
        assert list((await engine.list()).runs) == [], "nothing was stored"


async def _holds(value: bool) -> bool:
    return value
