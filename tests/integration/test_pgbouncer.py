"""The engine through a real PgBouncer in transaction pool mode (tests/fixtures/pgbouncer.py).

- The whole contract suite through the pooler, twice: workers polling (`listen=False`), and
  workers with everything pooled but a direct connection for LISTEN (`listen_url=`).
- psycopg's automatic prepared statements break under transaction pooling (PgBouncer 1.18,
  Debian 12's, has no `max_prepared_statements`), and `pooled=True` turns them off.
- Nothing session-scoped is left on the pooler's server connections (the migration lock, the
  same-database probe).
- Worker processes through the pooler complete a workload while one is SIGKILLed mid-run.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests._procs.support import Spawner, eventually, fetch, q
from tests.fixtures import pgbouncer
from tests.fixtures.pg import PostgresHarness
from tests.integration.checks import check_t_io_exactly_once
from tests.integration.tasks import BUSINESS, TASKS, Job, create_tables, t_io
from umt_backend_pg import PostgresBackend, migrate
from umt_sdk import Engine, Registry, connect
from umt_sdk.exceptions import BackendError, UsageError
from umt_sdk.testing import BackendContract

pytestmark = pytest.mark.backend("pg")


class PooledHarness(PostgresHarness):
    """The contract suite's Postgres, with the engine and the business connections through
    PgBouncer; `listen_url` (direct) or none (workers poll)."""

    def __init__(self, url: str, schema: str, *, pooled_url: str, listen_url: str | None) -> None:
        super().__init__(url, schema)
        self.pooled_url = pooled_url
        self.listen_url = listen_url

    async def connect(self, registry: Registry) -> Engine:
        await super().connect(registry)  # the receipts table (direct); that engine is unused
        listening: dict[str, Any] = (
            {"listen_url": self.listen_url} if self.listen_url else {"listen": False}
        )
        return await connect(
            self.pooled_url,
            registry=registry,
            schema=self.schema,
            run_migrations=False,
            max_size=8,
            pooled=True,
            **listening,
        )

    async def business_connection(self) -> Any:
        return await psycopg.AsyncConnection.connect(
            self.pooled_url, autocommit=True, prepare_threshold=None
        )


class TestContractThroughPgBouncerPolling(BackendContract):
    @pytest.fixture
    def harness(self, pg_url: str, pg_schema: str, pgbouncer_url: str) -> PooledHarness:
        return PooledHarness(pg_url, pg_schema, pooled_url=pgbouncer_url, listen_url=None)


class TestContractThroughPgBouncerListeningDirect(BackendContract):
    @pytest.fixture
    def harness(self, pg_url: str, pg_schema: str, pgbouncer_url: str) -> PooledHarness:
        return PooledHarness(pg_url, pg_schema, pooled_url=pgbouncer_url, listen_url=pg_url)


# -- prepared statements --------------------------------------------------------------------------


class _Shuffler:
    """Makes a client's next transaction run on another server connection: a second client
    opens a transaction, which PgBouncer gives the server connection used last (LIFO)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.blocker: psycopg.AsyncConnection[Any] | None = None

    async def __aenter__(self) -> _Shuffler:
        self.blocker = await psycopg.AsyncConnection.connect(
            self.url, autocommit=True, prepare_threshold=None
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.blocker is not None
        await self.blocker.close()

    async def around(self, action: Any) -> list[int]:
        """Run `action()` (which returns the server pid it ran on) twice, with the server
        connection of the first held by the blocker during the second."""
        assert self.blocker is not None
        first = await action()
        async with self.blocker.transaction():
            held = await (await self.blocker.execute("SELECT pg_backend_pid()")).fetchone()
            second = await action()
        assert held is not None
        return [first, held[0], second]


async def test_automatic_prepared_statements_break_under_transaction_pooling(
    pgbouncer_url: str,
) -> None:
    """Why `pooled=True` turns them off: prepared on one server connection, executed on
    another. (PgBouncer >= 1.21 could track them with `max_prepared_statements`, off by
    default; Debian 12 ships 1.18.)"""
    print(f"PgBouncer {'.'.join(map(str, pgbouncer.version()))}")
    async with (
        await psycopg.AsyncConnection.connect(
            pgbouncer_url, autocommit=True, prepare_threshold=0
        ) as conn,
        _Shuffler(pgbouncer_url) as shuffler,
    ):

        async def pid() -> int:
            row = await (await conn.execute("SELECT pg_backend_pid() + %s", (0,))).fetchone()
            assert row is not None
            return int(row[0])

        with pytest.raises(psycopg.errors.InvalidSqlStatementName, match="does not exist"):
            await shuffler.around(pid)


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "not-pooled"])
async def test_pooled_backend_survives_server_connection_changes(
    pgbouncer_url: str, pg_schema: str, pooled: bool
) -> None:
    """One client connection (max_size=1), its reads moved from server to server more times
    than psycopg's prepare threshold (5): with `pooled=True` every one works; without it,
    a read fails once psycopg has prepared it (or runs another client's statement of the same
    name that the server connection holds)."""
    options: dict[str, Any] = {"pooled": True} if pooled else {}
    engine = await connect(
        pgbouncer_url,
        registry=Registry(TASKS),
        schema=pg_schema,
        run_migrations=False,
        min_size=1,
        max_size=1,
        listen=False,
        idle_in_transaction_timeout=None,
        **options,
    )
    backend = engine.backend
    assert isinstance(backend, PostgresBackend)
    handle = await engine.enqueue(t_io, Job(key="prepared"), version=1)
    servers: set[int] = set()

    async def read() -> int:
        info = await engine.get(handle.run_id)
        assert info.status == "pending"
        async with backend._pool.connection() as conn:
            row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
        assert row is not None
        return int(row[0])

    try:
        async with _Shuffler(pgbouncer_url) as shuffler:
            if pooled:
                for _ in range(8):
                    first, held, second = await shuffler.around(read)
                    servers.update((first, second))
                    assert second != held
                assert len(servers) >= 2, f"the reads never changed server connection: {servers}"
            else:
                failed: list[BackendError] = []
                for _ in range(8):
                    try:
                        await shuffler.around(read)
                    except BackendError as exc:
                        failed.append(exc)
                        break
                assert failed, "reads moved between servers, prepared, and never failed"
                # "prepared statement ... does not exist", or worse: another client's statement
                # of the same name on that server connection, bound to these parameters.
                print(f"without pooled=True: {failed[0]}")
    finally:
        await engine.close()


# -- session state --------------------------------------------------------------------------------


async def _advisory_locks(url: str) -> list[dict[str, Any]]:
    return await fetch(url, "SELECT pid, classid, objid FROM pg_locks WHERE locktype = 'advisory'")


async def test_migrations_through_the_pooler_leave_no_lock_behind(
    pg_url: str, pgbouncer_url: str
) -> None:
    """Concurrent migrations through the pooler queue on a transaction lock, and leave no
    advisory lock on any server connection (a session lock taken in one statement and
    released in another could be released on another server connection, or not at all)."""
    schema = "t_pooled_migrate"
    try:
        results = await asyncio.gather(*(migrate(pgbouncer_url, schema=schema) for _ in range(3)))
        applied = sorted(len(r) for r in results)
        assert applied[:2] == [0, 0], applied  # applied once, all of it
        assert applied[2] > 0, applied
        assert await _advisory_locks(pg_url) == []
    finally:
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            )


async def test_same_database_probe_through_the_pooler(
    pg_url: str, pg_schema: str, pgbouncer_url: str
) -> None:
    """`shares_database_with` on a pooled business connection answers True and leaves no
    advisory lock held, even while the pooler moves that connection between servers."""
    backend = await PostgresBackend.open(
        pgbouncer_url, schema=pg_schema, run_migrations=False, pooled=True, listen=False
    )
    try:
        async with (
            await psycopg.AsyncConnection.connect(
                pgbouncer_url, autocommit=True, prepare_threshold=None
            ) as business,
            _Shuffler(pgbouncer_url) as shuffler,
        ):

            async def probe() -> int:
                backend._database._same_database.clear()  # ask again, not from the cache
                assert await backend.shares_database_with(business)
                row = await (await business.execute("SELECT pg_backend_pid()")).fetchone()
                assert row is not None
                return int(row[0])

            for _ in range(3):
                await shuffler.around(probe)
        assert await _advisory_locks(pg_url) == []
    finally:
        await backend.close()


async def test_pooled_options_are_checked(pgbouncer_url: str, pg_url: str) -> None:
    with pytest.raises(UsageError, match="LISTEN does not work through a pooler"):
        await PostgresBackend.open(pgbouncer_url, run_migrations=False, pooled=True)
    with pytest.raises(UsageError, match="listen=False opens none"):
        await PostgresBackend.open(
            pgbouncer_url, run_migrations=False, listen=False, listen_url=pg_url
        )
    with pytest.raises(UsageError, match="listen_url is the pooled URL itself"):
        await PostgresBackend.open(
            pgbouncer_url, run_migrations=False, pooled=True, listen_url=pgbouncer_url
        )
    with pytest.raises(UsageError, match="pooled"):
        await PostgresBackend.open(pgbouncer_url, run_migrations=False, pooled="yes")  # type: ignore[arg-type]


async def test_pooled_connections_get_no_session_settings(
    pg_schema: str, pgbouncer_url: str, pg_url: str
) -> None:
    """Direct, every pool connection carries idle_in_transaction_session_timeout; pooled, the
    engine sets nothing on the server connections it happens to run on."""
    direct = await PostgresBackend.open(
        pg_url, schema=pg_schema, run_migrations=False, listen=False, max_size=1
    )
    pooled = await PostgresBackend.open(
        pgbouncer_url, schema=pg_schema, run_migrations=False, pooled=True, listen=False
    )
    try:
        async with direct._pool.connection() as conn:
            row = await (
                await conn.execute("SELECT current_setting('idle_in_transaction_session_timeout')")
            ).fetchone()
        assert row == ("10s",)
        async with pooled._pool.connection() as conn:
            row = await (
                await conn.execute("SELECT current_setting('idle_in_transaction_session_timeout')")
            ).fetchone()
        assert row == ("0",), "a session setting reached a pooled server connection"
    finally:
        await direct.close()
        await pooled.close()


# -- worker processes -----------------------------------------------------------------------------


@pytest.fixture
def pooled_spawner(pgbouncer_url: str, pg_schema: str, tmp_path: Path) -> Iterator[Spawner]:
    fields = {"url": pgbouncer_url, "schema": pg_schema, "business": BUSINESS}
    with Spawner.under(tmp_path, tasks="tests.integration.tasks", **fields) as spawned:
        yield spawned


@pytest.fixture
async def pooled_engine(pg_url: str, pg_schema: str, pgbouncer_url: str) -> AsyncIterator[Engine]:
    await create_tables(pg_url, pg_schema)
    client = await connect(
        pgbouncer_url,
        registry=Registry(TASKS),
        schema=pg_schema,
        run_migrations=False,
        pooled=True,
        listen=False,
    )
    try:
        yield client
    finally:
        await client.close()


@pytest.mark.slow
async def test_workers_through_pgbouncer_survive_a_sigkill(
    pooled_engine: Engine, pooled_spawner: Spawner, pg_url: str, pg_schema: str
) -> None:
    """Three worker processes through PgBouncer (two polling, one listening on a direct
    connection) run 24 four-step runs with a fenced side effect; one is SIGKILLed while it
    holds runs, and the others take them over: every run completes, no completed step runs
    again, each side effect lands once."""
    keys = [f"p{i:02d}" for i in range(24)]
    handles = [await pooled_engine.enqueue(t_io, Job(key=k, delay=0.2), version=1) for k in keys]
    victim = pooled_spawner.start(versions="t_io@1", lease=1.0, concurrency=4, pooled=True)
    polling = pooled_spawner.start(versions="t_io@1", lease=1.0, concurrency=4, pooled=True)
    listening = pooled_spawner.start(
        versions="t_io@1", lease=1.0, concurrency=4, pooled=True, listen_url=pg_url
    )
    for worker in (victim, polling, listening):
        await worker.wait_ready()

    async def victim_holds_runs() -> list[dict[str, Any]]:
        return await fetch(
            pg_url,
            q(
                "SELECT run_id, fencing_token FROM {schema}.executions"
                " WHERE worker_id = %s AND ended_at IS NULL",
                pg_schema,
            ),
            (f"default-{victim.pid}",),
        )

    held = await eventually(
        victim_holds_runs, timeout=30, what="the victim to hold runs", on_timeout=victim.describe
    )
    victim.kill()
    infos = await pooled_engine.wait_idle([h.run_id for h in handles], timeout=90)
    statuses = sorted({i.status for i in infos})
    assert statuses == ["completed"], f"{statuses}\n{polling.describe()}\n{listening.describe()}"
    later = await fetch(
        pg_url,
        q("SELECT run_id, fencing_token, worker_id FROM {schema}.executions", pg_schema),
    )
    for run in held:
        takers = [
            e
            for e in later
            if e["run_id"] == run["run_id"] and e["fencing_token"] > run["fencing_token"]
        ]
        assert takers, f"run {run['run_id']} held by the killed worker was never taken over"
        assert all(e["worker_id"] != f"default-{victim.pid}" for e in takers)
    report = await check_t_io_exactly_once(
        pg_url, pg_schema, BUSINESS, keys, pooled_spawner.workdir
    )
    assert report.runs == len(keys)
    assert polling.alive, polling.describe()
    assert listening.alive, listening.describe()
    print(f"through PgBouncer: {report}; the victim held {len(held)} runs")
