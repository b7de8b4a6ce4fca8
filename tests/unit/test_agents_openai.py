"""`UmtRunner.run`: an OpenAI Agents SDK agent as a umt run, on the memory backend.

The model is a fake `agents.Model` scripted per turn (the SDK's `function_call` and
`assistant_message` build its output); tracing is off, so nothing leaves the process.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest
from agents import Agent, Model, ModelResponse, RunConfig, function_tool
from agents.testing import assistant_message, function_call
from agents.tracing import set_tracing_disabled
from agents.usage import Usage

from umt_backend_memory import MemoryStore
from umt_sdk import Engine, Registry, TaskContext, connect, task
from umt_sdk.agents import APPROVALS_STREAM, FencedTool, UmtRunner, current_attempt
from umt_sdk.testing import FakeClock, explore_crashes, simulate_crash

set_tracing_disabled(True)

LEASE = timedelta(seconds=5)
CALLS: Counter[str] = Counter()
PAUSE_AT: set[str] = set()
STORE = MemoryStore()
CHARGES: Counter[str] = Counter()
"""The outside system: card charges by order."""


class Gate:
    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self.opened = asyncio.Event()


GATE = Gate()


async def _maybe_pause(point: str) -> None:
    if point in PAUSE_AT and CALLS[point] == 1:
        gate = GATE
        gate.reached.set()
        await gate.opened.wait()


def _outputs(items: Any) -> list[str]:
    if isinstance(items, str):
        return []
    return [
        str(i["output"])
        for i in items
        if isinstance(i, dict)
        and i.get("type") == "function_call_output"
        and i.get("call_id") != "call-0"  # the handoff's own output
    ]


class ScriptModel(Model):
    """Turn 1 prices the order, turn 2 charges it, turn 3 answers with the receipt."""

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        outputs = _outputs(input)
        turn = len(outputs) + 1
        CALLS[f"model:{turn}"] += 1
        await _maybe_pause(f"model:{turn}")
        if turn == 1:
            item = function_call("price", {"order_id": "o-7"}, call_id="call-1")
        elif turn == 2:
            item = function_call(
                "charge", {"order_id": "o-7", "cents": int(outputs[0])}, call_id="call-2"
            )
        else:
            item = assistant_message(f"receipt: {outputs[-1]}")
        return ModelResponse(output=[item], usage=Usage(requests=1), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@function_tool
async def price(order_id: str) -> int:
    """The order's price in cents."""
    CALLS["tool:price"] += 1
    await _maybe_pause("tool:price")
    return 1250


async def _charge(order_id: str, cents: int) -> str:
    CALLS["tool:charge"] += 1
    attempt = current_attempt()
    if attempt is None or not attempt.resumed or not CHARGES[order_id]:
        CHARGES[order_id] += 1
    await _maybe_pause("tool:charge")
    return f"charged {cents} for {order_id}"


charge = function_tool(_charge, name_override="charge")
charge_approved = function_tool(_charge, name_override="charge", needs_approval=True)


def _agent(approval: bool = False) -> Agent[Any]:
    return Agent(
        name="cashier",
        instructions="Charge the order.",
        model=ScriptModel(),
        tools=[price, charge_approved if approval else charge],
    )


@task("agents.cashier", version=1)
async def cashier(ctx: TaskContext[str]) -> str:
    fenced = {"charge": FencedTool(op_key="charge:{order_id}", conn=STORE)}
    result = await UmtRunner.run(
        _agent(approval=ctx.input == "approval"),
        "Charge order o-7",
        fenced=fenced if ctx.input == "fenced" else None,
        run_config=RunConfig(tracing_disabled=True),
    )
    return str(result.final_output)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fresh() -> None:
    """The module's counters and switches, reset."""
    global GATE
    CALLS.clear()
    CHARGES.clear()
    PAUSE_AT.clear()
    GATE = Gate()


@pytest.fixture
async def engine(clock: FakeClock, fresh: None) -> AsyncIterator[Engine]:
    engine = await connect("memory://", registry=Registry([cashier]), clock=clock)
    yield engine
    GATE.opened.set()
    await engine.close()


def _worker(engine: Engine) -> Any:
    return engine.worker(lease=LEASE, poll_interval=timedelta(milliseconds=20))


async def _eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


ONCE = {"model:1": 1, "model:2": 1, "model:3": 1, "tool:price": 1, "tool:charge": 1}


async def test_a_multi_turn_run_makes_each_call_once_as_a_named_step(engine: Engine) -> None:
    handle = await engine.enqueue(cashier, "plain")
    async with _worker(engine):
        assert await handle.result(timeout=5) == "receipt: charged 1250 for o-7"
    assert Counter(ONCE) == CALLS
    info = await engine.get(handle.run_id)
    assert [s.name for s in info.timeline] == [
        "cashier/turn-1/model",
        "cashier/turn-1/tool/price/call-1",
        "cashier/turn-2/model",
        "cashier/turn-2/tool/charge/call-2",
        "cashier/turn-3/model",
    ]


async def _crash_at(engine: Engine, clock: FakeClock, point: str, which: str) -> str:
    PAUSE_AT.add(point)
    handle = await engine.enqueue(cashier, which)
    crashed = _worker(engine)
    await crashed.start()
    await asyncio.wait_for(GATE.reached.wait(), 5)
    simulate_crash(crashed)
    await crashed.stop()
    GATE.opened.set()
    clock.advance(LEASE * 2)
    async with _worker(engine):
        output: str = await handle.result(timeout=5)
    return output


@pytest.mark.parametrize("point", ["model:2", "tool:price", "tool:charge"])
async def test_a_crash_mid_call_repeats_only_the_call_in_flight(
    engine: Engine, clock: FakeClock, point: str
) -> None:
    assert await _crash_at(engine, clock, point, "plain") == "receipt: charged 1250 for o-7"
    assert Counter(ONCE) + Counter({point: 1}) == CALLS


async def test_a_fenced_tool_killed_after_its_effect_charges_once(
    engine: Engine, clock: FakeClock
) -> None:
    assert (
        await _crash_at(engine, clock, "tool:charge", "fenced") == "receipt: charged 1250 for o-7"
    )
    assert CALLS["tool:charge"] == 2
    assert Counter({"o-7": 1}) == CHARGES


async def test_an_approval_waits_two_virtual_days(engine: Engine, clock: FakeClock) -> None:
    handle = await engine.enqueue(cashier, "approval")
    fact = "cashier/approval/call-2"
    start = clock.now()
    async with _worker(engine) as worker:
        await _eventually(lambda: CALLS["model:2"] == 1 and not worker.running_runs)
        info = await engine.get(handle.run_id)
        assert (info.status, info.waiting_for) == ("waiting", fact)
        announced = await engine.stream_last(handle.run_id, APPROVALS_STREAM)
        assert announced is not None
        assert announced.value["args"] == {"order_id": "o-7", "cents": 1250}
        clock.advance(timedelta(days=2))
        assert CALLS["tool:charge"] == 0
        await engine.signal(handle.run_id, fact, {"approved": True})
        assert await handle.result(timeout=5) == "receipt: charged 1250 for o-7"
    assert clock.now() - start >= timedelta(days=2)
    assert Counter(ONCE) == CALLS


@pytest.mark.parametrize("which", ["fenced", "approval"])
async def test_the_crash_explorer_finds_every_crash_of_an_agent_run_harmless(
    fresh: None, which: str
) -> None:
    report = await explore_crashes(cashier, which, facts={"cashier/approval/call-2": True})
    assert report.ok, report.explain()
    assert len(report.points) >= 10, report.explain()


async def test_a_rejected_approval_skips_the_tool(engine: Engine) -> None:
    handle = await engine.enqueue(cashier, "approval")
    await engine.signal(
        handle.run_id, "cashier/approval/call-2", {"approved": False, "message": "no"}
    )
    async with _worker(engine):
        output = await handle.result(timeout=5)
    assert CALLS["tool:charge"] == 0
    assert output == "receipt: no", "the model is told the rejection's message"


class TriageModel(Model):
    """Hands the conversation off to the cashier."""

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        CALLS["model:triage"] += 1
        item = function_call("transfer_to_cashier", {}, call_id="call-0")
        return ModelResponse(output=[item], usage=Usage(requests=1), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@task("agents.triage", version=1)
async def triage(ctx: TaskContext[str]) -> str:
    cashier_agent = _agent()
    triage_agent = Agent(name="triage", model=TriageModel(), handoffs=[cashier_agent])
    result = await UmtRunner.run(
        triage_agent, "Charge order o-7", run_config=RunConfig(tracing_disabled=True)
    )
    return f"{result.last_agent.name}: {result.final_output}"


async def test_a_handoff_makes_the_next_agents_calls_steps_too(clock: FakeClock) -> None:
    CALLS.clear()
    engine = await connect("memory://", registry=Registry([triage]), clock=clock)
    handle = await engine.enqueue(triage, "x")
    async with _worker(engine):
        assert await handle.result(timeout=5) == "cashier: receipt: charged 1250 for o-7"
    info = await engine.get(handle.run_id)
    await engine.close()
    assert [s.name for s in info.timeline] == [
        "triage/turn-1/model",
        "triage/turn-2/model",
        "triage/turn-2/tool/price/call-1",
        "triage/turn-3/model",
        "triage/turn-3/tool/charge/call-2",
        "triage/turn-4/model",
    ]
    assert Counter({"model:triage": 1, **ONCE}) == CALLS
