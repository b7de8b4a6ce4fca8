"""Helpers of the chaos tests that crash a Postgres of their own (`private_pg` of
tests/fixtures/private_pg.py) under real worker processes.

`SLOW_FLUSH` (`wal_writer_delay = 10s`, the background writer off) keeps an asynchronous commit
(a claim) unflushed until something else flushes the WAL, so a crash right after a claim loses
it every time instead of when the crash happens to land within the default 200 ms. That is the
condition of the bug the token epochs fix, made deterministic, not a different one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from uuid import uuid4

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.fixtures.private_pg import PrivatePostgres
from umt_sdk.exceptions import BackendUnavailableError

T = TypeVar("T")

SLOW_FLUSH = {"wal_writer_delay": "10s", "bgwriter_lru_maxpages": "0"}


def configure(server: PrivatePostgres, settings: dict[str, str]) -> None:
    with psycopg.connect(server.url, autocommit=True) as conn:
        for name, value in settings.items():
            # ALTER SYSTEM takes no placeholders: quote the name and the value.
            conn.execute(
                sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value))
            )
        conn.execute("SELECT pg_reload_conf()")


def checkpoint(server: PrivatePostgres) -> None:
    """After a checkpoint the next `nextval` writes the sequence's WAL record again (as the
    first one after every server start does)."""
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")


@contextlib.asynccontextmanager
async def business_database(
    server_url: str, install: Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]
) -> AsyncIterator[str]:
    """A fresh database on `server_url` (a server these tests do not crash), set up by
    `install`; its URL. Dropped afterwards."""
    name = f"biz_{uuid4().hex[:10]}"
    async with await psycopg.AsyncConnection.connect(server_url, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = make_conninfo(**{**conninfo_to_dict(server_url), "dbname": name})
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await install(conn)
        yield url
    finally:
        async with await psycopg.AsyncConnection.connect(server_url, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name))
            )


async def retrying(
    call: Callable[[], Awaitable[T]], *, timeout: float = 20.0, what: str = "the call"
) -> T:
    """`call()` again while the server is still unreachable (the pool reconnects after a
    restart: the first uses of its old connections fail)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except BackendUnavailableError:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: the server stayed unreachable") from None
            await asyncio.sleep(0.05)
