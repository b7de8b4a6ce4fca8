"""Where the test tools (`umt_sdk.testing`: the crash explorer, the replayer) watch an
execution and crash it: named points on its path, reported to an observer of the context.

Without an observer (production), `reach` is one context-variable read. With one, every point
is reported in order; an observer that returns True crashes the execution there, as a SIGKILL
would: the abort state moves to STOPPED (`crash`), so nothing more is written, and
`SimulatedCrash` unwinds the handler. The points, by `kind`:

- `call`: the handler asks for a step, a sleep or a fact wait (`step_kind`), replayed from its
  record (`replayed`) or not; a report only, never a crash point;
- `step.before`: a step's body is about to start (`attempt`);
- `step.returned`: its body returned (`output`, as it will be stored); the record is not
  stored yet;
- `step.recorded`: its completed record is stored; a report only;
- `op.begin`, `op.action`, `op.acted`, `op.commit`, `op.committed`: `with_attempt_token`'s
  phases for op key `name`: before the ledger's begin, before the outside action (`fn`), after
  it and before the commit, inside the commit's transaction once `commit` ran (the result not
  recorded yet), after the result is recorded;
- `park`: a sleep, a fact wait or a step's retry backoff (`step_kind`) is about to park the run;
- `end`: the write that finishes the run (`name` is its status) is about to be sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Literal

from attrs import frozen

from umt_sdk._abort import Aborts
from umt_sdk._spi import SimulatedCrash, StepKind

__all__ = ["Point", "PointKind", "observing", "reach", "report"]

PointKind = Literal[
    "call",
    "step.before",
    "step.returned",
    "step.recorded",
    "op.begin",
    "op.action",
    "op.acted",
    "op.commit",
    "op.committed",
    "park",
    "end",
]


@frozen(kw_only=True)
class Point:
    """One point an execution passed."""

    kind: PointKind
    name: str
    """The step, sleep or fact wait (its recorded name: `name#2` for a second use), the op
    key, or the status of an ending."""
    attempt: int = 1
    step_kind: StepKind | None = None
    replayed: bool = False
    output: str | None = None
    output_type: Any = None
    """`call` of a step: the type its output decodes to (the replayer checks records against
    it)."""


Observer = Callable[[Point], bool]

_OBSERVER: ContextVar[Observer | None] = ContextVar("umt_probe_observer", default=None)


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[None]:
    """Report the points of every execution started in this context to `observer`."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def reach(aborts: Aborts, kind: PointKind, name: str, **details: object) -> None:
    """The execution whose abort state is `aborts` reached a point: report it, and crash here
    if the observer says so."""
    observer = _OBSERVER.get()
    if observer is None:
        return
    point = Point(kind=kind, name=name, **details)  # type: ignore[arg-type]
    if observer(point):
        reason = f"simulated crash at {kind} {name!r}"
        aborts.fire("crash", reason)
        raise SimulatedCrash(reason)


def report(kind: PointKind, name: str, **details: object) -> None:
    """A point that is only reported, never crashed at."""
    observer = _OBSERVER.get()
    if observer is not None:
        observer(Point(kind=kind, name=name, **details))  # type: ignore[arg-type]
