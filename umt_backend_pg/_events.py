"""The Postgres backend's event store (`umt_sdk.backend.EventStore`): the queries of
`sql/events.sql` on the tables of migration 0023."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from functools import cache
from typing import Any
from uuid import UUID

import psycopg
from psycopg_pool import AsyncConnectionPool

from umt_backend_pg._errors import wrap_exceptions
from umt_backend_pg._sql import blocks, render
from umt_sdk.backend import (
    EnqueueResult,
    EventRefusal,
    EventRun,
    NewEvent,
    NewRun,
    PublishOutcome,
    StoredEvent,
)
from umt_sdk.exceptions import UsageError

__all__ = ["PostgresEvents"]


@cache
def _queries(schema: str) -> dict[str, str]:
    return {name: render(text, schema) for name, text in blocks("events.sql").items()}


def _stored_event(row: tuple[Any, ...]) -> StoredEvent:
    """An event as `events_to_start` and `list_events` select it."""
    return StoredEvent(
        event_id=row[0],
        name=row[1],
        key=row[2],
        payload_json=row[3],
        published_at=row[4],
        trace_context=json.loads(row[5]),
    )


class PostgresEvents:
    """Mixed into `PostgresBackend`: it provides the pool, the schema and the batch enqueue
    on a given connection."""

    _pool: AsyncConnectionPool[Any]
    schema: str

    enqueue_many: Callable[..., Awaitable[Sequence[EnqueueResult]]]

    def _event_queries(self) -> dict[str, str]:
        return _queries(self.schema)

    async def _event_rows(self, query: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """The rows of the events.sql block `query`, on a connection of the pool."""
        with wrap_exceptions():
            async with self._pool.connection() as conn:
                cur = await conn.execute(self._event_queries()[query], params)
                rows: list[tuple[Any, ...]] = await cur.fetchall()
                return rows

    async def publish_event(
        self, event: NewEvent, runs: Sequence[NewRun], *, conn: Any = None
    ) -> PublishOutcome:
        if conn is not None and not isinstance(conn, psycopg.AsyncConnection):
            raise UsageError(
                "publish(conn=...) takes a psycopg.AsyncConnection to the engine's database "
                f"(your open transaction), got {type(conn).__name__}",
                argument="conn",
            )
        with wrap_exceptions():
            if conn is not None:
                return await self._publish_on(conn, event, runs)
            async with self._pool.connection() as own, own.transaction():
                return await self._publish_on(own, event, runs)

    async def _publish_on(
        self, conn: psycopg.AsyncConnection[Any], event: NewEvent, runs: Sequence[NewRun]
    ) -> PublishOutcome:
        q = self._event_queries()
        params = {
            "id": event.event_id,
            "name": event.name,
            "key": event.key,
            "payload": event.payload_json,
            "payload_hash": event.payload_hash,
            "trace_context": json.dumps(dict(event.trace_context)),
        }
        cur = await conn.execute(q["insert_event"], params)
        if await cur.fetchone() is None:
            cur = await conn.execute(q["find_event"], params)
            row = await cur.fetchone()
            if row is None:  # pragma: no cover - the racing insert was rolled back meanwhile
                return await self._publish_on(conn, event, runs)
            return PublishOutcome(event_id=row[0], created=False, payload_hash=row[1])
        # On this connection: the runs commit with the event, their NOTIFY at that commit.
        results = await self.enqueue_many(runs, conn=conn) if runs else ()
        return PublishOutcome(
            event_id=event.event_id,
            created=True,
            payload_hash=event.payload_hash,
            runs=tuple(results),
        )

    async def events_to_start(
        self, *, name: str, task_name: str, since: datetime, limit: int
    ) -> Sequence[StoredEvent]:
        rows = await self._event_rows(
            "events_to_start",
            {"name": name, "task_name": task_name, "since": since, "limit": limit},
        )
        return [_stored_event(row) for row in rows]

    async def refuse_event(
        self, *, event_id: UUID, task_name: str, task_version: int, reason: str
    ) -> None:
        with wrap_exceptions():
            async with self._pool.connection() as conn:
                await conn.execute(
                    self._event_queries()["refuse_event"],
                    {
                        "event_id": event_id,
                        "task_name": task_name,
                        "task_version": task_version,
                        "reason": reason,
                    },
                )

    async def event_refusals(self, *, limit: int) -> Sequence[EventRefusal]:
        rows = await self._event_rows("event_refusals", {"limit": limit})
        return [
            EventRefusal(
                event_id=row[0],
                event_name=row[1],
                event_key=row[2],
                task_name=row[3],
                task_version=row[4],
                reason=row[5],
                refused_at=row[6],
            )
            for row in rows
        ]

    async def expire_events(self, *, before: datetime, limit: int) -> int:
        return len(await self._event_rows("expire_events", {"before": before, "limit": limit}))

    async def list_events(
        self, *, name: str | None, before: UUID | None, limit: int
    ) -> Sequence[StoredEvent]:
        rows = await self._event_rows(
            "list_events", {"name": name, "before": before, "limit": limit}
        )
        return [_stored_event(row) for row in rows]

    async def event_runs(self, *, event_ids: Sequence[UUID]) -> Sequence[EventRun]:
        if not event_ids:
            return []
        keys = [f"umt.event:{event_id}" for event_id in event_ids]
        rows = await self._event_rows("event_runs", {"keys": keys})
        return [
            EventRun(
                event_id=UUID(row[0].removeprefix("umt.event:")),
                run_id=row[1],
                task_name=row[2],
                task_version=row[3],
                status=row[4],
            )
            for row in rows
        ]
