"""Outcomes an operator settles, in one process: the telemetry of a park and of a settlement
(the rows of docs/operations.md), the output types `settle` checks by reference, and what a
run in `needs_attention` reads as."""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Annotated, Any, Literal, Optional

import attrs
import pytest
from opentelemetry.trace import StatusCode

from tests.unit.test_telemetry_truth import Otel, attrs_of, events, until
from umt_sdk import Registry, TaskContext, connect, connect_sync, task
from umt_sdk._attention import resolve_type, type_ref
from umt_sdk.exceptions import UsageError
from umt_sdk.testing import FakeClock, Replayer

CALLS: Counter[str] = Counter()


@attrs.frozen
class Quote:
    amount: int
    currency: str


class Colour(enum.Enum):
    RED = "red"


@pytest.mark.parametrize(
    "tp",
    [
        int,
        str,
        Any,
        None,
        Quote,
        Colour,
        dt.datetime,
        uuid.UUID,
        list[Quote],
        dict[str, list[int]],
        tuple[int, ...],
        tuple[int, str],
        Sequence[Quote],
        int | None,
        Optional[Quote],  # noqa: UP045  # the typing form is a case of its own
        Literal["a", 1, None],
        Quote | list[Quote] | None,
    ],
)
def test_an_output_type_resolves_from_its_reference(tp: Any) -> None:
    ref = type_ref(tp)
    assert ref is not None
    assert resolve_type(ref) == (type(None) if tp is None else tp)


def test_a_type_without_a_reference_is_checked_as_json_only() -> None:
    class Local:
        pass

    assert type_ref(Local) is None
    assert type_ref(list[Local]) is None
    assert type_ref(Annotated[int, "meta"]) == type_ref(int)


def test_a_reference_that_does_not_import_is_a_lookup_error() -> None:
    with pytest.raises(LookupError, match=r"no_such_module\.Thing"):
        resolve_type("no_such_module:Thing")
    with pytest.raises(LookupError):
        resolve_type(f"{__name__}:Missing")


@task("tel.attention", version=1)
async def uncertain(ctx: TaskContext[str]) -> int:
    async def charge() -> int:
        CALLS[ctx.input] += 1
        if CALLS[ctx.input] == 1:
            raise TimeoutError("no answer")
        return 2

    value: int = await ctx.step.run("charge", charge, uncertain_on=(TimeoutError,))
    return value


@pytest.mark.parametrize("done", [True, False])
async def test_a_park_and_its_settlement_in_the_trace_and_the_metrics(done: bool) -> None:
    CALLS.clear()
    otel = Otel()
    engine = await otel.engine(uncertain, clock=FakeClock(auto_advance=True))
    handle = await engine.enqueue(uncertain, "k")
    async with engine.worker():
        info = await until(engine, handle.run_id, lambda i: i.needs_attention is not None)
        assert (info.needs_attention, info.display_status) == ("charge", "needs_attention")
        await engine.settle(
            handle.run_id, step="charge", done=done, output=7 if done else None, by="carol"
        )
        assert await handle.result(timeout=10) == (7 if done else 2)
    await engine.close()

    first, second = otel.spans("umt.run tel.attention")
    # The park: the step's span ends `needs_attention`, an error of the user's code.
    failed = otel.spans("umt.step charge")[0]
    assert attrs_of(failed)["umt.step.outcome"] == "needs_attention"
    assert failed.status.status_code == StatusCode.ERROR
    (parked,) = events(first, "umt.step.needs_attention")
    assert (parked["umt.step.name"], parked["umt.step.attempt"]) == ("charge", 1)
    assert str(parked["exception.type"]).endswith("TimeoutError")
    assert parked["exception.message"] == "no answer"
    assert attrs_of(first)["umt.outcome"] == "parked"
    assert otel.total("umt.runs.needs_attention", umt__task__name="tel.attention") == 1
    # The settle call.
    (settle,) = otel.spans("umt.settle charge")
    assert attrs_of(settle)["umt.settled.as"] == ("done" if done else "not-done")
    assert attrs_of(settle)["umt.settled.by"] == "carol"
    assert attrs_of(settle)["umt.run.id"] == str(handle.run_id)
    # The execution that applied it.
    (settled,) = events(second, "umt.step.settled")
    assert settled["umt.step.name"] == "charge"
    assert settled["umt.settled.as"] == ("done" if done else "not-done")
    assert settled["umt.settled.by"] == "carol"
    assert len(otel.spans("umt.step charge")) == (1 if done else 2)
    assert CALLS["k"] == (1 if done else 2)


@task("tel.attention_then", version=1)
async def uncertain_then(ctx: TaskContext[str]) -> str:
    async def charge() -> int:
        CALLS[ctx.input] += 1
        if CALLS[ctx.input] == 1:
            raise TimeoutError("no answer")
        return 2

    value: int = await ctx.step.run("charge", charge, uncertain_on=(TimeoutError,))
    mailed: str = await ctx.step.run("mail", lambda: f"mailed {value}")
    return mailed


@pytest.mark.parametrize("done", [True, False])
async def test_a_settled_history_replays_on_the_same_code(done: bool) -> None:
    CALLS.clear()
    engine = await connect(
        "memory://", registry=Registry([uncertain_then]), clock=FakeClock(auto_advance=True)
    )
    handle = await engine.enqueue(uncertain_then, "r")
    async with engine.worker():
        parked = await until(engine, handle.run_id, lambda i: i.needs_attention is not None)
        in_flight = await engine.export_history(handle.run_id)
        await engine.settle(parked.run_id, step="charge", done=done, output=5 if done else None)
        assert await handle.result(timeout=10) == ("mailed 5" if done else "mailed 2")
    history = await engine.export_history(handle.run_id)
    await engine.close()
    replayer = Replayer(Registry([uncertain_then]))
    for recorded in (in_flight, history):
        result = await replayer.replay(recorded)
        assert result.ok, result.summary()
    assert CALLS["r"] == (1 if done else 2), "a replay runs no step body"


def test_a_plain_caller_settles_through_the_sync_facade() -> None:
    CALLS.clear()
    facade = connect_sync("memory://", registry=Registry([uncertain]))
    try:
        worker = facade.engine.worker(poll_interval=timedelta(milliseconds=50))
        asyncio.run_coroutine_threadsafe(worker.start(), facade._loop).result(timeout=5)
        run_id = facade.enqueue(uncertain, "s")
        for _ in range(500):
            if facade.get(run_id).needs_attention is not None:
                break
            time.sleep(0.01)
        assert facade.get(run_id).needs_attention == "charge"
        with pytest.raises(UsageError, match="not 'nope'"):
            facade.settle(run_id, step="nope", done=False)
        settlement = facade.settle(run_id, step="charge", done=True, output=9, by="erin")
        assert (settlement.done, settlement.by, settlement.output_json) == (True, "erin", "9")
        assert facade.result(run_id, timeout=5) == 9
    finally:
        facade.close()
    assert CALLS["s"] == 1
