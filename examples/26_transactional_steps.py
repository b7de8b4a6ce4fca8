"""Exactly-once database writes without an op key: transactional steps on Postgres.

Run it: `python examples/26_transactional_steps.py` (uses `UMT_DATABASE_URL`, else the
embedded Postgres in `.umt/pg`; everything lives in a fresh schema, dropped at the end).

A refund debits the shop's account and books a ledger entry, in the engine's own database.
The step is transactional (`@step("debit", transactional=True)`): its writes commit in the
transaction that records the step, fenced by the run's lease. Worker A debits, then freezes
inside its transaction (a GC pause, a partition): its lease lapses and worker B takes over.
B's debit waits for A's row lock; when A wakes up, its commit is refused (`FencingError` in
the worker, its writes rolled back) and B's commits. The account is debited once, booked once,
by B. Then a fact wait makes the run resume: the recorded step is replayed, not run again.

A second refund is reversed: its debit (`ctx.step.transaction`, taking a token of the
`refunds` rate limit before its transaction begins) registers `compensate=credit`, a step
declared transactional too, and the run gives up (`raise Compensate(...)`). The credit runs as
the step `umt.compensate:debit` in a transaction of its own: the undo lands exactly once too.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import timedelta
from typing import Any

import psycopg

from umt_backend_pg import database_url
from umt_sdk import (
    Compensate,
    RateLimit,
    Registry,
    RunCompensatedError,
    TaskContext,
    connect,
    step,
    task,
)
from umt_sdk.testing import freeze_heartbeats

URL = database_url()  # UMT_DATABASE_URL if set, else the embedded Postgres
SCHEMA = f"ex26_{uuid.uuid4().hex[:8]}"  # the engine's tables and the shop's, in one schema
LEASE = timedelta(seconds=1)  # short, so that the takeover comes quickly
A_INSIDE, WAKE_A = threading.Event(), threading.Event()
B_INSIDE = asyncio.Event()
DEBITS: list[int] = []  # the attempt token of every debit body that ran


@step("debit", transactional=True)
async def debit(tx: psycopg.AsyncConnection[Any], refund_id: str, cents: int, token: int) -> int:
    """Runs inside the step's transaction: these writes land if and only if the step is
    recorded, by the attempt that still holds the run."""
    DEBITS.append(token)
    if len(DEBITS) == 2:
        B_INSIDE.set()
    cur = await tx.execute(
        f"UPDATE {SCHEMA}.accounts SET cents = cents - %s WHERE id = 'shop' RETURNING cents",
        (cents,),
    )
    row = await cur.fetchone()
    assert row is not None
    await tx.execute(
        f"INSERT INTO {SCHEMA}.ledger (refund_id, cents, token) VALUES (%s, %s, %s)",
        (refund_id, -cents, token),
    )
    if len(DEBITS) == 1:  # attempt A freezes inside its transaction, its rows written
        A_INSIDE.set()
        await asyncio.to_thread(WAKE_A.wait)
    return int(row[0])


@task("refund", version=1)
async def refund(ctx: TaskContext[str]) -> str:
    balance = await debit(ctx.input, 1250, ctx.attempt_token)  # the tx is umt's to give
    await ctx.step.wait_for_fact("mailed")  # the run parks; its resume replays the debit
    return f"refund {ctx.input}: shop balance {balance} cents"


REFUNDS = RateLimit[str]("refunds", limit=100, per=timedelta(minutes=1))  # the bank's quota


@step("credit", transactional=True)
async def credit(tx: psycopg.AsyncConnection[Any], booked: dict[str, Any]) -> None:
    """The undo of a debit (`compensate=credit`), called with the debit's output. Declared
    transactional, it runs as the step `umt.compensate:<step>` in a transaction of its own."""
    await tx.execute(
        f"UPDATE {SCHEMA}.accounts SET cents = cents + %s WHERE id = 'shop'", (booked["cents"],)
    )
    await tx.execute(
        f"INSERT INTO {SCHEMA}.ledger (refund_id, cents, token) VALUES (%s, %s, %s)",
        (booked["refund_id"], booked["cents"], booked["token"]),
    )


@task("refund_reversed", version=1)
async def refund_reversed(ctx: TaskContext[str]) -> None:
    async def book(tx: psycopg.AsyncConnection[Any], cents: int, token: int) -> dict[str, Any]:
        await tx.execute(
            f"UPDATE {SCHEMA}.accounts SET cents = cents - %s WHERE id = 'shop'", (cents,)
        )
        await tx.execute(
            f"INSERT INTO {SCHEMA}.ledger (refund_id, cents, token) VALUES (%s, %s, %s)",
            (ctx.input, -cents, token),
        )
        return {"refund_id": ctx.input, "cents": cents, "token": token}

    await ctx.step.transaction(
        "debit", book, 500, ctx.attempt_token, rate_limit=REFUNDS, compensate=credit
    )
    raise Compensate("the carrier refused the return label")  # the credit runs, once


async def main() -> None:
    registry = Registry([refund, refund_reversed])
    engine = await connect(URL, registry=registry, schema=SCHEMA)  # migrates SCHEMA
    try:
        async with await psycopg.AsyncConnection.connect(URL, autocommit=True) as conn:
            await conn.execute(
                f"CREATE TABLE {SCHEMA}.accounts (id text PRIMARY KEY, cents bigint NOT NULL);"
                f"INSERT INTO {SCHEMA}.accounts VALUES ('shop', 10000);"
                f"CREATE TABLE {SCHEMA}.ledger (refund_id text, cents bigint, token bigint)"
            )
        run = await engine.enqueue(refund, "r-42")
        worker_a = engine.worker(lease=LEASE, worker_id="A", concurrency=1)
        await worker_a.start()
        await asyncio.to_thread(A_INSIDE.wait)
        freeze_heartbeats(worker_a)  # A is stuck in its transaction; its lease will lapse
        print("worker A debited inside its transaction, then froze; its lease will lapse")
        async with engine.worker(lease=LEASE, worker_id="B", poll_interval=LEASE / 10):
            await B_INSIDE.wait()  # B took the run over and runs the debit again
            print("worker B runs the debit again; it waits for A's row lock")
            WAKE_A.set()  # A goes on: its commit is fenced, its writes roll back
            info = await engine.get(run.run_id)
            while info.status != "waiting":  # B committed the step and parked on the fact
                await asyncio.sleep(0.05)
                info = await engine.get(run.run_id)
            await engine.signal(run.run_id, "mailed", {"to": "customer@example.com"})
            result = await run.result(timeout=20)
        await worker_a.stop()
        print(f"result: {result!r}")

        async with await psycopg.AsyncConnection.connect(URL, autocommit=True) as conn:
            cur = await conn.execute(f"SELECT cents FROM {SCHEMA}.accounts")
            balance = await cur.fetchall()
            cur = await conn.execute(f"SELECT refund_id, cents, token FROM {SCHEMA}.ledger")
            ledger = await cur.fetchall()
        info = await engine.get(run.run_id)
        a, b = (e.fencing_token for e in info.executions[:2])
        timeline = [(s.name, s.status, s.fencing_token) for s in info.timeline]
        print(f"debit bodies run (token): {DEBITS}; balance: {balance}; ledger: {ledger}")
        print(f"timeline (step, status, token): {timeline}")
        assert [a, b] == DEBITS, "A's body ran, B's body ran; the replay ran none"
        assert balance == [(10000 - 1250,)], "debited once"
        assert ledger == [("r-42", -1250, b)], "booked once, by the attempt that recorded it"
        assert [e.outcome for e in info.executions] == ["interrupted", "waiting", "completed"]
        assert result == "refund r-42: shop balance 8750 cents"
        assert timeline[:2] == [("debit", "interrupted", a), ("debit", "completed", b)]

        reversed_run = await engine.enqueue(refund_reversed, "r-43")
        async with engine.worker():
            try:
                await reversed_run.result(timeout=20)
            except RunCompensatedError as exc:
                print(f"r-43 compensated: {exc.error_message}")
        async with await psycopg.AsyncConnection.connect(URL, autocommit=True) as conn:
            cur = await conn.execute(f"SELECT cents FROM {SCHEMA}.accounts")
            balance = await cur.fetchall()
            cur = await conn.execute(
                f"SELECT cents FROM {SCHEMA}.ledger WHERE refund_id = 'r-43' ORDER BY cents"
            )
            reversal = [cents for (cents,) in await cur.fetchall()]
        info = await engine.get(reversed_run.run_id)
        undone = ("debit", "umt.compensate:debit")  # the step, then its compensation
        steps = [(s.name, s.status) for s in info.timeline if s.name in undone]
        print(f"r-43: {info.status}; ledger {reversal}; balance {balance}; steps {steps}")
        assert info.status == "compensated"
        assert reversal == [-500, 500], "debited once, credited once"
        assert balance == [(10000 - 1250,)], "the reversed refund left the balance as it was"
        assert steps == [("debit", "completed"), ("umt.compensate:debit", "completed")]
    finally:
        await engine.close()
        async with await psycopg.AsyncConnection.connect(URL, autocommit=True) as conn:
            await conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")


if __name__ == "__main__":
    asyncio.run(main())
