"""A synchronous facade over the engine, for sync web apps and scripts."""

from __future__ import annotations

import asyncio
import builtins
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar
from uuid import UUID

from umt_sdk._attention import Settlement
from umt_sdk._engine import Engine, connect
from umt_sdk._event_list import EventInfo
from umt_sdk._export import RunHistory
from umt_sdk._flow_keys import Debounce, Singleton
from umt_sdk._rate_limits import RateLimit, RateLimits
from umt_sdk._retention import DEFAULT_BATCH_SIZE, PruneReport
from umt_sdk._spi import CancelOutcome, Clock, PausedTask, RateLimitInfo, RunStatus, TaskPair
from umt_sdk._streams import StreamItem
from umt_sdk._task import Registry, TaskDefinition
from umt_sdk._views import RunInfo, RunPage

__all__ = ["SyncEngine", "SyncRateLimits", "connect_sync"]

T = TypeVar("T")


class SyncRateLimits:
    """`sync_engine.rate_limits`: `Engine.rate_limits` (`RateLimits`), blocking."""

    def __init__(
        self, rate_limits: RateLimits, call: Callable[[Coroutine[Any, Any, Any]], Any]
    ) -> None:
        self._rate_limits = rate_limits
        self._call = call

    def set(
        self,
        name: str | RateLimit[Any],
        *,
        limit: int | None = None,
        per: timedelta | None = None,
    ) -> RateLimitInfo:
        """Store a limit, or change a stored one (see `RateLimits.set`)."""
        info: RateLimitInfo = self._call(self._rate_limits.set(name, limit=limit, per=per))
        return info

    def get(self, name: str) -> RateLimitInfo | None:
        """The stored limit of that name, or None (see `RateLimits.get`)."""
        info: RateLimitInfo | None = self._call(self._rate_limits.get(name))
        return info

    def list(self) -> builtins.list[RateLimitInfo]:
        """Every stored limit, by name (see `RateLimits.list`)."""
        infos: builtins.list[RateLimitInfo] = self._call(self._rate_limits.list())
        return infos

    def pause(self, name: str) -> bool:
        """Pause a limit (see `RateLimits.pause`); False when it was paused already."""
        changed: bool = self._call(self._rate_limits.pause(name))
        return changed

    def resume(self, name: str) -> bool:
        """Resume a paused limit (see `RateLimits.resume`); False when it was not paused."""
        changed: bool = self._call(self._rate_limits.resume(name))
        return changed


class SyncEngine:
    """enqueue / enqueue_many / signal / cancel / pause / resume / rerun / fork / get / list /
    result / stream / rate_limits, blocking. Runs its own event loop in a background thread;
    close it (or use `with`) when done."""

    def __init__(
        self, engine: Engine, loop: asyncio.AbstractEventLoop, thread: threading.Thread
    ) -> None:
        self._engine = engine
        self._loop = loop
        self._thread = thread
        self.rate_limits = SyncRateLimits(engine.rate_limits, self._call)
        """Set, read, list, pause and resume the stored rate limits, blocking (see
        `Engine.rate_limits`)."""

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()  # never run: close it so it is not reported as never awaited
            raise RuntimeError("this SyncEngine is closed; open a new one with connect_sync()")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def engine(self) -> Engine:
        """The async engine underneath (use it only from the facade's loop)."""
        return self._engine

    def enqueue(
        self,
        task: TaskDefinition[Any, Any] | str,
        input: Any,
        *,
        idempotency_key: str | None = None,
        priority: int = 0,
        delay: timedelta | None = None,
        version: int | None = None,
        tags: Mapping[str, str] | None = None,
        deadline: datetime | timedelta | None = None,
        start_within: timedelta | None = None,
        singleton: Singleton | None = None,
        debounce: Debounce | None = None,
        sequence: str | None = None,
        fairness_key: str | None = None,
        weight: int | None = None,
    ) -> UUID:
        """Enqueue (see `Engine.enqueue`) and return the run id."""
        handle = self._call(
            self._engine.enqueue(
                task,
                input,
                idempotency_key=idempotency_key,
                priority=priority,
                delay=delay,
                version=version,
                tags=tags,
                deadline=deadline,
                start_within=start_within,
                singleton=singleton,
                debounce=debounce,
                sequence=sequence,
                fairness_key=fairness_key,
                weight=weight,
            )
        )
        return handle.run_id

    def enqueue_many(
        self,
        task: TaskDefinition[Any, Any] | str,
        inputs: Iterable[Any],
        *,
        idempotency_keys: Sequence[str | None] | None = None,
        priority: int = 0,
        delay: timedelta | None = None,
        version: int | None = None,
        tags: Mapping[str, str] | None = None,
        deadline: datetime | timedelta | None = None,
        start_within: timedelta | None = None,
        singleton: Singleton | Sequence[Singleton | None] | None = None,
        debounce: Debounce | Sequence[Debounce | None] | None = None,
        sequence: str | Sequence[str | None] | None = None,
        fairness_key: str | Sequence[str | None] | None = None,
        weight: int | Sequence[int | None] | None = None,
    ) -> list[UUID]:
        """Enqueue many runs in one write (see `Engine.enqueue_many`) and return their ids,
        one per input, in order."""
        handles = self._call(
            self._engine.enqueue_many(
                task,
                inputs,
                idempotency_keys=idempotency_keys,
                priority=priority,
                delay=delay,
                version=version,
                tags=tags,
                deadline=deadline,
                start_within=start_within,
                singleton=singleton,
                debounce=debounce,
                sequence=sequence,
                fairness_key=fairness_key,
                weight=weight,
            )
        )
        return [handle.run_id for handle in handles]

    def publish(self, name: str, payload: Any = None, *, key: str | None = None) -> UUID:
        """Publish an event (see `Engine.publish`) and return its id (a repeat's: the stored
        event's)."""
        return self._call(self._engine.publish(name, payload, key=key)).event_id

    def events(
        self, *, name: str | None = None, before: UUID | None = None, limit: int = 50
    ) -> list[EventInfo]:
        """The stored events, newest first, each with the runs it started (see
        `Engine.events`)."""
        return self._call(self._engine.events(name=name, before=before, limit=limit))

    def signal(self, run_id: UUID, name: str, payload: Any = None) -> bool:
        return self._call(self._engine.signal(run_id, name, payload))

    def complete_callback(self, token: str, payload: Any = None) -> None:
        self._call(self._engine.complete_callback(token, payload))

    def settle(
        self,
        run_id: UUID,
        *,
        step: str,
        done: bool,
        output: Any = None,
        by: str | None = None,
    ) -> Settlement:
        """Settle the step of a run in `needs_attention` (see `Engine.settle`)."""
        return self._call(self._engine.settle(run_id, step=step, done=done, output=output, by=by))

    def update(
        self, run_id: UUID, name: str, arg: Any = None, *, timeout: float | None = None
    ) -> Any:
        """Send the run an update and wait for its result (see `Engine.update`)."""
        return self._call(self._engine.update(run_id, name, arg, timeout=timeout))

    def query(self, run_id: UUID, name: str) -> Any:
        """The answer of the run's query `name` (see `Engine.query`)."""
        return self._call(self._engine.query(run_id, name))

    def update_with_start(
        self,
        task: TaskDefinition[Any, Any] | str,
        input: Any,
        *,
        key: str,
        update: str,
        arg: Any = None,
        version: int | None = None,
        timeout: float | None = None,
    ) -> tuple[UUID, Any]:
        """Start the key's run unless it exists, then update it (see
        `Engine.update_with_start`); returns the run's id and the update's result."""
        handle, result = self._call(
            self._engine.update_with_start(
                task, input, key=key, update=update, arg=arg, version=version, timeout=timeout
            )
        )
        return handle.run_id, result

    def broadcast(self, name: str, payload: Any = None) -> bool:
        return self._call(self._engine.broadcast(name, payload))

    def cancel(self, run_id: UUID, *, reason: str = "") -> CancelOutcome:
        return self._call(self._engine.cancel(run_id, reason=reason))

    def pause(self, task: str | TaskPair) -> bool:
        """Pause a task (see `Engine.pause`)."""
        return self._call(self._engine.pause(task))

    def resume(self, task: str | TaskPair) -> bool:
        """Resume a paused task (see `Engine.resume`)."""
        return self._call(self._engine.resume(task))

    def paused(self) -> list[PausedTask]:
        """The stored pauses (see `Engine.paused`)."""
        return self._call(self._engine.paused())

    def rerun(self, run_id: UUID, *, version: int | None = None) -> UUID:
        """Start a finished run again (see `Engine.rerun`) and return the new run's id."""
        return self._call(self._engine.rerun(run_id, version=version)).run_id

    def fork(self, run_id: UUID, from_step: str, *, version: int | None = None) -> UUID:
        """Fork a finished run from a step (see `Engine.fork`) and return the new run's id."""
        return self._call(self._engine.fork(run_id, from_step, version=version)).run_id

    def get(self, run_id: UUID) -> RunInfo:
        return self._call(self._engine.get(run_id))

    def export_history(self, run_id: UUID) -> RunHistory:
        return self._call(self._engine.export_history(run_id))

    def list(
        self,
        *,
        task_name: str | None = None,
        version: int | None = None,
        status: RunStatus | None = None,
        parent: UUID | None = None,
        limit: int = 100,
        before: UUID | None = None,
        idempotency_key: str | None = None,
        tags: Mapping[str, str] | None = None,
        created_after: datetime | None = None,
        created_before: datetime | None = None,
        finished_after: datetime | None = None,
        finished_before: datetime | None = None,
    ) -> RunPage:
        return self._call(
            self._engine.list(
                task_name=task_name,
                version=version,
                status=status,
                parent=parent,
                limit=limit,
                before=before,
                idempotency_key=idempotency_key,
                tags=tags,
                created_after=created_after,
                created_before=created_before,
                finished_after=finished_after,
                finished_before=finished_before,
            )
        )

    def prune(
        self,
        *,
        older_than: timedelta,
        task: str | Sequence[str] | None = None,
        dry_run: bool = False,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> PruneReport:
        """Delete old finished runs now (see `Engine.prune`)."""
        return self._call(
            self._engine.prune(
                older_than=older_than, task=task, dry_run=dry_run, batch_size=batch_size
            )
        )

    def result(self, run_id: UUID, *, timeout: float | None = None) -> Any:
        return self._call(self._engine.result(run_id, timeout=timeout))

    def stream(
        self,
        run_id: UUID,
        name: str,
        *,
        since: int = 0,
        follow: bool = True,
        value_type: Any = Any,
    ) -> Iterator[StreamItem]:
        """The values of the run's stream `name`, in order, following it live until the run
        ends (see `Engine.stream`): `for item in engine.stream(run_id, "progress"): ...`."""
        items = self._engine.stream(run_id, name, since=since, follow=follow, value_type=value_type)
        try:
            while True:
                try:
                    item = self._call(anext(items))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if not self._loop.is_closed():
                self._call(items.aclose())

    def stream_last(self, run_id: UUID, name: str, *, value_type: Any = Any) -> StreamItem | None:
        """The newest value of the run's stream `name`, or None (see `Engine.stream_last`)."""
        return self._call(self._engine.stream_last(run_id, name, value_type=value_type))

    def stream_heads(
        self, run_ids: Sequence[UUID], *, name: str | None = None
    ) -> Mapping[UUID, Mapping[str, StreamItem]]:
        """The newest value of each stream of these runs (see `Engine.stream_heads`)."""
        return self._call(self._engine.stream_heads(run_ids, name=name))

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._engine.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


def connect_sync(
    url: str,
    *,
    registry: Registry | None = None,
    clock: Clock | None = None,
    plugins: Iterable[object] = (),
    **options: Any,
) -> SyncEngine:
    """Like `connect`, for synchronous code."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="umt-sync-engine", daemon=True)
    thread.start()
    try:
        engine = asyncio.run_coroutine_threadsafe(
            connect(url, registry=registry, clock=clock, plugins=plugins, **options), loop
        ).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
        raise
    return SyncEngine(engine, loop, thread)
