"""The memory backend's event store (`umt_sdk.backend.EventStore`): events by (name, key),
their refusals, and the runs a publish starts, all under the backend's one lock."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

from umt_sdk.backend import (
    Clock,
    EnqueueResult,
    EventRefusal,
    EventRun,
    NewEvent,
    NewRun,
    PublishOutcome,
    StoredEvent,
)
from umt_sdk.exceptions import UsageError

__all__ = ["MemoryEvents"]

_EVENT_KEY_PREFIX = "umt.event:"


class MemoryEvents:
    """Mixed into `MemoryBackend`: it provides the lock, the clock, the runs' keys and the
    enqueue under the lock."""

    clock: Clock
    _lock: threading.RLock
    _by_key: dict[tuple[str, str], UUID]
    _tombstone_keys: dict[tuple[str, str], UUID]
    _enqueue_locked: Callable[..., EnqueueResult]
    _storable_runs: Callable[[Sequence[NewRun]], None]
    _events: dict[UUID, StoredEvent]
    _event_keys: dict[tuple[str, str], UUID]
    _event_hashes: dict[UUID, str]
    _event_refusals: dict[tuple[UUID, str], EventRefusal]
    _runs: dict[UUID, Any]

    def _reset_events(self) -> None:
        self._events = {}
        self._event_keys = {}
        self._event_hashes = {}
        self._event_refusals = {}

    async def publish_event(
        self, event: NewEvent, runs: Sequence[NewRun], *, conn: Any = None
    ) -> PublishOutcome:
        if conn is not None:
            raise UsageError(
                "the memory backend has no transactions to join; publish without conn=",
                argument="conn",
            )
        self._storable_runs(runs)
        with self._lock:
            events, by_name_key, hashes = self._events, self._event_keys, self._event_hashes
            found = by_name_key.get((event.name, event.key))
            if found is not None:
                return PublishOutcome(event_id=found, created=False, payload_hash=hashes[found])
            events[event.event_id] = StoredEvent(
                event_id=event.event_id,
                name=event.name,
                key=event.key,
                payload_json=event.payload_json,
                published_at=self.clock.now(),
                trace_context=dict(event.trace_context),
            )
            by_name_key[(event.name, event.key)] = event.event_id
            hashes[event.event_id] = event.payload_hash
            results = [self._enqueue_locked(new, None) for new in runs]
            return PublishOutcome(
                event_id=event.event_id,
                created=True,
                payload_hash=event.payload_hash,
                runs=results,
            )

    async def events_to_start(
        self, *, name: str, task_name: str, since: datetime, limit: int
    ) -> Sequence[StoredEvent]:
        with self._lock:
            events, refusals = self._events, self._event_refusals
            found = []
            for event in sorted(events.values(), key=lambda e: (e.published_at, e.event_id)):
                if event.name != name or event.published_at < since:
                    continue
                key = (task_name, f"{_EVENT_KEY_PREFIX}{event.event_id}")
                if key in self._by_key or key in self._tombstone_keys:
                    continue
                if (event.event_id, task_name) in refusals:
                    continue
                found.append(event)
                if len(found) == limit:
                    break
            return found

    async def refuse_event(
        self, *, event_id: UUID, task_name: str, task_version: int, reason: str
    ) -> None:
        with self._lock:
            events, refusals = self._events, self._event_refusals
            event = events.get(event_id)
            if event is None or (event_id, task_name) in refusals:
                return
            refusals[(event_id, task_name)] = EventRefusal(
                event_id=event_id,
                event_name=event.name,
                event_key=event.key,
                task_name=task_name,
                task_version=task_version,
                reason=reason,
                refused_at=self.clock.now(),
            )

    async def event_refusals(self, *, limit: int) -> Sequence[EventRefusal]:
        with self._lock:
            refusals = self._event_refusals
            newest = sorted(refusals.values(), key=lambda r: r.refused_at, reverse=True)
            return newest[:limit]

    async def expire_events(self, *, before: datetime, limit: int) -> int:
        with self._lock:
            events, by_name_key = self._events, self._event_keys
            refusals, hashes = self._event_refusals, self._event_hashes
            old = sorted(
                (e for e in events.values() if e.published_at < before),
                key=lambda e: e.published_at,
            )[:limit]
            for event in old:
                del events[event.event_id]
                del by_name_key[(event.name, event.key)]
                del hashes[event.event_id]
                for pair in [p for p in refusals if p[0] == event.event_id]:
                    del refusals[pair]
            return len(old)

    async def list_events(
        self, *, name: str | None, before: UUID | None, limit: int
    ) -> Sequence[StoredEvent]:
        with self._lock:
            newest = sorted(
                (e for e in self._events.values() if name is None or e.name == name),
                key=lambda e: (e.published_at, e.event_id),
                reverse=True,
            )
            cursor = self._events.get(before) if before is not None else None
            if cursor is not None:
                mark = (cursor.published_at, cursor.event_id)
                newest = [e for e in newest if (e.published_at, e.event_id) < mark]
            return newest[:limit]

    async def event_runs(self, *, event_ids: Sequence[UUID]) -> Sequence[EventRun]:
        wanted = {f"{_EVENT_KEY_PREFIX}{event_id}": event_id for event_id in event_ids}
        with self._lock:
            found = []
            for (_, key), run_id in self._by_key.items():
                event_id = wanted.get(key)
                run = self._runs.get(run_id)
                if event_id is None or run is None:
                    continue
                found.append(
                    EventRun(
                        event_id=event_id,
                        run_id=run_id,
                        task_name=run.task_name,
                        task_version=run.task_version,
                        status=run.status,
                    )
                )
            return found

    def events(self) -> list[StoredEvent]:
        """Every stored event, oldest first (for tests)."""
        with self._lock:
            return sorted(self._events.values(), key=lambda e: (e.published_at, e.event_id))
