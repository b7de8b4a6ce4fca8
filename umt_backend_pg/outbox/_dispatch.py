"""Dispatch: one batch of due outbox rows claimed, each row enqueued as a run (with its span)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol, TypeAlias

import psycopg
from attrs import frozen
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, TracerProvider
from psycopg.rows import dict_row

from umt_sdk import Engine, PayloadCodec, TaskDefinition
from umt_sdk.backend import open_json, sealed_by
from umt_sdk.exceptions import (
    BackendUnavailableError,
    CodecError,
    IdempotencyConflictError,
    PayloadError,
)

__all__ = ["DispatchReport", "Dispatcher", "RelaySettings", "TaskRef"]

_log = logging.getLogger("umt.outbox")

TaskRef: TypeAlias = "TaskDefinition[Any, Any] | str"


@frozen(kw_only=True)
class DispatchReport:
    """What one `run_once` did."""

    claimed: int = 0
    dispatched: int = 0
    """Rows marked dispatched (their run was created, or already existed under the key)."""
    created: int = 0
    """Of those, how many runs this dispatch created."""
    retried: int = 0
    """Rows that failed and were scheduled again (backoff)."""
    dead: int = 0
    """Rows marked dead (unknown type, invalid payload, or out of attempts)."""
    engine_unavailable: bool = False
    """The engine's database could not be reached; the untouched rows stay pending."""


@frozen
class _Outcome:
    row_id: int
    ok: bool
    created: bool = False
    error: str = ""
    dead: bool = False


class _Unavailable(Exception):
    pass


class RelaySettings(Protocol):
    """What a dispatch reads of its relay, at each batch: the relay's public settings."""

    engine: Engine
    schema: str
    table: str
    routes: dict[str, tuple[TaskRef, Callable[[Any], Any] | None]]
    batch_size: int
    max_attempts: int
    backoff: timedelta
    max_backoff: timedelta
    concurrency: int

    def default_key(self, event_id: int) -> str: ...


class Dispatcher:
    """Claims a batch of due rows of one relay's outbox table and dispatches each, in one
    transaction on the relay's connection, with a consumer span per row."""

    def __init__(
        self,
        relay: RelaySettings,
        *,
        queries: Mapping[str, str],
        tracer_provider: TracerProvider | None,
    ) -> None:
        self._relay = relay
        self._q = queries
        self._tracer = trace.get_tracer("umt.outbox", tracer_provider=tracer_provider)

    async def dispatch_batch(
        self, conn: psycopg.AsyncConnection[Any], *, same_database: bool
    ) -> DispatchReport:
        outcomes: list[_Outcome] = []
        unavailable = False
        async with conn.transaction():
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(self._q["claim"], {"limit": self._relay.batch_size})
            rows = await cur.fetchall()
            if same_database or self._relay.concurrency == 1:
                for row in rows:
                    try:
                        outcomes.append(await self._dispatch_row(conn, row, same_database))
                    except _Unavailable:
                        unavailable = True
                        break
            else:
                slots = asyncio.Semaphore(self._relay.concurrency)

                async def dispatch(row: dict[str, Any]) -> _Outcome | None:
                    nonlocal unavailable
                    async with slots:
                        if unavailable:
                            return None
                        try:
                            return await self._dispatch_row(conn, row, same_database)
                        except _Unavailable:
                            unavailable = True
                            return None

                results = await asyncio.gather(*(dispatch(row) for row in rows))
                outcomes = [o for o in results if o is not None]
            done = [o.row_id for o in outcomes if o.ok]
            if done:
                await conn.execute(self._q["mark_dispatched"], {"ids": done})
            failed = [o for o in outcomes if not o.ok]
            statuses: dict[int, str] = {}
            if failed:
                marked = conn.cursor()
                await marked.execute(
                    self._q["mark_failed"],
                    {
                        "ids": [o.row_id for o in failed],
                        "errors": [o.error[:4000] for o in failed],
                        "dead": [o.dead for o in failed],
                        "max_attempts": self._relay.max_attempts,
                        "base": self._relay.backoff,
                        "cap": self._relay.max_backoff,
                    },
                )
                statuses = {r[0]: r[1] for r in await marked.fetchall()}
        dead = sum(1 for s in statuses.values() if s == "dead")
        for outcome in failed:
            _log.warning(
                "outbox event %s %s: %s",
                outcome.row_id,
                "is dead" if statuses.get(outcome.row_id) == "dead" else "will be retried",
                outcome.error,
            )
        return DispatchReport(
            claimed=len(rows),
            dispatched=len(done),
            created=sum(1 for o in outcomes if o.ok and o.created),
            retried=len(failed) - dead,
            dead=dead,
            engine_unavailable=unavailable,
        )

    async def _dispatch_row(
        self, conn: psycopg.AsyncConnection[Any], row: dict[str, Any], same_database: bool
    ) -> _Outcome:
        row_id: int = row["id"]
        event_type: str = row["type"]
        key: str = row["idempotency_key"] or self._relay.default_key(row_id)
        links = []
        if row["trace_context"]:
            writer = trace.get_current_span(
                propagate.extract(dict(row["trace_context"]))
            ).get_span_context()
            if writer.is_valid:
                links.append(Link(writer))
        attributes: dict[str, Any] = {
            "messaging.system": "umt.outbox",
            "messaging.operation.type": "process",
            "messaging.destination.name": f"{self._relay.schema}.{self._relay.table}",
            "messaging.message.id": str(row_id),
            "umt.outbox.event.id": row_id,
            "umt.outbox.event.type": event_type,
            "umt.outbox.attempt": row["attempts"] + 1,
            "umt.outbox.idempotency_key": key,
            "umt.outbox.same_database": same_database,
        }
        with self._tracer.start_as_current_span(
            f"umt.outbox.dispatch {event_type}",
            kind=SpanKind.CONSUMER,
            links=links,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            route = self._relay.routes.get(event_type)
            if route is None:
                known = ", ".join(sorted(self._relay.routes)) or "none"
                error = f"no route for outbox event type {event_type!r} (routes: {known})"
                span.set_status(Status(StatusCode.ERROR, error))
                span.set_attribute("umt.outbox.outcome", "dead")
                return _Outcome(row_id, ok=False, error=error, dead=True)
            target, mapper = route
            try:
                payload = _opened(row["payload"], self._relay.engine.codec)
                value = mapper(payload) if mapper is not None else payload
                if same_database:
                    async with conn.transaction():  # a savepoint: a failed enqueue undoes itself
                        handle = await self._relay.engine.enqueue(
                            target, value, idempotency_key=key, conn=conn
                        )
                else:
                    handle = await self._relay.engine.enqueue(target, value, idempotency_key=key)
            except BackendUnavailableError as exc:
                if same_database:
                    raise  # the relay's own connection: the whole batch rolls back
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"engine unavailable: {exc}"))
                span.set_attribute("umt.outbox.outcome", "deferred")
                raise _Unavailable from exc
            except Exception as exc:
                # Retrying cannot fix an input the task refuses, nor a key that names a run
                # with another input: those are dead at once; anything else backs off.
                permanent = isinstance(exc, PayloadError | IdempotencyConflictError)
                error = f"{type(exc).__name__}: {exc}"
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, error))
                span.set_attribute("umt.outbox.outcome", "dead" if permanent else "failed")
                return _Outcome(row_id, ok=False, error=error, dead=permanent)
            span.set_attribute("umt.run.id", str(handle.run_id))
            span.set_attribute("umt.run.created", handle.created)
            span.set_attribute("umt.outbox.outcome", "dispatched")
            return _Outcome(row_id, ok=True, created=handle.created)


def _opened(payload: Any, codec: PayloadCodec | None) -> Any:
    """An outbox row's payload as the business code gave it: opened by the engine's codec when
    `insert_outbox_event(..., codec=...)` sealed it (`CodecError` without one: the row backs
    off, as for any error a retry may fix once the relay has its codec)."""
    if not isinstance(payload, str) or sealed_by(payload) is None:
        return payload
    text = json.dumps(payload)
    if codec is None:
        raise CodecError(
            f"the outbox payload is sealed by codec {sealed_by(payload)!r} and the relay's "
            "engine has none: connect it with codec=...",
            codec=sealed_by(payload) or "",
        )
    return json.loads(open_json(codec, text))
