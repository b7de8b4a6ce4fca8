"""OpenAI Agents SDK agents as umt runs: `UmtRunner.run`, a drop-in for `Runner.run`.

The starting agent and the agents it hands off to are cloned with their model wrapped so that
each model call is the step `<name>/turn-<n>/model`, and each function tool wrapped so that
each call is the step `<name>/turn-<n>/tool/<tool>/<call id>`. Replay matches these names.
Tools that need approval park the run on a fact per call.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Mapping
from datetime import timedelta
from typing import Any

from attrs import define

from umt_sdk._retry import RetryPolicy
from umt_sdk.agents._common import (
    APPROVALS_STREAM,
    FencedTool,
    TaskSteps,
    label,
    missing_extra,
    task_steps,
)
from umt_sdk.exceptions import UsageError

try:
    from agents import Agent, FunctionTool, Handoff, Model, ModelResponse, RunConfig, Runner
    from agents.items import ToolApprovalItem
    from agents.result import RunResult
    from agents.run_state import RunState
    from agents.tool_context import ToolContext
    from agents.usage import Usage
    from openai.types.responses import ResponseOutputItem
    from pydantic import TypeAdapter
    from pydantic_core import to_jsonable_python
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra("umt_sdk.agents.UmtRunner", "openai-agents", exc) from exc

__all__ = ["UmtRunner"]

_OUTPUT_ITEMS: TypeAdapter[list[ResponseOutputItem]] = TypeAdapter(list[ResponseOutputItem])
_USAGE: TypeAdapter[Usage] = TypeAdapter(Usage)


@define(eq=False)
class _Turns:
    """One `UmtRunner.run`: its steps, name prefix and the count of model calls made."""

    steps: TaskSteps
    prefix: str
    fenced: Mapping[str, FencedTool]
    model_retry: RetryPolicy | None
    tool_retry: RetryPolicy | None
    provider: Any
    turn: int = 0


class _StepModel(Model):
    """A model whose every call is a step. The real model is resolved inside the step, so a
    replay needs no provider (nor its API key); streaming is refused (not replayable)."""

    def __init__(self, source: str | Model | None, turns: _Turns) -> None:
        self._source = source
        self._turns = turns
        self._model: Model | None = None

    def _resolve(self) -> Model:
        if self._model is None:
            source = self._source
            self._model = (
                source if isinstance(source, Model) else self._turns.provider.get_model(source)
            )
        return self._model

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        turns = self._turns
        turns.turn += 1
        name = f"{turns.prefix}/turn-{turns.turn}/model"

        async def call_model() -> dict[str, Any]:
            response = await self._resolve().get_response(*args, **kwargs)
            return {
                "output": _OUTPUT_ITEMS.dump_python(response.output, mode="json"),
                "usage": _USAGE.dump_python(response.usage, mode="json"),
                "response_id": response.response_id,
                "request_id": response.request_id,
            }

        record = await turns.steps.step.run(
            name, call_model, retry=turns.model_retry, output_type=dict[str, Any]
        )
        return ModelResponse(
            output=_OUTPUT_ITEMS.validate_python(record["output"]),
            usage=_USAGE.validate_python(record["usage"]),
            response_id=record.get("response_id"),
            request_id=record.get("request_id"),
        )

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise UsageError(
            "UmtRunner does not stream: a streamed model response cannot be replayed from its "
            "record; use UmtRunner.run"
        )


def _step_tool(tool: FunctionTool, turns: _Turns) -> FunctionTool:
    invoke = tool.on_invoke_tool
    fenced = turns.fenced.get(tool.name)

    async def invoke_step(ctx: ToolContext[Any], input_json: str) -> Any:
        call_id = label(ctx.tool_call_id or "call")
        name = f"{turns.prefix}/turn-{turns.turn}/tool/{label(tool.name, limit=60)}/{call_id}"

        async def call() -> Any:
            return to_jsonable_python(await invoke(ctx, input_json))

        async def call_step() -> dict[str, Any]:
            if fenced is None:
                return {"value": await call()}
            arguments = _arguments(input_json)
            return {"value": await fenced.call(tool.name, arguments, call)}

        outcome = await turns.steps.step.run(
            name, call_step, retry=turns.tool_retry, output_type=dict[str, Any]
        )
        return outcome.get("value")

    return dataclasses.replace(tool, on_invoke_tool=invoke_step)


def _arguments(input_json: str) -> dict[str, Any]:
    """A tool call's JSON arguments as a dict (empty when they are not a JSON object)."""
    try:
        value = json.loads(input_json or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class _Cloner:
    """Clones a graph of agents (handoffs included, cycles kept) with their models and
    function tools wrapped into steps."""

    def __init__(self, turns: _Turns, run_model: str | Model | None) -> None:
        self._turns = turns
        self._run_model = run_model
        self._clones: dict[int, Agent[Any]] = {}

    def agent(self, agent: Agent[Any]) -> Agent[Any]:
        done = self._clones.get(id(agent))
        if done is not None:
            return done
        source = self._run_model if self._run_model is not None else agent.model
        clone = agent.clone(model=_StepModel(source, self._turns))
        self._clones[id(agent)] = clone
        clone.tools = [
            _step_tool(t, self._turns) if isinstance(t, FunctionTool) else t for t in agent.tools
        ]
        clone.handoffs = [self._handoff(h) for h in agent.handoffs]
        return clone

    def _handoff(self, handoff: Agent[Any] | Handoff[Any, Any]) -> Any:
        if isinstance(handoff, Agent):
            return self.agent(handoff)
        invoke = handoff.on_invoke_handoff

        async def invoke_cloned(ctx: Any, input_json: str) -> Agent[Any]:
            return self.agent(await invoke(ctx, input_json))

        return dataclasses.replace(handoff, on_invoke_handoff=invoke_cloned)


class UmtRunner:
    """`Runner.run` for an async umt task: the OpenAI Agents SDK's agent loop, durable.

    Every model call is the step `<name>/turn-<n>/model` and every function tool call the
    step `<name>/turn-<n>/tool/<tool name>/<call id>` (`n` counts this run's model calls,
    across handoffs), so a crash resumes after the last completed model call or tool call and
    never makes one again. A tool with `needs_approval` parks the run on the fact
    `<name>/approval/<call id>` (announced on the run's stream `agent-approvals`), holding no
    worker slot; the fact's payload `true`/`false` (or `{"approved": bool, "message": str}`)
    approves or rejects the call.
    """

    @classmethod
    async def run(
        cls,
        starting_agent: Agent[Any],
        input: str | list[Any],
        *,
        name: str | None = None,
        fenced: Mapping[str, FencedTool] | None = None,
        approval_timeout: timedelta | None = None,
        model_retry: RetryPolicy | None = None,
        tool_retry: RetryPolicy | None = None,
        run_config: RunConfig | None = None,
        **kwargs: Any,
    ) -> RunResult:
        """Run `starting_agent` on `input` to its end, durably; returns the SDK's `RunResult`.

        Takes `Runner.run`'s keyword arguments (`context`, `max_turns`, `hooks`, ...) and:
        `name` (the prefix of step and fact names; default the starting agent's name: keep it
        stable), `fenced` (tool name -> `FencedTool`), `approval_timeout` (default: wait
        forever), `model_retry` / `tool_retry` (default: the task's policy). Call it from an
        async `@task` handler.
        """
        if not isinstance(starting_agent, Agent):
            raise UsageError(
                f"UmtRunner.run takes an agents.Agent, got {starting_agent!r}",
                argument="starting_agent",
            )
        for tool_name, spec in (fenced or {}).items():
            if not isinstance(spec, FencedTool):
                raise UsageError(
                    f"fenced[{tool_name!r}] must be a FencedTool, got {spec!r}", argument="fenced"
                )
        config = run_config if run_config is not None else RunConfig()
        prefix = label(name or starting_agent.name or "agent", limit=60)
        turns = _Turns(
            steps=task_steps("UmtRunner.run"),
            prefix=prefix,
            fenced=dict(fenced or {}),
            model_retry=model_retry,
            tool_retry=tool_retry,
            provider=config.model_provider,
        )
        agent = _Cloner(turns, config.model).agent(starting_agent)
        config = dataclasses.replace(config, model=None)
        step_input: str | list[Any] | RunState[Any] = input
        while True:
            result = await Runner.run(agent, step_input, run_config=config, **kwargs)
            if not result.interruptions:
                return result
            state = result.to_state()
            for item in result.interruptions:
                await cls._decide(turns, prefix, approval_timeout, state, item)
            step_input = state

    @staticmethod
    async def _decide(
        turns: _Turns,
        prefix: str,
        timeout: timedelta | None,
        state: RunState[Any],
        item: ToolApprovalItem,
    ) -> None:
        call_id = _call_id(item)
        fact = f"{prefix}/approval/{label(call_id)}"
        await turns.steps.stream.write(
            APPROVALS_STREAM,
            {
                "fact": fact,
                "kind": "approval",
                "tool": item.tool_name,
                "tool_call_id": call_id,
                "args": _arguments(item.arguments or ""),
            },
        )
        payload: Any = await turns.steps.step.wait_for_fact(fact, timeout=timeout)
        if payload is True or (isinstance(payload, Mapping) and payload.get("approved") is True):
            state.approve(item)
        else:
            message = payload.get("message") if isinstance(payload, Mapping) else None
            state.reject(item, rejection_message=str(message) if message else None)


def _call_id(item: ToolApprovalItem) -> str:
    raw = item.raw_item
    call_id = raw.get("call_id") if isinstance(raw, Mapping) else getattr(raw, "call_id", None)
    return str(call_id or item.tool_name or "call")


UmtRunner.__module__ = "umt_sdk.agents"
