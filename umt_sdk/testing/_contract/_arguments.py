"""Argument checks: a wrong argument is refused at once, with a message that says which."""

from __future__ import annotations

from typing import Any

import pytest

from umt_sdk import Engine, RetryPolicy, RunFailedError, TaskContext, TaskDefinition, task
from umt_sdk.exceptions import NotInTaskError, UsageError
from umt_sdk.testing._contract._base import Job, Tally, current_tally, first, waiter_task

__all__ = ["ArgumentsContract"]


@task("contract.bad_wait", version=1, retry=RetryPolicy(max_attempts=3))
async def bad_wait_task(ctx: TaskContext[Job]) -> str:
    """Arguments of the wrong type, as users write them: seconds where a timedelta goes."""
    tally = current_tally()
    tally.body_runs[(ctx.input.key, "handler")] += 1
    if ctx.input.n == 0:
        await ctx.step.wait_for_fact("go", timeout=30)  # type: ignore[arg-type]  # under test
    else:
        await ctx.step.wait_for_fact("go", poll_interval=5)  # type: ignore[arg-type]  # under test
    return "not reached"


TASKS: tuple[TaskDefinition[Any, Any], ...] = (bad_wait_task,)
"""The tasks of this topic that the suite's engine registers."""


class ArgumentsContract:
    """Misuse is refused where it happens: a step outside a task, a signal without a run id, a
    wait given seconds where a `timedelta` goes. A refused argument is never retried."""

    async def test_step_outside_task_is_an_error(self, engine: Engine) -> None:
        with pytest.raises(NotInTaskError):
            await first("x")

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

    @pytest.mark.parametrize(("n", "argument"), [(0, "timeout"), (1, "poll_interval")])
    async def test_a_wrong_type_argument_fails_the_run_at_once(
        self, engine: Engine, tally: Tally, n: int, argument: str
    ) -> None:
        handle = await engine.enqueue(bad_wait_task, Job(key=f"bad-{argument}", n=n))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert caught.value.error_type == "umt_sdk.UsageError"
        assert argument in caught.value.error_message
        assert tally.body_runs[(f"bad-{argument}", "handler")] == 1, (
            "a refused argument is not retried"
        )
