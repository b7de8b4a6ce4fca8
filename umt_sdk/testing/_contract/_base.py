"""What every topic of the contract suite shares: the per-test `Tally`, the fixtures, the
waiting helpers, and the few tasks that most topics run.

Task bodies report to the tests (how often a body ran, the order runs were claimed in) and
tests steer task bodies (gates a body waits on, values a check reads) through one `Tally` per
test. The bodies find it with `current_tally()`: a module-level holder that the `tally`
fixture fills and empties. Not a `ContextVar`: pytest-asyncio sets fixtures up in another task
than the test's, plain handlers run on the worker's own threads, and a holder is seen by
every thread and event loop alike. Tests run one at a time in a process, so one holder is
enough.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, ClassVar
from uuid import UUID

import attrs
import pytest

from umt_sdk import Engine, Registry, RunInfo, TaskContext, TaskDefinition, step, task
from umt_sdk.testing._helpers import BackendHarness

__all__ = [
    "TASKS",
    "ContractBase",
    "Job",
    "Tally",
    "counted",
    "current_tally",
    "echo_task",
    "echo_task_v2",
    "eventually",
    "first",
    "heartbeat_names",
    "holds",
    "other_task",
    "second",
    "steps_task",
    "wait_until",
    "waiter_task",
]


@attrs.define(eq=False)
class Tally:
    """One test's record of what its task bodies did, and the levers that steer them.

    Fresh for every test (the `tally` fixture), so no test sees another's counts.
    """

    harness: BackendHarness
    """The backend under test, for bodies that write business rows."""
    body_runs: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    """How often each body really ran, by (test key, body): replay must never run one again."""
    gates: dict[str, asyncio.Event] = attrs.field(factory=dict)
    """Events that bodies wait on, by name; the test sets them. All are set at teardown."""
    order: list[str] = attrs.field(factory=list)
    """The order in which the echo and other tasks ran: what claim-order tests compare."""
    business: dict[str, Any] = attrs.field(factory=dict)
    """Values shared by bodies and tests: business state a check reads, what a body saw."""

    def gate(self, name: str) -> asyncio.Event:
        """The gate `name`, made on first use (by the test or by the body, whichever is first)."""
        if name not in self.gates:
            self.gates[name] = asyncio.Event()
        return self.gates[name]

    def open_gates(self) -> None:
        """Set every gate, so no body is left waiting when the engine closes."""
        for gate in self.gates.values():
            gate.set()


@attrs.define
class _Holder:
    tally: Tally | None = None


_holder = _Holder()
"""The running test's tally (see the module docstring for why not a `ContextVar`)."""


def current_tally() -> Tally:
    """The tally of the test that is running, for task bodies."""
    tally = _holder.tally
    if tally is None:
        raise RuntimeError(
            "a contract task ran outside a contract test; the `tally` fixture provides its tally"
        )
    return tally


@attrs.frozen
class Job:
    """The input of the suite's tasks: `key` names the test's run in the tally (and is a
    fact name or a gate name to some tasks), `n` is a number each task reads its own way."""

    key: str
    n: int = 0


# -- the tasks most topics run ----------------------------------------------------------------


@step("first")
async def first(key: str) -> int:
    current_tally().body_runs[(key, "first")] += 1
    return 1


@step("second")
async def second(key: str) -> int:
    tally = current_tally()
    tally.body_runs[(key, "second")] += 1
    gate = tally.gates.get(key)
    if gate is not None:
        await gate.wait()
    return 2


@task("contract.steps", version=1)
async def steps_task(ctx: TaskContext[Job]) -> int:
    a = await first(ctx.input.key)
    b = await second(ctx.input.key)
    c = await ctx.step.run("third", lambda: 3)
    return a + b + c


@task("contract.echo", version=1)
async def echo_task(ctx: TaskContext[Job]) -> Job:
    current_tally().order.append(ctx.input.key)
    return Job(key=ctx.input.key.upper(), n=ctx.input.n + 1)


@task("contract.echo", version=2)
async def echo_task_v2(ctx: TaskContext[Job]) -> Job:
    current_tally().order.append(f"v2:{ctx.input.key}")
    return Job(key=ctx.input.key, n=ctx.input.n + 2)


@task("contract.other", version=1)
async def other_task(ctx: TaskContext[Job]) -> str:
    current_tally().order.append(f"other:{ctx.input.key}")
    return "other"


@task("contract.waiter", version=1)
async def waiter_task(ctx: TaskContext[Job]) -> dict[str, Any]:
    payload: dict[str, Any] = await ctx.step.wait_for_fact(
        ctx.input.key, timeout=timedelta(seconds=ctx.input.n) if ctx.input.n else None
    )
    return payload


TASKS: tuple[TaskDefinition[Any, Any], ...] = (
    steps_task,
    echo_task,
    echo_task_v2,
    other_task,
    waiter_task,
)
"""The shared tasks that the suite's engine registers."""


# -- waiting ----------------------------------------------------------------------------------


async def wait_until(
    engine: Engine,
    run_id: UUID,
    predicate: Callable[[RunInfo], bool],
    *,
    timeout: float = 15.0,
    what: str = "condition",
) -> RunInfo:
    """Poll the run until `predicate` holds; fail after `timeout` seconds, naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        info = await engine.get(run_id)
        if predicate(info):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id}: timed out waiting for {what}; last: {info}")
        await asyncio.sleep(0.01)


async def eventually(check: Callable[[], Awaitable[bool]], *, timeout: float = 15.0) -> None:
    """Poll `check` until it returns True; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for a condition")
        await asyncio.sleep(0.01)


async def holds(value: bool) -> bool:
    """`value`, awaitable: `eventually(lambda: holds(x == 1))` re-reads `x` at every poll."""
    return value


def heartbeat_names(engine: Engine, run_id: UUID, step_name: str) -> Callable[[], Awaitable[bool]]:
    """Whether a heartbeat of the run's current execution has reported it inside `step_name`."""

    async def check() -> bool:
        executions = (await engine.get(run_id)).executions
        return bool(executions) and executions[-1].current_step == step_name

    return check


def counted(tally: Tally, key: tuple[str, str], count: int) -> Callable[[], Awaitable[bool]]:
    """Whether the body `key` has run exactly `count` times."""

    async def check() -> bool:
        return tally.body_runs[key] == count

    return check


# -- fixtures ---------------------------------------------------------------------------------


class ContractBase:
    """The fixtures of the suite. A backend's subclass provides `harness`."""

    contract_tasks: ClassVar[Sequence[TaskDefinition[Any, Any]]]
    """The tasks the `engine` fixture registers: every topic's, set by `BackendContract`."""

    @pytest.fixture
    def tally(self, harness: BackendHarness) -> Iterator[Tally]:
        """A fresh tally, made current for the task bodies while the test runs."""
        tally = Tally(harness=harness)
        _holder.tally = tally
        yield tally
        _holder.tally = None

    @pytest.fixture
    async def engine(self, harness: BackendHarness, tally: Tally) -> AsyncIterator[Engine]:
        """An engine on a fresh store of the backend, with every task of the suite."""
        engine = await harness.connect(Registry(self.contract_tasks))
        yield engine
        tally.open_gates()
        await engine.close()
