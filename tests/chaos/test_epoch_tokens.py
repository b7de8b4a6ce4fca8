"""A fencing token is never handed to two claims: not after a Postgres crash (the claim commits
asynchronously, so its sequence advance can be lost), not after a failover to a standby that
missed the last commits. Each test crashes or fails over a real Postgres of its own."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from tests.fixtures.private_pg import PrivatePostgres, running_standby
from umt_backend_pg import PostgresBackend, migrate
from umt_sdk.backend import Beat, ClaimedRun, Ending, Lease, NewRun, StepRecord, TaskPair
from umt_sdk.exceptions import FencingError

SCHEMA = "umt_epoch"
PAIR = TaskPair(name="t", version=1)
SHORT = timedelta(milliseconds=200)


def _completed(output_json: str) -> Ending:
    return Ending(status="completed", outcome="completed", output_json=output_json)


async def _open(url: str) -> PostgresBackend:
    return await PostgresBackend.open(
        url, schema=SCHEMA, run_migrations=False, listen=False, max_size=2
    )


async def _enqueue(backend: PostgresBackend, n: int) -> list[uuid.UUID]:
    ids = []
    for _ in range(n):
        run_id = uuid.uuid4()
        await backend.enqueue(
            NewRun(
                run_id=run_id,
                task_name=PAIR.name,
                task_version=PAIR.version,
                input_json="null",
                input_hash="0" * 64,
            )
        )
        ids.append(run_id)
    return ids


async def _claim_each(backend: PostgresBackend, worker: str, n: int) -> list[ClaimedRun]:
    """n claims of one run each (n transactions, n tokens)."""
    claimed: list[ClaimedRun] = []
    for _ in range(n):
        got = await backend.claim(worker_id=worker, pairs=[PAIR], limit=1, lease=SHORT)
        claimed.extend(got)
    return claimed


async def _claim_all(backend: PostgresBackend, worker: str, n: int) -> list[ClaimedRun]:
    """Claim until n runs are held (the old leases lapse first, or were lost in the crash)."""
    held: dict[uuid.UUID, ClaimedRun] = {}
    deadline = time.monotonic() + 30
    while len(held) < n:
        for run in await backend.claim(
            worker_id=worker, pairs=[PAIR], limit=n, lease=timedelta(seconds=30)
        ):
            held[run.run_id] = run
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(held)} of {n} runs could be claimed again")
        await asyncio.sleep(0.05)
    return list(held.values())


async def _close(backend: PostgresBackend) -> None:
    with contextlib.suppress(Exception):  # its server may be gone
        await asyncio.wait_for(backend.close(), timeout=10)


async def _assert_old_claims_fenced(
    backend: PostgresBackend, old: Sequence[ClaimedRun], new: Sequence[ClaimedRun]
) -> None:
    old_tokens = [c.fencing_token for c in old]
    new_tokens = [c.fencing_token for c in new]
    assert not set(old_tokens) & set(new_tokens), (
        f"tokens handed to two claims: {sorted(set(old_tokens) & set(new_tokens))}"
    )
    newest = {c.run_id: c.fencing_token for c in new}
    for stale in old:
        assert newest[stale.run_id] > stale.fencing_token, (stale.run_id, stale.fencing_token)
    # The stale claims learn it at their next heartbeat and every write of theirs is refused.
    beats = [Beat(run_id=c.run_id, fencing_token=c.fencing_token) for c in old]
    result = await backend.heartbeat(worker_id="A", beats=beats, lease=SHORT)
    assert result.lost == {c.run_id for c in old}
    victim = old[-1]
    lease = Lease(
        run_id=victim.run_id, fencing_token=victim.fencing_token, worker_id="A", duration=SHORT
    )
    with pytest.raises(FencingError):
        await backend.record_step(
            lease,
            StepRecord(
                name="s",
                kind="step",
                status="completed",
                output_json="1",
                fencing_token=victim.fencing_token,
            ),
        )
    with pytest.raises(FencingError):
        await backend.end_execution(lease, _completed("1"))
    info = await backend.get_run(victim.run_id)
    assert info is not None
    assert info.status == "running"
    assert info.steps == ()
    assert info.fencing_token == newest[victim.run_id]


async def test_no_token_is_handed_out_twice_across_postgres_crashes(
    private_pg: PrivatePostgres,
) -> None:
    url = private_pg.url
    await migrate(url, schema=SCHEMA)
    for _cycle in range(3):
        backend = await _open(url)
        await _enqueue(backend, 40)
        # Each claim commits without waiting for its WAL; crash before the WAL writer flushes.
        old = await _claim_each(backend, "A", 40)
        private_pg.crash()
        await _close(backend)
        private_pg.start()
        backend = await _open(url)
        try:
            new = await _claim_all(backend, "B", 40)
            await _assert_old_claims_fenced(backend, old, new)
            for run in new:  # leave nothing claimable for the next cycle
                lease = Lease(
                    run_id=run.run_id,
                    fencing_token=run.fencing_token,
                    worker_id="B",
                    duration=timedelta(seconds=30),
                )
                await backend.end_execution(lease, _completed("null"))
        finally:
            await _close(backend)


def _standby_base() -> Path:
    base = Path(tempfile.mkdtemp(prefix="umt-standby-"))
    base.chmod(0o755)  # the server runs as its own system user when we are root
    return base


def _caught_up(primary: PrivatePostgres, standby: PrivatePostgres) -> bool:
    with psycopg.connect(primary.url, autocommit=True) as p:
        row = p.execute("SELECT pg_current_wal_lsn()").fetchone()
        assert row is not None
        target = row[0]
    try:
        with psycopg.connect(standby.url, autocommit=True, connect_timeout=2) as s:
            got = s.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)).fetchone()
    except psycopg.OperationalError:
        return False
    return bool(got and got[0])


async def test_no_token_is_handed_out_twice_after_failover_to_a_lagging_standby(
    private_pg: PrivatePostgres,
) -> None:
    primary = private_pg
    await migrate(primary.url, schema=SCHEMA)
    backend = await _open(primary.url)
    await _enqueue(backend, 40)
    # One claim before the copy, so the standby knows the primary's epoch and sequence.
    warm = await _claim_each(backend, "A", 1)
    lease = Lease(
        run_id=warm[0].run_id, fencing_token=warm[0].fencing_token, worker_id="A", duration=SHORT
    )
    await backend.end_execution(lease, _completed("null"))
    base = _standby_base()
    try:
        with running_standby(primary, base / "s") as standby:
            standby.start()
            standby.wait_running()
            deadline = time.monotonic() + 60
            while not _caught_up(primary, standby):
                assert time.monotonic() < deadline, "the standby did not catch up"
                await asyncio.sleep(0.1)
            # The standby goes away and misses what follows: 39 claims, committed on the primary.
            standby.stop()
            old = await _claim_each(backend, "A", 39)
            with psycopg.connect(primary.url, autocommit=True) as conn:
                conn.execute("CHECKPOINT")  # durable on the primary, lost to the standby
            primary.crash()
            await _close(backend)
            # Failover: the standby starts (its primary is gone) and is promoted.
            standby.start()
            standby.promote()
            standby.wait_running()
            promoted = await _open(standby.url)
            try:
                new = await _claim_all(promoted, "B", 39)
                await _assert_old_claims_fenced(promoted, old, new)
            finally:
                await _close(promoted)
    finally:
        shutil.rmtree(base, ignore_errors=True)
