"""Group commit of step checkpoints: those that arrive while one is written share the next."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any
from uuid import UUID

from umt_backend_pg._rows import _error_json
from umt_sdk.backend import Lease, StepRecord
from umt_sdk.exceptions import BackendError, BackendUnavailableError, FencingError

__all__ = ["Checkpoints"]

_CHECKPOINT_BATCH = 256


def _checkpoint_failed(
    item: tuple[Lease, StepRecord, asyncio.Future[bool]], exc: Exception
) -> None:
    """Hand a checkpoint's own failure to its writer: umt's own errors as they are (a
    FencingError stays one, not a BackendError that may be retried), anything else as a
    BackendError (text psycopg cannot encode raises UnicodeEncodeError, which must not escape
    the backend)."""
    _, step, future = item
    if future.done():
        return
    if not isinstance(exc, BackendError | FencingError):
        error = BackendError(f"cannot store step {step.name!r}: {exc}")
        error.__cause__ = exc
        exc = error
    future.set_exception(exc)


class Checkpoints:
    """The step checkpoints of one backend, written in batches through `all_rows` (a query
    of the backend's pool by name: one statement, one commit per batch)."""

    def __init__(
        self, all_rows: Callable[[str, Mapping[str, Any]], Awaitable[list[dict[str, Any]]]]
    ) -> None:
        self._all = all_rows
        self._checkpoints: list[tuple[Lease, StepRecord, asyncio.Future[bool]]] = []
        self._flushing = False
        self._flusher: asyncio.Task[None] | None = None

    async def record(self, lease: Lease, step: StepRecord) -> bool:
        """Store `step` with the next batch; False if `lease` no longer holds the run."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._checkpoints.append((lease, step, future))
        if not self._flushing:
            self._flushing = True
            self._flusher = asyncio.create_task(
                self._flush_checkpoints(), name="umt-pg-checkpoints"
            )
        return await future

    async def _flush_checkpoints(self) -> None:
        try:
            while self._checkpoints:
                batch = self._checkpoints[:_CHECKPOINT_BATCH]
                del self._checkpoints[:_CHECKPOINT_BATCH]
                try:
                    accepted = await self._write_checkpoints(batch)
                except BackendUnavailableError as exc:  # the connection is gone: all stop
                    for _, _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                except Exception as exc:
                    if len(batch) == 1:
                        _checkpoint_failed(batch[0], exc)
                    else:
                        # One member's data can fail the shared statement (a value Postgres
                        # cannot store): write each alone, so that only its own writer gets the
                        # error and no other run is failed or charged for it.
                        await self._write_checkpoints_one_by_one(batch)
                    continue
                for lease, step, future in batch:
                    if not future.done():
                        future.set_result((lease.run_id, step.name, step.attempt) in accepted)
        finally:
            self._flushing = False

    async def _write_checkpoints_one_by_one(
        self, batch: Sequence[tuple[Lease, StepRecord, asyncio.Future[bool]]]
    ) -> None:
        for item in batch:
            lease, step, future = item
            if future.done():  # its writer is gone (canceled)
                continue
            try:
                accepted = await self._write_checkpoints([item])
            except Exception as exc:
                _checkpoint_failed(item, exc)
                continue
            if not future.done():
                future.set_result((lease.run_id, step.name, step.attempt) in accepted)

    async def _write_checkpoints(
        self, batch: Sequence[tuple[Lease, StepRecord, asyncio.Future[bool]]]
    ) -> set[tuple[UUID, str, int]]:
        rows = await self._all(
            "record_steps",
            {
                "run_ids": [lease.run_id for lease, _, _ in batch],
                "tokens": [lease.fencing_token for lease, _, _ in batch],
                "leases": [lease.duration for lease, _, _ in batch],
                "names": [step.name for _, step, _ in batch],
                "attempts": [step.attempt for _, step, _ in batch],
                "kinds": [step.kind for _, step, _ in batch],
                "statuses": [step.status for _, step, _ in batch],
                "outputs": [step.output_json for _, step, _ in batch],
                "errors": [_error_json(step.error) for _, step, _ in batch],
                "started": [step.started_at for _, step, _ in batch],
                "finished": [step.finished_at for _, step, _ in batch],
                "wakes": [step.wake_at for _, step, _ in batch],
            },
        )
        return {(r["run_id"], r["name"], r["attempt"]) for r in rows}

    async def close(self) -> None:
        """Let the checkpoints already handed over be written."""
        if self._flusher is not None:
            with contextlib.suppress(Exception):
                await self._flusher
