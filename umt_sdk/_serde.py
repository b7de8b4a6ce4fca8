"""Payloads to and from JSON text through one private cattrs converter. No pickle anywhere.

Every payload umt stores (a run's input, a step's or a task's output, a fact's payload, a fenced
operation's result) is checked here, before any backend sees it, so that every backend refuses
the same values with the same `PayloadError`, naming the path in the value
(`input.items[3].name`, `output of step 'fetch'.a.b`). What a payload may not hold:

- a NUL character (U+0000) in a string or a key: Postgres text and jsonb cannot store it;
- a lone surrogate (U+D800..U+DFFF): not valid Unicode, it has no UTF-8 encoding;
- more than `MAX_DEPTH` levels of nested lists and objects;
- more than `MAX_BYTES` of JSON text (UTF-8).

JSON text from outside (`parse_json`) gets the same limits, checked without recursion. The
checks are C-speed scans of the encoded text in the common case; the value is walked (never
recursively) only to find the path of a problem, or when the text has many containers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from datetime import date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any
from uuid import UUID

import attrs
import cattrs
from cattrs.preconf.json import make_converter as _make_json_converter
from cattrs.strategies import configure_union_passthrough

from umt_sdk._codec import SEALED_PREFIX
from umt_sdk.exceptions import CodecError, PayloadError

_SEALED = '"' + SEALED_PREFIX

__all__ = [
    "MAX_BYTES",
    "MAX_DEPTH",
    "check_text",
    "clean_text",
    "decode",
    "decodes_to_itself",
    "dumps",
    "encode",
    "encode_input",
    "encode_payload",
    "encode_output",
    "from_raw",
    "input_hash",
    "make_converter",
    "parse_json",
    "to_raw",
    "unstorable_json_reason",
    "unstorable_reason",
    "validate",
]

MAX_DEPTH = 64
"""The deepest nesting of lists and objects a payload may have (`[[1]]` is 2 levels)."""

MAX_BYTES = 16 * 1024 * 1024
"""The largest payload, as UTF-8 JSON text: 16 MiB (Postgres's jsonb holds at most 255 MB; the
claim reads a run's step records in one message). Keep big data elsewhere; pass references."""


def _strict(expected: type, *, also: tuple[type, ...] = ()) -> Any:
    allowed = (expected, *also)

    def structure(value: Any, _: type) -> Any:
        if isinstance(value, bool) and expected is not bool:
            raise TypeError(f"expected {expected.__name__}, got bool")
        if not isinstance(value, allowed):
            raise TypeError(f"expected {expected.__name__}, got {type(value).__name__}")
        return expected(value)

    return structure


def make_converter() -> cattrs.Converter:
    """The converter used for every payload: strict primitives, ISO datetimes, UUIDs."""
    converter = _make_json_converter(detailed_validation=True, forbid_extra_keys=True)
    converter.register_structure_hook(str, _strict(str))
    converter.register_structure_hook(int, _strict(int))
    converter.register_structure_hook(float, _strict(float, also=(int,)))
    converter.register_structure_hook(bool, _strict(bool))
    # The JSON preset passes unions of primitives through when the value's class (or a subclass)
    # is a member; bool is a subclass of int, so `int | str` took True. Configure it without bool
    # (a union that names bool still accepts it, through the strict bool hook).
    configure_union_passthrough(str | int | float | None, converter)

    def structure_none(value: Any, _: type) -> None:
        if value is not None:
            raise TypeError(f"expected null, got {type(value).__name__}")

    converter.register_structure_hook(type(None), structure_none)

    def structure_datetime(value: Any, _: type) -> datetime:
        if isinstance(value, datetime):
            return value
        if not isinstance(value, str):
            raise TypeError(f"expected an ISO 8601 datetime string, got {type(value).__name__}")
        return datetime.fromisoformat(value)

    def structure_date(value: Any, _: type) -> date:
        if isinstance(value, date):
            return value
        if not isinstance(value, str):
            raise TypeError(f"expected an ISO 8601 date string, got {type(value).__name__}")
        return date.fromisoformat(value)

    def structure_uuid(value: Any, _: type) -> UUID:
        if isinstance(value, UUID):
            return value
        if not isinstance(value, str):
            raise TypeError(f"expected a UUID string, got {type(value).__name__}")
        return UUID(value)

    def structure_timedelta(value: Any, _: type) -> timedelta:
        if isinstance(value, timedelta):
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"expected seconds as a number, got {type(value).__name__}")
        return timedelta(seconds=value)

    def structure_decimal(value: Any, _: type) -> Decimal:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise TypeError(f"expected a decimal string, got {type(value).__name__}")
        try:
            return Decimal(str(value))
        except InvalidOperation:
            raise ValueError(f"expected a decimal string, got {value!r}") from None

    converter.register_structure_hook(datetime, structure_datetime)
    converter.register_unstructure_hook(datetime, datetime.isoformat)
    converter.register_structure_hook(date, structure_date)
    converter.register_unstructure_hook(date, date.isoformat)
    converter.register_structure_hook(UUID, structure_uuid)
    converter.register_unstructure_hook(UUID, str)
    converter.register_structure_hook(timedelta, structure_timedelta)
    converter.register_unstructure_hook(timedelta, timedelta.total_seconds)
    converter.register_structure_hook(Decimal, structure_decimal)
    converter.register_unstructure_hook(Decimal, str)
    return converter


_converter = make_converter()

# -- what a payload may hold ---------------------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")
_PLAIN_SCALARS: frozenset[type] = frozenset({str, int, float, bool, type(None)})
# A JSON string (skipped, escapes included) or one bracket: nesting depth without recursion.
_NESTING = re.compile(r'"(?:[^"\\]++|\\.)*+"|[\[\]{}]')


def unstorable_reason(text: str) -> str | None:
    """Why no backend may store `text`, or None: the one rule of what Postgres cannot store,
    which the SDK checks before any backend sees a value and the memory backend applies too,
    so that it refuses what the real store refuses. Two C-speed scans.

    A NUL character (Postgres text and jsonb cannot hold it), or a lone surrogate (not valid
    Unicode: it has no UTF-8 encoding).
    """
    if "\x00" in text:
        return "holds a NUL character (\\x00), which Postgres cannot store"
    if not text.isascii() and _SURROGATE.search(text) is not None:
        return "holds a lone surrogate (U+D800..U+DFFF), which is not valid Unicode"
    return None


def unstorable_json_reason(text: str) -> str | None:
    """`unstorable_reason` of the JSON text `text` (valid JSON) and of every string and key
    in it, its escapes decoded (jsonb refuses `\\u0000` and a lone surrogate escaped too), or
    None."""
    reason = unstorable_reason(text)
    if reason is not None or "\\u" not in text:  # no escapes: nothing hides in them
        return reason
    stack: list[Any] = [json.loads(text)]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and (reason := unstorable_reason(node)) is not None:
            return reason
    return None


def check_text(text: str, *, what: str) -> str:
    """`text` (a key, a reason: stored as text, not JSON) if a backend can store it, else
    PayloadError naming `what`."""
    if not isinstance(text, str):
        raise PayloadError(f"{what} must be a string, got {type(text).__name__}", field=what)
    problem = unstorable_reason(text)
    if problem is not None:
        raise PayloadError(f"{what} cannot be stored: it {problem}", field=what)
    return text


def clean_text(text: str) -> str:
    """`text` with NUL and lone surrogates replaced by visible escapes (`\\x00`, `\\ud800`).

    For text umt composes itself (error messages, tracebacks): stored as it is, never refused.
    """
    if unstorable_reason(text) is None:
        return text
    escaped = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return escaped.replace("\x00", "\\x00")


def _child(path: str, key: object) -> str:
    if isinstance(key, int) and not isinstance(key, bool):
        return f"{path}[{key}]"
    if isinstance(key, str) and key.isidentifier():
        return f"{path}.{key}"
    shown = key[:40] if isinstance(key, str) else key
    return f"{path}[{shown!r}]"


def _a(name: str) -> str:
    return f"an {name}" if name[:1].lower() in "aeio" else f"a {name}"


def _untyped(node: Any, path: str, root: str) -> str:
    """Why a value that is not of JSON's own types is refused where no type is declared."""
    name = type(node).__qualname__
    try:
        raw = _converter.unstructure(node)
    except Exception:
        raw = node
    if raw is node or type(raw) not in _PLAIN_SCALARS | {list, dict}:
        return (
            f"{_a(name)}, which cannot be stored as JSON; use attrs classes, dataclasses, "
            "primitives, datetimes, UUIDs, lists and dicts"
        )
    annotation = f"{name}[...]" if isinstance(node, tuple) else name
    if path != root:
        annotation = f"a type that names {annotation} where it occurs"
    return (
        f"{_a(name)}, which a replay would get back as {_a(type(raw).__name__)}. Declare the "
        "type, so that every execution gets the same back: annotate the function's return "
        f"type (-> {annotation}), or pass output_type= to ctx.step.run"
    )


def _find(value: Any, root: str, *, plain: bool) -> tuple[str, str] | None:
    """The first place (path, what is wrong) in `value` that cannot be stored, or None.

    `plain`: only JSON's own types are allowed, exactly (no tuples, no subclasses, string keys),
    because there is no type to decode them back to. Iterative, in document order.
    """
    stack: list[tuple[Any, str, int]] = [(value, root, 1)]
    while stack:
        node, path, level = stack.pop()
        kind = type(node)
        if plain and kind not in _PLAIN_SCALARS and kind is not list and kind is not dict:
            return path, _untyped(node, path, root)
        if isinstance(node, str):
            problem = unstorable_reason(node)
            if problem is not None:
                return path, f"a string that {problem}"
        elif isinstance(node, dict | list | tuple):
            if level > MAX_DEPTH:
                return path, f"nested deeper than {MAX_DEPTH} levels (the limit)"
            children: list[tuple[Any, str, int]] = []
            if isinstance(node, dict):
                for key, item in node.items():
                    if plain and type(key) is not str:
                        return path, (
                            f"an object with the {type(key).__name__} key {key!r}, which a replay "
                            "would get back as a str"
                        )
                    if isinstance(key, str):
                        problem = unstorable_reason(key)
                        if problem is not None:
                            return _child(path, key), f"a key that {problem}"
                    elif not isinstance(key, int | float | bool) and key is not None:
                        return path, f"an object with a {type(key).__qualname__} key"
                    children.append((item, _child(path, key), level + 1))
            else:
                children = [(item, f"{path}[{i}]", level + 1) for i, item in enumerate(node)]
            stack.extend(reversed(children))
        elif isinstance(node, float):
            if not math.isfinite(node):
                return path, f"{node!r}, which JSON cannot hold"
        elif isinstance(node, int) and node.bit_length() > 14_280:  # about 4300 digits
            return path, "an integer of more than 4300 digits, which JSON text cannot hold"
        elif not isinstance(node, int) and node is not None:
            return path, f"{_a(kind.__qualname__)}, which cannot be stored as JSON"
    return None


def _plain_and_shallow(value: Any) -> bool:
    """Fast path of `_find(plain=True)` for a value without paths: JSON's own types, exactly,
    at most MAX_DEPTH levels. Strings, keys and floats are checked on the encoded text."""
    if type(value) in _PLAIN_SCALARS:
        return True
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if level > MAX_DEPTH:
            return False
        kind = type(node)
        if kind is dict:
            for key in node:
                if type(key) is not str:
                    return False
            items = node.values()
        elif kind is list:
            items = node
        else:
            return False
        for item in items:
            kind = type(item)
            if kind is list or kind is dict:
                stack.append((item, level + 1))
            elif kind not in _PLAIN_SCALARS:
                return False
    return True


def _shallow(raw: Any) -> bool:
    """Whether unstructured `raw` has at most MAX_DEPTH levels (iterative, no paths)."""
    if not isinstance(raw, dict | list | tuple):
        return True
    stack: list[tuple[Any, int]] = [(raw, 1)]
    while stack:
        node, level = stack.pop()
        if level > MAX_DEPTH:
            return False
        for item in node.values() if isinstance(node, dict) else node:
            if isinstance(item, dict | list | tuple):
                stack.append((item, level + 1))
    return True


def _deep_path(value: Any, root: str) -> str:
    """Where a value of any kind (containers, attrs classes, dataclasses) first passes
    MAX_DEPTH levels; `root` if it does not."""
    stack: list[tuple[Any, str, int]] = [(value, root, 1)]
    while stack:
        node, path, level = stack.pop()
        if isinstance(node, dict):
            children = [(v, _child(path, k)) for k, v in node.items()]
        elif isinstance(node, list | tuple | set | frozenset):
            children = [(v, f"{path}[{i}]") for i, v in enumerate(node)]
        elif attrs.has(type(node)):
            children = [
                (getattr(node, a.name), f"{path}.{a.name}") for a in attrs.fields(type(node))
            ]
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            children = [
                (getattr(node, f.name), f"{path}.{f.name}") for f in dataclasses.fields(node)
            ]
        else:
            continue
        if level > MAX_DEPTH:
            return path
        stack.extend((child, child_path, level + 1) for child, child_path in reversed(children))
    return root


def _shown(path: str) -> str:
    """A path short enough for a message (`field` keeps it whole)."""
    return path if len(path) <= 160 else f"{path[:100]}...{path[-50:]}"


def _refused(what: str, path: str, reason: str) -> PayloadError:
    return PayloadError(f"{what} cannot be stored: {_shown(path)} is {reason}", field=path)


def _too_deep(value: Any, what: str) -> PayloadError:
    return _refused(
        what, _deep_path(value, what), f"nested deeper than {MAX_DEPTH} levels (the limit)"
    )


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _checked(text: str, source: Any, what: str, *, depth_known: bool = False) -> str:
    """`text` (the JSON of `source`) if a backend can store it, else PayloadError with a path.

    NUL escapes, surrogates and the size are seen in the text itself; the depth too when the
    text has at most MAX_DEPTH containers in all (brackets in strings only make it cautious).
    """
    if "\\u0000" in text or unstorable_reason(text) is not None:
        found = _find(source, what, plain=False)
        if found is not None:  # else a string held a backslash followed by "u0000": fine
            raise _refused(what, *found)
    if len(text) > MAX_BYTES // 4 and (size := _utf8_size(text)) > MAX_BYTES:
        raise PayloadError(
            f"{what} cannot be stored: its JSON is {size:,} bytes, more than the limit of "
            f"{MAX_BYTES:,} ({MAX_BYTES // 1024 // 1024} MiB); store big data elsewhere and "
            "pass a reference",
            field=what,
        )
    if not depth_known and text.count("[") + text.count("{") > MAX_DEPTH and not _shallow(source):
        raise _too_deep(source, what)
    return text


# -- encoding and decoding -----------------------------------------------------------------------


def _describe(exc: Exception, what: str) -> PayloadError:
    if isinstance(exc, cattrs.BaseValidationError):
        messages = cattrs.transform_error(exc, path=what)
        first = messages[0] if messages else str(exc)
        field = first.rsplit(" @ ", 1)[-1] if " @ " in first else what
        detail = "; ".join(messages)
        return PayloadError(f"invalid {what}: {detail}", field=field)
    return PayloadError(f"invalid {what}: {exc}", field=what)


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _dumps(value: Any) -> str:
    return _ENCODER.encode(value)  # json.dumps(value, **options) would build an encoder per call


def _unsupported(exc: Exception, source: Any, what: str) -> PayloadError:
    found = _find(source, what, plain=False)
    field = found[0] if found is not None else what
    where = f" ({_shown(field)} is {found[1]})" if found is not None and field != what else ""
    return PayloadError(
        f"{what} cannot be stored as JSON: {exc}{where}; use attrs classes, dataclasses, "
        "primitives, datetimes, UUIDs, lists and dicts",
        field=field,
    )


def encode(value: Any, type_: Any = Any, *, what: str = "payload") -> str:
    """Encode `value` (of `type_`) to compact JSON text a backend can store.

    Raises PayloadError naming the path of what cannot be stored (see the module docstring).
    """
    raw: Any = value
    try:
        raw = _converter.unstructure(value, unstructure_as=type_ if type_ is not Any else None)
        text = _dumps(raw)
    except RecursionError:
        raise _too_deep(value, what) from None
    except (TypeError, ValueError) as exc:
        raise _unsupported(exc, raw, what) from exc
    return _checked(text, raw, what)


def encode_payload(value: Any, *, what: str) -> str:
    """The JSON text of a payload that has no declared type yet (a run's input in its JSON
    form, as an outbox row holds it), checked as `enqueue` checks an input of type `Any`:
    `PayloadError` naming the path (`payload.items[3]`) of what cannot be stored (a NUL, a
    lone surrogate, a value JSON has no form for, too deep, too big). None is JSON null."""
    return encode(value, what=what)


def decodes_to_itself(value: Any, type_: Any) -> bool:
    """Whether decoding `value`'s JSON as `type_` surely gives `value` back without trying: a
    str, int, float or bool (exactly) declared as such, the bulk of step outputs."""
    return type(value) is type_ and type_ in _PLAIN_SCALARS


def encode_output(value: Any, type_: Any, *, what: str) -> tuple[str, Any]:
    """Encode a step's output; return its JSON text and the value every replay will see.

    The caller hands back the second, so the first execution sees exactly what a replay
    decodes. Without a type (`Any`: an unannotated function or lambda) only JSON's own types
    are accepted: a datetime, UUID, tuple or attrs instance would come back as something else
    on replay, so it is refused, saying how to declare the type.
    """
    if type_ is not Any:
        text = encode(value, type_, what=what)
        if decodes_to_itself(value, type_):
            return text, value
        return text, decode(text, type_, what=what)
    if not _plain_and_shallow(value):
        found = _find(value, what, plain=True)
        if found is not None:
            raise _refused(what, *found)
    try:
        text = _dumps(value)
    except (TypeError, ValueError) as exc:  # a float that is not finite, an int too long
        raise _unsupported(exc, value, what) from exc
    _checked(text, value, what, depth_known=True)
    if type(value) in _PLAIN_SCALARS:
        return text, value
    return text, json.loads(text)


def decode(text: str, type_: Any = Any, *, what: str = "payload") -> Any:
    """Decode JSON text to `type_`; raise PayloadError naming the field that does not fit,
    and CodecError for a payload a codec sealed (the engine has no codec to open it)."""
    if text.startswith(_SEALED):
        name = text[len(_SEALED) :].partition(":")[0]
        raise CodecError(
            f"{what} was encoded by codec {name!r} and could not be decoded here: connect with "
            "that codec (codec=..., or umt --codec / UMT_CODEC on the command line), holding "
            "the key it names",
            codec=name,
        )
    try:
        raw = json.loads(text)
    except RecursionError:
        raise PayloadError(
            f"{what} is nested deeper than this process can decode", field=what
        ) from None
    if type_ is Any or type_ is None or type_ is type(None):
        return raw
    try:
        return _converter.structure(raw, type_)
    except Exception as exc:
        raise _describe(exc, what) from exc


def parse_json(
    text: str | bytes,
    *,
    what: str = "payload",
    max_depth: int = MAX_DEPTH,
    max_bytes: int = MAX_BYTES,
) -> Any:
    """Parse JSON text from outside (a file, stdin, a request body) within the payload limits
    (a document that holds payloads, such as an exported history, passes larger ones).

    Never recurses past `max_depth`: the nesting is measured before the parser runs. Raises
    PayloadError (naming `what` and, where it applies, the path, line and column) for text that
    is not UTF-8, not JSON, too big, too deep, or holds what a backend cannot store.
    """
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PayloadError(
                f"{what} is not valid UTF-8 (byte {exc.start}: {exc.reason})", field=what
            ) from None
    if not isinstance(text, str):
        raise TypeError(f"parse_json takes str or bytes, got {type(text).__name__}")
    if len(text) > max_bytes // 4 and (size := _utf8_size(text)) > max_bytes:
        raise PayloadError(
            f"{what} is {size:,} bytes of JSON, more than the limit of {max_bytes:,}", field=what
        )
    if text.count("[") + text.count("{") > max_depth:
        depth = 0
        for match in _NESTING.finditer(text):
            token = match.group()
            if token in ("[", "{"):
                depth += 1
                if depth > max_depth:
                    at = match.start()
                    line = text.count("\n", 0, at) + 1
                    column = at - text.rfind("\n", 0, at)
                    raise PayloadError(
                        f"{what} is nested deeper than {max_depth} levels (the limit) at line "
                        f"{line} column {column}",
                        field=what,
                    )
            elif token in ("]", "}"):
                depth -= 1
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PayloadError(
            f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            field=what,
        ) from None
    except (ValueError, RecursionError) as exc:  # an integer of more than 4300 digits
        raise PayloadError(f"{what} is not valid JSON: {exc}", field=what) from None
    found = _find(raw, what, plain=False)
    if found is not None:
        raise _refused(what, *found)
    return raw


def validate(value: Any, type_: Any, *, what: str = "input") -> str:
    """Check `value` against `type_` by a full round trip and return its JSON text.

    Accepts either an instance of the type or its unstructured form (a dict from a web form or
    the CLI); rejects anything that would not decode back, naming the field, and anything a
    backend cannot store (see the module docstring).
    """
    return encode_input(value, type_, what=what)[0]


def encode_input(value: Any, type_: Any, *, what: str = "input") -> tuple[str, str]:
    """`validate`, and the input hash of the same text (`input_hash`), from one parse."""
    if type_ is Any:
        text = encode(value, what=what)
        return text, input_hash(text)
    try:
        raw = _converter.unstructure(value)
    except RecursionError:
        raise _too_deep(value, what) from None
    except Exception as exc:
        raise _describe(exc, what) from exc
    if not _shallow(raw):
        raise _too_deep(raw, what)  # before cattrs recurses into it
    try:
        raw = _converter.unstructure(_converter.structure(raw, type_), type_)
        text = _dumps(raw)
        _checked(text, raw, what, depth_known=True)
        loaded = json.loads(text)
        _converter.structure(loaded, type_)  # what a worker will decode
    except PayloadError:
        raise
    except Exception as exc:
        raise _describe(exc, what) from exc
    return text, _hash_of(loaded)


def input_hash(text: str) -> str:
    """SHA-256 of canonical JSON (sorted keys, no whitespace): compared for idempotent enqueue."""
    return _hash_of(json.loads(text))


def _hash_of(loaded: Any) -> str:
    # Canonical form of the parsed text (not of the value before JSON: its keys may not be
    # strings yet, and would sort differently), so the hash of stored runs never changes.
    canonical = json.dumps(loaded, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def to_raw(value: Any, type_: Any = Any) -> Any:
    """Unstructure `value` to JSON-ready primitives."""
    try:
        return _converter.unstructure(value, unstructure_as=type_ if type_ is not Any else None)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"value cannot be stored as JSON: {exc}") from exc


def from_raw(raw: Any, type_: Any = Any, *, what: str = "payload") -> Any:
    """Structure JSON-ready primitives into `type_`."""
    if type_ is Any or type_ is None or type_ is type(None):
        return raw
    try:
        return _converter.structure(raw, type_)
    except Exception as exc:
        raise _describe(exc, what) from exc


def dumps(raw: Any) -> str:
    """Compact JSON text of JSON-ready primitives."""
    return _dumps(raw)
