"""Migrations: `schema.sql` is what all migrations produce; `migrate` is safe to run from many
processes at once; bad schema names are refused; an unmigrated schema gives a clear error."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from umt_backend_pg import migrate
from umt_backend_pg._sql import migrations, render, schema_sql
from umt_sdk import BackendError, Registry, TaskContext, connect, task
from umt_sdk.exceptions import BackendUnavailableError

BOOKKEEPING = "migrations"


@task("migration.noop", version=1)
async def noop(ctx: TaskContext[int]) -> int:
    return ctx.input + 1


@pytest.fixture
async def fresh_schemas(pg_url: str) -> AsyncIterator[Callable[[str], str]]:
    """Names of schemas that do not exist yet; every one is dropped at teardown."""
    made: list[str] = []

    def new(prefix: str) -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        made.append(name)
        return name

    yield new
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        for name in made:
            await conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
            )


async def _rows(
    conn: psycopg.AsyncConnection[Any], query: str, schema: str
) -> list[tuple[Any, ...]]:
    cur = await conn.execute(query, {"schema": schema, "skip": BOOKKEEPING})
    normalized = [
        tuple(v.replace(schema, "{schema}") if isinstance(v, str) else v for v in row)
        for row in await cur.fetchall()
    ]
    return sorted(normalized, key=repr)


CATALOG: dict[str, str] = {
    "tables": """
        SELECT c.relname, c.relkind, c.relpersistence, c.reloptions::text
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
          AND c.relname <> %(skip)s
    """,
    "columns": """
        SELECT table_name, column_name, data_type, udt_name, character_maximum_length,
               numeric_precision, column_default, is_nullable, is_identity,
               identity_generation, identity_start, identity_increment, identity_maximum,
               identity_minimum, identity_cycle, is_generated, generation_expression,
               collation_name
        FROM information_schema.columns
        WHERE table_schema = %(schema)s AND table_name <> %(skip)s
    """,
    "indexes": """
        SELECT tablename, indexname, indexdef
        FROM pg_indexes WHERE schemaname = %(schema)s AND tablename <> %(skip)s
    """,
    "index storage": """
        SELECT i.relname, i.reloptions::text
        FROM pg_class i JOIN pg_namespace n ON n.oid = i.relnamespace
        WHERE n.nspname = %(schema)s AND i.relkind = 'i'
          AND i.relname NOT LIKE %(skip)s || '%%'
    """,
    "constraints": """
        SELECT t.relname, c.conname, c.contype, pg_get_constraintdef(c.oid, true),
               c.condeferrable, c.condeferred, c.convalidated
        FROM pg_constraint c
        JOIN pg_namespace n ON n.oid = c.connamespace
        LEFT JOIN pg_class t ON t.oid = c.conrelid
        WHERE n.nspname = %(schema)s AND coalesce(t.relname, '') <> %(skip)s
    """,
    "sequences": """
        SELECT sequencename, data_type::text, start_value, min_value, max_value,
               increment_by, cycle, cache_size
        FROM pg_sequences WHERE schemaname = %(schema)s
    """,
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = %(schema)s
    """,
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid, true)
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND NOT t.tgisinternal
    """,
    "views": """
        SELECT viewname, definition FROM pg_views WHERE schemaname = %(schema)s
    """,
    "types": """
        SELECT t.typname, t.typtype FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
        WHERE n.nspname = %(schema)s AND t.typtype IN ('e', 'd', 'c')
          AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.reltype = t.oid)
    """,
}


async def _describe(url: str, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return {name: await _rows(conn, query, schema) for name, query in CATALOG.items()}


async def test_schema_sql_equals_all_migrations_applied(
    pg_url: str, fresh_schemas: Callable[[str], str]
) -> None:
    from_file, migrated = fresh_schemas("mig_file"), fresh_schemas("mig_steps")
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(from_file)))
        async with conn.transaction():
            await conn.execute(render(schema_sql(), from_file))
    applied = await migrate(pg_url, schema=migrated)
    assert applied == [f"{v:04d}_{n}" for v, n, _ in migrations()], applied

    expected, actual = await _describe(pg_url, from_file), await _describe(pg_url, migrated)
    assert expected["tables"], "schema.sql created no tables?"
    assert {r[0] for r in expected["tables"]} >= {"runs", "steps", "executions", "op_ledger"}
    for part in CATALOG:
        only_file = sorted(set(expected[part]) - set(actual[part]), key=repr)
        only_migrations = sorted(set(actual[part]) - set(expected[part]), key=repr)
        assert not only_file, (
            f"{part}: {len(only_file)} only in schema.sql, not after the migrations: "
            f"{only_file}; only after the migrations: {only_migrations}"
        )
        assert not only_migrations, (
            f"{part}: {len(only_migrations)} only after the migrations, not in schema.sql: "
            f"{only_migrations}"
        )
        assert Counter(expected[part]) == Counter(actual[part]), part
    for part in ("columns", "indexes", "constraints", "sequences", "index storage"):
        assert expected[part], f"no {part} described: the comparison would be empty"

    # The comparison sees drift: a changed default, a dropped index, a changed table option.
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        for statement in (
            "ALTER TABLE {}.runs ALTER COLUMN priority SET DEFAULT 1",
            "DROP INDEX {}.runs_by_task",
            "ALTER TABLE {}.steps SET (fillfactor = 100)",
        ):
            await conn.execute(sql.SQL(statement).format(sql.Identifier(migrated)))
    drifted = await _describe(pg_url, migrated)
    changed = sorted(part for part in CATALOG if Counter(drifted[part]) != Counter(expected[part]))
    assert changed == ["columns", "index storage", "indexes", "tables"], changed


async def test_concurrent_migrations_are_safe(
    pg_url: str, fresh_schemas: Callable[[str], str]
) -> None:
    schema = fresh_schemas("mig_race")
    results = await asyncio.gather(
        *(migrate(pg_url, schema=schema) for _ in range(10)), return_exceptions=True
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of 10 concurrent migrate() calls failed: {errors}"
    applied = Counter(name for r in results if isinstance(r, list) for name in r)
    expected = [f"{v:04d}_{n}" for v, n, _ in migrations()]
    assert applied == Counter(expected), (
        f"each migration must be applied exactly once across 10 callers: {dict(applied)}"
    )
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        cur = await conn.execute(
            sql.SQL("SELECT version, count(*) FROM {}.migrations GROUP BY version").format(
                sql.Identifier(schema)
            )
        )
        recorded = dict(await cur.fetchall())
    assert recorded == {v: 1 for v, _, _ in migrations()}, recorded
    assert await migrate(pg_url, schema=schema) == [], "a migrated schema needs nothing more"
    async with await connect(
        pg_url, registry=Registry([noop]), schema=schema, run_migrations=False
    ) as engine:
        handle = await engine.enqueue(noop, 41)
        async with engine.worker():
            assert await handle.result(timeout=15) == 42


BAD_NAMES = [
    "Umt",
    "umt-prod",
    "umt prod",
    'umt"; DROP SCHEMA public CASCADE; --',
    "umt.runs",
    "",
    "1umt",
    "u" * 64,
    "umté",
]


async def _schema_names(url: str) -> set[str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute("SELECT nspname FROM pg_namespace")
        return {row[0] for row in await cur.fetchall()}


@pytest.mark.parametrize("name", BAD_NAMES)
async def test_invalid_schema_names_are_refused(pg_url: str, name: str) -> None:
    before = await _schema_names(pg_url)
    with pytest.raises(ValueError, match="schema must be a lowercase identifier") as caught:
        await migrate(pg_url, schema=name)
    assert repr(name) in str(caught.value), "the error names the refused schema"
    with pytest.raises(ValueError, match="schema must be a lowercase identifier"):
        await connect(pg_url, registry=Registry([noop]), schema=name)
    with pytest.raises(ValueError, match="schema must be a lowercase identifier"):
        await connect(pg_url, registry=Registry([noop]), schema=name, run_migrations=False)
    assert await _schema_names(pg_url) == before, "nothing may be created for a refused name"


@pytest.mark.parametrize("exists", [True, False], ids=["empty schema", "no schema"])
async def test_unmigrated_schema_gives_a_clear_error(
    pg_url: str, fresh_schemas: Callable[[str], str], exists: bool
) -> None:
    schema = fresh_schemas("mig_none")
    if exists:
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    async with await connect(
        pg_url, registry=Registry([noop]), schema=schema, run_migrations=False
    ) as engine:
        with pytest.raises(BackendError, match="umt migrate") as caught:
            await engine.enqueue(noop, 1)
        assert not isinstance(caught.value, BackendUnavailableError), caught.value
        with pytest.raises(BackendError, match="umt migrate"):
            await engine.list()
    assert schema not in await _schema_names(pg_url) or exists, "connect must not migrate"
