"""How an error is recorded and printed, whatever the error does (issue 33, part 2).

Errors are umt's to store and are never refused: a user's exception whose `__str__` or
`__repr__` raises (anything, even a BaseException), whose message is huge or holds NUL, or
whose cause chain loops, still becomes a record Postgres can hold, and telemetry prints it the
same safe way.
"""

from __future__ import annotations

import traceback

from umt_sdk import _serde
from umt_sdk._spi import ErrorInfo
from umt_sdk.exceptions import StepFailedError

__all__ = ["MESSAGE_LIMIT", "error_info", "printed"]


def error_info(exc: BaseException) -> ErrorInfo:
    """How an exception is recorded: qualified type, message, formatted traceback.

    Ours to store, so never refused: NUL and lone surrogates (which Postgres cannot hold) are
    replaced by visible escapes, and a step whose error message holds them fails normally.
    """
    kind = type(exc)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    message = printed(exc)
    if isinstance(exc, StepFailedError) and exc.error_type:
        message = f"{exc.step_name}: {exc.error_type}: {exc.error_message}"
    if len(message) > MESSAGE_LIMIT:
        message = f"{message[:MESSAGE_LIMIT]}... ({len(message) - MESSAGE_LIMIT} more characters)"
    try:
        trace = "".join(traceback.format_exception(exc))[-8000:]
    except BaseException:  # user code's `__str__` may raise anything here, even a BaseException
        trace = ""
    return ErrorInfo(
        type=_serde.clean_text(name),
        message=_serde.clean_text(message),
        traceback=_serde.clean_text(trace),
    )


MESSAGE_LIMIT = 65_536
"""Characters of an error message that are kept (the rest is counted, not stored)."""


def printed(exc: BaseException) -> str:
    """The error's text, whatever its `__str__` does: recording it never depends on it."""
    try:
        return str(exc)
    except BaseException:  # even a KeyboardInterrupt of `__str__`'s own making
        try:
            return f"<unprintable {type(exc).__qualname__} object: {exc!r}>"
        except BaseException:
            return f"<unprintable {type(exc).__qualname__} object>"
