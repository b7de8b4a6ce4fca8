"""RetryPolicy: validation, the delay sequence and its cap, presets, and which errors are final."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from umt_sdk import RetryPolicy
from umt_sdk.exceptions import (
    BackendError,
    BackendUnavailableError,
    CanceledError,
    FencingError,
    NonDeterminismError,
    NotInTaskError,
    PayloadError,
    StepFailedError,
    TaskDefinitionError,
    UnknownTaskError,
    UsageError,
)

S = timedelta(seconds=1)


def test_defaults() -> None:
    policy = RetryPolicy()
    assert policy.max_attempts == 3
    assert policy.initial == S
    assert policy.backoff == 2.0
    assert policy.max_interval == timedelta(minutes=5)
    assert policy.non_retryable == ()


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": -3}, "max_attempts"),
        ({"initial": timedelta(0)}, "initial"),
        ({"initial": -S}, "initial"),
        ({"max_interval": timedelta(0)}, "max_interval"),
        ({"backoff": 0.5}, "backoff"),
        ({"backoff": 0.0}, "backoff"),
    ],
)
def test_invalid_values_are_rejected(kwargs: dict[str, Any], names: str) -> None:
    with pytest.raises(ValueError, match=names) as caught:
        RetryPolicy(**kwargs)
    assert isinstance(caught.value, UsageError)  # a ValueError still, and now a UsageError
    assert caught.value.argument == names


@pytest.mark.parametrize("non_retryable", [[KeyError], KeyError, ("KeyError",), (int,), (None,)])
def test_non_retryable_must_be_a_tuple_of_exception_classes(non_retryable: Any) -> None:
    # Anything else used to be accepted here and then blow up inside the worker at retry time.
    # A UsageError since the hierarchy change (it was a TypeError; UsageError is not one).
    with pytest.raises(
        UsageError, match="non_retryable must be a tuple of exception classes"
    ) as caught:
        RetryPolicy(non_retryable=non_retryable)
    assert caught.value.argument == "non_retryable"


def test_the_policy_is_frozen_and_hashable() -> None:
    policy = RetryPolicy(non_retryable=(KeyError,))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        policy.max_attempts = 9  # type: ignore[misc]
    assert hash(policy) == hash(RetryPolicy(non_retryable=(KeyError,)))


def test_only_keyword_arguments() -> None:
    with pytest.raises(TypeError):
        RetryPolicy(3)  # type: ignore[misc]


# -- delays -----------------------------------------------------------------------------------


def test_no_delay_before_the_first_attempt() -> None:
    policy = RetryPolicy()
    assert policy.delay_before(0) == timedelta(0)
    assert policy.delay_before(1) == timedelta(0)


def test_delays_grow_by_the_backoff_then_stop_at_the_cap() -> None:
    policy = RetryPolicy(max_attempts=20, initial=2 * S, backoff=3.0, max_interval=timedelta(1))
    assert [policy.delay_before(n).total_seconds() for n in range(2, 8)] == [
        2.0,
        6.0,
        18.0,
        54.0,
        162.0,
        486.0,
    ]
    capped = RetryPolicy(initial=S, max_interval=10 * S)
    assert [capped.delay_before(n) for n in range(2, 8)] == [S, 2 * S, 4 * S, 8 * S, 10 * S, 10 * S]


def test_constant_backoff() -> None:
    policy = RetryPolicy(initial=timedelta(milliseconds=250), backoff=1.0)
    assert {policy.delay_before(n) for n in range(2, 50)} == {timedelta(milliseconds=250)}


@pytest.mark.parametrize("attempt", [40, 49, 60, 1_100, 10**6])
def test_the_cap_holds_for_any_attempt(attempt: int) -> None:
    # 2 ** 47 seconds no longer fits a timedelta and 2.0 ** 1100 no longer fits a float:
    # the delay must still be the cap, not an OverflowError inside the worker.
    policy = RetryPolicy(max_attempts=10**7)
    assert policy.delay_before(attempt) == timedelta(minutes=5)


def test_the_cap_holds_with_an_integer_backoff() -> None:
    policy = RetryPolicy(max_attempts=10**7, backoff=2)
    assert policy.delay_before(5_000) == timedelta(minutes=5)


# -- presets ----------------------------------------------------------------------------------


def test_network_preset() -> None:
    policy = RetryPolicy.network()
    assert policy.max_attempts == 5
    assert [policy.delay_before(n) for n in range(1, 6)] == [timedelta(0), S, 2 * S, 4 * S, 8 * S]
    assert policy.delay_before(8) == 60 * S, "64 s is capped at 60 s"
    assert policy.max_interval == 60 * S
    assert [policy.should_retry(OSError(), n) for n in range(1, 6)] == [True] * 4 + [False]


def test_file_preset() -> None:
    policy = RetryPolicy.file()
    assert policy.max_attempts == 3
    assert [policy.delay_before(n) for n in (2, 3)] == [S, 2 * S]
    assert policy.delay_before(30) == policy.max_interval
    assert [policy.should_retry(OSError(), n) for n in (1, 2, 3)] == [True, True, False]


def test_none_preset_is_a_single_attempt() -> None:
    assert RetryPolicy.none().max_attempts == 1
    assert not RetryPolicy.none().should_retry(OSError(), 1)


# -- which errors retry -----------------------------------------------------------------------


def test_ordinary_errors_retry_until_the_attempts_are_used() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert [policy.should_retry(ValueError("x"), n) for n in (1, 2, 3, 4)] == [
        True,
        True,
        False,
        False,
    ]


def test_non_retryable_errors_and_their_subclasses_fail_at_once() -> None:
    policy = RetryPolicy(max_attempts=10, non_retryable=(LookupError,))
    assert not policy.should_retry(LookupError(), 1)
    assert not policy.should_retry(KeyError("k"), 1)
    assert policy.should_retry(ValueError(), 1)


@pytest.mark.parametrize(
    "error",
    [
        PayloadError(),
        NonDeterminismError(),
        TaskDefinitionError(),
        UnknownTaskError(),
        NotInTaskError(),
        UsageError(),
        FencingError(),
        StepFailedError(),
        CanceledError(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_some_errors_are_always_final(error: Exception) -> None:
    assert not RetryPolicy(max_attempts=100).should_retry(error, 1)


def test_backend_errors_are_retried() -> None:
    assert RetryPolicy().should_retry(BackendError(), 1)
    assert RetryPolicy().should_retry(BackendUnavailableError(), 1)


_FIELDS = ("initial", "max_interval", "max_attempts", "backoff")
_ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.timedeltas(),
    st.lists(st.integers(), max_size=2),
    st.decimals(allow_nan=False, allow_infinity=False),
)


def _valid(field: str, value: object) -> bool:
    if field in ("initial", "max_interval"):
        # At most 100 years: `now + max_interval` must stay a datetime when a retry is due.
        return isinstance(value, timedelta) and timedelta(0) < value <= timedelta(days=36_500)
    if field == "max_attempts":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value >= 1.0  # an int too big for a float: no
    except OverflowError:
        return False


@given(field=st.sampled_from(_FIELDS), value=_ANY_VALUE)
def test_a_retry_policy_takes_a_valid_value_or_refuses_it_with_a_usage_error(
    field: str, value: object
) -> None:
    # A refused argument is a UsageError naming it (never retried inside a handler), never a
    # TypeError out of a comparison.
    if _valid(field, value):
        RetryPolicy(**{field: value})  # type: ignore[arg-type]  # any value, as users write
        return
    with pytest.raises(UsageError) as caught:
        RetryPolicy(**{field: value})  # type: ignore[arg-type]  # a wrong value, refused
    assert caught.value.argument == field
