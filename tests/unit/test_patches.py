"""Patches on the memory backend, to the unit: the decision rule (`went_past`), the replayer
passing over a marker the code no longer asks for, `PatchCheck` misuse, and the drift check
of recorded step outputs."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any
from uuid import uuid4

import attrs
import pytest

from umt_sdk import Registry, RunHistory, TaskContext, UsageError, connect, task
from umt_sdk._history import History
from umt_sdk._patches import PatchCheck, went_past
from umt_sdk._spi import StepRecord
from umt_sdk.testing import FakeClock, Replayer, check_deploy
from umt_sdk.testing._replay import _drift


def _record(name: str) -> StepRecord:
    return StepRecord(name=name, kind="step", status="completed", fencing_token=1)


def test_a_run_is_past_the_point_when_it_holds_a_record_not_replayed_yet() -> None:
    history = History(uuid4(), [_record("a"), _record("b"), _record("b#2")])
    assert went_past(history)
    history.occurrence("a")
    history.occurrence("b")
    assert went_past(history), "b#2 is still ahead"
    history.occurrence("b")
    assert not went_past(history)


def test_compensation_bookkeeping_counts_only_where_its_step_stands() -> None:
    records = [_record("a"), _record("umt.compensation:a"), _record("umt.compensating")]
    history = History(uuid4(), [*records, _record("umt.compensate:a")])
    assert went_past(history)
    history.occurrence("a")
    assert not went_past(history), "the plan and the compensations come after the handler"
    crashed_in_body = History(uuid4(), [_record("umt.compensation:b")])
    assert went_past(crashed_in_body), "its step began: the run was past an earlier point"


def test_a_patch_check_must_be_awaited() -> None:
    async def decide() -> bool:  # pragma: no cover - never awaited here
        return True

    check = PatchCheck("p", decide)
    with pytest.raises(UsageError, match=r"if await ctx.patched\('p'\):") as caught:
        bool(check)
    assert caught.value.argument == "patch_id"
    assert repr(check) == "<PatchCheck 'p' (await it)>"


@task("unit.patch", version=1)
async def patched_release(ctx: TaskContext[str]) -> str:
    await ctx.step.run("a", lambda: 1)
    if await ctx.patched("p"):
        await ctx.step.run("new", lambda: 2)
    await ctx.step.run("b", lambda: 3)
    return "done"


@task("unit.patch", version=1)
async def patch_removed(ctx: TaskContext[str]) -> str:
    """The release after the deprecation's: the marker stands for no code any more."""
    await ctx.step.run("a", lambda: 1, output_type=int)
    await ctx.step.run("new", lambda: 2, output_type=int)
    await ctx.step.run("b", lambda: 3, output_type=int)
    return "done"


@task("unit.patch", version=1)
async def bad_patch_id(ctx: TaskContext[str]) -> str:
    await ctx.patched("no spaces")
    return "never"


async def _history(definition: Any) -> RunHistory:
    engine = await connect(
        "memory://", registry=Registry([definition]), clock=FakeClock(auto_advance=True)
    )
    handle = await engine.enqueue(definition, "x")
    async with engine.worker():
        await handle.result(timeout=5)
    history = await engine.export_history(handle.run_id)
    await engine.close()
    return history


def test_a_marker_the_code_no_longer_asks_for_is_passed_over() -> None:
    history = asyncio.run(_history(patched_release))
    assert [s.name for s in history.steps] == ["a", "umt.patch:p", "new", "b"]
    for registry in (Registry([patched_release]), Registry([patch_removed])):
        result = asyncio.run(Replayer(registry).replay(history))
        assert (result.outcome, result.ok) == ("finished", True)
    assert asyncio.run(Replayer(Registry([patched_release])).replay(history)).patches == {"p": True}


def test_a_patch_id_must_be_a_name() -> None:
    engine_history = asyncio.run(_bad_run())
    assert engine_history.error is not None
    assert engine_history.error.type.endswith("UsageError")
    assert "patch name must be 1-200 characters" in engine_history.error.message
    assert engine_history.steps == ()


async def _bad_run() -> RunHistory:
    engine = await connect(
        "memory://", registry=Registry([bad_patch_id]), clock=FakeClock(auto_advance=True)
    )
    handle = await engine.enqueue(bad_patch_id, "x")
    async with engine.worker():
        with pytest.raises(Exception, match="UsageError"):
            await handle.result(timeout=5)
    history = await engine.export_history(handle.run_id)
    await engine.close()
    return history


@attrs.frozen
class Quote:
    amount: int
    currency: str = "EUR"


@pytest.mark.parametrize(
    ("recorded", "output_type", "problem"),
    [
        ({"amount": 30}, Quote, None),  # a new field with a default: fine
        ([2, 1], set[int], None),  # a set's items in another order: fine
        (30, float, None),
        ({"amount": 30.5}, Quote, "no longer decodes into Quote: "),
        ({"amount": 1, "tip": 2}, Quote, "no longer decodes into Quote: "),
        (1.5, Decimal, 'decodes into Decimal as another value: the value 1.5 becomes "1.5"'),
        (
            {"at": "2030-01-01T00:00:00Z"},
            dict[str, datetime],
            'as another value: at "2030-01-01T00:00:00Z" becomes',
        ),
    ],
)
def test_drift_of_a_recorded_output(recorded: Any, output_type: Any, problem: str | None) -> None:
    found = _drift("s", recorded, output_type)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found.problem
        assert found.describe().startswith("step 's': the recorded ")


def test_check_deploy_reports_drift_and_counts_pairs() -> None:
    history = asyncio.run(_history(patch_removed))
    changed = attrs.evolve(
        history,
        steps=tuple(attrs.evolve(s, output="one") if s.name == "a" else s for s in history.steps),
        status="running",
        finished_at=None,
        created_at=datetime(2030, 1, 1, tzinfo=UTC),
    )
    report = asyncio.run(check_deploy(Registry([patch_removed]), [history, changed]))
    assert report.pairs() == {"unit.patch@1": 2}
    assert [r.run_id for r in report.failures] == [changed.run_id]
    assert "type drift in step 'a': the recorded \"one\" no longer decodes into int" in (
        report.failures[0].summary()
    )
    assert report.summary() == "checked 2 run(s) of unit.patch@1 (2): 1 would break on this code"
