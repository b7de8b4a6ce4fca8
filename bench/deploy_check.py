"""The deploy check (`umt check --against <database URL>`) on many live runs: read every live
run's history from Postgres and replay it against the code about to ship.

Seeds N live runs of a checkout task (a typed quote, a fraud score and a reservation
recorded, then parked on a fact wait: five step records each, the shape `umt check` meets in
production), outside the timing. Then, per repetition, the check as `umt check` runs it: the
histories read (`live_histories`: the live runs listed by page, each read with its steps, 16
at a time) and replayed (`check_deploy`), and the `umt check` command itself as a process.
Reports seconds (wall) and client CPU seconds for each part; the check must find no failure.

    python -m bench.deploy_check [--database-url URL] [--runs 10000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import attrs

from bench._infra import Server
from umt_backend_pg import migrate
from umt_sdk import Registry, TaskContext, connect, task
from umt_sdk.testing import check_deploy, live_histories

SCHEMA = "umt"
DB = "bench_deploy_check"


@attrs.frozen
class Order:
    order_id: str
    amount_cents: int


@attrs.frozen
class Quote:
    amount_cents: int
    currency: str
    lines: list[str]


async def quote(order: Order) -> Quote:
    return Quote(amount_cents=order.amount_cents, currency="EUR", lines=["item-1", "item-2"])


async def score(order: Order) -> float:
    return 0.25


async def reserve(order: Order) -> dict[str, int]:
    return {"warehouse": 3, "slot": order.amount_cents % 97}


@task("bench.checkout", version=1)
async def checkout(ctx: TaskContext[Order]) -> str:
    q = await ctx.step.run("quote", quote, ctx.input)
    if await ctx.patched("fraud-check"):
        await ctx.step.run("fraud-check", score, ctx.input)
    await ctx.step.run("reserve", reserve, ctx.input)
    await ctx.step.wait_for_fact("paid", timeout=timedelta(days=2))
    return f"{q.amount_cents}"


registry = Registry([checkout])


async def seed(url: str, n: int) -> float:
    """N runs parked on their payment; returns the seconds it took."""
    engine = await connect(url, registry=registry, schema=SCHEMA, run_migrations=False)
    t0 = time.perf_counter()
    try:
        for start in range(0, n, 1000):
            await engine.enqueue_many(
                checkout, [Order(f"o-{i}", 1000 + i) for i in range(start, min(n, start + 1000))]
            )
        async with engine.worker(concurrency=64):
            while True:
                page = await engine.list(task_name="bench.checkout", status="pending", limit=1)
                running = await engine.list(task_name="bench.checkout", status="running", limit=1)
                if not page.runs and not running.runs:
                    break
                await asyncio.sleep(0.5)
    finally:
        await engine.close()
    return time.perf_counter() - t0


async def check_in_process(url: str) -> dict[str, Any]:
    engine = await connect(url, schema=SCHEMA, run_migrations=False, listen=False)
    try:
        t0, cpu0 = time.perf_counter(), time.process_time()
        histories = await live_histories(engine)
        t1, cpu1 = time.perf_counter(), time.process_time()
        report = await check_deploy(registry, histories)
        t2, cpu2 = time.perf_counter(), time.process_time()
    finally:
        await engine.close()
    assert report.ok, report.summary()
    return {
        "runs": len(histories),
        "read_s": t1 - t0,
        "read_cpu_s": cpu1 - cpu0,
        "replay_s": t2 - t1,
        "replay_cpu_s": cpu2 - cpu1,
        "total_s": t2 - t0,
        "unpatched": len(report.unpatched("fraud-check")),
    }


def check_command(url: str) -> dict[str, Any]:
    """`umt check` as CI runs it: a fresh process, the import of the registry included."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "umt_sdk.cli",
            "--schema",
            SCHEMA,
            "check",
            "--registry",
            "bench.deploy_check:registry",
            "--against",
            url,
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"umt check failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return {"command_s": seconds, "command_says": done.stdout.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    server = Server.start(args.database_url)
    url = server.fresh_db(DB)
    try:
        asyncio.run(migrate(url, schema=SCHEMA))
        seeded = asyncio.run(seed(url, args.runs))
        print(json.dumps({"seeded_runs": args.runs, "seed_s": round(seeded, 1)}), flush=True)
        rows = []
        for rep in range(args.repeats):
            row = {"repeat": rep, **asyncio.run(check_in_process(url)), **check_command(url)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        summary = {
            key: statistics.median(r[key] for r in rows)
            for key in ("read_s", "replay_s", "total_s", "read_cpu_s", "replay_cpu_s", "command_s")
        }
        print(json.dumps({"median": summary, "runs": rows[0]["runs"]}), flush=True)
    finally:
        server.drop_db(DB)


if __name__ == "__main__":
    main()
