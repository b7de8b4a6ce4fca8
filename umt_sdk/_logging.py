"""`ctx.logger`: records that carry the run's identity, with secrets redacted before any handler
sees them, and silent while the handler replays what an earlier execution already did."""

from __future__ import annotations

import logging
import re
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["REDACTED", "RunLogger", "redact", "redact_text"]

REDACTED = "[REDACTED]"
SECRET_KEYS = ("passkey", "token", "password", "secret", "authorization", "cookie", "api_key")
_SECRET_NAME = "|".join(SECRET_KEYS)
# key=value in query strings (and in text that looks like one): ?token=abc&x=1 -> ?token=[REDACTED]
_QUERY_PARAM = re.compile(rf"(?i)([?&;][^=&#\s]*(?:{_SECRET_NAME})[^=&#\s]*=)[^&#\s'\"]*")
# key: value / key=value in free text, e.g. "Authorization: Bearer x" or "password=hunter2"
_INLINE = re.compile(
    rf"(?i)\b(\w*(?:{_SECRET_NAME})\w*\s*[:=]\s*)(?:(?:bearer|basic)\s+)?[^\s,;&'\"]+"
)


def _is_secret_key(key: object) -> bool:
    return isinstance(key, str) and any(name in key.lower() for name in SECRET_KEYS)


def redact_text(text: str) -> str:
    """Redact secret query parameters of URLs and `secret: value` pairs in free text."""
    return _INLINE.sub(rf"\g<1>{REDACTED}", _QUERY_PARAM.sub(rf"\g<1>{REDACTED}", text))


def redact(value: Any, _depth: int = 0) -> Any:
    """A copy of `value` with secret keys (case-insensitive, nested in dicts and lists) and
    secret URL parameters in strings replaced by `[REDACTED]`."""
    if _depth > 20:
        return value
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if _is_secret_key(k) else redact(v, _depth + 1)) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        items = [redact(v, _depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, BaseException):
        return redact_text(str(value))
    return value


class RunLogger(logging.LoggerAdapter[logging.Logger]):
    """A stdlib-compatible logger for one execution of a run.

    Every record carries `umt_run_id`, `umt_task`, `umt_version`, `umt_step` and `umt_trace_id`
    (plus `umt_span_id`); message, arguments, extra fields and exception text are redacted
    before the record reaches a handler. While the handler replays recorded steps, it logs
    nothing: those lines were written by the execution that ran them.
    """

    def __init__(
        self,
        logger: logging.Logger,
        extra: Mapping[str, object],
        *,
        context: Callable[[], Mapping[str, object]],
        replaying: Callable[[], bool],
    ) -> None:
        super().__init__(logger, dict(extra))
        self._context = context
        self._replaying = replaying

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if self._replaying() or not self.logger.isEnabledFor(level):
            return
        exc_info = kwargs.pop("exc_info", None)
        stack_info = bool(kwargs.pop("stack_info", False))
        stacklevel = int(kwargs.pop("stacklevel", 1))
        extra = dict(self.extra or {})
        extra.update(self._context())
        extra.update(redact(dict(kwargs.pop("extra", None) or {})))
        text = redact(msg) if isinstance(msg, str | Mapping | list | tuple) else msg
        safe_args = tuple(redact(a) for a in args)
        if len(safe_args) == 1 and isinstance(args[0], Mapping):
            safe_args = (redact(args[0]),)  # %(name)s formatting keeps a single mapping
        exc_text = None
        if exc_info:
            if exc_info is True:
                exc_info = sys.exc_info()
            elif isinstance(exc_info, BaseException):
                exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
            if exc_info and exc_info[0] is not None:
                exc_text = redact_text("".join(traceback.format_exception(*exc_info)).rstrip())
        caller = sys._getframe(min(stacklevel, 2))
        record = self.logger.makeRecord(
            self.logger.name,
            level,
            caller.f_code.co_filename,
            caller.f_lineno,
            text,
            safe_args,
            None,  # the raw exception never reaches a handler: only its redacted text
            caller.f_code.co_name,
            extra,
            None,
        )
        record.exc_text = exc_text
        if stack_info:
            record.stack_info = redact_text("".join(traceback.format_stack(caller)))
        self.logger.handle(record)
