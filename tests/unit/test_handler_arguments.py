"""A wrong argument to a ctx method, inside a running handler, fails the run at once.

The call raises `UsageError` naming the argument; the handler does not catch it, so the run
fails with it, and is not retried: its body runs once (the task's policy would retry any other
error, and the clock advances by itself here, so a retry would run). Before these checks,
`ctx.step.run("s", None)` raised a TypeError inside the step, which the step retried; a sleep
of `timedelta.max` raised OverflowError, which the task retried.

`tests/properties/test_public_arguments.py` draws many more wrong values for the same
arguments, outside a handler.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest

from umt_backend_memory import MemoryStore
from umt_sdk import (
    Engine,
    Registry,
    RetryPolicy,
    RunFailedError,
    SyncTaskContext,
    TaskContext,
    connect,
    task,
    with_attempt_token,
)
from umt_sdk.testing import FakeClock

BODY_RUNS: Counter[str] = Counter()
STORE = MemoryStore()


def _body() -> int:
    return 1


def _effect(info: object) -> int:
    return 1


AsyncCall = Callable[[TaskContext[str]], Any]
SyncCall = Callable[[SyncTaskContext[str]], Any]

# case id -> (the argument refused, the call a handler makes)
ASYNC_CASES: dict[str, tuple[str, AsyncCall]] = {
    "run-name-int": ("name", lambda ctx: ctx.step.run(5, _body)),  # type: ignore[call-overload]  # deliberately wrong: a step name that is not text
    "run-name-space": ("name", lambda ctx: ctx.step.run("a b", _body)),
    "run-fn-none": ("fn", lambda ctx: ctx.step.run("s", None)),  # type: ignore[call-overload]  # deliberately wrong: nothing to run
    "run-fn-text": ("fn", lambda ctx: ctx.step.run("s", "_body")),  # type: ignore[call-overload]  # deliberately wrong: a name, not a function
    "run-retry-int": ("retry", lambda ctx: ctx.step.run("s", _body, retry=3)),
    "run-retry-class": ("retry", lambda ctx: ctx.step.run("s", _body, retry=RetryPolicy)),
    "run-output-object": ("output_type", lambda ctx: ctx.step.run("s", _body, output_type=object)),
    "run-output-int": ("output_type", lambda ctx: ctx.step.run("s", _body, output_type=5)),
    "sleep-name-none": ("name", lambda ctx: ctx.step.sleep(None, timedelta(1))),  # type: ignore[arg-type]  # deliberately wrong: no name
    "sleep-seconds": ("duration", lambda ctx: ctx.step.sleep("nap", 5)),  # type: ignore[arg-type]  # deliberately wrong: seconds, not a timedelta
    "sleep-text": ("duration", lambda ctx: ctx.step.sleep("nap", "5m")),  # type: ignore[arg-type]  # deliberately wrong: text
    "sleep-bool": ("duration", lambda ctx: ctx.step.sleep("nap", True)),  # type: ignore[arg-type]  # deliberately wrong: a bool
    "sleep-forever": ("duration", lambda ctx: ctx.step.sleep("nap", timedelta.max)),
    "wait-name-bytes": ("name", lambda ctx: ctx.step.wait_for_fact(b"go")),  # type: ignore[arg-type]  # deliberately wrong: bytes
    "wait-timeout-seconds": ("timeout", lambda ctx: ctx.step.wait_for_fact("go", timeout=30)),  # type: ignore[arg-type]  # deliberately wrong: seconds
    "wait-timeout-negative": (
        "timeout",
        lambda ctx: ctx.step.wait_for_fact("go", timeout=timedelta(seconds=-1)),
    ),
    "wait-timeout-forever": (
        "timeout",
        lambda ctx: ctx.step.wait_for_fact("go", timeout=timedelta.max),
    ),
    "wait-poll-zero": (
        "poll_interval",
        lambda ctx: ctx.step.wait_for_fact("go", poll_interval=timedelta(0)),
    ),
    "wait-poll-float": (
        "poll_interval",
        lambda ctx: ctx.step.wait_for_fact("go", poll_interval=1.5),
    ),  # type: ignore[arg-type]  # deliberately wrong: seconds
    "wait-check-text": ("check", lambda ctx: ctx.step.wait_for_fact("go", check="yes")),  # type: ignore[arg-type]  # deliberately wrong: not a function
    "wait-payload-object": (
        "payload_type",
        lambda ctx: ctx.step.wait_for_fact("go", payload_type=object),
    ),
    "token-conn": ("conn", lambda ctx: with_attempt_token(object(), "op", _effect)),
    "token-op-key-empty": ("op_key", lambda ctx: with_attempt_token(STORE, "", _effect)),
    "token-op-key-int": ("op_key", lambda ctx: with_attempt_token(STORE, 5, _effect)),  # type: ignore[arg-type]  # deliberately wrong: not text
    "token-fn-none": ("fn", lambda ctx: with_attempt_token(STORE, "op", None)),  # type: ignore[arg-type]  # deliberately wrong: nothing to call
    "token-commit-int": ("commit", lambda ctx: with_attempt_token(STORE, "op", _effect, commit=5)),  # type: ignore[arg-type]  # deliberately wrong: not a function
    "token-result-object": (
        "result_type",
        lambda ctx: with_attempt_token(STORE, "op", _effect, result_type=object),
    ),
}

SYNC_CASES: dict[str, tuple[str, SyncCall]] = {
    "sync-run-name-int": ("name", lambda ctx: ctx.step.run(5, _body)),  # type: ignore[arg-type]  # deliberately wrong: a step name that is not text
    "sync-run-fn-none": ("fn", lambda ctx: ctx.step.run("s", None)),  # type: ignore[arg-type]  # deliberately wrong: nothing to run
    "sync-run-retry-int": ("retry", lambda ctx: ctx.step.run("s", _body, retry=3)),
    "sync-run-output-object": (
        "output_type",
        lambda ctx: ctx.step.run("s", _body, output_type=object),
    ),
    "sync-sleep-seconds": ("duration", lambda ctx: ctx.step.sleep("nap", 5)),  # type: ignore[arg-type]  # deliberately wrong: seconds
    "sync-sleep-forever": ("duration", lambda ctx: ctx.step.sleep("nap", timedelta.max)),
    "sync-wait-timeout-seconds": ("timeout", lambda ctx: ctx.step.wait_for_fact("go", timeout=30)),  # type: ignore[arg-type]  # deliberately wrong: seconds
    "sync-wait-poll-zero": (
        "poll_interval",
        lambda ctx: ctx.step.wait_for_fact("go", poll_interval=timedelta(0)),
    ),
    "sync-wait-check-text": ("check", lambda ctx: ctx.step.wait_for_fact("go", check="yes")),  # type: ignore[arg-type]  # deliberately wrong: not a function
    "sync-wait-payload-object": (
        "payload_type",
        lambda ctx: ctx.step.wait_for_fact("go", payload_type=object),
    ),
}


@task("args.async_handler")
async def async_handler(ctx: TaskContext[str]) -> None:
    BODY_RUNS[ctx.input] += 1
    outcome = ASYNC_CASES[ctx.input][1](ctx)
    if hasattr(outcome, "__await__"):
        await outcome


@task("args.sync_handler")
def sync_handler(ctx: SyncTaskContext[str]) -> None:
    BODY_RUNS[ctx.input] += 1
    SYNC_CASES[ctx.input][1](ctx)


@task("args.in_a_step")
async def in_a_step(ctx: TaskContext[str]) -> None:
    async def pay() -> int:
        BODY_RUNS[ctx.input] += 1
        return await with_attempt_token(STORE, "", _effect)

    await ctx.step.run("pay", pay)


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    # The clock jumps to the next timer by itself: a retry, if one were scheduled, would run.
    engine = await connect(
        "memory://",
        registry=Registry([async_handler, sync_handler, in_a_step]),
        clock=FakeClock(auto_advance=True),
    )
    yield engine
    await engine.close()


@pytest.mark.parametrize(
    ("case", "argument"),
    [(case, argument) for case, (argument, _) in {**ASYNC_CASES, **SYNC_CASES}.items()],
)
async def test_a_wrong_argument_fails_the_run_once_naming_it(
    engine: Engine, case: str, argument: str
) -> None:
    handler = sync_handler if case in SYNC_CASES else async_handler
    handle = await engine.enqueue(handler, case)
    async with engine.worker(poll_interval=timedelta(milliseconds=20)):
        with pytest.raises(RunFailedError) as caught:
            await handle.result(timeout=10)
    assert caught.value.error_type == "umt_sdk.UsageError", caught.value.error_message
    assert argument in caught.value.error_message
    assert BODY_RUNS[case] == 1, "a refused argument is not retried"
    info = await engine.get(handle.run_id)
    assert (info.attempts, info.failures) == (1, 1)


async def test_a_wrong_argument_inside_a_step_fails_the_step_once(engine: Engine) -> None:
    """`with_attempt_token(conn, "", fn)` in a step body: the step fails without a retry (a
    UsageError is final for the step's policy too), and so does the run."""
    handle = await engine.enqueue(in_a_step, "in-a-step")
    async with engine.worker(poll_interval=timedelta(milliseconds=20)):
        with pytest.raises(RunFailedError) as caught:
            await handle.result(timeout=10)
    assert caught.value.error_type == "umt_sdk.StepFailedError"
    assert "umt_sdk.UsageError: op_key must be a non-empty string" in caught.value.error_message
    assert BODY_RUNS["in-a-step"] == 1
    info = await engine.get(handle.run_id)
    (record,) = [s for s in info.timeline if s.name == "pay"]
    assert (record.status, record.attempt) == ("failed", 1)
