"""Transactional steps on Postgres: the step body's writes and its checkpoint in one transaction.

The transaction runs on a pool of its own (opened at the first transactional step, as large
as the engine's pool), so a long transaction never holds a connection that a heartbeat, a
claim or a checkpoint waits for. It is READ COMMITTED: the fence at the commit must read the
run row as it is then, not as a snapshot taken when the body began (see
`step_transaction_record` in sql/step_transactions.sql).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from umt_backend_pg._errors import _unreachable, fenced, wrap_exceptions
from umt_backend_pg._rows import _error_json
from umt_backend_pg._sql import blocks, render
from umt_sdk.backend import Lease, StepRecord
from umt_sdk.exceptions import (
    BackendUnavailableError,
    FencingError,
    TransactionConflictError,
)

__all__ = ["StepTransactions"]

_CONFLICTS = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)


class StepTransactions:
    """The transactions of transactional steps of one backend (`run`), on the pool that
    `open_pool` makes when the first one comes."""

    def __init__(
        self,
        open_pool: Callable[[], Awaitable[AsyncConnectionPool[Any]]],
        *,
        schema: str,
        still_held: Callable[[Mapping[str, Any]], Awaitable[bool]],
        owns_pool: bool = True,
    ) -> None:
        """`still_held(params)`: whether the run is held under the token, read through the
        engine's pool (after a body failed, its own transaction is gone); `owns_pool`: the
        pool `open_pool` gives is closed with this."""
        self._open_pool = open_pool
        self._owns_pool = owns_pool
        self._pool: AsyncConnectionPool[Any] | None = None
        self._q = {
            name: render(text, schema) for name, text in blocks("step_transactions.sql").items()
        }
        self._still_held = still_held

    async def _connections(self) -> AsyncConnectionPool[Any]:
        if self._pool is None:
            self._pool = await self._open_pool()
        return self._pool

    async def run(self, lease: Lease, body: Callable[[Any], Awaitable[StepRecord]]) -> None:
        """`TransactionStore.run_step_transaction` (see the SPI for the rules)."""
        fence = {"run_id": lease.run_id, "token": lease.fencing_token}
        what = "a transactional step"
        in_body = False
        try:
            with wrap_exceptions():
                pool = await self._connections()
            async with pool.connection() as conn:
                # Whatever the server's default: the fence at the commit must see the run
                # row as it is then (client-side: sent with the BEGIN).
                await conn.set_isolation_level(psycopg.IsolationLevel.READ_COMMITTED)
                async with conn.transaction():
                    cur = await conn.execute(self._q["step_transaction_fence"], fence)
                    if await cur.fetchone() is None:
                        raise fenced(lease, f"beginning {what}")
                    in_body = True
                    step = await body(conn)
                    in_body = False
                    what = f"recording step {step.name!r}"
                    cur = await conn.execute(
                        self._q["step_transaction_record"],
                        {
                            **fence,
                            "lease": lease.duration,
                            "name": step.name,
                            "attempt": step.attempt,
                            "kind": step.kind,
                            "status": step.status,
                            "output": step.output_json,
                            "error": _error_json(step.error),
                            "started": step.started_at,
                            "finished": step.finished_at,
                            "wake": step.wake_at,
                        },
                    )
                    if await cur.fetchone() is None:
                        raise fenced(lease, what)  # rolls the body's writes back with it
        except FencingError:
            raise
        except _CONFLICTS as exc:
            raise TransactionConflictError(
                f"{what}: the transaction conflicted with a concurrent one ({exc.sqlstate}: "
                f"{exc.diag.message_primary}); nothing of it was stored",
                sqlstate=exc.sqlstate or "",
            ) from exc
        except psycopg.OperationalError as exc:
            if _unreachable(exc):  # whether the commit landed is unknown: the SDK stops
                raise BackendUnavailableError(f"database unavailable: {exc}") from exc
            if in_body:
                await self._raise_if_stale(lease, fence, exc)
                raise
            with wrap_exceptions():
                raise
        except Exception as exc:
            if in_body:  # the body's own error: the step's failure, unless it is stale now
                await self._raise_if_stale(lease, fence, exc)
                raise
            with wrap_exceptions():
                raise

    async def _raise_if_stale(
        self, lease: Lease, fence: Mapping[str, Any], exc: BaseException
    ) -> None:
        try:
            held = await self._still_held(fence)
        except Exception:  # cannot tell (the database is gone): report the body's error
            return
        if not held:
            raise fenced(lease, "a transactional step whose body failed") from exc

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None and self._owns_pool:
            await pool.close()
