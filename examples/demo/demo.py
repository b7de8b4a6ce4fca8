"""`make demo`: a crash-proof run on an embedded Postgres, told in under a minute.

1. two worker processes (groups `io` and `agent`) serve a multi-step download task with a
   fenced submission, a durable sleep and a wait for an approval fact;
2. the `io` worker is SIGKILLed mid-step; its lease expires and `agent` takes over without
   re-running completed steps;
3. approvals arrive (some before their waiters reach them), one run is canceled, and an
   urgent run overtakes a backlog;
4. a table of runs, the timeline of the interrupted run, and the counts that prove each side
   effect happened once. The data stays in `.umt/pg` for `umt --schema umt_demo runs list`.

Options: `--schema NAME` (engine schema, default umt_demo), `--otel console` (print spans).
`UMT_DATABASE_URL` points it at a running Postgres instead of the embedded one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

START = time.monotonic()
TTY = sys.stdout.isatty()


def say(message: str) -> None:
    print(f"[{time.monotonic() - START:5.1f}s] {message}", flush=True)


def progress(done: int, total: int, what: str) -> None:
    if TTY:
        print(f"\r         {what}: {done}/{total}", end="", flush=True)


BUSINESS_DDL = """
DROP SCHEMA IF EXISTS {biz} CASCADE;
CREATE SCHEMA {biz};
CREATE TABLE {biz}.step_log (
    id bigserial PRIMARY KEY, run_id uuid NOT NULL, step text NOT NULL, worker text NOT NULL,
    token bigint NOT NULL, started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at timestamptz
);
CREATE TABLE {biz}.client_calls (
    id bigserial PRIMARY KEY, op_key text NOT NULL, token bigint NOT NULL, resumed boolean NOT NULL
);
CREATE TABLE {biz}.submissions (
    item text PRIMARY KEY, client_ref text NOT NULL, size bigint NOT NULL, approved_by text NOT NULL
);
"""


class Workers:
    """The worker processes the demo starts, stops and kills."""

    def __init__(self, url: str, schema: str, otel: str | None) -> None:
        self.url = url
        self.schema = schema
        self.otel = otel
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(self, group: str, name: str) -> None:
        command = [sys.executable, str(HERE / "worker.py"), self.url, self.schema, group, name]
        if self.otel:
            command += ["--otel", self.otel]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("ready"):
            raise SystemExit(f"worker {name} did not start (exit {proc.poll()})")
        self.procs[name] = proc

    def kill(self, name: str) -> int:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return proc.pid

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()


async def fetch(url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    """A query on the demo's business tables (found through the search path)."""
    search_path = f"-c search_path={os.environ['DEMO_BIZ']}"
    async with await psycopg.AsyncConnection.connect(
        url, autocommit=True, options=search_path
    ) as conn:
        cur = await conn.execute(query, params)  # type: ignore[arg-type]  # demo's own SQL
        return await cur.fetchall()


async def wait_for_row(url: str, query: str, *params: Any, timeout: float = 30) -> tuple[Any, ...]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = await fetch(url, query, *params)
        if rows:
            return rows[0]
        await asyncio.sleep(0.05)
    raise SystemExit(f"timed out waiting for: {query}")


async def main(schema: str, otel: str | None) -> int:
    from umt_backend_pg import database_url, migrate

    say("starting Postgres (embedded in .umt/pg unless UMT_DATABASE_URL is set) ...")
    url = database_url(Path.cwd() / ".umt" / "pg")
    os.environ["DEMO_URL"] = url
    os.environ["DEMO_BIZ"] = f"{schema}_biz"  # the business tables, beside the engine's schema
    from tasks import download, fetch_metadata, registry, summarize

    from umt_sdk import connect

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
        )
        template = sql.SQL(BUSINESS_DDL)  # type: ignore[arg-type]  # a constant, not input
        ddl = template.format(biz=sql.Identifier(os.environ["DEMO_BIZ"]))
        await conn.execute(ddl)
    applied = await migrate(url, schema=schema)
    say(f"migrated schema {schema!r} ({', '.join(applied)})")

    provider = None
    if otel:
        from telemetry import tracer_provider

        provider = tracer_provider(otel, "umt-demo-driver")
    engine = await connect(url, registry=registry, schema=schema, tracer_provider=provider)
    workers = Workers(url, schema, otel)
    try:
        # -- 1. two groups, a batch of runs ------------------------------------------------------
        workers.start("io", "io-1")
        workers.start("agent", "agent-1")
        say("workers up: io-1 serves download, fetch_metadata; agent-1 serves download, summarize")
        items = [f"ubuntu-{n}" for n in range(1, 7)]
        runs: dict[str, UUID] = {}
        for item in items:
            handle = await engine.enqueue(download, {"item": item}, idempotency_key=f"plan:{item}")
            runs[item] = handle.run_id
        for item in items[:3]:  # these approvals arrive before their runs wait for them
            await engine.signal(runs[item], "approved", {"by": "alice"})
        meta = [
            (await engine.enqueue(fetch_metadata, {"item": f"meta-{n}"})).run_id for n in (1, 2)
        ]
        say(f"enqueued {len(items)} downloads, approved 3 of them early, and 2 io-only runs")

        # -- 2. SIGKILL mid-step -----------------------------------------------------------------
        row = await wait_for_row(
            url,
            "SELECT run_id FROM step_log WHERE step = 'transfer' AND worker = 'io-1'"
            " AND finished_at IS NULL ORDER BY id LIMIT 1",
        )
        victim: UUID = row[0]
        victim_item = next(i for i, r in runs.items() if r == victim)
        await asyncio.sleep(0.8)  # let a heartbeat tell which step it is in (for the timeline)
        pid = workers.kill("io-1")
        killed_at = time.monotonic()
        say(f"SIGKILL io-1 (pid {pid}) in the middle of {victim_item}'s 'transfer' step")
        taker = await wait_for_row(
            url,
            "SELECT worker FROM step_log WHERE run_id = %s AND step = 'transfer'"
            " AND worker <> 'io-1' ORDER BY id LIMIT 1",
            victim,
        )
        say(
            f"lease (2 s) expired: {taker[0]} took {victim_item} over after "
            f"{time.monotonic() - killed_at:.1f}s, resuming at 'transfer' ('plan' is replayed)"
        )
        workers.start("io", "io-2")
        say("io-2 started to replace io-1")

        # -- 3. approvals, a cancel, priority ----------------------------------------------------
        canceled_item = items[-1]
        outcome = await engine.cancel(runs[canceled_item], reason="operator changed their mind")
        say(f"cancel {canceled_item}: {outcome}")
        for item in items[3:-1]:
            await engine.signal(runs[item], "approved", {"by": "bob"})
        say("bob approved the rest")
        backlog = [(await engine.enqueue(summarize, {"item": f"s-{n}"})).run_id for n in range(30)]
        urgent = (await engine.enqueue(summarize, {"item": "urgent"}, priority=10)).run_id
        say("enqueued a backlog of 30 summaries, then 1 urgent one (priority 10)")

        # -- 4. wait, then report ----------------------------------------------------------------
        everything = [*runs.values(), *meta, *backlog, urgent]
        pending = set(everything)
        while pending:
            for run_id in list(pending):
                info = await engine.get(run_id)
                if info.status in ("completed", "failed", "canceled"):
                    pending.discard(run_id)
            progress(len(everything) - len(pending), len(everything), "runs finished")
            await asyncio.sleep(0.1)
        if TTY:
            print()
        say(f"all {len(everything)} runs finished")
        order = [
            r[0]
            for r in await fetch(
                url, "SELECT run_id FROM step_log WHERE step = 'write' ORDER BY id"
            )
        ]
        say(f"the urgent summary started #{order.index(urgent) + 1} of {len(order)}")

        print()
        header = ("run", "task", "item", "status", "attempts", "steps", "time")
        print("  {:<10} {:<15} {:<10} {:<10} {:>8} {:>6} {:>6}".format(*header))
        for item, run_id in [*runs.items(), *[(f"meta-{n}", r) for n, r in enumerate(meta, 1)]]:
            info = await engine.get(run_id)
            seconds = ((info.finished_at or info.updated_at) - info.created_at).total_seconds()
            completed = sum(1 for s in info.timeline if s.status == "completed")
            print(
                f"  {str(run_id)[-8:]:<10} {info.task_name:<15} {item:<10} {info.status:<10}"
                f" {info.attempts:>8} {completed:>6} {seconds:>5.1f}s"
            )
        info = await engine.get(victim)
        print(f"\n  timeline of {victim_item} (run {victim}):")
        for entry in info.timeline:
            token = entry.fencing_token
            print(f"    {entry.name:<10} {entry.kind:<5} {entry.status:<12} token {token}")
        for execution in info.executions:
            token, where = execution.fencing_token, execution.worker_id
            print(f"    execution token {token} on {where}: {execution.outcome}")

        submissions = await fetch(url, "SELECT item, count(*) FROM submissions GROUP BY item")
        calls = await fetch(url, "SELECT count(*) FROM client_calls")
        # A completed step never runs again: no body may start under a later attempt (a larger
        # fencing token) than the one whose record completed the step.
        bodies = await fetch(url, "SELECT run_id, step, token, finished_at IS NULL FROM step_log")
        recorded = {}
        for run_id in everything:
            for entry in (await engine.get(run_id)).timeline:
                if entry.status == "completed" and entry.kind == "step":
                    recorded[(run_id, entry.name)] = entry.fencing_token
        rerun_after_completion = [
            b for b in bodies if (b[0], b[1]) in recorded and b[2] > recorded[(b[0], b[1])]
        ]
        cut_off = sum(1 for b in bodies if b[3])
        completed_downloads = [
            i for i, r in runs.items() if (await engine.get(r)).status == "completed"
        ]
        print()
        say(
            f"exactly-once: {len(submissions)} submissions for {len(completed_downloads)} "
            f"completed downloads (max {max((c for _, c in submissions), default=0)} per item), "
            f"{calls[0][0]} client call(s); {len(rerun_after_completion)} completed steps run "
            f"again; {cut_off} step bodies cut off by the SIGKILL (re-run elsewhere)"
        )
        ok = (
            len(submissions) == len(completed_downloads) == len(items) - 1
            and all(c == 1 for _, c in submissions)
            and not rerun_after_completion
            and (await engine.get(runs[canceled_item])).status == "canceled"
        )
    finally:
        workers.stop_all()
        await engine.close()
        if provider is not None:
            provider.shutdown()
    say(f"done; inspect with: umt --schema {schema} runs list" if ok else "EXACTLY-ONCE VIOLATED")
    if ok:
        # The killed worker's interrupted execution and the takeover are on each download's
        # timeline (the runs page lists them; open one).
        say(
            f"see it in a browser: umt --schema {schema} dashboard  (then open http://127.0.0.1:8765/)"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--schema", default="umt_demo")
    parser.add_argument("--otel", choices=["console"], default=None)
    arguments = parser.parse_args()
    sys.exit(asyncio.run(main(arguments.schema, arguments.otel)))
