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
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.chaos._crash_support import (
    SLOW_FLUSH,
    business_database,
    checkpoint,
    configure,
    retrying,
)
from tests.chaos.crash_worker import BODIES, READY, STEPS, Payment, install_business, pay
from tests.fixtures.private_pg import PrivatePostgres
from tests.integration._support import WorkerProcess, eventually, fetch, q
from umt_backend_pg import migrate
from umt_sdk import Registry, connect

pytestmark = pytest.mark.slow

SCHEMA = "umt_epoch_workers"
PROGRAM = Path(__file__).with_name("crash_worker.py")
CRASHES = int(os.environ.get("UMT_CHAOS_EPOCH_CRASHES", "3"))
BATCH = 3
WORKERS = 2


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
    pg_url: str, private_pg: PrivatePostgres, tmp_path: Path
) -> None:
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    logs, workdir = tmp_path / "logs", tmp_path / "files"
    logs.mkdir()
    workdir.mkdir()
    keys: list[str] = []

    async def install(conn: psycopg.AsyncConnection[Any]) -> None:
        await install_business(conn, SCHEMA)

    server = private_pg
    configure(server, SLOW_FLUSH)
    url = server.url
    await migrate(url, schema=SCHEMA)
    async with (
        business_database(pg_url, install) as business_url,
        await connect(url, registry=Registry([pay]), schema=SCHEMA, run_migrations=False) as client,
    ):
        workers = [
            WorkerProcess(
                [
                    *("--url", url, "--schema", SCHEMA, "--business-url", business_url),
                    *("--workdir", str(workdir), "--name", f"w{i}"),
                ],
                logs,
                f"w{i}",
                program=PROGRAM,
            )
            for i in range(WORKERS)
        ]

        def describe() -> str:
            return f"seed {seed}\n" + "\n".join(w.describe() for w in workers)

        try:
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
                checkpoint(server)
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
        finally:
            for worker in workers:
                worker.close()

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

    bodies = _bodies(workdir)
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
