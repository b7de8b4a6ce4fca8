"""A state machine of concurrency keys at the SPI, on the memory backend and on Postgres.

Rules enqueue runs of three keys (limits 1, 2 and 2, the last with `count_waiting`), claim a
few or all, end held runs every way an execution ends (completed, failed, handed back, parked
on a fact or a sleep), signal parked runs, cancel any run, and (memory, where the clock is the
test's) let every lease lapse so that claims take runs over.

Invariants, read back from the store after every rule:
- a key is never over its limit: the runs holding a slot (running, and waiting with
  `count_waiting`) are at most the key's limit;
- no run is ever stuck behind a limit that is free: right after a claim that could take
  everything, a key with a free slot has no due run left wanting one.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from datetime import timedelta
from typing import Any, TypeVar
from uuid import UUID

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from umt_backend_memory import MemoryBackend
from umt_backend_pg import PostgresBackend
from umt_sdk.backend import (
    Backend,
    Ending,
    Lease,
    NewRun,
    RunQuery,
    RunRecord,
    StepRecord,
    TaskPair,
    new_run_id,
)
from umt_sdk.exceptions import FencingError
from umt_sdk.testing import FakeClock

T = TypeVar("T")

LIMITS = {"a": 1, "b": 2, "c": 2}
COUNT_WAITING = {"c"}
LEASE = timedelta(seconds=30)
WORKER = "machine"
EVERYTHING = 100

keys = st.sampled_from(sorted(LIMITS))
picks = st.integers(min_value=0, max_value=10_000)
endings = st.sampled_from(["completed", "failed", "released", "fact", "sleep"])


class KeysMachine(RuleBasedStateMachine):
    """The store under test comes from `backend()`; `loop` runs its coroutines."""

    loop: asyncio.AbstractEventLoop
    store: Backend
    clock: FakeClock | None = None

    def __init__(self) -> None:
        super().__init__()
        self.pair = TaskPair(name=f"prop.keys.{uuid.uuid4().hex[:8]}", version=1)
        self.key_of: dict[UUID, str] = {}
        self.leases: dict[UUID, Lease] = {}
        self.parked: dict[UUID, str] = {}

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    async def _records(self) -> list[RunRecord]:
        return list(await self.store.list_runs(RunQuery(task_name=self.pair.name, limit=1000)))

    def _claim(self, limit: int) -> None:
        claimed = self._run(
            self.store.claim(worker_id=WORKER, pairs=[self.pair], limit=limit, lease=LEASE)
        )
        for c in claimed:
            self.leases[c.run_id] = Lease(
                run_id=c.run_id, fencing_token=c.fencing_token, worker_id=WORKER, duration=LEASE
            )
            self.parked.pop(c.run_id, None)

    # -- rules ----------------------------------------------------------------------------------

    @rule(key=keys, priority=st.integers(min_value=0, max_value=2))
    def enqueue(self, key: str, priority: int) -> None:
        run_id = new_run_id()
        self._run(
            self.store.enqueue(
                NewRun(
                    run_id=run_id,
                    task_name=self.pair.name,
                    task_version=self.pair.version,
                    input_json="null",
                    input_hash="h",
                    priority=priority,
                    concurrency_key=key,
                    concurrency_limit=LIMITS[key],
                    count_waiting=key in COUNT_WAITING,
                )
            )
        )
        self.key_of[run_id] = key

    @rule(limit=st.integers(min_value=1, max_value=3))
    def claim_some(self, limit: int) -> None:
        self._claim(limit)

    @rule()
    def claim_everything(self) -> None:
        self._claim(EVERYTHING)
        records = self._run(self._records())
        now = max((r.observed_at for r in records if r.observed_at), default=None)
        holders = _holders(records)
        for record in records:
            key = record.concurrency_key
            assert key is not None
            due = record.available_at is not None and now is not None and record.available_at <= now
            if _wants(record) and due:
                assert holders[key] >= LIMITS[key], (
                    f"run {record.run_id} of key {key} is due and left waiting behind a free "
                    f"slot ({holders[key]} of {LIMITS[key]} held)"
                )

    @precondition(lambda self: bool(self.leases))
    @rule(pick=picks, how=endings)
    def end(self, pick: int, how: str) -> None:
        run_id = sorted(self.leases)[pick % len(self.leases)]
        lease = self.leases.pop(run_id)
        record = self._run(self.store.get_run_head(run_id))
        assert record is not None
        now = record.observed_at
        fact = f"go-{run_id}"
        ending = {
            "completed": Ending(status="completed", outcome="completed", output_json="1"),
            "failed": Ending(status="failed", outcome="failed"),
            "released": Ending(status="pending", outcome="released"),
            "fact": Ending(status="waiting", outcome="waiting", wait_for=fact),
            "sleep": Ending(
                status="waiting",
                outcome="waiting",
                available_at=now,
                step=StepRecord(name="nap", kind="sleep", status="waiting", wake_at=now),
            ),
        }[how]
        try:
            result = self._run(self.store.end_execution(lease, ending))
        except FencingError:
            return  # taken over or canceled meanwhile: its holder's writes are refused
        if result == "ended" and how == "fact":
            self.parked[run_id] = fact

    @precondition(lambda self: bool(self.parked))
    @rule(pick=picks)
    def signal(self, pick: int) -> None:
        run_id = sorted(self.parked)[pick % len(self.parked)]
        name = self.parked.pop(run_id)
        self._run(self.store.signal(run_id=run_id, name=name, payload_json="1"))

    @precondition(lambda self: bool(self.key_of))
    @rule(pick=picks)
    def cancel(self, pick: int) -> None:
        run_id = sorted(self.key_of)[pick % len(self.key_of)]
        self._run(self.store.cancel(run_id, reason="machine"))

    @precondition(lambda self: self.clock is not None and bool(self.leases))
    @rule()
    def every_lease_lapses(self) -> None:
        assert self.clock is not None
        self.clock.advance(LEASE * 2)

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def no_key_is_over_its_limit(self) -> None:
        holders = _holders(self._run(self._records()))
        for key, held in holders.items():
            assert held <= LIMITS[key], f"key {key}: {held} runs hold a slot, limit {LIMITS[key]}"


def _holds(record: RunRecord) -> bool:
    return record.status == "running" or (
        record.status == "waiting" and record.concurrency_key in COUNT_WAITING
    )


def _wants(record: RunRecord) -> bool:
    return record.status == "pending" or (
        record.status == "waiting" and record.concurrency_key not in COUNT_WAITING
    )


def _holders(records: list[RunRecord]) -> dict[str, int]:
    held = dict.fromkeys(LIMITS, 0)
    for record in records:
        if _holds(record):
            assert record.concurrency_key is not None
            held[record.concurrency_key] += 1
    return held


@pytest.mark.backend("memory")
def test_concurrency_keys_on_the_memory_backend() -> None:
    loop = asyncio.new_event_loop()
    try:

        class OnMemory(KeysMachine):
            def __init__(self) -> None:
                super().__init__()
                self.loop = loop
                self.clock = FakeClock(auto_advance=False)
                self.store = MemoryBackend(clock=self.clock)

        OnMemory.TestCase.settings = settings(
            settings.get_profile(settings._current_profile or "default"),
            stateful_step_count=40,
        )
        OnMemory.TestCase().runTest()
    finally:
        loop.close()


@pytest.mark.backend("pg")
def test_concurrency_keys_on_postgres(pg_url: str) -> None:
    loop = asyncio.new_event_loop()
    schema = f"keys_{uuid.uuid4().hex[:10]}"
    store = loop.run_until_complete(PostgresBackend.open(pg_url, schema=schema, listen=False))
    try:

        class OnPostgres(KeysMachine):
            def __init__(self) -> None:
                super().__init__()
                self.loop = loop
                self.store = store

        OnPostgres.TestCase.settings = settings(
            settings.get_profile(settings._current_profile or "default"),
            max_examples=15,
            stateful_step_count=30,
        )
        OnPostgres.TestCase().runTest()
    finally:
        loop.run_until_complete(store.close())
        loop.run_until_complete(_drop(pg_url, schema))
        loop.close()


async def _drop(url: str, schema: str) -> None:
    import psycopg
    from psycopg import sql

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
