"""Pydantic AI agents as umt runs: every model request and every tool call a named step.

`UmtAgent(agent)` wraps an `Agent` for use inside an async `@task` handler. Its `run` runs the
agent with its model wrapped so that each request is the step `<name>/turn-<n>/model`, and
each of its toolsets (the function tools, MCP servers, your own) wrapped so that each call is
the step `<name>/turn-<n>/tool/<tool>/<tool call id>`. Replay matches these names: a resumed
run gets the recorded responses and tool results back without calling the model or the tool.
Deferred tool calls (approvals, external calls) park the run on a fact per call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

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
    from pydantic_ai import (
        Agent,
        DeferredToolRequests,
        DeferredToolResults,
        ModelMessagesTypeAdapter,
        RunContext,
        ToolApproved,
        ToolDenied,
        WrapperToolset,
    )
    from pydantic_ai.agent import AgentRunResult
    from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry, ToolFailed
    from pydantic_ai.messages import ModelMessage, ModelResponse
    from pydantic_ai.models import Model, ModelRequestParameters
    from pydantic_ai.models.wrapper import WrapperModel
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.toolsets import AbstractToolset, ToolsetTool
    from pydantic_core import to_jsonable_python
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra("umt_sdk.agents.UmtAgent", "pydantic-ai", exc) from exc

__all__ = ["UmtAgent"]

DepsT = TypeVar("DepsT")
OutputT = TypeVar("OutputT")

_OUTCOME = dict[str, Any]
"""A tool step's record: `{"value": json}`, or how pydantic-ai's control-flow exception ended
the call (`retry`, `failed`, `approval`, `deferred`), so a replay raises it again."""


@define(eq=False)
class _Turns:
    """One `UmtAgent.run`: its step API, name prefix and the count of model requests made."""

    steps: TaskSteps
    prefix: str
    fenced: Mapping[str, FencedTool]
    model_retry: RetryPolicy | None
    tool_retry: RetryPolicy | None
    turn: int = 0


class _StepModel(WrapperModel):
    """A model whose every request is a step; streaming is refused (not replayable)."""

    def __init__(self, wrapped: Model, turns: _Turns) -> None:
        super().__init__(wrapped)
        self._turns = turns

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        turns = self._turns
        turns.turn += 1
        name = f"{turns.prefix}/turn-{turns.turn}/model"

        async def request_model() -> dict[str, Any]:
            response = await self.wrapped.request(
                messages, model_settings, model_request_parameters
            )
            record: dict[str, Any] = ModelMessagesTypeAdapter.dump_python([response], mode="json")[
                0
            ]
            return record

        record = await turns.steps.step.run(
            name, request_model, retry=turns.model_retry, output_type=dict[str, Any]
        )
        response = ModelMessagesTypeAdapter.validate_python([record])[0]
        if not isinstance(response, ModelResponse):  # pragma: no cover - a record we wrote
            raise UsageError(f"step {name!r} did not record a model response")
        return response


@dataclass
class _StepToolset(WrapperToolset[Any]):
    """A toolset whose every tool call is a step (fenced when the tool is declared so).

    A dataclass, not attrs: `WrapperToolset` is one, and Pydantic AI copies toolsets with
    `dataclasses.replace`."""

    turns: _Turns | None = None

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        turns = self.turns
        if turns is None:  # pragma: no cover - always set by UmtAgent
            return await super().call_tool(name, tool_args, ctx, tool)
        call_id = label(ctx.tool_call_id or "call")
        step_name = f"{turns.prefix}/turn-{turns.turn}/tool/{label(name, limit=60)}/{call_id}"
        fenced = turns.fenced.get(name)

        async def call() -> Any:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)

        async def call_step() -> dict[str, Any]:
            try:
                if fenced is None:
                    value = await call()
                else:
                    value = await fenced.call(name, tool_args, lambda: _jsonable_call(call))
            except ModelRetry as exc:
                return {"retry": exc.message}
            except ToolFailed as exc:
                return {"failed": exc.message}
            except ApprovalRequired as exc:
                return {"approval": exc.metadata}
            except CallDeferred as exc:
                return {"deferred": exc.metadata, "kind": exc.kind}
            return {"value": to_jsonable_python(value)}

        outcome = await turns.steps.step.run(
            step_name, call_step, retry=turns.tool_retry, output_type=_OUTCOME
        )
        return _replay_outcome(outcome)


async def _jsonable_call(call: Any) -> Any:
    return to_jsonable_python(await call())


def _replay_outcome(outcome: Mapping[str, Any]) -> Any:
    if "retry" in outcome:
        raise ModelRetry(outcome["retry"])
    if "failed" in outcome:
        raise ToolFailed(outcome["failed"])
    if "approval" in outcome:
        raise ApprovalRequired(outcome["approval"])
    if "deferred" in outcome:
        raise CallDeferred(outcome["deferred"], kind=outcome.get("kind", "external"))
    return outcome.get("value")


def _approval(payload: Any) -> bool | ToolApproved | ToolDenied:
    """A fact's payload as an approval: `true`/`false`, or `{"approved": bool, "message":
    str, "override_args": {...}}`."""
    if isinstance(payload, bool):
        return payload
    if isinstance(payload, Mapping) and isinstance(payload.get("approved"), bool):
        if payload["approved"]:
            return ToolApproved(override_args=payload.get("override_args"))
        return ToolDenied(str(payload.get("message") or "The tool call was denied."))
    return ToolDenied(f"The approval was not understood: {payload!r}")


class UmtAgent(Generic[DepsT, OutputT]):
    """A Pydantic AI `Agent` run durably inside an async umt task.

    Every model request is the step `<name>/turn-<n>/model` and every tool call the step
    `<name>/turn-<n>/tool/<tool name>/<tool call id>` (`n` counts this run's model requests),
    so a crash resumes after the last completed model request or tool call and never makes
    one again. A deferred tool call (a tool with `requires_approval=True`, or one raising
    `ApprovalRequired` or `CallDeferred`) parks the run on the fact
    `<name>/approval/<tool call id>` (or `<name>/result/<tool call id>`), announced first on
    the run's stream `agent-approvals`; the run holds no worker slot while it waits.

    Args:
        agent: the agent. Its output type must allow `DeferredToolRequests` for deferred
            tools (as Pydantic AI requires).
        name: the prefix of the steps and facts (default: the agent's name, else `agent`).
            Part of the run's history: keep it stable.
        fenced: tool name -> `FencedTool`, for tools with an outside side effect.
        approval_timeout: how long a deferred call may wait for its fact (default: forever);
            past it the run gets `FactTimeoutError`.
        model_retry, tool_retry: retry policies of the model and tool steps (default: the
            task's).
    """

    def __init__(
        self,
        agent: Agent[DepsT, OutputT],
        *,
        name: str | None = None,
        fenced: Mapping[str, FencedTool] | None = None,
        approval_timeout: timedelta | None = None,
        model_retry: RetryPolicy | None = None,
        tool_retry: RetryPolicy | None = None,
    ) -> None:
        if not isinstance(agent, Agent):
            raise UsageError(f"UmtAgent wraps a pydantic_ai.Agent, got {agent!r}", argument="agent")
        prefix = label(name or agent.name or "agent", limit=60)
        for tool_name, spec in (fenced or {}).items():
            if not isinstance(spec, FencedTool):
                raise UsageError(
                    f"fenced[{tool_name!r}] must be a FencedTool, got {spec!r}", argument="fenced"
                )
        self.agent = agent
        self.name = prefix
        self._fenced = dict(fenced or {})
        self._approval_timeout = approval_timeout
        self._model_retry = model_retry
        self._tool_retry = tool_retry

    async def run(
        self,
        user_prompt: str | None = None,
        *,
        deps: DepsT = None,  # type: ignore[assignment]  # Pydantic AI's own default
        message_history: Sequence[ModelMessage] | None = None,
        deferred_tool_results: DeferredToolResults | None = None,
        model: Model | str | None = None,
        toolsets: Sequence[AbstractToolset[DepsT]] | None = None,
        **kwargs: Any,
    ) -> AgentRunResult[Any]:
        """Run the agent to its end, durably; returns Pydantic AI's `AgentRunResult`.

        Takes the arguments of `Agent.run` (streaming and `event_stream_handler` excepted).
        Deferred tool calls are resolved by waiting for their facts, so the result's output
        is never `DeferredToolRequests`. Call it from an async `@task` handler.
        """
        if "event_stream_handler" in kwargs:
            raise UsageError(
                "UmtAgent.run does not stream: a streamed model response cannot be replayed "
                "from its record",
                argument="event_stream_handler",
            )
        turns = _Turns(
            steps=task_steps("UmtAgent.run"),
            prefix=self.name,
            fenced=self._fenced,
            model_retry=self._model_retry,
            tool_retry=self._tool_retry,
        )
        chosen = model if model is not None else self.agent.model
        if chosen is None:
            raise UsageError("the agent has no model: give one to Agent(...) or run(model=...)")
        step_model = _StepModel(_as_model(chosen), turns)
        wrapped: list[AbstractToolset[Any]] = [
            _StepToolset(toolset, turns=turns)
            for toolset in (*self.agent.toolsets, *(toolsets or ()))
        ]
        prompt, history, results = user_prompt, message_history, deferred_tool_results
        while True:
            with ExitStack() as overrides:
                overrides.enter_context(
                    self.agent.override(model=step_model, toolsets=wrapped, tools=[])
                )
                # One tool call at a time: steps of one execution are recorded in call order.
                overrides.enter_context(Agent.parallel_tool_call_execution_mode("sequential"))
                result: AgentRunResult[Any] = await self.agent.run(
                    prompt,
                    deps=deps,
                    message_history=history,
                    deferred_tool_results=results,
                    **kwargs,
                )
            if not isinstance(result.output, DeferredToolRequests):
                return result
            results = await self._resolve(turns.steps, result.output)
            prompt, history = None, result.all_messages()

    async def _resolve(
        self, steps: TaskSteps, requests: DeferredToolRequests
    ) -> DeferredToolResults:
        """Wait for a fact per deferred call: its approval, or its result from outside."""
        waits: list[tuple[str, str, bool]] = []
        for part in requests.approvals:
            fact = f"{self.name}/approval/{label(part.tool_call_id)}"
            waits.append((part.tool_call_id, fact, True))
            await steps.stream.write(APPROVALS_STREAM, _announcement(fact, part, "approval"))
        for part in requests.calls:
            fact = f"{self.name}/result/{label(part.tool_call_id)}"
            waits.append((part.tool_call_id, fact, False))
            await steps.stream.write(APPROVALS_STREAM, _announcement(fact, part, "result"))
        results = DeferredToolResults()
        for call_id, fact, is_approval in waits:
            payload: Any = await steps.step.wait_for_fact(fact, timeout=self._approval_timeout)
            if is_approval:
                results.approvals[call_id] = _approval(payload)
            else:
                results.calls[call_id] = payload
        return results

    def __repr__(self) -> str:
        return f"<UmtAgent {self.name!r} of {self.agent!r}>"


def _announcement(fact: str, part: Any, kind: str) -> dict[str, Any]:
    return {
        "fact": fact,
        "kind": kind,
        "tool": part.tool_name,
        "tool_call_id": part.tool_call_id,
        "args": to_jsonable_python(part.args_as_dict()),
    }


def _as_model(model: Model | str) -> Model:
    if isinstance(model, Model):
        return model
    from pydantic_ai.models import infer_model

    return infer_model(model)


UmtAgent.__module__ = "umt_sdk.agents"
