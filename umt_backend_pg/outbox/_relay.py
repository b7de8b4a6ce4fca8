"""The outbox relay's lifecycle: start and stop, its loop, outages, listening and connections."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import timedelta
from typing import Any, Literal, TypeAlias
from uuid import UUID

import psycopg
from opentelemetry.trace import TracerProvider
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from umt_backend_pg import _args
from umt_backend_pg._args import described
from umt_backend_pg._backend import PostgresBackend
from umt_backend_pg._sql import blocks
from umt_backend_pg.outbox._dispatch import Dispatcher, DispatchReport, TaskRef
from umt_backend_pg.outbox._schema import channel_name, outbox_sql
from umt_sdk import Engine, TaskDefinition
from umt_sdk.backend import CodecBackend
from umt_sdk.exceptions import BackendError, UsageError

__all__ = ["OutboxRelay"]

_log = logging.getLogger("umt.outbox")

Route: TypeAlias = "TaskRef | tuple[TaskRef, Callable[[Any], Any]]"
RelayMode: TypeAlias = Literal["auto", "same_database", "separate"]
ConnOrPool: TypeAlias = "str | psycopg.AsyncConnection[Any] | AsyncConnectionPool[Any]"


def _backoff(failures: int) -> float:
    """The relay's pause after its n-th failure in a row: 0.4 s doubling, at most 30 s."""
    return float(min(0.2 * 2 ** min(failures, 8), 30.0))


class _Outage:
    """Log a failing loop once per outage (then at debug level), and its recovery."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.since: float | None = None
        self.failures = 0

    def failed(self, message: str, retry_in: float, exc: BaseException | None = None) -> None:
        self.failures += 1
        if self.since is None:
            self.since = time.monotonic()
            expected = exc is None or isinstance(exc, _EXPECTED_FAILURES)
            _log.log(
                logging.WARNING if expected else logging.ERROR,
                "%s: %s; retrying with backoff until it works",
                self.what,
                message,
                exc_info=None if expected else exc,
            )
        else:
            _log.debug("%s: %s; again in %.1f s", self.what, message, retry_in)

    def succeeded(self) -> None:
        if self.since is not None:
            _log.info(
                "%s works again after %.1f s (%d failed attempts)",
                self.what,
                time.monotonic() - self.since,
                self.failures,
            )
        self.since = None
        self.failures = 0


# Failures a database restart or a cut connection causes; anything else is logged with its
# traceback (it may be a bug or a misconfiguration), but the relay keeps trying all the same.
# FencingError is deliberately not here (it is no BackendError): the relay holds no lease, so
# one reaching this loop is a bug, and is logged with its traceback.
_EXPECTED_FAILURES = (psycopg.Error, OSError, TimeoutError, BackendError)
_LISTEN_CHECK = 10.0
"""Seconds without a notification after which a LISTEN connection is pinged."""


class OutboxRelay:
    """Dispatches outbox rows to runs. Use `run()`, `run_once()` or `async with relay:`.

    Args:
        conn_or_pool: the business database: a URL, a psycopg `AsyncConnection` (used only by
            this relay), or an `AsyncConnectionPool`.
        engine: where runs are enqueued.
        routes: event type -> task (the payload is the input), or -> (task, mapper) where
            `mapper(payload)` builds the input. A task is a definition or a name (newest
            version at dispatch time).
        batch_size: rows claimed per transaction.
        max_attempts: failed dispatches after which a row is `dead`.
        backoff / max_backoff: the delay after the n-th failure is backoff * 2^(n-1), capped.
        poll_interval: how long an idle relay waits when no NOTIFY comes.
        mode: "auto" (detect), "same_database" (required: the enqueue commits with the row's
            status) or "separate" (enqueue, then mark; safe anywhere thanks to the key).
        concurrency: with separate databases, how many rows of a batch are enqueued at once
            (1 keeps the rows' order; on one database they share the relay's transaction and
            go one by one).
        listen: wake on the insert trigger's NOTIFY (False: poll only).
        tracer_provider: for the per-row dispatch spans (the global one by default).
    """

    def __init__(
        self,
        conn_or_pool: ConnOrPool,
        engine: Engine,
        routes: Mapping[str, Route],
        *,
        schema: str = "public",
        table: str = "outbox_event",
        batch_size: int = 100,
        max_attempts: int = 10,
        backoff: timedelta = timedelta(seconds=1),
        max_backoff: timedelta = timedelta(minutes=5),
        poll_interval: timedelta = timedelta(seconds=5),
        mode: RelayMode = "auto",
        concurrency: int = 8,
        listen: bool = True,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        if not isinstance(conn_or_pool, str | psycopg.AsyncConnection | AsyncConnectionPool):
            raise UsageError(
                "OutboxRelay takes a database URL, a psycopg.AsyncConnection or an "
                f"AsyncConnectionPool as conn_or_pool, got {described(conn_or_pool)}",
                argument="conn_or_pool",
            )
        if not isinstance(engine, Engine):
            raise UsageError(
                f"OutboxRelay needs an umt Engine as engine, got {described(engine)}",
                argument="engine",
            )
        if not isinstance(mode, str) or mode not in ("auto", "same_database", "separate"):
            raise UsageError(
                f"mode must be 'auto', 'same_database' or 'separate', got {described(mode)}",
                argument="mode",
            )
        where = "OutboxRelay"
        _args.integer(batch_size, "batch_size", at_least=1, at_most=10_000, where=where)
        _args.integer(concurrency, "concurrency", at_least=1, at_most=1000, where=where)
        _args.integer(max_attempts, "max_attempts", at_least=1, where=where)
        for what, value in (
            ("backoff", backoff),
            ("max_backoff", max_backoff),
            ("poll_interval", poll_interval),
        ):
            _args.duration(value, what, where=where)
        if not isinstance(routes, Mapping):
            _args.refuse("routes", "a mapping of event type -> task", routes, where=where)
        _args.flag(listen, "listen", where=where)
        if tracer_provider is not None and not isinstance(tracer_provider, TracerProvider):
            _args.refuse(
                "tracer_provider",
                "an OpenTelemetry TracerProvider, or None",
                tracer_provider,
                where=where,
            )
        self._source = conn_or_pool
        self.engine = engine
        self.schema = schema
        self.table = table
        self._q = {name: outbox_sql(name, schema, table) for name in blocks("outbox.sql")}
        self.channel = channel_name(schema, table)
        self.routes: dict[str, tuple[TaskRef, Callable[[Any], Any] | None]] = {}
        for event_type, route in routes.items():
            if not isinstance(event_type, str) or not event_type:
                _args.refuse("routes", "keyed by event type (a string)", event_type, where=where)
            if isinstance(route, tuple) and len(route) == 2:
                target, mapper = route
                if not callable(mapper):
                    raise UsageError(
                        f"route {event_type!r}: the mapper must be callable, got "
                        f"{described(mapper)}",
                        argument="routes",
                    )
            else:
                target, mapper = route, None
            if not isinstance(target, TaskDefinition | str):
                _args.refuse(
                    "routes",
                    f"a task (a definition or a name), or (task, mapper), for {event_type!r}",
                    target,
                    where=where,
                )
            engine.registry.resolve(target)  # an unknown or stale task fails here, not later
            self.routes[event_type] = (target, mapper)
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.poll_interval = poll_interval
        self.mode: RelayMode = mode
        self.concurrency = concurrency
        self._same_database: bool | None = False if mode == "separate" else None
        self._listen = listen
        self._dispatcher = Dispatcher(self, queries=self._q, tracer_provider=tracer_provider)
        self._own_conn: psycopg.AsyncConnection[Any] | None = None
        self._batch_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._listener: asyncio.Task[None] | None = None
        self._listening_on_batch_conn = False
        self._task: asyncio.Task[None] | None = None
        self._install_id: UUID | None = None
        self._legacy_keys_below = 0
        self.totals = DispatchReport()
        """What this relay did so far, summed over its batches."""

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> OutboxRelay:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self) -> asyncio.Task[None]:
        """Run the relay in a background task (what `async with relay:` does)."""
        if self._task is not None and not self._task.done():
            raise RuntimeError("this OutboxRelay is already running")
        self._stopping.clear()  # here, not in the task: a stop() right after start() holds
        self._task = asyncio.create_task(self._loop(), name=f"umt-outbox-relay-{self.table}")
        return self._task

    async def stop(self) -> None:
        """Stop gracefully: the batch in progress is finished and committed, then run() returns."""
        self._stopping.set()
        self._wake.set()
        if self._task is not None:
            task, self._task = self._task, None
            await task
        await self.close()

    async def close(self) -> None:
        """Close the connection the relay opened itself (with a URL); `stop()` does it too."""
        await self._close_own()

    @property
    def same_database(self) -> bool | None:
        """Whether enqueues share the relay's transaction (None until the first batch)."""
        return self._same_database

    @property
    def install_id(self) -> UUID | None:
        """The outbox table's install id (read at the first batch; None until then)."""
        return self._install_id

    def default_key(self, event_id: int) -> str:
        """The idempotency key of the run of event `event_id` when its row names none:
        `outbox:<install id>:<schema>.<table>:<id>`; rows that existed when an outbox of an
        older umt was upgraded keep the key they had then, `outbox:<id>`."""
        _args.integer(event_id, "event_id", at_least=1, where="OutboxRelay.default_key")
        if self._install_id is None:
            raise RuntimeError("the install id is read at the relay's first batch: run it first")
        if event_id < self._legacy_keys_below:
            return f"outbox:{event_id}"
        return f"outbox:{self._install_id}:{self.schema}.{self.table}:{event_id}"

    async def run(self) -> None:
        """Dispatch until `stop()`: batches back to back while rows are due, then wait for a
        NOTIFY from the insert trigger, the next retry's time, or `poll_interval`."""
        self._stopping.clear()
        await self._loop()

    async def _loop(self) -> None:
        """Batches until stop(). Survives anything a batch or a wait raises (a restart of
        either database, a cut connection, an error of its own): logs it once per outage,
        backs off (0.4 s doubling, at most 30 s) and resumes; only stop() ends it."""
        business = _Outage(f"outbox relay on {self.schema}.{self.table}")
        engine = _Outage(f"outbox relay on {self.schema}.{self.table}: the engine")
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                try:
                    if self._listen and self._listener is None:
                        await self._start_listening()
                    report = await self.run_once()
                    business.succeeded()
                    if report.engine_unavailable:
                        delay = _backoff(engine.failures + 1)
                        engine.failed("unreachable; its rows stay pending, uncharged", delay)
                        await self._pause(delay)
                        continue
                    engine.succeeded()
                    if report.claimed < self.batch_size:
                        # Inside the retry: its own query can meet a restart or a cut connection.
                        await self._idle()
                except Exception as exc:
                    if self._stopping.is_set():
                        break
                    delay = _backoff(business.failures + 1)
                    business.failed(f"{type(exc).__name__}: {exc}", delay, exc)
                    await self._close_own()
                    await self._pause(delay)
        finally:
            await self._stop_listening()
            await self._close_own()

    async def run_once(self) -> DispatchReport:
        """Claim one batch of due rows and dispatch them; return what happened."""
        async with self._batch_lock, self._connection() as conn:
            if self._same_database is None:
                self._same_database = await self._detect(conn)
            if self._install_id is None:
                self._install_id, self._legacy_keys_below = await self._read_install_id(conn)
            report = await self._dispatcher.dispatch_batch(conn, same_database=self._same_database)
        t = self.totals
        self.totals = DispatchReport(
            claimed=t.claimed + report.claimed,
            dispatched=t.dispatched + report.dispatched,
            created=t.created + report.created,
            retried=t.retried + report.retried,
            dead=t.dead + report.dead,
        )
        return report

    # -- connections ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        source = self._source
        if isinstance(source, AsyncConnectionPool):
            async with source.connection() as conn:
                yield conn
        elif isinstance(source, psycopg.AsyncConnection):
            yield source
        else:
            if self._own_conn is None or self._own_conn.closed or self._own_conn.broken:
                await self._close_own()
                self._own_conn = await psycopg.AsyncConnection.connect(source, autocommit=True)
            yield self._own_conn

    async def _close_own(self) -> None:
        conn, self._own_conn = self._own_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _conninfo(self) -> tuple[str, dict[str, Any]] | None:
        source = self._source
        if isinstance(source, str):
            return source, {}
        if isinstance(source, AsyncConnectionPool):
            conninfo: Any = source.conninfo
            kwargs: Any = source.kwargs
            if callable(conninfo):  # psycopg_pool's dynamic conninfo
                conninfo = conninfo()
                if inspect.isawaitable(conninfo):
                    conninfo = await conninfo
            if callable(kwargs):
                kwargs = kwargs()
                if inspect.isawaitable(kwargs):
                    kwargs = await kwargs
            return str(conninfo), dict(kwargs or {})
        return None  # a single connection: it listens itself, between batches

    async def _start_listening(self) -> None:
        if await self._conninfo() is None:
            if not self._listening_on_batch_conn:
                conn = self._source
                assert isinstance(conn, psycopg.AsyncConnection)
                async with self._batch_lock, conn.transaction():
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                self._listening_on_batch_conn = True
            return
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._listener = asyncio.create_task(self._listen_loop(ready), name="umt-outbox-listen")
        await asyncio.wait({ready, self._listener}, timeout=10, return_when="FIRST_COMPLETED")

    async def _listen_loop(self, ready: asyncio.Future[None]) -> None:
        # A notification only wakes a batch (which reads the table): its payload is ignored.
        delay = 0.1
        outage = _Outage(f"outbox LISTEN on {self.channel}")
        while not self._stopping.is_set():
            try:
                info = await self._conninfo()
                assert info is not None
                conninfo, kwargs = info
                kwargs["autocommit"] = True
                async with await psycopg.AsyncConnection.connect(conninfo, **kwargs) as conn:
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                    if not ready.done():
                        ready.set_result(None)
                    delay = 0.1
                    outage.succeeded()
                    self._wake.set()  # rows written while we were not listening
                    while not self._stopping.is_set():
                        async for _ in conn.notifies(timeout=_LISTEN_CHECK):
                            self._wake.set()
                        # Quiet for a while: is the connection still there (a cut that sent
                        # no reset would leave us deaf; the relay would only poll)?
                        await asyncio.wait_for(conn.execute(self._q["ping"]), _LISTEN_CHECK)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stopping.is_set():
                    return
                outage.failed(f"connection lost ({exc}); polling meanwhile", delay, exc)
                if not ready.done():
                    ready.set_result(None)  # run() polls meanwhile
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await listener

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _idle(self) -> None:
        """Wait for a NOTIFY, the next due retry, `poll_interval`, or stop()."""
        timeout = self.poll_interval.total_seconds()
        async with self._connection() as conn:
            cur = await conn.execute(self._q["next_due"])
            row = await cur.fetchone()
            if not conn.autocommit:
                await conn.commit()
        if row is not None and row[0] is not None:
            # due now but skipped: another relay holds them; look again soon in case it died
            timeout = min(timeout, max(float(row[0]), 0.5 if row[0] == 0 else 0.01))
        if self._wake.is_set() or self._stopping.is_set():
            return
        if self._listening_on_batch_conn:
            # psycopg keeps notifications that arrive during a batch's queries in a backlog
            # that notifies() yields first, so none is lost between two waits.
            batch_conn = self._source
            assert isinstance(batch_conn, psycopg.AsyncConnection)
            deadline = time.monotonic() + timeout
            while not (self._wake.is_set() or self._stopping.is_set()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                async with self._batch_lock:
                    notes = batch_conn.notifies(timeout=min(remaining, 0.2), stop_after=1)
                    async for _ in notes:
                        self._wake.set()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _read_install_id(self, conn: psycopg.AsyncConnection[Any]) -> tuple[UUID, int]:
        """The table's install id; an outbox installed by an older umt has none: say how to
        add it (nothing is dispatched meanwhile: the old default key could collide)."""
        try:
            async with conn.transaction():
                cur = await conn.execute(self._q["install_id"])
                row = await cur.fetchone()
        except psycopg.errors.UndefinedTable:
            row = None
        if row is None:
            raise BackendError(
                f"outbox table {self.schema}.{self.table} has no install id (it was installed "
                "by an older umt): apply install_outbox(conn, schema="
                f"{self.schema!r}, table={self.table!r}) again, or the SQL of outbox_ddl(...); "
                "it only adds what is missing"
            )
        install_id: UUID = row[0]
        legacy_keys_below: int = row[1]
        return install_id, legacy_keys_below

    async def _detect(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Same database iff the engine's pool sees an advisory lock this connection holds."""
        backend = self.engine.backend
        if isinstance(backend, CodecBackend):  # a codec in front: ask the store behind it
            backend = backend.inner
        if not isinstance(backend, PostgresBackend):
            if self.mode == "same_database":
                raise UsageError(
                    "mode='same_database' needs the engine on the Postgres backend, got "
                    f"{type(backend).__name__}",
                    argument="mode",
                )
            return False
        async with conn.transaction():
            same = await backend.shares_database_with(conn)
        if self.mode == "same_database" and not same:
            raise UsageError(
                "mode='same_database', but the relay's connection and the engine's backend are "
                "not on the same database; use mode='separate' (or 'auto')",
                argument="mode",
            )
        _log.info(
            "outbox relay on %s.%s: %s",
            self.schema,
            self.table,
            "same database as the engine (transactional enqueue)"
            if same
            else "separate databases (enqueue, then mark dispatched)",
        )
        return same
