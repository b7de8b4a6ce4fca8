"""`UmtAgent`: a Pydantic AI agent as a umt run, on the memory backend and its FakeClock.

The model is Pydantic AI's own `FunctionModel`, scripted per turn; nothing leaves the process.
Each model request and tool call is counted where it really runs, so a test can tell a replay
(no count) from a call made again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest
from pydantic_ai import Agent, DeferredToolRequests, RunContext
from pydantic_ai.exceptions import ApprovalRequired, CallDeferred
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from umt_backend_memory import MemoryBackend, MemoryStore
from umt_sdk import Engine, Registry, TaskContext, connect, task
from umt_sdk.agents import APPROVALS_STREAM, FencedTool, UmtAgent, current_attempt
from umt_sdk.exceptions import NotInTaskError, UsageError
from umt_sdk.testing import FakeClock, explore_crashes, freeze_heartbeats, simulate_crash

LEASE = timedelta(seconds=5)
CALLS: Counter[str] = Counter()
"""Every real model request (`model:<turn>`) and tool call (`tool:<name>`)."""
PAUSE_AT: set[str] = set()
"""Points (as counted in CALLS) whose first call blocks until GATE is set: a crash there."""


class Gate:
    """A pause in a call: `reached` once it is there, and it goes on once `opened`."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self.opened = asyncio.Event()


GATE = Gate()
STORE = MemoryStore()
"""The business database the fenced tool's ledger lives in."""
BOOKINGS: Counter[str] = Counter()
"""The outside system the `book` tool has an effect on."""


PASSES: Counter[str] = Counter()


async def _maybe_pause(point: str) -> None:
    PASSES[point] += 1
    if point in PAUSE_AT and PASSES[point] == 1:
        gate = GATE
        gate.reached.set()
        await gate.opened.wait()


def _turn(messages: list[ModelMessage]) -> int:
    return 1 + sum(isinstance(m, ModelResponse) for m in messages)


def _last_return(messages: list[ModelMessage]) -> Any:
    returns = [
        p for m in messages for p in getattr(m, "parts", []) if isinstance(p, ToolReturnPart)
    ]
    return returns[-1].content if returns else None


CITY = ["Paris"]
"""What the model asks for in turn 1: a test changes it between a crash and the resume."""


async def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Turn 1 looks the city up, turn 2 books it, turn 3 answers with the booking."""
    turn = _turn(messages)
    CALLS[f"model:{turn}"] += 1
    await _maybe_pause(f"model:{turn}")
    if turn == 1:
        return ModelResponse(parts=[ToolCallPart("lookup", {"city": CITY[0]}, "call-1")])
    if turn == 2:
        hotel = _last_return(messages)
        return ModelResponse(parts=[ToolCallPart("book", {"hotel": hotel, "nights": 2}, "call-2")])
    return ModelResponse(parts=[TextPart(f"booked: {_last_return(messages)}")])


class HotelSystem:
    """An outside system that takes a fencing token and an idempotency key with each booking:
    a key books once, and a token older than one it has seen for the key is refused."""

    def __init__(self) -> None:
        self.booked: Counter[str] = Counter()
        self.newest: dict[str, int] = {}
        self.refused: list[int] = []

    def book(self, key: str, token: int) -> None:
        if token < self.newest.get(key, 0):
            self.refused.append(token)
            raise RuntimeError(f"stale token {token} for {key}")
        self.newest[key] = token
        if not self.booked[key]:
            self.booked[key] += 1


HOTEL = HotelSystem()
COMMITS: list[Any] = []
"""What the fenced tool's commit callback wrote, once per commit that ran."""


def record_commit(tx: Any, result: Any) -> None:
    COMMITS.append(result)
    tx.put("receipts", "book", result)


def make_agent(
    *, approval: bool = False, zombie_proof: bool = False
) -> Agent[None, str | DeferredToolRequests]:
    agent: Agent[None, str | DeferredToolRequests] = Agent(
        FunctionModel(script), output_type=[str, DeferredToolRequests], name="travel"
    )

    @agent.tool_plain
    async def lookup(city: str) -> str:
        CALLS["tool:lookup"] += 1
        await _maybe_pause("tool:lookup")
        return f"hotel-{city.lower()}"

    @agent.tool_plain(requires_approval=approval)
    async def book(hotel: str, nights: int) -> dict[str, Any]:
        CALLS["tool:book"] += 1
        await _maybe_pause("tool:book:start")
        attempt = current_attempt()
        if attempt is not None and zombie_proof:  # the processor takes the attempt's token
            HOTEL.book(attempt.op_key, attempt.attempt_token)
            return {"hotel": hotel, "nights": nights}
        if attempt is not None and attempt.resumed:
            CALLS["tool:book:resumed"] += 1
        if attempt is None or not attempt.resumed or not BOOKINGS[hotel]:
            BOOKINGS[hotel] += 1  # the outside effect; a resumed attempt looks it up first
        await _maybe_pause("tool:book")
        return {"hotel": hotel, "nights": nights}

    return agent


PLAIN = UmtAgent(make_agent())
APPROVED = UmtAgent(make_agent(approval=True), name="travel-approved")
FENCED = UmtAgent(
    make_agent(),
    name="travel-fenced",
    fenced={"book": FencedTool(op_key="book:{hotel}", conn=STORE)},
)


ZOMBIE_PROOF = UmtAgent(
    make_agent(zombie_proof=True),
    name="travel-zombie",
    fenced={"book": FencedTool(op_key="book:{hotel}", conn=STORE, commit=record_commit)},
)


@task("agents.travel", version=1)
async def travel(ctx: TaskContext[str]) -> str:
    agents = {"plain": PLAIN, "approved": APPROVED, "fenced": FENCED, "zombie": ZOMBIE_PROOF}
    agent = agents[ctx.input]
    result = await agent.run("Book two nights in Paris")
    assert isinstance(result.output, str)
    return result.output


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fresh() -> None:
    """The module's counters and switches, reset."""
    CALLS.clear()
    PASSES.clear()
    PAUSE_AT.clear()
    global GATE, HOTEL
    GATE = Gate()
    BOOKINGS.clear()
    CITY[:] = ["Paris"]
    HOTEL = HotelSystem()
    COMMITS.clear()


@pytest.fixture
async def engine(clock: FakeClock, fresh: None) -> AsyncIterator[Engine]:
    engine = await connect("memory://", registry=Registry([travel]), clock=clock)
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


async def test_a_multi_turn_run_makes_each_call_once_as_a_named_step(engine: Engine) -> None:
    handle = await engine.enqueue(travel, "plain")
    async with _worker(engine):
        assert await handle.result(timeout=5) == "booked: {'hotel': 'hotel-paris', 'nights': 2}"
    assert (
        Counter({"model:1": 1, "model:2": 1, "model:3": 1, "tool:lookup": 1, "tool:book": 1})
        == CALLS
    )
    info = await engine.get(handle.run_id)
    assert [s.name for s in info.timeline] == [
        "travel/turn-1/model",
        "travel/turn-1/tool/lookup/call-1",
        "travel/turn-2/model",
        "travel/turn-2/tool/book/call-2",
        "travel/turn-3/model",
    ]


async def _crash_at(
    engine: Engine,
    clock: FakeClock,
    point: str,
    which: str = "plain",
    before_resume: Callable[[], None] = lambda: None,
    *,
    open_at_once: bool = False,
) -> str:
    """`open_at_once`: the killed call goes on before the crash's cancellation reaches it."""
    PAUSE_AT.add(point)
    handle = await engine.enqueue(travel, which)
    crashed = _worker(engine)
    await crashed.start()
    await asyncio.wait_for(GATE.reached.wait(), 5)
    simulate_crash(crashed)
    if open_at_once:
        GATE.opened.set()
    await crashed.stop()
    GATE.opened.set()  # the killed call goes on in the void; nothing it writes lands
    before_resume()
    clock.advance(LEASE * 2)
    async with _worker(engine):
        output: str = await handle.result(timeout=5)
    info = await engine.get(handle.run_id)
    assert [e.outcome for e in info.executions] == ["interrupted", "completed"]
    return output


async def test_a_crash_inside_a_tool_call_resumes_without_repeating_completed_calls(
    engine: Engine, clock: FakeClock
) -> None:
    output = await _crash_at(engine, clock, "tool:book")
    assert output.startswith("booked: ")
    # The tool call in flight runs again (at least once); every completed call ran once.
    assert Counter({"hotel-paris": 2}) == BOOKINGS, "unfenced, the effect in flight is repeated"
    assert (
        Counter({"model:1": 1, "model:2": 1, "model:3": 1, "tool:lookup": 1, "tool:book": 2})
        == CALLS
    )


async def test_a_crash_inside_a_model_request_resumes_without_repeating_completed_calls(
    engine: Engine, clock: FakeClock
) -> None:
    output = await _crash_at(engine, clock, "model:2")
    assert output.startswith("booked: ")
    assert (
        Counter({"model:1": 1, "model:2": 2, "model:3": 1, "tool:lookup": 1, "tool:book": 1})
        == CALLS
    )


async def test_a_model_changed_between_crash_and_resume_keeps_the_recorded_turns(
    engine: Engine, clock: FakeClock
) -> None:
    # The documented tolerance: replay is by step name, so the turn recorded before the crash
    # is returned as recorded although the model would now answer otherwise.
    output = await _crash_at(
        engine, clock, "model:2", before_resume=lambda: CITY.__setitem__(0, "Rome")
    )
    assert output == "booked: {'hotel': 'hotel-paris', 'nights': 2}"
    assert CALLS["model:1"] == 1


async def test_a_fenced_tool_killed_after_its_effect_does_it_once(
    engine: Engine, clock: FakeClock
) -> None:
    output = await _crash_at(engine, clock, "tool:book", which="fenced")
    assert output.startswith("booked: ")
    assert CALLS["tool:book"] == 2
    assert CALLS["tool:book:resumed"] == 1, "the second attempt is told an earlier one began"
    assert Counter({"hotel-paris": 1}) == BOOKINGS, "the effect happened once"
    backend = engine.backend
    assert isinstance(backend, MemoryBackend)
    assert list(backend.ledger_entries()) == ["book:hotel-paris"]


async def test_a_fenced_tool_call_that_goes_on_after_its_crash_commits_nothing(
    engine: Engine, clock: FakeClock
) -> None:
    # The call is let go before the crash's cancellation reaches it: it returns and reaches
    # the ledger's commit, which a crashed attempt may not make (a killed process could not),
    # so the resumed attempt is told an earlier one began, and does not book twice.
    output = await _crash_at(engine, clock, "tool:book", which="fenced", open_at_once=True)
    assert output.startswith("booked: ")
    assert CALLS["tool:book"] == 2, "the resumed attempt calls the tool: nothing was committed"
    assert CALLS["tool:book:resumed"] == 1
    assert Counter({"hotel-paris": 1}) == BOOKINGS


async def test_a_zombie_attempt_of_a_fenced_tool_neither_books_nor_commits_again(
    engine: Engine, clock: FakeClock
) -> None:
    """Worker A's heartbeats stop while it is inside the fenced tool (begun, before its
    effect); B takes the run over and books; then A goes on: the hotel refuses A's older token
    and the ledger refuses A's commit, so there is one booking and one commit."""
    PAUSE_AT.add("tool:book:start")
    handle = await engine.enqueue(travel, "zombie")
    zombie = _worker(engine)
    await zombie.start()
    await asyncio.wait_for(GATE.reached.wait(), 5)
    freeze_heartbeats(zombie)
    clock.advance(LEASE * 2)
    async with _worker(engine):
        output = await handle.result(timeout=5)
    assert output == "booked: {'hotel': 'hotel-paris', 'nights': 2}"
    GATE.opened.set()  # the zombie wakes up inside the tool
    await _eventually(lambda: not zombie.running_runs)
    await zombie.stop()
    assert Counter({"book:hotel-paris": 1}) == HOTEL.booked
    assert HOTEL.refused == [HOTEL.newest["book:hotel-paris"] - 1], "the zombie's token"
    assert COMMITS == [{"hotel": "hotel-paris", "nights": 2}], "committed once"
    info = await engine.get(handle.run_id)
    assert info.status == "completed"
    assert CALLS["tool:book"] == 2


async def test_an_approval_waits_two_virtual_days_without_a_worker_slot(
    engine: Engine, clock: FakeClock
) -> None:
    handle = await engine.enqueue(travel, "approved")
    fact = "travel-approved/approval/call-2"
    start = clock.now()
    async with _worker(engine) as worker:
        await _eventually(lambda: CALLS["model:2"] == 1 and not worker.running_runs)
        info = await engine.get(handle.run_id)
        assert (info.status, info.waiting_for) == ("waiting", fact)
        announced = await engine.stream_last(handle.run_id, APPROVALS_STREAM)
        assert announced is not None
        assert announced.value == {
            "fact": fact,
            "kind": "approval",
            "tool": "book",
            "tool_call_id": "call-2",
            "args": {"hotel": "hotel-paris", "nights": 2},
        }
        clock.advance(timedelta(days=2))
        assert (await engine.get(handle.run_id)).status == "waiting"
        assert CALLS["tool:book"] == 0
        await engine.signal(handle.run_id, fact, True)
        assert await handle.result(timeout=5) == "booked: {'hotel': 'hotel-paris', 'nights': 2}"
    assert clock.now() - start >= timedelta(days=2)
    # The resumed execution replayed turns 1 and 2 from their records.
    assert (
        Counter({"model:1": 1, "model:2": 1, "model:3": 1, "tool:lookup": 1, "tool:book": 1})
        == CALLS
    )


async def test_a_denied_approval_tells_the_model_and_skips_the_tool(
    engine: Engine, clock: FakeClock
) -> None:
    handle = await engine.enqueue(travel, "approved")
    await engine.signal(
        handle.run_id, "travel-approved/approval/call-2", {"approved": False, "message": "too dear"}
    )
    async with _worker(engine):
        assert await handle.result(timeout=5) == "booked: too dear"
    assert CALLS["tool:book"] == 0


def _new_outside_systems() -> HotelSystem:
    """Each explored run starts on a fresh memory engine, whose tokens start again at 1."""
    global HOTEL
    HOTEL = HotelSystem()
    BOOKINGS.clear()
    return HOTEL


@pytest.mark.parametrize("which", ["fenced", "zombie", "approved"])
async def test_the_crash_explorer_finds_every_crash_of_an_agent_run_harmless(
    fresh: None, which: str
) -> None:
    """A crash at every point an agent run passes (before and after each model and tool step,
    the fenced operation's begin and finish, the approval's park): each run ends as the
    crash-free one, no recorded step runs again, the fenced commit happens once."""
    facts = {"travel-approved/approval/call-2": True}
    report = await explore_crashes(travel, which, facts=facts, setup=_new_outside_systems)
    assert report.ok, report.explain()
    assert len(report.points) >= 10, report.explain()


async def test_run_outside_a_task_says_where_to_call_it() -> None:
    with pytest.raises(NotInTaskError, match="async @task handler"):
        await PLAIN.run("hello")


def test_a_fenced_tool_needs_an_op_key() -> None:
    with pytest.raises(UsageError, match="op_key"):
        FencedTool(op_key="", conn=STORE)
    with pytest.raises(UsageError, match="FencedTool"):
        UmtAgent(make_agent(), fenced={"book": "book:{hotel}"})  # type: ignore[dict-item]  # under test


def asking_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    if len(messages) == 1:
        calls = [
            ToolCallPart("pay", {"cents": 5}, "c1"),
            ToolCallPart("ask", {"q": "color?"}, "c2"),
        ]
        return ModelResponse(parts=calls)
    return ModelResponse(parts=[TextPart(f"done: {_returns(messages)}")])


def _returns(messages: list[ModelMessage]) -> list[Any]:
    return [p.content for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]


asking: Agent[None, str | DeferredToolRequests] = Agent(
    FunctionModel(asking_model), output_type=[str, DeferredToolRequests]
)


@asking.tool
async def pay(ctx: RunContext[None], cents: int) -> str:
    CALLS["tool:pay"] += 1
    if not ctx.tool_call_approved:
        raise ApprovalRequired({"why": "a payment"})
    return f"paid {cents}"


@asking.tool_plain
async def ask(q: str) -> str:
    CALLS["tool:ask"] += 1
    raise CallDeferred({"q": q})


ASKING = UmtAgent(asking, name="asking")


@task("agents.asking", version=1)
async def asking_task(ctx: TaskContext[str]) -> str:
    return str((await ASKING.run(ctx.input)).output)


async def test_tools_that_raise_approval_required_or_call_deferred_wait_for_their_facts(
    fresh: None,
) -> None:
    engine = await connect(
        "memory://", registry=Registry([asking_task]), clock=FakeClock(auto_advance=True)
    )
    handle = await engine.enqueue(asking_task, "go")
    await engine.signal(handle.run_id, "asking/approval/c1", True)  # facts may come first
    await engine.signal(handle.run_id, "asking/result/c2", "blue")
    async with _worker(engine):
        assert await handle.result(timeout=5) == "done: ['paid 5', 'blue']"
    info = await engine.get(handle.run_id)
    await engine.close()
    assert [s.name for s in info.timeline] == [
        "asking/turn-1/model",
        "asking/turn-1/tool/pay/c1",  # raised ApprovalRequired: recorded, raised on replay
        "asking/turn-1/tool/ask/c2",  # raised CallDeferred
        "asking/approval/c1",
        "asking/result/c2",
        "asking/turn-1/tool/pay/c1#2",  # approved: the call made again, as a step of its own
        "asking/turn-2/model",
    ]
    assert Counter({"tool:pay": 2, "tool:ask": 1}) == CALLS
