"""A Pydantic AI agent as a durable umt run: a crash, a two-day approval, a fenced refund.

Run it: `python examples/agents/pydantic_ai_refund.py` (needs `umt-tasks[pydantic-ai]`; no
network and no API key: the model is Pydantic AI's offline `FunctionModel`, scripted).

The story: a support agent looks an order up (a tool), asks to refund it (a tool that needs a
human's approval), and answers the customer. The first worker crashes while the order is
being looked up; the second takes the run over after its lease without asking the model
again for the turn it already answered. The refund then waits two (virtual) days for an
operator's approval, holding no worker slot, and is paid through `with_attempt_token` (a
`FencedTool`): once, whatever crashes.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta

from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from umt_backend_memory import MemoryStore
from umt_sdk import Registry, TaskContext, connect, task
from umt_sdk.agents import APPROVALS_STREAM, FencedTool, UmtAgent, current_attempt
from umt_sdk.testing import FakeClock, simulate_crash

CALLS: Counter[str] = Counter()
LOOKUP_STARTED = asyncio.Event()
LOOKUP_GOES_ON = asyncio.Event()
PAYMENTS = MemoryStore()  # the business database the refund's ledger lives in
REFUNDS: Counter[str] = Counter()  # the payment provider


async def support_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """What an LLM would answer, turn by turn."""
    turn = 1 + sum(isinstance(m, ModelResponse) for m in messages)
    CALLS[f"model turn {turn}"] += 1
    results = [p.content for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
    if turn == 1:
        return ModelResponse(parts=[ToolCallPart("find_order", {"order_id": "A-17"}, "call-1")])
    if turn == 2:
        args = {"order_id": "A-17", "cents": results[0]["cents"]}
        return ModelResponse(parts=[ToolCallPart("refund", args, "call-2")])
    return ModelResponse(parts=[TextPart(f"Done: {results[-1]}. Sorry for the trouble!")])


support: Agent[None, str | DeferredToolRequests] = Agent(
    FunctionModel(support_model),
    name="support",
    instructions="Refund broken orders.",
    output_type=[str, DeferredToolRequests],
)


@support.tool_plain
async def find_order(order_id: str) -> dict[str, int | str]:
    """Look an order up."""
    CALLS["find_order"] += 1
    LOOKUP_STARTED.set()
    await LOOKUP_GOES_ON.wait()
    return {"order_id": order_id, "cents": 4999}


@support.tool_plain(requires_approval=True)
async def refund(order_id: str, cents: int) -> str:
    """Refund an order (a human approves it first)."""
    CALLS["refund"] += 1
    attempt = current_attempt()  # set by the FencedTool
    assert attempt is not None
    if not (attempt.resumed and REFUNDS[order_id]):  # resumed: look the refund up first
        REFUNDS[order_id] += 1
    return f"refunded {cents / 100:.2f} EUR on {order_id}"


durable_support = UmtAgent(
    support, fenced={"refund": FencedTool(op_key="refund:{order_id}", conn=PAYMENTS)}
)


@task("support_ticket", version=1)
async def support_ticket(ctx: TaskContext[str]) -> str:
    result = await durable_support.run(ctx.input)
    return str(result.output)


async def main() -> None:
    clock = FakeClock()
    engine = await connect("memory://", registry=Registry([support_ticket]), clock=clock)
    run = await engine.enqueue(support_ticket, "My order A-17 arrived broken.")
    lease = timedelta(seconds=10)

    first = engine.worker(lease=lease)
    await first.start()
    await LOOKUP_STARTED.wait()
    print("worker 1 is looking the order up ... and crashes (like kill -9)")
    simulate_crash(first)
    await first.stop()
    LOOKUP_GOES_ON.set()
    clock.advance(lease + timedelta(seconds=1))

    async with engine.worker(lease=lease):
        info = await engine.get(run.run_id)
        while info.status != "waiting":
            await asyncio.sleep(0.01)
            info = await engine.get(run.run_id)
        pending = await engine.stream_last(run.run_id, APPROVALS_STREAM)
        assert pending is not None
        print(f"worker 2 took over; the run waits for {info.waiting_for!r}: {pending.value}")
        clock.advance(timedelta(days=2))
        print("two days later, an operator approves")
        await engine.signal(run.run_id, pending.value["fact"], {"approved": True})
        print(f"answer: {await run.result(timeout=10)}")

    info = await engine.get(run.run_id)
    print("calls really made:", dict(CALLS))
    print("refunds paid:", dict(REFUNDS))
    print("steps:", [s.name for s in info.timeline if s.status == "completed"])
    assert CALLS["model turn 1"] == 1, "the turn answered before the crash was not asked again"
    assert Counter({"A-17": 1}) == REFUNDS
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
