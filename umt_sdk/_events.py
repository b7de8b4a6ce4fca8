"""Event triggers: `@task(on_event="order.placed")` and `engine.publish("order.placed", ...)`.

A publish stores the event once per (name, key) and, in the same transaction, one run per
subscriber the publishing engine's registry knows. A subscriber is a task name: the newest
registered version of it that subscribes to the event is started. Each run's idempotency key
is `umt.event:<event id>`, so an event starts a task at most once, whoever starts it.

Subscribers the publisher does not know (a worker deployed later, a task only workers import)
are started by the workers that serve them: every worker looks, at start and every
`event_interval`, for the events of the last `event_window` (default 24 h) its subscribers
have no run for, and starts them under the same keys. Events older than the window are never
started and are deleted by that same loop.

The payload is stored as JSON once; each subscriber's input is that JSON decoded into its own
input type. A subscriber the publisher knows whose type refuses it fails the publish
(`PayloadError` naming the task, nothing stored); a subscriber found later that refuses it is
not started, and the refusal is recorded (`engine.event_refusals()`) and logged.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from attrs import define, field

from umt_sdk import _check as check
from umt_sdk import _serde
from umt_sdk._concurrency import key_fields
from umt_sdk._definition import TaskDefinition
from umt_sdk._event_spi import EventStore, NewEvent, StoredEvent
from umt_sdk._insight import store_now
from umt_sdk._rate_limits import ensure_defined, rate_limit_fields
from umt_sdk._spi import Backend, BatchEnqueueStore, EnqueueResult, NewRun
from umt_sdk.exceptions import PayloadError, UsageError

__all__ = [
    "DEFAULT_EVENT_WINDOW",
    "EVENT_KEY_PREFIX",
    "EventStarter",
    "check_event_name",
    "event_run",
    "event_store",
    "subscribers",
]

_log = logging.getLogger("umt.events")

EVENT_KEY_PREFIX = "umt.event:"
"""The idempotency-key prefix of the runs events start: `umt.event:<event id>`."""

DEFAULT_EVENT_WINDOW = timedelta(hours=24)
"""How long an event waits for subscribers registered after its publish."""

LATE_COMMIT = timedelta(minutes=10)
"""How late after its publish time an event may commit and still be found by the passes after
a worker's first (which reads the whole window): a publish whose transaction stays open
longer is found by the next worker that starts."""

MAX_EVENT_NAME_LENGTH = 200
_EVENT_NAME = re.compile(r"^[A-Za-z0-9._:\-]+$")
_BATCH = 200


def check_event_name(
    name: object, argument: str, *, where: str, error: type[UsageError] = UsageError
) -> str:
    """An event name: 1 to 200 of `[A-Za-z0-9._:-]`, else `error` naming `argument`."""
    if (
        not isinstance(name, str)
        or not _EVENT_NAME.fullmatch(name)
        or len(name) > MAX_EVENT_NAME_LENGTH
    ):
        raise error(
            f"{where}: {argument} must be an event name of 1 to {MAX_EVENT_NAME_LENGTH} "
            f"letters, digits and '._:-' (such as 'order.placed'), got {name!r}",
            argument=argument,
        )
    return name


def event_store(backend: Backend, what: str) -> EventStore:
    """The backend as an event store, or `UsageError` saying it stores no events."""
    if not isinstance(backend, EventStore):
        raise UsageError(
            f"{what}: the {type(backend).__name__} backend does not store events",
            argument="backend",
        )
    return backend


def subscribers(
    registry: Iterable[TaskDefinition[Any, Any]], name: str
) -> list[TaskDefinition[Any, Any]]:
    """Per task name, the newest registered version that subscribes to `name`."""
    newest: dict[str, TaskDefinition[Any, Any]] = {}
    for definition in registry:
        if definition.on_event != name:
            continue
        found = newest.get(definition.name)
        if found is None or found.version < definition.version:
            newest[definition.name] = definition
    return [newest[task_name] for task_name in sorted(newest)]


def event_run(
    definition: TaskDefinition[Any, Any],
    *,
    event_id: UUID,
    event_name: str,
    payload_json: str,
    trace_context: dict[str, str],
    run_id: UUID,
) -> NewRun:
    """The run an event starts for `definition`: `PayloadError` if its input type refuses
    the payload, `UsageError` if its concurrency or rate-limit key function does."""
    input_json, input_hash = _serde.encode_input(
        json.loads(payload_json),
        definition.input_type,
        what=f"payload of event {event_name!r} as the input of task {definition.name!r}",
    )
    fields = {
        "task_name": definition.name,
        "input_type": definition.input_type,
        "input_json": input_json,
    }
    return NewRun(
        run_id=run_id,
        task_name=definition.name,
        task_version=definition.version,
        input_json=input_json,
        input_hash=input_hash,
        idempotency_key=f"{EVENT_KEY_PREFIX}{event_id}",
        trace_context=trace_context,
        **key_fields(definition.concurrency, **fields),
        **rate_limit_fields(definition.rate_limit, **fields),
        deadline_at=None,
        timeout=definition.timeout,
    )


def new_event(
    *, event_id: UUID, name: str, key: str, payload_json: str, trace_context: dict[str, str]
) -> NewEvent:
    return NewEvent(
        event_id=event_id,
        name=name,
        key=key,
        payload_json=payload_json,
        payload_hash=_serde.input_hash(payload_json),
        trace_context=trace_context,
    )


@define(eq=False, kw_only=True)
class EventStarter:
    """Starts the events of the window that the subscribers a worker serves have no run for,
    and deletes the events older than the window. Every worker runs it; the runs' keys make
    one run per (event, task) whoever starts it, and a worker killed midway leaves the rest to
    the next pass.

    A worker's first pass for a subscriber reads the whole window; the next ones read only
    the events published since the last complete pass began, less `LATE_COMMIT`: an event is
    stamped when its transaction begins and seen when it commits."""

    backend: Backend
    registry: Iterable[TaskDefinition[Any, Any]]
    task_names: frozenset[str]
    window: timedelta
    new_run_id: Any
    covered: dict[str, datetime] = field(factory=dict)
    """Per task name: when this starter's last complete pass for it began."""

    async def run_pass(self) -> dict[str, int]:
        store = event_store(self.backend, "event subscribers")
        now = store_now(self.backend)
        since = now - self.window
        started = refused = 0
        names = {
            d.on_event
            for d in self.registry
            if d.on_event is not None and d.name in self.task_names
        }
        for name in sorted(names):
            for definition in subscribers(self.registry, name):
                if definition.name not in self.task_names:
                    continue
                if definition.rate_limit is not None:
                    await ensure_defined(self.backend, definition.rate_limit, "event subscribers")
                covered = self.covered.get(definition.name)
                start_at = since if covered is None else max(since, covered - LATE_COMMIT)
                while True:
                    events = await store.events_to_start(
                        name=name, task_name=definition.name, since=start_at, limit=_BATCH
                    )
                    news: list[NewRun] = []
                    for event in events:
                        new = self._run_for(definition, event)
                        if isinstance(new, str):
                            await store.refuse_event(
                                event_id=event.event_id,
                                task_name=definition.name,
                                task_version=definition.version,
                                reason=new,
                            )
                            refused += 1
                            _log.warning(
                                "event %r (key %r) not started for task %s@%d: %s",
                                event.name,
                                event.key,
                                definition.name,
                                definition.version,
                                new,
                            )
                        else:
                            news.append(new)
                    results = await self._store(news)
                    started += sum(1 for r in results if r.created)
                    if len(events) < _BATCH:
                        break
                self.covered[definition.name] = now
        expired = 0
        while True:
            count = await store.expire_events(before=since, limit=_BATCH)
            expired += count
            if count < _BATCH:
                break
        return {"started": started, "refused": refused, "expired": expired}

    def _run_for(self, definition: TaskDefinition[Any, Any], event: StoredEvent) -> NewRun | str:
        try:
            return event_run(
                definition,
                event_id=event.event_id,
                event_name=event.name,
                payload_json=event.payload_json,
                trace_context=dict(event.trace_context),
                run_id=self.new_run_id(),
            )
        except (PayloadError, UsageError) as exc:  # its type, or its key functions, refuse it
            return str(exc)

    async def _store(self, news: Sequence[NewRun]) -> Sequence[EnqueueResult]:
        if not news:
            return ()
        if isinstance(self.backend, BatchEnqueueStore):
            return await self.backend.enqueue_many(news)
        return [await self.backend.enqueue(new) for new in news]


def check_window(value: object, argument: str) -> timedelta:
    check.duration(
        value,
        argument,
        positive=True,
        expected="a timedelta > 0 such as timedelta(hours=24)",
    )
    assert isinstance(value, timedelta)
    return value
