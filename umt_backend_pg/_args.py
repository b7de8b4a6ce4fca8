"""Arguments of the backend's public functions, checked before anything connects: a refused one
is a `UsageError` naming it, as the SDK's own checks are (never a TypeError from psycopg, or an
AttributeError from a value that is not a connection).

Imports no psycopg: `plugin.py` uses it too.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import NoReturn

from umt_sdk.exceptions import UsageError

__all__ = ["described", "duration", "flag", "integer", "path", "refuse", "text"]

_PLAIN = (int, float, str, bytes, bool, timedelta)
_LONGEST = timedelta(days=36_500)  # as the SDK's: `now() + span` must stay a timestamp


def described(value: object) -> str:
    """`value` for a message without running its code: the repr of a builtin value, else only
    its type (a foreign object's `__repr__` may raise, or print a password)."""
    if value is None:
        return "None"
    kind = type(value).__name__
    if type(value) in _PLAIN:
        try:
            text = repr(value)
        except ValueError:  # an int past the digit limit of int -> str
            return f"a huge {kind}"
        return f"{kind} {text[:80]}{'...' if len(text) > 80 else ''}"
    return kind


def refuse(argument: str, expected: str, value: object, *, where: str) -> NoReturn:
    raise UsageError(
        f"{where}: {argument} must be {expected}, got {described(value)}", argument=argument
    )


def integer(
    value: object, argument: str, *, at_least: int, at_most: int | None = None, where: str
) -> int:
    """An int (not a bool) within the bounds."""
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= at_least
        and (at_most is None or value <= at_most)
    ):
        return value
    bounds = f">= {at_least}" if at_most is None else f"in {at_least}..{at_most}"
    refuse(argument, f"an integer {bounds}", value, where=where)


def flag(value: object, argument: str, *, where: str) -> bool:
    if isinstance(value, bool):
        return value
    refuse(argument, "True or False", value, where=where)


def text(value: object, argument: str, *, where: str, expected: str = "a non-empty string") -> str:
    if isinstance(value, str) and value:
        return value
    refuse(argument, expected, value, where=where)


def duration(value: object, argument: str, *, where: str) -> timedelta:
    """A timedelta > 0 and at most 36500 days."""
    if isinstance(value, timedelta) and timedelta(0) < value <= _LONGEST:
        return value
    hint = ""
    if isinstance(value, int | float) and not isinstance(value, bool):
        hint = " (use timedelta(seconds=...))"
    refuse(argument, f"a positive timedelta (at most 36500 days){hint}", value, where=where)


def path(value: object, argument: str, *, where: str) -> str | os.PathLike[str]:
    """A directory path: a str or an `os.PathLike` of one (not bytes)."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
        return value
    refuse(argument, "a directory path (a str or a pathlib.Path)", value, where=where)
