"""Exactly-once side effects on Postgres: `with_attempt_token`, `info.resumed`, and fencing.

Run it: `python examples/04_fencing_with_reconcile.py` (uses `UMT_DATABASE_URL`, else the
embedded Postgres in `.umt/pg`; everything lives in a fresh schema, dropped at the end).

A payout pays through a "bank" (a table standing in for an outside API), then reconciles its
books with the bank. Worker A pays, then freezes (a GC pause, a partition): its lease lapses and
worker B takes over. B is told `info.resumed`, looks the transfer up by its `op_key` and finds
it: no second payment. When A wakes up, its commit is refused with `FencingError`.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import psycopg

from umt_backend_pg import database_url
from umt_sdk import AttemptInfo, FencingError, Registry, TaskContext, connect, task
from umt_sdk import with_attempt_token as fenced
from umt_sdk.testing import freeze_heartbeats

URL = database_url()  # UMT_DATABASE_URL if set, else the embedded Postgres
SCHEMA = f"ex04_{uuid.uuid4().hex[:8]}"  # our own schema: engine tables and business tables
CALLS: list[tuple[int, bool]] = []  # (attempt token, resumed) of each call to the bank
REJECTED: list[FencingError] = []
A_PAUSED, WAKE_A = asyncio.Event(), asyncio.Event()
LEASE = timedelta(seconds=1)  # short, so that the takeover comes quickly


async def db() -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(
        URL, autocommit=True, options=f"-c search_path={SCHEMA}"
    )


async def transfer(payout_id: str) -> str:
    async def call_bank(info: AttemptInfo) -> str:
        CALLS.append((info.attempt_token, info.resumed))
        async with await db() as bank:
            if info.resumed:  # an earlier attempt began this: did the bank get it?
                cur = await bank.execute("SELECT ref FROM bank WHERE tag = %s", (info.op_key,))
                if row := await cur.fetchone():
                    return str(row[0])  # yes: finish with it instead of paying twice
            ref = f"T{info.attempt_token}"
            await bank.execute("INSERT INTO bank VALUES (%s, %s)", (ref, info.op_key))
        if len(CALLS) == 1:  # attempt A freezes after the bank accepted its transfer
            A_PAUSED.set()
            await WAKE_A.wait()
        return ref

    async def record(tx: psycopg.AsyncConnection[Any], ref: str) -> None:
        # Runs in the transaction that checks the fencing token: all or nothing.
        await tx.execute("INSERT INTO payouts VALUES (%s, %s, false)", (payout_id, ref))

    async with await db() as conn:
        try:
            return await fenced(conn, f"payout:{payout_id}", call_bank, commit=record)
        except FencingError as exc:
            REJECTED.append(exc)
            raise  # the execution stops; never swallow a FencingError


async def reconcile(payout_id: str, ref: str) -> str:
    async with await db() as conn:  # settle only if our books and the bank agree (idempotent)
        cur = await conn.execute(
            "UPDATE payouts SET settled = true WHERE id = %s AND ref = %s"
            " AND (SELECT count(*) FROM bank WHERE tag = %s) = 1",
            (payout_id, ref, f"payout:{payout_id}"),
        )
        if cur.rowcount != 1:
            raise RuntimeError(f"payout {payout_id}: our books and the bank disagree")
    return f"{ref} settled"


@task("payout", version=1)
async def payout(ctx: TaskContext[str]) -> str:
    ref = await ctx.step.run("transfer", transfer, ctx.input)
    return await ctx.step.run("reconcile", reconcile, ctx.input, ref)


async def main() -> None:
    engine = await connect(URL, registry=Registry([payout]), schema=SCHEMA)  # migrates SCHEMA
    try:
        async with await db() as conn:
            await conn.execute(
                "CREATE TABLE bank (ref text PRIMARY KEY, tag text NOT NULL);"
                "CREATE TABLE payouts (id text PRIMARY KEY, ref text NOT NULL, settled bool)"
            )
        run = await engine.enqueue(payout, "p-7")
        worker_a = engine.worker(lease=LEASE, worker_id="A", concurrency=1)  # 1 slot: busy
        await worker_a.start()
        await A_PAUSED.wait()
        info = await engine.get(run.run_id)
        while not any(s.status == "running" for s in info.timeline):
            await asyncio.sleep(0.05)  # until a heartbeat has reported the step A is in
            info = await engine.get(run.run_id)
        freeze_heartbeats(worker_a)  # A goes on running, but its lease is no longer renewed
        print("worker A paid through the bank, then froze; its lease will lapse")
        async with engine.worker(lease=LEASE, worker_id="B", poll_interval=LEASE / 10):
            result = await run.result(timeout=20)  # B claims the run once A's lease expires
        print(f"worker B finished the run: {result!r}")
        WAKE_A.set()  # A wakes up and tries to commit its stale attempt
        await worker_a.stop()  # (after letting its execution end)
        print(f"worker A's commit was refused: FencingError: {REJECTED[0]}")

        async with await db() as conn:
            bank = await (await conn.execute("SELECT ref FROM bank")).fetchall()
            books = await (await conn.execute("SELECT ref, settled FROM payouts")).fetchall()
        print(f"bank calls (token, resumed): {CALLS}; bank rows: {bank}; our books: {books}")
        info = await engine.get(run.run_id)
        timeline = [(s.name, s.status, s.fencing_token) for s in info.timeline]
        print(f"timeline (step, status, token): {timeline}")
        a, b = (e.fencing_token for e in info.executions)  # the tokens of attempts A and B
        assert [(a, False), (b, True)] == CALLS, "B was told that A had begun"
        assert (bank, books) == ([(f"T{a}",)], [(f"T{a}", True)]), "paid once, booked once"
        assert result == f"T{a} settled"
        assert [e.worker_id for e in info.executions] == ["A", "B"]
        assert timeline == [
            ("transfer", "interrupted", a),
            ("transfer", "completed", b),
            ("reconcile", "completed", b),
        ]
    finally:
        await engine.close()
        async with await db() as conn:  # clean up: drop the example's schema
            await conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")


if __name__ == "__main__":
    asyncio.run(main())
