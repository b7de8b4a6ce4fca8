"""The Postgres backend: the SPI over psycopg 3 with a pool, LISTEN/NOTIFY and named SQL.

Round trips (each one statement and one commit unless noted):
- enqueue: 1 (the insert and its NOTIFY in one statement; +1 on an idempotency hit, to read
  the existing run);
- claim: 1 for up to N runs, including their step records for replay (committed without
  waiting for the WAL flush: a claim lost in a server crash is caught by fencing);
- step checkpoint: 1 (insert the record if the token holds, extend the lease);
- park on a sleep or a retry: 1; park on a fact: 1 (lock + park, pipelined in a transaction);
- signal: 1 (lock + insert + wake-up + NOTIFY, pipelined in a transaction);
- complete / fail / cancel-finish / release: 1;
- heartbeat: 1 per worker per interval, for every run it holds (also without the flush wait).
A 1-step run therefore costs 4 server transactions: enqueue, claim, checkpoint, complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from umt_backend_pg._errors import wrap_exceptions
from umt_backend_pg._migrate import migrate
from umt_backend_pg._sql import queries, render, validate_schema
from umt_sdk.backend import (
    Beat,
    CancelOutcome,
    ClaimedRun,
    Clock,
    Ending,
    EndResult,
    EnqueueResult,
    ErrorInfo,
    ExecutionRecord,
    Fact,
    HeartbeatResult,
    Lease,
    LedgerEntry,
    NewRun,
    RunQuery,
    RunRecord,
    StepRecord,
    TaskPair,
)
from umt_sdk.exceptions import (
    BackendError,
    BackendUnavailableError,
    FencingError,
    IdempotencyConflictError,
    RunNotFoundError,
)

__all__ = ["PostgresBackend", "PostgresLedger"]

_log = logging.getLogger("umt.pg")
_CHECKPOINT_BATCH = 256
_LISTEN_CHECK = 10.0
"""Seconds without a notification after which the LISTEN connection is pinged."""
_KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5}


def _error_json(error: ErrorInfo | None) -> str | None:
    if error is None:
        return None
    return json.dumps({"type": error.type, "message": error.message, "traceback": error.traceback})


def _error(value: Any) -> ErrorInfo | None:
    if not value:
        return None
    return ErrorInfo(
        type=str(value.get("type", "")),
        message=str(value.get("message", "")),
        traceback=str(value.get("traceback", "")),
    )


def _step(row: Mapping[str, Any], output_json: str | None) -> StepRecord:
    return StepRecord(
        name=row["name"],
        kind=row["kind"],
        status=row["status"],
        attempt=row["attempt"],
        fencing_token=row["fencing_token"],
        output_json=output_json,
        error=_error(row["error"]),
        started_at=_ts(row["started_at"]),
        finished_at=_ts(row["finished_at"]),
        wake_at=_ts(row["wake_at"]),
    )


def _checkpoint_failed(
    item: tuple[Lease, StepRecord, asyncio.Future[bool]], exc: Exception
) -> None:
    """Hand a checkpoint's own failure to its writer (as a BackendError: text psycopg cannot
    encode raises UnicodeEncodeError, which must not escape the backend)."""
    _, step, future = item
    if future.done():
        return
    if not isinstance(exc, BackendError):
        error = BackendError(f"cannot store step {step.name!r}: {exc}")
        error.__cause__ = exc
        exc = error
    future.set_exception(exc)


def _ts(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


class PostgresBackend:
    """Runs, steps, facts and the ledger in one Postgres schema. Open with `open()`."""

    clock: Clock | None = None

    def __init__(
        self, *, url: str, pool: AsyncConnectionPool[Any], schema: str, listen: bool
    ) -> None:
        self.url = url
        self.schema = schema
        self._pool = pool
        self._q = {name: render(text, schema) for name, text in queries().items()}
        self.work_channel = f"{schema}.work"
        self.cancel_channel = f"{schema}.cancel"
        self._listen = listen
        self._listener: asyncio.Task[None] | None = None
        self._work_waiters: list[tuple[frozenset[str], asyncio.Future[None]]] = []
        self._notified: dict[str, int] = {}
        self._seen: dict[frozenset[str], int] = {}
        self._wanted: frozenset[str] | None = None
        self._cancel_listeners: list[Callable[[UUID, str], None]] = []
        self._same_database: dict[tuple[str, int, str], bool] = {}
        self._ledger_checked: set[tuple[str, int, str]] = set()
        self._closed = False
        self._checkpoints: list[tuple[Lease, StepRecord, asyncio.Future[bool]]] = []
        self._flushing = False
        self._flusher: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        schema: str = "umt",
        run_migrations: bool = True,
        min_size: int = 1,
        max_size: int = 10,
        listen: bool = True,
    ) -> PostgresBackend:
        """Open a pool on `url`. With `listen=False` (poolers that cannot LISTEN) workers poll."""
        validate_schema(schema)
        if run_migrations:
            await migrate(url, schema=schema)
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            kwargs={"autocommit": True},
            open=False,
            name=f"umt-{schema}",
        )
        with wrap_exceptions():
            await pool.open(wait=True, timeout=30)
        backend = cls(url=url, pool=pool, schema=schema, listen=listen)
        if listen:
            backend._listener = asyncio.create_task(backend._listen_loop(), name="umt-pg-listen")
        return backend

    # -- notifications ----------------------------------------------------------------------------

    # Notifications are hints to look, never facts: any role that can connect to the database
    # can NOTIFY on our channels (no privilege is needed), and a payload can be anything up to
    # 8000 bytes. A work hint wakes a claim (which reads the runs table); a cancel hint makes
    # the worker heartbeat now (which reads the run's stored cancel state). Nothing a payload
    # says is acted on by itself, and a malformed one is dropped.

    async def _listen_loop(self) -> None:
        delay = 0.1
        lost_at: float | None = None
        while not self._closed:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, connect_timeout=10, **_KEEPALIVES
                ) as conn:
                    for channel in (self.work_channel, self.cancel_channel):
                        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    delay = 0.1
                    if lost_at is not None:
                        _log.warning(
                            "LISTEN connection back after %.1f s", time.monotonic() - lost_at
                        )
                        lost_at = None
                    self._wake_all()  # anything sent while we were away
                    while not self._closed:
                        async for note in conn.notifies(timeout=_LISTEN_CHECK):
                            self._on_note(note.channel, note.payload)
                        # Quiet for a while: make sure the connection is still there (a cut
                        # that sent no reset would otherwise leave us deaf for good).
                        await asyncio.wait_for(conn.execute(self._q["ping"]), _LISTEN_CHECK)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database went away: reconnect with backoff
                if self._closed:
                    return
                if lost_at is None:
                    lost_at = time.monotonic()
                    _log.warning(
                        "LISTEN connection lost (%s: %s); workers poll until it is back "
                        "(reconnecting with backoff up to 5 s)",
                        type(exc).__name__,
                        exc,
                    )
                else:
                    _log.debug("LISTEN reconnect failed (%s); again in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _on_note(self, channel: str, payload: str) -> None:
        try:
            if channel == self.work_channel:
                self._on_work(payload)
            elif channel == self.cancel_channel:
                self._on_cancel(payload)
        except Exception:  # a bad hint (or a listener's bug) must not cost us the LISTEN
            _log.exception("ignoring a notification on %s that could not be handled", channel)

    def _on_work(self, payload: str) -> None:
        # Only pairs some claim here asked for count: a payload full of made-up names must not
        # grow `_notified` without bound. An empty payload means "look, whatever the pair".
        wanted_pairs = self._wanted_pairs()
        named = payload.split(",") if payload else []
        pairs = {p for p in named if p in wanted_pairs}
        if named and not pairs:
            return  # about pairs nobody here serves
        for pair in pairs or {"*"}:
            self._notified[pair] = self._notified.get(pair, 0) + 1
        remaining = []
        for wanted, future in self._work_waiters:
            if not pairs or wanted & pairs:
                if not future.done():
                    future.set_result(None)
            else:
                remaining.append((wanted, future))
        self._work_waiters = remaining

    def _wanted_pairs(self) -> frozenset[str]:
        if self._wanted is None:
            self._wanted = frozenset().union(*self._seen, *(k for k, _ in self._work_waiters))
        return self._wanted

    def _wake_all(self) -> None:
        for _, future in self._work_waiters:
            if not future.done():
                future.set_result(None)
        self._work_waiters = []

    def _on_cancel(self, payload: str) -> None:
        """`<run id>:<reason>`: a hint that the run's cancel may have been requested."""
        run_id_text, _, reason = payload.partition(":")
        if len(run_id_text) != 36:  # the canonical text form; UUID() accepts more shapes
            return
        try:
            run_id = UUID(run_id_text)
        except ValueError:
            return
        for listener in list(self._cancel_listeners):
            try:
                listener(run_id, reason)
            except Exception:
                _log.exception("a cancel listener failed on run %s", run_id)

    def _generation(self, pairs: frozenset[str]) -> int:
        return sum(self._notified.get(p, 0) for p in pairs) + self._notified.get("*", 0)

    # -- helpers ----------------------------------------------------------------------------------

    async def _one(self, query: str, params: Mapping[str, Any]) -> dict[str, Any] | None:
        with wrap_exceptions():
            async with self._pool.connection() as conn:
                cur = await conn.cursor(row_factory=dict_row).execute(self._q[query], params)
                row: dict[str, Any] | None = await cur.fetchone()
                return row

    async def _all_async_commit(
        self, query: str, params: Mapping[str, Any]
    ) -> list[dict[str, Any]]:
        """Like `_all`, committed without waiting for the WAL flush (pipelined: one round trip).

        Only for writes whose loss in a server crash is harmless: claims (the holder's next
        write is fenced, and a durable write flushes every earlier commit's WAL with it) and
        heartbeats (a lease that is shorter than thought).
        """
        with wrap_exceptions():
            async with self._pool.connection() as conn:
                cur = conn.cursor(row_factory=dict_row)
                async with conn.pipeline(), conn.transaction():
                    await conn.execute(self._q["async_commit"])
                    await cur.execute(self._q[query], params)
                rows: list[dict[str, Any]] = await cur.fetchall()
                return rows

    async def _all(self, query: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        with wrap_exceptions():
            async with self._pool.connection() as conn:
                cur = await conn.cursor(row_factory=dict_row).execute(self._q[query], params)
                rows: list[dict[str, Any]] = await cur.fetchall()
                return rows

    @staticmethod
    def _fenced(lease: Lease, what: str) -> FencingError:
        return FencingError(
            f"{what}: run {lease.run_id} is no longer held by attempt token {lease.fencing_token}",
            run_id=lease.run_id,
            fencing_token=lease.fencing_token,
        )

    # -- the SPI ----------------------------------------------------------------------------------

    async def enqueue(self, new: NewRun, *, conn: Any = None) -> EnqueueResult:
        params = {
            "id": new.run_id,
            "task_name": new.task_name,
            "task_version": new.task_version,
            "priority": new.priority,
            "delay": new.delay or timedelta(0),
            "idempotency_key": new.idempotency_key,
            "input_hash": new.input_hash,
            "trace_context": Jsonb(dict(new.trace_context)),
            "input": new.input_json,
            "channel": self.work_channel,
            "pair": f"{new.task_name}@{new.task_version}",
        }
        if conn is not None:
            if not isinstance(conn, psycopg.AsyncConnection):
                raise TypeError(
                    "enqueue(conn=...) takes a psycopg.AsyncConnection to the engine's database "
                    f"(your open transaction), got {type(conn).__name__}"
                )
            with wrap_exceptions():
                return await self._enqueue_on(conn, new, params)
        with wrap_exceptions():
            async with self._pool.connection() as own:  # autocommit: one statement, one commit
                return await self._enqueue_on(own, new, params)

    async def _enqueue_on(
        self, conn: psycopg.AsyncConnection[Any], new: NewRun, params: dict[str, Any]
    ) -> EnqueueResult:
        cur = await conn.execute(self._q["insert_run"], params)
        if await cur.fetchone() is not None:
            return EnqueueResult(run_id=new.run_id, created=True, task_version=new.task_version)
        cur = await conn.execute(self._q["find_idempotent_run"], params)
        row = await cur.fetchone()
        if row is None:  # pragma: no cover - the conflicting insert was rolled back meanwhile
            raise IdempotencyConflictError(
                f"idempotency key {new.idempotency_key!r} is being used concurrently; retry",
                idempotency_key=new.idempotency_key or "",
            )
        existing_id, existing_hash, existing_version = row
        return EnqueueResult(
            run_id=existing_id,
            created=False,
            task_version=existing_version,
            input_hash=existing_hash,
        )

    async def claim(
        self, *, worker_id: str, pairs: Sequence[TaskPair], limit: int, lease: timedelta
    ) -> Sequence[ClaimedRun]:
        keys = frozenset(str(p) for p in pairs)
        if keys not in self._seen:
            self._wanted = None
        self._seen[keys] = self._generation(keys)
        rows = await self._all_async_commit(
            "claim_runs",
            {
                "names": [p.name for p in pairs],
                "versions": [p.version for p in pairs],
                "limit": limit,
                # Over-fetch candidates: a short batch would make the worker wait for its
                # next poll while work is still queued (see claim_runs in queries.sql).
                "scan": limit + max(limit, 16),
                "worker_id": worker_id,
                "lease": lease,
            },
        )
        claimed = []
        for row in rows:
            # json_agg hands back steps as JSON: outputs as their stored text (untouched),
            # timestamps as text.
            steps = tuple(_step(s, s["output"]) for s in (row["steps"] or ()))
            claimed.append(
                ClaimedRun(
                    run_id=row["id"],
                    task_name=row["task_name"],
                    task_version=row["task_version"],
                    input_json=row["input"],
                    priority=row["priority"],
                    fencing_token=row["fencing_token"],
                    claimed_at=row["claimed_at"],
                    claims=row["claims"],
                    failures=row["failures"],
                    trace_context=row["trace_context"] or {},
                    steps=steps,
                    ready_at=row["ready_at"],
                    lost_leases=row["lost_leases"],
                    cancel_reason=row["cancel_reason"],
                )
            )
        return claimed

    async def heartbeat(
        self, *, worker_id: str, beats: Sequence[Beat], lease: timedelta
    ) -> HeartbeatResult:
        if not beats:
            return HeartbeatResult()
        rows = await self._all_async_commit(
            "heartbeat",
            {
                "ids": [b.run_id for b in beats],
                "tokens": [b.fencing_token for b in beats],
                "steps": [b.current_step for b in beats],
                "step_started": [b.step_started_at for b in beats],
                "lease": lease,
            },
        )
        return HeartbeatResult(
            lost=frozenset(r["id"] for r in rows if not r["held"]),
            cancel_requested={
                r["id"]: r["cancel_reason"] or "" for r in rows if r["cancel_requested"]
            },
        )

    async def record_step(self, lease: Lease, step: StepRecord) -> None:
        """Group commit: checkpoints that arrive while one is being written go together in the
        next statement (one commit for all), so a busy worker pays well under one server
        transaction per step, and an idle one pays no extra wait."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._checkpoints.append((lease, step, future))
        if not self._flushing:
            self._flushing = True
            self._flusher = asyncio.create_task(
                self._flush_checkpoints(), name="umt-pg-checkpoints"
            )
        if not await future:
            raise self._fenced(lease, f"recording step {step.name!r}")

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

    async def end_execution(self, lease: Lease, ending: Ending) -> EndResult:
        step = ending.step
        params = {
            "run_id": lease.run_id,
            "token": lease.fencing_token,
            "status": ending.status,
            "outcome": ending.outcome,
            "available_at": ending.available_at,
            "wait_for": ending.wait_for,
            "output": ending.output_json,
            "error": _error_json(ending.error),
            "add_failure": 1 if ending.count_failure else 0,
            "step_name": step.name if step else None,
            "step_attempt": step.attempt if step else None,
            "step_kind": step.kind if step else None,
            "step_status": step.status if step else None,
            "step_started_at": step.started_at if step else None,
            "step_finished_at": step.finished_at if step else None,
            "step_wake_at": step.wake_at if step else None,
            "step_error": _error_json(step.error) if step else None,
        }
        with wrap_exceptions():
            async with self._pool.connection() as conn:
                if ending.wait_for is None:
                    cur = await conn.execute(self._q["end_execution"], params)
                    row = await cur.fetchone()
                else:
                    # Shared lock on the fact name, then the ending in a new statement (a fresh
                    # snapshot): a concurrent signal either committed before (we see its fact)
                    # or waits for us (and then sees this run waiting).
                    async with conn.pipeline(), conn.transaction():
                        await conn.execute(
                            self._q["lock_fact_name_shared"], {"name": ending.wait_for}
                        )
                        cur = await conn.execute(self._q["end_execution"], params)
                    row = await cur.fetchone()
        owned, ended, fact_present = row if row else (0, 0, False)
        if not owned:
            raise self._fenced(lease, f"ending as {ending.outcome}")
        if ended:
            return "ended"
        return "fact_present" if fact_present else "cancel_requested"

    async def signal(self, *, run_id: UUID | None, name: str, payload_json: str) -> bool:
        params = {
            "run_id": run_id,
            "name": name,
            "payload": payload_json,
            "channel": self.work_channel,
        }
        with wrap_exceptions():
            async with self._pool.connection() as conn:
                try:
                    # Exclusive lock on the fact name, then the insert and the wake-up in a new
                    # statement; pipelined, so the transaction costs one round trip.
                    async with conn.pipeline(), conn.transaction():
                        await conn.execute(self._q["lock_fact_name"], {"name": name})
                        cur = await conn.execute(self._q["insert_fact"], params)
                    row = await cur.fetchone()
                except psycopg.errors.ForeignKeyViolation:
                    raise RunNotFoundError(f"no run {run_id}", run_id=run_id) from None
        return bool(row and row[0])

    async def get_facts(self, *, run_id: UUID, name: str) -> Sequence[Fact]:
        rows = await self._all("get_facts", {"run_id": run_id, "name": name})
        return [
            Fact(
                name=r["name"],
                run_id=r["run_id"],
                payload_json=r["payload"],
                created_at=r["created_at"],
            )
            for r in rows
        ]

    async def cancel(self, run_id: UUID, *, reason: str) -> CancelOutcome:
        with wrap_exceptions():
            async with self._pool.connection() as conn, conn.transaction():
                cur = await conn.execute(
                    self._q["cancel_run"], {"run_id": run_id, "reason": reason}
                )
                row = await cur.fetchone()
                if row is None:
                    raise RunNotFoundError(f"no run {run_id}", run_id=run_id)
                previous, status = row
                if status is None:
                    return "already_finished"
                if status == "canceled":
                    return "canceled"
                await conn.execute(
                    self._q["notify"],
                    {"channel": self.cancel_channel, "payload": f"{run_id}:{reason}"[:7000]},
                )
        del previous
        return "requested"

    async def get_run(self, run_id: UUID) -> RunRecord | None:
        with wrap_exceptions():
            async with self._pool.connection() as conn:
                cur = conn.cursor(row_factory=dict_row)
                await cur.execute(self._q["get_run"], {"run_id": run_id})
                row = await cur.fetchone()
                if row is None:
                    return None
                await cur.execute(self._q["get_steps"], {"run_id": run_id})
                steps = await cur.fetchall()
                await cur.execute(self._q["get_executions"], {"run_id": run_id})
                executions = await cur.fetchall()
        return self._record(row, steps, executions)

    def _record(
        self,
        row: dict[str, Any],
        steps: Sequence[dict[str, Any]] = (),
        executions: Sequence[dict[str, Any]] = (),
    ) -> RunRecord:
        now = row["db_now"]
        records = []
        for e in executions:
            outcome = e["outcome"]  # as stored: the SDK reads a lapsed `running` (`_views`)
            records.append(
                ExecutionRecord(
                    fencing_token=e["fencing_token"],
                    worker_id=e["worker_id"],
                    claimed_at=e["claimed_at"],
                    ended_at=e["ended_at"],
                    outcome=outcome,
                    current_step=e["current_step"],
                    step_started_at=e["step_started_at"],
                )
            )
        return RunRecord(
            run_id=row["id"],
            task_name=row["task_name"],
            task_version=row["task_version"],
            status=row["status"],
            priority=row["priority"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            available_at=row["available_at"] if row["status"] != "running" else None,
            input_json=row["input"],
            idempotency_key=row["idempotency_key"],
            output_json=row["output"],
            error=_error(row["error"]),
            claims=row["claims"],
            failures=row["failures"],
            lease_expirations=row["lease_expirations"],
            fencing_token=row["fencing_token"],
            lease_owner=row["lease_owner"],
            lease_expires_at=row["lease_expires_at"],
            finished_at=row["finished_at"],
            cancel_requested_at=row["cancel_requested_at"],
            cancel_reason=row["cancel_reason"],
            wait_for=row["wait_for"],
            trace_context=row["trace_context"] or {},
            steps=tuple(_step(s, s["output"]) for s in steps),
            executions=tuple(records),
            observed_at=now,
        )

    async def list_runs(self, query: RunQuery) -> Sequence[RunRecord]:
        rows = await self._all(
            "list_runs",
            {
                "task_name": query.task_name,
                "task_version": query.task_version,
                "status": query.status,
                "before": query.before,
                "limit": query.limit,
            },
        )
        return [self._record(r) for r in rows]

    async def queue_depths(self, pairs: Sequence[TaskPair]) -> dict[TaskPair, int]:
        rows = await self._all(
            "queue_depths",
            {"names": [p.name for p in pairs], "versions": [p.version for p in pairs]},
        )
        depths = dict.fromkeys(pairs, 0)
        for row in rows:
            depths[TaskPair(name=row["task_name"], version=row["task_version"])] = row["depth"]
        return depths

    async def wait_for_work(self, *, pairs: Sequence[TaskPair], timeout: float) -> None:
        if not self._listen or self._listener is None:
            await asyncio.sleep(timeout)
            return
        keys = frozenset(str(p) for p in pairs)
        if self._generation(keys) != self._seen.get(keys, -1):
            return  # a notification came since the last claim: claim again now
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not keys <= self._wanted_pairs():
            self._wanted = None
        self._work_waiters.append((keys, future))
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            pass
        finally:
            self._work_waiters = [(k, f) for k, f in self._work_waiters if f is not future]

    async def wait_for_run(self, run_id: UUID, *, timeout: float) -> None:
        await asyncio.sleep(min(timeout, 0.05))

    def add_cancel_listener(self, listener: Callable[[UUID, str], None]) -> Callable[[], None]:
        self._cancel_listeners.append(listener)

        def remove() -> None:
            if listener in self._cancel_listeners:
                self._cancel_listeners.remove(listener)

        return remove

    def ledger(self, conn: Any) -> PostgresLedger:
        if not isinstance(conn, psycopg.AsyncConnection):
            raise TypeError(
                "with_attempt_token on Postgres takes a psycopg.AsyncConnection to your "
                f"business database, got {type(conn).__name__}"
            )
        return PostgresLedger(self, conn)

    async def shares_database_with(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Whether `conn` is on the engine's database: the same server and the same database.

        Asked, not guessed from names: `conn` takes a session advisory lock on two random keys
        and releases it at once, and the engine's pool looks for that lock, held by that
        backend process, in its own database (locks belong to one server and one database).
        Another database that happens to hold a schema of the same name answers False. The
        answer is cached per (host, port, database) of `conn`. Used by the ledger and the
        outbox alike.
        """
        info = conn.info
        where = (info.host, info.port, info.dbname)
        same = self._same_database.get(where)
        if same is None:
            keys = {"k1": secrets.randbelow(2**31 - 1) + 1, "k2": secrets.randbelow(2**31 - 1) + 1}
            with wrap_exceptions():
                cur = await conn.execute(self._q["probe_lock"], keys)
                row = await cur.fetchone()
                assert row is not None
                try:
                    async with self._pool.connection() as engine_conn:
                        cur = await engine_conn.execute(
                            self._q["probe_see"], {**keys, "pid": row[1]}
                        )
                        seen = await cur.fetchone()
                finally:
                    await conn.execute(self._q["probe_unlock"], keys)
            same = bool(seen and seen[0])
            self._same_database[where] = same
        return same

    async def _ledger_database(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Whether the ledger on `conn` is in the engine's database; refuses a database
        without a ledger, saying how to install one."""
        same = await self.shares_database_with(conn)
        where = (conn.info.host, conn.info.port, conn.info.dbname)
        if where not in self._ledger_checked:
            with wrap_exceptions():
                cur = await conn.execute(self._q["ledger_here"])
                row = await cur.fetchone()
            if row is None or not row[0]:
                raise BackendError(
                    f"no operation ledger in schema {self.schema!r} of database "
                    f"{conn.info.dbname!r}: install it there with umt_backend_pg.install_ledger"
                    f"(conn, schema={self.schema!r}), or use a connection to the "
                    "engine's database"
                )
            self._ledger_checked.add(where)
        return same

    async def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
            self._listener = None
        self._wake_all()
        if self._flusher is not None:  # let the checkpoints already handed over be written
            with contextlib.suppress(Exception):
                await self._flusher
        await self._pool.close()


class PostgresLedger:
    """The operation ledger (`<schema>.op_ledger`) on the caller's business connection.

    Two layouts, found by looking for the engine's runs table on `conn` (once per database):
    - the business tables share the engine's database: the ledger is the engine schema's;
    - the business database is another one: install the ledger there with
      `umt_backend_pg.install_ledger(conn, schema=<the engine's schema name>)`.
    Either way the fence is the ledger row of the op key: a begin raises the op's token to the
    caller's (never lowers it), and a commit lands only under the token that last began the
    op, checked by the last statement before the commit (`ledger_finish`). The run itself is
    only read (on `conn`, or through the engine's pool for a separate database), never locked:
    at begin, before the commit callback and before the result is recorded, so an attempt
    whose lease is already lost is refused even before a newer attempt reaches the operation.
    No lock is held on engine rows while your code runs: a frozen commit cannot hold up a
    takeover, a cancel or a heartbeat. (The rows your callback writes stay locked by its open
    transaction until it ends, like any transaction of yours.)

    The connection should not be inside a transaction of the caller's: `begin` must commit
    before the side effect runs. `commit(tx, result)` receives the connection itself, inside
    the fenced transaction.
    """

    def __init__(self, backend: PostgresBackend, conn: psycopg.AsyncConnection[Any]) -> None:
        self._backend = backend
        self._conn = conn

    async def _holds_run(self, params: Mapping[str, Any]) -> bool:
        if await self._backend._ledger_database(self._conn):
            cur = await self._conn.execute(self._backend._q["ledger_check_run"], params)
            return await cur.fetchone() is not None
        return await self._backend._one("ledger_check_run", params) is not None

    async def _fence(self, lease: Lease, params: Mapping[str, Any], what: str) -> None:
        """Refuse a stale attempt before its commit callback runs (plain reads, no locks)."""
        if not await self._holds_run(params):
            raise PostgresBackend._fenced(lease, what)
        cur = await self._conn.execute(self._backend._q["ledger_peek"], params)
        row = await cur.fetchone()
        if row is None or row[0] != lease.fencing_token or row[1]:
            raise PostgresBackend._fenced(
                lease, f"{what} (a newer attempt began it, or it finished elsewhere)"
            )

    async def begin(self, *, op_key: str, lease: Lease) -> LedgerEntry:
        q = self._backend._q
        conn = self._conn
        params = {"op_key": op_key, "run_id": lease.run_id, "token": lease.fencing_token}
        with wrap_exceptions():
            async with conn.transaction():
                if not await self._holds_run(params):
                    raise PostgresBackend._fenced(lease, f"beginning {op_key!r}")
                cur = await conn.execute(q["ledger_get"], params)
                existing = await cur.fetchone()
                if existing is not None and existing[1] is not None:
                    return LedgerEntry(result_json=existing[1], resumed=False)
                cur = await conn.execute(q["ledger_begin"], params)
                if await cur.fetchone() is None:
                    raise PostgresBackend._fenced(
                        lease, f"beginning {op_key!r} (a newer attempt has)"
                    )
        return LedgerEntry(result_json=None, resumed=existing is not None)

    async def finish(
        self,
        *,
        op_key: str,
        lease: Lease,
        result_json: str,
        commit: Callable[[Any], Awaitable[None]],
    ) -> None:
        q = self._backend._q
        conn = self._conn
        what = f"committing {op_key!r}"
        params = {
            "op_key": op_key,
            "run_id": lease.run_id,
            "token": lease.fencing_token,
            "result": result_json,
        }
        try:
            with wrap_exceptions():
                async with conn.transaction():
                    await self._fence(lease, params, what)  # fence first
                    await commit(conn)
                    if not await self._holds_run(params):
                        raise PostgresBackend._fenced(lease, what)
                    cur = await conn.execute(q["ledger_finish"], params)
                    if await cur.fetchone() is None:
                        raise PostgresBackend._fenced(
                            lease, f"{what} (a newer attempt began it, or it finished elsewhere)"
                        )
        except FencingError:
            raise
        except Exception as exc:
            # The callback (or the connection) failed. If that is because a newer attempt took
            # over (say, its business row hit your unique key), the answer is FencingError.
            if await self._stale(lease, params, what):
                raise PostgresBackend._fenced(lease, what) from exc
            raise

    async def _stale(self, lease: Lease, params: Mapping[str, Any], what: str) -> bool:
        try:
            with wrap_exceptions():
                await self._fence(lease, params, what)
        except FencingError:
            return True
        except Exception:  # cannot tell (the connection is gone): report the original error
            return False
        return False


async def install_ledger(conn: psycopg.AsyncConnection[Any], *, schema: str = "umt") -> None:
    """Create the operation ledger in a business database separate from the engine's.

    Use the engine's schema name, so that `with_attempt_token` finds it there.
    """
    with wrap_exceptions():
        async with conn.transaction():
            await conn.execute(render(queries()["install_ledger"], schema))
