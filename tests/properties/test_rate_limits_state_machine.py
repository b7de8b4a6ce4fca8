"""A state machine of rate limits at the SPI, on the memory backend and on Postgres.

Rules enqueue runs into three buckets of two limits ("a" split by key into two buckets, "b"
with one), claim a few or all, end held runs (completed, failed, handed back: a hand-back
starts again and takes a new token), cancel any run, take steps' tokens for held runs, change
a limit, pause and resume one, and (memory, where the clock is the test's) let time pass and
every lease lapse so that claims take runs over (a takeover takes no token).

Invariants, from what the store handed out (each start's `claimed_at`, each step token's
`observed_at`, both on the store's clock):
- never more tokens than the limit allows in any window: within the time since the limit was
  last changed, any k consecutive takes of a bucket span at least (k - limit) intervals, i.e.
  at most `limit + d / interval` takes in any span `d` (GCRA: a burst of `limit`, then one per
  interval); no token at all while the limit is paused;
- no run is stuck behind a limit that has a free token: right after a claim that could take
  everything, no pending run with a limit is due (each was started, or parked until its
  bucket's next token, or held by a pause).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from datetime import datetime, timedelta
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
    RateLimitStore,
    RunQuery,
    RunRecord,
    TaskPair,
    TokenRequest,
    new_run_id,
    token_interval,
)
from umt_sdk.exceptions import FencingError
from umt_sdk.testing import FakeClock

T = TypeVar("T")

LEASE = timedelta(seconds=30)
WORKER = "machine"
EVERYTHING = 100
BUCKETS = (("a", "k1"), ("a", "k2"), ("b", ""))

buckets = st.sampled_from(BUCKETS)
limit_names = st.sampled_from(["a", "b"])
picks = st.integers(min_value=0, max_value=10_000)
endings = st.sampled_from(["completed", "failed", "released"])


class LimitsMachine(RuleBasedStateMachine):
    """The store under test comes from the subclass (`store`, `clock`, `per`); `loop` runs its
    coroutines. `per` is the limits' window: short on the fake clock, long on the wall clock
    (where no token comes back during a run of the machine)."""

    loop: asyncio.AbstractEventLoop
    store: Backend
    clock: FakeClock | None = None
    per: timedelta

    def __init__(self) -> None:
        super().__init__()
        tag = uuid.uuid4().hex[:8]
        self.pair = TaskPair(name=f"prop.limits.{tag}", version=1)
        self.names = {"a": f"prop.a.{tag}", "b": f"prop.b.{tag}"}
        self.limits = {"a": 2, "b": 3}
        self.paused: set[str] = set()
        self.bucket_of: dict[UUID, tuple[str, str]] = {}
        self.state: dict[UUID, str] = {}
        self.leases: dict[UUID, Lease] = {}
        self.takes: dict[tuple[str, str], list[datetime]] = {b: [] for b in BUCKETS}
        self.steps = 0
        self.defined = False

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def _limits(self) -> RateLimitStore:
        assert isinstance(self.store, RateLimitStore)
        return self.store

    def _define(self) -> None:
        if not self.defined:
            for short, name in self.names.items():
                self._run(
                    self._limits().define_rate_limit(name, limit=self.limits[short], per=self.per)
                )
            self.defined = True

    async def _records(self) -> list[RunRecord]:
        return list(await self.store.list_runs(RunQuery(task_name=self.pair.name, limit=1000)))

    def _took(self, bucket: tuple[str, str], when: datetime) -> None:
        assert bucket[0] not in self.paused, f"a token of paused limit {bucket[0]} was given"
        self.takes[bucket].append(when)

    def _claim(self, limit: int) -> None:
        claimed = self._run(
            self.store.claim(worker_id=WORKER, pairs=[self.pair], limit=limit, lease=LEASE)
        )
        for c in claimed:
            if self.state[c.run_id] == "pending":  # a start: it took a token
                self._took(self.bucket_of[c.run_id], c.claimed_at)
            self.state[c.run_id] = "running"
            self.leases[c.run_id] = Lease(
                run_id=c.run_id, fencing_token=c.fencing_token, worker_id=WORKER, duration=LEASE
            )

    # -- rules ----------------------------------------------------------------------------------

    @rule(bucket=buckets, priority=st.integers(min_value=0, max_value=2))
    def enqueue(self, bucket: tuple[str, str], priority: int) -> None:
        self._define()
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
                    rate_limit=self.names[bucket[0]],
                    rate_limit_key=bucket[1],
                )
            )
        )
        self.bucket_of[run_id] = bucket
        self.state[run_id] = "pending"

    @rule(limit=st.integers(min_value=1, max_value=3))
    def claim_some(self, limit: int) -> None:
        self._claim(limit)

    @rule()
    def claim_everything(self) -> None:
        self._claim(EVERYTHING)
        records = self._run(self._records())
        for record in records:
            now = record.observed_at
            assert now is not None
            if record.status == "pending" and record.available_at is not None:
                assert record.available_at > now, (
                    f"run {record.run_id} of limit {record.rate_limit} is due and was neither "
                    "started nor parked by a claim that could take everything"
                )

    @precondition(lambda self: bool(self.leases))
    @rule(pick=picks, how=endings)
    def end(self, pick: int, how: str) -> None:
        run_id = sorted(self.leases)[pick % len(self.leases)]
        lease = self.leases.pop(run_id)
        ending = {
            "completed": Ending(status="completed", outcome="completed", output_json="1"),
            "failed": Ending(status="failed", outcome="failed"),
            "released": Ending(status="pending", outcome="released"),
        }[how]
        try:
            result = self._run(self.store.end_execution(lease, ending))
        except FencingError:
            return  # taken over or canceled meanwhile: its holder's writes are refused
        if result == "ended":
            self.state[run_id] = "pending" if how == "released" else "done"

    @precondition(lambda self: bool(self.state))
    @rule(pick=picks)
    def cancel(self, pick: int) -> None:
        run_id = sorted(self.state)[pick % len(self.state)]
        if self._run(self.store.cancel(run_id, reason="machine")) == "canceled":
            self.state[run_id] = "done"
            self.leases.pop(run_id, None)

    @precondition(lambda self: bool(self.leases))
    @rule(pick=picks, bucket=buckets)
    def step_takes_a_token(self, pick: int, bucket: tuple[str, str]) -> None:
        run_id = sorted(self.leases)[pick % len(self.leases)]
        self.steps += 1
        request = TokenRequest(
            limit=self.names[bucket[0]], key=bucket[1], step=f"s{self.steps}", attempt=1
        )
        try:
            grant = self._run(self._limits().take_rate_token(self.leases[run_id], request))
        except FencingError:
            self.leases.pop(run_id)
            return
        if grant.status == "granted":
            self._took(bucket, grant.observed_at)
            again = self._run(self._limits().take_rate_token(self.leases[run_id], request))
            assert again.status == "granted", "an attempt keeps its token"
        else:
            assert grant.status == ("paused" if bucket[0] in self.paused else "wait")

    @precondition(lambda self: self.defined)
    @rule(short=limit_names, limit=st.integers(min_value=1, max_value=4))
    def change_a_limit(self, short: str, limit: int) -> None:
        self._run(self._limits().set_rate_limit(self.names[short], limit=limit, per=self.per))
        self.limits[short] = limit
        for bucket in BUCKETS:  # the bound holds from the change on (tokens taken stay taken)
            if bucket[0] == short:
                self.takes[bucket] = []

    @precondition(lambda self: self.defined)
    @rule(short=limit_names, paused=st.booleans())
    def pause_or_resume(self, short: str, paused: bool) -> None:
        changed = self._run(self._limits().pause_rate_limit(self.names[short], paused=paused))
        assert changed == (paused != (short in self.paused))
        if paused:
            self.paused.add(short)
        else:
            self.paused.discard(short)

    @precondition(lambda self: self.clock is not None)
    @rule(seconds=st.integers(min_value=1, max_value=12))
    def time_passes(self, seconds: int) -> None:
        assert self.clock is not None
        self.clock.advance(timedelta(seconds=seconds))

    @precondition(lambda self: self.clock is not None and bool(self.leases))
    @rule()
    def every_lease_lapses(self) -> None:
        assert self.clock is not None
        self.clock.advance(LEASE * 2)

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def no_bucket_gives_more_than_its_limit_allows(self) -> None:
        for bucket, takes in self.takes.items():
            limit = self.limits[bucket[0]]
            interval = token_interval(limit, self.per)
            ordered = sorted(takes)
            for i in range(len(ordered)):
                for j in range(i + limit, len(ordered)):
                    # takes i..j are j - i + 1 tokens: at most `limit` at once, then one per
                    # interval.
                    assert ordered[j] - ordered[i] >= (j - i + 1 - limit) * interval, (
                        f"bucket {bucket}: {j - i + 1} tokens within {ordered[j] - ordered[i]}, "
                        f"limit {limit} per {self.per}"
                    )


@pytest.mark.backend("memory")
def test_rate_limits_on_the_memory_backend() -> None:
    loop = asyncio.new_event_loop()
    try:

        class OnMemory(LimitsMachine):
            per = timedelta(seconds=10)

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
def test_rate_limits_on_postgres(pg_url: str) -> None:
    loop = asyncio.new_event_loop()
    schema = f"limits_{uuid.uuid4().hex[:10]}"
    store = loop.run_until_complete(PostgresBackend.open(pg_url, schema=schema, listen=False))
    try:

        class OnPostgres(LimitsMachine):
            per = timedelta(hours=1)

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
