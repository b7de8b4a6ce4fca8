"""Arguments of the public API, checked where they come in.

A refused argument is a `UsageError` that names it (in its message and its `argument`) and says
what it takes; never a `TypeError` from a comparison deep inside, and never a retry when the
call was made inside a handler (a `UsageError` is final). Each helper returns the value it
accepted, so a call site reads `priority = check.integer(priority, "priority", ...)`.

Messages never call a refused value's `__repr__` unguarded: it is user code, and may raise.

Pure helpers: this module imports nothing of the SDK but its exceptions.
"""

from __future__ import annotations

import math
import numbers
import types
from collections.abc import Callable, Collection, Iterable
from datetime import datetime, timedelta
from typing import Any, NoReturn
from uuid import UUID

from umt_sdk.exceptions import UsageError

__all__ = [
    "MAX_DURATION",
    "aware_datetime",
    "choice",
    "clock",
    "collection",
    "duration",
    "finite",
    "flag",
    "function",
    "integer",
    "refuse",
    "seconds",
    "shown",
    "text",
    "uuid",
]

MAX_DURATION = timedelta(days=36_500)
"""The longest time span an argument may give (100 years): `now + span` must stay a datetime
(a `timedelta.max` delay would overflow when the run is scheduled, inside the engine)."""

_SHOWN_LENGTH = 80


def shown(value: object) -> str:
    """`value` for a message: its type and a short repr (`int 30`, `str '30'`, `None`), safe
    from a `__repr__` that raises or an int too long to print."""
    kind = type(value).__qualname__
    if value is None:
        return "None"
    try:
        text = repr(value)
    except Exception:  # user code, or an int past the digit limit of int -> str
        return f"a {kind} object that cannot be printed"
    if not isinstance(text, str):  # pragma: no cover - repr() itself refuses non-str
        return f"a {kind} object"
    if len(text) > _SHOWN_LENGTH:
        text = f"{text[:_SHOWN_LENGTH]}..."
    if isinstance(value, timedelta | datetime | UUID) or text.startswith("<"):
        return text  # the repr names the type already
    return f"{kind} {text}"


def refuse(
    argument: str, expected: str, value: object, *, where: str = "", hint: str = ""
) -> NoReturn:
    """Raise the `UsageError` of `argument`: "<where>: <argument> must be <expected>, got
    <value>[: <hint>]"."""
    prefix = f"{where}: " if where else ""
    suffix = f": {hint}" if hint else ""
    raise UsageError(
        f"{prefix}{argument} must be {expected}, got {shown(value)}{suffix}", argument=argument
    )


def optional(value: object, kind: type, argument: str, expected: str, *, where: str = "") -> None:
    """Refuse `value` unless it is None or a `kind` (`expected` says it in words)."""
    if value is not None and not isinstance(value, kind):
        refuse(argument, f"{expected}, or None", value, where=where)


def _range_text(low: object, high: object, unit: str = "") -> str:
    if low is not None and high is not None:
        return f"in {low}..{high}{unit}"
    if low is not None:
        return f">= {low}{unit}"
    if high is not None:  # pragma: no cover - every caller bounds from below
        return f"<= {high}{unit}"
    return ""


def integer(
    value: object,
    argument: str,
    *,
    at_least: int | None = None,
    at_most: int | None = None,
    expected: str | None = None,
    where: str = "",
) -> int:
    """An `int` (a bool is refused: it is not a count) within the bounds given."""
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (at_least is None or value >= at_least)
        and (at_most is None or value <= at_most)
    ):
        return value
    if expected is None:
        expected = f"an integer {_range_text(at_least, at_most)}".rstrip()
    hint = ""
    if isinstance(value, bool):
        hint = "a bool is not a number here; pass an int"
    elif isinstance(value, float) and value.is_integer() and abs(value) < 1e18:
        hint = f"pass the int {int(value)}"
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        hint = "convert text with int(text)"
    refuse(argument, expected, value, where=where, hint=hint)


def seconds(value: object, argument: str, *, expected: str | None = None, where: str = "") -> float:
    """A finite number of seconds >= 0 (an int or a float; not a bool, not a timedelta)."""
    number = finite(value)
    if number is not None and number >= 0:
        return number
    hint = ""
    if isinstance(value, timedelta):
        hint = f"pass seconds as a number, such as {value.total_seconds()!r}"
    elif isinstance(value, bool):
        hint = "a bool is not a number of seconds"
    refuse(argument, expected or "a finite number of seconds >= 0", value, where=where, hint=hint)


def duration(
    value: object,
    argument: str,
    *,
    at_least: timedelta | None = timedelta(0),
    positive: bool = False,
    at_most: timedelta = MAX_DURATION,
    expected: str | None = None,
    where: str = "",
) -> timedelta:
    """A `timedelta` within the bounds (`positive`: > 0; at most `MAX_DURATION` by default).

    A number is refused with the timedelta to write instead: a bare 30 could be seconds or
    minutes, and umt never guesses."""
    if isinstance(value, timedelta) and value <= at_most:
        if positive:
            if value > timedelta(0):
                return value
        elif at_least is None or value >= at_least:
            return value
    if expected is None:
        low = "> 0" if positive else ("" if at_least is None else f">= {_span(at_least)}")
        expected = f"a timedelta {low} (at most {_span(at_most)})".replace("  ", " ")
    hint = ""
    number = finite(value)
    if number is not None:
        shown_number = value if isinstance(value, int) and abs(value) < 10**18 else number
        hint = f"use timedelta(seconds={shown_number!r})"
    elif isinstance(value, bool):
        hint = "a bool is not a time span"
    elif isinstance(value, str):
        hint = "use a timedelta such as timedelta(seconds=30), not text"
    refuse(argument, expected, value, where=where, hint=hint)


def finite(value: object) -> float | None:
    """`value` as a finite float if it is a real number (not a bool), else None."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):  # an int too large for a float, say
        return None
    return number if math.isfinite(number) else None


def _span(span: timedelta) -> str:
    if span == timedelta(0):
        return "0"
    if span % timedelta(days=1) == timedelta(0):
        return f"{span.days} days"
    if span < timedelta(seconds=1):
        return f"{span // timedelta(milliseconds=1)} ms"
    return f"{span.total_seconds():g} s"


def text(
    value: object,
    argument: str,
    *,
    empty: bool = True,
    max_length: int | None = None,
    expected: str | None = None,
    where: str = "",
) -> str:
    """A `str` (not bytes), non-empty unless `empty`, of at most `max_length` characters."""
    if (
        isinstance(value, str)
        and (empty or value)
        and (max_length is None or len(value) <= max_length)
    ):
        return value
    if expected is None:
        expected = "a non-empty string" if not empty else "a string"
        if max_length is not None:
            expected += f" of at most {max_length} characters"
    hint = "decode bytes to text first" if isinstance(value, bytes | bytearray) else ""
    refuse(argument, expected, value, where=where, hint=hint)


def flag(value: object, argument: str, *, where: str = "") -> bool:
    """True or False exactly: a truthy 1 or "no" is a mistake, not a choice."""
    if isinstance(value, bool):
        return value
    refuse(argument, "True or False", value, where=where)


def function(
    value: object, argument: str, *, expected: str | None = None, where: str = ""
) -> Callable[..., Any]:
    """A callable (a function, a lambda, an object with `__call__`)."""
    if callable(value):
        return value
    refuse(argument, expected or "a function", value, where=where)


def uuid(value: object, argument: str, *, expected: str = "a uuid.UUID", where: str = "") -> UUID:
    """A `uuid.UUID` (text is refused: convert it with `uuid.UUID(text)`)."""
    if isinstance(value, UUID):
        return value
    hint = "convert text with uuid.UUID(text)" if isinstance(value, str) else ""
    refuse(argument, expected, value, where=where, hint=hint)


def choice(value: object, argument: str, choices: Collection[str], *, where: str = "") -> str:
    """One of `choices` (strings; compared only once `value` is known to be a str, so an
    object whose `__eq__` or `__hash__` raises is refused, not raised from)."""
    if isinstance(value, str) and value in choices:
        return value
    refuse(argument, f"one of {', '.join(sorted(choices))}", value, where=where)


def aware_datetime(value: object, argument: str, *, where: str = "") -> datetime:
    """A timezone-aware `datetime` (a naive one cannot be compared with umt's UTC times)."""
    if isinstance(value, datetime) and value.utcoffset() is not None:
        return value
    hint = "add tzinfo=UTC" if isinstance(value, datetime) else ""
    refuse(argument, "a timezone-aware datetime", value, where=where, hint=hint)


def clock(value: object, argument: str, *, where: str = "") -> Any:
    """A clock: an object whose `now()` returns a timezone-aware datetime (`FakeClock()`), not
    the `datetime` class, whose `now()` is naive."""
    now = getattr(value, "now", None)
    if callable(now) and not isinstance(value, type):
        try:
            sample = now()
        except Exception:  # a clock that cannot tell the time is no clock
            sample = None
        if isinstance(sample, datetime) and sample.utcoffset() is not None:
            return value
    refuse(
        argument,
        "a clock (an object whose now() returns a timezone-aware datetime, such as FakeClock())",
        value,
        where=where,
    )


def collection(value: object, argument: str, *, expected: str, where: str = "") -> list[Any]:
    """The items of a list-like argument (a list, a tuple, a set, a generator), as a list.

    Refused: text and bytes (iterable, but one value), and types (`list[int]` iterates too)."""
    if isinstance(value, Iterable) and not isinstance(
        value, str | bytes | bytearray | type | types.GenericAlias
    ):
        return list(value)
    hint = f"wrap one item in a list: [{shown(value)}]" if isinstance(value, str) else ""
    refuse(argument, expected, value, where=where, hint=hint)
