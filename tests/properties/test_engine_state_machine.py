"""A stateful model of the engine on the memory backend.

A `RuleBasedStateMachine` enqueues runs of a small multi-step flow (a step that may block on a
gate the test opens, a fenced side effect through `with_attempt_token`, a durable sleep, a
wait for a run-scoped fact, a flaky step that retries), and interleaves at random: facts
signalled before or after their waiter gets there, cancels, crashes of one execution at a
chosen backend operation (the memory backend's `crash_hook`), crashes of whole workers,
graceful stops, version-filtered workers, moves of the virtual clock, a frozen worker that
resumes after another worker took its runs over, and pauses and resumes of tasks (one version
or all): a paused pair never starts a new execution, and the drain resumes everything first.

After every rule it checks the backend's records against the rules of leases, fencing and
replay (see `_check_state`); at the end it drains every run with a worker serving all pairs
and checks how each one ended (see `_drain`).

The machine owns its event loop (a `VirtualTimeLoop`): each rule runs with
`loop.run_until_complete`, and between rules nothing moves. The backend's FakeClock does not
advance by itself; rules move it either smoothly (`pass_time`: the loop's clock moves with it in
half-second slices, so workers poll and heartbeat as it goes) or in one jump (`jump_clock`: no
worker runs meanwhile, leases lapse). No real time passes anywhere, so every replay of an
example behaves the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import selectors
from collections import Counter, defaultdict
from collections.abc import Coroutine, Sequence
from datetime import timedelta
from typing import Any, TypeVar
from uuid import UUID

import attrs
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from tests.strategies import (
    PAIRS,
    FlowInput,
    clock_steps,
    crash_points,
    deadlines,
    fact_payloads,
    flow_inputs,
    pair_subsets,
    priorities,
)
from umt_backend_memory import MemoryBackend, MemoryStore, MemoryTransaction
from umt_sdk import (
    AttemptInfo,
    Engine,
    Registry,
    RetryPolicy,
    TaskContext,
    TaskPair,
    UsageError,
    Worker,
    connect,
    task,
    with_attempt_token,
)
from umt_sdk._context import current_execution
from umt_sdk._views import with_execution_outcomes
from umt_sdk.backend import TERMINAL_STATUSES, RunRecord, StepRecord
from umt_sdk.testing import FakeClock, freeze_heartbeats, simulate_crash

T = TypeVar("T")

LEASE = timedelta(seconds=5)
POLL = timedelta(milliseconds=20)
GRACE = timedelta(milliseconds=200)
FLAKY_RETRY = RetryPolicy(max_attempts=3, initial=timedelta(seconds=1), backoff=1.0)
COMMITS = "commits"
MAX_LIVE_WORKERS = 4
MAX_RUNS = 8
PAUSE_TARGETS = ("prop.flow", "prop.flow@1", "prop.flow@2", "prop.other@1")
SETTLE_ROUNDS = 50
TIME_SLICE = timedelta(milliseconds=500)
HUNG_AFTER = 600.0  # seconds the loop may skip ahead on its own within one rule

# -- the tasks ------------------------------------------------------------------------------------


@attrs.frozen
class FlowOutput:
    pair: str
    receipt: str | None = None
    fact: int | None = None
    flaky: int | None = None


def op_key(run_id: UUID) -> str:
    return f"submit:{run_id}"


async def _flow(ctx: TaskContext[FlowInput], *, audit: bool) -> FlowOutput:
    obs = _observer()
    spec = ctx.input

    async def prepare() -> str:
        await obs.body_started(ctx, "prepare")
        await obs.gate(ctx, "prepare")
        return "prepared"

    await ctx.step.run("prepare", prepare)
    # Between two steps, in the handler itself, as users write it: wait for the go-ahead or
    # the abort signal, then `ctx.throw_if_canceled()` (a worker stopping is not a cancel).
    await obs.gate(ctx, "handler")

    if audit:

        async def audit_step() -> int:
            await obs.body_started(ctx, "audit")
            return ctx.task_version

        await ctx.step.run("audit", audit_step)

    receipt: str | None = None
    if spec.fenced:
        key = op_key(ctx.run_id)

        async def act(info: AttemptInfo) -> str:
            obs.act_called(key, info)
            await obs.gate(ctx, "act")
            return f"receipt-{info.attempt_token}"

        async def commit(tx: MemoryTransaction, value: str) -> None:
            # An append-only log: one row per commit that really applied.
            tx.put(COMMITS, (key, obs.next_commit_id()), (value, ctx.attempt_token))

        async def submit() -> str:
            await obs.body_started(ctx, "submit")
            return await with_attempt_token(obs.store, key, act, commit=commit)

        receipt = await ctx.step.run("submit", submit)

    if spec.sleep_s:
        await ctx.step.sleep("nap", timedelta(seconds=spec.sleep_s))

    fact: int | None = None
    if spec.wait_fact:
        fact = await ctx.step.wait_for_fact("go", payload_type=int)

    flaky_value: int | None = None
    if spec.fail_times >= 0:

        async def flaky() -> int:
            started = await obs.body_started(ctx, "flaky")
            if started <= spec.fail_times:
                raise ConnectionError(f"flaky body {started} of run {ctx.run_id} fails")
            return started

        flaky_value = await ctx.step.run("flaky", flaky, retry=FLAKY_RETRY)

    async def finish() -> str:
        await obs.body_started(ctx, "finish")
        await obs.gate(ctx, "finish")
        return "done"

    await ctx.step.run("finish", finish)
    return FlowOutput(
        pair=f"{ctx.task_name}@{ctx.task_version}", receipt=receipt, fact=fact, flaky=flaky_value
    )


@task("prop.flow", version=1, retry=RetryPolicy.none())
async def flow_v1(ctx: TaskContext[FlowInput]) -> FlowOutput:
    return await _flow(ctx, audit=False)


@task("prop.flow", version=2, retry=RetryPolicy.none())
async def flow_v2(ctx: TaskContext[FlowInput]) -> FlowOutput:
    return await _flow(ctx, audit=True)


@task("prop.other", version=1, retry=RetryPolicy.none())
async def other_v1(ctx: TaskContext[FlowInput]) -> FlowOutput:
    return await _flow(ctx, audit=False)


REGISTRY = Registry([flow_v1, flow_v2, other_v1])
assert set(REGISTRY.pairs()) == set(PAIRS)


def expected_steps(pair: TaskPair, spec: FlowInput) -> list[str]:
    names = ["prepare"]
    if pair == flow_v2.pair:
        names.append("audit")
    if spec.fenced:
        names.append("submit")
    if spec.sleep_s:
        names.append("nap")
    if spec.wait_fact:
        names.append("go")
    if spec.fail_times >= 0:
        names.append("flaky")
    names.append("finish")
    return names


# -- what the task bodies report ------------------------------------------------------------------


class Observer:
    """What the task bodies saw, and the rules they found broken (checked by the machine)."""

    def __init__(self, backend: MemoryBackend, store: MemoryStore) -> None:
        self.backend = backend
        self.store = store
        self.worker_pairs: dict[str, frozenset[TaskPair]] = {}
        self.starts: Counter[tuple[UUID, str]] = Counter()
        self.started: set[tuple[UUID, str, int]] = set()
        self.acts: dict[str, list[tuple[int, bool]]] = defaultdict(list)
        self.violations: list[str] = []
        self.gates: dict[tuple[UUID, int, str], asyncio.Event] = {}
        self.blocked: set[tuple[UUID, int, str]] = set()
        self.draining = False
        self._commit_ids = itertools.count(1)

    def next_commit_id(self) -> int:
        return next(self._commit_ids)

    async def body_started(self, ctx: TaskContext[FlowInput], step: str) -> int:
        """Count a step body's start and check it was due; returns the starts of (run, step)."""
        execution = current_execution()
        assert execution is not None, "a step body runs inside an execution"
        worker_id = execution.lease.worker_id
        token = ctx.attempt_token
        pair = TaskPair(name=ctx.task_name, version=ctx.task_version)
        served = self.worker_pairs.get(worker_id, frozenset())
        if pair not in served:
            self.violations.append(
                f"worker {worker_id} (serving {sorted(map(str, served))}) ran a body of {pair}"
            )
        key = (ctx.run_id, step, token)
        if key in self.started:
            self.violations.append(f"execution {token} ran the body of {step!r} twice")
        self.started.add(key)
        self.starts[(ctx.run_id, step)] += 1
        count = self.starts[(ctx.run_id, step)]
        record = await self.backend.get_run(ctx.run_id)
        assert record is not None
        for done in record.steps:
            # A record written by this attempt or an earlier one was in (or before) this
            # attempt's claim: replay had to return it instead of running the body again.
            # (A superseded attempt, token < the writer's, may still be inside a body.)
            if done.name == step and done.status == "completed" and done.fencing_token <= token:
                self.violations.append(
                    f"run {ctx.run_id}: execution {token} re-ran the body of {step!r}, "
                    f"completed by execution {done.fencing_token}"
                )
        return count

    def act_called(self, key: str, info: AttemptInfo) -> None:
        earlier = self.acts[key]
        if earlier and not info.resumed:
            self.violations.append(
                f"{key}: attempt {info.attempt_token} was not told it resumes the operation "
                f"begun by {[token for token, _ in earlier]}"
            )
        earlier.append((info.attempt_token, info.resumed))

    async def gate(self, ctx: TaskContext[FlowInput], where: str) -> None:
        """Block this execution until the test opens its gate (or its abort signal fires)."""
        if self.draining or where not in ctx.input.gates:
            return
        key = (ctx.run_id, ctx.attempt_token, where)
        opened = self.gates.setdefault(key, asyncio.Event())
        if opened.is_set():
            return
        self.blocked.add(key)
        waiters = [
            asyncio.ensure_future(opened.wait()),
            asyncio.ensure_future(ctx.abort_event.wait()),
        ]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.blocked.discard(key)
            for waiter in waiters:
                waiter.cancel()
        ctx.throw_if_canceled()


_OBSERVERS: list[Observer] = []


def _observer() -> Observer:
    assert _OBSERVERS, "no state machine is running"
    return _OBSERVERS[-1]


class _ErrorLog(logging.Handler):
    """Collects ERROR records of umt's loggers (an execution ended with an unexpected error)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# -- a deterministic event loop -------------------------------------------------------------------


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock (`loop.time()`, behind every `asyncio.sleep` and timeout) moves
    only when the test moves it, or when the loop has nothing to do but wait for a timer.

    Workers' polls and heartbeats then fire at the same points of every replay of an example, so
    Hypothesis sees the same behaviour each time (real-time timers made rules' preconditions,
    such as "some execution is blocked", differ between replays).
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.skipped = 0.0
        self.watched: asyncio.Task[Any] | None = None
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def skip(self, seconds: float) -> None:
        """Nothing can happen before a timer `seconds` away: go there at once."""
        self.now += seconds
        self.skipped += seconds
        if self.skipped > HUNG_AFTER:
            self.hung()

    def hung(self) -> None:
        if self.watched is not None and not self.watched.done():
            self.watched.cancel()


class _JumpingSelector(selectors.BaseSelector):
    """Wraps the real selector: an idle loop waiting for a timer jumps its clock instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._inner = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return self._inner.select(timeout)
        ready = self._inner.select(0)
        if ready:
            return ready
        if timeout is None:  # no timer at all: only another thread could wake the loop
            ready = self._inner.select(10.0)
            if not ready:
                self._loop.hung()
            return ready
        self._loop.skip(timeout)
        return []

    def get_map(self) -> Any:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()


# -- the model ------------------------------------------------------------------------------------


@attrs.define
class RunModel:
    pair: TaskPair
    spec: FlowInput
    fact: int | None = None
    canceled_at_once: bool = False
    cancel_requested: bool = False
    deadline: timedelta | None = None


@attrs.define
class Snapshot:
    status: str
    output_json: str | None
    fencing_token: int
    max_token: int
    lease_expires_at: Any
    steps: dict[tuple[str, int], StepRecord]


class EngineMachine(RuleBasedStateMachine):
    runs = Bundle("runs")

    def __init__(self) -> None:
        super().__init__()
        self.failed = False
        self.loop = VirtualTimeLoop()
        self.loop.set_exception_handler(self._on_loop_error)
        self.loop_errors: list[str] = []
        self.errors = _ErrorLog()
        logging.getLogger("umt").addHandler(self.errors)
        self.clock = FakeClock(auto_advance=False)
        self.engine: Engine = self._run(connect("memory://", registry=REGISTRY, clock=self.clock))
        backend = self.engine.backend
        assert isinstance(backend, MemoryBackend)
        self.backend = backend
        self.store = MemoryStore()
        self.obs = Observer(backend, self.store)
        _OBSERVERS.append(self.obs)
        self.armed: set[tuple[str, UUID, str]] = set()
        self.countdowns: dict[tuple[str, str], int] = {}
        self.crashes: list[tuple[str, UUID, str]] = []
        self.backend.crash_hook = self._crash_hook
        self.models: dict[UUID, RunModel] = {}
        self.order: dict[UUID, int] = {}
        self.cancels = 0
        self.workers: list[Worker] = []
        self.frozen: set[str] = set()
        self.worker_numbers = itertools.count(1)
        self.snapshots: dict[UUID, Snapshot] = {}
        self.seen_commits: set[Any] = set()
        self.paused: set[tuple[str, int | None]] = set()
        """The pauses the rules stored: (task name, version or None for every version)."""
        self.resumed_at_drain = False
        self.executions_at_pause: dict[UUID, int] = {}
        """For each run of a paused pair: its executions when the pause began (or 0 when it
        was enqueued paused). While the pause lasts, no claim may add one."""

    # -- plumbing ---------------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the machine's loop; it is canceled if it hangs."""
        task = self.loop.create_task(coro)
        self.loop.watched, self.loop.skipped = task, 0.0
        try:
            return self.loop.run_until_complete(task)
        except asyncio.CancelledError:
            self.failed = True
            raise AssertionError(f"{coro.__qualname__} hung") from None
        except BaseException:
            self.failed = True
            raise
        finally:
            self.loop.watched = None

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.loop_errors.append(str(context.get("message")) + ": " + repr(context.get("exception")))

    def _crash_hook(self, operation: str, run_id: UUID, phase: str) -> bool:
        key = (operation, run_id, phase)
        if key in self.armed:
            self.armed.discard(key)
            self.crashes.append(key)
            return True
        left = self.countdowns.get((operation, phase))
        if left is not None:
            if left > 0:
                self.countdowns[(operation, phase)] = left - 1
                return False
            del self.countdowns[(operation, phase)]
            self.crashes.append(key)
            return True
        return False

    async def _settle(self, rounds: int = SETTLE_ROUNDS) -> None:
        for _ in range(rounds):
            await asyncio.sleep(0)

    async def _pass_time(self, delta: timedelta) -> None:
        """Let `delta` pass for everyone, in slices: workers poll and heartbeat as it goes."""
        while delta > timedelta(0):
            step = min(delta, TIME_SLICE)
            delta -= step
            self.clock.advance(step)
            self.loop.advance(step.total_seconds())
            await self._settle()

    def _blocked(self) -> list[tuple[UUID, int, str]]:
        """The blocked bodies, in an order that is the same on every replay."""
        return sorted(self.obs.blocked, key=lambda k: (self.order[k[0]], k[1], k[2]))

    async def _start_worker(
        self, pairs: Sequence[TaskPair], concurrency: int, label: str = "w"
    ) -> Worker:
        worker_id = f"{label}{next(self.worker_numbers)}[{','.join(map(str, pairs))}]"
        worker = self.engine.worker(
            versions=list(pairs),
            concurrency=concurrency,
            lease=LEASE,
            worker_id=worker_id,
            poll_interval=POLL,
            shutdown_grace=GRACE,
        )
        self.obs.worker_pairs[worker_id] = frozenset(worker.pairs)
        await worker.start()
        self.workers.append(worker)
        return worker

    def _pick_worker(self, choice: int) -> Worker:
        return self.workers[choice % len(self.workers)]

    # -- rules ------------------------------------------------------------------------------------

    @initialize(
        target=runs,
        first=st.lists(
            st.tuples(st.sampled_from(PAIRS), flow_inputs(), priorities), min_size=1, max_size=3
        ),
    )
    def first_runs(self, first: list[tuple[TaskPair, FlowInput, int]]) -> MultipleResults[UUID]:
        return multiple(*(self.enqueue(pair, spec, priority) for pair, spec, priority in first))

    @initialize(pairs=pair_subsets(), concurrency=st.sampled_from([1, 4]))
    def first_worker(self, pairs: list[TaskPair], concurrency: int) -> None:
        self.start_worker(pairs, concurrency)

    @precondition(lambda self: len(self.models) < MAX_RUNS)
    @rule(target=runs, pair=st.sampled_from(PAIRS), spec=flow_inputs(), priority=priorities)
    def enqueue(self, pair: TaskPair, spec: FlowInput, priority: int) -> UUID:
        async def go() -> UUID:
            handle = await self.engine.enqueue(str(pair), spec, priority=priority)
            assert handle.created
            assert (handle.task_name, handle.task_version) == (pair.name, pair.version)
            self.models[handle.run_id] = RunModel(pair=pair, spec=spec)
            self.order[handle.run_id] = len(self.order)
            if self._is_paused(pair):
                self.executions_at_pause[handle.run_id] = 0
            await self._settle()
            return handle.run_id

        return self._run(go())

    @precondition(lambda self: len(self.models) < MAX_RUNS)
    @rule(target=runs, pair=st.sampled_from(PAIRS), spec=flow_inputs(), deadline=deadlines)
    def enqueue_with_deadline(self, pair: TaskPair, spec: FlowInput, deadline: timedelta) -> UUID:
        """A run that must be finished within `deadline`: past it, it ends failed with
        `DeadlineExceededError` wherever it is (running, parked, pending) and starts no step."""

        async def go() -> UUID:
            handle = await self.engine.enqueue(str(pair), spec, deadline=deadline)
            self.models[handle.run_id] = RunModel(pair=pair, spec=spec, deadline=deadline)
            self.order[handle.run_id] = len(self.order)
            record = await self.backend.get_run(handle.run_id)
            assert record is not None
            assert record.deadline_at == record.created_at + deadline
            await self._settle()
            return handle.run_id

        return self._run(go())

    @precondition(lambda self: len(self.workers) < MAX_LIVE_WORKERS)
    @rule(pairs=pair_subsets(), concurrency=st.sampled_from([1, 4]))
    def start_worker(self, pairs: list[TaskPair], concurrency: int) -> None:
        async def go() -> None:
            await self._start_worker(pairs, concurrency)
            await self._settle()

        self._run(go())

    @precondition(lambda self: self.workers)
    @rule(choice=st.integers(min_value=0, max_value=7))
    def stop_worker(self, choice: int) -> None:
        """A graceful stop: handlers stop at their next step boundary and runs are given back."""
        worker = self._pick_worker(choice)
        self.workers.remove(worker)

        async def go() -> None:
            await worker.stop()
            assert not worker.running_runs
            await self._settle()

        self._run(go())

    @precondition(lambda self: self.workers)
    @rule(choice=st.integers(min_value=0, max_value=7))
    def crash_worker(self, choice: int) -> None:
        """The whole worker vanishes (SIGKILL): its leases are left to expire."""
        worker = self._pick_worker(choice)
        self.workers.remove(worker)

        async def go() -> None:
            held = {
                r.run_id: r.fencing_token
                for r in self.backend.runs()
                if r.status == "running" and r.lease_owner == worker.worker_id
            }
            simulate_crash(worker)
            await worker.stop()
            await self._settle()
            for run_id, token in held.items():
                record = await self.backend.get_run(run_id)
                assert record is not None
                if record.fencing_token == token and record.status == "running":
                    # Nothing gave it back: it stays held until the lease runs out.
                    assert record.lease_owner == worker.worker_id

        self._run(go())

    @rule(run=runs, point=crash_points)
    def arm_crash_of_run(self, run: UUID, point: tuple[str, str]) -> None:
        """The next `operation` for `run` crashes its caller (before or after it applies)."""
        operation, phase = point
        self.armed.add((operation, run, phase))

    @rule(point=crash_points, skip=st.integers(min_value=0, max_value=2))
    def arm_crash(self, point: tuple[str, str], skip: int) -> None:
        """The `skip + 1`-th next `operation` of any run crashes its caller."""
        self.countdowns[point] = skip

    @rule(run=runs, payload=fact_payloads)
    def signal(self, run: UUID, payload: int) -> None:
        self._run(self._signal(run, payload))

    async def _signal(self, run: UUID, payload: int) -> None:
        model = self.models[run]
        created = await self.engine.signal(run, "go", payload)
        assert created == (model.fact is None), "facts are first-write-wins"
        if model.fact is None:
            model.fact = payload
        [fact] = await self.backend.get_facts(run_id=run, name="go")
        assert json.loads(fact.payload_json) == model.fact
        await self._settle()

    @precondition(lambda self: 2 * self.cancels < len(self.models))
    @rule(run=runs)
    def cancel(self, run: UUID) -> None:
        async def go() -> None:
            before = await self.backend.get_run(run)
            assert before is not None
            outcome = await self.engine.cancel(run, reason="property test")
            self.cancels += 1
            after = await self.backend.get_run(run)
            assert after is not None
            model = self.models[run]
            if before.status in TERMINAL_STATUSES:
                assert outcome == "already_finished"
                assert after.status == before.status
            elif before.status == "running" and (
                before.lease_expires_at is not None and before.lease_expires_at > self.clock.now()
            ):
                assert outcome == "requested"
                model.cancel_requested = True
            else:
                assert outcome == "canceled", (before.status, outcome)
                assert after.status == "canceled"
                model.canceled_at_once = True
            await self._settle()

        self._run(go())

    def _is_paused(self, pair: TaskPair) -> bool:
        return (pair.name, None) in self.paused or (pair.name, pair.version) in self.paused

    @rule(which=st.sampled_from(PAUSE_TARGETS))
    def pause(self, which: str) -> None:
        """Pause a task (one version, or every version): its runs wait, running ones go on."""

        async def go() -> None:
            name, _, version = which.partition("@")
            key = (name, int(version) if version else None)
            for run in self.backend.runs():  # before the pause: nothing moves in between
                if self.models[run.run_id].pair not in self._paused_pairs():
                    self.executions_at_pause.setdefault(run.run_id, len(run.executions))
            stored = await self.engine.pause(which)
            assert stored == (key not in self.paused), "a pause is stored once"
            self.paused.add(key)
            for run in self.backend.runs():
                if not self._is_paused(self.models[run.run_id].pair):
                    self.executions_at_pause.pop(run.run_id, None)
            await self._settle()

        self._run(go())

    def _paused_pairs(self) -> set[TaskPair]:
        return {p for p in PAIRS if self._is_paused(p)}

    @precondition(lambda self: self.paused)
    @rule(which=st.sampled_from(PAUSE_TARGETS))
    def resume(self, which: str) -> None:
        """Resume a task: `name` lifts every pause of it; `name@version` that version's, and
        is refused while the whole task is paused."""

        async def go() -> None:
            name, _, version = which.partition("@")
            if version and (name, None) in self.paused:
                with contextlib.suppress(UsageError):
                    await self.engine.resume(which)
                    raise AssertionError(f"resume({which!r}) of a task paused as a whole")
                return
            removed = {
                k
                for k in self.paused
                if k[0] == name and (not version or k == (name, int(version)))
            }
            assert await self.engine.resume(which) == bool(removed)
            self.paused -= removed
            for run_id in list(self.executions_at_pause):
                if not self._is_paused(self.models[run_id].pair):
                    del self.executions_at_pause[run_id]
            await self._settle()

        self._run(go())

    @rule(delta=clock_steps)
    def pass_time(self, delta: timedelta) -> None:
        """Time passes for everyone: live workers heartbeat, their leases hold."""
        self._run(self._pass_time(delta))

    @rule(delta=clock_steps)
    def jump_clock(self, delta: timedelta) -> None:
        """The clock jumps while no worker gets to run (a pause of every process): leases
        are not renewed, and runs whose lease ran out may be taken over."""

        async def go() -> None:
            self.clock.advance(delta)
            await self._settle()

        self._run(go())

    @rule(rounds=st.integers(min_value=1, max_value=60))
    def let_it_run(self, rounds: int) -> None:
        self._run(self._settle(rounds))

    @precondition(lambda self: self.obs.blocked)
    @rule(choice=st.integers(min_value=0, max_value=7))
    def open_gate(self, choice: int) -> None:
        blocked = self._blocked()
        key = blocked[choice % len(blocked)]

        async def go() -> None:
            self.obs.gates[key].set()
            await self._settle()

        self._run(go())

    @precondition(lambda self: any(w.running_runs for w in self.workers))
    @rule(choice=st.integers(min_value=0, max_value=7), stale_first=st.booleans())
    def stale_worker_resumes(self, choice: int, stale_first: bool) -> None:
        """Freeze a worker's heartbeats, let its leases expire and another worker take its runs
        over, then let the frozen one go on: none of its writes may land."""
        busy = [w for w in self.workers if w.running_runs]
        stale = busy[choice % len(busy)]
        self._run(self._stale(stale, stale_first))

    async def _stale(self, stale: Worker, stale_first: bool) -> None:
        freeze_heartbeats(stale)
        self.frozen.add(stale.worker_id)
        held: dict[UUID, tuple[int, str]] = {}
        for run_id, token, where in self._blocked():
            record = await self.backend.get_run(run_id)
            assert record is not None
            if record.fencing_token == token and record.lease_owner == stale.worker_id:
                held[run_id] = (token, where)
        await self._pass_time(LEASE + timedelta(seconds=1))
        # The taker has a slot for every run, so every expired lease is taken over.
        await self._start_worker(list(PAIRS), concurrency=MAX_RUNS, label="taker")
        await self._settle()
        self._check_state()
        for run_id, (token, where) in held.items():
            record = await self.backend.get_run(run_id)
            assert record is not None
            if record.status in TERMINAL_STATUSES:
                continue  # a canceled run is finished by the claim instead
            if self._is_paused(self.models[run_id].pair):
                assert record.fencing_token == token, "a paused pair's lapsed lease waits"
                continue
            assert record.fencing_token > token, "an expired lease is taken over"
            if not stale_first:
                # The new holder goes first, as far as its next gate.
                for key in [k for k in self._blocked() if k[:2] == (run_id, record.fencing_token)]:
                    self.obs.gates[key].set()
                await self._settle()
                record = await self.backend.get_run(run_id)
                assert record is not None
            commits_before = self.store.rows(COMMITS)
            steps_before = {(s.name, s.attempt): s for s in record.steps}
            self.obs.gates[(run_id, token, where)].set()
            await self._settle()
            # Released from a gate in the handler, it may run the next step's body before it
            # writes anything (its heartbeats are frozen): let it through its later gates too.
            for _ in range(4):  # at most one gate of each kind
                later = [k for k in self.obs.blocked if k[:2] == (run_id, token)]
                if not later:
                    break
                for key in later:
                    self.obs.gates[key].set()
                await self._settle()
            assert not [k for k in self.obs.blocked if k[:2] == (run_id, token)], (
                "the superseded execution stops at its first write"
            )
            after = await self.backend.get_run(run_id)
            assert after is not None
            for s in after.steps:
                if steps_before.get((s.name, s.attempt)) != s:
                    assert s.fencing_token != token, f"stale write {s} landed"
            for row_key, (_, row_token) in self.store.rows(COMMITS).items():
                if row_key not in commits_before:
                    assert row_token != token, "the stale attempt's side effect committed"
            [execution] = [e for e in after.executions if e.fencing_token == token]
            assert execution.outcome == "interrupted"
            if run_id in stale.running_runs:
                # Only as a new claim of its own, never as the superseded execution.
                assert after.lease_owner == stale.worker_id
                assert after.fencing_token != token
            self._check_state()

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def records_keep_the_rules(self) -> None:
        try:
            self._check_state()
        except BaseException:
            self.failed = True
            raise

    def _check_state(self) -> None:
        assert not self.obs.violations, self.obs.violations
        assert not self.errors.messages, self.errors.messages
        assert not self.loop_errors, self.loop_errors
        now = self.clock.now()
        facts = {(f.run_id, f.name) for f in self.backend.facts()}
        # The runs as the SDK reads them (a lapsed `running` execution reads `interrupted`).
        records = [with_execution_outcomes(r) for r in self.backend.runs()]
        assert {r.run_id for r in records} == set(self.models)
        all_tokens: list[int] = []
        for run in records:
            self._check_run(run, facts, now)
            all_tokens.extend(e.fencing_token for e in run.executions)
        assert len(all_tokens) == len(set(all_tokens)), "fencing tokens are never reused"
        self._check_commits(records)
        for run in records:
            frozen = self.executions_at_pause.get(run.run_id)
            assert frozen is None or len(run.executions) <= frozen, (
                f"run {run.run_id} of paused pair {self.models[run.run_id].pair} was claimed "
                f"while paused: {run.executions}"
            )
        for run in records:
            self.snapshots[run.run_id] = Snapshot(
                status=run.status,
                output_json=run.output_json,
                fencing_token=run.fencing_token,
                max_token=max((e.fencing_token for e in run.executions), default=0),
                lease_expires_at=run.lease_expires_at,
                steps={(s.name, s.attempt): s for s in run.steps},
            )
        self.seen_commits = set(self.store.rows(COMMITS))

    def _check_run(self, run: RunRecord, facts: set[tuple[UUID | None, str]], now: Any) -> None:
        model = self.models[run.run_id]
        rid = run.run_id
        executions = list(run.executions)
        tokens = [e.fencing_token for e in executions]
        assert all(a < b for a, b in itertools.pairwise(tokens)), (rid, tokens)
        live = [e for e in executions if e.outcome == "running"]
        assert len(live) <= 1, f"run {rid} held by two live leases: {live}"
        if live:
            assert live[0] is executions[-1], (rid, executions)
            assert run.status == "running"
            assert run.lease_owner == live[0].worker_id
            assert run.lease_expires_at is not None
            assert run.lease_expires_at > now
        if executions:
            assert run.fencing_token == tokens[-1]
            assert run.claims == len(executions)
        if run.status == "running":
            assert executions
            assert executions[-1].outcome in ("running", "interrupted")
        # The pair a run belongs to never changes, and only workers of that pair hold it.
        assert (run.task_name, run.task_version) == (model.pair.name, model.pair.version)
        for e in executions:
            assert model.pair in self.obs.worker_pairs[e.worker_id], (rid, e.worker_id)
        # Every recorded step was written by one of the run's executions ...
        for s in run.steps:
            assert s.fencing_token in tokens, (rid, s)
        previous = self.snapshots.get(rid)
        if previous is not None:
            # ... and never by an attempt older than one claimed before the write.
            for s in run.steps:
                if previous.steps.get((s.name, s.attempt)) != s:
                    assert s.fencing_token >= previous.max_token, (
                        f"run {rid}: stale write by {s.fencing_token} after "
                        f"{previous.max_token} was claimed: {s}"
                    )
            for key in previous.steps:
                assert key in {(s.name, s.attempt) for s in run.steps}, "records are never lost"
            if previous.status in TERMINAL_STATUSES:
                assert run.status == previous.status, (rid, previous.status, run.status)
                assert run.output_json == previous.output_json
            # A lease is taken over only after it expired.
            if previous.status == "running" and previous.lease_expires_at is not None:
                holder = [e for e in executions if e.fencing_token == previous.fencing_token]
                newer = [e for e in executions if e.fencing_token > previous.fencing_token]
                if holder and newer and holder[0].outcome == "interrupted":
                    assert newer[0].claimed_at >= previous.lease_expires_at, (
                        f"run {rid}: execution {newer[0].fencing_token} claimed at "
                        f"{newer[0].claimed_at} while {previous.fencing_token}'s lease ran "
                        f"until {previous.lease_expires_at}"
                    )
        # A run past its deadline never starts a step (its handler may still be unwinding),
        # and a parked or pending one is claimable by then, to be ended.
        if run.deadline_at is not None:
            for s in run.steps:
                assert s.started_at is None or s.started_at < run.deadline_at, (
                    f"run {rid}: step {s.name!r} started at {s.started_at}, past the run's "
                    f"deadline {run.deadline_at}"
                )
            if run.status in ("pending", "waiting"):
                assert run.available_at is not None, f"run {rid} parked past its deadline"
                assert run.available_at <= run.deadline_at, (rid, run.available_at)
            if run.status == "completed":
                assert executions[-1].claimed_at < run.deadline_at, (rid, run.deadline_at)
        # No lost wake-up: a run parked on a fact that exists must have been woken: claimable
        # now (it keeps `wait_for` until a claim takes it, on both backends).
        if run.status == "waiting" and run.wait_for is not None:
            woken = run.available_at is not None and run.available_at <= now
            lost = f"run {rid} sleeps on fact {run.wait_for!r} that was already signalled"
            assert woken or (rid, run.wait_for) not in facts, lost
            assert woken or (None, run.wait_for) not in facts, lost
        # A run whose cancel was requested is never parked for good.
        if run.cancel_requested_at is not None:
            assert not (run.status == "waiting" and run.available_at is None), (
                f"run {rid}: cancel requested but parked without a deadline"
            )
        if model.canceled_at_once:
            assert run.status == "canceled"
        if run.status == "completed":
            assert executions[-1].outcome == "completed"
            assert [e.outcome for e in executions].count("completed") == 1

    def _check_commits(self, records: list[RunRecord]) -> None:
        by_id = {r.run_id: r for r in records}
        ledger = self.backend.ledger_entries()
        per_op: dict[str, list[tuple[Any, str, int]]] = defaultdict(list)
        for row_key, (receipt, token) in self.store.rows(COMMITS).items():
            per_op[row_key[0]].append((row_key, receipt, token))
        for key, rows in per_op.items():
            assert len(rows) == 1, f"{key} committed {len(rows)} times: {rows}"
            [(row_key, receipt, token)] = rows
            run_id = UUID(key.removeprefix("submit:"))
            run = by_id[run_id]
            assert token in [e.fencing_token for e in run.executions]
            assert receipt == f"receipt-{token}"
            assert ledger.get(key) == json.dumps(receipt), (key, ledger.get(key))
            previous = self.snapshots.get(run_id)
            if row_key not in self.seen_commits and previous is not None:
                assert token >= previous.max_token, f"stale commit by {token} in {key}"
            completed = [s for s in run.steps if s.name == "submit" and s.status == "completed"]
            for s in completed:
                assert s.output_json == json.dumps(receipt), (s, receipt)
        for key, result in ledger.items():
            if result is not None:
                assert key in per_op, f"{key} has a result but no commit"

    # -- the end --------------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if not self.failed:
                self._run(self._drain())
        finally:
            self._shutdown()

    async def _drain(self) -> None:
        """Signal every fact, open every gate, serve every pair, and let time pass: every run
        must end, and end the way its shape and the cancels say."""
        self.armed.clear()
        self.countdowns.clear()
        self.obs.draining = True
        if self.paused:
            self.resumed_at_drain = True
        for name in sorted({name for name, _ in self.paused}):
            assert await self.engine.resume(name)  # resume lets them all run (checked below)
        self.paused.clear()
        self.executions_at_pause.clear()
        for gate in self.obs.gates.values():
            gate.set()
        await self._start_worker(list(PAIRS), concurrency=16, label="drain")
        for run_id, model in self.models.items():
            if model.fact is None:
                await self._signal(run_id, 7)
        for _ in range(60):  # two virtual minutes: the longest sleep, retries and lease expiries
            await self._settle()
            self._check_state()
            if all(r.status in TERMINAL_STATUSES for r in self.backend.runs()):
                break
            await self._pass_time(timedelta(seconds=2))
        else:
            stuck = [
                (r.run_id, r.status, r.lease_owner, r.lease_expires_at, r.executions)
                for r in self.backend.runs()
                if r.status not in TERMINAL_STATUSES
            ]
            loops = [
                (w.worker_id, w.running_runs, [(t.get_name(), t.done()) for t in w._tasks])
                for w in self.workers
            ]
            raise AssertionError(f"runs did not finish at {self.clock.now()}: {stuck}; {loops}")
        records = [with_execution_outcomes(r) for r in self.backend.runs()]
        for run in records:
            self._check_final(run)
        if not currently_in_test_context():
            return
        for run in records:
            event(f"run ended {run.status}")
            if run.error is not None and run.error.type == "umt_sdk.DeadlineExceededError":
                event("a run ended at its deadline")
            if len(run.executions) > 1 and any(e.outcome == "interrupted" for e in run.executions):
                event("a run was taken over")
        event(f"crashes fired: {min(len(self.crashes), 3)}")
        event(f"runs: {min(len(records), 4)}")
        if self.frozen:
            event("a worker was frozen")
        if self.resumed_at_drain:
            event("paused runs were resumed by the drain")

    def _check_final(self, run: RunRecord) -> None:
        model = self.models[run.run_id]
        spec = model.spec
        what = (run.run_id, spec, run.status, run.error)
        if run.error is not None and run.error.type == "umt_sdk.LeaseLostTooOftenError":
            # The rules took it over again and again without letting it record a step: the
            # lost-lease bound ends it, and only then.
            assert run.status == "failed", what
            newest = max((s.fencing_token for s in run.steps), default=0)
            lost = [
                e
                for e in run.executions
                if e.outcome == "interrupted" and e.fencing_token >= newest
            ]
            limit = REGISTRY.get(run.task_name, run.task_version).max_lost_leases
            # The claim that found `limit` lost leases fails the run at once; if that write
            # itself was cut off (a crash before it landed), the next claim fails it again.
            # Such executions ran no handler: no step of theirs was ever named.
            assert len(lost) >= limit, (what, run.executions)
            for late in lost[limit:]:
                assert late.current_step is None, (what, run.executions)
            assert run.executions[-1].outcome == "failed", (what, run.executions)
            return
        if run.error is not None and run.error.type == "umt_sdk.DeadlineExceededError":
            assert model.deadline is not None, what
            assert run.status == "failed", what
            assert run.deadline_at is not None
            assert run.finished_at is not None
            assert run.finished_at >= run.deadline_at, what
            assert not model.canceled_at_once, what
            return
        if model.canceled_at_once:
            assert run.status == "canceled", what
        elif model.cancel_requested:
            assert run.status in TERMINAL_STATUSES, what
        elif spec.fail_times >= 3:
            assert run.status in ("completed", "failed"), what
        else:
            assert run.status == "completed", what
        if run.status == "failed":
            assert spec.fail_times >= 3, what
            assert run.error is not None
            assert run.error.type == "umt_sdk.StepFailedError", what
            failed = [s for s in run.steps if s.name == "flaky" and s.status == "failed"]
            assert [s.attempt for s in failed] == [FLAKY_RETRY.max_attempts], what
        if run.status != "completed":
            return
        output = json.loads(run.output_json or "null")
        assert output["pair"] == str(model.pair)
        names = expected_steps(model.pair, spec)
        completed = {s.name for s in run.steps if s.status == "completed"}
        assert completed == set(names), (what, completed)
        for name in names:
            body_runs = self.obs.starts[(run.run_id, name)]
            if name not in ("nap", "go"):
                assert body_runs >= 1, (what, name)
        if spec.wait_fact:
            assert output["fact"] == model.fact, "the first signalled payload is the fact"
        if spec.fenced:
            rows = [v for k, v in self.store.rows(COMMITS).items() if k[0] == op_key(run.run_id)]
            assert len(rows) == 1, rows
            assert output["receipt"] == rows[0][0]
        if spec.fail_times >= 0:
            assert output["flaky"] > spec.fail_times, what
            retries = [s for s in run.steps if s.name == "flaky" and s.status == "retrying"]
            assert len(retries) <= spec.fail_times

    def _shutdown(self) -> None:
        loop = self.loop
        try:
            self.backend.crash_hook = None
            self.obs.draining = True
            for gate in self.obs.gates.values():
                gate.set()
            with contextlib.suppress(Exception):
                loop.run_until_complete(self.engine.close())
            pending = asyncio.all_tasks(loop)
            for pending_task in pending:
                pending_task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
            logging.getLogger("umt").removeHandler(self.errors)
            _OBSERVERS.remove(self.obs)


TestEngineStateMachine = EngineMachine.TestCase
TestEngineStateMachine.settings = settings(
    stateful_step_count=30,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_renewed_lease_is_not_taken_over() -> None:
    """A run whose lease expired, was seen by a claim of another pair (which moved it to the
    ready runs), and was then renewed by its holder recording a step, is not claimable: the
    machine above once found a worker taking such a live lease over."""
    flow, other = PAIRS[0], PAIRS[2]
    machine = EngineMachine()
    try:
        machine.start_worker([flow], concurrency=1)
        machine.enqueue(flow, FlowInput(gates=("finish", "prepare"), fenced=False), priority=0)
        machine.start_worker([other], concurrency=1)
        machine.jump_clock(LEASE + timedelta(seconds=1))  # the lease expires; nobody takes it
        machine.records_keep_the_rules()
        machine.open_gate(0)  # "prepare" is recorded (the lease renewed); "finish" blocks
        machine.records_keep_the_rules()
        assert len(machine.obs.blocked) == 1
        machine.start_worker([flow], concurrency=1)
        machine.records_keep_the_rules()
        [run] = machine.backend.runs()
        assert [e.outcome for e in run.executions] == ["running"]
    finally:
        machine.teardown()
