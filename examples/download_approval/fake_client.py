"""A fake download client: an outside system with its own state (tables `client_jobs`,
`client_faults` in the application schema).

`add` starts a job and is NOT idempotent (each call is a new job, as with a real client);
`find` looks a job up by its tag. Failure modes a test can switch on with `set_fault`:
- `refuse`: `add` raises ConnectionError before doing anything (the step retries);
- `lost_reply`: `add` creates the job, then raises TimeoutError, as if the reply were lost
  (the retry is told `info.resumed` and must find the job by its tag instead of adding another).
`complete_jobs` plays the client finishing its downloads: it writes the files.
"""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
from psycopg import sql


def _q(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(s=sql.Identifier(schema))


async def set_fault(url: str, schema: str, mode: str, count: int) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            _q(
                "INSERT INTO {s}.client_faults (mode, remaining) VALUES (%s, %s)"
                " ON CONFLICT (mode) DO UPDATE SET remaining = EXCLUDED.remaining",
                schema,
            ),
            (mode, count),
        )


async def _take_fault(conn: psycopg.AsyncConnection[object], schema: str, mode: str) -> bool:
    cur = await conn.execute(
        _q(
            "UPDATE {s}.client_faults SET remaining = remaining - 1"
            " WHERE mode = %s AND remaining > 0 RETURNING 1",
            schema,
        ),
        (mode,),
    )
    return await cur.fetchone() is not None


async def add(url: str, schema: str, *, source: str, size: int, tag: str, token: int) -> int:
    """Start downloading `source`; returns the job id."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        if await _take_fault(conn, schema, "refuse"):
            raise ConnectionError("download client refused the connection")
        cur = await conn.execute(
            _q(
                "INSERT INTO {s}.client_jobs (tag, url, size, token) VALUES (%s, %s, %s, %s)"
                " RETURNING id",
                schema,
            ),
            (tag, source, size, token),
        )
        row = await cur.fetchone()
        assert row is not None
        if await _take_fault(conn, schema, "lost_reply"):
            raise TimeoutError("download client did not answer (the job was created)")
    return int(row[0])


async def find(url: str, schema: str, *, tag: str) -> int | None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            _q("SELECT id FROM {s}.client_jobs WHERE tag = %s ORDER BY id LIMIT 1", schema),
            (tag,),
        )
        row = await cur.fetchone()
    return None if row is None else int(row[0])


async def complete_jobs(url: str, schema: str, incoming: Path, limit: int | None = None) -> int:
    """Finish every queued job (the first `limit`, oldest first, when given): write its file;
    returns how many finished."""
    incoming.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - a fake, kept simple
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            _q(
                "SELECT id, size FROM {s}.client_jobs WHERE status = 'queued' ORDER BY id LIMIT %s",
                schema,
            ),
            (limit,),
        )
        jobs = await cur.fetchall()
        for job_id, size in jobs:
            path = incoming / f"job-{job_id}.bin"
            path.write_bytes(os.urandom(size))
            await conn.execute(
                _q("UPDATE {s}.client_jobs SET status = 'done', path = %s WHERE id = %s", schema),
                (str(path), job_id),
            )
    return len(jobs)
