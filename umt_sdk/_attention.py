"""Outcomes an operator must settle: a step declared `uncertain_on=(TimeoutError, ...)` whose
attempt fails that way may or may not have done its work (the call may have happened), so the
run is neither retried nor failed: it parks in `needs_attention` until someone says what
happened (`engine.settle`, `umt runs settle`).

Built on steps and facts, not beside them:
- the failed attempt's record (kind `step`, status `waiting`) is written first, with the
  error and a reference to the step's output type: from then on, whatever happens to the
  worker, a replay of the step parks the run again and never runs its body;
- the run then parks like a fact wait with no deadline, on the reserved fact
  `umt.attention:<attempt>:<step>`: it holds no lease and no worker slot, a cancel ends it at
  once, and on Postgres it is woken by the same write that stores the fact;
- `engine.settle` checks the run is parked on that step, checks the output against the step's
  output type, and stores the fact (first write wins, so a run is settled once) with who
  settled it and when;
- the woken run records the settlement (a `fact` record under the fact's name, with who
  settled it, kept in the run's history) and then the step: `done` records the given output
  as the attempt's result and the body never runs; `not-done` marks the attempt `retrying`
  and runs the step again as the next attempt.
"""

from __future__ import annotations

import getpass
import importlib
import json
import re
import types
import typing
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Literal
from uuid import UUID

from attrs import frozen

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._spi import ATTENTION_WAIT_PREFIX, Backend, StepRecord
from umt_sdk._telemetry import Telemetry
from umt_sdk.exceptions import PayloadError, UsageError

__all__ = [
    "ATTENTION_FACT_PREFIX",
    "Settlement",
    "attention_envelope",
    "attention_fact",
    "attention_of",
    "check_uncertain_on",
    "checked_output",
    "find_parked",
    "parse_attention_fact",
    "resolve_type",
    "settlement_json",
    "settlement_of",
    "settle_run",
    "type_ref",
]

ATTENTION_FACT_PREFIX = ATTENTION_WAIT_PREFIX
"""The facts that settle a step: `umt.attention:<attempt>:<step>`. Reserved: `signal` and
`broadcast` refuse them, so only `settle` stores one."""

_FACT = re.compile(r"umt\.attention:([0-9]+):(.+)", re.DOTALL)
_ENVELOPE_KEY = "umt_attention"
_SETTLED_KEY = "umt_settled"


def attention_fact(step_name: str, attempt: int) -> str:
    """The fact that settles attempt `attempt` of step `step_name`."""
    return f"{ATTENTION_FACT_PREFIX}{attempt}:{step_name}"


def parse_attention_fact(name: str | None) -> tuple[str, int] | None:
    """The (step, attempt) a run parked on `name` waits for a settlement of; None when
    `name` is not an attention fact."""
    if name is None:
        return None
    match = _FACT.fullmatch(name)
    if match is None:
        return None
    return match.group(2), int(match.group(1))


def check_uncertain_on(
    value: object, *, where: str, error: type[UsageError]
) -> tuple[type[BaseException], ...]:
    """`uncertain_on=` as given (an exception class or a tuple of them), as a tuple."""
    classes = value if isinstance(value, tuple) else (value,)
    if not classes or not all(
        isinstance(c, type) and issubclass(c, BaseException) for c in classes
    ):
        raise error(
            f"{where}: uncertain_on must be an exception class or a non-empty tuple of them "
            f"(such as (TimeoutError,)), got {value!r}",
            argument="uncertain_on",
        )
    return typing.cast(tuple[type[BaseException], ...], classes)


# -- the parked attempt's record ----------------------------------------------------------------


def attention_envelope(output_type: Any) -> str:
    """The output of the record of an attempt that failed uncertainly: a reference to the
    step's output type (checked by `settle`), not an output."""
    return json.dumps({_ENVELOPE_KEY: {"output_type": type_ref(output_type)}})


def attention_of(record: StepRecord | None) -> dict[str, Any] | None:
    """What an attempt that failed uncertainly recorded (its output type's reference); None for
    any other record."""
    if record is None or record.kind != "step" or record.status != "waiting":
        return None
    try:
        loaded = json.loads(record.output_json or "null")
    except ValueError:
        return None
    if isinstance(loaded, dict) and isinstance(loaded.get(_ENVELOPE_KEY), dict):
        return typing.cast(dict[str, Any], loaded[_ENVELOPE_KEY])
    return None


def find_parked(records: Sequence[StepRecord], step_name: str, attempt: int) -> StepRecord | None:
    """The record of attempt `attempt` of `step_name` if it failed uncertainly."""
    for record in records:
        if (
            record.name == step_name
            and record.attempt == attempt
            and attention_of(record) is not None
        ):
            return record
    return None


# -- the settlement -------------------------------------------------------------------------------


@frozen(kw_only=True)
class Settlement:
    """How an operator settled a step that needed attention."""

    step_name: str
    attempt: int
    done: bool
    """True: the step's work was done, `output_json` is its result; False: it was not, the
    step runs again."""
    output_json: str | None
    by: str
    at: datetime


def settlement_json(settlement: Settlement) -> str:
    """The payload of the fact that settles the step (and of its record in the history)."""
    body = {
        "step": settlement.step_name,
        "attempt": settlement.attempt,
        "as": "done" if settlement.done else "not-done",
        "output": None if settlement.output_json is None else json.loads(settlement.output_json),
        "by": settlement.by,
        "at": settlement.at.isoformat(),
    }
    return _serde.dumps({_SETTLED_KEY: body})


def settlement_of(payload_json: str) -> Settlement | None:
    """The settlement a fact's payload holds; None if it holds none."""
    loaded = json.loads(payload_json)
    body = loaded.get(_SETTLED_KEY) if isinstance(loaded, dict) else None
    if not isinstance(body, dict):
        return None
    output = body.get("output")
    return Settlement(
        step_name=str(body["step"]),
        attempt=int(body["attempt"]),
        done=body.get("as") == "done",
        output_json=None if body.get("as") != "done" else _serde.dumps(output),
        by=str(body.get("by", "")),
        at=datetime.fromisoformat(str(body["at"])),
    )


# -- output types by reference ------------------------------------------------------------------
#
# `settle` may run in another process than the worker (the `umt` command), which has no step
# code at hand: the parked record names the step's output type, resolved there by import.


def type_ref(tp: Any) -> Any:
    """A JSON reference to `tp` that `resolve_type` turns back into it, or None when it has
    none (a class defined inside a function, a type form not covered): then only JSON is
    checked at `settle`, and the type when the run replays the step."""
    if tp is Any:
        return "any"
    if tp is None or tp is type(None):
        return "none"
    if tp is Ellipsis:
        return "..."
    origin = typing.get_origin(tp)
    if origin is None:
        if isinstance(tp, type) and "<locals>" not in tp.__qualname__:
            return f"{tp.__module__}:{tp.__qualname__}"
        return None
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return type_ref(args[0])
    if origin is Literal:
        if all(a is None or isinstance(a, (str, int, bool)) for a in args):
            return {"literal": list(args)}
        return None
    if origin is typing.Union or origin is types.UnionType:
        head: Any = "union"
    else:
        head = type_ref(origin)
    refs = [type_ref(a) for a in args]
    if head is None or any(r is None for r in refs):
        return None
    return {"of": head, "args": refs}


def resolve_type(ref: Any) -> Any:
    """The type `ref` (from `type_ref`) names; `LookupError` when it cannot be imported here."""
    if ref == "any":
        return Any
    if ref == "none":
        return type(None)
    if ref == "...":
        return Ellipsis
    if isinstance(ref, str):
        module_name, _, qualname = ref.partition(":")
        try:
            found: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError) as exc:
            raise LookupError(ref.replace(":", ".")) from exc
        return found
    if isinstance(ref, dict) and "literal" in ref:
        return Literal[tuple(ref["literal"])]
    if isinstance(ref, dict) and "of" in ref:
        args = tuple(resolve_type(a) for a in ref["args"])
        if ref["of"] == "union":
            return typing.Union[args]  # noqa: UP007  # built from a tuple at run time
        return resolve_type(ref["of"])[args if len(args) != 1 else args[0]]
    raise LookupError(repr(ref))


def checked_output(output: Any, ref: Any, *, what: str) -> str:
    """`output` as the JSON the step's record will hold, checked against the step's output
    type (`ref`): `UsageError` naming what is wrong."""
    try:
        text = _serde.encode(output, what=what)
    except PayloadError as exc:
        raise UsageError(f"{what}: {exc}", argument="output") from exc
    if ref is None:
        return text
    try:
        output_type = resolve_type(ref)
    except LookupError as exc:
        raise UsageError(
            f"{what}: cannot check it against the step's output type {exc.args[0]}, which "
            "cannot be imported here; settle from where your task modules import (the "
            "directory your workers run in)",
            argument="output",
        ) from exc
    try:
        value = _serde.decode(text, output_type, what=what)
        return _serde.encode(value, output_type, what=what)
    except PayloadError as exc:
        raise UsageError(
            f"{what} does not decode into the step's output type: {exc}", argument="output"
        ) from exc


# -- settle ---------------------------------------------------------------------------------


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError, ImportError):  # no login name in this process's environment
        return "unknown"


async def settle_run(
    backend: Backend,
    telemetry: Telemetry,
    run_id: UUID,
    *,
    step: str,
    done: bool,
    output: Any,
    by: str | None,
) -> Settlement:
    """`engine.settle`: check, then store the settlement's fact (first write wins), which
    wakes the run. Every refusal is a `UsageError` naming what is wrong, with nothing stored."""
    where = "settle()"
    check.text(step, "step", empty=False, where=where)
    if not isinstance(done, bool):
        check.refuse("done", "True (the step's work was done) or False (it was not)", done)
    if by is None:
        by = _os_user()
    check.text(by, "by", empty=False, max_length=200, where=where)
    _serde.check_text(by, what="by")
    if not done and output is not None:
        raise UsageError(
            f"{where}: an output is given only with done=True (the step's result); a step "
            "settled as not done runs again",
            argument="output",
        )
    run = await backend.get_run(run_id)
    if run is None:
        raise UsageError(f"{where}: there is no run {run_id}", argument="run_id")
    parked = parse_attention_fact(run.wait_for) if run.status == "waiting" else None
    if parked is None:
        state = "waiting" if run.status == "waiting" else run.status
        raise UsageError(
            f"{where}: run {run_id} is {state}, not needs_attention: no step of it waits to "
            "be settled",
            argument="run_id",
        )
    step_name, attempt = parked
    if step != step_name:
        raise UsageError(
            f"{where}: run {run_id} waits for step {step_name!r} to be settled, not {step!r}",
            argument="step",
        )
    record = find_parked(run.steps, step_name, attempt)
    envelope = attention_of(record)
    if envelope is None:  # the parked attempt's record comes first; a guard
        raise UsageError(
            f"{where}: run {run_id} has no uncertain attempt {attempt} of step {step_name!r}",
            argument="step",
        )
    output_json = (
        checked_output(output, envelope.get("output_type"), what=f"output of step {step_name!r}")
        if done
        else None
    )
    settlement = Settlement(
        step_name=step_name,
        attempt=attempt,
        done=done,
        output_json=output_json,
        by=by,
        at=run.observed_at or datetime.now(UTC),
    )
    attributes = {
        "umt.run.id": str(run_id),
        "umt.step.name": step_name,
        "umt.settled.as": "done" if done else "not-done",
        "umt.settled.by": by,
    }
    with telemetry.producer_span(f"umt.settle {step_name}", attributes):
        stored = await backend.signal(
            run_id=run_id,
            name=attention_fact(step_name, attempt),
            payload_json=settlement_json(settlement),
        )
    if not stored:
        raise UsageError(
            f"{where}: step {step_name!r} of run {run_id} was already settled (the first "
            "settlement stays)",
            argument="step",
        )
    return settlement
