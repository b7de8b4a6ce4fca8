"""The enqueue form of a registered task, generated from its input type (an attrs class or a
dataclass: one field each; any other type: one JSON field), and what a submitted form means.

A field that does not parse (a number that is not one, JSON that is not JSON) is reported
beside it; the engine then checks the whole input against the type (`engine.enqueue`), and a
field it refuses is reported beside that field too. Nothing is stored unless every check
passes: `enqueue` validates before it writes.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Mapping, Sequence
from datetime import date, datetime
from typing import Any, Literal

import attrs
from attrs import frozen

from umt_sdk import _serde
from umt_sdk.exceptions import UmtError

__all__ = ["FormField", "fields_of", "read_form", "field_of_error"]

WHOLE = "input"
"""The name of the single JSON field of an input type without fields."""

Kind = Literal["text", "integer", "number", "checkbox", "select", "json"]


@frozen(kw_only=True)
class FormField:
    """One input of the form."""

    name: str
    kind: Kind
    type_text: str
    required: bool
    default_text: str = ""
    """The default, as the field shows it (JSON for a json field)."""
    choices: Sequence[str] = ()
    optional: bool = False
    """None is allowed (an empty field means None)."""
    numeric: bool = False
    """A select whose choices are whole numbers (sent as numbers)."""


def _unwrap_optional(type_: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(type_)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(type_) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(type_)) == 2:
            return args[0], True
    return type_, False


def _type_text(type_: Any) -> str:
    if isinstance(type_, type):
        return type_.__name__
    return str(type_).replace("typing.", "")


def _kind(type_: Any) -> tuple[Kind, Sequence[str]]:
    if type_ is bool:
        return "checkbox", ()
    if type_ is int:
        return "integer", ()
    if type_ is float:
        return "number", ()
    if type_ is str:
        return "text", ()
    if typing.get_origin(type_) is Literal:
        values = typing.get_args(type_)
        if all(isinstance(v, str | int) and not isinstance(v, bool) for v in values):
            return "select", tuple(str(v) for v in values)
    if isinstance(type_, type) and issubclass(type_, enum.Enum):
        members = [m.value for m in type_]
        if all(isinstance(v, str | int) and not isinstance(v, bool) for v in members):
            return "select", tuple(str(v) for v in members)
    if type_ in (datetime, date):
        return "text", ()
    return "json", ()


def _shown_default(default: Any, kind: Kind) -> str:
    if default is None:
        return ""
    if kind == "json":
        try:
            return json.dumps(_serde.to_raw(default), ensure_ascii=False)
        except Exception:
            return ""
    if kind == "checkbox":
        return "on" if default else ""
    if isinstance(default, enum.Enum):
        return str(default.value)
    if isinstance(default, datetime | date):
        return default.isoformat()
    return str(default)


def _field(name: str, type_: Any, has_default: bool, default: Any) -> FormField:
    inner, optional = _unwrap_optional(type_)
    kind, choices = _kind(inner)
    return FormField(
        name=name,
        kind=kind,
        type_text=_type_text(type_),
        required=not has_default and not optional,
        default_text=_shown_default(default, kind) if has_default else "",
        choices=choices,
        optional=optional,
        numeric=bool(choices) and all(c.lstrip("-").isdigit() for c in choices),
    )


def fields_of(input_type: Any) -> list[FormField]:
    """The form's fields for `input_type`."""
    if isinstance(input_type, type) and attrs.has(input_type):
        hints = typing.get_type_hints(input_type)
        found = []
        for a in attrs.fields(input_type):
            if not a.init:
                continue
            default = a.default
            has_default = default is not attrs.NOTHING
            if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
                default = None if default.takes_self else default.factory()
            found.append(_field(a.alias or a.name, hints.get(a.name, Any), has_default, default))
        return found
    if isinstance(input_type, type) and dataclasses.is_dataclass(input_type):
        hints = typing.get_type_hints(input_type)
        found = []
        for f in dataclasses.fields(input_type):
            if not f.init:
                continue
            has_default = (
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            )
            default = (
                f.default
                if f.default is not dataclasses.MISSING
                else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            )
            found.append(_field(f.name, hints.get(f.name, Any), has_default, default))
        return found
    return [_field(WHOLE, input_type, False, None)]


def _value(field: FormField, raw: str) -> Any:
    if field.kind == "integer":
        return int(raw.strip())
    if field.kind == "number":
        return float(raw.strip())
    if field.kind == "json":
        return _serde.parse_json(raw, what=field.name)
    if field.kind == "select" and field.numeric:
        return int(raw.strip())
    return raw


def read_form(fields: Sequence[FormField], form: Mapping[str, Any]) -> tuple[Any, dict[str, str]]:
    """The input a submitted form gives (a dict of the fields given, or the whole value), and
    what is wrong with each field that does not parse."""
    errors: dict[str, str] = {}
    data: dict[str, Any] = {}
    for field in fields:
        key = f"field.{field.name}"
        if field.kind == "checkbox":
            data[field.name] = key in form
            continue
        raw = str(form.get(key) or "")
        if not raw.strip():
            if field.optional:
                data[field.name] = None
            elif field.required:
                errors[field.name] = "required"
            continue  # the type's default applies
        try:
            data[field.name] = _value(field, raw)
        except ValueError:
            expected = {"integer": "a whole number", "number": "a number"}.get(field.kind)
            errors[field.name] = f"expected {expected}" if expected else "not valid"
        except UmtError as exc:
            errors[field.name] = str(exc)
    if len(fields) == 1 and fields[0].name == WHOLE:
        return data.get(WHOLE), errors
    return data, errors


def field_of_error(path: str, names: Sequence[str]) -> str | None:
    """The form field a `PayloadError.field` path (`input.items[3].name`) falls in."""
    rest = path.removeprefix("input").lstrip(".")
    head = rest.split(".", 1)[0].split("[", 1)[0]
    if head in names:
        return head
    if WHOLE in names:
        return WHOLE
    return None
