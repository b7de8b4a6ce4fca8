"""A schema of one test's own, for the pytest plugin's `umt_engine` (hook `umt_test_storage`)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg import sql

from umt_backend_pg._errors import wrap_exceptions
from umt_backend_pg._migrate import migrate

__all__ = ["fresh_schema"]


@asynccontextmanager
async def fresh_schema(url: str) -> AsyncIterator[Mapping[str, Any]]:
    """Create a schema with the engine's tables; give `connect()`'s options for it; drop it."""
    schema = f"umt_test_{uuid.uuid4().hex[:12]}"
    await migrate(url, schema=schema)
    try:
        yield {"schema": schema, "run_migrations": False}
    finally:
        with wrap_exceptions():
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )
