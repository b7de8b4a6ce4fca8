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
from datetime import timedelta
from typing import Any

import cattrs

from umt_sdk import _check as check
from umt_sdk._check import shown
from umt_sdk._retry import RetryPolicy
from umt_sdk._serde import _converter
from umt_sdk.exceptions import TaskDefinitionError, UsageError

__all__ = [
    "RESERVED_STEP_PREFIX",
    "check_name",
    "check_retry",
    "check_step_kind",
    "check_run_arguments",
    "check_callback_arguments",
    "check_sleep_arguments",
    "check_storable",
    "check_type_argument",
    "check_wait_arguments",
    "declared_transactional",
    "hints",
    "inline_target",
    "output_type_of",
    "unwrap_awaitable",
]

_NAME = re.compile(r"^[A-Za-z0-9_.:\-/]{1,200}$")

RESERVED_STEP_PREFIX = "umt."
"""Step records whose names start with this are umt's own (`umt.compensate:<step>`...): a
step, sleep or fact wait of the user's cannot take such a name."""
_RECORDED_KINDS = frozenset({"step", "sleep"})


def check_name(kind: str, name: object, *, argument: str | None = None) -> str:
    """`name` if it is a valid `kind` name. A name a declaration gives (a task's, a step's)
    is refused with `TaskDefinitionError`; one passed to a call at run time (a fact's, to
    `signal`) names its parameter as `argument` and is refused with `UsageError`. Either way
    the error's `argument` names the parameter (`name` unless told)."""
    error: type[UsageError] = TaskDefinitionError if argument is None else UsageError
    if not isinstance(name, str) or not _NAME.match(name):
        raise error(
            f"{kind} name must be 1-200 characters of letters, digits and _ . : - /, "
            f"got {shown(name)}",
            argument=argument or "name",
        )
    if kind in _RECORDED_KINDS and name.startswith(RESERVED_STEP_PREFIX):
        raise error(
            f"{kind} name {name!r}: names starting with {RESERVED_STEP_PREFIX!r} are umt's own "
            "records (compensations, child runs); choose another name",
            argument=argument or "name",
        )
    if "#" in name:  # pragma: no cover - excluded by the pattern; kept for the reader
        raise error(
            f"{kind} name must not contain '#': umt uses it for repeats",
            argument=argument or "name",
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


def check_type_argument(type_: object, argument: str, *, where: str) -> Any:
    """A type passed to a call (`output_type=`, `payload_type=`, `result_type=`) that the payload
    converter can decode to, else `UsageError` naming `argument`: refused at the call, not
    when a step's output or a fact is decoded (after the step ran)."""
    if type_ is Any:
        return type_
    try:
        _converter.get_structure_hook(type_)
    except Exception as exc:  # not a type at all (5, "int"), or one cattrs cannot decode
        raise UsageError(
            f"{where}: {argument} must be a type umt can store and read back (attrs classes, "
            "dataclasses, primitives, datetimes, UUIDs, lists and dicts of those, or Any for "
            f"plain JSON), got {shown(type_)}",
            argument=argument,
        ) from exc
    return type_


def check_retry(
    retry: object, *, where: str, error: type[UsageError] = UsageError
) -> RetryPolicy | None:
    """`retry=`: a `RetryPolicy` or None (the default: the task's policy)."""
    if retry is None or isinstance(retry, RetryPolicy):
        return retry
    hint = ""
    if isinstance(retry, type) and issubclass(retry, RetryPolicy):
        hint = ": the class itself was passed; use RetryPolicy(...) or RetryPolicy.network()"
    raise error(
        f"{where}: retry must be a RetryPolicy such as RetryPolicy(max_attempts=5), or None; "
        f"got {shown(retry)}{hint}",
        argument="retry",
    )


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
    fn: Callable[..., Any], retry: RetryPolicy | None, timeout: timedelta | None = None
) -> tuple[Callable[..., Any], Any, RetryPolicy | None, timedelta | None]:
    """What `ctx.step.run(name, fn, ...)` runs: a decorated step passes its plain function, its
    output type and (unless `retry` / `timeout` override them) its retry policy and timeout;
    other callables run as they are. Calling the decorated step itself there would start a
    step inside the step."""
    declared = getattr(fn, "__umt_step__", None)  # set by @step (`_task._StepBase`)
    if declared is not None:
        plain, output_type, own_retry, own_timeout = declared
        return (
            plain,
            output_type,
            retry if retry is not None else own_retry,
            timeout if timeout is not None else own_timeout,
        )
    return fn, output_type_of(fn), retry, timeout


# The arguments of `ctx.step.run / sleep / wait_for_fact`, checked before the execution sees
# them: refused there, the handler fails at once with a UsageError (never retried), where a
# wrong type used to surface later as a TypeError that the step or the task retried.


def check_run_arguments(
    name: object,
    fn: object,
    retry: object,
    output_type: object,
    timeout: object = None,
    compensate: object = None,
    *,
    transactional: bool = False,
) -> None:
    """`ctx.step.run(name, fn, ..., retry=, output_type=, timeout=, compensate=)` (and
    `ctx.step.transaction(...)`, `transactional=True`)."""
    check_name("step", name, argument="name")
    where = f"step {name!r}"
    check.function(fn, "fn", expected="the function the step runs", where=where)
    check_step_kind(name, fn, transactional=transactional)
    if compensate is not None:
        check.function(
            compensate,
            "compensate",
            expected="the function that undoes the step (called with its output), or None",
            where=where,
        )
    check_retry(retry, where=where)
    if output_type is not None:
        check_type_argument(output_type, "output_type", where=where)
    if timeout is not None:
        check.duration(
            timeout,
            "timeout",
            positive=True,
            expected="a timedelta > 0 such as timedelta(seconds=30), or None",
            where=where,
        )


def declared_transactional(fn: object) -> bool | None:
    """Whether `fn` was declared a transactional step (`@step(..., transactional=True)`):
    True or False for a decorated step, None for any other callable."""
    declared = getattr(fn, "__umt_transactional__", None)  # set by @step (`_task._StepBase`)
    return declared if isinstance(declared, bool) else None


def check_step_kind(name: object, fn: object, *, transactional: bool) -> None:
    """A decorated step run inline keeps the kind it was declared with: a transactional
    step's function takes the transaction first and its writes must commit with the step's
    record, a plain step's takes no transaction. Run the other way, the first would be
    called without its `tx` (or with an argument in its place) and its writes would not be
    the step's; the second would be given a transaction it does not expect. Refused at the
    call, before anything of the step is stored."""
    declared = declared_transactional(fn)
    if declared is None or declared == transactional:
        return
    step = getattr(fn, "name", "?")
    shown_fn = getattr(fn, "__name__", None) or "fn"
    if declared:
        raise UsageError(
            f"step {name!r}: {shown_fn} is the transactional step {step!r} "
            f"(@step({step!r}, transactional=True)): its function takes the transaction first "
            "and its writes must commit with the step's record, which ctx.step.run does not "
            f"do; run it with ctx.step.transaction({name!r}, {shown_fn}, ...), or call it as "
            f"the step it is: await {shown_fn}(...)",
            argument="fn",
        )
    raise UsageError(
        f"step {name!r}: ctx.step.transaction runs a function that takes the transaction "
        f"first, but {shown_fn} is the plain step {step!r} (@step({step!r})), whose function "
        f"takes none; run it with ctx.step.run({name!r}, {shown_fn}, ...), or declare it "
        f"@step({step!r}, transactional=True) with the transaction as its first parameter",
        argument="fn",
    )


def check_sleep_arguments(name: object, duration: object) -> None:
    """`ctx.step.sleep(name, duration)`: a duration <= 0 is no sleep, as before."""
    check_name("sleep", name, argument="name")
    check.duration(
        duration,
        "duration",
        at_least=None,
        expected=f"a timedelta such as timedelta(minutes=5) (at most {check.MAX_DURATION.days} "
        "days)",
        where=f"sleep {name!r}",
    )


def check_callback_arguments(name: object, timeout: object) -> None:
    """`ctx.step.callback_token(name, timeout=)`: a step's name, and a timeout > 0 (a token
    that never expires would stay usable for ever, so there is no default)."""
    check_name("step", name, argument="name")
    check.duration(
        timeout,
        "timeout",
        positive=True,
        expected=f"a timedelta > 0 such as timedelta(hours=1) (at most {check.MAX_DURATION.days} "
        "days)",
        where=f"callback_token {name!r}",
    )


def check_wait_arguments(
    name: object, *, timeout: object, check_fn: object, payload_type: object, poll: object
) -> None:
    """`ctx.step.wait_for_fact(name, timeout=, check=, payload_type=, poll_interval=)`."""
    check_name("fact", name, argument="name")
    if isinstance(name, str) and name.startswith(RESERVED_STEP_PREFIX):
        raise UsageError(
            f"wait_for_fact {name!r}: names starting with {RESERVED_STEP_PREFIX!r} are umt's "
            "own records; wait for a fact of another name",
            argument="name",
        )
    where = f"wait_for_fact {name!r}"
    most = f"at most {check.MAX_DURATION.days} days"
    if timeout is not None:
        check.duration(
            timeout,
            "timeout",
            expected=f"a timedelta >= 0 such as timedelta(seconds=30) ({most}), or None",
            where=where,
        )
    if poll is not None:
        check.duration(
            poll,
            "poll_interval",
            positive=True,
            expected=f"a timedelta > 0 such as timedelta(seconds=30) ({most}), or None",
            where=where,
        )
    if check_fn is not None:
        check.function(
            check_fn, "check", expected="a function returning the fact or None", where=where
        )
    check_type_argument(payload_type, "payload_type", where=where)
