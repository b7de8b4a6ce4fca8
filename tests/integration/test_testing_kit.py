"""`assert_enqueued`, `refute_enqueued`, `all_enqueued` and `run_inline` on both backends,
through the pytest plugin's own fixtures (`umt_engine` pinned to each backend here)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import attrs
import pytest

from umt_sdk import (
    Engine,
    Registry,
    RetryPolicy,
    SyncTaskContext,
    TaskContext,
    task,
)
from umt_sdk.exceptions import (
    ResultTimeoutError,
    RunFailedError,
    UnknownTaskError,
    UsageError,
)
from umt_sdk.testing import (
    FakeClock,
    all_enqueued,
    assert_enqueued,
    refute_enqueued,
    run_inline,
)

pytestmark = pytest.mark.parametrize(
    "umt_backend",
    ["memory", pytest.param("postgres", marks=pytest.mark.backend("pg"))],
)


@attrs.frozen
class Email:
    to: str
    subject: str = "hello"
    tags: dict[str, Any] = attrs.field(factory=dict)


@task("send_email")
def send_email(ctx: SyncTaskContext[Email]) -> str:
    return f"sent {ctx.input.subject!r} to {ctx.input.to}"


@task("report")
async def report(ctx: TaskContext[dict[str, Any]]) -> int:
    return len(ctx.input)


@task("approval")
async def approval(ctx: TaskContext[str]) -> str:
    """Two days of cool-down, then a decision that may take a week."""
    await ctx.step.sleep("cool-down", timedelta(days=2))
    decision: dict[str, str] = await ctx.step.wait_for_fact("decision", timeout=timedelta(days=7))
    return f"{ctx.input}: {decision['verdict']}"


@task("quick_approval")
async def quick_approval(ctx: TaskContext[str]) -> str:
    """`approval` with real-time-sized waits, for Postgres."""
    await ctx.step.sleep("cool-down", timedelta(milliseconds=200))
    decision: dict[str, str] = await ctx.step.wait_for_fact("decision", timeout=timedelta(days=7))
    return f"{ctx.input}: {decision['verdict']}"


@task("go_ahead")
async def go_ahead(ctx: TaskContext[str]) -> str:
    go: int = await ctx.step.wait_for_fact("go")
    return f"{ctx.input} after {go}"


@task("broken", retry=RetryPolicy(max_attempts=1))
async def broken(ctx: TaskContext[str]) -> str:
    raise ValueError(f"no {ctx.input}")


@pytest.fixture
def umt_registry() -> Registry:
    return Registry([send_email, report, approval, quick_approval, go_ahead, broken])


# -- assert_enqueued ------------------------------------------------------------------------------


async def test_assert_enqueued_finds_a_run_by_task_input_and_priority(umt_engine: Engine) -> None:
    handle = await umt_engine.enqueue(
        send_email, Email("ada@example.com", tags={"lang": "en", "vip": True}), priority=5
    )
    run = await assert_enqueued(umt_engine, send_email, input={"to": "ada@example.com"})
    assert run.run_id == handle.run_id
    assert run.input == {
        "to": "ada@example.com",
        "subject": "hello",
        "tags": {"lang": "en", "vip": True},
    }
    # the same run by name, by name@version, by a nested subset, by the whole input
    for found in [
        await assert_enqueued(umt_engine, "send_email", priority=5),
        await assert_enqueued(umt_engine, "send_email@1", input={"tags": {"vip": True}}),
        await assert_enqueued(
            umt_engine, send_email, input=Email("ada@example.com", tags={"lang": "en", "vip": True})
        ),
        await assert_enqueued(umt_engine),
    ]:
        assert found.run_id == handle.run_id


async def test_a_failed_assertion_lists_what_was_enqueued(umt_engine: Engine) -> None:
    first = await umt_engine.enqueue(send_email, Email("ada@example.com"), priority=5)
    await umt_engine.enqueue(report, {"day": "monday"}, idempotency_key="report:monday")
    with pytest.raises(AssertionError) as failed:
        await assert_enqueued(umt_engine, send_email, input={"to": "bob@example.com"}, priority=5)
    assert str(failed.value) == (
        "expected a pending run of 'send_email' with input containing "
        '{"to": "bob@example.com"}, priority 5; found none.\n'
        "Pending runs (2):\n"
        f'  - send_email@1 [pending] priority=5 input={{"subject": "hello", "tags": {{}}, '
        f'"to": "ada@example.com"}} (run {first.run_id})\n'
        '  - report@1 [pending] priority=0 key=\'report:monday\' input={"day": "monday"} '
        f"(run {(await all_enqueued(umt_engine, report))[0].run_id})"
    )


async def test_a_run_that_already_ran_is_named_in_the_failure(umt_engine: Engine) -> None:
    assert await run_inline(umt_engine, report, {"a": 1}) == 1
    with pytest.raises(AssertionError) as failed:
        await assert_enqueued(umt_engine, report)
    message = str(failed.value)
    assert "expected a pending run of 'report'; found none.\nPending runs: none\n" in message
    assert "Matching runs in other statuses (status=None finds them) (1):" in message
    assert "report@1 [completed]" in message
    completed = await assert_enqueued(umt_engine, report, status="completed")
    assert completed.output == 1
    assert (await assert_enqueued(umt_engine, report, status=None)).run_id == completed.run_id


async def test_input_matching_tells_true_from_one_and_needs_every_key(umt_engine: Engine) -> None:
    await umt_engine.enqueue(report, {"flag": True, "nested": {"n": 1, "m": [1, 2]}})
    await refute_enqueued(umt_engine, report, input={"flag": 1})
    await refute_enqueued(umt_engine, report, input={"nested": {"n": True}})
    await refute_enqueued(umt_engine, report, input={"nested": {"m": [1]}})  # lists: equal
    await refute_enqueued(umt_engine, report, input={"missing": None})
    await assert_enqueued(umt_engine, report, input={"nested": {"m": [1, 2]}})


async def test_priority_key_and_version_filter(umt_engine: Engine) -> None:
    await umt_engine.enqueue(report, {"n": 1}, priority=-3, idempotency_key="k1")
    await refute_enqueued(umt_engine, report, priority=0)
    await refute_enqueued(umt_engine, report, idempotency_key="k2")
    await refute_enqueued(umt_engine, report, version=2)
    await refute_enqueued(umt_engine, send_email)
    await assert_enqueued(umt_engine, report, priority=-3, idempotency_key="k1", version=1)


# -- refute_enqueued, all_enqueued ----------------------------------------------------------------


async def test_refute_enqueued_lists_the_runs_it_did_not_expect(umt_engine: Engine) -> None:
    await refute_enqueued(umt_engine)
    handle = await umt_engine.enqueue(send_email, Email("eve@example.com"), priority=2)
    with pytest.raises(AssertionError) as failed:
        await refute_enqueued(umt_engine, send_email, input={"to": "eve@example.com"})
    assert str(failed.value) == (
        "expected no pending run of 'send_email' with input containing "
        '{"to": "eve@example.com"}; found (1):\n'
        '  - send_email@1 [pending] priority=2 input={"subject": "hello", "tags": {}, '
        f'"to": "eve@example.com"}} (run {handle.run_id})'
    )


async def test_all_enqueued_returns_the_matches_oldest_first(umt_engine: Engine) -> None:
    for n in range(3):
        await umt_engine.enqueue(report, {"n": n, "even": n % 2 == 0})
    await umt_engine.enqueue(send_email, Email("x@example.com"))
    assert [r.input["n"] for r in await all_enqueued(umt_engine, report)] == [0, 1, 2]
    assert [r.input["n"] for r in await all_enqueued(umt_engine, report, input={"even": True})] == [
        0,
        2,
    ]
    assert [r.task_name for r in await all_enqueued(umt_engine)] == [
        "report",
        "report",
        "report",
        "send_email",
    ]
    assert await all_enqueued(umt_engine, status="completed") == []


async def test_wrong_arguments_are_refused_by_name(umt_engine: Engine) -> None:
    with pytest.raises(UsageError, match="task must be a @task definition") as refused:
        await assert_enqueued(umt_engine, 42)  # type: ignore[arg-type]
    assert refused.value.argument == "task"
    with pytest.raises(UsageError, match="status must be one of") as refused:
        await all_enqueued(umt_engine, status="done")  # type: ignore[arg-type]
    assert refused.value.argument == "status"
    with pytest.raises(UsageError, match="'report@1' conflicts with version=2"):
        await refute_enqueued(umt_engine, "report@1", version=2)
    with pytest.raises(UsageError, match="engine must be an Engine"):
        await assert_enqueued("memory://", report)  # type: ignore[arg-type]


# -- run_inline -----------------------------------------------------------------------------------


async def test_run_inline_runs_a_plain_handler_to_its_typed_output(umt_engine: Engine) -> None:
    output = await run_inline(umt_engine, send_email, Email("ada@example.com", subject="hi"))
    assert output == "sent 'hi' to ada@example.com"
    run = await assert_enqueued(umt_engine, send_email, status="completed")
    assert run.attempts == 1


async def test_run_inline_raises_what_result_raises(umt_engine: Engine) -> None:
    with pytest.raises(RunFailedError, match="ValueError: no coffee") as failed:
        await run_inline(umt_engine, broken, "coffee")
    assert failed.value.error_type == "ValueError"


async def test_run_inline_needs_the_facts_a_run_waits_for(umt_engine: Engine) -> None:
    with pytest.raises(UsageError, match="waits for fact 'go' with no deadline") as refused:
        await run_inline(umt_engine, go_ahead, "x")
    assert refused.value.argument == "facts"
    assert await run_inline(umt_engine, go_ahead, "y", facts={"go": 3}) == "y after 3"
    assert await run_inline(umt_engine, go_ahead, "z", facts=lambda name: len(name)) == "z after 2"
    with pytest.raises(UsageError, match="facts must be a dict") as refused:
        await run_inline(umt_engine, go_ahead, "w", facts=42)  # type: ignore[arg-type]
    assert refused.value.argument == "facts"


async def test_run_inline_refuses_a_running_worker(umt_engine: Engine) -> None:
    async with umt_engine.worker():
        with pytest.raises(UsageError, match="is running on this engine"):
            await run_inline(umt_engine, report, {})


async def test_run_inline_says_to_fill_an_empty_registry(umt_backend: str) -> None:
    from umt_sdk import connect

    engine = await connect("memory://")
    async with engine:
        with pytest.raises(UnknownTaskError, match="override the `umt_registry` fixture"):
            await run_inline(engine, report, {})


async def test_two_days_and_a_fact_inline(
    umt_engine: Engine, umt_backend: str, umt_clock: FakeClock
) -> None:
    facts = {"decision": {"verdict": "approved"}}
    if umt_backend == "memory":
        start = umt_clock.now()
        assert await run_inline(umt_engine, approval, "doc-1", facts=facts) == "doc-1: approved"
        assert umt_clock.now() - start >= timedelta(days=2)
    else:  # real time: a two-day sleep fails at once, saying why; a short one runs
        with pytest.raises(ResultTimeoutError, match="this engine keeps real time"):
            await run_inline(umt_engine, approval, "doc-1", facts=facts, timeout=30)
        out = await run_inline(umt_engine, quick_approval, "doc-2", facts=facts, timeout=30)
        assert out == "doc-2: approved"
    info = await assert_enqueued(umt_engine, status="completed")
    assert [s.name for s in (await umt_engine.get(info.run_id)).timeline] == [
        "cool-down",
        "decision",
    ]


async def test_a_fact_that_never_comes_is_a_usage_error(
    umt_engine: Engine, umt_backend: str
) -> None:
    if umt_backend == "memory":  # the wait times out after seven (virtual) days
        with pytest.raises(RunFailedError, match="FactTimeoutError"):
            await run_inline(umt_engine, approval, "doc-3")
    else:
        with pytest.raises(ResultTimeoutError, match="is waiting until"):
            await run_inline(umt_engine, quick_approval, "doc-3", timeout=5)


# -- the fixtures ---------------------------------------------------------------------------------


async def test_umt_worker_serves_the_registry(umt_engine: Engine, umt_worker: Any) -> None:
    assert umt_worker.running
    handle = await umt_engine.enqueue(send_email, Email("w@example.com"))
    assert await handle.result(timeout=30) == "sent 'hello' to w@example.com"


async def test_the_engine_matches_the_backend(umt_engine: Engine, umt_backend: str) -> None:
    clock = umt_engine.backend.clock
    assert isinstance(clock, FakeClock) == (umt_backend == "memory")
