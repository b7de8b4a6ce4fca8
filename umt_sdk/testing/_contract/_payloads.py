"""Payloads and serde: values a backend cannot store (NUL, lone surrogates, too deep) are
refused where they come in or fail the step or run that made them; every execution sees
the same typed values."""

from __future__ import annotations

import dataclasses
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID

import pytest

from umt_sdk import (
    Engine,
    PayloadError,
    RetryPolicy,
    RunFailedError,
    StepFailedError,
    TaskContext,
    TaskDefinition,
    task,
)
from umt_sdk.testing._contract._base import Job, Tally, current_tally, echo_task_v2, waiter_task

__all__ = ["PayloadsContract"]


PAYLOAD_BAD_VALUES: dict[str, Any] = {
    "nul": "x\x00y",
    "surrogate": "x\ud800y",
    "nested-nul": {"a": {"b": ["ok", "x\x00y"]}},
    "key-nul": {"a": {"k\x00": 1}},
    "good": {"a": "fine"},
}


@task(
    "contract.payload_bad_step",
    version=1,
    retry=RetryPolicy(max_attempts=3, initial=timedelta(milliseconds=50), backoff=1.0),
)
async def payload_bad_step_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()

    def fetch() -> Any:
        tally.body_runs[(ctx.input.key, "fetch")] += 1
        return PAYLOAD_BAD_VALUES[ctx.input.key]

    await ctx.step.run("fetch", fetch)
    tally.body_runs[(ctx.input.key, "after")] += 1
    return "ok"


@task(
    "contract.payload_bad_output",
    version=1,
    retry=RetryPolicy(max_attempts=3, initial=timedelta(milliseconds=50), backoff=1.0),
)
async def payload_bad_output_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()
    tally.body_runs[(ctx.input.key, "handler")] += 1
    value: str = tally.business["output"]
    return value


@task("contract.payload_any", version=1)
async def payload_any_task(ctx: TaskContext[Any]) -> Any:
    return ctx.input


@dataclasses.dataclass(frozen=True)
class Shipment:
    when: datetime
    tags: tuple[str, ...]


_WHEN = datetime(2030, 1, 2, 3, 4, 5, 6, tzinfo=timezone(timedelta(hours=5, minutes=30)))


_IDENT = UUID("0190f4d4-1b2c-7a00-8b00-000000000001")


def _now() -> datetime:
    return _WHEN


def _day() -> date:
    return _WHEN.date()


def _ratio() -> float:
    return 3  # an int where a float is declared: every execution must see 3.0


def _numbers() -> list[int]:
    return (1, 2, 3)  # type: ignore[return-value]  # a tuple where a list is declared


def _mixed() -> dict[str, Any]:
    return {"when": _WHEN, "n": [1, {"x": None}]}  # Any inside: JSON's form on every execution


def _shipment() -> Shipment:
    return Shipment(when=_WHEN, tags=("a", "b"))


@task("contract.payload_types", version=1)
async def payload_types_task(ctx: TaskContext[Job]) -> str:
    tally = current_tally()
    seen: dict[str, Any] = {
        "datetime": await ctx.step.run("datetime", _now),
        "datetime-lambda": await ctx.step.run("dt-lambda", lambda: _WHEN, output_type=datetime),
        "date": await ctx.step.run("date", _day),
        "uuid": await ctx.step.run("uuid", lambda: _IDENT, output_type=UUID),
        "decimal": await ctx.step.run("decimal", lambda: Decimal("10.50"), output_type=Decimal),
        "timedelta": await ctx.step.run(
            "timedelta", lambda: timedelta(days=2, microseconds=7), output_type=timedelta
        ),
        "attrs": await ctx.step.run("attrs", lambda: Job(key="j", n=2), output_type=Job),
        "dataclass": await ctx.step.run("dataclass", _shipment),
        "tuple": await ctx.step.run("tuple", lambda: (1, "a"), output_type=tuple[int, str]),
        "float": await ctx.step.run("float", _ratio),
        "list": await ctx.step.run("list", _numbers),
        "mixed": await ctx.step.run("mixed", _mixed),
        "plain": await ctx.step.run("plain", lambda: {"a": [1, 2.5, "x", True, None], "b": {}}),
        "none": await ctx.step.run("none", lambda: None),
    }
    tally.business.setdefault("seen", []).append(seen)
    await ctx.step.sleep("nap", timedelta(milliseconds=50))
    return "ok"


PAYLOAD_TYPES_EXPECTED: dict[str, Any] = {
    "datetime": _WHEN,
    "datetime-lambda": _WHEN,
    "date": _WHEN.date(),
    "uuid": _IDENT,
    "decimal": Decimal("10.50"),
    "timedelta": timedelta(days=2, microseconds=7),
    "attrs": Job(key="j", n=2),
    "dataclass": Shipment(when=_WHEN, tags=("a", "b")),
    "tuple": (1, "a"),
    "float": 3.0,
    "list": [1, 2, 3],
    "mixed": {"when": _WHEN.isoformat(), "n": [1, {"x": None}]},
    "plain": {"a": [1, 2.5, "x", True, None], "b": {}},
    "none": None,
}


def _shape(value: Any) -> Any:
    """`value` with the exact type of every part beside it (3 == 3.0, tuple == list otherwise).
    The order of an object's keys is not kept (Postgres's jsonb orders them its own way)."""
    if isinstance(value, dict):
        return ("dict", sorted((k, _shape(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return (type(value).__name__, [_shape(v) for v in value])
    if isinstance(value, datetime):
        return ("datetime", value, value.utcoffset())
    if isinstance(value, Decimal):
        return ("Decimal", str(value))
    return (type(value).__qualname__, value)


@task("contract.payload_untyped", version=1)
async def payload_untyped_task(ctx: TaskContext[Job]) -> str:
    try:
        await ctx.step.run("now", lambda: _WHEN)
    except StepFailedError as exc:
        return "refused" if exc.error_type.endswith("PayloadError") else exc.error_type
    return "accepted"


@task("contract.payload_nul_error", version=1, retry=RetryPolicy.none())
async def payload_nul_error_task(ctx: TaskContext[Job]) -> str:
    def boom() -> None:
        raise OSError("disk \x00 on fire")

    try:
        await ctx.step.run("boom", boom)
    except StepFailedError:
        raise RuntimeError("handler \x00 gave up \ud800") from None
    return "unreachable"


TASKS: tuple[TaskDefinition[Any, Any], ...] = ()
"""None registered with the suite's engine: each test adds the task it runs."""


class PayloadsContract:
    """What is stored is what every replay decodes, and what cannot be stored is refused."""

    @pytest.mark.parametrize(
        ("bad", "path"),
        [
            ("nul", "output of step 'fetch'"),
            ("surrogate", "output of step 'fetch'"),
            ("nested-nul", "output of step 'fetch'.a.b[1]"),
            ("key-nul", "output of step 'fetch'.a['k\\x00']"),
        ],
    )
    async def test_payload_step_output_that_cannot_be_stored_fails_the_step(
        self, engine: Engine, tally: Tally, bad: str, path: str
    ) -> None:
        engine.registry.add(payload_bad_step_task)
        handle = await engine.enqueue(payload_bad_step_task, Job(key=bad))
        good = await engine.enqueue(payload_bad_step_task, Job(key="good"))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
            assert await good.result(timeout=15) == "ok"
        assert caught.value.error_type.endswith("StepFailedError")
        assert "PayloadError" in caught.value.error_message
        assert path in caught.value.error_message
        info = await engine.get(handle.run_id)
        assert info.attempts == 1, "a value that cannot be stored is not retried"
        assert info.failures == 1
        (record,) = info.timeline
        assert (record.name, record.status, record.attempt) == ("fetch", "failed", 1)
        assert record.error is not None
        assert record.error.type == "umt_sdk.PayloadError"
        assert path in record.error.message
        assert "\x00" not in record.error.message, "the stored error holds no NUL itself"
        assert tally.body_runs[(bad, "fetch")] == 1
        assert tally.body_runs[(bad, "after")] == 0
        assert (await engine.get(good.run_id)).failures == 0

    @pytest.mark.parametrize("bad", ["a\x00b", "a\ud800b", "\udfff"])
    async def test_payload_task_output_that_cannot_be_stored_fails_the_run_at_once(
        self, engine: Engine, tally: Tally, bad: str
    ) -> None:
        engine.registry.add(payload_bad_output_task)
        tally.business["output"] = bad
        handle = await engine.enqueue(payload_bad_output_task, Job(key="out"))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert caught.value.error_type == "umt_sdk.PayloadError"
        assert "task output" in caught.value.error_message
        info = await engine.get(handle.run_id)
        assert info.status == "failed"
        assert info.output is None, "nothing is stored"
        assert (info.attempts, info.failures, info.lease_expirations) == (1, 1, 0)
        assert tally.body_runs[("out", "handler")] == 1

    async def test_payload_input_and_fact_payload_that_cannot_be_stored_are_refused(
        self, engine: Engine
    ) -> None:
        cases: list[tuple[Any, str]] = [
            (Job(key="a\x00b"), "input.key"),
            ({"key": "x\ud800", "n": 1}, "input.key"),
        ]
        for bad, field in cases:
            with pytest.raises(PayloadError) as caught:
                await engine.enqueue(echo_task_v2, bad)
            assert caught.value.field == field
            assert field in str(caught.value)
        with pytest.raises(PayloadError) as caught:
            await engine.enqueue(echo_task_v2, Job(key="k"), idempotency_key="key\x00")
        assert caught.value.field == "idempotency_key"
        assert len(await engine.list()) == 0, "nothing is stored"
        handle = await engine.enqueue(waiter_task, Job(key="f"))
        for payload, field in [
            ({"note": ["ok", "x\x00"]}, "payload of fact 'f'.note[1]"),
            ("\ud800", "payload of fact 'f'"),
            ({"k\x00": 1}, "payload of fact 'f'['k\\x00']"),
        ]:
            with pytest.raises(PayloadError) as caught:
                await engine.signal(handle.run_id, "f", payload)
            assert caught.value.field == field
        with pytest.raises(PayloadError):
            await engine.cancel(handle.run_id, reason="no\x00")
        assert await engine.signal(handle.run_id, "f", {"v": "ok"}), "no refused fact was kept"
        async with engine.worker():
            assert await handle.result(timeout=15) == {"v": "ok"}

    async def test_payload_deep_input_is_refused_with_a_payload_error(self, engine: Engine) -> None:
        engine.registry.add(payload_any_task)
        for levels in (65, 10_000):
            deep: list[Any] = []
            inner = deep
            for _ in range(levels - 1):
                inner.append([])
                inner = inner[0]
            with pytest.raises(PayloadError) as caught:
                await engine.enqueue(payload_any_task, deep)
            assert caught.value.field.startswith("input[0]")
            assert "64 levels" in str(caught.value)
            with pytest.raises(PayloadError):
                await engine.enqueue(echo_task_v2, {"key": deep})
        assert len(await engine.list()) == 0
        at_limit: list[Any] = []
        inner = at_limit
        for _ in range(63):
            inner.append([])
            inner = inner[0]
        handle = await engine.enqueue(payload_any_task, at_limit)
        async with engine.worker():
            assert await handle.result(timeout=15) == at_limit

    async def test_payload_first_execution_sees_what_every_replay_sees(
        self, engine: Engine, tally: Tally
    ) -> None:
        engine.registry.add(payload_types_task)
        handle = await engine.enqueue(payload_types_task, Job(key="types"))
        async with engine.worker():
            assert await handle.result(timeout=15) == "ok"
        first, replayed = tally.business["seen"]
        assert _shape(first) == _shape(replayed), "a replay sees other values or types"
        assert _shape(first) == _shape(PAYLOAD_TYPES_EXPECTED)
        info = await engine.get(handle.run_id)
        assert info.attempts == 2, "the sleep parked the run: the second execution replayed"

    async def test_payload_untyped_step_returning_a_non_json_value_is_refused(
        self, engine: Engine
    ) -> None:
        engine.registry.add(payload_untyped_task)
        handle = await engine.enqueue(payload_untyped_task, Job(key="untyped"))
        async with engine.worker():
            assert await handle.result(timeout=15) == "refused"
        info = await engine.get(handle.run_id)
        (record,) = info.timeline
        assert record.status == "failed"
        assert record.error is not None
        assert record.error.type == "umt_sdk.PayloadError"
        assert "output of step 'now' is a datetime" in record.error.message
        assert "output_type=" in record.error.message, "the error says how to fix it"

    async def test_payload_error_messages_holding_nul_are_recorded_escaped(
        self, engine: Engine
    ) -> None:
        engine.registry.add(payload_nul_error_task)
        handle = await engine.enqueue(payload_nul_error_task, Job(key="err"))
        async with engine.worker():
            with pytest.raises(RunFailedError) as caught:
                await handle.result(timeout=15)
        assert caught.value.error_type == "RuntimeError"
        assert caught.value.error_message == "handler \\x00 gave up \\ud800"
        info = await engine.get(handle.run_id)
        (record,) = info.timeline
        assert (record.name, record.status) == ("boom", "failed")
        assert record.error is not None
        assert record.error.message == "disk \\x00 on fire"
        assert info.error is not None
        assert "\x00" not in info.error.traceback
