"""Durable AI agents: Pydantic AI and OpenAI Agents SDK agents run as umt runs.

Every model call and every tool call of an agent is a named step of the run, so a crash
resumes after the last completed one and never makes it again; approvals are durable fact
waits; a tool with a side effect can be fenced (`FencedTool`). See docs/agents.md.

`UmtAgent` needs `pip install 'umt-tasks[pydantic-ai]'`, `UmtRunner` needs
`pip install 'umt-tasks[openai-agents]'`; each framework is imported only when its name is
first used, so this module imports without either.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from umt_sdk.agents._common import APPROVALS_STREAM, FencedTool, current_attempt

if TYPE_CHECKING:
    from umt_sdk.agents._openai_agents import UmtRunner
    from umt_sdk.agents._pydantic_ai import UmtAgent

__all__ = ["APPROVALS_STREAM", "FencedTool", "UmtAgent", "UmtRunner", "current_attempt"]

_LAZY = {
    "UmtAgent": "umt_sdk.agents._pydantic_ai",
    "UmtRunner": "umt_sdk.agents._openai_agents",
}

# Evaluate string annotations where they were written before `__module__` changes (as
# umt_sdk's own re-exports do): get_type_hints resolves them in `__module__`'s namespace.
FencedTool.__annotations__ = inspect.get_annotations(FencedTool, eval_str=True)
FencedTool.__module__ = __name__
current_attempt.__module__ = __name__


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(module_name), name)
    globals()[name] = value
    return value
