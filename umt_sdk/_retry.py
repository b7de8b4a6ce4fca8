from __future__ import annotations

from datetime import timedelta

from attrs import field, frozen

from umt_sdk import _check as check
from umt_sdk.exceptions import (
    CanceledError,
    DeadlineExceededError,
    FencingError,
    NonDeterminismError,
    PayloadError,
    StepFailedError,
    UsageError,
)

__all__ = ["RetryPolicy"]

# Errors that retrying cannot fix: the code or the data must change first (UsageError covers
# TaskDefinitionError and NotInTaskError), or the attempt has lost the run (FencingError: a
# retry's writes would be refused again; it is not a BackendError, which may be retried), or
# the run is past its deadline (DeadlineExceededError).
_ALWAYS_FINAL: tuple[type[BaseException], ...] = (
    PayloadError,
    NonDeterminismError,
    UsageError,
    FencingError,
    StepFailedError,
    CanceledError,
    DeadlineExceededError,
)


# The validators guard RetryPolicy(...), a call of the API: what they refuse is a UsageError.


def _positive(_: object, attribute: object, value: object) -> None:
    name = getattr(attribute, "name", "?")
    check.duration(
        value,
        name,
        positive=True,
        expected="a timedelta > 0 such as timedelta(seconds=1) (at most "
        f"{check.MAX_DURATION.days} days)",
        where="RetryPolicy",
    )


def _at_least_one(_: object, __: object, value: object) -> None:
    check.integer(
        value, "max_attempts", at_least=1, expected="a whole number >= 1", where="RetryPolicy"
    )


def _backoff_ok(_: object, __: object, value: object) -> None:
    # An int too large for a float is refused too (math.isfinite would raise OverflowError).
    number = check.finite(value) if isinstance(value, int | float) else None
    if number is None or number < 1.0:
        check.refuse("backoff", "a number >= 1.0", value, where="RetryPolicy")


def _exception_types(_: object, __: object, value: object) -> None:
    if not isinstance(value, tuple) or not all(
        isinstance(t, type) and issubclass(t, BaseException) for t in value
    ):
        hint = ""
        if isinstance(value, list):
            hint = "use a tuple, such as (KeyError,)"
        elif isinstance(value, type) and issubclass(value, BaseException):
            hint = f"use a tuple, such as ({value.__name__},)"
        check.refuse(
            "non_retryable", "a tuple of exception classes", value, where="RetryPolicy", hint=hint
        )


@frozen(kw_only=True)
class RetryPolicy:
    """How often and how soon a failed step or task is tried again.

    Attempt n (n >= 2) starts `initial * backoff ** (n - 2)` after attempt n-1 failed, capped at
    `max_interval`. Errors whose type is in `non_retryable` fail at once. Retries are durable:
    the run is rescheduled and its worker slot released while it waits.
    """

    max_attempts: int = field(default=3, validator=_at_least_one)
    initial: timedelta = field(default=timedelta(seconds=1), validator=_positive)
    backoff: float = field(default=2.0, validator=_backoff_ok)
    max_interval: timedelta = field(default=timedelta(minutes=5), validator=_positive)
    non_retryable: tuple[type[BaseException], ...] = field(default=(), validator=_exception_types)

    @classmethod
    def network(cls) -> RetryPolicy:
        """Network work: 5 attempts, 1 s doubling to at most 60 s."""
        return cls(max_attempts=5, initial=timedelta(seconds=1), max_interval=timedelta(seconds=60))

    @classmethod
    def file(cls) -> RetryPolicy:
        """File work: 3 attempts, 1 s doubling."""
        return cls(max_attempts=3, initial=timedelta(seconds=1), max_interval=timedelta(seconds=30))

    @classmethod
    def none(cls) -> RetryPolicy:
        """A single attempt."""
        return cls(max_attempts=1)

    def delay_before(self, attempt: int) -> timedelta:
        """The wait before `attempt` (2 for the first retry)."""
        check.integer(attempt, "attempt", where="RetryPolicy.delay_before")
        if attempt <= 1:
            return timedelta(0)
        try:
            seconds = self.initial.total_seconds() * self.backoff ** (attempt - 2)
        except OverflowError:  # far past the cap
            return self.max_interval
        if seconds >= self.max_interval.total_seconds():  # also before timedelta() overflows
            return self.max_interval
        return timedelta(seconds=seconds)

    def should_retry(self, error: BaseException, failed_attempts: int) -> bool:
        """True if another attempt is due after `failed_attempts` failures ending in `error`."""
        if not isinstance(error, BaseException):
            check.refuse("error", "an exception", error, where="RetryPolicy.should_retry")
        check.integer(failed_attempts, "failed_attempts", where="RetryPolicy.should_retry")
        if isinstance(error, (_ALWAYS_FINAL, self.non_retryable)):
            return False
        return failed_attempts < self.max_attempts
