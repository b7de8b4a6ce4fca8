"""The event store's part of the SPI (`engine.publish`, `@task(on_event=...)`).

A published event is stored once per (name, key), with its publish time; the runs it starts
are ordinary runs whose idempotency key is `umt.event:<event id>`, so "this subscriber was
started for this event" is the uniqueness of that key per task name, tombstones included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, runtime_checkable
from uuid import UUID

from attrs import field, frozen

from umt_sdk._spi import EnqueueResult, NewRun, RunStatus

__all__ = [
    "EventListStore",
    "EventRefusal",
    "EventRun",
    "EventStore",
    "NewEvent",
    "PublishOutcome",
    "StoredEvent",
]


@frozen(kw_only=True)
class NewEvent:
    """What `engine.publish` stores."""

    event_id: UUID
    name: str
    key: str
    """Unique per name: a second publish of (name, key) stores nothing."""
    payload_json: str
    payload_hash: str
    trace_context: Mapping[str, str] = field(factory=dict)


@frozen(kw_only=True)
class StoredEvent:
    """An event as stored, for the runs a subscriber registered later starts."""

    event_id: UUID
    name: str
    key: str
    payload_json: str
    published_at: datetime
    trace_context: Mapping[str, str] = field(factory=dict)


@frozen(kw_only=True)
class PublishOutcome:
    """What `EventStore.publish_event` did."""

    event_id: UUID
    """The stored event's id: the new one's, or the one (name, key) already names."""
    created: bool
    payload_hash: str
    """The stored event's payload hash (the SDK refuses a repeat with another payload)."""
    runs: Sequence[EnqueueResult] = ()
    """One per run given, in order, when `created`; empty otherwise (nothing was written)."""


@frozen(kw_only=True)
class EventRefusal:
    """A subscriber whose input type refused an event's payload: no run was started for it."""

    event_id: UUID
    event_name: str
    event_key: str
    task_name: str
    task_version: int
    reason: str
    refused_at: datetime


@runtime_checkable
class EventStore(Protocol):
    """What a backend implements to store events. Optional: without it `publish` raises
    `UsageError`."""

    async def publish_event(
        self, event: NewEvent, runs: Sequence[NewRun], *, conn: Any = None
    ) -> PublishOutcome:
        """Store `event` unless its (name, key) is stored; if it is new, store `runs` (as
        `BatchEnqueueStore.enqueue_many` does: idempotency keys honoured) in the same
        transaction: the caller's `conn` when given, else one of its own. A repeat stores
        nothing and returns the stored event's id and payload hash."""
        ...

    async def events_to_start(
        self, *, name: str, task_name: str, since: datetime, limit: int
    ) -> Sequence[StoredEvent]:
        """Events named `name` published at or after `since` for which task `task_name` has
        no run (nor a tombstone) under the key `umt.event:<event id>` and no refusal, oldest
        first, at most `limit`."""
        ...

    async def refuse_event(
        self, *, event_id: UUID, task_name: str, task_version: int, reason: str
    ) -> None:
        """Record that `task_name`'s input type refused the event: it is not offered again.
        A second refusal of the same pair keeps the first."""
        ...

    async def event_refusals(self, *, limit: int) -> Sequence[EventRefusal]:
        """The refusals of events still stored, newest first."""
        ...

    async def expire_events(self, *, before: datetime, limit: int) -> int:
        """Delete at most `limit` events published before `before` (with their refusals);
        return how many."""
        ...


@frozen(kw_only=True)
class EventRun:
    """A run an event started: a run whose idempotency key is `umt.event:<event id>`."""

    event_id: UUID
    run_id: UUID
    task_name: str
    task_version: int
    status: RunStatus


@runtime_checkable
class EventListStore(Protocol):
    """What a backend implements to list events for operators (`engine.events()`, `umt
    events list`, the dashboard's events page). Optional: without it those say the backend
    cannot list events."""

    async def list_events(
        self, *, name: str | None, before: UUID | None, limit: int
    ) -> Sequence[StoredEvent]:
        """The stored events (of `name` only, when given), newest first (by publish time,
        then id, both descending), at most `limit`; with `before` (an event id), only those
        that come after that event in this order (an id no longer stored: from the start)."""
        ...

    async def event_runs(self, *, event_ids: Sequence[UUID]) -> Sequence[EventRun]:
        """The runs these events started (idempotency key `umt.event:<event id>`, any task),
        stored now (a pruned run's tombstone is not a run), in any order."""
        ...
