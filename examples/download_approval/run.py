"""Drive the download-approval application end to end, on the embedded Postgres by default.

1. migrate the engine's schema and the application's (plans, downloads, assets, outbox);
2. start release 1: a relay, an `io` worker and an `agent` worker (separate processes);
3. create three plans: each plan row and its `plan.created` outbox event commit together,
   and the relay turns the events into `download_plan@1` runs, which wait for approval;
4. deploy release 2 while those runs are in flight: a new `io` worker serving @1 and @2, a new
   relay (new plans now start @2), then the old worker and relay stop gracefully;
5. create two more plans (@2), approve all five; the fake download client loses its first
   reply (the job was created): the retry reconciles by tag instead of submitting twice;
6. the client finishes the downloads, the runs copy the files, record the assets, and each
   asset's outbox event starts a `describe_asset` run in the `agent` group;
7. check: one client job, one download, one asset per plan; every outbox row dispatched;
   no @1 run left in flight, so download_plan@1 can be removed;
8. the night: three plans deferred to the night window, and the `nightly_downloads` schedule
   (02:00 Europe/Paris) triggered by hand: its run fans out one `download_plan@2` child per
   deferred plan with `ctx.step.map` (two at once), and is woken once, when all are done.

Options: `--schema NAME` (default dl_demo), `--data DIR` (files; a temporary one by default).
`UMT_DATABASE_URL` points it at a running Postgres instead of the embedded one.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

START = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - START:5.1f}s] {message}", flush=True)


class Processes:
    def __init__(self, url: str, schema: str, data: Path) -> None:
        self.common = ["--url", url, "--schema", schema, "--data", str(data)]
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(self, name: str, role: str, release: int, group: str = "io") -> None:
        command = [sys.executable, str(HERE / "app.py"), role, *self.common]
        command += ["--release", str(release), "--group", group, "--name", name]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("ready"):
            raise SystemExit(f"{name} did not start (exit {proc.poll()})")
        self.procs[name] = proc

    def stop(self, name: str) -> str:
        proc = self.procs.pop(name)
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        if proc.returncode != 0:
            raise SystemExit(f"{name} exited with {proc.returncode}")
        return out

    def stop_all(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


async def rows(url: str, query: str, schema: str, *params: Any) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(sql.SQL(query).format(s=sql.Identifier(schema)), params)
        return await cur.fetchall()


async def until(check: Any, what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


async def main(schema: str, data: Path) -> int:
    from app import app_schema, approve, client_daemon, create_plan, migrate_business

    from umt_backend_pg import database_url, migrate

    say("starting Postgres (embedded in .umt/pg unless UMT_DATABASE_URL is set) ...")
    url = database_url(Path.cwd() / ".umt" / "pg")
    app = app_schema(schema)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for name in (schema, app):
            await conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
            )
    await migrate(url, schema=schema)
    await migrate_business(url, schema)
    say(f"migrated the engine ({schema}) and the application ({app}, with its outbox)")

    import fake_client
    import tasks

    from umt_sdk import connect

    engine = await connect(url, registry=tasks.registry(2), schema=schema, run_migrations=False)
    procs = Processes(url, schema, data)
    stop = asyncio.Event()
    daemon = asyncio.create_task(client_daemon(url, schema, data / "incoming", engine, stop))
    ok = False
    try:
        procs.start("relay-r1", "relay", 1)
        procs.start("io-r1", "worker", 1, "io")
        procs.start("agent-r1", "worker", 1, "agent")
        say("release 1 up: relay-r1, io-r1 (download_plan@1), agent-r1 (describe_asset@1)")

        sizes = [3_000_000, 1_500_000, 2_200_000]
        old = [
            await create_plan(
                url, schema, url_to_fetch=f"https://mirror.example/{n}.iso", size=size
            )
            for n, size in enumerate(sizes, 1)
        ]
        say(f"created plans {', '.join(old)} (each with its outbox event, one transaction)")

        async def waiting_for_approval() -> bool:
            found = await rows(
                url, "SELECT count(*) FROM {s}.plans WHERE status = 'awaiting approval'", app
            )
            return found[0][0] == len(old)

        await until(waiting_for_approval, "the first plans to wait for approval")
        say("the relay started their runs; all three wait for an operator's approval")

        procs.start("io-r2", "worker", 2, "io")
        procs.start("relay-r2", "relay", 2)
        out = procs.stop("relay-r1")
        procs.stop("io-r1")
        say(f"deployed release 2 (io-r2 serves @1 and @2); the old relay stopped ({out.strip()})")

        new = [
            await create_plan(
                url, schema, url_to_fetch=f"https://mirror.example/{n}.iso", size=1_000_000
            )
            for n in (4, 5)
        ]
        say(f"created plans {', '.join(new)}: they start download_plan@2")
        await fake_client.set_fault(url, app, "lost_reply", 1)
        say("the download client will lose its next reply (after creating the job)")

        for plan_id in [*old, *new]:
            await approve(engine, url, schema, plan_id, by="ops")
        say("ops approved all five plans")

        async def all_done() -> bool:
            found = await rows(url, "SELECT count(*) FROM {s}.plans WHERE status = 'done'", app)
            described = await rows(
                url, "SELECT count(*) FROM {s}.assets WHERE description IS NOT NULL", app
            )
            return found[0][0] == described[0][0] == len(old) + len(new)

        await until(all_done, "every plan to be done and described", timeout=90)
        say("every plan is downloaded, copied, recorded and described")

        print()
        report = await rows(
            url,
            "SELECT p.id, a.version, p.status, (SELECT count(*) FROM {s}.client_jobs j"
            " WHERE j.tag = 'submit:' || p.id), (SELECT count(*) FROM {s}.downloads d"
            " WHERE d.plan_id = p.id), a.description"
            " FROM {s}.plans p LEFT JOIN {s}.assets a ON a.plan_id = p.id ORDER BY p.created_at",
            app,
        )
        print(f"  {'plan':<14} {'version':>7} {'status':<8} {'jobs':>4} {'downloads':>9}  asset")
        for plan_id, version, status, jobs, downloads, description in report:
            print(
                f"  {plan_id:<14} {version:>7} {status:<8} {jobs:>4} {downloads:>9}  {description}"
            )
        print()

        lost = await rows(
            url,
            "SELECT count(*) FROM {s}.op_ledger WHERE op_key LIKE 'submit:%%'",
            schema,
        )
        retried = []
        for plan_id, run_id in await rows(url, "SELECT id, run_id FROM {s}.plans", app):
            info = await engine.get(run_id)
            attempts = [s for s in info.timeline if s.name == "submit"]
            if len(attempts) > 1:
                retried.append(plan_id)
                say(
                    f"the lost reply hit {plan_id}: its submit step ran "
                    f"{len(attempts)} times ({', '.join(s.status for s in attempts)}); "
                    "the retry was told info.resumed and found the job by its tag"
                )
        outbox = await rows(url, "SELECT status, count(*) FROM {s}.outbox_event GROUP BY 1", app)
        in_flight_v1 = 0
        for status in ("pending", "running", "waiting"):
            page = await engine.list(task_name="download_plan", version=1, status=status)
            in_flight_v1 += len(page.runs)
        versions = {int(r[1]) for r in report}
        jobs_per_plan = [int(r[3]) for r in report]
        say(
            f"exactly-once: {sum(jobs_per_plan)} client jobs for {len(report)} plans "
            f"(max {max(jobs_per_plan)} per plan) despite the lost reply; "
            f"{lost[0][0]} submissions in the ledger"
        )
        say(f"outbox: {dict(outbox)}")
        say(f"download_plan@1 runs in flight: {in_flight_v1} (it can be removed now)")
        night = [
            await create_plan(
                url,
                schema,
                url_to_fetch=f"https://mirror.example/night-{n}.iso",
                size=500_000,
                deferred=True,
            )
            for n in (1, 2, 3)
        ]
        say(f"deferred plans {', '.join(night)} to the night window")
        await engine.schedules.create(tasks.NIGHTLY)
        nightly = await engine.schedules.trigger("nightly_downloads")
        say("triggered the nightly_downloads schedule (0 2 * * *, Europe/Paris) by hand")
        said = await nightly.result(timeout=90)
        children = (await engine.list(parent=nightly.run_id)).runs
        parent_info = await engine.get(nightly.run_id)
        assets = sum(1 for value in said.values() if value.startswith("asset-"))
        say(
            f"the night fanned out {len(children)} download_plan@2 children for "
            f"{len(night)} deferred plans (two at once), {assets} assets recorded; "
            f"its run was woken {parent_info.attempts - 1} time(s) for all of them"
        )
        night_jobs = await rows(
            url,
            "SELECT count(*) FROM {s}.client_jobs WHERE tag = ANY (%s)",
            app,
            [f"submit:{plan_id}" for plan_id in night],
        )
        ok = (
            sorted(said) == sorted(night)
            and assets == len(night)
            and len(children) == len(night)
            and {c.task_version for c in children} == {2}
            and night_jobs[0][0] == len(night)
            and parent_info.attempts == 2
            and jobs_per_plan == [1] * 5
            and len(retried) == 1
            and all(r[2] == "done" and r[4] == 1 for r in report)
            and versions == {1, 2}
            and dict(outbox) == {"dispatched": 10}
            and in_flight_v1 == 0
        )
    finally:
        stop.set()
        await daemon
        procs.stop_all()
        await engine.close()
    say("done" if ok else "CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--schema", default="dl_demo")
    parser.add_argument("--data", type=Path, default=None)
    arguments = parser.parse_args()
    if arguments.data is None:
        with tempfile.TemporaryDirectory(prefix="download_approval_") as tmp:
            sys.exit(asyncio.run(main(arguments.schema, Path(tmp))))
    sys.exit(asyncio.run(main(arguments.schema, arguments.data)))
