"""Updates and queries: a caller changes a run while it runs and gets the handler's result
(`engine.update`), or reads what the run shows of itself (`engine.query`).

Built on facts, steps and streams, not beside them, so every backend stores them as it is:

- an update is a fact addressed to the run, `umt.update:<n>`: the n-th update the run was
  sent. The caller takes the first free n (first write wins, so two callers never share
  one) after the updates the run has applied; its payload is the update's name, argument
  and id. Nothing is stored when the name is unknown or the argument is refused.
- the run applies updates in that order where it waits for them
  (`ctx.step.wait_for_update`): a fact wait on `umt.update:<n>` (parked, slot freed, woken by
  the caller's write as any fact wait is), then the handler, then a step record
  `umt.update-result:<n>` holding the result (or the handler's error). A replay finds both
  records at the same point: it runs the handler again (its steps replay) and returns the
  recorded result. A crash between the fact and the record runs the handler again in the
  next execution (its steps replay or run once, as steps do) and records one result.
- the caller waits for that record; the run writes `n` to its stream `umt.updates` after it,
  which wakes the caller (LISTEN on Postgres), and the caller reads the record again at least
  every second in case the wake-up was lost.
- the caller waits out an outage of the database (a restart, a crash) until its timeout, in
  the store as in the wait: a stored update is applied whatever happens to its caller, and a
  caller that gave up could only send it again, as another update. A store whose answer was
  lost is told apart by the id in the stored fact, so an update is stored once.
- a query reads the newest value of the run's stream `umt.query-state` (written by
  `ctx.set_query_state`) and calls the query's handler on it in the caller's process: no
  worker involved, nothing written, whatever the run is doing (or after it ended).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from attrs import frozen

from umt_sdk import _probe, _serde
from umt_sdk._error_info import error_info
from umt_sdk._handlers import UpdateDefinition, known
from umt_sdk._spi import TERMINAL_STATUSES, Backend, RunRecord, StepRecord
from umt_sdk._streams import stream_store
from umt_sdk.exceptions import (
    BackendUnavailableError,
    CanceledError,
    DeadlineExceededError,
    FactTimeoutError,
    FencingError,
    NonDeterminismError,
    ResultTimeoutError,
    UpdateFailedError,
    UpdateTimeoutError,
    UsageError,
)

if TYPE_CHECKING:
    from umt_sdk._definition import TaskDefinition
    from umt_sdk._steps import Steps

__all__ = [
    "QUERY_STATE_STREAM",
    "UPDATES_STREAM",
    "UPDATE_FACT_PREFIX",
    "AppliedUpdate",
    "send_update",
    "wait_for_update",
]

UPDATE_FACT_PREFIX = "umt.update:"
"""The facts that carry updates: `umt.update:<n>`. Reserved: `signal` and `broadcast`
refuse them, so only `engine.update` sends one."""
UPDATE_RESULT_PREFIX = "umt.update-result:"
UPDATES_STREAM = "umt.updates"
"""The stream a run writes an update's number to once its result is recorded: a wake-up."""
QUERY_STATE_STREAM = "umt.query-state"
"""The stream `ctx.set_query_state` writes and `engine.query` reads the newest value of."""

_RECHECK = 1.0
"""Seconds a caller waits for a wake-up before it reads the run again."""

# What a handler raises that is the execution's business, not the update's failure.
_NOT_THE_UPDATES = (CanceledError, DeadlineExceededError, FencingError, NonDeterminismError)


@frozen(kw_only=True)
class AppliedUpdate:
    """An update the run applied (`ctx.step.wait_for_update` returns it)."""

    name: str
    arg: Any
    """The argument, decoded to the handler's argument type."""
    result: Any
    """What the handler returned (and the caller received)."""
    update_id: str


def request_fact(n: int) -> str:
    return f"{UPDATE_FACT_PREFIX}{n}"


def result_step(n: int) -> str:
    return f"{UPDATE_RESULT_PREFIX}{n}"


def _applied_count(steps: Any) -> int:
    return sum(1 for s in steps if s.kind == "step" and s.name.startswith(UPDATE_RESULT_PREFIX))


# -- in the run -----------------------------------------------------------------------------


async def wait_for_update(
    ctx: Any,
    steps: Steps,
    definition: TaskDefinition[Any, Any],
    names: tuple[str, ...],
    timeout: timedelta | None,
) -> AppliedUpdate:
    """Apply the run's updates in the order they were sent until one named in `names` (any,
    when empty) has been applied without its handler raising; return it. Parked while none
    is stored. `timeout` counts from this call's first wait (recorded, so replays agree).
    `ctx` is the run's `TaskContext`, which the handlers get."""
    first_started: datetime | None = None
    while True:
        n = steps.updates_received + 1
        fact = request_fact(n)
        full = steps.history.occurrence(fact)
        try:
            raw = await steps._wait_for(
                full,
                fact,
                timeout=timeout if first_started is None else None,
                deadline_at=(
                    first_started + timeout
                    if first_started is not None and timeout is not None
                    else None
                ),
                check=None,
                payload_type=Any,
                poll=None,
            )
        except FactTimeoutError as exc:
            wanted = ", ".join(names) if names else "any"
            raise UpdateTimeoutError(
                f"no update ({wanted}) was applied before the wait timed out", update_names=names
            ) from exc
        if first_started is None:
            record = steps.history.last(full, "fact")
            first_started = record.started_at if record is not None else None
        steps.updates_received = n
        applied = await _apply(ctx, steps, definition, n, raw)
        if applied is not None and (not names or applied.name in names):
            return applied


async def _apply(
    ctx: Any,
    steps: Steps,
    definition: TaskDefinition[Any, Any],
    n: int,
    request: Any,
) -> AppliedUpdate | None:
    """Apply the n-th update (or replay it); None when its handler raised (recorded)."""
    name = str(request["name"])
    update_id = str(request["id"])
    arg_text = json.dumps(request.get("arg"))
    handler: UpdateDefinition[Any, Any] | None = definition.updates.get(name)
    full = steps.history.occurrence(result_step(n))
    last = steps.history.last(full, "step")
    replayed = last is not None and last.status == "completed"
    _probe.report("call", full, step_kind="step", replayed=replayed)
    if last is not None and last.status == "completed":  # a replay: the same point, again
        outcome: Any = json.loads(last.output_json or "{}")
        if handler is not None:
            arg = _serde.decode(arg_text, handler.arg_type, what=f"argument of update {name!r}")
            try:
                await handler.fn(ctx, arg)
            except _NOT_THE_UPDATES:
                raise
            except Exception:  # it raised the first time too: recorded as such
                pass
        if "error" in outcome or handler is None:
            return None
        return AppliedUpdate(
            name=name,
            arg=arg,
            result=_serde.from_raw(
                outcome.get("result"), handler.result_type, what=f"result of update {name!r}"
            ),
            update_id=update_id,
        )
    steps._host.check_before_step()
    steps._host.go_live()
    started = steps._host.now()
    result: Any = None
    body: dict[str, Any] = {"id": update_id, "name": name}
    if handler is None:
        error = UsageError(
            f"update {name!r}: the task {definition.pair} declares no such update (it "
            f"declares {known(definition.updates)})",
            argument="name",
        )
        body["error"] = {"type": type(error).__name__, "message": str(error)}
    else:
        try:
            arg = _serde.decode(arg_text, handler.arg_type, what=f"argument of update {name!r}")
            result = await handler.fn(ctx, arg)
            body["result"] = json.loads(
                _serde.encode(result, handler.result_type, what=f"result of update {name!r}")
            )
        except _NOT_THE_UPDATES:
            raise
        except Exception as exc:
            info = error_info(exc)
            body["error"] = {"type": info.type, "message": info.message}
    output_json = json.dumps(body)
    _probe.reach(steps._host.aborts, "step.returned", full, output=output_json)
    await steps.record(
        StepRecord(
            name=full,
            kind="step",
            status="completed",
            fencing_token=steps._host.lease.fencing_token,
            started_at=started,
            finished_at=steps._host.now(),
            output_json=output_json,
        )
    )
    _probe.report("step.recorded", full)
    await ctx.stream.write(UPDATES_STREAM, n)  # wakes the caller
    if "error" in body or handler is None:
        return None
    return AppliedUpdate(
        name=name,
        arg=arg,
        result=_serde.decode(
            json.dumps(body["result"]), handler.result_type, what=f"result of update {name!r}"
        ),
        update_id=update_id,
    )


# -- in the caller --------------------------------------------------------------------------


async def send_update(
    backend: Backend,
    record: RunRecord,
    handler: UpdateDefinition[Any, Any],
    arg_json: str,
    *,
    timeout: float | None,
) -> Any:
    """Store the update for the run (the first free number), wait for its result record and
    return the result; `UpdateFailedError` when the handler raised or the run ended first."""
    run_id = record.run_id
    update_id = uuid.uuid4().hex
    payload = (
        '{"id":' + json.dumps(update_id) + ',"name":' + json.dumps(handler.name)
        + ',"arg":' + arg_json + "}"
    )  # fmt: skip
    deadline = None if timeout is None else time.monotonic() + timeout
    n = await _store_request(
        backend, run_id, _applied_count(record.steps) + 1, payload, update_id, deadline
    )
    store = stream_store(backend)
    wanted = result_step(n)
    outage = _Outage()
    while True:
        try:
            heads = await store.last_stream_entries([run_id], UPDATES_STREAM)
            seen = heads[0].seq if heads else 0
            current = await backend.get_run(run_id)
        except BackendUnavailableError as exc:
            # The update is stored: it is applied whatever happens to this caller, so an
            # outage is waited out here (a caller who gave up could only send it again).
            if deadline is not None and time.monotonic() >= deadline:
                raise ResultTimeoutError(
                    f"update {handler.name!r} of run {run_id} was stored (update {n}) but the "
                    f"database could not be reached to read its result within {timeout} s; "
                    "it stays stored and is applied when the run waits for updates"
                ) from exc
            await outage.wait(deadline)
            continue
        outage.over()
        if current is None:
            raise UpdateFailedError(
                f"run {run_id} was deleted before it applied update {handler.name!r}",
                run_id=run_id,
                update_name=handler.name,
                reason="finished",
            )
        done = next((s for s in current.steps if s.name == wanted and s.kind == "step"), None)
        if done is not None:
            return _outcome(run_id, handler, done)
        if current.status in TERMINAL_STATUSES:
            raise UpdateFailedError(
                f"run {run_id} ended ({current.status}) before it applied update "
                f"{handler.name!r} (it was stored as update {n})",
                run_id=run_id,
                update_name=handler.name,
                reason="finished",
            )
        remaining = _RECHECK if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            raise ResultTimeoutError(
                f"update {handler.name!r} of run {run_id} was stored (update {n}) but not "
                f"applied within {timeout} s; it stays stored and is applied when the run "
                "waits for updates"
            )
        try:
            await store.wait_for_stream(
                run_id, UPDATES_STREAM, after=seen, timeout=min(remaining, _RECHECK)
            )
        except BackendUnavailableError:  # a wake-up is a hint: read again after a pause
            await outage.wait(deadline)


async def _store_request(
    backend: Backend,
    run_id: Any,
    n: int,
    payload: str,
    update_id: str,
    deadline: float | None,
) -> int:
    """Store the request as update `n`, or the first free number after it (first write wins,
    so no two updates share a number); return its number. An outage is waited out until
    `deadline`: a write whose answer was lost is told apart by reading the number's fact
    back (its id is this update's or another's), so the update is stored once."""
    outage = _Outage()
    while True:
        try:
            if await backend.signal(run_id=run_id, name=request_fact(n), payload_json=payload):
                return n
            facts = await backend.get_facts(run_id=run_id, name=request_fact(n))
            if _stored_id(facts, run_id) == update_id:
                return n  # an earlier try of this call stored it; its answer was lost
        except BackendUnavailableError:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            await outage.wait(deadline)
            continue
        n += 1  # taken by an earlier update


def _stored_id(facts: Any, run_id: Any) -> str | None:
    """The id of the update a run's `umt.update:<n>` fact holds."""
    for fact in facts:
        loaded = json.loads(fact.payload_json)
        if fact.run_id == run_id and isinstance(loaded, dict):
            return str(loaded.get("id"))
    return None


class _Outage:
    """The caller's pause between tries while the database cannot be reached: 50 ms,
    doubling up to a second, never past the caller's deadline."""

    def __init__(self) -> None:
        self.delay = 0.05

    async def wait(self, deadline: float | None) -> None:
        pause = self.delay
        if deadline is not None:
            pause = max(0.0, min(pause, deadline - time.monotonic()))
        await asyncio.sleep(pause)
        self.delay = min(self.delay * 2, _RECHECK)

    def over(self) -> None:
        self.delay = 0.05


def _outcome(run_id: Any, handler: UpdateDefinition[Any, Any], done: StepRecord) -> Any:
    body: Any = json.loads(done.output_json or "{}")
    if "error" in body:
        error = body["error"]
        raise UpdateFailedError(
            f"update {handler.name!r} of run {run_id} failed: {error['type']}: {error['message']}",
            run_id=run_id,
            update_name=handler.name,
            reason="failed",
            error_type=str(error["type"]),
            error_message=str(error["message"]),
        )
    return _serde.from_raw(
        body.get("result"), handler.result_type, what=f"result of update {handler.name!r}"
    )
