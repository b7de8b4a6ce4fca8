"""What both agent integrations share: step and fact names, fenced tools, the missing extra.

No agent framework is imported here, so `umt_sdk.agents` imports without either extra.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import Any

from attrs import field, frozen

from umt_sdk._context import StepApi, current_execution
from umt_sdk._fencing import AttemptInfo, with_attempt_token
from umt_sdk._streams import StreamApi
from umt_sdk.exceptions import NotInTaskError, UsageError

__all__ = [
    "APPROVALS_STREAM",
    "FencedTool",
    "TaskSteps",
    "current_attempt",
    "label",
    "missing_extra",
    "task_steps",
]

APPROVALS_STREAM = "agent-approvals"
"""The run's stream to which an agent writes each approval (and external result) it waits for,
before it parks: what a UI reads to show the pending decisions."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_.:\-]")
_ATTEMPT: ContextVar[AttemptInfo | None] = ContextVar("umt_agent_attempt", default=None)


def label(text: str, *, limit: int = 80) -> str:
    """`text` as a part of a step or fact name: characters a name refuses become `_`, and a
    long text keeps its end (a tool-call id's unique part)."""
    cleaned = _UNSAFE.sub("_", text) or "_"
    return cleaned if len(cleaned) <= limit else cleaned[-limit:]


def missing_extra(what: str, extra: str, exc: ImportError) -> ImportError:
    """The error for an integration whose framework is not installed, naming the extra."""
    return ImportError(
        f"{what} needs the {extra} extra ({exc.name} is missing): pip install 'umt-tasks[{extra}]'",
        name=exc.name,
    )


@frozen(kw_only=True)
class TaskSteps:
    """The running task's step and stream APIs, found through its context variable."""

    step: StepApi
    stream: StreamApi


def task_steps(what: str) -> TaskSteps:
    """The steps of the task running in this context, or `NotInTaskError` naming `what`."""
    execution = current_execution()
    if execution is None or execution.in_handler_thread():
        raise NotInTaskError(
            f"{what} was called outside a running async task; call it from an async "
            "@task handler (its model calls and tool calls become the run's steps)"
        )
    return TaskSteps(step=StepApi(execution.steps), stream=StreamApi(execution.streams))


def current_attempt() -> AttemptInfo | None:
    """Inside a fenced tool (see `FencedTool`): the attempt's `AttemptInfo` (`op_key`,
    `attempt_token` to hand to the outside system, `resumed` when an earlier attempt began
    this operation and left no result); None elsewhere."""
    return _ATTEMPT.get()


def _check_op_key(value: object) -> str | Callable[[Mapping[str, Any]], str]:
    if isinstance(value, str) and value:
        return value
    if callable(value):
        return value  # any callable: its result is checked when it is called
    raise UsageError(
        "op_key must be a non-empty format string such as 'charge:{order_id}' (filled with "
        f"the tool's arguments) or a function of the arguments, got {value!r}",
        argument="op_key",
    )


@frozen(kw_only=True)
class FencedTool:
    """Declares that a tool has an outside side effect: each call runs through
    `with_attempt_token`, so the effect happens once per `op_key` even when a stale (zombie)
    attempt of the agent's run calls the tool too.

    Attributes:
        op_key: the operation's key, unique per effect: a format string filled with the
            tool's arguments (`"charge:{order_id}"`) or a function of the arguments.
        conn: the business connection `with_attempt_token` fences on (an autocommit psycopg
            connection on Postgres, a `MemoryStore` on the memory backend), or a function
            (plain or async) that returns it when the tool is called.
        commit: optional `commit(tx, result)`: business writes in the fencing transaction.
    """

    op_key: str | Callable[[Mapping[str, Any]], str] = field(converter=_check_op_key)
    conn: Any
    commit: Callable[[Any, Any], Awaitable[None] | None] | None = None

    def key_for(self, tool_name: str, arguments: Mapping[str, Any]) -> str:
        """The op_key of one call of `tool_name` with `arguments`."""
        try:
            key = (
                self.op_key.format(**arguments)
                if isinstance(self.op_key, str)
                else self.op_key(arguments)
            )
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise UsageError(
                f"the op_key of tool {tool_name!r} cannot be made from its arguments "
                f"{sorted(arguments)}: {exc!r}",
                argument="op_key",
            ) from exc
        if not isinstance(key, str) or not key:
            raise UsageError(
                f"the op_key of tool {tool_name!r} must be a non-empty string, got {key!r}",
                argument="op_key",
            )
        return key

    async def connection(self) -> Any:
        """The business connection: `conn`, or what calling it returns."""
        conn = self.conn
        if callable(conn):
            conn = conn()
            if inspect.isawaitable(conn):
                conn = await conn
        return conn

    async def call(
        self, tool_name: str, arguments: Mapping[str, Any], act: Callable[[], Awaitable[Any]]
    ) -> Any:
        """Run `act` (the tool's body) fenced, under this call's op_key; what it returns must
        be JSON (it is recorded in the operation's ledger row)."""
        op_key = self.key_for(tool_name, arguments)
        conn = await self.connection()

        async def fenced_act(info: AttemptInfo) -> Any:
            token = _ATTEMPT.set(info)
            try:
                return await act()
            finally:
                _ATTEMPT.reset(token)

        return await with_attempt_token(
            conn, op_key, fenced_act, commit=self.commit, result_type=Any
        )
