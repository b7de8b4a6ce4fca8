"""The crash explorer: run a task once without a crash, then once per point it passed with a
crash there (and, at `depth=2`, once per pair), and check what a crash may never change.

Every exploration runs from a fresh state (`setup()`), on a fresh memory engine under a fresh
`FakeClock`, with the same run id and the same seed of `random`, so the only difference between
two explorations is where the execution was cut off. A crash is a lost lease: the execution
stops writing at once (`_probe`), its lease lapses, and the next execution takes the run over
from its records, as after a SIGKILL. What is checked at every crash, and why it can fail:

- the run ends as the crash-free run did (same output, or the same error): a step whose output
  depends on the clock, randomness or outside state records another value when a crash makes it
  run again; code between steps that does the same changes the path;
- no step body starts again once its completion is recorded (the engine's promise);
- each `with_attempt_token` operation commits exactly once (the ledger's promise);
- `invariant(state)` holds at the end (the user's promise);
- no step runs twice and changes the state both times: a side effect outside
  `with_attempt_token` that is not idempotent (writes made by a fenced commit do not count).
"""

from __future__ import annotations

import copy
import inspect
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar
from uuid import UUID

from attrs import evolve, field, frozen

from umt_sdk import _check as check
from umt_sdk import _probe, _serde
from umt_sdk._engine import connect
from umt_sdk._probe import Point
from umt_sdk._spi import NewRun, RunRecord
from umt_sdk._task import Registry, TaskDefinition
from umt_sdk.exceptions import UmtError, UsageError
from umt_sdk.testing._clock import FakeClock
from umt_sdk.testing._inline import Facts, drive

__all__ = ["CrashPoint", "CrashReport", "Exploration", "explore_crashes"]

S = TypeVar("S")

_RUN_ID = UUID("00000000-0000-7000-8000-0000000e4a10")
_START = datetime(2030, 1, 1, tzinfo=UTC)
_SEED = 20301

_LABELS: dict[str, str] = {
    "step.before": "before",
    "step.returned": "after",
    "op.begin": "begin",
    "op.action": "action",
    "op.acted": "acted",
    "op.commit": "commit",
    "op.committed": "committed",
    "park": "park",
    "end": "end",
}


@frozen(kw_only=True)
class CrashPoint:
    """A place an execution can be cut off: the `occurrence`-th time the run reaches `label`."""

    label: str
    """`before:charge`, `after:charge`, `acted:charge:o-1`, `park:approval`, `end:completed`."""
    occurrence: int = 1
    description: str = field(default="", eq=False)
    """As a reader says it: "crash after step 'charge' returned, before its record was stored"."""

    @property
    def id(self) -> str:
        """What `only=` takes: the label, with `[n]` for a later pass (`before:charge[2]`)."""
        return self.label if self.occurrence == 1 else f"{self.label}[{self.occurrence}]"

    def __str__(self) -> str:
        return self.id


@frozen(kw_only=True)
class Exploration:
    """One run of the task with crashes at `crashes`, in order, and what went wrong."""

    crashes: tuple[CrashPoint, ...]
    problems: tuple[str, ...]
    step_starts: dict[str, int]
    """How many times each step's body started (all attempts)."""
    outcome: str

    @property
    def ok(self) -> bool:
        return not self.problems


@frozen(kw_only=True)
class CrashReport(Generic[S]):
    """What `explore_crashes` found: `ok`, and `explain()` for a reader."""

    task: str
    depth: int
    points: tuple[CrashPoint, ...]
    """The crash points of the crash-free run, in the order it passed them."""
    baseline: Exploration
    """The crash-free run."""
    explorations: tuple[Exploration, ...]
    """One per crash schedule tried, in order."""
    notes: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def failures(self) -> tuple[Exploration, ...]:
        return tuple(e for e in (self.baseline, *self.explorations) if not e.ok)

    @property
    def ok(self) -> bool:
        return not self.failures

    def explain(self) -> str:
        """The findings, one paragraph per failing crash, each with a reproducer."""
        failures = self.failures
        head = (
            f"explored {len(self.explorations)} crash schedule(s) of {self.task} "
            f"(depth {self.depth}, {len(self.points)} crash points) in {self.seconds:.2f} s: "
        )
        lines = [head + ("every one ended as the crash-free run did" if self.ok else "")]
        if not self.ok:
            lines[0] += f"{len(failures)} failed"
        lines += [f"note: {note}" for note in self.notes]
        for number, failure in enumerate(failures, 1):
            if failure.crashes:
                where = ", then ".join(c.description for c in failure.crashes)
            else:
                where = "without a crash"
            lines.append(f"{number}. {where}:")
            lines += [f"   - {problem}" for problem in failure.problems]
            if failure.crashes:
                only = _only_argument(failure.crashes)
                lines.append(f"   reproduce: explore_crashes(..., only={only})")
        return "\n".join(lines)


def _times(count: int) -> str:
    return {1: "once", 2: "twice"}.get(count, f"{count} times")


def _only_argument(crashes: Sequence[CrashPoint]) -> str:
    if len(crashes) == 1:
        return repr(crashes[0].id)
    return repr([c.id for c in crashes])


def _describe(point: Point, step: str | None) -> str:
    name = point.name
    inside = f" in step {step!r}" if step else ""
    if point.kind == "step.before":
        again = f" (attempt {point.attempt})" if point.attempt > 1 else ""
        return f"crash before step {name!r} started{again}"
    if point.kind == "step.returned":
        return f"crash after step {name!r} returned, before its record was stored"
    if point.kind == "op.begin":
        return f"crash before with_attempt_token({name!r}) began{inside}"
    if point.kind == "op.action":
        return f"crash after with_attempt_token({name!r}) began, before its action ran{inside}"
    if point.kind == "op.acted":
        return f"crash after the action of with_attempt_token({name!r}), before its commit{inside}"
    if point.kind == "op.commit":
        return (
            f"crash inside the commit of with_attempt_token({name!r}), before its result "
            f"was recorded{inside}"
        )
    if point.kind == "op.committed":
        return f"crash after with_attempt_token({name!r}) committed{inside}"
    if point.kind == "park":
        what = {"sleep": "sleep", "fact": "the wait for fact", "step": "the retry of step"}
        return f"crash before {what.get(point.step_kind or '', 'step')} {name!r} parked the run"
    return f"crash before the run's {name} ending was stored"


class _Snapshots:
    """Compares the user's state before and after each stretch of a step's body, leaving out
    what a fenced commit wrote."""

    def __init__(self, state: Any, snapshot: Callable[[Any], Any] | None) -> None:
        self._state = state
        self._take = snapshot or copy.deepcopy
        self.usable = True
        try:
            if snapshot is None and self._take(state) != state:
                self.usable = False  # compares by identity: every copy differs
        except Exception:
            self.usable = False
        self._base: Any = None

    def start(self) -> None:
        if self.usable:
            self._base = self._take(self._state)

    def changed(self) -> bool:
        """Whether the state changed since `start`; starts again from now."""
        if not self.usable:
            return False
        now = self._take(self._state)
        differs = bool(now != self._base)
        self._base = now
        return differs


class _Observer:
    """Counts the points a run passes, crashes it at the scheduled ones, and notes what the
    checks need: body starts, recorded steps, commits, state changes by body run."""

    def __init__(self, schedule: Sequence[CrashPoint], snapshots: _Snapshots) -> None:
        self._schedule = list(schedule)
        self._snapshots = snapshots
        self.passes: Counter[str] = Counter()
        self.points: list[tuple[CrashPoint, Point]] = []
        self.fired: list[CrashPoint] = []
        self.tail: list[CrashPoint] = []
        """The points passed after the last scheduled crash."""
        self.starts: Counter[str] = Counter()
        self.recorded: set[str] = set()
        self.ran_after_record: list[str] = []
        self.commits: Counter[str] = Counter()
        self.outputs: dict[str, list[str | None]] = {}
        self.changes: dict[str, list[bool]] = {}
        self._step: str | None = None
        self._counting = False
        self._changed = False

    def __call__(self, point: Point) -> bool:
        if point.kind == "call":
            return False
        if point.kind == "step.recorded":
            self.recorded.add(point.name)
            return False
        self._note(point)
        label = f"{_LABELS[point.kind]}:{point.name}"
        self.passes[label] += 1
        here = CrashPoint(
            label=label,
            occurrence=self.passes[label],
            description=_describe(point, self._step),
        )
        self.points.append((here, point))
        if len(self.fired) == len(self._schedule):
            if self.fired:
                self.tail.append(here)
            return False
        if here != self._schedule[len(self.fired)]:
            return False
        self.fired.append(here)
        self._end_body(crashed=True)
        return True

    def _note(self, point: Point) -> None:
        kind, name = point.kind, point.name
        if kind == "step.before":
            self._step = name
            self.starts[name] += 1
            if name in self.recorded:
                self.ran_after_record.append(name)
            self._counting, self._changed = True, False
            self._snapshots.start()
        elif kind == "step.returned":
            self.outputs.setdefault(name, []).append(point.output)
            self._end_body(crashed=False)
        elif kind == "op.acted" and self._counting:
            self._changed |= self._snapshots.changed()
        elif kind == "op.committed":
            self.commits[name] += 1
            if self._counting:
                self._snapshots.start()  # what the fenced commit wrote does not count
        elif kind == "park" and point.step_kind == "step":
            self._end_body(crashed=False)

    def _end_body(self, *, crashed: bool) -> None:
        """A stretch of a step's body ended (it returned, raised into a retry, or crashed)."""
        if not self._counting or self._step is None:
            return
        changed = self._changed or self._snapshots.changed()
        self.changes.setdefault(self._step, []).append(changed)
        self._counting = False
        if crashed:
            self._step = None


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _outcome(record: RunRecord) -> str:
    if record.status == "completed":
        return f"completed with {record.output_json}"
    if record.status == "failed" and record.error is not None:
        return f"failed with {record.error.type}: {record.error.message}"
    return record.status


async def _check_invariant(invariant: Callable[[Any], Any] | None, state: Any) -> str | None:
    if invariant is None:
        return None
    try:
        verdict = await _maybe_await(invariant(state))
    except AssertionError as exc:
        message = str(exc).splitlines()[0] if str(exc) else "(AssertionError)"
        return f"invariant failed: {message}"
    except Exception as exc:
        return f"invariant raised {type(exc).__name__}: {exc}"
    if verdict is False:
        return "invariant returned False"
    return None


class _Explorer:
    def __init__(
        self,
        task: TaskDefinition[Any, Any],
        input_json: str,
        input_hash: str,
        *,
        registry: Registry,
        setup: Callable[[], Any] | None,
        invariant: Callable[[Any], Any] | None,
        facts: Facts | None,
        snapshot: Callable[[Any], Any] | None,
        check_output: bool,
    ) -> None:
        self.task = task
        self.input_json = input_json
        self.input_hash = input_hash
        self.registry = registry
        self.setup = setup
        self.invariant = invariant
        self.facts = facts
        self.snapshot = snapshot
        self.check_output = check_output
        self.baseline_outputs: dict[str, str | None] = {}
        self.baseline_outcome = ""
        self.baseline_commits: Counter[str] = Counter()
        self.snapshots_usable = True

    async def run(
        self, schedule: Sequence[CrashPoint]
    ) -> tuple[Exploration, _Observer, RunRecord | None]:
        state = await _maybe_await(self.setup()) if self.setup is not None else None
        snapshots = _Snapshots(state, self.snapshot)
        self.snapshots_usable = snapshots.usable
        observer = _Observer(schedule, snapshots)
        engine = await connect("memory://", registry=self.registry, clock=FakeClock(_START))
        problems: list[str] = []
        record: RunRecord | None = None
        random.seed(_SEED)
        try:
            await engine.backend.enqueue(
                NewRun(
                    run_id=_RUN_ID,
                    task_name=self.task.name,
                    task_version=self.task.version,
                    input_json=self.input_json,
                    input_hash=self.input_hash,
                )
            )
            try:
                with _probe.observing(observer):
                    await drive(engine, _RUN_ID, facts=self.facts)
            except UmtError as exc:
                problems.append(f"the run did not finish: {exc}")
            record = await engine.backend.get_run(_RUN_ID)
        finally:
            await engine.close()
        assert record is not None
        missed = schedule[len(observer.fired) :]
        if missed:
            problems.append(
                f"the run never reached {missed[0].id}: it took another path than the "
                "crash-free run (code between steps that reads the clock or randomness?)"
            )
        problems += self._check(observer, record)
        problem = await _check_invariant(self.invariant, state)
        if problem is not None:
            problems.append(problem)
        exploration = Exploration(
            crashes=tuple(observer.fired),
            problems=tuple(problems),
            step_starts=dict(observer.starts),
            outcome=_outcome(record),
        )
        return exploration, observer, record

    def _check(self, observer: _Observer, record: RunRecord) -> list[str]:
        problems: list[str] = []
        for name in dict.fromkeys(observer.ran_after_record):
            problems.append(f"step {name!r} ran again after its completion was recorded")
        for op_key in sorted(observer.commits.keys() | self.baseline_commits.keys()):
            done = observer.commits[op_key]
            if done != 1:
                problems.append(
                    f"with_attempt_token({op_key!r}) committed {done} times, not exactly once"
                )
        outputs = {s.name: s.output_json for s in record.steps if s.status == "completed"}
        if self.check_output and observer.fired and _outcome(record) != self.baseline_outcome:
            problems.append(
                f"the run ended differently from the crash-free run: {_outcome(record)} "
                f"instead of {self.baseline_outcome}"
            )
            for name, before in self.baseline_outputs.items():
                now = outputs.get(name, before)
                if now != before:
                    runs = len(observer.outputs.get(name, []))
                    again = f" (it ran {_times(runs)})" if runs > 1 else ""
                    problems.append(
                        f"step {name!r} recorded {now} instead of {before}{again}: its output "
                        "depends on the clock, randomness or outside state, so a crash that "
                        "makes it run again changes what the run does"
                    )
        for name, changes in observer.changes.items():
            if len(changes) > 1 and sum(changes) > 1:
                problems.append(
                    f"step {name!r} ran {_times(len(changes))} and changed the state "
                    f"{_times(sum(changes))}: its side effect is not idempotent; put it behind "
                    "with_attempt_token (fenced, committed once) or make it an upsert keyed "
                    "by the run"
                )
        return problems


def _parse_only(only: str | Sequence[str], known: Sequence[CrashPoint]) -> list[CrashPoint]:
    ids = [only] if isinstance(only, str) else list(only)
    by_id = {p.id: p for p in known}
    schedule: list[CrashPoint] = []
    for text in ids:
        if not isinstance(text, str):
            check.refuse("only", "a crash point id such as 'after:charge', or a list of them", text)
        label, occurrence = text.strip(), 1
        if label.endswith("]") and "[" in label:
            label, _, number = label[:-1].rpartition("[")
            if not number.isdigit() or int(number) < 1:
                raise UsageError(
                    f"only={text!r}: the pass number in brackets must be an integer >= 1, "
                    "as in 'before:charge[2]'",
                    argument="only",
                )
            occurrence = int(number)
        point = CrashPoint(label=label, occurrence=occurrence)
        if not schedule and point.id not in by_id:
            shown = ", ".join(p.id for p in known) or "(none)"
            raise UsageError(
                f"only={text!r} names no crash point of the crash-free run; its points are: "
                f"{shown}",
                argument="only",
            )
        schedule.append(point)
    if not schedule:
        raise UsageError("only= needs at least one crash point id", argument="only")
    return schedule


async def explore_crashes(
    task: TaskDefinition[Any, Any],
    input: Any,
    *,
    registry: Registry | None = None,
    setup: Callable[[], S | Awaitable[S]] | None = None,
    invariant: Callable[[S], Any] | None = None,
    facts: Facts | None = None,
    depth: int = 1,
    only: str | Sequence[str] | None = None,
    snapshot: Callable[[S], Any] | None = None,
    check_output: bool = True,
) -> CrashReport[S]:
    """Crash `task` on `input` at every point it passes and check what a crash may not change.

    Runs the task once without a crash (twice: to tell a task whose outcome varies on its own),
    then once for each crash point of that run, in order; with `depth=2`, also once for each
    point of each recovery after the first crash. Each run starts from `setup()` (the business
    state your steps write, reset; sync or async; its value goes to `invariant` and `snapshot`)
    on a fresh memory engine under a `FakeClock`: sleeps and wait timeouts cost nothing, and
    the facts the task waits for come from `facts` (`{name: payload}` or a function of the
    name). `random` is seeded the same before every run.

    Checked at every crash: the run ends as the crash-free one did (`check_output`), no step
    body starts again once its completion is recorded, each `with_attempt_token` operation
    commits exactly once, `invariant(state)` holds (raise AssertionError or return False to
    fail it), and no step runs twice and changes the state both times (compared with
    `snapshot(state)`, by default a deep copy compared with ==; writes of a fenced commit do
    not count).

    `only="after:charge"` (or a list, for a crash in the recovery of the one before) runs just
    that schedule: the reproducer `explain()` prints. `registry` serves the task's children
    (default: the task alone). Returns a `CrashReport`: `assert report.ok, report.explain()`.
    """
    if not isinstance(task, TaskDefinition):
        check.refuse("task", "a @task definition", task, where="explore_crashes()")
    check.integer(depth, "depth", at_least=1, at_most=2, where="explore_crashes()")
    check.optional(registry, Registry, "registry", "a Registry", where="explore_crashes()")
    for name, fn in (("setup", setup), ("invariant", invariant), ("snapshot", snapshot)):
        if fn is not None:
            check.function(fn, name, where="explore_crashes()")
    check.flag(check_output, "check_output", where="explore_crashes()")
    if registry is None:
        registry = Registry([task])
    else:
        registry.get(task.name, task.version)  # LookupError naming it if it is not there
    input_json, input_hash = _serde.encode_input(input, task.input_type, what="input")
    explorer = _Explorer(
        task,
        input_json,
        input_hash,
        registry=registry,
        setup=setup,
        invariant=invariant,
        facts=facts,
        snapshot=snapshot,
        check_output=check_output,
    )
    started = time.perf_counter()
    saved = random.getstate()
    try:
        report = await _explore(explorer, depth=depth, only=only)
    finally:
        random.setstate(saved)
    return evolve(report, seconds=time.perf_counter() - started)


async def _explore(
    explorer: _Explorer, *, depth: int, only: str | Sequence[str] | None
) -> CrashReport[Any]:
    baseline, observer, record = await explorer.run(())
    assert record is not None
    explorer.baseline_outcome = _outcome(record)
    explorer.baseline_outputs = {
        s.name: s.output_json for s in record.steps if s.status == "completed"
    }
    explorer.baseline_commits = Counter(dict.fromkeys(observer.commits, 1))
    points = tuple(point for point, _ in observer.points)
    notes: list[str] = []
    _, _, record2 = await explorer.run(())
    assert record2 is not None
    problems = list(baseline.problems)
    if explorer.check_output and _outcome(record2) != explorer.baseline_outcome:
        problems.append(
            "two runs without a crash ended differently "
            f"({explorer.baseline_outcome}, then {_outcome(record2)}): the outcome depends on "
            "the clock, randomness or state that setup() does not reset"
        )
        for step in record2.steps:
            before = explorer.baseline_outputs.get(step.name)
            if step.status == "completed" and before is not None and step.output_json != before:
                problems.append(
                    f"step {step.name!r} returned {before}, then {step.output_json}: read the "
                    "time or draw randomness where the run does not depend on it, or pass "
                    "check_output=False"
                )
        explorer.check_output = False
    baseline = Exploration(
        crashes=(),
        problems=tuple(problems),
        step_starts=baseline.step_starts,
        outcome=baseline.outcome,
    )
    if not explorer.snapshots_usable:
        notes.append(
            "the state setup() returns does not compare by value (a deep copy is not == to "
            "it), so steps that change it twice are not found: pass snapshot=, a function "
            "of the state returning something that does (a dict of its rows, say)"
        )
    explorations: list[Exploration] = []
    if only is not None:
        exploration, _, _ = await explorer.run(_parse_only(only, points))
        explorations.append(exploration)
    else:
        for point in _unique(points):
            exploration, crashed, _ = await explorer.run((point,))
            explorations.append(exploration)
            if depth == 2:
                for second_point in crashed.tail:
                    deeper, _, _ = await explorer.run((point, second_point))
                    explorations.append(deeper)
    return CrashReport(
        task=f"{explorer.task.name}@{explorer.task.version}",
        depth=depth,
        points=points,
        baseline=baseline,
        explorations=tuple(explorations),
        notes=tuple(notes),
    )


def _unique(points: Sequence[CrashPoint]) -> Iterator[CrashPoint]:
    seen: set[str] = set()
    for point in points:
        if point.id not in seen:
            seen.add(point.id)
            yield point
