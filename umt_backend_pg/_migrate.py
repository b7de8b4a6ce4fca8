"""Migrations: numbered .sql files applied in order, in one transaction, under an advisory lock."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

from umt_backend_pg import _args
from umt_backend_pg._errors import wrap_exceptions
from umt_backend_pg._sql import migrations, queries, render, validate_schema
from umt_sdk.exceptions import BackendError

__all__ = ["migrate", "pending_migrations_sql"]

_LOCK_SEED = 0x756D74  # "umt"


async def migrate(url: str, *, schema: str = "umt") -> list[str]:
    """Apply the engine's pending migrations to `schema`; return the names applied.

    Safe to run from many processes at once: they queue on an advisory lock per schema. All
    pending migrations apply in one transaction (all or none), so it also runs through a pooler
    in transaction mode.
    Raises BackendError, after applying them, if the role lacks a privilege workers need.
    """
    _args.text(url, "url", where="migrate()", expected="a database URL (postgresql://...)")
    validate_schema(schema)
    applied: list[str] = []
    # One transaction, under a transaction-scoped lock: a pooler in transaction mode
    # (PgBouncer) keeps it on one server connection, where a session lock taken in one
    # statement and released in another could land on two (and stay held on the first).
    # Never prepared, for the same reason.
    with wrap_exceptions(), _privileges_named(schema):
        async with await psycopg.AsyncConnection.connect(
            url, autocommit=True, prepare_threshold=None
        ) as conn:
            async with conn.transaction():
                await conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended(%s, %s))",
                    (f"umt-migrate:{schema}", _LOCK_SEED),
                )
                await conn.execute(
                    sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema))
                )
                await conn.execute(
                    sql.SQL(
                        "CREATE TABLE IF NOT EXISTS {}.migrations (version integer PRIMARY KEY,"
                        " name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
                    ).format(sql.Identifier(schema))
                )
                cur = await conn.execute(
                    sql.SQL("SELECT version FROM {}.migrations").format(sql.Identifier(schema))
                )
                done = {row[0] for row in await cur.fetchall()}
                for version, name, text in migrations():
                    if version in done:
                        continue
                    await conn.execute(render(text, schema))
                    await conn.execute(
                        sql.SQL("INSERT INTO {}.migrations (version, name) VALUES (%s, %s)").format(
                            sql.Identifier(schema)
                        ),
                        (version, name),
                    )
                    applied.append(f"{version:04d}_{name}")
            await _check_privileges(conn, schema)
    return applied


@contextmanager
def _privileges_named(schema: str) -> Iterator[None]:
    try:
        yield
    except psycopg.errors.InsufficientPrivilege as exc:
        raise BackendError(
            f"this role cannot migrate the schema {schema!r} ({exc.diag.message_primary}): run "
            "`umt migrate` (or `migrate()`) as the schema's owner, and connect the other roles "
            "with run_migrations=False"
        ) from exc


async def _check_privileges(conn: psycopg.AsyncConnection[Any], schema: str) -> None:
    """The role that migrates is the one workers are expected to run as (or an owner): say now,
    not under load, if it cannot rotate the ready queue."""
    cur = await conn.execute(render(queries()["missing_privileges"], schema), {"schema": schema})
    row = await cur.fetchone()
    role: str = row[0] if row else "?"
    missing: list[str] | None = row[1] if row else None
    if missing:
        tables = ", ".join(f"{schema}.{name}" for name in missing)
        raise BackendError(
            f"the role {role!r} cannot TRUNCATE {tables}: workers empty the ready queue's slots "
            f"with TRUNCATE. As the tables' owner, run `GRANT TRUNCATE ON {tables} TO {role}` "
            "(or migrate and run workers as the owner); the migrations themselves are applied"
        )


async def pending_migrations_sql(url: str, *, schema: str = "umt") -> str:
    """The SQL `migrate` would run now (for `umt migrate --dry-run`)."""
    _args.text(
        url, "url", where="pending_migrations_sql()", expected="a database URL (postgresql://...)"
    )
    validate_schema(schema)
    done: set[int] = set()
    with wrap_exceptions():
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT to_regclass(%s) IS NOT NULL", (f"{schema}.migrations",)
            )
            row = await cur.fetchone()
            if row is not None and row[0]:
                cur = await conn.execute(
                    sql.SQL("SELECT version FROM {}.migrations").format(sql.Identifier(schema))
                )
                done = {r[0] for r in await cur.fetchall()}
    return "\n".join(
        f"-- {version:04d}_{name}\n{render(text, schema)}"
        for version, name, text in migrations()
        if version not in done
    )
