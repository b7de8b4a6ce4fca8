"""Names and types as umt checks them: step, task and fact names; the types a payload may have.

Pure helpers, below every other module of the SDK but `_serde` (they import nothing that
imports them back).
"""

from __future__ import annotations

import contextlib
import re
import typing
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import cattrs

from umt_sdk._retry import RetryPolicy
from umt_sdk._serde import _converter
from umt_sdk.exceptions import TaskDefinitionError, UsageError

__all__ = [
    "check_name",
    "check_storable",
    "hints",
    "inline_target",
    "output_type_of",
    "unwrap_awaitable",
]

_NAME = re.compile(r"^[A-Za-z0-9_.:\-/]{1,200}$")


def check_name(kind: str, name: object, *, argument: str | None = None) -> str:
    """`name` if it is a valid `kind` name. A name a declaration gives (a task's, a step's)
    is refused with `TaskDefinitionError`; one passed to a call at run time (a fact's, to
    `signal`) names its parameter as `argument` and is refused with `UsageError`."""
    error: type[UsageError] = TaskDefinitionError if argument is None else UsageError
    if not isinstance(name, str) or not _NAME.match(name):
        raise error(
            f"{kind} name must be 1-200 characters of letters, digits and _ . : - /, got {name!r}",
            argument=argument or "",
        )
    if "#" in name:  # pragma: no cover - excluded by the pattern; kept for the reader
        raise error(
            f"{kind} name must not contain '#': umt uses it for repeats", argument=argument or ""
        )
    return name


def hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception as exc:
        raise TaskDefinitionError(
            f"cannot resolve the type annotations of {fn.__qualname__}: {exc}"
        ) from exc


def check_storable(type_: Any, what: str) -> None:
    """Refuse, when decorated, a type that the payload converter cannot decode (`object`, a
    plain class, `list[object]`...): otherwise the run completes and only `result()` or a
    replay fails. `Any` (JSON as it is) is allowed."""
    if type_ is Any:
        return
    try:
        _converter.get_structure_hook(type_)
    except cattrs.errors.StructureHandlerNotFoundError as exc:
        raise TaskDefinitionError(
            f"{what} is {type_name(type_)}, which umt cannot store and read back ({exc}); "
            "use attrs classes, dataclasses, primitives, datetimes, UUIDs, lists and dicts of "
            "those, or Any for plain JSON"
        ) from exc
    except Exception:  # not decidable yet (a forward reference): decoding will say
        return


def type_name(type_: Any) -> str:
    return (
        type_.__qualname__
        if isinstance(type_, type) and not typing.get_args(type_)
        else repr(type_)
    )


_OUTPUT_TYPES: weakref.WeakKeyDictionary[Callable[..., Any], Any] = weakref.WeakKeyDictionary()


def output_type_of(fn: Callable[..., Any]) -> Any:
    """The return annotation of `fn` (awaitables unwrapped; Any if none), cached per function:
    inline steps ask for it on every call."""
    try:
        return _OUTPUT_TYPES[fn]
    except (KeyError, TypeError):
        pass
    if getattr(fn, "__annotations__", None):
        found = unwrap_awaitable(hints(fn).get("return", Any))
        check_storable(found, f"the return type of step function {fn.__qualname__}")
    else:
        found = Any
    with contextlib.suppress(TypeError):  # not weak-referenceable (a builtin): not cached
        _OUTPUT_TYPES[fn] = found
    return found


def unwrap_awaitable(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Coroutine, Awaitable, typing.Coroutine, typing.Awaitable):
        args = typing.get_args(tp)
        return args[-1] if args else Any
    return tp


def inline_target(
    fn: Callable[..., Any], retry: RetryPolicy | None
) -> tuple[Callable[..., Any], Any, RetryPolicy | None]:
    """What `ctx.step.run(name, fn, ...)` runs: a decorated step passes its plain function, its
    output type and (unless `retry` overrides it) its retry policy; other callables run as
    they are. Calling the decorated step itself there would start a step inside the step."""
    declared = getattr(fn, "__umt_step__", None)  # set by @step (`_task._StepBase`)
    if declared is not None:
        plain, output_type, own_retry = declared
        return plain, output_type, retry if retry is not None else own_retry
    return fn, output_type_of(fn), retry
