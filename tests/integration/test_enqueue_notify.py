"""An enqueue wakes idle workers with a NOTIFY sent after its commit, in the background, shared
with the enqueues of the same process meanwhile (umt_backend_pg/_notifier.py); closing the
backend sends what is still due; one in the caller's transaction notifies at that
transaction's commit, not before. A write that frees a concurrency key's slot while runs wait
for it (an ending, a cancel) notifies in its statement."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import attrs
import psycopg
import pytest

from umt_backend_pg import PostgresBackend
from umt_sdk.backend import Ending, Lease, NewRun, TaskPair

A = TaskPair(name="notify.a", version=1)
B = TaskPair(name="notify.b", version=2)


def new_run(pair: TaskPair) -> NewRun:
    return NewRun(
        run_id=uuid.uuid4(),
        task_name=pair.name,
        task_version=pair.version,
        input_json="{}",
        input_hash="h",
    )


@pytest.fixture
async def backend(pg_url: str, pg_schema: str) -> AsyncIterator[PostgresBackend]:
    opened = await PostgresBackend.open(
        pg_url, schema=pg_schema, run_migrations=False, listen=False, max_size=4
    )
    try:
        yield opened
    finally:
        await opened.close()


@pytest.fixture
async def listener(
    pg_url: str, backend: PostgresBackend
) -> AsyncIterator[psycopg.AsyncConnection[object]]:
    conn = await psycopg.AsyncConnection.connect(pg_url, autocommit=True)
    await conn.execute(
        psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(backend.work_channel))
    )
    try:
        yield conn
    finally:
        await conn.close()


async def received(conn: psycopg.AsyncConnection[object], seconds: float) -> list[str]:
    payloads = []
    async for note in conn.notifies(timeout=seconds):
        payloads.append(note.payload)
    return payloads


async def test_concurrent_enqueues_share_their_notifications_and_each_is_named(
    backend: PostgresBackend, listener: psycopg.AsyncConnection[object]
) -> None:
    runs = [new_run(A if i % 2 else B) for i in range(40)]
    results = await asyncio.gather(*(backend.enqueue(r) for r in runs))
    assert all(r.created for r in results)
    payloads = await received(listener, 1.0)
    named = {pair for p in payloads for pair in p.split(",")}
    assert named == {"notify.a@1", "notify.b@2"}
    assert 1 <= len(payloads) < len(runs), f"{len(payloads)} notifications for {len(runs)} runs"


async def test_a_notification_follows_each_enqueue(
    backend: PostgresBackend, listener: psycopg.AsyncConnection[object]
) -> None:
    for pair in (A, B, A):
        await backend.enqueue(new_run(pair))
        payloads = await received(listener, 1.0)
        assert f"{pair.name}@{pair.version}" in {x for p in payloads for x in p.split(",")}


async def test_closing_the_backend_sends_the_notifications_asked_for(
    pg_url: str, pg_schema: str, listener: psycopg.AsyncConnection[object]
) -> None:
    other = await PostgresBackend.open(
        pg_url, schema=pg_schema, run_migrations=False, listen=False, max_size=2
    )
    await other.enqueue(new_run(B))
    await other.close()  # at once, as a script that enqueues and exits
    assert "notify.b@2" in {x for p in await received(listener, 1.0) for x in p.split(",")}


async def test_an_idempotent_hit_does_not_notify(
    backend: PostgresBackend, listener: psycopg.AsyncConnection[object]
) -> None:
    keyed = attrs.evolve(new_run(A), idempotency_key="k")
    await backend.enqueue(keyed)
    assert await received(listener, 0.5)
    again = await backend.enqueue(keyed)
    assert not again.created
    assert await received(listener, 0.5) == []


async def test_an_enqueue_in_the_callers_transaction_notifies_at_its_commit(
    backend: PostgresBackend, listener: psycopg.AsyncConnection[object], pg_url: str
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url) as conn:
        await backend.enqueue(new_run(B), conn=conn)
        assert await received(listener, 0.5) == [], "notified before the commit"
        await conn.commit()
    assert await received(listener, 1.0) == ["notify.b@2"]


# -- concurrency keys: a freed slot wakes the workers --------------------------------------------


def keyed_run(pair: TaskPair, key: str) -> NewRun:
    return attrs.evolve(new_run(pair), concurrency_key=key, concurrency_limit=1)


async def _claim_one(backend: PostgresBackend, lease: timedelta) -> Lease:
    (claimed,) = await backend.claim(worker_id="w", pairs=[A], limit=5, lease=lease)
    return Lease(
        run_id=claimed.run_id, fencing_token=claimed.fencing_token, worker_id="w", duration=lease
    )


async def test_a_slot_freed_with_runs_waiting_for_it_wakes_the_workers(
    backend: PostgresBackend, listener: psycopg.AsyncConnection[object]
) -> None:
    for _ in range(3):
        await backend.enqueue(keyed_run(A, "k"))
    lease = await _claim_one(backend, timedelta(seconds=60))
    await received(listener, 0.5)  # the enqueues' own notifications
    # An ending frees the slot of a key with runs queued: the workers are told at its commit.
    done = Ending(status="completed", outcome="completed", output_json="1")
    assert await backend.end_execution(lease, done) == "ended"
    assert "notify.a@1" in await received(listener, 1.0)
    # A cancel that ends a held run whose worker is gone frees its slot, and says so too.
    lease = await _claim_one(backend, timedelta(milliseconds=200))
    await asyncio.sleep(0.4)
    assert await backend.cancel(lease.run_id, reason="operator") == "canceled"
    assert "notify.a@1" in await received(listener, 1.0)
    # The last run: nobody waits for its slot, so its ending wakes nobody.
    lease = await _claim_one(backend, timedelta(seconds=60))
    assert await backend.end_execution(lease, done) == "ended"
    assert await received(listener, 0.5) == []
