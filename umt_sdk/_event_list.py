"""The events operators look at: `engine.events()` (and `umt events list`, the dashboard's
events page), each stored event with the runs it started, newest first.

An event's runs are found by their idempotency key, `umt.event:<event id>` (see `_events`),
whatever task they are of: the runs the publish started and those workers started later for
subscribers registered after it. Events older than the event window are deleted by the
workers, so the list holds the window's events.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any
from uuid import UUID

from attrs import frozen

from umt_sdk import _check as check
from umt_sdk._event_spi import EventListStore
from umt_sdk._events import check_event_name
from umt_sdk._spi import Backend, RunStatus
from umt_sdk.exceptions import UsageError

__all__ = ["EventInfo", "EventRunInfo", "list_events"]

MAX_LIMIT = 500


@frozen(kw_only=True)
class EventRunInfo:
    """A run an event started: one per subscribing task."""

    run_id: UUID
    task_name: str
    task_version: int
    status: RunStatus


@frozen(kw_only=True)
class EventInfo:
    """A stored event (`engine.events()`): what was published, when, and the runs it started
    so far (a subscriber a worker has not served yet has none)."""

    event_id: UUID
    name: str
    key: str
    """The publish's `key`, or the event id when it was published without one."""
    published_at: datetime
    payload: Any
    """The payload as JSON decoded (dicts, lists, text, numbers)."""
    runs: tuple[EventRunInfo, ...] = ()
    """By task name."""


async def list_events(
    backend: Backend, *, name: str | None, before: UUID | None, limit: int
) -> list[EventInfo]:
    """`engine.events(...)`: see there."""
    if name is not None:
        check_event_name(name, "name", where="events()")
    if before is not None and not isinstance(before, UUID):
        check.refuse("before", "an event id (a UUID) or None", before, where="events()")
    check.integer(limit, "limit", at_least=1, at_most=MAX_LIMIT, where="events()")
    if not isinstance(backend, EventListStore):
        raise UsageError(
            f"events(): this backend ({type(backend).__name__}) cannot list events "
            "(it does not implement umt_sdk.backend.EventListStore)",
            argument="backend",
        )
    stored = await backend.list_events(name=name, before=before, limit=limit)
    runs = await backend.event_runs(event_ids=[event.event_id for event in stored])
    by_event: dict[UUID, list[EventRunInfo]] = {}
    for run in runs:
        by_event.setdefault(run.event_id, []).append(
            EventRunInfo(
                run_id=run.run_id,
                task_name=run.task_name,
                task_version=run.task_version,
                status=run.status,
            )
        )
    return [
        EventInfo(
            event_id=event.event_id,
            name=event.name,
            key=event.key,
            published_at=event.published_at,
            payload=json.loads(event.payload_json),
            runs=tuple(sorted(by_event.get(event.event_id, ()), key=_by_task)),
        )
        for event in stored
    ]


def _by_task(run: EventRunInfo) -> tuple[str, int]:
    return (run.task_name, run.task_version)
