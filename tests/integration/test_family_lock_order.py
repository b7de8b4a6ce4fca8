"""A child's finishing write and its parent's cancel never deadlock on Postgres.

A child's ending (or its own cancel) writes its row, then its parent's: the parent's fact and
wake-up, or its group's count and, for the last member, the parent. A cancel of the parent
writes the parent's row, then its children's (the cascade). Taken in those orders the two
deadlock (Postgres aborts one after `deadlock_timeout`: `deadlock detected`); so every write
that finishes a child locks the parent's row first (end_execution's and cancel_run's
`parent_locked`), the order the cascade takes.

Each test forces the interleaving that deadlocked, without timing: a third connection holds,
uncommitted, a row the child's write needs after it has locked the child (the parent's fact,
or the group's row), so the child's write stops there; the parent's cancel is started and
stops too; then the third connection rolls back and both go on. With the child's row locked
before the parent's, this is a deadlock every time. A last test races the two many times
without a third connection.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from umt_backend_pg import PostgresBackend
from umt_sdk.backend import ChildGroup, Ending, Lease, NewRun, TaskPair

PARENT = TaskPair(name="family.parent", version=1)
CHILD = TaskPair(name="family.child", version=1)
LEASE = timedelta(seconds=60)
GROUP = "umt.group fan"


@pytest.fixture
async def backend(pg_url: str, pg_schema: str) -> AsyncIterator[PostgresBackend]:
    opened = await PostgresBackend.open(
        pg_url, schema=pg_schema, run_migrations=False, listen=False, max_size=6
    )
    try:
        yield opened
    finally:
        await opened.close()


def _run(pair: TaskPair, **fields: Any) -> NewRun:
    return NewRun(
        run_id=uuid.uuid4(),
        task_name=pair.name,
        task_version=pair.version,
        input_json="{}",
        input_hash="h",
        **fields,
    )


async def _claim(backend: PostgresBackend, pair: TaskPair, run_id: uuid.UUID) -> Lease:
    for claimed in await backend.claim(worker_id="w", pairs=[pair], limit=10, lease=LEASE):
        if claimed.run_id == run_id:
            return Lease(
                run_id=run_id, fencing_token=claimed.fencing_token, worker_id="w", duration=LEASE
            )
    raise AssertionError(f"run {run_id} could not be claimed")


async def _parent_waiting_on_child(
    backend: PostgresBackend, *, child_status: str
) -> tuple[uuid.UUID, uuid.UUID, Lease | None]:
    """A parent parked on its one child (`start_child` + `result()`); the child running (its
    lease returned) or pending (None)."""
    parent = _run(PARENT)
    await backend.enqueue(parent)
    parent_lease = await _claim(backend, PARENT, parent.run_id)
    child_id = uuid.uuid4()
    fact = f"umt.child:{child_id}"
    child = NewRun(
        run_id=child_id,
        task_name=CHILD.name,
        task_version=CHILD.version,
        input_json="{}",
        input_hash="h",
        parent_run_id=parent.run_id,
        parent_fact=fact,
        cancel_with_parent=True,
        idempotency_key=f"umt.child:{parent.run_id}:start",
    )
    await backend.enqueue(child)
    parked = Ending(status="waiting", outcome="waiting", wait_for=fact)
    assert await backend.end_execution(parent_lease, parked) == "ended"
    if child_status == "pending":
        return parent.run_id, child_id, None
    return parent.run_id, child_id, await _claim(backend, CHILD, child_id)


async def _parent_waiting_on_group(backend: PostgresBackend) -> tuple[uuid.UUID, Lease]:
    """A parent parked on a map of one child (the last member), the child running."""
    parent = _run(PARENT)
    await backend.enqueue(parent)
    parent_lease = await _claim(backend, PARENT, parent.run_id)
    child = _run(
        CHILD,
        parent_run_id=parent.run_id,
        cancel_with_parent=True,
        idempotency_key=f"umt.map:{parent.run_id}:fan:0",
    )
    await backend.start_group(ChildGroup(parent_run_id=parent.run_id, name=GROUP), [child])
    parked = Ending(status="waiting", outcome="waiting", wait_for=GROUP)
    assert await backend.end_execution(parent_lease, parked) == "ended"
    return parent.run_id, await _claim(backend, CHILD, child.run_id)


class Holder:
    """A third connection that holds a row, uncommitted, until `release` rolls it back."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], schema: str) -> None:
        self.conn = conn
        self.schema = schema

    async def hold(self, query: str, *args: Any) -> None:
        await self.conn.execute("BEGIN")
        await self.conn.execute(
            sql.SQL(query).format(schema=sql.Identifier(self.schema)),  # the test's constant
            args,
        )

    async def release(self) -> None:
        await self.conn.execute("ROLLBACK")


@pytest.fixture
async def holder(pg_url: str, pg_schema: str) -> AsyncIterator[Holder]:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        yield Holder(conn, pg_schema)


async def _lock_waiters(pg_url: str) -> int:
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


async def _until_waiting(pg_url: str, count: int, what: str) -> None:
    for _ in range(400):
        if await _lock_waiters(pg_url) >= count:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{what} never waited for a lock")


async def _status(backend: PostgresBackend, run_id: uuid.UUID) -> str:
    record = await backend.get_run_head(run_id)
    assert record is not None
    return record.status


async def _finished_but_queued(backend: PostgresBackend) -> list[uuid.UUID]:
    """Finished runs that still have a row in `ready`: a write that finished a run missed the
    row a write it waited for had queued (the claim would keep offering it, and skipping it,
    until a rotation dropped it)."""
    async with backend._pool.connection() as conn:
        cur = await conn.execute(
            sql.SQL(
                "SELECT q.run_id FROM {s}.ready q JOIN {s}.runs r ON r.id = q.run_id"
                " WHERE r.status IN ('completed', 'failed', 'canceled')"
            ).format(s=sql.Identifier(backend.schema))
        )
        return [row[0] for row in await cur.fetchall()]


async def _both(child_write: asyncio.Task[Any], cancel: asyncio.Task[Any]) -> None:
    """Both writes went through: neither was chosen as a deadlock's victim."""
    outcomes = await asyncio.gather(child_write, cancel, return_exceptions=True)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert not failed, f"a write failed (a deadlock?): {failed!r}"


async def test_a_childs_ending_and_its_parents_cancel_do_not_deadlock(
    backend: PostgresBackend, holder: Holder, pg_url: str
) -> None:
    parent_id, child_id, lease = await _parent_waiting_on_child(backend, child_status="running")
    assert lease is not None
    # The child's ending will stop at its parent's fact (held, uncommitted, here).
    await holder.hold(
        "INSERT INTO {schema}.facts (scope, name, run_id, payload) VALUES (%s, %s, %s, 'null')",
        str(parent_id),
        f"umt.child:{child_id}",
        parent_id,
    )
    done = Ending(status="completed", outcome="completed", output_json="1")
    ending = asyncio.create_task(backend.end_execution(lease, done))
    await _until_waiting(pg_url, 1, "the child's ending")
    cancel = asyncio.create_task(backend.cancel(parent_id, reason="operator"))
    await _until_waiting(pg_url, 2, "the parent's cancel")
    await holder.release()
    await _both(ending, cancel)
    assert await _status(backend, child_id) == "completed"
    assert await _status(backend, parent_id) == "canceled"
    # The ending woke the parent (queued it) before the cancel, which waited for it, ended it.
    assert await _finished_but_queued(backend) == []


async def test_a_childs_cancel_and_its_parents_cancel_do_not_deadlock(
    backend: PostgresBackend, holder: Holder, pg_url: str
) -> None:
    parent_id, child_id, _ = await _parent_waiting_on_child(backend, child_status="pending")
    await holder.hold(
        "INSERT INTO {schema}.facts (scope, name, run_id, payload) VALUES (%s, %s, %s, 'null')",
        str(parent_id),
        f"umt.child:{child_id}",
        parent_id,
    )
    child_cancel = asyncio.create_task(backend.cancel(child_id, reason="skip"))
    await _until_waiting(pg_url, 1, "the child's cancel")
    cancel = asyncio.create_task(backend.cancel(parent_id, reason="operator"))
    await _until_waiting(pg_url, 2, "the parent's cancel")
    await holder.release()
    await _both(child_cancel, cancel)
    assert await _status(backend, child_id) == "canceled"
    assert await _status(backend, parent_id) == "canceled"
    assert await _finished_but_queued(backend) == []


async def test_a_groups_last_ending_and_its_parents_cancel_do_not_deadlock(
    backend: PostgresBackend, holder: Holder, pg_url: str
) -> None:
    parent_id, lease = await _parent_waiting_on_group(backend)
    # The member's ending will stop at its group's row (locked here).
    await holder.hold(
        "SELECT 1 FROM {schema}.child_groups WHERE parent_run_id = %s FOR UPDATE", parent_id
    )
    done = Ending(status="completed", outcome="completed", output_json="1")
    ending = asyncio.create_task(backend.end_execution(lease, done))
    await _until_waiting(pg_url, 1, "the member's ending")
    cancel = asyncio.create_task(backend.cancel(parent_id, reason="operator"))
    await _until_waiting(pg_url, 2, "the parent's cancel")
    await holder.release()
    await _both(ending, cancel)
    assert await _status(backend, lease.run_id) == "completed"
    assert await _status(backend, parent_id) == "canceled"
    assert await _finished_but_queued(backend) == []


async def test_endings_and_parent_cancels_raced_many_times(backend: PostgresBackend) -> None:
    """No third connection: the two writes started together, on their own connections, 40
    times, children of a start_child and members of a group in turn."""
    for round_ in range(40):
        if round_ % 2:
            parent_id, lease = await _parent_waiting_on_group(backend)
        else:
            parent_id, _, child_lease = await _parent_waiting_on_child(
                backend, child_status="running"
            )
            assert child_lease is not None
            lease = child_lease
        done = Ending(status="failed", outcome="failed", count_failure=True)
        ending = asyncio.create_task(backend.end_execution(lease, done))
        cancel = asyncio.create_task(backend.cancel(parent_id, reason="operator"))
        await _both(ending, cancel)
        assert await _status(backend, lease.run_id) == "failed"
        assert await _status(backend, parent_id) == "canceled"
        assert await _finished_but_queued(backend) == []
