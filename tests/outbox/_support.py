"""Helpers of the outbox tests: reads of the database and relay subprocesses."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

RELAY_PROGRAM = Path(__file__).with_name("relay_proc.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


async def rows(url: str, query: sql.Composable, params: Any = None) -> list[dict[str, Any]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(query, params)
        return await cur.fetchall()


def q(text: str, schema: str) -> sql.Composed:
    return sql.SQL(text).format(schema=sql.Identifier(schema))


async def insert_items(url: str, schema: str, numbers: range, *, per_tx: int = 300) -> None:
    """`item` events {"n": n}, `per_tx` rows per transaction (one NOTIFY each)."""
    async with await psycopg.AsyncConnection.connect(url) as conn:
        chunk = list(numbers)
        for start in range(0, len(chunk), per_tx):
            part = chunk[start : start + per_tx]
            await conn.execute(
                q(
                    "INSERT INTO {schema}.outbox_event (type, payload)"
                    " SELECT 'item', jsonb_build_object('n', n) FROM unnest(%s::int[]) AS n",
                    schema,
                ),
                (part,),
            )
            await conn.commit()


async def status_counts(url: str, schema: str) -> dict[str, int]:
    found = await rows(
        url, q("SELECT status, count(*) AS c FROM {schema}.outbox_event GROUP BY status", schema)
    )
    return {r["status"]: r["c"] for r in found}


async def runs_per_key(url: str, schema: str) -> dict[str, int]:
    found = await rows(
        url,
        q(
            "SELECT idempotency_key AS k, count(*) AS c FROM {schema}.runs"
            " WHERE task_name = 'process_item' GROUP BY idempotency_key",
            schema,
        ),
    )
    return {r["k"]: r["c"] for r in found}


async def eventually(check: Any, *, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


class RelayProcess:
    """One relay_proc.py process; output in files, SIGKILLed at teardown if still alive."""

    def __init__(self, tmp: Path, name: str, *args: str) -> None:
        self.name = name
        self.log = tmp / f"{name}.calls"
        self.out_path = tmp / f"{name}.out"
        self.err_path = tmp / f"{name}.err"
        self._out: IO[bytes] = self.out_path.open("wb")
        self._err: IO[bytes] = self.err_path.open("wb")
        self.popen = subprocess.Popen(
            [sys.executable, str(RELAY_PROGRAM), "--name", name, "--log", str(self.log), *args],
            stdout=self._out,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def describe(self) -> str:
        err = self.err_path.read_text(errors="replace")[-4000:]
        return f"relay {self.name} (exit {self.popen.poll()})\n{self.output()}\n{err}"

    async def wait_for(self, marker: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.output().splitlines():
                if line.startswith(marker):
                    return line
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {marker!r} line\n{self.describe()}")
            await asyncio.sleep(0.02)

    def calls(self) -> list[int]:
        if not self.log.exists():
            return []
        return [int(x) for x in self.log.read_text().split()]

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def close(self) -> None:
        try:
            self.kill()
        finally:
            self._out.close()
            self._err.close()
