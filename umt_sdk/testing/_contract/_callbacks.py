"""Callback tokens: one token per callback step (the same on replay), completed exactly once;
a completion before the wait is kept; a malformed, forged, expired or used token is refused
and changes nothing; two racing completions, one wins."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from umt_sdk import (
    CallbackTimeoutError,
    CallbackTokenError,
    Engine,
    RetryPolicy,
    RunFailedError,
    TaskContext,
    TaskDefinition,
    UsageError,
    task,
)
from umt_sdk.testing._contract._base import Job, Tally, current_tally, wait_until

__all__ = ["CallbacksContract"]


@task("contract.callback", version=1)
async def callback_task(ctx: TaskContext[Job]) -> dict[str, Any]:
    """Mint a token (shown to the test in the tally), wait for the fact `<key>.go` when `n`
    is 1 (so the test can complete the callback before the wait), then wait for it."""
    tally = current_tally()
    token = await ctx.step.callback_token("payment", timeout=timedelta(minutes=10))
    tally.business.setdefault(f"{ctx.input.key}.tokens", []).append(token)
    if ctx.input.n == 1:
        await ctx.step.wait_for_fact(f"{ctx.input.key}.go")
    payload: dict[str, Any] = await ctx.step.wait_for_callback(token)
    return {"token": token, "payload": payload}


@task("contract.callback_expires", version=1)
async def expiring_callback_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()
    token = await ctx.step.callback_token("payment", timeout=timedelta(milliseconds=400))
    tally.business[f"{ctx.input.key}.token"] = token
    try:
        await ctx.step.wait_for_callback(token)
    except CallbackTimeoutError as exc:
        return f"expired: {exc.callback_name}"
    return "completed"


@task("contract.callback_misuse", version=1, retry=RetryPolicy(max_attempts=3))
async def callback_misuse_task(ctx: TaskContext[Job]) -> str:
    """Callbacks used wrongly, as users might: each `n` one mistake."""
    current_tally().body_runs[(ctx.input.key, "handler")] += 1
    if ctx.input.n == 0:
        await ctx.step.callback_token("payment", timeout=timedelta(0))
    elif ctx.input.n == 1:
        await ctx.step.callback_token("payment", timeout=30)  # type: ignore[arg-type]  # under test
    elif ctx.input.n == 2:
        await ctx.step.wait_for_callback(f"umtcb1.{'0' * 32}.{'A' * 43}")
    else:
        await ctx.step.wait_for_callback("nope")
    return "not reached"


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    callback_task,
    expiring_callback_task,
    callback_misuse_task,
)
"""The tasks of this topic that the suite's engine registers."""


async def _token_of(engine: Engine, tally: Tally, run_id: Any, key: str) -> str:
    await wait_until(engine, run_id, lambda i: i.status == "waiting", what="callback wait")
    tokens: list[str] = tally.business[f"{key}.tokens"]
    return tokens[0]


class CallbacksContract:
    """`callback_token`, `wait_for_callback` and `complete_callback`, on facts."""

    async def test_completion_wakes_the_wait_and_replay_keeps_the_token(
        self, engine: Engine, tally: Tally
    ) -> None:
        handle = await engine.enqueue(callback_task, Job(key="cb"))
        async with engine.worker():
            token = await _token_of(engine, tally, handle.run_id, "cb")
            await engine.complete_callback(token, {"paid": 42})
            result = await handle.result(timeout=15)
        assert result == {"token": token, "payload": {"paid": 42}}
        # The handler ran twice (before and after the park): the step gave the same token.
        assert tally.business["cb.tokens"] == [token, token]
        assert token.startswith("umtcb1.")
        assert len(token) == 83

    async def test_completion_before_the_wait_is_kept(self, engine: Engine, tally: Tally) -> None:
        handle = await engine.enqueue(callback_task, Job(key="early", n=1))
        async with engine.worker():
            token = await _token_of(engine, tally, handle.run_id, "early")
            await engine.complete_callback(token, {"paid": 1})
            assert await engine.signal(handle.run_id, "early.go")
            result = await handle.result(timeout=15)
        assert result["payload"] == {"paid": 1}

    async def test_a_token_completes_once(self, engine: Engine, tally: Tally) -> None:
        handle = await engine.enqueue(callback_task, Job(key="twice", n=1))
        async with engine.worker():
            token = await _token_of(engine, tally, handle.run_id, "twice")
            await engine.complete_callback(token, {"paid": 1})
            with pytest.raises(CallbackTokenError, match="already completed") as caught:
                await engine.complete_callback(token, {"paid": 2})
            assert caught.value.reason == "completed"
            assert await engine.signal(handle.run_id, "twice.go")
            result = await handle.result(timeout=15)
        assert result["payload"] == {"paid": 1}

    async def test_racing_completions_one_wins(self, engine: Engine, tally: Tally) -> None:
        handle = await engine.enqueue(callback_task, Job(key="race", n=1))
        async with engine.worker():
            token = await _token_of(engine, tally, handle.run_id, "race")
            outcomes = await asyncio.gather(
                *(engine.complete_callback(token, {"by": i}) for i in range(4)),
                return_exceptions=True,
            )
            winners = [i for i, o in enumerate(outcomes) if o is None]
            losers = [o for o in outcomes if o is not None]
            assert len(winners) == 1, outcomes
            assert all(
                isinstance(o, CallbackTokenError) and o.reason == "completed" for o in losers
            ), outcomes
            assert await engine.signal(handle.run_id, "race.go")
            result = await handle.result(timeout=15)
        assert result["payload"] == {"by": winners[0]}

    async def test_bad_tokens_are_refused_and_change_nothing(
        self, engine: Engine, tally: Tally
    ) -> None:
        one = await engine.enqueue(callback_task, Job(key="real", n=1))
        other = await engine.enqueue(callback_task, Job(key="other", n=1))
        async with engine.worker():
            token = await _token_of(engine, tally, one.run_id, "real")
            other_token = await _token_of(engine, tally, other.run_id, "other")
            secret = token.rsplit(".", 1)[1]
            flipped = ("A" if secret[0] != "A" else "B") + secret[1:]
            forged = [
                # well formed, unknown secret for the run
                f"umtcb1.{one.run_id.hex}.{flipped}",
                # a real secret, bound to another run
                f"umtcb1.{other.run_id.hex}.{secret}",
                # a run that does not exist
                f"umtcb1.{'0' * 32}.{secret}",
            ]
            for bad in forged:
                with pytest.raises(CallbackTokenError, match="no callback of run") as caught:
                    await engine.complete_callback(bad, {"paid": 666})
                assert caught.value.reason == "unknown"
            malformed: list[Any] = ["", "nope", token + "x", token[:-1] + "!", "a" * 1_000_000, 7]
            for bad in malformed:
                with pytest.raises(CallbackTokenError, match="malformed") as caught:
                    await engine.complete_callback(bad, {"paid": 666})
                assert caught.value.reason == "malformed"
                assert caught.value.argument == "token"
            # Only the token completes a callback: its fact cannot be signaled or broadcast.
            with pytest.raises(UsageError, match="reserved"):
                await engine.signal(one.run_id, "umt.callback:payment", {"paid": 666})
            with pytest.raises(UsageError, match="reserved"):
                await engine.broadcast("umt.callback:payment", {"paid": 666})
            # Nothing changed: the real tokens still complete their own runs.
            await engine.complete_callback(token, {"paid": 1})
            await engine.complete_callback(other_token, {"paid": 2})
            for handle, key in ((one, "real"), (other, "other")):
                assert await engine.signal(handle.run_id, f"{key}.go")
            assert (await one.result(timeout=15))["payload"] == {"paid": 1}
            assert (await other.result(timeout=15))["payload"] == {"paid": 2}

    async def test_an_expired_token_is_refused(self, engine: Engine, tally: Tally) -> None:
        handle = await engine.enqueue(expiring_callback_task, Job(key="late"))
        async with engine.worker():
            assert await handle.result(timeout=15) == "expired: payment"
        token: str = tally.business["late.token"]
        with pytest.raises(CallbackTokenError, match="expired") as caught:
            await engine.complete_callback(token, {"paid": 1})
        assert caught.value.reason == "expired"
        info = await engine.get(handle.run_id)
        assert [(s.name, s.status) for s in info.timeline] == [
            ("payment", "completed"),
            ("umt.callback:payment", "completed"),
        ]

    async def test_a_fork_mints_its_own_token(self, engine: Engine, tally: Tally) -> None:
        old = await engine.enqueue(callback_task, Job(key="forked"))
        async with engine.worker():
            token = await _token_of(engine, tally, old.run_id, "forked")
            await engine.complete_callback(token, {"paid": 5})
            assert (await old.result(timeout=15))["token"] == token
            fork = await engine.fork(old.run_id, "umt.callback:payment")
            result = await fork.result(timeout=15)
        # The fork keeps the old run's facts (the completion), but not its token: a token is
        # bound to one run, so the fork's replay of the kept step mints one of its own.
        assert result["payload"] == {"paid": 5}
        assert result["token"] != token
        assert result["token"].startswith(f"umtcb1.{fork.run_id.hex}.")
        with pytest.raises(CallbackTokenError, match="already completed"):
            await engine.complete_callback(result["token"], {"paid": 6})

    @pytest.mark.parametrize(
        ("n", "error_type", "says"),
        [
            (0, "umt_sdk.UsageError", "timeout"),
            (1, "umt_sdk.UsageError", "timeout"),
            (2, "umt_sdk.UsageError", "not minted by this run"),
            (3, "umt_sdk.CallbackTokenError", "malformed"),
        ],
    )
    async def test_misuse_fails_the_run_at_once(
        self, engine: Engine, tally: Tally, n: int, error_type: str, says: str
    ) -> None:
        handle = await engine.enqueue(callback_misuse_task, Job(key=f"misuse-{n}", n=n))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert caught.value.error_type == error_type
        assert says in caught.value.error_message
        assert tally.body_runs[(f"misuse-{n}", "handler")] == 1, "a refused call is not retried"
