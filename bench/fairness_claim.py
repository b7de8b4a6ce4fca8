"""What fairness keys cost the claim, and how soon a tenant's run starts behind another's
backlog (issue 28, part 2).

Two measures, each in a fresh schema of its own database (dropped at the end):

1. Claim cost: the worker's claim (`claim_runs`, 16 runs, no timers read) under EXPLAIN
   (ANALYZE, BUFFERS), committed, then the ending of every run it claimed (as the worker's
   would), `--claims` times; the median of the claims' shared buffers (hit + read, the
   statement's top plan node) and of the runs each took. Scenarios:
   - `unkeyed`: 2 x `--keys` runs without a key (a task that does not use fairness keys);
   - `fair_keys`: `--keys` fairness keys (10,000) with 2 runs each (as many runs);
   - `unkeyed_backlog`: `--backlog` runs without a key (100,000);
   - `fair_backlog`: one fairness key with `--backlog` runs (as many).
   A claim's cost grows with the table (its updates' index entries descend deeper B-trees), so
   each fair scenario has an unkeyed one of the same size beside it.
2. Pickup: one in-process worker (16 slots) drains a backlog of `--backlog` runs of tenant
   "bulk"; meanwhile `--pickups` times, one run of tenant "acme" is enqueued and the time from
   its enqueue to its start is taken (ms). With fairness keys (`fairness_key=tenant`), and
   without them (the runs in enqueue order: acme's run waits for the backlog; the wait is cut
   at `--baseline-wait` seconds, and the backlog runs that started meanwhile are counted).

    python -m bench.fairness_claim [--database-url URL] [--keys 10000] [--backlog 100000]
        [--claims 40] [--pickups 20] [--baseline-wait 10] [--json FILE]

Buffers are work, not time: the machine's load cannot move them; the pickup times are
wall-clock, on whatever machine runs it (`machine` in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

import psycopg
from attrs import frozen

from bench._claim_cost import measure_claims, print_claim_figures, scratch_backend
from bench._infra import Server, machine_info, summary
from umt_backend_pg import PostgresBackend
from umt_sdk import Registry, TaskContext, connect, task
from umt_sdk.backend import NewRun, TaskPair

DB = "bench_fairness_claim"
TASK = "bench_fair"
LIMIT = 16
WORKER = "bench-fair"
FAIR_SLOTS = 2_147_483_647
BATCH = 1000


@frozen
class Job:
    tenant: str
    n: int


_started: dict[int, float] = {}
"""The acme runs' start times (monotonic), by their number."""
_acme: dict[int, asyncio.Event] = {}
_backlog_started = 0
_busy = asyncio.Event()
"""Set once the worker's slots are all taken by backlog runs."""


@task(TASK, version=1)
async def fair_job(ctx: TaskContext[Job]) -> None:
    global _backlog_started
    if ctx.input.tenant == "acme":
        _started.setdefault(ctx.input.n, time.monotonic())
        _acme.setdefault(ctx.input.n, asyncio.Event()).set()
    else:
        _backlog_started += 1
        if _backlog_started >= LIMIT:
            _busy.set()


def _new(key: str | None, *, tenant: str = "bulk", n: int = 0) -> NewRun:
    fields: dict[str, Any] = {}
    if key is not None:
        fields = {"concurrency_key": key, "concurrency_limit": FAIR_SLOTS, "fairness_weight": 1}
    return NewRun(
        run_id=uuid.uuid4(),
        task_name=TASK,
        task_version=1,
        input_json=json.dumps({"tenant": tenant, "n": n}),
        input_hash="h",
        **fields,
    )


async def _store(backend: PostgresBackend, runs: list[NewRun]) -> None:
    for start in range(0, len(runs), BATCH):
        await backend.enqueue_many(runs[start : start + BATCH])


async def _claim_cost(url: str, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    async with scratch_backend(url, f"fair_{scenario}") as backend:
        if scenario == "unkeyed":
            await _store(backend, [_new(None) for _ in range(2 * args.keys)])
        elif scenario == "unkeyed_backlog":
            await _store(backend, [_new(None) for _ in range(args.backlog)])
        elif scenario == "fair_keys":
            await _store(backend, [_new(f"t{i % args.keys}") for i in range(2 * args.keys)])
        elif scenario == "fair_backlog":
            await _store(backend, [_new("bulk") for _ in range(args.backlog)])
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
        return await measure_claims(
            backend,
            url,
            pairs=[TaskPair(name=TASK, version=1)],
            claims=args.claims,
            limit=LIMIT,
            worker_id=WORKER,
            analyze=("runs", "concurrency_keys"),
        )


async def _pickup(url: str, *, fair: bool, args: argparse.Namespace) -> dict[str, Any]:
    global _backlog_started
    schema = "fair_pickup" if fair else "fair_pickup_baseline"
    engine = await connect(url, registry=Registry([fair_job]), schema=schema)
    backend = engine.backend
    assert isinstance(backend, PostgresBackend)
    waits_ms: list[float | None] = []
    backlog_ran: list[int] = []
    try:
        await _store(backend, [_new("bulk" if fair else None, n=i) for i in range(args.backlog)])
        _started.clear()
        _acme.clear()
        _busy.clear()
        _backlog_started = 0
        pickups = args.pickups if fair else 1
        async with engine.worker(concurrency=LIMIT):
            await _busy.wait()  # every slot is busy with the backlog
            for n in range(pickups):
                before = _backlog_started
                seen = _acme.setdefault(n, asyncio.Event())
                enqueued = time.monotonic()
                await engine.enqueue(
                    fair_job, Job("acme", n), fairness_key="acme" if fair else None
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(seen.wait(), args.baseline_wait)
                started = _started.get(n)
                waits_ms.append(None if started is None else (started - enqueued) * 1000)
                backlog_ran.append(_backlog_started - before)
    finally:
        await engine.close()
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    started_ms = [w for w in waits_ms if w is not None]
    return {
        "pickups": len(waits_ms),
        "started": len(started_ms),
        "wait_ms": summary(started_ms) if started_ms else None,
        "backlog_runs_started_meanwhile": summary([float(b) for b in backlog_ran]),
        "cut_at_s": args.baseline_wait,
    }


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    server = Server.start(args.database_url)
    url = server.fresh_db(DB)
    out: dict[str, Any] = {"machine": machine_info(), "keys": args.keys, "backlog": args.backlog}
    try:
        for scenario in ("unkeyed", "fair_keys", "unkeyed_backlog", "fair_backlog"):
            out[scenario] = await _claim_cost(url, scenario, args)
            print_claim_figures(scenario, out[scenario], width=15)
        for fair in (True, False):
            name = "pickup_fair" if fair else "pickup_in_enqueue_order"
            out[name] = result = await _pickup(url, fair=fair, args=args)
            wait = result["wait_ms"]
            shown = (
                f"median {wait['median']:.1f} ms, max {wait['max']:.1f} ms"
                if wait
                else f"not started within {args.baseline_wait} s"
            )
            print(
                f"{name:>23}: {result['started']}/{result['pickups']} started, {shown}; "
                f"backlog runs started meanwhile (median) "
                f"{result['backlog_runs_started_meanwhile']['median']:.0f}",
                flush=True,
            )
    finally:
        server.drop_db(DB)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", help="use this server (default: embedded, temp dir)")
    p.add_argument("--keys", type=int, default=10_000, help="fairness keys (fair_keys)")
    p.add_argument("--backlog", type=int, default=100_000, help="runs of the busy tenant")
    p.add_argument("--claims", type=int, default=40, help="claims measured per scenario")
    p.add_argument("--pickups", type=int, default=20, help="acme runs timed (fair)")
    p.add_argument("--baseline-wait", type=float, default=10.0, help="s to wait, unfair")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    result = asyncio.run(_run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
