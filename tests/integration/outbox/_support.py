"""Helpers of the outbox tests: reads and writes of the outbox, and relay processes
(`relay_proc.py`, started with the shared `tests._procs.support.Spawner`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import psycopg

from tests._procs.support import Process, Spawner, fetch, q
from tests._procs.support import eventually as _eventually

RELAY = "tests.integration.outbox.relay_proc"

eventually = functools.partial(_eventually, interval=0.05)
"""`eventually`, polling the outbox's tables every 50 ms."""


async def insert_items(url: str, schema: str, numbers: Sequence[int], *, per_tx: int = 300) -> None:
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
    found = await fetch(
        url, q("SELECT status, count(*) AS c FROM {schema}.outbox_event GROUP BY status", schema)
    )
    return {r["status"]: r["c"] for r in found}


async def runs_per_key(url: str, schema: str) -> dict[str, int]:
    found = await fetch(
        url,
        q(
            "SELECT idempotency_key AS k, count(*) AS c FROM {schema}.runs"
            " WHERE task_name = 'process_item' GROUP BY idempotency_key",
            schema,
        ),
    )
    return {r["k"]: r["c"] for r in found}


def start_relay(relays: Spawner, name: str, *args: str) -> Process:
    """A relay process named `name`; it counts its routed rows in `calls(relay)`."""
    return relays.run(RELAY, "--name", name, "--workdir", str(relays.workdir), *args, name=name)


def calls(relay: Process) -> list[int]:
    """The payload numbers the relay routed, one per call of its mapper, in order."""
    log = relay.workdir / f"{relay.name}.calls"
    if not log.exists():
        return []
    return [int(x) for x in log.read_text().split()]
