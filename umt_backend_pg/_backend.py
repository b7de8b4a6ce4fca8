"""The Postgres backend: the SPI over psycopg 3 with a pool, LISTEN/NOTIFY and named SQL.

Round trips (each one statement and one commit unless noted):
- enqueue: 1 (the insert, and its `ready` row when it is claimable at once; +1 on an
  idempotency hit, to read the existing run); then, in the background, a NOTIFY in a
  statement of its own that does not wait for the flush, shared by the enqueues of this
  process meanwhile (`_notifier`); in the caller's transaction (`conn=`), the NOTIFY is in the
  insert's statement;
- claim: 1 for up to N runs, including their step records for replay (their outputs as the
  stored text), committed without waiting for the WAL flush: a claim lost in a server crash is
  caught by fencing, and the token epochs never hand its token out again;
- step checkpoint: 1 (insert the record if the token holds, extend the lease);
- the ending (`end_execution`: complete, fail, retry, cancel, release, park on a sleep or a
  step's backoff): 1; park on a fact: 1 (lock + ending, pipelined in a transaction);
- signal: 1 (lock + insert + wake-up + NOTIFY, pipelined in a transaction);
- heartbeat: 1 per worker per interval, for every run it holds (also without the flush wait);
- ready-queue rotation: 1 per worker about every quarter second, offered before a claim (a
  no-op unless a slot behind is due; see `_ready`); the sweep of lost `ready` rows: 1 per worker
  every 30 s; the releases maps owe (`pay_group_releases`): 1 per worker every second.
A 1-step run therefore costs 4 server transactions: enqueue, claim, checkpoint, complete. The
claim reads the ready queue always, and the timers (due sleeps, backoffs, expired leases)
about once a second, so a due timer starts within about a second of its time.

Rooms the backend owns: `_wakeups` (the LISTEN loop and its wake-ups), `_checkpoints` (group
commit of step records), `_ledger` (the operation ledger and the same-database probe), `_ready`
(when the claim reads timers, rotates and sweeps the ready queue), `_notifier` (the enqueues'
coalesced NOTIFY); `_rows` turns rows into records.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import attrs
import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from umt_backend_pg import _args
from umt_backend_pg._checkpoints import Checkpoints
from umt_backend_pg._errors import fenced, wrap_exceptions
from umt_backend_pg._events import PostgresEvents
from umt_backend_pg._ledger import EngineDatabase, PostgresLedger
from umt_backend_pg._migrate import migrate
from umt_backend_pg._notifier import Notifier
from umt_backend_pg._ready import (
    MAX_MOVED,
    RELEASES_PAGE,
    SWEEP_GRACE,
    SWEEP_PAGE,
    TIMERS_MARGIN,
    ClaimClocks,
)
from umt_backend_pg._rows import (
    _error_json,
    _pruned_run,
    _record,
    _schedule_record,
    _step,
    _stream_entry,
)
from umt_backend_pg._sql import queries, render, validate_schema
from umt_backend_pg._transactions import StepTransactions
from umt_backend_pg._wakeups import Wakeups
from umt_sdk.backend import (
    TERMINAL_STATUSES,
    Beat,
    CancelOutcome,
    ChildGroup,
    ClaimedRun,
    Clock,
    Ending,
    EndResult,
    EnqueueResult,
    Fact,
    FinishedCount,
    HeartbeatResult,
    KeyUsage,
    Lease,
    NewRun,
    PairActivity,
    PausedTask,
    PruneBatch,
    PrunedRun,
    PruneQuery,
    RateLimitInfo,
    RunQuery,
    RunRecord,
    ScheduleQuery,
    ScheduleRecord,
    ScheduleState,
    StepRecord,
    StreamAppend,
    StreamEntry,
    TaskPair,
    TokenGrant,
    TokenRequest,
    WorkerRecord,
    WorkerState,
)
from umt_sdk.exceptions import (
    BackendError,
    FencingError,
    IdempotencyConflictError,
    RunNotFoundError,
    UsageError,
)

__all__ = ["PostgresBackend"]


# TCP settings for the pool's connections unless the URL sets its own: a peer that vanished
# (a crashed host, a dropped NAT entry) is noticed in about 30 s instead of the kernel's two
# hours, and data that is never acknowledged fails the connection after 30 s. A peer that
# acknowledges and never answers (a proxy holding the connection) is what the worker's deadline
# on its claim and heartbeat is for (umt_sdk._worker).
_NETWORK_DEFAULTS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


async def _refuse_unfinished_pipeline(conn: psycopg.AsyncConnection[Any]) -> None:
    """The pool's reset: a connection handed back still in pipeline mode is discarded.

    A task cancelled inside `async with conn.pipeline(), conn.transaction()` (the worker's
    deadline on a claim or a heartbeat, a shutdown) can hand its connection back with the
    pipeline still on and the transaction status reading idle (psycopg 3.3): every later
    statement on it would then run inside a transaction that never commits, so an enqueue
    would return before its run was stored. Raising here makes the pool close it.
    """
    if conn.pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF:
        raise psycopg.ProgrammingError(
            "connection handed back in pipeline mode (a cancelled statement): discarded"
        )


def _idle_in_transaction_ms(value: object, *, where: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, timedelta) or value < timedelta(seconds=1):
        _args.refuse(
            "idle_in_transaction_timeout",
            "a timedelta of at least 1 s, or None to leave the server's setting",
            value,
            where=where,
        )
    return int(_args.duration(value, "idle_in_transaction_timeout", where=where) / _MS)


_MS = timedelta(milliseconds=1)


def _session_settings(
    schema: str, idle_ms: int
) -> Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]:
    """The pool's configure step: the settings every connection of the engine runs with."""
    text = render(queries()["session_settings"], schema)

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(text, {"idle_ms": str(idle_ms)})

    return configure


def _check_listen(
    url: str, *, listen: bool, pooled: bool, listen_url: str | None, where: str
) -> None:
    """LISTEN needs a session of its own: through a transaction pooler, only on a direct URL."""
    if listen_url is None:
        if pooled and listen:
            raise UsageError(
                f"{where}: LISTEN does not work through a pooler in transaction mode "
                "(pooled=True): the LISTEN would stay on whichever server connection ran it. "
                "Pass listen=False (workers poll), or listen_url='postgresql://...' (a direct "
                "connection to the same database, for LISTEN only)",
                argument="listen",
            )
        return
    _args.text(listen_url, "listen_url", where=where, expected="a database URL (postgresql://...)")
    if not listen:
        raise UsageError(
            f"{where}: listen_url is the URL of the LISTEN connection, but listen=False opens "
            "none: drop listen_url, or leave listen=True",
            argument="listen_url",
        )
    if listen_url == url and pooled:
        raise UsageError(
            f"{where}: listen_url is the pooled URL itself; LISTEN needs a direct connection "
            "to the database (not through the pooler)",
            argument="listen_url",
        )


def _network_defaults(url: str) -> dict[str, Any]:
    given = psycopg.conninfo.conninfo_to_dict(url)
    return {k: v for k, v in _NETWORK_DEFAULTS.items() if k not in given}


class PostgresBackend(PostgresEvents):
    """Runs, steps, facts and the ledger in one Postgres schema. Open with `open()`."""

    clock: Clock | None = None

    def __init__(
        self,
        *,
        url: str,
        pool: AsyncConnectionPool[Any],
        schema: str,
        listen: bool,
        listen_url: str | None = None,
        open_transaction_pool: Callable[[], Awaitable[AsyncConnectionPool[Any]]] | None = None,
    ) -> None:
        """`open_transaction_pool`: opens the pool of transactional steps, at the first one
        (`_transactions`); None: they share `pool`."""
        self.url = url
        self.schema = schema
        self._pool = pool
        self._q = {name: render(text, schema) for name, text in queries().items()}
        self.work_channel = f"{schema}.work"
        self.cancel_channel = f"{schema}.cancel"
        self.ended_channel = f"{schema}.ended"
        self.stream_channel = f"{schema}.stream"
        self._wakeups = Wakeups(
            listen_url or url,
            work_channel=self.work_channel,
            cancel_channel=self.cancel_channel,
            ended_channel=self.ended_channel,
            stream_channel=self.stream_channel,
            queries=self._q,
            listen=listen,
        )
        self._checkpoints = Checkpoints(self._all)
        self._notifier = Notifier(pool, self._q, self.work_channel)
        self._endings = Notifier(
            pool, self._q, self.ended_channel, what="result() callers of ended runs"
        )
        self._streams = Notifier(
            pool, self._q, self.stream_channel, what="followers of the streams of runs"
        )
        self._clocks = ClaimClocks()
        self._database = EngineDatabase(pool, schema=schema, queries=self._q)
        self._transactions = StepTransactions(
            open_transaction_pool or _shared(pool),
            schema=schema,
            still_held=self._database.holds_run,
            owns_pool=open_transaction_pool is not None,
        )

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
        idle_in_transaction_timeout: timedelta | None = timedelta(seconds=10),
        pooled: bool = False,
        listen_url: str | None = None,
    ) -> PostgresBackend:
        """Open a pool on `url`. With `listen=False` (poolers that cannot LISTEN) workers poll.

        `idle_in_transaction_timeout` is set on every connection of the pool: a client that
        stops between the statements of a transaction (a process frozen by SIGSTOP, a stalled
        VM) has its transaction rolled back by the server after that long, instead of holding
        row locks (a claimed or heartbeated run's) until it wakes up, which would keep every
        other worker from taking the run over. `None` leaves the server's setting.

        `pooled=True` says that `url` goes through a pooler in transaction mode (PgBouncer
        `pool_mode = transaction`), where consecutive transactions of one client connection
        run on different server connections. The backend then keeps no state between
        transactions: psycopg's automatic prepared statements are off (`prepare_threshold=None`),
        and `idle_in_transaction_timeout` is not applied (a session setting would land on
        whichever server connection ran it: set the pooler's `idle_transaction_timeout`, or the
        role's `idle_in_transaction_session_timeout`, instead). LISTEN cannot work through
        such a pooler, so `pooled=True` needs `listen=False` (workers poll) or a `listen_url`.

        `listen_url` is the URL of the LISTEN connection alone (one per backend), by default
        `url`: with `pooled=True`, a direct URL to the same database (not through the pooler),
        so that workers are woken by notifications while everything else is pooled.
        """
        where = "the Postgres backend"
        _args.text(url, "url", where=where, expected="a database URL (postgresql://...)")
        validate_schema(schema)
        _args.flag(run_migrations, "run_migrations", where=where)
        _args.integer(min_size, "min_size", at_least=0, where=where)
        _args.integer(max_size, "max_size", at_least=max(1, min_size), where=where)
        _args.flag(listen, "listen", where=where)
        _args.flag(pooled, "pooled", where=where)
        idle_ms = _idle_in_transaction_ms(idle_in_transaction_timeout, where=where)
        _check_listen(url, listen=listen, pooled=pooled, listen_url=listen_url, where=where)
        if run_migrations:
            await migrate(url, schema=schema)
        kwargs: dict[str, Any] = {"autocommit": True, **_network_defaults(url)}
        if pooled:
            kwargs["prepare_threshold"] = None
            idle_ms = None
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            kwargs=kwargs,
            reset=_refuse_unfinished_pipeline,
            configure=None if idle_ms is None else _session_settings(schema, idle_ms),
            open=False,
            name=f"umt-{schema}",
        )
        with wrap_exceptions():
            await pool.open(wait=True, timeout=30)

        async def open_transaction_pool() -> AsyncConnectionPool[Any]:
            # The same connections as the engine's pool, apart: a transactional step's long
            # transaction never holds one that a heartbeat or a claim waits for.
            tx_pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                url,
                min_size=0,
                max_size=max_size,
                kwargs=kwargs,
                reset=_refuse_unfinished_pipeline,
                configure=None if idle_ms is None else _session_settings(schema, idle_ms),
                open=False,
                name=f"umt-{schema}-steps",
            )
            await tx_pool.open(wait=False)
            return tx_pool

        backend = cls(
            url=url,
            pool=pool,
            schema=schema,
            listen=listen,
            listen_url=listen_url or url,
            open_transaction_pool=open_transaction_pool,
        )
        if listen:
            backend._wakeups.start()
        return backend

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
        return fenced(lease, what)

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
            "parent_run_id": new.parent_run_id,
            "parent_fact": new.parent_fact,
            "cancel_with_parent": new.cancel_with_parent,
            "rerun_of": new.rerun_of,
            "forked_from": new.forked_from,
            "forked_at_step": new.forked_at_step,
            "tags": Jsonb(dict(new.tags)),
            "concurrency_key": new.concurrency_key,
            "concurrency_limit": new.concurrency_limit,
            "fairness_weight": new.fairness_weight,
            "count_waiting": new.count_waiting,
            "deadline_at": new.deadline_at,
            "timeout": new.timeout,
            "start_within": new.start_within,
            "rate_limit": new.rate_limit,
            "rate_limit_key": new.rate_limit_key,
            "debounce_key": new.debounce_key,
            "debounce_max_wait": new.debounce_max_wait,
        }
        if new.singleton is not None or new.debounce_key is not None:
            if conn is not None:  # the SDK never asks: the lock is held in its own transaction
                raise UsageError(
                    "a singleton or debounced enqueue cannot join conn=", argument="conn"
                )
            with wrap_exceptions():
                async with self._pool.connection() as own, own.transaction():
                    result = await self._enqueue_keyed(own, new, {**params, "notify": False})
            if result.created:
                self._notifier.notify(f"{new.task_name}@{new.task_version}")
            return result
        if conn is not None:
            if not isinstance(conn, psycopg.AsyncConnection):
                raise UsageError(
                    "enqueue(conn=...) takes a psycopg.AsyncConnection to the engine's database "
                    f"(your open transaction), got {type(conn).__name__}",
                    argument="conn",
                )
            with wrap_exceptions():
                return await self._enqueue_on(conn, new, {**params, "notify": True})
        with wrap_exceptions():
            async with self._pool.connection() as own:  # autocommit: one statement, one commit
                if new.forked_from is None:
                    result = await self._enqueue_on(own, new, {**params, "notify": False})
                else:  # a fork: the run and its copied history in one transaction
                    async with own.transaction():
                        result = await self._enqueue_on(own, new, {**params, "notify": False})
        if result.created:
            self._notifier.notify(f"{new.task_name}@{new.task_version}")
        return result

    async def _enqueue_on(
        self, conn: psycopg.AsyncConnection[Any], new: NewRun, params: dict[str, Any]
    ) -> EnqueueResult:
        cur = await conn.execute(self._q["insert_run"], params)
        if await cur.fetchone() is not None:
            if new.forked_from is not None:
                await self._copy_fork(conn, new)
            return EnqueueResult(run_id=new.run_id, created=True, task_version=new.task_version)
        cur = await conn.execute(self._q["find_idempotent_run"], params)
        row = await cur.fetchone()
        if row is None:  # pragma: no cover - the conflicting insert was rolled back meanwhile
            raise IdempotencyConflictError(
                f"idempotency key {new.idempotency_key!r} is being used concurrently; retry",
                idempotency_key=new.idempotency_key or "",
            )
        existing_id, existing_hash, existing_version, pruned = row
        return EnqueueResult(
            run_id=existing_id,
            created=False,
            task_version=existing_version,
            input_hash=existing_hash,
            pruned=pruned,
        )

    async def _enqueue_keyed(
        self, conn: psycopg.AsyncConnection[Any], new: NewRun, params: dict[str, Any]
    ) -> EnqueueResult:
        """A singleton's or a debounced enqueue, in one transaction under the key's lock."""
        key = new.debounce_key if new.singleton is None else new.concurrency_key
        kind = "singleton" if new.singleton is not None else "debounce"
        lock_name = f"{self.schema}.{kind}:{len(new.task_name)}:{new.task_name}:{key}"
        await conn.execute(self._q["lock_flow_key"], {"lock_name": lock_name})
        if new.singleton is not None:
            cur = await conn.execute(self._q["active_key_runs"], params)
            active = await cur.fetchall()
            if new.singleton == "skip" and active:
                newest_id, newest_version = active[-1]
                return EnqueueResult(
                    run_id=newest_id, created=False, task_version=newest_version, skipped=True
                )
            result = await self._enqueue_on(conn, new, params)
            return attrs.evolve(result, replaced=tuple(row[0] for row in active))
        cur = await conn.execute(self._q["debounce_run"], params)
        row = await cur.fetchone()
        if row is not None:
            return EnqueueResult(
                run_id=row[0], created=False, task_version=new.task_version, debounced=True
            )
        return await self._enqueue_on(conn, new, params)

    async def enqueue_many(
        self, runs: Sequence[NewRun], *, conn: Any = None
    ) -> Sequence[EnqueueResult]:
        for new in runs:
            if new.forked_from is not None or new.parent_run_id is not None or new.rerun_of:
                raise UsageError(
                    "enqueue_many stores new top-level runs only (no fork, child or rerun)",
                    argument="runs",
                )
        if conn is not None and not isinstance(conn, psycopg.AsyncConnection):
            raise UsageError(
                "enqueue_many(conn=...) takes a psycopg.AsyncConnection to the engine's "
                f"database (your open transaction), got {type(conn).__name__}",
                argument="conn",
            )
        params = {
            "ids": [new.run_id for new in runs],
            "task_names": [new.task_name for new in runs],
            "task_versions": [new.task_version for new in runs],
            "priorities": [new.priority for new in runs],
            "delays": [new.delay or timedelta(0) for new in runs],
            "idempotency_keys": [new.idempotency_key for new in runs],
            "input_hashes": [new.input_hash for new in runs],
            "trace_contexts": _json_texts([new.trace_context for new in runs]),
            "inputs": [new.input_json for new in runs],
            "tags": _json_texts([new.tags for new in runs]),
            "concurrency_keys": [new.concurrency_key for new in runs],
            "concurrency_limits": [new.concurrency_limit for new in runs],
            "fairness_weights": [new.fairness_weight for new in runs],
            "count_waiting": [new.count_waiting for new in runs],
            "deadlines": [new.deadline_at for new in runs],
            "timeouts": [new.timeout for new in runs],
            "start_within": [new.start_within for new in runs],
            "rate_limits": [new.rate_limit for new in runs],
            "rate_limit_keys": [new.rate_limit_key for new in runs],
            "channel": self.work_channel,
            "notify": conn is not None,
        }
        with wrap_exceptions():
            if conn is not None:
                return await self._enqueue_many_on(conn, runs, params)
            async with self._pool.connection() as own:  # autocommit: one statement, one commit
                results = await self._enqueue_many_on(own, runs, params)
        created = zip(runs, results, strict=True)
        for name, version in {(n.task_name, n.task_version) for n, r in created if r.created}:
            self._notifier.notify(f"{name}@{version}")
        return results

    async def _enqueue_many_on(
        self, conn: psycopg.AsyncConnection[Any], runs: Sequence[NewRun], params: dict[str, Any]
    ) -> list[EnqueueResult]:
        # Binary: arrays of thousands of elements are dumped without text quoting.
        cur = await conn.execute(self._q["insert_runs"], params, binary=True)
        inserted = {row[0] for row in await cur.fetchall()}
        taken = [new for new in runs if new.run_id not in inserted]
        found: dict[tuple[str, str | None], tuple[Any, ...]] = {}
        if taken:
            cur = await conn.execute(
                self._q["find_idempotent_runs"],
                {
                    "task_names": [new.task_name for new in taken],
                    "idempotency_keys": [new.idempotency_key for new in taken],
                },
            )
            found = {(row[0], row[1]): row[2:] for row in await cur.fetchall()}
        results = []
        for new in runs:
            if new.run_id in inserted:
                results.append(
                    EnqueueResult(run_id=new.run_id, created=True, task_version=new.task_version)
                )
                continue
            row = found.get((new.task_name, new.idempotency_key))
            if row is None:  # pragma: no cover - the conflicting insert was rolled back meanwhile
                raise IdempotencyConflictError(
                    f"idempotency key {new.idempotency_key!r} is being used concurrently; retry",
                    idempotency_key=new.idempotency_key or "",
                )
            existing_id, existing_hash, existing_version, pruned = row
            results.append(
                EnqueueResult(
                    run_id=existing_id,
                    created=False,
                    task_version=existing_version,
                    input_hash=existing_hash,
                    pruned=pruned,
                )
            )
        return results

    async def _copy_fork(self, conn: psycopg.AsyncConnection[Any], new: NewRun) -> None:
        """Copy the kept step records and the facts of the run `new` forks (`NewRun`)."""
        source = new.forked_from
        cur = await conn.execute(
            self._q["copy_fork"],
            {
                "id": new.run_id,
                "source": source,
                "names": [name for name, _ in new.kept_steps],
                "attempts": [attempt for _, attempt in new.kept_steps],
            },
        )
        row = await cur.fetchone()
        copied, _, found = row if row else (0, 0, False)
        if not found:
            raise RunNotFoundError(f"no run {source}", run_id=source)
        if copied != len(new.kept_steps):
            raise BackendError(
                f"run {source} has {copied} of the {len(new.kept_steps)} step records its fork "
                "keeps; read it again and fork it anew"
            )

    async def claim(
        self, *, worker_id: str, pairs: Sequence[TaskPair], limit: int, lease: timedelta
    ) -> Sequence[ClaimedRun]:
        self._wakeups.claiming(pairs)
        if self._clocks.rotation_due():
            await self._rotate_ready()
        if self._clocks.sweep_due():
            await self._sweep_ready()
        if self._clocks.releases_due():
            await self._pay_group_releases()
        key = frozenset(pairs)
        timers = self._clocks.timers(key)
        started = time.monotonic()
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
                "timers": timers.read,
                "timers_after": timers.after,
                "timers_margin": TIMERS_MARGIN,
            },
        )
        if timers.read and rows:
            self._clocks.timers_read(
                key,
                timers,
                started=started,
                timers_from=rows[0]["timers_from"],
                left=rows[0]["timers_left"],
                paused=frozenset(rows[0]["paused"] or ()),
            )
        claimed = []
        for row in rows:
            if row["id"] is None:  # only the timers' row: nothing was claimed
                continue
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
                    idempotency_key=row["idempotency_key"],
                    deadline_at=row["deadline_at"],
                    start_by=row["start_by"],
                )
            )
        return claimed

    async def _rotate_ready(self) -> None:
        """Offer to truncate the next `ready` slot (see migrations/0003_ready_queue.sql)."""
        outcome = "failed"
        try:
            with wrap_exceptions():
                try:
                    async with self._pool.connection() as conn:
                        cur = await conn.execute(self._q["rotate_ready"], {"max_moved": MAX_MOVED})
                        row = await cur.fetchone()
                        outcome = row[0] if row else "failed"
                except psycopg.errors.InsufficientPrivilege as exc:
                    self._clocks.disable_rotation(str(exc).strip())
        finally:
            self._clocks.rotated(outcome)

    async def _pay_group_releases(self) -> None:
        """Let run the held members whose release a map owes (see pay_group_releases)."""
        groups = 0
        try:
            row = await self._one(
                "pay_group_releases", {"limit": RELEASES_PAGE, "channel": self.work_channel}
            )
            groups = row["groups"] if row else 0
        finally:
            self._clocks.releases_paid(groups=groups)

    async def _sweep_ready(self) -> None:
        """Give queued runs whose `ready` row is gone back to the claim (see sweep_ready)."""
        after = self._clocks.swept_to
        try:
            row = await self._one(
                "sweep_ready",
                {
                    "grace": SWEEP_GRACE,
                    "page": SWEEP_PAGE,
                    "after_at": after[0] if after else None,
                    "after_id": after[1] if after else None,
                },
            )
        except BaseException:
            self._clocks.sweep_failed()
            raise
        assert row is not None  # one row, always
        last = (row["last_at"], row["last_id"]) if row["last_id"] is not None else None
        self._clocks.swept(scanned=row["scanned"], requeued=row["requeued"], last=last)

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
            unrenewed=frozenset(r["id"] for r in rows if r["unrenewed"]),
        )

    async def record_step(self, lease: Lease, step: StepRecord) -> None:
        """Group commit: checkpoints that arrive while one is being written go together in the
        next statement (one commit for all), so a busy worker pays well under one server
        transaction per step, and an idle one pays no extra wait."""
        if not await self._checkpoints.record(lease, step):
            raise self._fenced(lease, f"recording step {step.name!r}")

    async def run_step_transaction(
        self, lease: Lease, body: Callable[[Any], Awaitable[StepRecord]]
    ) -> None:
        """`TransactionStore`: `body` gets a psycopg connection inside a READ COMMITTED
        transaction on the engine's database, whose last statement records the step, fenced
        (`_transactions`). One transaction: the fence, the body's statements, the record."""
        await self._transactions.run(lease, body)

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
            "channel": self.work_channel,
        }
        canceled: list[UUID] = []
        with wrap_exceptions():
            async with self._pool.connection() as conn:
                if ending.status in ("failed", "canceled", "compensated"):
                    # Also cancels the children that asked for it (the SPI's `finishing`), in
                    # the same transaction, level by level.
                    async with conn.transaction():
                        cur = await conn.execute(self._q["end_execution"], params)
                        row = await cur.fetchone()
                        if row and row[1]:
                            canceled = await self._cancel_children(conn, lease.run_id)
                elif ending.wait_for is None:
                    # One statement; a child's also stores its parent's fact (end_execution).
                    cur = await conn.execute(self._q["end_execution"], params)
                    row = await cur.fetchone()
                else:
                    # Shared lock on the fact name and the run's own row, then the ending in a
                    # new statement (a fresh snapshot): a concurrent signal, or a child that
                    # finishes, either committed before (we see its fact) or waits for us (and
                    # then sees this run waiting).
                    async with conn.pipeline(), conn.transaction():
                        await conn.execute(
                            self._q["lock_fact_name_shared"], {"name": ending.wait_for}
                        )
                        await conn.execute(self._q["lock_run"], params)
                        cur = await conn.execute(self._q["end_execution"], params)
                    row = await cur.fetchone()
        owned, ended, fact_present = row[:3] if row else (0, 0, False)
        if not owned:
            raise self._fenced(lease, f"ending as {ending.outcome}")
        if ended:
            if ending.status in TERMINAL_STATUSES:
                self._endings.notify(str(lease.run_id))
            for child in canceled:
                self._endings.notify(str(child))
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
        canceled: list[UUID] = []
        with wrap_exceptions():
            async with self._pool.connection() as conn, conn.transaction():
                # The parent's row, then the run's (see lock_for_cancel); cancel_run then
                # reads, in a new statement, what the writes it waited for committed.
                await conn.execute(self._q["lock_for_cancel"], {"run_id": run_id})
                cur = await conn.execute(
                    self._q["cancel_run"],
                    {"run_id": run_id, "reason": reason, "channel": self.work_channel},
                )
                row = await cur.fetchone()
                if row is None:
                    raise RunNotFoundError(f"no run {run_id}", run_id=run_id)
                status, held = row[0], row[-1]
                if status is None:
                    return "already_finished"
                if status == "canceled":  # it finished: what a finishing write also does
                    finished = {"run_id": run_id, "channel": self.work_channel, "held": held}
                    await conn.execute(self._q["finish_child"], finished)
                    await conn.execute(self._q["group_member_canceled"], finished)
                    canceled = await self._cancel_children(conn, run_id)
                else:
                    await conn.execute(
                        self._q["notify"],
                        {"channel": self.cancel_channel, "payload": f"{run_id}:{reason}"[:7000]},
                    )
        if status == "canceled":
            for ended in (run_id, *canceled):  # after the commit: a waiter reads it ended
                self._endings.notify(str(ended))
            return "canceled"
        return "requested"

    async def _cancel_children(
        self, conn: psycopg.AsyncConnection[Any], run_id: UUID
    ) -> list[UUID]:
        """The cascade of a run that finished failed or canceled, level by level in the
        caller's transaction: the children (then their children...) that ended canceled."""
        ended: list[UUID] = []
        level = [run_id]
        while level:
            cur = await conn.execute(
                self._q["cancel_children"],
                {
                    "run_ids": level,
                    "cancel_channel": self.cancel_channel,
                    "work_channel": self.work_channel,
                },
            )
            level = [child for child, ends, *_ in await cur.fetchall() if ends]
            ended += level
        if ended:
            await conn.execute(self._q["dequeue_runs"], {"run_ids": ended})
        return ended

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
        return _record(row, steps, executions)

    async def get_run_head(self, run_id: UUID) -> RunRecord | None:
        row = await self._one("get_run", {"run_id": run_id})
        return None if row is None else _record(row)

    async def list_runs(self, query: RunQuery) -> Sequence[RunRecord]:
        params: dict[str, Any] = {
            "task_name": query.task_name,
            "task_version": query.task_version,
            "status": query.status,
            "parent_run_id": query.parent_run_id,
            "concurrency_key": query.concurrency_key,
            "idempotency_key": query.idempotency_key,
            "worker_id": query.worker_id,
            "needs_attention": query.needs_attention,
            "created_after": query.created_after,
            "created_before": query.created_before,
            "finished_after": query.finished_after,
            "finished_before": query.finished_before,
            "before": query.before,
            "limit": query.limit,
        }
        if query.tags:
            # Driven by the tag index (run_tags_lookup) of the first tag, in run-id order.
            tag_key, tag_value = min(query.tags.items())
            params |= {"tag_key": tag_key, "tag_value": tag_value, "tags": Jsonb(dict(query.tags))}
            name = "list_runs_tagged"
        else:
            name = "list_runs"
        # Never prepared: each page is planned with its values, so a filter left out (NULL)
        # costs nothing and the index of the filters given is used (tests/integration/
        # test_listing_plans.py); a generic plan would have to serve every filter at once.
        with wrap_exceptions():
            async with self._pool.connection() as conn:
                cur = conn.cursor(row_factory=dict_row)
                await cur.execute(self._q[name], params, prepare=False)
                rows = await cur.fetchall()
        return [_record(r) for r in rows]

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
        await self._wakeups.wait_for_work(pairs=pairs, timeout=timeout)

    async def wait_for_run(self, run_id: UUID, *, timeout: float) -> None:
        await self._wakeups.wait_for_run(run_id, timeout=timeout)

    def add_cancel_listener(self, listener: Callable[[UUID, str], None]) -> Callable[[], None]:
        return self._wakeups.add_cancel_listener(listener)

    # -- child groups (ChildGroupStore) --------------------------------------------------------

    async def start_group(
        self, group: ChildGroup, runs: Sequence[NewRun]
    ) -> Sequence[EnqueueResult]:
        """One statement for the whole group, however many children (arrays, unnested)."""
        params = {
            "parent_run_id": group.parent_run_id,
            "name": group.name,
            "max_concurrency": group.max_concurrency,
            "ids": [new.run_id for new in runs],
            "task_names": [new.task_name for new in runs],
            "task_versions": [new.task_version for new in runs],
            "priorities": [new.priority for new in runs],
            "keys": [new.idempotency_key for new in runs],
            "hashes": [new.input_hash for new in runs],
            "inputs": [new.input_json for new in runs],
            "rate_limits": [new.rate_limit for new in runs],
            "rate_keys": [new.rate_limit_key for new in runs],
            "trace_context": Jsonb(dict(runs[0].trace_context) if runs else {}),
            "cancel_with_parent": bool(runs) and runs[0].cancel_with_parent,
            "timeout": runs[0].timeout if runs else None,
            "channel": self.work_channel,
        }
        with wrap_exceptions():
            async with self._pool.connection() as conn, conn.transaction():
                cur = await conn.execute(self._q["start_group"], params)
                row = await cur.fetchone()
                if row is not None and row[0] and row[1] != len(runs):
                    raise IdempotencyConflictError(  # rolls the group back
                        f"start_group {group.name!r}: {len(runs) - row[1]} of its children's "
                        "idempotency keys name runs that already exist",
                        idempotency_key=runs[0].idempotency_key or "",
                    )
                if row is not None and row[0]:
                    return [
                        EnqueueResult(
                            run_id=new.run_id, created=True, task_version=new.task_version
                        )
                        for new in runs
                    ]
                cur = await conn.execute(self._q["group_members"], params)
                members = await cur.fetchall()
        return [
            EnqueueResult(run_id=run_id, created=False, task_version=version, input_hash=hashed)
            for run_id, hashed, version in members
        ]

    async def join_group(self, group: ChildGroup, run_ids: Sequence[UUID]) -> int:
        row = await self._one(
            "join_group",
            {"parent_run_id": group.parent_run_id, "name": group.name, "ids": list(run_ids)},
        )
        found, left_over = (row["found"], row["left_over"]) if row else (0, 0)
        if found != len(run_ids):
            raise RunNotFoundError(
                f"join_group {group.name!r}: only {found} of the {len(run_ids)} runs are "
                f"children of run {group.parent_run_id}",
                run_id=group.parent_run_id,
            )
        return int(left_over)

    async def group_runs(self, *, parent_run_id: UUID, name: str) -> Sequence[RunRecord]:
        rows = await self._all("group_runs", {"parent_run_id": parent_run_id, "name": name})
        return [_record(r) for r in rows]

    # -- streams (StreamStore) -----------------------------------------------------------------

    async def append_stream(
        self, lease: Lease, appends: Sequence[StreamAppend]
    ) -> Sequence[StreamEntry]:
        """One statement per value (one for a single value, the SDK's case; several in one
        transaction for a batch); the followers' NOTIFY follows in the background
        (`_notifier`), so the write never waits on the server-wide NOTIFY lock."""
        params = [
            {
                "run_id": lease.run_id,
                "token": lease.fencing_token,
                "name": append.stream,
                "key": append.key,
                "value": append.value_json,
            }
            for append in appends
        ]
        rows: list[dict[str, Any] | None] = []
        if len(params) == 1:
            rows.append(await self._one("append_stream", params[0]))
        elif params:
            with wrap_exceptions():
                async with self._pool.connection() as conn, conn.transaction():
                    cur = conn.cursor(row_factory=dict_row)
                    for one in params:
                        await cur.execute(self._q["append_stream"], one)
                        rows.append(await cur.fetchone())
        entries = []
        new = False
        for append, row in zip(appends, rows, strict=True):
            if row is None or not row["held"] or row["seq"] is None:
                raise self._fenced(lease, f"writing to stream {append.stream!r}")
            new = new or row["new"]
            entries.append(
                _stream_entry(
                    {**row, "run_id": lease.run_id, "name": append.stream, "key": append.key}
                )
            )
        if new:
            self._streams.notify(str(lease.run_id))
        return entries

    async def read_stream(
        self, run_id: UUID, stream: str, *, after: int, limit: int
    ) -> Sequence[StreamEntry]:
        rows = await self._all(
            "read_stream", {"run_id": run_id, "name": stream, "after": after, "limit": limit}
        )
        return [_stream_entry(row) for row in rows]

    async def last_stream_entries(
        self, run_ids: Sequence[UUID], stream: str | None = None
    ) -> Sequence[StreamEntry]:
        rows = await self._all("last_stream_entries", {"run_ids": list(run_ids), "name": stream})
        return [_stream_entry(row) for row in rows]

    async def wait_for_stream(
        self, run_id: UUID, stream: str, *, after: int, timeout: float
    ) -> None:
        del stream, after  # hints name the run: a follower reads again after any of them
        await self._wakeups.wait_for_stream(run_id, timeout=timeout)

    # -- schedules (ScheduleStore) -------------------------------------------------------------

    @staticmethod
    def _schedule_params(state: ScheduleState) -> dict[str, Any]:
        return {
            "name": state.name,
            "task_name": state.task_name,
            "cron": state.cron,
            "timezone": state.timezone,
            "input": state.input_json,
            "overlap": state.overlap,
            "catchup_window": state.catchup_window,
            "paused": state.paused,
            "next_tick": state.next_tick,
            "last_tick": state.last_tick,
            "last_run_id": state.last_run_id,
            "buffered_tick": state.buffered_tick,
        }

    async def create_schedule(self, state: ScheduleState) -> bool:
        return await self._one("insert_schedule", self._schedule_params(state)) is not None

    async def get_schedule(self, name: str) -> ScheduleRecord | None:
        row = await self._one("get_schedule", {"name": name})
        return None if row is None else _schedule_record(row)

    async def list_schedules(self, query: ScheduleQuery) -> Sequence[ScheduleRecord]:
        names = None if query.task_names is None else list(query.task_names)
        rows = await self._all("list_schedules", {"task_names": names, "due": query.due_only})
        return [_schedule_record(row) for row in rows]

    async def update_schedule(self, state: ScheduleState, *, expected_version: int) -> bool:
        params = {**self._schedule_params(state), "expected_version": expected_version}
        return await self._one("update_schedule", params) is not None

    async def delete_schedule(self, name: str) -> bool:
        return await self._one("delete_schedule", {"name": name}) is not None

    # -- pause (LifecycleStore) ----------------------------------------------------------------

    async def pause_task(self, *, task_name: str, task_version: int | None) -> bool:
        row = await self._one(
            "pause_task", {"task_name": task_name, "task_version": task_version or 0}
        )
        return bool(row and row["stored"])

    async def resume_task(self, *, task_name: str, task_version: int | None) -> bool:
        row = await self._one(
            "resume_task",
            {"task_name": task_name, "task_version": task_version, "channel": self.work_channel},
        )
        return bool(row and row["deleted"])

    async def list_paused_tasks(self) -> Sequence[PausedTask]:
        rows = await self._all("list_paused_tasks", {})
        return [
            PausedTask(
                task_name=r["task_name"],
                task_version=r["task_version"] or None,
                paused_at=r["paused_at"],
            )
            for r in rows
        ]

    # -- what operators look at (InsightStore) ---------------------------------------------------

    async def record_worker(self, state: WorkerState) -> None:
        # Committed without waiting for the WAL flush: a lost report is repeated seconds later.
        await self._all_async_commit(
            "record_worker",
            {
                "worker_id": state.worker_id,
                "host": state.host,
                "pid": state.pid,
                "pairs": Jsonb([{"name": p.name, "version": p.version} for p in state.pairs]),
                "concurrency": state.concurrency,
                "runs_held": state.runs_held,
                "started_at": state.started_at,
                "stopped": state.stopped,
            },
        )

    async def list_workers(self, *, limit: int) -> Sequence[WorkerRecord]:
        rows = await self._all("list_workers", {"limit": limit})
        return [
            WorkerRecord(
                worker_id=r["worker_id"],
                host=r["host"],
                pid=r["pid"],
                pairs=tuple(TaskPair(name=p["name"], version=p["version"]) for p in r["pairs"]),
                concurrency=r["concurrency"],
                runs_held=r["runs_held"],
                started_at=r["started_at"],
                last_seen_at=r["last_seen_at"],
                stopped_at=r["stopped_at"],
                observed_at=r["db_now"],
            )
            for r in rows
        ]

    async def forget_workers(self, *, seen_before: datetime) -> int:
        row = await self._one("forget_workers", {"seen_before": seen_before})
        return int(row["forgotten"]) if row else 0

    async def pair_activity(self) -> Sequence[PairActivity]:
        rows = await self._all("pair_activity", {})
        return [
            PairActivity(
                task_name=r["task_name"],
                task_version=r["task_version"],
                pending=r["pending"],
                running=r["running"],
                waiting=r["waiting"],
                oldest_due_at=r["oldest_due_at"],
                observed_at=r["db_now"],
            )
            for r in rows
        ]

    async def finished_counts(
        self, *, since: datetime, bucket: timedelta
    ) -> Sequence[FinishedCount]:
        rows = await self._all("finished_counts", {"since": since, "bucket": bucket})
        return [
            FinishedCount(
                task_name=r["task_name"],
                task_version=r["task_version"],
                status=r["status"],
                bucket_start=r["bucket_start"],
                runs=r["runs"],
            )
            for r in rows
        ]

    async def key_usage(self, *, limit: int) -> Sequence[KeyUsage]:
        rows = await self._all("key_usage", {"limit": limit})
        return [
            KeyUsage(
                task_name=r["task_name"],
                concurrency_key=r["concurrency_key"],
                limit=r["slot_limit"],
                holding=r["holding"],
                wanting=r["wanting"],
            )
            for r in rows
        ]

    # -- rate limits (RateLimitStore) ----------------------------------------------------------

    @staticmethod
    def _rate_limit(row: Mapping[str, Any]) -> RateLimitInfo:
        return RateLimitInfo(
            name=row["name"],
            limit=row["token_limit"],
            per=timedelta(microseconds=row["per_us"]),
            paused=row["paused"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
        )

    async def define_rate_limit(self, name: str, *, limit: int, per: timedelta) -> RateLimitInfo:
        row = await self._one(
            "define_rate_limit",
            {"name": name, "limit": limit, "per_us": per // timedelta(microseconds=1)},
        )
        assert row is not None
        return self._rate_limit(row)

    async def _unpark(
        self,
        conn: psycopg.AsyncConnection[Any],
        name: str,
        rescale: tuple[int, int] | None = None,
    ) -> None:
        """In the transaction that changed or resumed the limit: wait for the takes in flight
        (their parks committed), rescale the buckets to a new interval (`rescale`: old and
        new, in microseconds), then make the runs it parked claimable."""
        await conn.execute(self._q["lock_rate_buckets"], {"name": name})
        if rescale is not None and rescale[0] != rescale[1]:
            await conn.execute(
                self._q["rescale_rate_buckets"],
                {"name": name, "old_us": rescale[0], "new_us": rescale[1]},
            )
        await conn.execute(
            self._q["unpark_rate_limited"], {"name": name, "channel": self.work_channel}
        )

    async def set_rate_limit(self, name: str, *, limit: int, per: timedelta) -> RateLimitInfo:
        with wrap_exceptions():
            async with self._pool.connection() as conn, conn.transaction():
                cur = await conn.cursor(row_factory=dict_row).execute(
                    self._q["set_rate_limit"],
                    {"name": name, "limit": limit, "per_us": per // timedelta(microseconds=1)},
                )
                row = await cur.fetchone()
                assert row is not None
                if row["old_interval_us"] is not None:
                    await self._unpark(conn, name, (row["old_interval_us"], row["interval_us"]))
        return self._rate_limit(row)

    async def get_rate_limit(self, name: str) -> RateLimitInfo | None:
        row = await self._one("get_rate_limit", {"name": name})
        return None if row is None else self._rate_limit(row)

    async def list_rate_limits(self) -> Sequence[RateLimitInfo]:
        return [self._rate_limit(r) for r in await self._all("list_rate_limits", {})]

    async def pause_rate_limit(self, name: str, *, paused: bool) -> bool:
        with wrap_exceptions():
            async with self._pool.connection() as conn, conn.transaction():
                cur = await conn.execute(
                    self._q["pause_rate_limit"], {"name": name, "paused": paused}
                )
                changed = await cur.fetchone() is not None
                if changed and not paused:
                    await self._unpark(conn, name)
        return changed

    async def take_rate_token(self, lease: Lease, request: TokenRequest) -> TokenGrant:
        row = await self._one(
            "take_rate_token",
            {
                "run_id": lease.run_id,
                "token": lease.fencing_token,
                "step": request.step,
                "attempt": request.attempt,
                "limit": request.limit,
                "key": request.key,
            },
        )
        assert row is not None
        if not row["held"]:
            raise self._fenced(lease, f"take a token of rate limit {request.limit!r}")
        if row["granted"] or row["state"] == "taken":
            return TokenGrant(status="granted", observed_at=row["db_now"])
        status = row["state"]
        return TokenGrant(
            status=status,
            next_at=row["next_at"] if status == "wait" else None,
            observed_at=row["db_now"],
        )

    # -- retention (RetentionStore) --------------------------------------------------------------

    def _prune_params(self, query: PruneQuery) -> dict[str, Any]:
        return {
            "older_than": query.older_than,
            "task_names": None if query.task_names is None else list(query.task_names),
            "exclude_task_names": list(query.exclude_task_names),
            "limit": query.limit,
            "lock_name": f"{self.schema}.prune",
        }

    async def prune_runs(self, query: PruneQuery) -> PruneBatch:
        row = await self._one("prune_runs", self._prune_params(query))
        assert row is not None  # one row, always
        return PruneBatch(pruned=row["pruned"], busy=not row["held"])

    async def count_prunable(self, query: PruneQuery) -> int:
        row = await self._one("count_prunable", self._prune_params(query))
        assert row is not None
        return int(row["prunable"])

    async def get_pruned(self, run_id: UUID) -> PrunedRun | None:
        row = await self._one("get_pruned", {"run_id": run_id})
        return None if row is None else _pruned_run(row)

    async def forget_pruned(self, *, older_than: timedelta, limit: int) -> PruneBatch:
        params = {"older_than": older_than, "limit": limit, "lock_name": f"{self.schema}.prune"}
        row = await self._one("forget_pruned", params)
        assert row is not None
        return PruneBatch(pruned=row["pruned"], busy=not row["held"])

    def ledger(self, conn: Any) -> PostgresLedger:
        if not isinstance(conn, psycopg.AsyncConnection):
            raise UsageError(
                "with_attempt_token on Postgres takes a psycopg.AsyncConnection to your "
                f"business database, got {type(conn).__name__}",
                argument="conn",
            )
        return PostgresLedger(self._database, conn)

    async def shares_database_with(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Whether `conn` is on the engine's database: the same server and the same database.

        Asked, not guessed from names: `conn` takes a session advisory lock on two random keys
        and releases it at once, and the engine's pool looks for that lock, held by that
        backend process, in its own database (locks belong to one server and one database).
        Another database that happens to hold a schema of the same name answers False. The
        answer is cached per (host, port, database) of `conn`. Used by the ledger and the
        outbox alike.
        """
        return await self._database.shares_database_with(conn)

    async def close(self) -> None:
        await self._wakeups.close()
        await self._checkpoints.close()
        await self._transactions.close()
        await self._notifier.close()
        await self._endings.close()
        await self._streams.close()
        await self._pool.close()


def _shared(
    pool: AsyncConnectionPool[Any],
) -> Callable[[], Awaitable[AsyncConnectionPool[Any]]]:
    async def shared() -> AsyncConnectionPool[Any]:
        return pool

    return shared


def _json_texts(values: Sequence[Mapping[str, str]]) -> list[str]:
    """Mappings as JSON text, one per run; a batch that shares one (the usual case) encodes it
    once."""
    texts: list[str] = []
    last: Mapping[str, str] | None = None
    text = ""
    for value in values:
        if value is not last:
            last, text = value, json.dumps(dict(value), separators=(",", ":"))
        texts.append(text)
    return texts
