"""The operation ledger, and whether a caller's connection is on the engine's database."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from umt_backend_pg._args import refuse
from umt_backend_pg._errors import fenced, wrap_exceptions
from umt_backend_pg._sql import queries, render, validate_schema
from umt_sdk.backend import Lease, LedgerEntry
from umt_sdk.exceptions import BackendError, FencingError

__all__ = ["EngineDatabase", "PostgresLedger", "install_ledger"]


class EngineDatabase:
    """The engine's database, as a caller's connection (a ledger's, an outbox relay's) meets it:
    whether the two are one database, and reads of the runs table through the engine's pool."""

    def __init__(
        self, pool: AsyncConnectionPool[Any], *, schema: str, queries: Mapping[str, str]
    ) -> None:
        self.schema = schema
        self.q = queries
        self._pool = pool
        self._same_database: dict[tuple[str, int, str], bool] = {}
        self._ledger_checked: set[tuple[str, int, str]] = set()

    async def shares_database_with(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """The answer of `PostgresBackend.shares_database_with`: whether the engine's pool sees
        an advisory lock that `conn` takes (cached per host, port and database of `conn`)."""
        info = conn.info
        where = (info.host, info.port, info.dbname)
        same = self._same_database.get(where)
        if same is None:
            keys = {"k1": secrets.randbelow(2**31 - 1) + 1, "k2": secrets.randbelow(2**31 - 1) + 1}
            # In a transaction (a savepoint inside the caller's): a pooler in transaction mode
            # keeps the lock, the look and the unlock on one server connection.
            with wrap_exceptions():
                async with conn.transaction():
                    cur = await conn.execute(self.q["probe_lock"], keys, prepare=False)
                    row = await cur.fetchone()
                    assert row is not None
                    try:
                        async with self._pool.connection() as engine_conn:
                            cur = await engine_conn.execute(
                                self.q["probe_see"], {**keys, "pid": row[1]}
                            )
                            seen = await cur.fetchone()
                    finally:
                        await conn.execute(self.q["probe_unlock"], keys, prepare=False)
            same = bool(seen and seen[0])
            self._same_database[where] = same
        return same

    async def ledger_database(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Whether the ledger on `conn` is in the engine's database; refuses a database
        without a ledger, saying how to install one."""
        same = await self.shares_database_with(conn)
        where = (conn.info.host, conn.info.port, conn.info.dbname)
        if where not in self._ledger_checked:
            with wrap_exceptions():
                cur = await conn.execute(self.q["ledger_here"])
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

    async def holds_run(self, params: Mapping[str, Any]) -> bool:
        """Whether the run is still held under the token, read through the engine's pool."""
        with wrap_exceptions():
            async with self._pool.connection() as conn:
                cur = await conn.execute(self.q["ledger_check_run"], params)
                return await cur.fetchone() is not None


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

    def __init__(self, engine: EngineDatabase, conn: psycopg.AsyncConnection[Any]) -> None:
        self._engine = engine
        self._conn = conn

    async def _holds_run(self, params: Mapping[str, Any]) -> bool:
        if await self._engine.ledger_database(self._conn):
            cur = await self._conn.execute(self._engine.q["ledger_check_run"], params)
            return await cur.fetchone() is not None
        return await self._engine.holds_run(params)

    async def _fence(self, lease: Lease, params: Mapping[str, Any], what: str) -> None:
        """Refuse a stale attempt before its commit callback runs (plain reads, no locks)."""
        if not await self._holds_run(params):
            raise fenced(lease, what)
        cur = await self._conn.execute(self._engine.q["ledger_peek"], params)
        row = await cur.fetchone()
        if row is None or row[0] != lease.fencing_token or row[1]:
            raise fenced(lease, f"{what} (a newer attempt began it, or it finished elsewhere)")

    async def begin(self, *, op_key: str, lease: Lease) -> LedgerEntry:
        q = self._engine.q
        conn = self._conn
        params = {"op_key": op_key, "run_id": lease.run_id, "token": lease.fencing_token}
        with wrap_exceptions():
            async with conn.transaction():
                if not await self._holds_run(params):
                    raise fenced(lease, f"beginning {op_key!r}")
                cur = await conn.execute(q["ledger_get"], params)
                existing = await cur.fetchone()
                if existing is not None and existing[1] is not None:
                    return LedgerEntry(result_json=existing[1], resumed=False)
                cur = await conn.execute(q["ledger_begin"], params)
                if await cur.fetchone() is None:
                    raise fenced(lease, f"beginning {op_key!r} (a newer attempt has)")
        return LedgerEntry(result_json=None, resumed=existing is not None)

    async def finish(
        self,
        *,
        op_key: str,
        lease: Lease,
        result_json: str,
        commit: Callable[[Any], Awaitable[None]],
    ) -> None:
        q = self._engine.q
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
                        raise fenced(lease, what)
                    cur = await conn.execute(q["ledger_finish"], params)
                    if await cur.fetchone() is None:
                        raise fenced(
                            lease, f"{what} (a newer attempt began it, or it finished elsewhere)"
                        )
        except FencingError:
            raise
        except Exception as exc:
            # The callback (or the connection) failed. If that is because a newer attempt took
            # over (say, its business row hit your unique key), the answer is FencingError.
            if await self._stale(lease, params, what):
                raise fenced(lease, what) from exc
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
    if not isinstance(conn, psycopg.AsyncConnection):
        refuse("conn", "a psycopg.AsyncConnection", conn, where="install_ledger()")
    validate_schema(schema)
    with wrap_exceptions():
        async with conn.transaction():
            await conn.execute(render(queries()["install_ledger"], schema))
