"""Compensation (sagas): which compensations a run registered, and which it runs when it gives up.

A step run with `compensate=fn` is registered with the run's history: before its body first
runs, the record `umt.compensation:<step>` (its output: the compensation's name) is stored, so
a registration survives any crash and a code change that drops it is noticed, never skipped.
The callable itself comes back on every execution by replay: the handler calls the step again
by its name and passes `compensate=` again.

When the run compensates (`raise Compensate(...)`, or `@task(on_failure="compensate")` once
its retries are spent) the SDK stores the plan, `umt.compensating` (why it gave up and the
steps to undo, newest first), then runs each compensation as the durable step
`umt.compensate:<step>` and ends the run `compensated`. A later execution that finds the plan
replays the handler only up to its first step not recorded (`ResumeCompensation` unwinds it
there: no new step of the handler runs once the run gave up) and goes on with the plan: the
compensations already recorded replay, the rest run. The backends store records and a status.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable
from typing import Any

from attrs import define, field, frozen

from umt_sdk._spi import ErrorInfo, StepRecord

__all__ = [
    "COMPENSATE_PREFIX",
    "COMPENSATING",
    "COMPENSATION_PREFIX",
    "Compensation",
    "ResumeCompensation",
    "Saga",
    "compensation_args",
    "compensation_name",
    "umt_record",
]

COMPENSATION_PREFIX = "umt.compensation:"
"""`umt.compensation:<step>`: the step registered a compensation (recorded before its body)."""
COMPENSATE_PREFIX = "umt.compensate:"
"""`umt.compensate:<step>`: the durable step that runs the compensation of `<step>`."""
COMPENSATING = "umt.compensating"
"""The run gave up and compensates: why, and the steps to undo in the order they are undone."""


class ResumeCompensation(BaseException):
    """The handler, replayed by a run that already decided to compensate, reached a step it
    never recorded: it stops there and the execution goes on compensating."""


def umt_record(name: str) -> bool:
    """A record no call of the handler makes: a registration or the plan (the compensations
    themselves are steps the execution calls, replayed like any other)."""
    return name == COMPENSATING or name.startswith(COMPENSATION_PREFIX)


def compensation_name(fn: Callable[..., Any]) -> str:
    """How a compensation is named in its registration and in errors."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    return type(fn).__qualname__


def compensation_args(
    fn: Callable[..., Any], output: Any, *, transactional: bool = False
) -> tuple[Any, ...]:
    """A compensation is called with the output of the step it undoes, or with nothing when
    it takes no parameter (`lambda: refund(order_id)`). A transactional one's first
    parameter is its transaction (given by the backend), not counted."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: give it the output
        return (output,)
    takes = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if transactional and takes and takes[0].kind is not inspect.Parameter.VAR_POSITIONAL:
        takes = takes[1:]
    return (output,) if takes else ()


@frozen(kw_only=True)
class Compensation:
    """One entry of the plan: the step it undoes, the compensation's recorded name, and, when
    this execution's replay registered it, the callable and the step's output."""

    step: str
    name: str
    fn: Callable[..., Any] | None = None
    output: Any = None


@define(eq=False)
class Saga:
    """The compensations of one execution: registrations recorded and replayed, the plan."""

    recorded: dict[str, str] = field(factory=dict)
    """Step -> compensation name, for every registration recorded, in the order recorded."""
    live: dict[str, tuple[Callable[..., Any], Any]] = field(factory=dict)
    """Step -> (compensation, step output), registered by this execution's handler."""
    plan_record: StepRecord | None = None
    """The stored `umt.compensating` record, once the run decided to compensate."""
    active: bool = False
    """The execution runs the compensations: the steps it starts are not the handler's."""

    @classmethod
    def of(cls, records: Iterable[StepRecord]) -> Saga:
        saga = cls()
        for record in records:
            saga.remember(record)
        return saga

    def remember(self, record: StepRecord) -> None:
        if record.name == COMPENSATING and record.status == "completed":
            self.plan_record = record
        elif record.name.startswith(COMPENSATION_PREFIX) and record.status == "completed":
            step = record.name[len(COMPENSATION_PREFIX) :]
            self.recorded.setdefault(step, _recorded_name(record.output_json))

    @property
    def decided(self) -> bool:
        """The run already decided to compensate (its plan is stored)."""
        return self.plan_record is not None

    def registration(self, step: str, fn: Callable[..., Any], token: int) -> StepRecord | None:
        """The record that registers `fn` for `step`, or None when it is recorded already."""
        if step in self.recorded:
            return None
        return StepRecord(
            name=f"{COMPENSATION_PREFIX}{step}",
            kind="step",
            status="completed",
            fencing_token=token,
            output_json=json.dumps({"compensation": compensation_name(fn)}),
        )

    def register(self, step: str, fn: Callable[..., Any], output: Any) -> None:
        self.live[step] = (fn, output)

    def new_plan(
        self, completed: Callable[[str], bool], error: ErrorInfo | None, token: int
    ) -> StepRecord:
        """The `umt.compensating` record: every recorded registration whose step completed,
        newest first, and why the run gave up."""
        steps = [step for step in reversed(self.recorded) if completed(step)]
        payload = {
            "error": None if error is None else {"type": error.type, "message": error.message},
            "steps": steps,
        }
        return StepRecord(
            name=COMPENSATING,
            kind="step",
            status="completed",
            fencing_token=token,
            output_json=json.dumps(payload),
        )

    def plan(self) -> tuple[list[Compensation], ErrorInfo | None]:
        """The stored plan's compensations, in the order they run, and why the run gave up."""
        assert self.plan_record is not None
        raw = json.loads(self.plan_record.output_json or "{}")
        error = raw.get("error")
        info = None if error is None else ErrorInfo(type=error["type"], message=error["message"])
        entries: list[Compensation] = []
        for step in raw.get("steps", []):
            fn, output = self.live.get(step, (None, None))
            entries.append(
                Compensation(step=step, name=self.recorded.get(step, "?"), fn=fn, output=output)
            )
        return entries, info


def _recorded_name(output_json: str | None) -> str:
    try:
        raw = json.loads(output_json or "{}")
    except ValueError:
        return "?"
    name = raw.get("compensation") if isinstance(raw, dict) else None
    return name if isinstance(name, str) else "?"
