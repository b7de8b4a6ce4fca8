"""The replayer: today's code against a run's recorded history, with no backend and no side
effects, to check before a deploy that the runs in flight still replay.

A replay is a real `Execution` of the run (so its semantics are exactly the engine's) over a
stub backend that writes nothing. The execution's probe (`_probe`) reports each step, sleep
and fact wait the handler asks for (a `call` point); the replay compares that sequence with the
recorded one, position by position:
- a call the history satisfies at its position is replayed from its record, as a worker would;
- the first call it cannot satisfy (another name, another kind, another position) ends the
  replay with a `NonDeterminismError` whose message is the diff;
- the first call of a step the history does not hold, once every recorded step was matched in
  order, ends it successfully: from there the run would go on live (a step appended at the end
  is a compatible change). So does a recorded step still in flight (`retrying`, `waiting`).
The handler is unwound there by a private `BaseException` before anything live starts: no step
body, no `wait_for_fact` check and no `with_attempt_token` ever runs during a replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, Literal
from uuid import UUID

from attrs import field, frozen
from opentelemetry import metrics, trace

from umt_sdk import _probe, _serde
from umt_sdk._attention import parse_attention_fact
from umt_sdk._check import shown
from umt_sdk._execution import Execution
from umt_sdk._export import RunHistory, step_records
from umt_sdk._history import History
from umt_sdk._patches import is_marker
from umt_sdk._sagas import umt_record
from umt_sdk._spi import (
    Backend,
    CancelOutcome,
    ClaimedRun,
    Clock,
    Ending,
    EndResult,
    EnqueueResult,
    Fact,
    HeartbeatResult,
    Lease,
    Ledger,
    NewRun,
    RunQuery,
    RunRecord,
    StepKind,
    StepRecord,
    StreamAppend,
    StreamEntry,
    TaskPair,
)
from umt_sdk._task import Registry
from umt_sdk._telemetry import Telemetry
from umt_sdk.exceptions import NonDeterminismError, UmtError, UsageError

__all__ = ["ReplayResult", "Replayer", "StepDrift"]

_REPLAY_WORKER = "umt-replay"
_CONTEXT_ROWS = 5
"""Matched positions shown before the one that differs."""
_ADVICE = (
    "bump the task's version for incompatible changes and keep the old version registered "
    "until its runs drain"
)

ReplayOutcome = Literal["finished", "goes_on_live", "mismatch", "not_registered"]


@frozen(kw_only=True)
class StepDrift:
    """A completed step's recorded output that no longer decodes into the step's return type,
    or decodes into another value: a resumed run would see something else than it recorded."""

    step: str
    """The step, as recorded (`name#2` for a second use)."""
    recorded: Any
    """The recorded output (parsed JSON)."""
    output_type: str
    """The step's return type today, as the code declares it."""
    problem: str
    """What goes wrong: the decoding error, or what changes (`'amount': 30.5 becomes 30`)."""

    def describe(self) -> str:
        return f"step {self.step!r}: the recorded {_shown_json(self.recorded)} {self.problem}"


@frozen(kw_only=True)
class ReplayResult:
    """How one history replayed against today's code."""

    run_id: UUID
    task: str
    version: int
    steps_recorded: int
    """The recorded steps, sleeps and fact waits (each name once, whatever its attempts)."""
    steps_matched: int
    """How many of them the code asked for, in the recorded order, before the replay ended."""
    outcome: ReplayOutcome
    """`finished`: the handler returned or raised as the history allows; `goes_on_live`: it
    reached a step the history does not hold (or one still in flight) after matching all the
    recorded ones; `mismatch`: see `error`; `not_registered`: the registry has no such task
    and version (its runs would never be claimed)."""
    next_call: str | None = None
    """For `goes_on_live`: the call the run would make live next, such as `"step 'notify'"`."""
    error: UmtError | None = None
    """`NonDeterminismError` (with the diff) or `UnknownTaskError`; None when it replayed."""
    drift: tuple[StepDrift, ...] = ()
    """The replayed steps whose recorded output no longer decodes into today's return type,
    or decodes into another value (type drift); each makes the result not `ok`."""
    patches: Mapping[str, bool] = field(factory=dict)
    """What `ctx.patched` / `ctx.deprecate_patch` decided during the replay, by patch id
    (False: the run takes the old branch there); a patch the replay did not reach is left
    out (the run reaches it live, on the new code)."""

    @property
    def ok(self) -> bool:
        return self.error is None and not self.drift

    def summary(self) -> str:
        """One line: `ok run ... task@1: ...`, or `FAILED run ...` and the error's text."""
        head = f"run {self.run_id} ({self.task}@{self.version})"
        drift = "".join(f"\n  type drift in {d.describe()}" for d in self.drift)
        if isinstance(self.error, NonDeterminismError):
            return f"FAILED {self.error}{drift}"  # the diff, which names the run and the task
        if self.error is not None:
            return f"FAILED {head}: {self.error}{drift}"
        if drift:
            return f"FAILED {head}: a recorded step no longer decodes as it did{drift}"
        steps = f"{self.steps_matched} of {self.steps_recorded} recorded step(s) replayed"
        if self.outcome == "goes_on_live":
            return f"ok {head}: {steps}; goes on live with {self.next_call}"
        return f"ok {head}: {steps}; the handler finished"


class _StopReplay(BaseException):
    """Unwinds the handler where the replay ends (matched or not): nothing live may run."""


def _call(name: str, kind: str) -> str:
    return f"{kind} {name!r}"


class _Comparison:
    """The recorded positions against the calls the handler makes, in order."""

    def __init__(self, history: RunHistory) -> None:
        self.history = history
        last: dict[str, tuple[int, StepKind, str]] = {}
        order: list[str] = []
        for step in history.steps:
            if umt_record(step.name):  # a saga's registrations and plan: no call makes them
                continue
            if parse_attention_fact(step.name) is not None:  # a settlement: `settle` made it
                continue
            if step.name not in last:
                order.append(step.name)
            seen = last.get(step.name)
            if seen is None or step.attempt >= seen[0]:
                last[step.name] = (step.attempt, step.kind, step.status)
        self.recorded = [(name, last[name][1]) for name in order]
        self.outputs = {
            step.name: step.output for step in history.steps if step.status == "completed"
        }
        self.drift: list[StepDrift] = []
        self.matched = 0
        self.calls: list[tuple[str, str]] = []
        self.mismatch: NonDeterminismError | None = None
        self.next_call: str | None = None
        self.stopped = False
        self.finished = False

    def skip_markers(self, name: str = "") -> None:
        """Pass over the patch markers recorded here that the code no longer asks for (a
        patch deprecated, then removed): they stand for no code."""
        while (
            self.matched < len(self.recorded)
            and is_marker(self.recorded[self.matched][0])
            and self.recorded[self.matched][0] != name
        ):
            self.calls.append(self.recorded[self.matched])
            self.matched += 1

    def on_call(self, name: str, kind: str, replayed: bool, output_type: Any = None) -> None:
        """The handler asks for step `name` of `kind`: go on, or stop the replay here."""
        if self.stopped:  # a `finally:` of the handler asks for more while it unwinds
            raise _StopReplay
        self.skip_markers(name)
        if replayed and output_type is not None and name in self.outputs:
            found = _drift(name, self.outputs[name], output_type)
            if found is not None:
                self.drift.append(found)
        position = self.matched
        if position < len(self.recorded):
            if self.recorded[position] != (name, kind):
                self.differs(_call(name, kind), step_name=name, current_kind=kind)
            self.calls.append((name, kind))
            self.matched += 1
            if not replayed:  # recorded, but still in flight: the run goes on live here
                self.goes_on_live(_call(name, kind))
            return
        # Past the history: every name in it was matched, so this one is new (appended).
        self.goes_on_live(_call(name, kind))

    def on_point(self, point: _probe.Point) -> bool:
        if point.kind == "call":
            assert point.step_kind is not None
            self.on_call(point.name, point.step_kind, point.replayed, point.output_type)
        elif point.kind == "end":
            self.finished = True
        else:  # a body, a park or an op would start: never during a replay
            self.stopped = True
            raise _StopReplay
        return False

    def goes_on_live(self, call: str) -> None:
        self.next_call = call
        self.stopped = True
        raise _StopReplay

    def differs(self, current: str, *, step_name: str = "", current_kind: str = "") -> None:
        """The call at the next position is `current`, which the history cannot satisfy."""
        self.mismatch = self.error(current, step_name=step_name, current_kind=current_kind)
        self.stopped = True
        raise _StopReplay

    def error(
        self, current: str, *, step_name: str = "", current_kind: str = ""
    ) -> NonDeterminismError:
        history = self.history
        position = self.matched
        recorded_kind = ""
        if position < len(self.recorded):
            recorded_name, recorded_kind = self.recorded[position]
            recorded = _call(recorded_name, recorded_kind)
        else:
            recorded = "(the history ends here)"
        rows: list[tuple[str, str, str]] = []
        first = max(0, position - _CONTEXT_ROWS)
        if first > 0:
            rows.append(("...", "", ""))
        for index in range(first, position):
            name, kind = self.recorded[index]
            now_name, now_kind = self.calls[index]
            rows.append((str(index + 1), _call(name, kind), _call(now_name, now_kind)))
        rows.append((str(position + 1), recorded, current))
        width_position = max(len("position"), *(len(r[0]) for r in rows))
        width_recorded = max(len("recorded"), *(len(r[1]) for r in rows))
        width_now = max(len("now"), *(len(r[2]) for r in rows))
        lines = [
            f"run {history.run_id}: the code no longer replays its history "
            f"(task {history.task}@{history.version})",
            f"  {'position':<{width_position}}  {'recorded':<{width_recorded}}  now",
        ]
        for index, (pos, rec, now) in enumerate(rows):
            marker = "   <- differs" if index == len(rows) - 1 else ""
            line = f"  {pos:<{width_position}}  {rec:<{width_recorded}}  "
            line += f"{now:<{width_now}}{marker}" if marker else now
            lines.append(line.rstrip() if not marker else line)
        lines.append(f"  ({_ADVICE})")
        return NonDeterminismError(
            "\n".join(lines),
            step_name=step_name,
            recorded_kind=recorded_kind,
            current_kind=current_kind,
            run_id=history.run_id,
            position=position + 1,
            recorded=recorded,
            current=current,
        )


class _ReplayHistory(History):
    """The execution's history, whose kind check becomes a position in the diff."""

    def __init__(self, comparison: _Comparison, records: list[StepRecord]) -> None:
        super().__init__(comparison.history.run_id, records)
        self._comparison = comparison

    def last(self, name: str, kind: StepKind) -> StepRecord | None:
        try:
            return super().last(name, kind)
        except NonDeterminismError:
            self._comparison.on_call(name, kind, replayed=True)
            raise  # pragma: no cover - on_call has stopped the replay


class _FixedClock:
    def __init__(self, at: datetime) -> None:
        self._at = at

    def now(self) -> datetime:
        return self._at


class _RefusedError(RuntimeError):
    """The replay's stub backend was asked for something a replay never does."""


def _refuse(what: str) -> _RefusedError:
    return _RefusedError(
        f"a replay tried to {what}: it never writes, reads or runs anything live "
        "(a bug in umt_sdk.testing.Replayer)"
    )


class _ReplayBackend:
    """Writes nothing. The one write a replay reaches, the handler's ending, is kept to be
    compared with the recorded run; stream writes (`ctx.stream.write`, which the handler's
    own code makes between steps as it replays) are answered without being stored; anything
    else means live code ran, and is refused."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.ending: Ending | None = None
        self._stream_keys: dict[str, dict[str, int]] = {}

    @property
    def clock(self) -> Clock | None:
        return self._clock

    async def end_execution(self, lease: Lease, ending: Ending) -> EndResult:
        self.ending = ending
        return "ended"

    async def enqueue(self, new: NewRun, *, conn: Any = None) -> EnqueueResult:
        raise _refuse("enqueue a run")

    async def append_stream(
        self, lease: Lease, appends: Iterable[StreamAppend]
    ) -> list[StreamEntry]:
        """What a store would answer (the seq of each key, in the order first written), with
        nothing stored: a replay has no side effects, and the run's values are stored already."""
        entries = []
        for append in appends:
            keys = self._stream_keys.setdefault(append.stream, {})
            seq = keys.setdefault(append.key, len(keys) + 1)
            entries.append(
                StreamEntry(
                    run_id=lease.run_id,
                    stream=append.stream,
                    seq=seq,
                    key=append.key,
                    value_json=append.value_json,
                    written_at=self._clock.now(),
                )
            )
        return entries

    async def read_stream(self, run_id: Any, stream: str, *, after: int, limit: int) -> Any:
        raise _refuse(f"read stream {stream!r}")

    async def last_stream_entries(self, run_ids: Any, stream: str | None = None) -> Any:
        raise _refuse("read streams")

    async def wait_for_stream(
        self, run_id: Any, stream: str, *, after: int, timeout: float
    ) -> None:
        raise _refuse(f"wait for stream {stream!r}")

    async def claim(
        self, *, worker_id: str, pairs: Any, limit: int, lease: timedelta
    ) -> list[ClaimedRun]:
        raise _refuse("claim runs")

    async def heartbeat(self, *, worker_id: str, beats: Any, lease: timedelta) -> HeartbeatResult:
        raise _refuse("send a heartbeat")

    async def record_step(self, lease: Lease, step: StepRecord) -> None:
        raise _refuse(f"record step {step.name!r}")

    async def signal(self, *, run_id: Any, name: str, payload_json: str) -> bool:
        raise _refuse(f"send fact {name!r}")

    async def get_facts(self, *, run_id: Any, name: str) -> list[Fact]:
        raise _refuse(f"read fact {name!r}")

    async def cancel(self, run_id: Any, *, reason: str) -> CancelOutcome:
        raise _refuse("cancel a run")

    async def get_run(self, run_id: Any) -> RunRecord | None:
        raise _refuse("read a run")

    async def get_run_head(self, run_id: Any) -> RunRecord | None:
        raise _refuse("read a run")

    async def list_runs(self, query: RunQuery) -> list[RunRecord]:
        raise _refuse("list runs")

    async def queue_depths(self, pairs: Any) -> dict[TaskPair, int]:
        raise _refuse("count runs")

    async def wait_for_work(self, *, pairs: Any, timeout: float) -> None:
        raise _refuse("wait for work")

    async def wait_for_run(self, run_id: Any, *, timeout: float) -> None:
        raise _refuse("wait for a run")

    def add_cancel_listener(self, listener: Any) -> Any:
        raise _refuse("listen for cancels")

    def ledger(self, conn: Any) -> Ledger:
        raise _refuse("open the operation ledger")

    async def close(self) -> None:
        return None


def _last_time(history: RunHistory) -> datetime:
    """The latest time the history holds: the replay's fixed clock."""
    times = [history.created_at]
    if history.finished_at is not None:
        times.append(history.finished_at)
    for step in history.steps:
        times += [t for t in (step.started_at, step.finished_at, step.wake_at) if t is not None]
    return max(times)


class Replayer:
    """Replays recorded histories (`umt_sdk.RunHistory`, from `Engine.export_history` or
    `umt runs export`) against the tasks of `registry`: today's code, no backend, no side
    effects. See the module docstring of `umt_sdk.testing._replay` for the rules."""

    def __init__(self, registry: Registry) -> None:
        if not isinstance(registry, Registry):
            raise UsageError(
                f"Replayer(registry): expected a umt Registry, got {shown(registry)}",
                argument="registry",
            )
        self.registry = registry
        # No spans or metrics: a replay is not an execution of the run.
        self._telemetry = Telemetry(
            tracer_provider=trace.NoOpTracerProvider(),
            meter_provider=metrics.NoOpMeterProvider(),
        )

    async def replay(self, history: RunHistory) -> ReplayResult:
        """Replay one history; return how far it went.

        Raises `NonDeterminismError` (its message the diff, recorded vs now, with the position)
        at the first step, sleep or fact wait the history cannot satisfy, and `UnknownTaskError`
        when the registry lacks the run's task and version.
        """
        result = await self._replay(history)
        if result.error is not None:
            raise result.error
        return result

    async def replay_many(self, histories: Iterable[RunHistory]) -> list[ReplayResult]:
        """Replay every history; one result per run, in order, never stopping at a failure."""
        return [await self._replay(history) for history in _histories(histories)]

    async def _replay(self, history: RunHistory) -> ReplayResult:
        if not isinstance(history, RunHistory):
            raise UsageError(
                "Replayer.replay(history): expected a umt_sdk.RunHistory (from "
                f"Engine.export_history or RunHistory.from_json), got {shown(history)}",
                argument="history",
            )
        comparison = _Comparison(history)

        execution: Execution | None = None

        def result(
            outcome: ReplayOutcome, *, error: UmtError | None = None, next_call: str | None = None
        ) -> ReplayResult:
            return ReplayResult(
                drift=tuple(comparison.drift),
                patches=execution.steps.patches.decisions() if execution is not None else {},
                run_id=history.run_id,
                task=history.task,
                version=history.version,
                steps_recorded=len(comparison.recorded),
                steps_matched=comparison.matched,
                outcome=outcome,
                next_call=next_call,
                error=error,
            )

        try:
            definition = self.registry.get(history.task, history.version)
        except UmtError as exc:
            return result("not_registered", error=exc)
        records = step_records(history)
        at = _last_time(history)
        backend = _ReplayBackend(_FixedClock(at))
        claimed = ClaimedRun(
            run_id=history.run_id,
            task_name=history.task,
            task_version=history.version,
            input_json=_input_json(history),
            priority=0,
            fencing_token=1,
            claimed_at=at,
            claims=1,
            failures=0,
            steps=records,
        )
        execution = Execution(
            backend=_as_backend(backend),
            claimed=claimed,
            definition=definition,
            worker_id=_REPLAY_WORKER,
            lease_duration=timedelta(days=1),
            loop=asyncio.get_running_loop(),
            telemetry=self._telemetry,
        )
        # The execution's history, so that a changed kind lands in the diff (see the class).
        replay_history = _ReplayHistory(comparison, records)
        execution.history = replay_history
        execution.steps.history = replay_history
        with _probe.observing(comparison.on_point), contextlib.suppress(_StopReplay):
            await execution.execute()
        if comparison.mismatch is None and comparison.next_call is None:
            self._check_ending(comparison, backend.ending)
        if comparison.mismatch is not None:
            return result("mismatch", error=comparison.mismatch)
        if comparison.next_call is not None:
            return result("goes_on_live", next_call=comparison.next_call)
        return result("finished")

    @staticmethod
    def _check_ending(comparison: _Comparison, ending: Ending | None) -> None:
        """The handler ended (returned or raised) before asking for anything live: it must
        have asked for every recorded step, and may raise only what the run recorded."""
        history = comparison.history
        raised = ending.error if ending is not None else None
        now = "(the handler returned)"
        if raised is not None:
            now = f"(the handler raised {raised.type}: {_shorten(raised.message)})"
        try:
            comparison.skip_markers()
            if comparison.matched < len(comparison.recorded):
                comparison.differs(now)
            if raised is not None and (history.error is None or history.error.type != raised.type):
                comparison.mismatch = comparison.error(now)
        except _StopReplay:
            pass


def _histories(histories: object) -> list[RunHistory]:
    """`replay_many`'s argument, checked: an iterable of `RunHistory`."""
    expected = "an iterable of umt_sdk.RunHistory (from RunHistory.from_jsonl, say)"
    if isinstance(histories, str | bytes | bytearray | Mapping) or not isinstance(
        histories, Iterable
    ):
        raise UsageError(
            f"Replayer.replay_many(histories): expected {expected}, got {shown(histories)}",
            argument="histories",
        )
    items = list(histories)
    for index, item in enumerate(items):
        if not isinstance(item, RunHistory):
            raise UsageError(
                f"Replayer.replay_many(histories): item {index} is {shown(item)}, not a "
                "umt_sdk.RunHistory",
                argument="histories",
            )
    return items


def _type_name(type_: Any) -> str:
    if isinstance(type_, type) and not getattr(type_, "__args__", None):
        return type_.__qualname__
    return repr(type_).replace("typing.", "")


def _drift(name: str, recorded: Any, output_type: Any) -> StepDrift | None:
    """How step `name`'s recorded output fares when decoded into `output_type` today: None
    when it decodes and encodes back to what was recorded (new fields with defaults may be
    added), else the drift."""
    if output_type is Any:
        return None
    shown_type = _type_name(output_type)
    try:
        value = _serde.from_raw(recorded, output_type, what=f"output of step {name!r}")
        again = json.loads(_serde.dumps(_serde.to_raw(value, output_type)))
    except Exception as exc:  # a PayloadError, or the type's own code refusing
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return StepDrift(
            step=name,
            recorded=recorded,
            output_type=shown_type,
            problem=f"no longer decodes into {shown_type}: {reason}",
        )
    changed = _changed(recorded, again, "")
    if changed is None:
        return None
    return StepDrift(
        step=name,
        recorded=recorded,
        output_type=shown_type,
        problem=f"decodes into {shown_type} as another value: {changed}",
    )


def _changed(recorded: Any, now: Any, path: str) -> str | None:
    """Where `now` (the recorded value decoded and encoded again) loses or changes what was
    recorded; keys only `now` has are new fields with defaults, and fine."""
    here = path or "the value"
    if isinstance(recorded, dict):
        if not isinstance(now, dict):
            return f"{here} {_shown_json(recorded)} becomes {_shown_json(now)}"
        for key, value in recorded.items():
            if key not in now:
                return f"{path}.{key} is dropped" if path else f"field {key!r} is dropped"
            found = _changed(value, now[key], f"{path}.{key}" if path else key)
            if found is not None:
                return found
        return None
    if isinstance(recorded, list):
        if not isinstance(now, list) or len(now) != len(recorded):
            return f"{here} {_shown_json(recorded)} becomes {_shown_json(now)}"
        for index, (a, b) in enumerate(zip(recorded, now, strict=True)):
            found = _changed(a, b, f"{path}[{index}]")
            if found is not None:
                if sorted(map(_canonical, recorded)) == sorted(map(_canonical, now)):
                    return None  # a set's items in another order: decoding never reorders
                return found
        return None
    if recorded != now or isinstance(recorded, bool) != isinstance(now, bool):
        return f"{here} {_shown_json(recorded)} becomes {_shown_json(now)}"
    return None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _shown_json(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _shorten(text: str, limit: int = 120) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else f"{line[:limit]}..."


def _input_json(history: RunHistory) -> str:
    return json.dumps(history.input, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _as_backend(backend: _ReplayBackend) -> Backend:
    """The stub as the SPI's `Backend` (where mypy checks that it is one)."""
    return backend
