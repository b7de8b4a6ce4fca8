"""An agent run whose worker process is SIGKILLed in the middle of a model call and then in
the middle of a fenced tool call completes on a third worker; no completed model call or
tool call runs again, and the fenced tool's effect happens once.

Both integrations, on Postgres: a Pydantic AI agent (`UmtAgent`, its `FunctionModel`) and an
OpenAI Agents SDK agent (`UmtRunner`, a fake `Model`). Their script is the same: turn 1 looks
the order up, turn 2 charges it (a tool fenced with `FencedTool`: the charge goes to a "card
processor" file, its receipt row is written in the fencing transaction), turn 3 answers. Every
call really made appends a line to `calls.log` in the workers' shared folder; at a kill point,
the first call to get there prints `IN_CALL <point>` and waits for the test's SIGKILL.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
from agents import Agent as OpenAIAgent
from agents import Model, ModelResponse, RunConfig, function_tool
from agents.testing import assistant_message, function_call
from agents.tracing import set_tracing_disabled
from agents.usage import Usage
from psycopg import sql
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.messages import ModelResponse as PaiResponse
from pydantic_ai.models.function import AgentInfo, FunctionModel

from tests._procs.support import Spawner, fetch, q
from tests._procs.worker import append_line, config, say, until_file, write_first
from umt_sdk import Registry, TaskContext, connect, task
from umt_sdk.agents import FencedTool, UmtAgent, UmtRunner, current_attempt

set_tracing_disabled(True)

RECEIPTS = "agent_receipts"
CALLS_LOG = "calls.log"
CHARGES_LOG = "charges.log"
KILL_POINTS = ("model:2", "tool:charge")


@attrs.frozen
class Order:
    order_id: str
    framework: str


async def _call(point: str) -> None:
    """Count a real call; at a kill point, the first call there waits to be killed."""
    folder = config().workdir
    append_line(folder / CALLS_LOG, f"{point} {os.getpid()}")
    if point in KILL_POINTS and write_first(folder / f"paused-{point}", str(os.getpid())) == str(
        os.getpid()
    ):
        say("IN_CALL", point, os.getpid())
        await until_file(f"never-{point}", limit=None)


def _charge_once(order_id: str) -> None:
    """The card processor: a resumed attempt looks the charge up by order first."""
    path = config().workdir / CHARGES_LOG
    attempt = current_attempt()
    assert attempt is not None, "the charge tool is fenced"
    if attempt.resumed and path.exists() and order_id in path.read_text().split():
        return
    append_line(path, f"{order_id} {attempt.attempt_token}")


_BUSINESS: list[psycopg.AsyncConnection[Any]] = []


async def business_conn() -> psycopg.AsyncConnection[Any]:
    """The worker's autocommit connection to the business database (the engine's here)."""
    if not _BUSINESS:
        _BUSINESS.append(await psycopg.AsyncConnection.connect(config().url, autocommit=True))
    return _BUSINESS[0]


async def write_receipt(tx: psycopg.AsyncConnection[Any], result: Any) -> None:
    await tx.execute(
        sql.SQL("INSERT INTO {}.{} (body) VALUES (%s)").format(
            sql.Identifier(config().schema), sql.Identifier(RECEIPTS)
        ),
        (json.dumps(result),),
    )


FENCED = {
    "charge": FencedTool(op_key="charge:{order_id}", conn=business_conn, commit=write_receipt)
}


# -- Pydantic AI -------------------------------------------------------------------------------


async def pai_script(messages: list[ModelMessage], info: AgentInfo) -> PaiResponse:
    turn = 1 + sum(isinstance(m, PaiResponse) for m in messages)
    await _call(f"model:{turn}")
    returns = [
        p.content
        for m in messages
        for p in getattr(m, "parts", [])
        if isinstance(p, ToolReturnPart)
    ]
    if turn == 1:
        return PaiResponse(parts=[ToolCallPart("lookup", {"order_id": "o-1"}, "call-1")])
    if turn == 2:
        args = {"order_id": "o-1", "cents": int(returns[0])}
        return PaiResponse(parts=[ToolCallPart("charge", args, "call-2")])
    return PaiResponse(parts=[TextPart(f"receipt: {returns[-1]}")])


pai_agent: Agent[None, str] = Agent(FunctionModel(pai_script), name="cashier")


@pai_agent.tool_plain
async def lookup(order_id: str) -> int:
    await _call("tool:lookup")
    return 1250


@pai_agent.tool_plain(name="charge")
async def pai_charge(order_id: str, cents: int) -> str:
    await _call("tool:charge:start")
    _charge_once(order_id)
    await _call("tool:charge")
    return f"charged {cents} for {order_id}"


UMT_AGENT = UmtAgent(pai_agent, fenced=FENCED)


# -- OpenAI Agents SDK -------------------------------------------------------------------------


class ScriptModel(Model):
    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        outputs = [
            str(i["output"])
            for i in (input if isinstance(input, list) else [])
            if isinstance(i, dict) and i.get("type") == "function_call_output"
        ]
        turn = len(outputs) + 1
        await _call(f"model:{turn}")
        if turn == 1:
            item = function_call("lookup", {"order_id": "o-1"}, call_id="call-1")
        elif turn == 2:
            args = {"order_id": "o-1", "cents": int(outputs[0])}
            item = function_call("charge", args, call_id="call-2")
        else:
            item = assistant_message(f"receipt: {outputs[-1]}")
        return ModelResponse(output=[item], usage=Usage(requests=1), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@function_tool(name_override="lookup")
async def oai_lookup(order_id: str) -> int:
    """The order's price in cents."""
    await _call("tool:lookup")
    return 1250


@function_tool(name_override="charge")
async def oai_charge(order_id: str, cents: int) -> str:
    """Charge the order."""
    await _call("tool:charge:start")
    _charge_once(order_id)
    await _call("tool:charge")
    return f"charged {cents} for {order_id}"


oai_agent = OpenAIAgent(name="cashier", model=ScriptModel(), tools=[oai_lookup, oai_charge])


@task("agents.cashier", version=1)
async def cashier(ctx: TaskContext[Order]) -> str:
    if ctx.input.framework == "pydantic-ai":
        result = await UMT_AGENT.run(f"Charge order {ctx.input.order_id}")
        return str(result.output)
    done = await UmtRunner.run(
        oai_agent,
        f"Charge order {ctx.input.order_id}",
        fenced=FENCED,
        run_config=RunConfig(tracing_disabled=True),
    )
    return str(done.final_output)


TASKS = [cashier]


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["pydantic-ai", "openai-agents"])
async def test_an_agent_killed_mid_model_call_and_mid_tool_call_completes_once_each(
    pg_url: str, pg_schema: str, tmp_path: Path, framework: str
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(
            q("CREATE TABLE {schema}.{t} (body text NOT NULL)", pg_schema, t=RECEIPTS)
        )
    engine = await connect(pg_url, registry=Registry(TASKS), schema=pg_schema, run_migrations=False)
    fields = {"url": pg_url, "schema": pg_schema, "poll": 0.2}
    try:
        with Spawner.under(tmp_path, tasks=__name__, **fields) as spawner:
            handle = await engine.enqueue(cashier, Order("o-1", framework))
            for n, point in enumerate(KILL_POINTS):
                worker = spawner.start(group=f"w{n}", lease=1.0)
                try:
                    await worker.wait_for(f"IN_CALL {point}", timeout=60)
                except AssertionError as exc:
                    info = await engine.get(handle.run_id)
                    steps = [(s.name, s.status, s.error) for s in info.timeline]
                    raise AssertionError(f"{info.status} {info.error} {steps}") from exc
                worker.kill()
                assert worker.popen.returncode == -9, worker.describe()
            last = spawner.start(group="w-last", lease=1.0)
            output = await handle.result(timeout=90)
            assert output == "receipt: charged 1250 for o-1", last.describe()

            lines = (spawner.workdir / CALLS_LOG).read_text().split("\n")
            calls = Counter(line.split()[0] for line in lines if line)
            # The two calls in flight at a kill ran twice; every other call, once.
            assert calls == Counter(
                {
                    "model:1": 1,
                    "tool:lookup": 1,
                    "model:2": 2,
                    "tool:charge:start": 2,
                    "tool:charge": 2,
                    "model:3": 1,
                }
            ), calls
            charges = (spawner.workdir / CHARGES_LOG).read_text().split("\n")
            assert [c.split()[0] for c in charges if c] == ["o-1"], "charged once"
        receipts = await fetch(pg_url, q("SELECT body FROM {schema}.{t}", pg_schema, t=RECEIPTS))
        assert [json.loads(r["body"]) for r in receipts] == ["charged 1250 for o-1"]
        info = await engine.get(handle.run_id)
        assert [e.outcome for e in info.executions] == ["interrupted", "interrupted", "completed"]
        assert info.lease_expirations == 2
    finally:
        await engine.close()
