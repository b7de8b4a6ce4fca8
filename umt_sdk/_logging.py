"""`ctx.logger`: records that carry the run's identity, with secrets redacted before any handler
sees them, and silent while the handler replays what an earlier execution already did.

Redaction works on what a handler would print, not on the call's pieces: the message is first
formatted (`msg % args`, as the stdlib would), then the resulting text, the formatted traceback
and the stack are redacted; the record that reaches handlers carries only that text (no `args`,
no `exc_info`). Structured values (dict arguments, `extra`) are redacted by key first, at any
depth (an explicit stack, no recursion, safe on cycles). Logging never raises into the task: a
message whose arguments do not fit its format is still logged, with its arguments appended.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

__all__ = ["REDACTED", "SECRET_NAMES", "RunLogger", "is_secret_key", "redact", "redact_text"]

REDACTED = "[REDACTED]"

SECRET_NAMES = (
    "password",
    "passwd",
    "passphrase",
    "passkey",
    "secret",
    "token",
    "api_key",
    "private_key",
    "authorization",
    "cookie",
)
"""A key (of a dict, a `key=value` or `key: value` pair, a header, a query parameter) whose name
contains one of these, case-insensitive, with `-`, `_` or nothing inside (`apikey`, `X-Api-Key`,
`privateKey`, `client_secret`, `access_token`, `Set-Cookie`...), holds a secret."""

_NAMES = (
    r"pass(?:word|wd|phrase|key)|secret|token|api[-_]?key|private[-_]?key|authori[sz]ation|cookie"
)
_NAME = re.compile(_NAMES, re.IGNORECASE)
_KEY_CHARS = r"A-Za-z0-9_.\-"
_BLANK = r"(?:[ \t]|\\t)*"  # spaces and tabs, also a tab as a repr writes it
# A secret key followed by its separator: `password=`, `X-Api-Key: `, `"token": ` (JSON),
# `'secret': ` (a dict's repr), `\"password\": ` (JSON inside a JSON string). `==`, `:=` are
# comparisons and assignments in source lines, not pairs.
_FIELD = re.compile(
    rf"(?<![{_KEY_CHARS}])(?P<key>[{_KEY_CHARS}]*?(?:{_NAMES})[{_KEY_CHARS}]*)"
    rf"(?:\\*[\"'])?{_BLANK}(?P<sep>:(?![:=])|=(?!=)){_BLANK}",
    re.IGNORECASE,
)
# The password of a URL's userinfo: scheme://user:PASSWORD@host (the last @ of the authority).
_USERINFO = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/@:?#'\"]*:)(?P<password>[^\s/?#'\"]*)@"
)
_QUOTE_START = re.compile(r"(?:[bBrRuU]{1,2})?(?P<escapes>\\*)(?P<quote>[\"'])")
_AUTH_SCHEME = re.compile(
    r"(?i)(?:bearer|basic|digest|token|negotiate|ntlm|hoba|mutual|aws4-hmac-sha256)[ \t]+"
)
_HEADER_KEY = re.compile(r"(?i)authori[sz]ation|cookie")
_OPENERS = {"{": "}", "[": "]", "(": ")", "<": ">"}
# A backslash ends an unquoted value too: in a repr, "\n" is a backslash and an n.
_FREE_STOPS = frozenset(" \t\r\n\f\v,;&'\"<>()[]{}\\")
_QUERY_STOPS = frozenset(" \t\r\n\f\v&#'\"\\")
_HEADER_STOPS = frozenset("\r\n'\"\\")


def is_secret_key(key: object) -> bool:
    """Whether a dict key names a secret (see `SECRET_NAMES`)."""
    if isinstance(key, bytes):
        key = key.decode("latin-1")
    return isinstance(key, str) and _NAME.search(key) is not None


def _quoted_end(text: str, start: int, escapes: int, quote: str) -> int:
    """Index of the closing quote of the string whose opening quote is at `start`."""
    n = len(text)
    i = start + 1
    if escapes == 0:
        while i < n:
            c = text[i]
            if c == "\\":
                i += 2
                continue
            if c == quote or c == "\n":
                return i
            i += 1
        return n
    # An escaped quote (JSON inside a JSON string): it closes at the same quote preceded by
    # exactly as many backslashes; deeper strings have more.
    while i < n:
        j = text.find(quote, i)
        if j < 0:
            return n
        run = 0
        while j - run - 1 >= start and text[j - run - 1] == "\\":
            run += 1
        if run == escapes:
            return j - escapes
        i = j + 1
    return n


def _bracket_end(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at `start`, honouring quoted strings,
    also escaped ones (`\\"...\\"`: JSON inside a JSON string). Inside, only ( [ { nest: an
    angle bracket is too common in text to count."""
    closers = [_OPENERS[text[start]]]
    n = len(text)
    i = start + 1
    while i < n and closers:
        c = text[i]
        if c == "\\":
            run = 1
            while i + run < n and text[i + run] == "\\":
                run += 1
            if i + run < n and text[i + run] in "\"'":
                closing = _quoted_end(text, i + run, run, text[i + run])
                i = closing + run + 1
            else:
                i += run + 1
            continue
        if c in "\"'":
            i = _quoted_end(text, i, 0, c) + 1
            continue
        if c in "([{":
            closers.append(_OPENERS[c])
        elif c == closers[-1]:
            closers.pop()
        i += 1
    return min(i, n)


def _plain_end(text: str, start: int, stops: frozenset[str]) -> int:
    i = start
    n = len(text)
    while i < n and text[i] not in stops:
        i += 1
    return i


def _redact_fields(text: str) -> str:
    out: list[str] = []
    pos = 0
    n = len(text)
    while pos < n:
        match = _FIELD.search(text, pos)
        if match is None:
            break
        value = match.end()
        out.append(text[pos:value])
        pos = value
        if text.startswith(REDACTED, value):
            out.append(REDACTED)
            pos = value + len(REDACTED)
            continue
        quoted = _QUOTE_START.match(text, value)
        if quoted is not None:
            escapes = len(quoted["escapes"])
            opening = quoted.end() - 1
            end = _quoted_end(text, opening, escapes, quoted["quote"])
            out.append(text[value : quoted.end()])
            out.append(REDACTED)
            pos = end
            continue
        if value < n and text[value] in _OPENERS:
            out.append(REDACTED)
            pos = _bracket_end(text, value)
            continue
        if match["sep"] == ":" and _HEADER_KEY.search(match["key"]):
            # An Authorization or Cookie header: everything to the end of the line.
            scheme = _AUTH_SCHEME.match(text, value)
            if scheme is not None:
                out.append(text[value : scheme.end()])
                value = scheme.end()
            end = _plain_end(text, value, _HEADER_STOPS)
        else:
            before = text[match.start() - 1] if match.start() > 0 else ""
            end = _plain_end(text, value, _QUERY_STOPS if before in "?&" else _FREE_STOPS)
        if end > value:
            out.append(REDACTED)
        pos = max(end, value)
    out.append(text[pos:])
    return "".join(out)


def _redact_userinfo(match: re.Match[str]) -> str:
    if not match["password"] or match["password"] == REDACTED:
        return match[0]
    return f"{match['head']}{REDACTED}@"


def redact_text(text: str, known: Iterator[str] | tuple[str, ...] = ()) -> str:
    """`text` with the values of secret keys replaced by `[REDACTED]`.

    Covers `key=value` and `key: value` pairs, `"key": "value"` (JSON, also inside JSON
    strings), `'key': 'value'` (a dict's or an object's repr), any value nested under such a
    key (a bracketed value is replaced whole), HTTP headers (`Authorization: Bearer ...`,
    `Cookie: ...` to the end of the line, `X-Api-Key: ...`), query parameters and the password
    of a URL (`scheme://user:password@host`). An unquoted value ends at whitespace, a
    backslash or one of `, ; & ' " < > ( ) [ ] { }` (in a query: at `&` or `#`). The strings
    in `known` (of 4 characters or more) are secrets wherever they appear. The rest of the
    text is kept as it was.
    """
    for secret in sorted(known, key=len, reverse=True):
        if len(secret) >= 4:
            text = text.replace(secret, REDACTED)
    if "://" in text:
        text = _USERINFO.sub(_redact_userinfo, text)
    if _NAME.search(text) is None:
        return text
    return _redact_fields(text)


# -- structured values ---------------------------------------------------------------------------


def _container_kind(value: object) -> str | None:
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, list):
        return "list"
    if isinstance(value, tuple) and not hasattr(value, "_fields"):  # namedtuples: by repr
        return "tuple"
    if isinstance(value, set | frozenset):
        return "set"
    return None


class _Frame:
    __slots__ = ("items", "key", "kind", "out", "source")

    def __init__(self, source: Any, kind: str) -> None:
        self.source = source
        self.kind = kind
        self.items: Iterator[Any] = iter(list(source.items()) if kind == "mapping" else source)
        self.out: list[Any] = []
        self.key: Any = None


def _close(frame: _Frame) -> Any:
    if frame.kind == "mapping":
        return dict(frame.out)
    if frame.kind == "list":
        return frame.out
    if frame.kind == "tuple":
        return tuple(frame.out)
    try:
        return frozenset(frame.out) if isinstance(frame.source, frozenset) else set(frame.out)
    except TypeError:  # an item became unhashable (a frozenset holding a tuple of dicts...)
        return frame.out


def redact(value: Any, leaf: Callable[[Any], Any] | None = None) -> Any:
    """A copy of `value` with the values of secret keys (case-insensitive, nested in dicts,
    lists, tuples and sets at any depth) replaced by `[REDACTED]`, and strings redacted as by
    `redact_text`. Iterative (no recursion limit) and safe on cycles (a container that
    contains itself becomes `'<...>'`). `leaf` maps every other value (default: unchanged).
    """

    def convert(item: Any) -> Any:
        if isinstance(item, str):
            return redact_text(item)
        return item if leaf is None else leaf(item)

    kind = _container_kind(value)
    if kind is None:
        return convert(value)
    done: dict[int, Any] = {}
    active: set[int] = {id(value)}
    stack = [_Frame(value, kind)]
    keep: list[Any] = [value]  # ids stay unique while their objects live
    result: Any = None
    while stack:
        frame = stack[-1]
        try:
            item = next(frame.items)
        except StopIteration:
            stack.pop()
            active.discard(id(frame.source))
            built = _close(frame)
            done[id(frame.source)] = built
            if not stack:
                result = built
                break
            parent = stack[-1]
            parent.out.append((parent.key, built) if parent.kind == "mapping" else built)
            continue
        if frame.kind == "mapping":
            key, child = item
            safe_key = redact_text(key) if isinstance(key, str) else key
            if is_secret_key(key):
                frame.out.append((safe_key, REDACTED))
                continue
            frame.key = safe_key
        else:
            child = item
        child_kind = _container_kind(child)
        if child_kind is None:
            converted = convert(child)
        elif id(child) in active:
            converted = "<...>"
        elif id(child) in done:
            converted = done[id(child)]
        else:
            keep.append(child)
            active.add(id(child))
            stack.append(_Frame(child, child_kind))
            continue
        frame.out.append((frame.key, converted) if frame.kind == "mapping" else converted)
    return result


# -- formatting --------------------------------------------------------------------------------


def _safe_str(value: object) -> str:
    """str(value), else repr(value), else a placeholder: never raises (a deep value's repr may
    exceed the recursion limit, a __str__ may fail)."""
    try:
        return str(value)
    except Exception:
        pass
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__} object that cannot be printed>"


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__} object that cannot be printed>"


def _scalar_or_text(value: object) -> Any:
    """For `extra`: plain scalars stay, anything else becomes its redacted text (an object's
    repr may hold a secret, and a handler would print it)."""
    if value is None or isinstance(value, bool | int | float):
        return value
    return redact_text(_safe_str(value))


_SPEC = re.compile(
    r"%(?:\((?P<name>[^)]*)\))?[#0\- +]*(?P<width>\*|\d+)?(?:\.(?P<precision>\*|\d+))?"
    r"[hlL]?(?P<conversion>[diouxXeEfFgGcrsa%])"
)
_AFTER_KEY = re.compile(
    rf"(?<![{_KEY_CHARS}])[{_KEY_CHARS}]*?(?:{_NAMES})[{_KEY_CHARS}]*(?:\\*[\"'])?"
    rf"[ \t]*(?::|=)[ \t]*(?:[bBrRuU]{{0,2}}\\*[\"'])?$",
    re.IGNORECASE,
)


def _secret_slots(template: str) -> tuple[dict[int, str], dict[str, str]]:
    """The conversions (by positional index, or by mapping name) of the arguments that the
    template puts right after a secret key (`"password=%s"`): those arguments are secrets."""
    positions: dict[int, str] = {}
    names: dict[str, str] = {}
    index = 0
    for spec in _SPEC.finditer(template):
        if spec["conversion"] == "%":
            continue
        index += (spec["width"] == "*") + (spec["precision"] == "*")
        if _AFTER_KEY.search(template[max(0, spec.start() - 200) : spec.start()]):
            if spec["name"] is not None:
                names[spec["name"]] = spec["conversion"]
            else:
                positions[index] = spec["conversion"]
        index += 1
    return positions, names


def _format(msg: object, args: tuple[Any, ...]) -> str:
    """The redacted text of `msg % args`, as `LogRecord.getMessage` would build it; never
    raises. Arguments that do not fit the format are appended to the message instead."""
    if isinstance(msg, str):
        template = msg
    else:
        template = _safe_str(redact(msg) if _container_kind(msg) is not None else msg)
    if not args:
        return redact_text(template)
    safe = tuple(redact(a) for a in args)
    known: list[str] = []
    positions, names = _secret_slots(template) if "%" in template else ({}, {})
    # A secret argument becomes [REDACTED] where the conversion takes any object (%s %r %a);
    # a number (%d) stays, as one token that the text pass redacts. Either way its text is a
    # known secret wherever else it appears.
    mapping: dict[Any, Any] | None = None
    if len(safe) == 1 and isinstance(safe[0], Mapping) and safe[0]:
        mapping = dict(safe[0])
        for name, conversion in names.items():
            if name in mapping:
                known.append(_safe_str(mapping[name]))
                if conversion in "sra":
                    mapping[name] = REDACTED
    slots = list(safe)
    for i, conversion in positions.items():
        if i < len(slots):
            known.append(_safe_str(args[i]))
            if conversion in "sra":
                slots[i] = REDACTED
    try:
        text = template % (mapping if mapping is not None else tuple(slots))
    except Exception as exc:
        shown = _safe_repr(mapping) if mapping is not None else ", ".join(map(_safe_repr, slots))
        text = (
            f"{template} [log arguments that do not fit the format ({type(exc).__name__}): {shown}]"
        )
    return redact_text(text, tuple(known))


def _exc_text(exc_info: Any) -> str | None:
    if exc_info is True:
        exc_info = sys.exc_info()
    elif isinstance(exc_info, BaseException):
        exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
    if not isinstance(exc_info, tuple) or len(exc_info) != 3 or exc_info[0] is None:
        return None
    try:
        text = "".join(traceback.format_exception(*exc_info)).rstrip()
    except Exception:
        text = f"{_safe_str(exc_info[0])}: {_safe_str(exc_info[1])}"
    return redact_text(text)


_THIS_FILE = _format.__code__.co_filename
_LOGGING_FILE = logging.Logger.handle.__code__.co_filename
# Fields a LogRecord has of its own: `extra` may not overwrite them (the stdlib raises
# KeyError, which would fail the task); such keys are kept as `extra_<key>`.
_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
}


def _caller(stacklevel: int) -> FrameType | None:
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in (_THIS_FILE, _LOGGING_FILE):
        frame = frame.f_back
    for _ in range(max(stacklevel, 1) - 1):
        if frame is None or frame.f_back is None:
            break
        frame = frame.f_back
    return frame


def _report_failure(what: str, exc: BaseException) -> None:
    """A failure inside logging never reaches the task; say so on stderr, as the stdlib's
    `Handler.handleError` does (type only: the record may hold secrets)."""
    if logging.raiseExceptions:
        with contextlib.suppress(Exception):
            sys.stderr.write(f"umt: {what} ({type(exc).__name__}); the log record was dropped\n")


class RunLogger(logging.LoggerAdapter[logging.Logger]):
    """A stdlib-compatible logger for one execution of a run.

    Every record carries `umt_run_id`, `umt_task`, `umt_version`, `umt_step` and `umt_trace_id`
    (plus `umt_span_id`). Message, arguments, extra fields, exception and stack text are
    redacted before the record reaches a handler; the record holds the formatted, redacted
    message (`args` is empty) and the redacted traceback as `exc_text` (`exc_info` is None).
    Logging never raises into the task. While the handler replays recorded steps, it logs
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
        try:
            if self._replaying() or not self.logger.isEnabledFor(level):
                return
            record = self._make_record(level, msg, args, kwargs)
        except Exception as exc:
            _report_failure("a log record could not be built", exc)
            return
        try:
            self.logger.handle(record)
        except Exception as exc:
            _report_failure("a logging handler or filter raised", exc)

    def _make_record(
        self, level: int, msg: object, args: tuple[object, ...], kwargs: dict[str, Any]
    ) -> logging.LogRecord:
        stacklevel = kwargs.get("stacklevel", 1)
        caller = _caller(stacklevel if isinstance(stacklevel, int) else 1)
        try:
            text = _format(msg, args)
        except Exception:
            text = f"{REDACTED} (the log message could not be redacted, so it is withheld)"
        extra: dict[str, Any] = dict(self.extra or {})
        extra.update(self._context())
        user_extra = kwargs.get("extra")
        if isinstance(user_extra, Mapping):
            safe = redact(dict(user_extra), leaf=_scalar_or_text)
            for key, value in safe.items():
                if isinstance(key, str):
                    extra[f"extra_{key}" if key in _RESERVED else key] = value
        record = self.logger.makeRecord(
            self.logger.name,
            level,
            caller.f_code.co_filename if caller is not None else "(unknown file)",
            caller.f_lineno if caller is not None else 0,
            text,
            (),
            None,  # the raw exception never reaches a handler: only its redacted text
            caller.f_code.co_name if caller is not None else "(unknown function)",
            extra,
            None,
        )
        exc_info = kwargs.get("exc_info")
        if exc_info:
            record.exc_text = _exc_text(exc_info)
        if kwargs.get("stack_info") and caller is not None:
            stack = "".join(traceback.format_stack(caller)).rstrip("\n")
            record.stack_info = redact_text("Stack (most recent call last):\n" + stack)
        return record
