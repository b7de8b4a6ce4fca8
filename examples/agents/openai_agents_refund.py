"""An OpenAI Agents SDK agent as a durable umt run: `UmtRunner.run` instead of `Runner.run`.

Run it: `python examples/agents/openai_agents_refund.py` (needs `umt-tasks[openai-agents]`;
no network and no API key: the model is a scripted fake `agents.Model`, tracing is off).

The story: a support agent prices an order, refunds it (a tool that needs approval, fenced
with a `FencedTool`) and answers. The worker crashes inside the model's second call; the next
worker resumes after the first call's recorded answer and the price already looked up, then
the refund waits two (virtual) days for an operator and is paid once.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any

from agents import Agent, Model, ModelResponse, RunConfig, function_tool
from agents.testing import assistant_message, function_call
from agents.tracing import set_tracing_disabled
from agents.usage import Usage

from umt_backend_memory import MemoryStore
from umt_sdk import Registry, TaskContext, connect, task
from umt_sdk.agents import APPROVALS_STREAM, FencedTool, UmtRunner, current_attempt
from umt_sdk.testing import FakeClock, simulate_crash

set_tracing_disabled(True)  # the SDK would export traces to OpenAI otherwise

CALLS: Counter[str] = Counter()
SECOND_CALL_STARTED = asyncio.Event()
SECOND_CALL_GOES_ON = asyncio.Event()
PAYMENTS = MemoryStore()
REFUNDS: Counter[str] = Counter()


class SupportModel(Model):
    """What an LLM would answer, turn by turn (the turn: tool results seen so far + 1)."""

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        seen = [i["output"] for i in input if i.get("type") == "function_call_output"]
        turn = len(seen) + 1
        CALLS[f"model turn {turn}"] += 1
        if turn == 1:
            item = function_call("price", {"order_id": "A-17"}, call_id="call-1")
        elif turn == 2:
            if CALLS["model turn 2"] == 1:
                SECOND_CALL_STARTED.set()
                await SECOND_CALL_GOES_ON.wait()
            item = function_call(
                "refund", {"order_id": "A-17", "cents": int(seen[0])}, call_id="call-2"
            )
        else:
            item = assistant_message(f"Done: {seen[-1]}. Sorry for the trouble!")
        return ModelResponse(output=[item], usage=Usage(requests=1), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@function_tool
async def price(order_id: str) -> int:
    """The order's price in cents."""
    CALLS["price"] += 1
    return 4999


@function_tool(needs_approval=True)
async def refund(order_id: str, cents: int) -> str:
    """Refund an order (a human approves it first)."""
    CALLS["refund"] += 1
    attempt = current_attempt()
    assert attempt is not None
    if not (attempt.resumed and REFUNDS[order_id]):
        REFUNDS[order_id] += 1
    return f"refunded {cents / 100:.2f} EUR on {order_id}"


support = Agent(
    name="support",
    instructions="Refund broken orders.",
    model=SupportModel(),
    tools=[price, refund],
)


@task("support_ticket", version=1)
async def support_ticket(ctx: TaskContext[str]) -> str:
    result = await UmtRunner.run(
        support,
        ctx.input,
        fenced={"refund": FencedTool(op_key="refund:{order_id}", conn=PAYMENTS)},
        run_config=RunConfig(tracing_disabled=True),
    )
    return str(result.final_output)


async def main() -> None:
    clock = FakeClock()
    engine = await connect("memory://", registry=Registry([support_ticket]), clock=clock)
    run = await engine.enqueue(support_ticket, "My order A-17 arrived broken.")
    lease = timedelta(seconds=10)

    first = engine.worker(lease=lease)
    await first.start()
    await SECOND_CALL_STARTED.wait()
    print("worker 1 is waiting for the model's second answer ... and crashes (like kill -9)")
    simulate_crash(first)
    await first.stop()
    SECOND_CALL_GOES_ON.set()
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
        await engine.signal(run.run_id, pending.value["fact"], True)
        print(f"answer: {await run.result(timeout=10)}")

    info = await engine.get(run.run_id)
    print("calls really made:", dict(CALLS))
    print("refunds paid:", dict(REFUNDS))
    print("steps:", [s.name for s in info.timeline if s.status == "completed"])
    assert CALLS["model turn 1"] == 1, "the answer recorded before the crash is not asked again"
    assert CALLS["price"] == 1, "nor is the tool call that completed"
    assert Counter({"A-17": 1}) == REFUNDS
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
