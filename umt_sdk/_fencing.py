"""`with_attempt_token`: exactly-once side effects through the operation ledger."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from uuid import UUID

from attrs import frozen

from umt_sdk import _check as check
from umt_sdk import _probe, _serde
from umt_sdk._abort import Stop
from umt_sdk._context import current_execution
from umt_sdk._execution import Execution
from umt_sdk._names import check_type_argument, hints, unwrap_awaitable
from umt_sdk._spi import SimulatedCrash
from umt_sdk.exceptions import BackendUnavailableError, FencingError, NotInTaskError

_log = logging.getLogger("umt.fencing")

__all__ = ["AttemptInfo", "with_attempt_token"]

_WHERE = "with_attempt_token"

T = TypeVar("T")


@frozen(kw_only=True)
class AttemptInfo:
    """What `fn` is told when `with_attempt_token` calls it."""

    op_key: str
    run_id: UUID
    attempt_token: int
    """The caller's fencing token: pass it to outside systems as a fencing or idempotency key."""
    resumed: bool
    """An earlier attempt began this operation and left no result: look the outside state up
    by `op_key` first, then finish or redo."""


async def with_attempt_token(
    conn: Any,
    op_key: str,
    fn: Callable[[AttemptInfo], Awaitable[T] | T],
    *,
    commit: Callable[[Any, T], Awaitable[None] | None] | None = None,
    result_type: Any = None,
) -> T:
    """Run an outside side effect at most once per `op_key`, fenced by the run's lease.

    1. If the ledger on `conn` has a result for `op_key`, return it without calling `fn`.
    2. Record (fenced) that this attempt begins `op_key`, then call `fn(info)`;
       `info.resumed` is True when an earlier attempt began it and left no result.
    3. In one transaction: check that the caller still holds the run and is the attempt that
       last began `op_key` (else `FencingError`, and `commit` is not called: fence first), run
       `commit(tx, result)` for business writes, and record the result only if that still
       holds (else `FencingError`, and the business writes roll back with it).

    The fence is the ledger row of `op_key`: a newer attempt's begin raises its token, so a
    stale attempt either committed before the newer one began (which then returns the recorded
    result) or is refused. No lock on the engine's rows is held while `fn` or `commit` runs:
    a frozen or slow commit never holds up a takeover, a cancel or another run's heartbeat.

    Call it from inside a step (else `NotInTaskError`). `conn` is a business connection the
    backend understands (a psycopg connection for Postgres, a `MemoryStore` for the memory
    backend); another `conn`, or an empty `op_key`, is refused with `UsageError`.
    """
    check.text(
        op_key, "op_key", empty=False, expected="a non-empty string such as 'submit:<plan id>'"
    )
    check.function(fn, "fn", expected="the function that makes the side effect", where=_WHERE)
    if commit is not None:
        check.function(
            commit, "commit", expected="a function (tx, result) -> None, or None", where=_WHERE
        )
    if result_type is not None:
        check_type_argument(result_type, "result_type", where=_WHERE)
    execution = current_execution()
    if not isinstance(execution, Execution):
        raise NotInTaskError(
            f"with_attempt_token({op_key!r}) was called outside a running task; call it from a step"
        )
    if result_type is None:
        result_type = unwrap_awaitable(hints(fn).get("return", Any)) if _has_hints(fn) else Any
    ledger = execution.backend.ledger(conn)
    lease = execution.lease
    aborts = execution.aborts
    try:
        _probe.reach(aborts, "op.begin", op_key)
        _stop_if_crashed(execution)
        entry = await ledger.begin(op_key=op_key, lease=lease)
    except (FencingError, SimulatedCrash):
        execution.abort("lease_lost", "lease lost before a fenced operation")
        raise
    except BackendUnavailableError as exc:
        _outage(execution, op_key, "begin", exc)
        raise
    if entry.result_json is not None:
        recorded: T = _serde.decode(entry.result_json, result_type, what=f"result of {op_key!r}")
        return recorded
    info = AttemptInfo(
        op_key=op_key,
        run_id=execution.claimed.run_id,
        attempt_token=lease.fencing_token,
        resumed=entry.resumed,
    )
    _probe.reach(aborts, "op.action", op_key)
    value = fn(info)
    result: T = await value if inspect.isawaitable(value) else value
    result_json = _serde.encode(result, result_type, what=f"result of {op_key!r}")

    async def apply(tx: Any) -> None:
        _stop_if_crashed(execution)
        if commit is not None:
            done = commit(tx, result)
            if inspect.isawaitable(done):
                await done
        _probe.reach(aborts, "op.commit", op_key)
        _stop_if_crashed(execution)  # last: the ledger applies the commit right after this

    try:
        _probe.reach(aborts, "op.acted", op_key)
        await ledger.finish(op_key=op_key, lease=lease, result_json=result_json, commit=apply)
        _probe.reach(aborts, "op.committed", op_key)
    except (FencingError, SimulatedCrash):
        execution.abort("lease_lost", "lease lost at the commit of a fenced operation")
        raise
    except BackendUnavailableError as exc:
        _outage(execution, op_key, "commit", exc)
        raise
    return result


def _stop_if_crashed(execution: Execution) -> None:
    """A crashed execution (simulated, or stopped by an outage) writes nothing more, as a
    killed process could not: its ledger begin and commit are not made (the commit's business
    writes roll back). Only a crash: after a lost lease the ledger's fence decides, and a
    commit that lands before the newer attempt begins is that attempt's recorded result."""
    if execution.aborts.kind == "crash":
        raise Stop


def _outage(execution: Execution, op_key: str, where: str, exc: BackendUnavailableError) -> None:
    """The fence could not be checked (a database is down): whether the write landed is
    unknown, and an outage is not the step's failure. Stop the execution as a crash would; the
    run resumes after its lease, and the next attempt's begin finds the result if it landed."""
    _log.warning(
        "run %s: %r: the backend is unavailable at the fence's %s (%s); stopping this "
        "execution, the run resumes when its lease expires",
        execution.claimed.run_id,
        op_key,
        where,
        exc,
    )
    execution.abort("crash", f"backend unavailable at the {where} of {op_key!r}: {exc}")


def _has_hints(fn: Callable[..., Any]) -> bool:
    return bool(getattr(fn, "__annotations__", None))
