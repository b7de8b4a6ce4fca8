"""The replayer on the memory backend: histories recorded by real runs, replayed against
changed code. Every changed handler's step bodies, checks and ops fail the test if called."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest

from umt_backend_memory import MemoryStore
from umt_sdk import (
    AttemptInfo,
    Registry,
    RetryPolicy,
    RunHistory,
    RunStatus,
    SyncTaskContext,
    TaskContext,
    TaskDefinition,
    connect,
    task,
    with_attempt_token,
)
from umt_sdk.exceptions import (
    NonDeterminismError,
    RunFailedError,
    RunNotFoundError,
    UnknownTaskError,
)
from umt_sdk.testing import FakeClock, Replayer

CALLED: list[str] = []
"""What ran during a replay that must never run (step bodies, checks, ops)."""


@pytest.fixture(autouse=True)
def _nothing_ran() -> Any:
    CALLED.clear()
    yield
    assert CALLED == [], f"ran during a replay: {CALLED}"


def never(what: str) -> Any:
    async def body(*_: Any, **__: Any) -> Any:
        CALLED.append(what)
        raise AssertionError(f"{what} ran during a replay")

    return body


def never_plain(what: str) -> Any:
    def body(*_: Any, **__: Any) -> Any:
        CALLED.append(what)
        raise AssertionError(f"{what} ran during a replay")

    return body


# -- the recorded code ----------------------------------------------------------------------------


async def fetch(order: str) -> dict[str, Any]:
    return {"order": order, "amount": 12}


async def charge(amount: int) -> str:
    return f"paid {amount}"


@task("shop.order", version=1)
async def order_v1(ctx: TaskContext[str]) -> str:
    found = await ctx.step.run("fetch", fetch, ctx.input)
    paid: str = await ctx.step.run("charge", charge, found["amount"])
    await ctx.step.sleep("cool-down", timedelta(hours=1))
    labels = [await ctx.step.run("label", fetch, part) for part in ("a", "b")]
    return f"{paid} with {len(labels)} labels"


# -- today's code, changed ------------------------------------------------------------------------


@task("shop.order", version=1)
async def unchanged(ctx: TaskContext[str]) -> str:
    found = await ctx.step.run("fetch", never("fetch"), ctx.input)
    paid: str = await ctx.step.run("charge", never("charge"), found["amount"])
    await ctx.step.sleep("cool-down", timedelta(hours=1))
    labels = [await ctx.step.run("label", never("label"), part) for part in ("a", "b")]
    return f"{paid} with {len(labels)} labels"


@task("shop.order", version=1)
async def reordered(ctx: TaskContext[str]) -> str:
    paid: str = await ctx.step.run("charge", never("charge"), 12)
    await ctx.step.run("fetch", never("fetch"), ctx.input)
    return paid


@task("shop.order", version=1)
async def renamed(ctx: TaskContext[str]) -> str:
    found = await ctx.step.run("fetch", never("fetch"), ctx.input)
    paid: str = await ctx.step.run("charge_card", never("charge_card"), found["amount"])
    return paid


@task("shop.order", version=1)
async def run_to_sleep(ctx: TaskContext[str]) -> str:
    await ctx.step.run("fetch", never("fetch"), ctx.input)
    await ctx.step.sleep("charge", timedelta(minutes=5))
    return "slept"


@task("shop.order", version=1)
async def appended(ctx: TaskContext[str]) -> str:
    found = await ctx.step.run("fetch", never("fetch"), ctx.input)
    paid: str = await ctx.step.run("charge", never("charge"), found["amount"])
    await ctx.step.sleep("cool-down", timedelta(hours=1))
    for part in ("a", "b"):
        await ctx.step.run("label", never("label"), part)
    await ctx.step.run("notify", never("notify"))
    return paid


@task("shop.order", version=1)
async def dropped_last(ctx: TaskContext[str]) -> str:
    found = await ctx.step.run("fetch", never("fetch"), ctx.input)
    paid: str = await ctx.step.run("charge", never("charge"), found["amount"])
    await ctx.step.sleep("cool-down", timedelta(hours=1))
    await ctx.step.run("label", never("label"), "a")
    return paid


@task("shop.order", version=1)
async def output_type_changed(ctx: TaskContext[str]) -> str:
    found = await ctx.step.run("fetch", never("fetch"), ctx.input, output_type=int)
    return str(found)


@task("shop.order", version=1)
def plain_unchanged(ctx: SyncTaskContext[str]) -> str:
    found = ctx.step.run("fetch", never_plain("fetch"), ctx.input)
    paid: str = ctx.step.run("charge", never_plain("charge"), found["amount"])
    ctx.step.sleep("cool-down", timedelta(hours=1))
    labels = [ctx.step.run("label", never_plain("label"), part) for part in ("a", "b")]
    return f"{paid} with {len(labels)} labels"


@task("shop.order", version=1)
def plain_renamed(ctx: SyncTaskContext[str]) -> str:
    ctx.step.run("fetch", never_plain("fetch"), ctx.input)
    paid: str = ctx.step.run("charge_card", never_plain("charge_card"), 12)
    return paid


@task("shop.order", version=1)
async def cleans_up_in_finally(ctx: TaskContext[str]) -> str:
    try:
        await ctx.step.run("fetch", never("fetch"), ctx.input)
        await ctx.step.run("charge_card", never("charge_card"), 12)
    finally:
        await ctx.step.run("cleanup", never("cleanup"))
    return "done"


async def record(
    definition: TaskDefinition[Any, Any],
    payload: Any,
    *,
    until: Sequence[RunStatus] = ("completed", "failed"),
) -> RunHistory:
    """Run `definition` on the memory backend until the run is in one of `until`; export it."""
    clock = FakeClock(auto_advance=True)
    engine = await connect("memory://", registry=Registry([definition]), clock=clock)
    try:
        handle = await engine.enqueue(definition, payload)
        async with engine.worker():
            if "completed" in until:  # someone waits for the result: the clock jumps
                with contextlib.suppress(RunFailedError):
                    await handle.result(timeout=5)
            for _ in range(500):
                info = await engine.get(handle.run_id)
                if info.status in until and info.attempts > 0:
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail(f"the run stayed {info.status}")
        return await engine.export_history(handle.run_id)
    finally:
        await engine.close()


@pytest.fixture
async def order_history() -> RunHistory:
    return await record(order_v1, "o-1")


def test_the_export_carries_the_run_as_recorded(order_history: RunHistory) -> None:
    h = order_history
    assert (h.task, h.version, h.status, h.input) == ("shop.order", 1, "completed", "o-1")
    assert h.output == "paid 12 with 2 labels"
    assert [(s.name, s.kind, s.status) for s in h.steps] == [
        ("fetch", "step", "completed"),
        ("charge", "step", "completed"),
        ("cool-down", "sleep", "completed"),
        ("label", "step", "completed"),
        ("label#2", "step", "completed"),
    ]
    assert h.steps[0].output == {"order": "o-1", "amount": 12}
    assert h.steps[2].wake_at is not None
    assert RunHistory.from_json(h.to_json()) == h


async def test_unchanged_code_replays_to_the_end(order_history: RunHistory) -> None:
    result = await Replayer(Registry([unchanged])).replay(order_history)
    assert (result.ok, result.outcome) == (True, "finished")
    assert (result.steps_recorded, result.steps_matched) == (5, 5)
    assert result.summary().startswith(f"ok run {order_history.run_id} (shop.order@1)")


async def test_a_plain_handler_replays_too(order_history: RunHistory) -> None:
    result = await Replayer(Registry([plain_unchanged])).replay(order_history)
    assert (result.outcome, result.steps_matched) == ("finished", 5)


async def test_a_reordered_step_is_caught_with_the_diff(order_history: RunHistory) -> None:
    with pytest.raises(NonDeterminismError) as caught:
        await Replayer(Registry([reordered])).replay(order_history)
    error = caught.value
    assert (error.position, error.recorded, error.current) == (1, "step 'fetch'", "step 'charge'")
    assert error.run_id == order_history.run_id
    lines = str(error).splitlines()
    assert lines[0] == (
        f"run {order_history.run_id}: the code no longer replays its history (task shop.order@1)"
    )
    assert lines[1].split() == ["position", "recorded", "now"]
    assert lines[2].split() == ["1", "step", "'fetch'", "step", "'charge'", "<-", "differs"]


async def test_a_renamed_step_is_caught_with_the_diff(order_history: RunHistory) -> None:
    with pytest.raises(NonDeterminismError) as caught:
        await Replayer(Registry([renamed])).replay(order_history)
    error = caught.value
    assert (error.position, error.recorded, error.current) == (
        2,
        "step 'charge'",
        "step 'charge_card'",
    )
    lines = str(error).splitlines()
    assert lines[2].split() == ["1", "step", "'fetch'", "step", "'fetch'"]
    assert lines[3].split() == ["2", "step", "'charge'", "step", "'charge_card'", "<-", "differs"]


async def test_a_plain_handler_mismatch_is_caught(order_history: RunHistory) -> None:
    with pytest.raises(NonDeterminismError) as caught:
        await Replayer(Registry([plain_renamed])).replay(order_history)
    assert (caught.value.position, caught.value.current) == (2, "step 'charge_card'")


async def test_a_step_turned_into_a_sleep_is_caught(order_history: RunHistory) -> None:
    with pytest.raises(NonDeterminismError) as caught:
        await Replayer(Registry([run_to_sleep])).replay(order_history)
    error = caught.value
    assert (error.position, error.recorded, error.current) == (2, "step 'charge'", "sleep 'charge'")
    assert (error.recorded_kind, error.current_kind, error.step_name) == ("step", "sleep", "charge")
    assert "<- differs" in str(error).splitlines()[3]


async def test_a_step_appended_at_the_end_is_compatible(order_history: RunHistory) -> None:
    result = await Replayer(Registry([appended])).replay(order_history)
    assert (result.ok, result.outcome, result.next_call) == (True, "goes_on_live", "step 'notify'")
    assert result.steps_matched == 5


async def test_a_recorded_step_the_code_no_longer_asks_for_is_caught(
    order_history: RunHistory,
) -> None:
    with pytest.raises(NonDeterminismError) as caught:
        await Replayer(Registry([dropped_last])).replay(order_history)
    error = caught.value
    assert (error.position, error.recorded, error.current) == (
        5,
        "step 'label#2'",
        "(the handler returned)",
    )
    assert "..." not in str(error)  # 4 matched rows: all shown
    assert str(error).splitlines()[-2].split()[:3] == ["5", "step", "'label#2'"]


async def test_an_output_that_no_longer_decodes_is_caught(order_history: RunHistory) -> None:
    with pytest.raises(NonDeterminismError) as caught:
        await Replayer(Registry([output_type_changed])).replay(order_history)
    assert caught.value.position == 2
    assert "(the handler raised" in caught.value.current
    assert "PayloadError" in caught.value.current


async def test_a_finally_that_asks_for_more_runs_nothing(order_history: RunHistory) -> None:
    with pytest.raises(NonDeterminismError) as caught:
        await Replayer(Registry([cleans_up_in_finally])).replay(order_history)
    assert caught.value.current == "step 'charge_card'"


async def test_replay_many_gives_one_result_per_run(order_history: RunHistory) -> None:
    other = await record(order_v1, "o-2")
    registry = Registry([renamed])
    results = await Replayer(registry).replay_many([order_history, other])
    assert [r.run_id for r in results] == [order_history.run_id, other.run_id]
    assert [r.outcome for r in results] == ["mismatch", "mismatch"]
    assert all(isinstance(r.error, NonDeterminismError) for r in results)
    assert results[0].summary().startswith(f"FAILED run {order_history.run_id}: the code")


async def test_an_unregistered_task_is_a_failed_replay(order_history: RunHistory) -> None:
    @task("shop.other", version=1)
    async def other(ctx: TaskContext[str]) -> str:
        return ""

    replayer = Replayer(Registry([other]))
    [result] = await replayer.replay_many([order_history])
    assert (result.ok, result.outcome) == (False, "not_registered")
    assert isinstance(result.error, UnknownTaskError)
    assert "shop.order@1 is not registered" in result.summary()
    with pytest.raises(UnknownTaskError):
        await replayer.replay(order_history)


# -- runs in flight -------------------------------------------------------------------------------


@task("shop.approval", version=1)
async def approval_v1(ctx: TaskContext[str]) -> str:
    await ctx.step.run("fetch", fetch, ctx.input)
    approved: dict[str, str] = await ctx.step.wait_for_fact("approved")
    return approved["by"]


@task("shop.approval", version=1)
async def approval_now(ctx: TaskContext[str]) -> str:
    await ctx.step.run("fetch", never("fetch"), ctx.input)
    approved: dict[str, str] = await ctx.step.wait_for_fact(
        "approved", check=never_plain("check"), poll_interval=timedelta(seconds=1)
    )
    return approved["by"]


async def test_a_run_waiting_for_a_fact_goes_on_live_without_its_check() -> None:
    history = await record(approval_v1, "o-3", until=("waiting",))
    assert history.status == "waiting"
    assert [(s.name, s.status) for s in history.steps] == [
        ("fetch", "completed"),
        ("approved", "waiting"),
    ]
    result = await Replayer(Registry([approval_now])).replay(history)
    assert (result.outcome, result.next_call, result.steps_matched) == (
        "goes_on_live",
        "fact 'approved'",
        2,
    )


class Ops:
    store = MemoryStore()


@task("shop.payout", version=1, retry=RetryPolicy(max_attempts=3, initial=timedelta(hours=1)))
async def payout_v1(ctx: TaskContext[str]) -> str:
    async def pay() -> str:
        raise ConnectionError("bank down")

    return await ctx.step.run("pay", pay)


@task("shop.payout", version=1)
async def payout_now(ctx: TaskContext[str]) -> str:
    async def pay() -> str:
        async def act(info: AttemptInfo) -> str:
            CALLED.append("with_attempt_token")
            return "paid"

        return await with_attempt_token(Ops.store, "pay", act)

    return await ctx.step.run("pay", pay)


async def test_a_step_waiting_to_retry_goes_on_live_without_running() -> None:
    history = await record(payout_v1, "o-4", until=("pending",))
    assert [(s.name, s.status) for s in history.steps][:1] == [("pay", "retrying")]
    assert history.steps[0].error is not None
    assert history.steps[0].error.message == "bank down"
    result = await Replayer(Registry([payout_now])).replay(history)
    assert (result.outcome, result.next_call) == ("goes_on_live", "step 'pay'")


# -- failures recorded ----------------------------------------------------------------------------


@task("shop.doomed", version=1, retry=RetryPolicy.none())
async def doomed(ctx: TaskContext[str]) -> str:
    async def explode() -> str:
        raise ValueError("no stock")

    return await ctx.step.run("reserve", explode, retry=RetryPolicy.none())


@task("shop.doomed", version=1, retry=RetryPolicy.none())
async def doomed_now(ctx: TaskContext[str]) -> str:
    return await ctx.step.run("reserve", never("reserve"))


async def test_a_failed_run_replays_its_failure() -> None:
    history = await record(doomed, "o-5")
    assert history.status == "failed"
    assert history.error is not None
    assert history.steps[0].error is not None
    assert history.steps[0].error.type.endswith("ValueError")
    result = await Replayer(Registry([doomed_now])).replay(history)
    assert (result.outcome, result.steps_matched) == ("finished", 1)


@task("shop.report", version=1)
async def reporting(ctx: TaskContext[str]) -> int:
    await ctx.stream.write("progress", {"done": 0})
    found = await ctx.step.run("fetch", fetch, ctx.input)
    await ctx.stream.write("progress", {"done": 1})
    await ctx.step.sleep("cool-down", timedelta(hours=1))
    seq: int = await ctx.stream.write("progress", {"done": 2})
    return seq + found["amount"]


@task("shop.report", version=1)
async def reporting_now(ctx: TaskContext[str]) -> int:
    await ctx.stream.write("progress", {"done": 0})
    found = await ctx.step.run("fetch", never("fetch"), ctx.input)
    await ctx.stream.write("progress", {"done": 1})
    await ctx.step.sleep("cool-down", timedelta(hours=1))
    seq: int = await ctx.stream.write("progress", {"done": 2})
    return seq + found["amount"]


async def test_stream_writes_replay_without_being_stored() -> None:
    history = await record(reporting, "o-6")
    assert history.output == 3 + 12
    result = await Replayer(Registry([reporting_now])).replay(history)
    assert (result.ok, result.outcome, result.steps_matched) == (True, "finished", 2)


# -- export errors --------------------------------------------------------------------------------


async def test_export_of_an_unknown_run_says_so() -> None:
    engine = await connect("memory://", registry=Registry([order_v1]))
    try:
        with pytest.raises(RunNotFoundError):
            await engine.export_history(uuid.uuid4())
        with pytest.raises(ValueError, match="export_history"):
            await engine.export_history("not-a-uuid")  # type: ignore[arg-type]
    finally:
        await engine.close()
