"""The exceptions umt raises, in one tree.

```
UmtError
├── UsageError               (also ValueError) an API got an argument it refuses (fix the call)
│   ├── TaskDefinitionError  a task or step is declared wrongly (@task, @step, Registry)
│   │   └── UnknownTaskError (also LookupError) no such (name, version) is registered
│   ├── NotInTaskError       a step or the context was used outside a running task
│   └── CallbackTokenError   complete_callback: the token is malformed, unknown, expired or used
├── PayloadError             (also ValueError) an input/output/payload does not fit its type
├── CodecError               a stored payload cannot be decoded (tampered, unknown key, no codec)
├── BackendError             the backend failed; the operation may be retried
│   ├── BackendNotFoundError no installed backend plugin serves the URL
│   ├── BackendUnavailableError  the database could not be reached (restart, lost connection)
│   └── TransactionConflictError  a transactional step's transaction lost to a concurrent one
├── FencingError             this attempt no longer holds the run (lease lost): never retry
├── IdempotencyConflictError same idempotency key, different input or task version
├── RunNotFoundError         (also LookupError) no run with that id
│   └── RunPrunedError       the run existed and retention deleted it (its tombstone says so)
├── ScheduleNotFoundError    (also LookupError) no schedule with that name
├── NonDeterminismError      the code no longer matches the run's recorded history
├── LeaseLostTooOftenError   a run kept losing its lease without progress (its recorded error)
├── StepFailedError          a step exhausted its retries; carries the recorded error
├── FactTimeoutError         (also TimeoutError) a wait_for_fact passed its timeout
│   └── CallbackTimeoutError  a wait_for_callback passed its token's expiry
├── StepTimeoutError         (also TimeoutError) a step attempt ran past its timeout
├── DeadlineExceededError    (also TimeoutError) the run was not finished at its deadline
│   └── StartDeadlineExceededError  the run was not started before its start deadline
├── CanceledError            the run was canceled (raised inside the handler)
├── Compensate               raised by a handler: undo the completed steps (a saga), then end
├── CompensationFailedError  a compensation could not run (its step failed, or the code lost it)
├── RunFailedError           engine.result(): the run ended failed
│   ├── ChildFailedError     a child run's result, in its parent: the child ended failed
│   └── RunCompensatedError  engine.result(): the run failed and its compensations ran
├── RunCanceledError         engine.result(): the run ended canceled
│   └── ChildCanceledError   a child run's result, in its parent: the child ended canceled
├── ChildrenFailedError      a map or gather in a parent: some children failed or were canceled
└── ResultTimeoutError       (also TimeoutError) engine.result() waited longer than asked
```

Each class's docstring is its default message; structured details are attributes.

What to catch: `UsageError` for every refused argument, decoration errors included (it is a
`ValueError`, so `except ValueError` still works; it is not a `TypeError`, even where a wrong
type was passed). `BackendError` for failures that a retry may fix. `FencingError` on its own:
this attempt lost the run, and retrying the write would only be refused again; stop the
execution (umt does, for its own writes and for `with_attempt_token`).
"""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

__all__ = [
    "BackendError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "CallbackTimeoutError",
    "CallbackTokenError",
    "CanceledError",
    "ChildCanceledError",
    "ChildFailedError",
    "ChildrenFailedError",
    "CodecError",
    "Compensate",
    "CompensationFailedError",
    "DeadlineExceededError",
    "FactTimeoutError",
    "FencingError",
    "IdempotencyConflictError",
    "LeaseLostTooOftenError",
    "NonDeterminismError",
    "NotInTaskError",
    "PayloadError",
    "ResultTimeoutError",
    "RunCanceledError",
    "RunCompensatedError",
    "RunFailedError",
    "RunNotFoundError",
    "RunPrunedError",
    "ScheduleNotFoundError",
    "StartDeadlineExceededError",
    "StepFailedError",
    "StepTimeoutError",
    "TaskDefinitionError",
    "TransactionConflictError",
    "UmtError",
    "UnknownTaskError",
    "UsageError",
]


class UmtError(Exception):
    """An error raised by umt."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (type(self).__doc__ or type(self).__name__).strip())


class UsageError(UmtError, ValueError):
    """An API was called with an argument it refuses: fix the call (the message names the
    argument and what it takes). Nothing was stored."""

    def __init__(self, message: str | None = None, *, argument: str = "") -> None:
        super().__init__(message)
        self.argument = argument


class CallbackTokenError(UsageError):
    """`complete_callback` refused the token, and changed nothing. `reason` says why:
    `malformed` (not a token's shape), `unknown` (well formed, but no callback of that run
    has it: forged, or bound to another run), `expired` (its timeout passed), `completed`
    (already used: the first payload stays), `finished` (its run has ended)."""

    def __init__(self, message: str | None = None, *, reason: str = "") -> None:
        super().__init__(message, argument="token")
        self.reason = reason


class TaskDefinitionError(UsageError):
    """A task or step is declared in a way umt cannot accept: found when it is decorated
    (`@task`, `@step`) or when the `Registry` takes or resolves it. Fix the declaration."""


class UnknownTaskError(TaskDefinitionError, LookupError):
    """No task with that name and version is registered."""

    def __init__(self, message: str | None = None, *, task_name: str = "") -> None:
        super().__init__(message)
        self.task_name = task_name


class NotInTaskError(UsageError):
    """This can only be used while a task is running: call it from inside a @task handler."""


class PayloadError(UmtError, ValueError):
    """A payload does not fit its declared type."""

    def __init__(self, message: str | None = None, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class CodecError(UmtError):
    """A stored payload cannot be decoded: it was changed after it was stored, it names a key
    or a codec this engine does not have, or it is sealed and the engine has no codec
    (`connect(..., codec=...)`, `umt --codec`). Retrying does not help; fix the codec."""

    def __init__(self, message: str | None = None, *, codec: str = "") -> None:
        super().__init__(message)
        self.codec = codec


class BackendError(UmtError):
    """The backend failed to carry out an operation."""


class BackendNotFoundError(BackendError):
    """No installed backend serves this URL."""


class BackendUnavailableError(BackendError):
    """The backend could not be reached (connection lost, server restarting); it may be back
    later. A running execution whose own write fails this way stops, and the run resumes from
    its records once its lease expires: an outage is not charged to the run as a failure."""


class TransactionConflictError(BackendError):
    """The transaction of a transactional step was refused because of a concurrent one (a
    serialization failure, SQLSTATE 40001, or a deadlock, 40P01): nothing of it was stored.
    umt runs the step's transaction again a few times at once before the step's retry policy
    sees this error."""

    def __init__(self, message: str | None = None, *, sqlstate: str = "") -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class FencingError(UmtError):
    """This attempt no longer holds the run: its lease expired and another attempt took over.

    Not a `BackendError`: the backend worked and refused the write on purpose. Never retry
    it; the attempt must stop (its run goes on under the newer attempt)."""

    def __init__(
        self,
        message: str | None = None,
        *,
        run_id: UUID | None = None,
        fencing_token: int | None = None,
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.fencing_token = fencing_token


class IdempotencyConflictError(UmtError):
    """A run with this idempotency key exists with a different input, or of another version
    of the task."""

    def __init__(
        self,
        message: str | None = None,
        *,
        idempotency_key: str = "",
        run_id: UUID | None = None,
        existing_version: int | None = None,
        requested_version: int | None = None,
    ) -> None:
        super().__init__(message)
        self.idempotency_key = idempotency_key
        self.run_id = run_id
        self.existing_version = existing_version
        """With a version conflict: the version of the run the key already names."""
        self.requested_version = requested_version
        """With a version conflict: the version this enqueue asked for."""


class RunNotFoundError(UmtError, LookupError):
    """No run with this id exists."""

    def __init__(self, message: str | None = None, *, run_id: UUID | None = None) -> None:
        super().__init__(message)
        self.run_id = run_id


class RunPrunedError(RunNotFoundError):
    """The run finished and was deleted by retention; only its tombstone is left."""

    def __init__(
        self,
        message: str | None = None,
        *,
        run_id: UUID | None = None,
        status: str = "",
        finished_at: datetime | None = None,
        pruned_at: datetime | None = None,
    ) -> None:
        super().__init__(message, run_id=run_id)
        self.status = status
        self.finished_at = finished_at
        self.pruned_at = pruned_at


class ScheduleNotFoundError(UmtError, LookupError):
    """No schedule with this name exists."""

    def __init__(self, message: str | None = None, *, schedule_name: str = "") -> None:
        super().__init__(message)
        self.schedule_name = schedule_name


class NonDeterminismError(UmtError):
    """The task's code no longer matches the history recorded for this run.

    Raised by an execution when a step's recorded kind differs from what the code asks for,
    and by `umt_sdk.testing.Replayer` at the first call its history cannot satisfy; then the
    message is a diff of the recorded steps and today's calls, and `position` (1-based),
    `recorded` and `current` describe the first one that differs (`"step 'charge'"`,
    `"sleep 'cool-down'"`, `"fact 'approved'"`, or what stands in for none)."""

    def __init__(
        self,
        message: str | None = None,
        *,
        step_name: str = "",
        recorded_kind: str = "",
        current_kind: str = "",
        run_id: UUID | None = None,
        position: int | None = None,
        recorded: str = "",
        current: str = "",
    ) -> None:
        super().__init__(message)
        self.step_name = step_name
        self.recorded_kind = recorded_kind
        self.current_kind = current_kind
        self.run_id = run_id
        self.position = position
        self.recorded = recorded
        self.current = current


class LeaseLostTooOftenError(UmtError):
    """The run lost its lease too many times without recording a step: its executions keep
    dying (a crash, an OOM kill, a freeze longer than the lease) on a fault that repeats, so
    the engine failed it instead of starting it again. Fix the cause, then enqueue it again.

    Recorded as the run's error (`RunFailedError.error_type` ends with this class's name);
    the limit is the task's `max_lost_leases`."""

    def __init__(
        self,
        message: str | None = None,
        *,
        run_id: UUID | None = None,
        lost_leases: int = 0,
        max_lost_leases: int = 0,
        step_name: str | None = None,
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.lost_leases = lost_leases
        self.max_lost_leases = max_lost_leases
        self.step_name = step_name


class StepFailedError(UmtError):
    """A step failed and has no retries left."""

    def __init__(
        self,
        message: str | None = None,
        *,
        step_name: str = "",
        error_type: str = "",
        error_message: str = "",
    ) -> None:
        super().__init__(message)
        self.step_name = step_name
        self.error_type = error_type
        self.error_message = error_message


class FactTimeoutError(UmtError, TimeoutError):
    """No fact of that name arrived before the wait's timeout."""

    def __init__(self, message: str | None = None, *, fact_name: str = "") -> None:
        super().__init__(message)
        self.fact_name = fact_name


class CallbackTimeoutError(FactTimeoutError):
    """No `complete_callback` came before the callback token expired (raised by
    `wait_for_callback`, and again on replay)."""

    def __init__(self, message: str | None = None, *, callback_name: str = "") -> None:
        super().__init__(message, fact_name=callback_name)
        self.callback_name = callback_name


class StepTimeoutError(UmtError, TimeoutError):
    """A step attempt ran past its timeout: an async body was cancelled, a plain one (a
    thread, which cannot be killed) was left to finish on its own and its result ignored. The
    attempt failed; the step's retry policy decides whether another one runs."""

    def __init__(
        self, message: str | None = None, *, step_name: str = "", timeout_seconds: float = 0.0
    ) -> None:
        super().__init__(message)
        self.step_name = step_name
        self.timeout_seconds = timeout_seconds


class DeadlineExceededError(UmtError, TimeoutError):
    """The run was not finished at its deadline (`@task(timeout=...)`,
    `enqueue(deadline=...)`): it ended failed, never retried, whatever it was doing."""

    def __init__(
        self,
        message: str | None = None,
        *,
        run_id: UUID | None = None,
        deadline_at: datetime | None = None,
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.deadline_at = deadline_at


class StartDeadlineExceededError(DeadlineExceededError):
    """The run was not claimed before its start deadline (`enqueue(start_within=...)`): it
    ended failed without running."""


class CanceledError(UmtError):
    """The run was canceled."""

    def __init__(self, message: str | None = None, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class Compensate(UmtError):
    """The run gives up and undoes what it did: the compensations of its completed steps
    (`ctx.step.run(..., compensate=fn)`) run in reverse order, each as a durable step, and the
    run ends `compensated` (or `failed`, naming the compensation that could not run)."""


class CompensationFailedError(UmtError):
    """A compensation could not run: its step failed with no retries left, or the code that
    replays the run no longer registers it (`step_name` is the step it undoes). The run ends
    `failed` with this error; the compensations after it in the reverse order did not run."""

    def __init__(
        self,
        message: str | None = None,
        *,
        step_name: str = "",
        compensation: str = "",
        error_type: str = "",
        error_message: str = "",
    ) -> None:
        super().__init__(message)
        self.step_name = step_name
        self.compensation = compensation
        self.error_type = error_type
        self.error_message = error_message


class RunFailedError(UmtError):
    """The run ended failed."""

    def __init__(
        self,
        message: str | None = None,
        *,
        run_id: UUID | None = None,
        error_type: str = "",
        error_message: str = "",
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.error_type = error_type
        self.error_message = error_message


class RunCanceledError(UmtError):
    """The run ended canceled."""

    def __init__(
        self, message: str | None = None, *, run_id: UUID | None = None, reason: str = ""
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.reason = reason


class ChildFailedError(RunFailedError):
    """A child run ended failed (raised in its parent by the child's result, on every replay
    too); `step_name` is the step that started it, `run_id` the child's."""

    def __init__(
        self,
        message: str | None = None,
        *,
        run_id: UUID | None = None,
        step_name: str = "",
        error_type: str = "",
        error_message: str = "",
    ) -> None:
        super().__init__(message, run_id=run_id, error_type=error_type, error_message=error_message)
        self.step_name = step_name


class RunCompensatedError(RunFailedError):
    """The run failed and every compensation of its completed steps ran (status
    `compensated`); `error_type` and `error_message` are why it gave up. A `RunFailedError`,
    so code that catches failures catches it too."""


class ChildCanceledError(RunCanceledError):
    """A child run ended canceled (raised in its parent by the child's result, on every replay
    too); `step_name` is the step that started it, `run_id` the child's."""

    def __init__(
        self,
        message: str | None = None,
        *,
        run_id: UUID | None = None,
        step_name: str = "",
        reason: str = "",
    ) -> None:
        super().__init__(message, run_id=run_id, reason=reason)
        self.step_name = step_name


class ChildrenFailedError(UmtError):
    """Some children of a fan-out (`ctx.step.map`, `ctx.step.gather`) failed or were canceled
    (raised in the parent once all of them finished, on every replay too).

    `results` holds every child's outcome in input order: its output, or the
    `ChildFailedError` / `ChildCanceledError` it ended with; `errors` maps the index of each
    child that did not complete to that error. `step_name` is the map's or gather's name.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        step_name: str = "",
        results: list[object] | None = None,
        errors: dict[int, ChildFailedError | ChildCanceledError] | None = None,
    ) -> None:
        super().__init__(message)
        self.step_name = step_name
        self.results: list[object] = results if results is not None else []
        self.errors: dict[int, ChildFailedError | ChildCanceledError] = (
            errors if errors is not None else {}
        )


class ResultTimeoutError(UmtError, TimeoutError):
    """The run did not finish within the time given to result()."""
