"""A synchronous facade over the engine, for sync web apps and scripts."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable
from datetime import datetime, timedelta
from typing import Any, TypeVar
from uuid import UUID

from umt_sdk._engine import Engine, connect
from umt_sdk._export import RunHistory
from umt_sdk._spi import CancelOutcome, Clock, RunStatus
from umt_sdk._task import Registry, TaskDefinition
from umt_sdk._views import RunInfo, RunPage

__all__ = ["SyncEngine", "connect_sync"]

T = TypeVar("T")


class SyncEngine:
    """enqueue / signal / cancel / get / list / result, blocking. Runs its own event loop in a
    background thread; close it (or use `with`) when done."""

    def __init__(
        self, engine: Engine, loop: asyncio.AbstractEventLoop, thread: threading.Thread
    ) -> None:
        self._engine = engine
        self._loop = loop
        self._thread = thread

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
        deadline: datetime | timedelta | None = None,
        start_within: timedelta | None = None,
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
                deadline=deadline,
                start_within=start_within,
            )
        )
        return handle.run_id

    def signal(self, run_id: UUID, name: str, payload: Any = None) -> bool:
        return self._call(self._engine.signal(run_id, name, payload))

    def broadcast(self, name: str, payload: Any = None) -> bool:
        return self._call(self._engine.broadcast(name, payload))

    def cancel(self, run_id: UUID, *, reason: str = "") -> CancelOutcome:
        return self._call(self._engine.cancel(run_id, reason=reason))

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
    ) -> RunPage:
        return self._call(
            self._engine.list(
                task_name=task_name,
                version=version,
                status=status,
                parent=parent,
                limit=limit,
                before=before,
            )
        )

    def result(self, run_id: UUID, *, timeout: float | None = None) -> Any:
        return self._call(self._engine.result(run_id, timeout=timeout))

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
