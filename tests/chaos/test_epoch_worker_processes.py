"""Real worker processes while Postgres is crashed (`pg_ctl stop -m immediate`) again and
again: no step body ever runs under a token another execution also held, the token-fenced
outside store never takes two writes under one token, and the ledger-fenced business table
gets each payment once.

Each crash cycle: a first run opens the server incarnation's token epoch and completes; then a
checkpoint (as Postgres makes every few minutes: the next `nextval` writes the sequence's WAL
record again); then a batch of runs arrives, a worker claims it (a commit that does not wait for the
flush), and Postgres is crashed at once, while the workers' step bodies, which touch only
files and a business database on another server, go on. After the restart the batch is
claimed again; the holders of the lost claims must find out at their next heartbeat or write
and stop. Set UMT_CHAOS_EPOCH_CRASHES (default 3) for a longer run.

The workers (`tests/_procs/worker.py --tasks tests.chaos.test_epoch_worker_processes`) serve
`epoch.pay` of this module. Nothing its step bodies do touches the engine's database, which the
test crashes: every body appends a line `<run key> <step> <attempt token> <pid>` to
`<workdir>/bodies.log`, and the fenced side effect goes to a business database on another
server:
- inside `with_attempt_token` (ledger installed there with `install_ledger`), it writes to an
  outside store that fences by token itself, as outside systems do: a write is taken unless
  the store has already seen a newer token for the op (`store_writes`, `accepted`);
- the ledger's commit adds the op's row to `payments` (deliberately no unique key).

`SLOW_FLUSH` (`wal_writer_delay = 10s`, the background writer off) keeps an asynchronous commit
(a claim) unflushed until something else flushes the WAL, so a crash right after a claim loses
it every time instead of when the crash happens to land within the default 200 ms. That is the
condition of the bug the token epochs fix, made deterministic, not a different one.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import psycopg
import pytest

from tests._procs.support import Spawner, eventually, fetch, q
from tests._procs.worker import READY, append_line, config, say
from tests.fixtures.private_pg import PrivatePostgres
from umt_backend_pg import install_ledger, migrate
from umt_sdk import (
    AttemptInfo,
    FencingError,
    Registry,
    RetryPolicy,
    TaskContext,
    TaskDefinition,
    connect,
    task,
    with_attempt_token,
)
from umt_sdk.exceptions import BackendUnavailableError

pytestmark = pytest.mark.slow

T = TypeVar("T")

SCHEMA = "umt_epoch_workers"
CRASHES = int(os.environ.get("UMT_CHAOS_EPOCH_CRASHES", "3"))
BATCH = 3
WORKERS = 2
SLOW_FLUSH = {"wal_writer_delay": "10s", "bgwriter_lru_maxpages": "0"}
BODIES = "bodies.log"
BUSINESS_DDL = (
    "CREATE TABLE payments (op_key text NOT NULL, receipt text NOT NULL, token bigint NOT NULL,"
    " pid integer NOT NULL)",
    "CREATE TABLE store_fence (op_key text PRIMARY KEY, max_token bigint NOT NULL)",
    "CREATE TABLE store_writes (seq bigserial PRIMARY KEY, op_key text NOT NULL,"
    " token bigint NOT NULL, pid integer NOT NULL, accepted boolean NOT NULL,"
    " at timestamptz NOT NULL DEFAULT clock_timestamp())",
)


@attrs.frozen
class Payment:
    key: str
    delay: float = 1.0
    """How long the side effect takes (seconds): a crash lands while it runs."""


async def install_business(conn: psycopg.AsyncConnection[Any], schema: str) -> None:
    await install_ledger(conn, schema=schema)
    for statement in BUSINESS_DDL:
        await conn.execute(statement)


def log_body(ctx: TaskContext[Payment], step: str) -> None:
    line = f"{ctx.input.key} {step} {ctx.attempt_token} {os.getpid()}"
    append_line(config().workdir / BODIES, line)  # one small append: atomic among processes


async def store_write(op_key: str, token: int) -> None:
    """The outside store: takes the write unless it has seen a newer token for `op_key`."""
    async with await psycopg.AsyncConnection.connect(
        config().business_url, autocommit=True
    ) as conn:
        await conn.execute(
            "WITH fence AS ("
            " INSERT INTO store_fence (op_key, max_token) VALUES (%(op)s, %(token)s)"
            " ON CONFLICT (op_key) DO UPDATE SET max_token = EXCLUDED.max_token"
            " WHERE store_fence.max_token <= EXCLUDED.max_token RETURNING 1)"
            " INSERT INTO store_writes (op_key, token, pid, accepted)"
            " SELECT %(op)s, %(token)s, %(pid)s, EXISTS (SELECT 1 FROM fence)",
            {"op": op_key, "token": token, "pid": os.getpid()},
        )


async def pay_step(ctx: TaskContext[Payment]) -> str:
    log_body(ctx, "pay")
    op_key = f"pay-{ctx.input.key}"

    async def act(info: AttemptInfo) -> str:
        log_body(ctx, "act")
        await store_write(op_key, info.attempt_token)
        await asyncio.sleep(ctx.input.delay)
        return f"receipt-{info.attempt_token}"

    async def commit(tx: Any, receipt: str) -> None:
        await tx.execute(
            "INSERT INTO payments (op_key, receipt, token, pid) VALUES (%s, %s, %s, %s)",
            (op_key, receipt, ctx.attempt_token, os.getpid()),
        )

    async with await psycopg.AsyncConnection.connect(
        config().business_url, autocommit=True
    ) as conn:
        try:
            return await with_attempt_token(conn, op_key, act, commit=commit)
        except FencingError as exc:
            say(f"FENCED run={ctx.run_id} token={ctx.attempt_token}: {exc}")
            raise


async def note_step(ctx: TaskContext[Payment]) -> str:
    log_body(ctx, "note")
    await asyncio.sleep(ctx.input.delay / 2)
    return f"noted {ctx.input.key}"


@task("epoch.pay", version=1, retry=RetryPolicy.none())
async def pay(ctx: TaskContext[Payment]) -> list[str]:
    """The fenced payment, then a plain step; no retries: a failure would show."""
    receipt = await ctx.step.run("pay", pay_step, ctx)
    note = await ctx.step.run("note", note_step, ctx)
    return [receipt, note]


STEPS = ("pay", "note")
TASKS: list[TaskDefinition[Any, Any]] = [pay]


# -- the test -------------------------------------------------------------------------------------


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


async def _claimed(url: str, keys: list[str]) -> bool:
    rows = await fetch(
        url,
        q(
            "SELECT 1 FROM {schema}.executions e JOIN {schema}.runs r ON r.id = e.run_id"
            " WHERE r.input->>'key' = ANY(%s) LIMIT 1",
            SCHEMA,
        ),
        (keys,),
    )
    return bool(rows)


def _bodies(workdir: Path) -> list[tuple[str, str, int, int]]:
    """(run key, step, token, pid) of every step body (and side effect) that ran."""
    lines = (workdir / BODIES).read_text().splitlines()
    return [(k, s, int(t), int(p)) for k, s, t, p in (line.split() for line in lines)]


async def test_worker_processes_through_postgres_crashes_never_share_a_token(
    private_pg: PrivatePostgres, second_db: str, tmp_path: Path
) -> None:
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    keys: list[str] = []

    business_url = second_db  # on the session's server, which this test does not crash
    async with await psycopg.AsyncConnection.connect(business_url, autocommit=True) as conn:
        await install_business(conn, SCHEMA)
    server = private_pg
    server.configure(SLOW_FLUSH)
    url = server.url
    await migrate(url, schema=SCHEMA)
    async with await connect(
        url, registry=Registry(TASKS), schema=SCHEMA, run_migrations=False
    ) as client:
        with Spawner.under(
            tmp_path, tasks=__name__, url=url, schema=SCHEMA, business_url=business_url
        ) as spawner:
            workers = [
                spawner.start(group=f"w{i}", lease=3.0, concurrency=8, poll=0.05, max_size=10)
                for i in range(WORKERS)
            ]

            def describe() -> str:
                return f"seed {seed}\n" + "\n".join(w.describe() for w in workers)

            for worker in workers:
                await worker.wait_ready()
                assert READY in worker.output()

            async def completed(key: str) -> bool:
                rows = await fetch(
                    url,
                    q("SELECT status FROM {schema}.runs WHERE input->>'key' = %s", SCHEMA),
                    (key,),
                )
                return bool(rows) and rows[0]["status"] == "completed"

            for cycle in range(CRASHES):
                first = f"first-{cycle}"
                await retrying(
                    lambda first=first: client.enqueue(pay, Payment(key=first, delay=0.05)),
                    what="enqueue",
                )
                keys.append(first)
                await eventually(
                    lambda first=first: completed(first),
                    timeout=20,
                    what=f"the first run of cycle {cycle}",
                    on_timeout=describe,
                )
                server.checkpoint()
                # The batch arrives in one commit and is claimed in one statement.
                batch = [f"c{cycle}-{i}" for i in range(BATCH)]
                async with (
                    await psycopg.AsyncConnection.connect(url) as conn,
                    conn.transaction(),
                ):
                    for key in batch:
                        await client.enqueue(pay, Payment(key=key, delay=1.0), conn=conn)
                keys.extend(batch)
                await eventually(
                    lambda batch=batch: _claimed(url, batch),
                    timeout=20,
                    what=f"a claim of batch {cycle}",
                    interval=0.005,
                    on_timeout=describe,
                )
                server.crash()  # at once: that claim is not flushed yet
                server.start()
                await asyncio.sleep(rng.uniform(0.2, 1.0))

            async def all_completed() -> bool:
                rows = await fetch(url, q("SELECT status FROM {schema}.runs", SCHEMA))
                done = Counter(r["status"] for r in rows)
                return done["completed"] + done["failed"] + done["canceled"] == len(keys)

            await eventually(
                all_completed,
                timeout=90,
                what="every run to finish",
                interval=0.1,
                on_timeout=describe,
            )
            for worker in workers:
                assert worker.alive, describe()
                assert "Traceback" not in worker.errors(), describe()

        runs = await fetch(
            url,
            q(
                "SELECT id, status, failures, output, error, input->>'key' AS key"
                " FROM {schema}.runs",
                SCHEMA,
            ),
        )
        steps = await fetch(
            url,
            q("SELECT run_id, name, status, fencing_token, output FROM {schema}.steps", SCHEMA),
        )
        executions = await fetch(
            url, q("SELECT run_id, fencing_token, outcome FROM {schema}.executions", SCHEMA)
        )
        writes = await fetch(business_url, "SELECT op_key, token, pid, accepted FROM store_writes")
        payments = await fetch(business_url, "SELECT op_key, receipt, token FROM payments")
        ledger = await fetch(
            business_url,
            q("SELECT op_key, fencing_token, result FROM {schema}.op_ledger", SCHEMA),
        )

    by_key = {r["key"]: r for r in runs}
    assert sorted(by_key) == sorted(keys), describe()
    bad = {
        k: (r["status"], r["failures"], (r["error"] or {}).get("message"))
        for k, r in by_key.items()
        if r["status"] != "completed"
    }
    assert not bad, f"runs that did not complete: {bad}\n{describe()}"

    bodies = _bodies(spawner.workdir)
    # 1. No step body ran under a token that another execution also held.
    holders: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for key, step, token, pid in bodies:
        holders[(key, step, token)].append(pid)
    shared = {k: pids for k, pids in holders.items() if len(pids) > 1}
    assert not shared, (
        f"step bodies that ran more than once under one token (run, step, token): pids "
        f"{shared}\n{describe()}"
    )

    # 2. The outside store fenced by token never took two writes under one token.
    accepted: dict[str, list[int]] = defaultdict(list)
    for write in writes:
        if write["accepted"]:
            accepted[write["op_key"]].append(write["token"])
    doubled = {op: t for op, t in accepted.items() if len(set(t)) != len(t)}
    assert not doubled, f"the fenced store took two writes under one token: {doubled}"

    # 3. The ledger-fenced business table got each payment exactly once, under the token the
    #    ledger recorded, and the run's output is that payment.
    per_op = Counter(p["op_key"] for p in payments)
    assert per_op == Counter(f"pay-{k}" for k in keys), f"payments per op: {dict(per_op)}"
    ledger_by_op = {e["op_key"]: e for e in ledger}
    for payment in payments:
        entry = ledger_by_op[payment["op_key"]]
        assert entry["fencing_token"] == payment["token"], (entry, payment)
        assert entry["result"] == payment["receipt"], (entry, payment)
        run = by_key[payment["op_key"].removeprefix("pay-")]
        assert run["output"][0] == payment["receipt"], (run, payment)

    # 4. Completed steps never ran again; every step record is of an execution the engine
    #    knows (the holders of lost claims wrote nothing to it); count the lost claims.
    known = {(e["run_id"], e["fencing_token"]) for e in executions}
    recorded: dict[tuple[Any, str], int] = {}
    for s in steps:
        assert s["status"] == "completed", s
        assert (s["run_id"], s["fencing_token"]) in known, f"step of an unknown claim: {s}"
        recorded[(s["run_id"], s["name"])] = s["fencing_token"]
    lost_claims: set[tuple[str, int]] = set()
    for key, run in by_key.items():
        for name in STEPS:
            token = recorded[(run["id"], name)]
            ran = [t for k, s, t, _ in bodies if k == key and s == name]
            assert ran.count(token) == 1, (key, name, token, ran)
            assert max(ran) == token, f"run {key} step {name} re-ran after {token}: {ran}"
        for k, _, t, _ in bodies:
            if k == key and (run["id"], t) not in known:
                lost_claims.add((key, t))
    # The crashes did lose claims (else this test would not have tested the case), and each
    # holder of a lost claim stopped at its next heartbeat or write: none went on to the
    # step after the fenced payment.
    assert lost_claims, f"no crash lost a claim\n{describe()}"
    went_on = [(k, s, t) for k, s, t, _ in bodies if s == "note" and (k, t) in lost_claims]
    assert not went_on, f"holders of lost claims went on: {went_on}\n{describe()}"
    told = sum(w.output().count("FENCED") + w.errors().count("lost the lease") for w in workers)
    assert told, f"no worker was told it lost a claim\n{describe()}"
    print(f"seed {seed}: {CRASHES} crashes, {len(keys)} runs, lost claims {sorted(lost_claims)}")
