"""An execution's abort state, and the one rule for what a handler's or a step's exception means.

Five states, in order of precedence (a state is only ever left for a stronger one):

- RUNNING: from the claim. The handler runs; the execution ends as the handler does.
- RELEASING: the worker is shutting down (`shutdown`). The handler is asked to stop
  (`abort_event`); at the next step boundary, or when the handler unwinds, the run is handed
  back uncharged for another worker to finish.
- EXPIRING: the run's deadline came (`deadline`). The handler is asked to stop, the step
  in progress is cut off (an async body cancelled, a thread's result ignored) and the run ends
  failed with `DeadlineExceededError`, whatever else the handler raises. Stronger than a
  shutdown (a run past its deadline is never handed back to start again), weaker than a
  cancel (a run whose cancel was asked for ends canceled).
- CANCELING: the run's cancel was read from the store (`cancel`). The handler is asked to stop;
  the run ends canceled, keeping the handler's error if it raised another one.
- STOPPED: the lease is lost or the process is going away (`lease_lost`, `crash`). The handler
  is cut off and nothing more is written.

`classify` is the one place that turns an exception into what happens next; the step path and
the handler path both ask it.
"""

from __future__ import annotations

import asyncio
import enum
from typing import ClassVar, Literal

from umt_sdk._spi import SimulatedCrash
from umt_sdk.exceptions import CanceledError, DeadlineExceededError, FencingError

__all__ = [
    "AbortKind",
    "AbortState",
    "Aborts",
    "Release",
    "Stop",
    "Suspend",
    "Verdict",
]

AbortKind = Literal["cancel", "deadline", "lease_lost", "shutdown", "crash"]


class Suspend(BaseException):
    """The run is parked; unwind the handler without recording anything else."""

    step_outcome: ClassVar[str] = "retrying"


class Stop(BaseException):
    """This execution must stop writing: its lease is lost or its process is going away."""


class Release(BaseException):
    """The worker is shutting down: give the run back at the next step boundary."""

    step_outcome: ClassVar[str] = "released"


class AbortState(enum.IntEnum):
    """Ordered by precedence: a higher state wins."""

    RUNNING = 0
    RELEASING = 1
    EXPIRING = 2
    CANCELING = 3
    STOPPED = 4


_STATE_OF: dict[AbortKind, AbortState] = {
    "shutdown": AbortState.RELEASING,
    "deadline": AbortState.EXPIRING,
    "cancel": AbortState.CANCELING,
    "lease_lost": AbortState.STOPPED,
    "crash": AbortState.STOPPED,
}


class Verdict(enum.Enum):
    """What an exception out of a step or a handler means."""

    SUSPEND = "suspend"  # parked: unwind, nothing more to write
    STOP = "stop"  # no more writes
    FENCED = "fenced"  # a write was refused: another attempt holds the run; stop
    RELEASE = "release"  # hand the run back, uncharged
    CANCEL = "cancel"  # end canceled
    EXPIRE = "expire"  # the run's deadline came: end failed with DeadlineExceededError
    FAIL = "fail"  # a failure of the user's code: the retry policy decides


class Aborts:
    """The abort state of one execution: one transition method that owns the precedence."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.state = AbortState.RUNNING
        self.kind: AbortKind | None = None
        self.reason: str | None = None
        self.event = asyncio.Event()

    def fire(self, kind: AbortKind, reason: str) -> bool:
        """Move to the state `kind` asks for if it is stronger; True if the state changed.
        Safe from any thread; the event is set on the loop."""
        state = _STATE_OF[kind]
        if state <= self.state:
            return False
        self.state, self.kind, self.reason = state, kind, reason
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self.event.set()  # with the state, so no handler sees one without the other
        else:
            self._loop.call_soon_threadsafe(self.event.set)
        return True

    @property
    def stopped(self) -> bool:
        return self.state is AbortState.STOPPED

    @property
    def canceling(self) -> bool:
        return self.state is AbortState.CANCELING

    @property
    def expiring(self) -> bool:
        return self.state is AbortState.EXPIRING

    @property
    def releasing(self) -> bool:
        return self.state is AbortState.RELEASING

    def raise_at_boundary(self, run_label: str) -> None:
        """What must happen instead of the next step: stop, the cancel, the deadline, or
        release."""
        if self.state is AbortState.STOPPED:
            raise Stop
        if self.state is AbortState.CANCELING:
            reason = self.reason or "canceled"
            raise CanceledError(f"{run_label} canceled: {reason}", reason=reason)
        if self.state is AbortState.EXPIRING:
            raise DeadlineExceededError(f"{run_label}: {self.reason or 'deadline exceeded'}")
        if self.state is AbortState.RELEASING:
            raise Release

    def classify(self, exc: BaseException, *, cancelled_by_worker: bool) -> Verdict:
        """What `exc`, raised by a step body or a handler, means now.

        `cancelled_by_worker`: the execution's task has a cancellation pending (the worker
        cancelled it). A `CancelledError` that user code raised on its own (a library
        cancelling a future of its own) is a failure of that code, not a stop.
        """
        if isinstance(exc, Suspend):
            return Verdict.SUSPEND
        if isinstance(exc, (Stop, SimulatedCrash)) or self.state is AbortState.STOPPED:
            return Verdict.STOP
        if isinstance(exc, FencingError):
            return Verdict.FENCED
        if isinstance(exc, asyncio.CancelledError) and not cancelled_by_worker:
            return Verdict.FAIL
        if self.state is AbortState.CANCELING:
            return Verdict.CANCEL
        if self.state is AbortState.EXPIRING:
            return Verdict.EXPIRE
        if self.state is AbortState.RELEASING or isinstance(exc, Release):
            return Verdict.RELEASE
        if isinstance(exc, asyncio.CancelledError):
            return Verdict.STOP  # cancelled by the worker with no abort: it is going away
        return Verdict.FAIL
