"""The workloads: each returns the figures of one JSON key."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

from bench._infra import BENCH_DIR, MONITOR_TAG, Child, ChildError, Server, pct, summary
from umt_sdk import Registry, TaskContext, connect, task

__all__ = ["Config", "Runner"]


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@dataclass
class Config:
    quick: bool
    reps: int
    workers: int = 2
    concurrency: int = 16
    umt_only: bool = False
    n_raw: int = 5000
    n_umt1: int = 5000
    n_umt10: int = 800
    n_pgqueuer: int = 10000
    n_procrastinate: int = 1500
    n_dbos1: int = 300
    n_dbos10: int = 100
    dbos_concurrency: int = 16
    dbos_poll: float = 0.1
    dbos_pool: int = 0  # 0: DBOS's default pool (20 connections per process)
    pgqueuer_batch: int = 10
    procrastinate_concurrency: int = 10
    latency_n: int = 300
    latency_rate: float = 50.0
    latency_poll: float = 1.0
    backlog: int = 200_000
    claim_samples: int = 300
    leases: tuple[float, ...] = (2.0, 10.0)
    recovery_reps: int = 3
    memory_n: int = 5000
    drain_timeout: float = 300.0
    only: set[str] = field(default_factory=set)

    @classmethod
    def make(cls, quick: bool, **overrides: Any) -> Config:
        if quick:
            base = cls(
                quick=True,
                reps=2,
                n_raw=500,
                n_umt1=500,
                n_umt10=60,
                n_pgqueuer=1000,
                n_procrastinate=200,
                n_dbos1=40,
                n_dbos10=15,
                latency_n=30,
                latency_rate=40.0,
                backlog=50_000,
                claim_samples=100,
                recovery_reps=1,
                memory_n=1000,
                drain_timeout=120.0,
            )
        else:
            base = cls(quick=False, reps=3)
        for key, value in overrides.items():
            if value is not None:
                setattr(base, key, value)
        return base


@dataclass
class System:
    name: str
    python: str
    script: list[str]
    done_sql: str
    enqueue_mode: str = "enqueue"
    work_mode: str = "work"
    work_args: list[str] = field(default_factory=list)
    cwd: Path | None = None


class Runner:
    """Runs the workloads on one server; peers through their own virtualenv's python."""

    def __init__(
        self, server: Server, cfg: Config, peers_python: Path | None, peer_status: dict[str, Any]
    ) -> None:
        self.server = server
        self.cfg = cfg
        self.peers_python = peers_python
        self.peer_status = peer_status

    # -- systems ------------------------------------------------------------------------------

    def system(self, name: str) -> System:
        cfg = self.cfg
        me = sys.executable
        if name in ("raw", "raw_lifecycle"):
            return System(
                name,
                me,
                ["-m", "bench._raw_child"],
                "SELECT count(*) FROM raw_runs WHERE status = 2",
                enqueue_mode="setup",
                work_mode="work" if name == "raw" else "lifecycle",
            )
        if name == "umt":
            return System(
                name,
                me,
                ["-m", "bench._umt_child"],
                "SELECT count(*) FROM umt.runs WHERE status = 'completed'",
                work_args=["--conns", "1", "--concurrency", str(cfg.concurrency)],
            )
        python = str(self.peers_python)
        peers = BENCH_DIR / "peers"
        if name == "dbos":
            return System(
                name,
                python,
                [str(peers / "dbos_worker.py")],
                "SELECT count(*) FROM dbos.workflow_status "
                "WHERE status = 'SUCCESS' AND queue_name = 'bench_q'",
                work_args=[
                    "--concurrency",
                    str(cfg.dbos_concurrency),
                    "--poll",
                    str(cfg.dbos_poll),
                    "--pool",
                    str(cfg.dbos_pool),
                ],
                cwd=peers,
            )
        if name == "pgqueuer":
            return System(
                name,
                python,
                [str(peers / "pgqueuer_worker.py")],
                "SELECT {n} - count(*) FROM pgqueuer",
                work_args=["--batch", str(cfg.pgqueuer_batch)],
                cwd=peers,
            )
        if name == "procrastinate":
            return System(
                name,
                python,
                [str(peers / "procrastinate_worker.py")],
                "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'",
                work_args=["--concurrency", str(cfg.procrastinate_concurrency), "--pool", "2"],
                cwd=peers,
            )
        raise KeyError(name)

    def available(self, name: str) -> str | None:
        """None when `name` can run, else why not."""
        if name in ("umt", "raw", "raw_lifecycle"):
            return None
        if self.cfg.umt_only:
            return "skipped (--umt-only)"
        status = self.peer_status.get(name, {})
        if "missing" in status:
            return str(status["missing"])
        if self.peers_python is None:
            return "no peers' virtualenv"
        return None

    # -- one drain ----------------------------------------------------------------------------

    def drain(self, name: str, *, n: int, k: int) -> dict[str, Any]:
        """Pre-enqueue n runs of k no-op steps; drain with the configured worker processes."""
        cfg = self.cfg
        spec = self.system(name)
        dbname = f"bench_{name}"
        dsn = self.server.fresh_db(dbname)
        base = [spec.python, *spec.script]
        workers: list[Child] = []
        try:
            setup_n = 0 if name == "raw_lifecycle" else n
            if name in ("umt", "raw", "raw_lifecycle"):  # no interpreter start-up to wait for
                enq = _setup_here(name, dsn, setup_n, k)
            else:
                setup = Child(
                    [*base, spec.enqueue_mode, "--dsn", dsn, "--n", str(setup_n), "--k", str(k)],
                    name=f"{name}-enqueue",
                    cwd=spec.cwd,
                )
                enq = setup.expect("RESULT", 600)
                setup.close()
            self.server.wait_idle(dbname)
            before = self.server.counters(dbname)
            per_worker = -(-n // cfg.workers)
            for wid in range(1, cfg.workers + 1):
                argv = [
                    *base,
                    spec.work_mode,
                    "--dsn",
                    dsn,
                    "--k",
                    str(k),
                    "--wid",
                    str(wid),
                    *spec.work_args,
                ]
                if name == "raw_lifecycle":
                    argv += ["--n", str(min(per_worker, n - per_worker * (wid - 1)))]
                workers.append(Child(argv, name=f"{name}-w{wid}", cwd=spec.cwd))
            for child in workers:
                child.expect("READY", 180)
            t_go = time.time()
            for child in workers:
                child.send("GO")
            done, polls, t_end, timed_out = 0, 0, 0.0, False
            query = f"SELECT d AS {MONITOR_TAG} FROM ({spec.done_sql.format(n=n)}) AS m (d)"
            with psycopg.connect(dsn, autocommit=True) as mon:
                while True:
                    row = mon.execute(query).fetchone()
                    polls += 1
                    done = int(row[0]) if row else 0
                    if done >= n:
                        t_end = time.time()
                        break
                    if time.time() - t_go > cfg.drain_timeout:
                        t_end, timed_out = time.time(), True
                        break
                    for child in workers:
                        if child.proc.poll() is not None:
                            raise ChildError(
                                f"{child.name} died during the drain\n{child.stderr_tail()}"
                            )
                    time.sleep(0.02)
            for child in workers:
                child.send("STOP")
            results = [child.expect("RESULT", 120) for child in workers]
            for child in workers:
                child.close(60)
            workers = []
            self.server.wait_idle(dbname)
            after = self.server.counters(dbname)
        finally:
            for child in workers:
                child.kill()
        work = self.server.work_delta(before, after, monitor_xacts=polls)
        starts = [r["first_start"] for r in results if r.get("first_start")]
        t_first = min(starts) if starts else t_go
        span = max(t_end - t_first, 1e-9)
        steps = max(done, 1) * max(k, 1)
        runs = max(done, 1)
        cpu = sum(float(r["cpu_s"]) for r in results)
        out = {
            "n": n,
            "k": k,
            "done": done,
            "timed_out": timed_out,
            "workers": cfg.workers,
            "runs_per_s": done / span,
            "steps_per_s": done * k / span,
            "wall_runs_per_s": done / max(t_end - t_go, 1e-9),
            "start_delay_s": t_first - t_go,
            "span_s": span,
            "enqueue_per_s": enq.get("enqueue_per_s") if isinstance(enq, dict) else None,
            "client_cpu_ms_per_step": cpu * 1000 / steps,
            "client_cpu_ms_per_run": cpu * 1000 / runs,
            "xact_per_step": work["xact"] / steps,
            "xact_per_run": work["xact"] / runs,
            "statements_per_step": (
                None if work["statements"] is None else work["statements"] / steps
            ),
            "statements_per_run": (
                None if work["statements"] is None else work["statements"] / runs
            ),
            "wal_bytes_per_step": work["wal_bytes"] / steps,
            "wal_bytes_per_run": work["wal_bytes"] / runs,
            "rows_written_per_run": (work["rows_ins"] + work["rows_upd"] + work["rows_del"]) / runs,
            "work": work,
        }
        _log(
            f"  {name:<14} k={k:<2} n={n:<6} {out['runs_per_s']:9.1f} runs/s "
            f"{out['steps_per_s']:9.1f} steps/s  cpu {out['client_cpu_ms_per_step']:.3f} "
            f"ms/step  {out['xact_per_step']:.2f} xact/step"
        )
        self.server.drop_db(dbname)
        return out

    def _drain_safe(self, name: str, *, n: int, k: int) -> dict[str, Any]:
        try:
            return self.drain(name, n=n, k=k)
        except (ChildError, psycopg.Error, OSError) as exc:
            _log(f"  {name} k={k} failed: {str(exc)[:2000]}")
            return {"error": str(exc)[-4000:]}

    # -- drains, interleaved ------------------------------------------------------------------

    def drains(self) -> dict[str, Any]:
        """raw_ceiling, drain_1step, drain_10step: every system once per repetition."""
        cfg = self.cfg
        plan: list[tuple[str, str, int, int]] = [
            ("raw_ceiling", "raw", 1, cfg.n_raw),
            ("raw_ceiling", "raw_lifecycle", 1, cfg.n_raw),
            ("drain_1step", "umt", 1, cfg.n_umt1),
            ("drain_1step", "pgqueuer", 1, cfg.n_pgqueuer),
            ("drain_1step", "procrastinate", 1, cfg.n_procrastinate),
            ("drain_1step", "dbos", 1, cfg.n_dbos1),
            ("drain_10step", "umt", 10, cfg.n_umt10),
            ("drain_10step", "dbos", 10, cfg.n_dbos10),
        ]
        wanted = cfg.only
        plan = [
            p
            for p in plan
            if not wanted or p[0] in wanted or (p[0] == "raw_ceiling" and "drain_1step" in wanted)
        ]
        reps: dict[tuple[str, str], list[dict[str, Any]]] = {}
        missing: dict[str, str] = {}
        for rep in range(cfg.reps):
            _log(f"drains: repetition {rep + 1}/{cfg.reps}")
            for key, name, k, n in plan:
                why = self.available(name)
                if why is not None:
                    missing[name] = why
                    continue
                reps.setdefault((key, name), []).append(self._drain_safe(name, n=n, k=k))
        return self._fold_drains(reps, missing)

    def _fold_drains(
        self, reps: dict[tuple[str, str], list[dict[str, Any]]], missing: dict[str, str]
    ) -> dict[str, Any]:
        fields = (
            "runs_per_s",
            "steps_per_s",
            "wall_runs_per_s",
            "client_cpu_ms_per_step",
            "xact_per_step",
            "xact_per_run",
            "statements_per_step",
            "statements_per_run",
            "wal_bytes_per_step",
            "wal_bytes_per_run",
            "rows_written_per_run",
            "enqueue_per_s",
            "start_delay_s",
        )

        def fold(runs: list[dict[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = {f: summary([r.get(f) for r in runs]) for f in fields}
            out["n"] = runs[0].get("n") if runs else None
            out["errors"] = [r["error"] for r in runs if "error" in r]
            out["timed_out"] = any(r.get("timed_out") for r in runs)
            out["repetitions"] = runs
            return out

        result: dict[str, Any] = {"raw_ceiling": {}, "drain_1step": {}, "drain_10step": {}}
        for (key, name), runs in reps.items():
            label = {"raw": "drain", "raw_lifecycle": "lifecycle"}.get(name, name)
            result[key][label] = fold(runs)
        for key, names in (
            ("drain_1step", ("umt", "pgqueuer", "procrastinate", "dbos")),
            ("drain_10step", ("umt", "dbos")),
        ):
            for name in names:
                if name not in result[key]:
                    result[key][name] = {"missing": missing.get(name, "not run")}
        raw = result["raw_ceiling"]
        if "drain" in raw:
            raw["runs_per_s"] = raw["drain"]["runs_per_s"]
            raw["description"] = (
                "bare psycopg 3 loop, one connection per worker process, autocommit: claim "
                "(UPDATE .. SKIP LOCKED), checkpoint (INSERT step), complete (UPDATE) on runs "
                "inserted beforehand = the writes of a drained 1-step run; 'lifecycle' also "
                "inserts each run in the loop (4 commits)"
            )
            raw["connections"] = self.cfg.workers
        umt_reps = reps.get(("drain_1step", "umt"), [])
        raw_reps = reps.get(("raw_ceiling", "raw"), [])
        if umt_reps and raw_reps:
            ratios = [
                (u["runs_per_s"] / r["runs_per_s"])
                if "runs_per_s" in u and r.get("runs_per_s")
                else None
                for u, r in zip(umt_reps, raw_reps, strict=False)
            ]
            result["drain_1step"]["ratio_vs_ceiling"] = summary(ratios)
        else:
            result["drain_1step"]["ratio_vs_ceiling"] = summary([])
        result["drain_1step"]["connections"] = self.cfg.workers
        result["drain_10step"]["connections"] = self.cfg.workers
        return result

    # -- enqueue to start -----------------------------------------------------------------------

    def enqueue_to_start(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for mode, listen in (("listen", True), ("poll", False)):
            _log(f"enqueue_to_start: {mode}")
            try:
                out[mode] = asyncio.run(self._latency(listen))
            except (ChildError, psycopg.Error, OSError, TimeoutError) as exc:
                _log(f"  failed: {exc}")
                out[mode] = {"error": str(exc)[-2000:], "p50": None, "p99": None}
        out["poll_interval_s"] = self.cfg.latency_poll
        return out

    async def _latency(self, listen: bool) -> dict[str, Any]:
        from bench._umt_child import REGISTRY, bench_latency
        from umt_backend_pg import migrate

        cfg = self.cfg
        dbname = "bench_latency"
        dsn = self.server.fresh_db(dbname)
        await migrate(dsn)
        child = Child(
            [
                sys.executable,
                "-m",
                "bench._umt_child",
                "latency",
                "--dsn",
                dsn,
                "--listen",
                "1" if listen else "0",
                "--poll",
                str(cfg.latency_poll),
            ],
            name="umt-latency",
        )
        try:
            child.expect("READY", 120)
            child.send("GO")
            await asyncio.sleep(0.5)  # the worker's first claim, then it waits idle
            engine = await connect(
                dsn, registry=REGISTRY, listen=False, max_size=2, run_migrations=False
            )
            sent: dict[Any, float] = {}
            gap = 1.0 / cfg.latency_rate
            nxt = time.perf_counter()
            for _ in range(cfg.latency_n):
                t0 = time.time()
                handle = await engine.enqueue(bench_latency, 0)
                sent[handle.run_id] = t0
                nxt += gap
                await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
            deadline = time.monotonic() + 30 + cfg.latency_poll * 3
            rows: list[Any] = []
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                while time.monotonic() < deadline:
                    cur = await conn.execute(
                        "SELECT id, output::text FROM umt.runs WHERE status = 'completed'"
                    )
                    rows = await cur.fetchall()
                    if len(rows) >= len(sent):
                        break
                    await asyncio.sleep(0.1)
            await engine.close()
        finally:
            child.send("STOP")
            with contextlib.suppress(ChildError):
                child.expect("RESULT", 30)
            child.close(30)
        lat = [(float(out) - sent[rid]) * 1000 for rid, out in rows if rid in sent]
        self.server.drop_db(dbname)
        if not lat:
            raise TimeoutError("no run started")
        result = {
            "n": len(lat),
            "sent": len(sent),
            "rate_per_s": cfg.latency_rate,
            "p50": pct(lat, 50),
            "p90": pct(lat, 90),
            "p99": pct(lat, 99),
            "max": max(lat),
        }
        _log(f"  p50 {result['p50']:.2f} ms  p99 {result['p99']:.2f} ms  (n={len(lat)})")
        return result

    # -- claim latency with a foreign backlog -----------------------------------------------

    LEGACY_CLAIM = """
UPDATE legacy_runs SET status = 'running', lease_owner = %(worker_id)s,
       lease_expires_at = now() + %(lease)s::interval, claims = claims + 1,
       available_at = now() + %(lease)s::interval, updated_at = now()
WHERE id IN (
    SELECT id FROM legacy_runs
    WHERE status = 'pending' AND available_at <= now()
      AND task_name = %(name)s AND task_version = %(version)s
    ORDER BY available_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED)
RETURNING id, task_name, task_version, input
"""

    def claim_backlog(self) -> dict[str, Any]:
        _log(f"claim_ms_foreign_backlog: {self.cfg.backlog} foreign pending runs")
        return asyncio.run(self._claim_backlog())

    async def _claim_backlog(self) -> dict[str, Any]:
        from umt_backend_pg import PostgresBackend, migrate
        from umt_sdk import TaskPair

        cfg = self.cfg
        dbname = "bench_claim"
        dsn = self.server.fresh_db(dbname)
        await migrate(dsn)
        own = cfg.claim_samples * 2 + 100
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO umt.runs (id, task_name, task_version, status, priority, "
                "available_at, input_hash, input) "
                "SELECT gen_random_uuid(), 'foreign_' || (g %% 50), 1 + g %% 2, 'pending', 0, "
                "now() - interval '2 hours' + g * interval '10 ms', 'h', '0'::jsonb "
                "FROM generate_series(1, %s) AS g",
                (cfg.backlog,),
            )
            conn.execute(
                "INSERT INTO umt.runs (id, task_name, task_version, status, priority, "
                "available_at, input_hash, input) "
                "SELECT gen_random_uuid(), 'pair_a', 1, 'pending', 0, "
                "now() - interval '1 minute' + g * interval '1 ms', 'h', '0'::jsonb "
                "FROM generate_series(1, %s) AS g",
                (own,),
            )
            # Enqueued runs claimable at once are queued in `ready` (as insert_run does).
            conn.execute("UPDATE umt.runs SET queued = true")
            conn.execute(
                "INSERT INTO umt.ready (run_id, task_name, task_version, priority, "
                "available_at, slot) SELECT id, task_name, task_version, priority, available_at, "
                "umt.ready_slot() FROM umt.runs"
            )
            conn.execute("CREATE TABLE legacy_runs AS TABLE umt.runs")
            conn.execute("ALTER TABLE legacy_runs ADD PRIMARY KEY (id)")
            conn.execute(
                "CREATE INDEX legacy_runs_claim ON legacy_runs (available_at) "
                "WHERE status = 'pending'"
            )
            conn.execute("VACUUM ANALYZE umt.runs")
            conn.execute("VACUUM ANALYZE legacy_runs")
            conn.execute("VACUUM ANALYZE umt.ready")
        pair = TaskPair(name="pair_a", version=1)
        lease = timedelta(seconds=30)
        backend = await PostgresBackend.open(
            dsn, run_migrations=False, min_size=1, max_size=1, listen=False
        )
        explain_umt = self._explain(
            dsn,
            backend._q["claim_runs"],
            {
                "names": ["pair_a"],
                "versions": [1],
                "limit": 1,
                "scan": 17,  # as PostgresBackend.claim passes for limit 1 (extra keys unused)
                "worker_id": "bench-claim",
                "lease": lease,
                "timers": False,  # as most claims: the timers are read once a second
                "timers_after": None,
                "timers_margin": timedelta(seconds=5),
            },
        )
        umt_ms: list[float] = []
        claimed = 0
        try:
            for i in range(cfg.claim_samples + 10):
                t0 = time.perf_counter()
                got = await backend.claim(
                    worker_id="bench-claim", pairs=[pair], limit=1, lease=lease
                )
                dt = (time.perf_counter() - t0) * 1000
                claimed += len(got)
                if i >= 10:
                    umt_ms.append(dt)
        finally:
            await backend.close()
        legacy_params = {
            "worker_id": "bench-claim",
            "lease": lease,
            "name": "pair_a",
            "version": 1,
            "limit": 1,
        }
        explain_legacy = self._explain(dsn, self.LEGACY_CLAIM, legacy_params)
        legacy_ms: list[float] = []
        legacy_claimed = 0
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            for i in range(cfg.claim_samples + 10):
                t0 = time.perf_counter()
                cur = await conn.execute(self.LEGACY_CLAIM, legacy_params)
                got_rows = await cur.fetchall()
                dt = (time.perf_counter() - t0) * 1000
                legacy_claimed += len(got_rows)
                if i >= 10:
                    legacy_ms.append(dt)
        self.server.drop_db(dbname)
        plan = explain_umt
        result = {
            "backlog_foreign": cfg.backlog,
            "own_pending": own,
            "samples": cfg.claim_samples,
            "umt": {
                "p50": pct(umt_ms, 50),
                "p99": pct(umt_ms, 99),
                "max": max(umt_ms),
                "claimed": claimed,
            },
            "legacy": {
                "p50": pct(legacy_ms, 50),
                "p99": pct(legacy_ms, 99),
                "max": max(legacy_ms),
                "claimed": legacy_claimed,
                "sql": " ".join(self.LEGACY_CLAIM.split()),
                "index": "legacy_runs (available_at) WHERE status = 'pending'",
            },
            "umt_uses_pair_index": "Index Scan using ready_" in plan
            and "Seq Scan on r" not in plan,
            "explain_umt": explain_umt,
            "explain_legacy": explain_legacy,
        }
        result["speedup_p50"] = result["legacy"]["p50"] / max(result["umt"]["p50"], 1e-9)
        _log(
            f"  umt p50 {result['umt']['p50']:.3f} ms p99 {result['umt']['p99']:.3f} ms; "
            f"legacy p50 {result['legacy']['p50']:.3f} ms"
        )
        return result

    @staticmethod
    def _explain(dsn: str, query: str, params: dict[str, Any]) -> str:
        with psycopg.connect(dsn, cursor_factory=psycopg.ClientCursor) as conn:
            try:
                cur = conn.execute("EXPLAIN (ANALYZE, BUFFERS, VERBOSE OFF) " + query, params)
                return "\n".join(str(r[0]) for r in cur.fetchall())
            finally:
                conn.rollback()

    # -- recovery after SIGKILL ---------------------------------------------------------------

    def recovery(self) -> dict[str, Any]:
        cfg = self.cfg
        out: dict[str, Any] = {}
        results: dict[float, list[dict[str, Any]]] = {lease: [] for lease in cfg.leases}

        def series(lease: float, slot: int) -> None:
            for rep in range(cfg.recovery_reps):
                _log(f"recovery_after_sigkill: lease {lease:g} s, repetition {rep + 1}")
                try:
                    results[lease].append(self._recovery_once(lease, f"bench_recovery_{slot}"))
                except (ChildError, psycopg.Error, OSError, TimeoutError) as exc:
                    _log(f"  failed: {exc}")
                    results[lease].append({"error": str(exc)[-2000:]})

        if cfg.quick:  # side by side, to keep the smoke run short
            threads = [
                threading.Thread(target=series, args=(lease, i))
                for i, lease in enumerate(cfg.leases)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for i, lease in enumerate(cfg.leases):
                series(lease, i)
        for lease, runs in results.items():
            ok = [r for r in runs if "recovery_s" in r]
            out[f"lease_{lease:g}s"] = {
                "lease_s": lease,
                "recovery_s": summary([r.get("recovery_s") for r in runs]),
                "reexecuted_completed_steps": sum(int(r["reexecuted_completed_steps"]) for r in ok)
                if ok
                else None,
                "over_lease_s": summary([r["recovery_s"] - lease for r in ok]),
                "errors": [r["error"] for r in runs if "error" in r],
                "repetitions": runs,
            }
        return out

    def _recovery_once(self, lease: float, dbname: str) -> dict[str, Any]:
        from bench._umt_child import REGISTRY, bench_recovery
        from umt_backend_pg import migrate

        dsn = self.server.fresh_db(dbname)
        asyncio.run(migrate(dsn))
        base = [
            sys.executable,
            "-m",
            "bench._umt_child",
            "recovery",
            "--dsn",
            dsn,
            "--lease",
            str(lease),
        ]
        victim = Child([*base, "--role", "victim"], name="umt-victim")
        rescuer = Child([*base, "--role", "rescuer"], name="umt-rescuer")
        try:
            victim.expect("READY", 120)
            rescuer.expect("READY", 120)
            victim.send("GO")

            async def enqueue() -> Any:
                engine = await connect(
                    dsn, registry=REGISTRY, listen=False, max_size=1, run_migrations=False
                )
                handle = await engine.enqueue(bench_recovery, 0)
                await engine.close()
                return handle.run_id

            run_id = asyncio.run(enqueue())
            victim.expect("EVENT", 60)  # in s2, s1 recorded
            # The rescuer starts idle-polling now; the kill comes at a random point of its
            # poll cycle (and of the victim's heartbeat cycle), as a real crash would.
            rescuer.send("GO")
            time.sleep(random.uniform(0.1, 1.1))
            t_kill = time.time()
            os.kill(victim.proc.pid, signal.SIGKILL)
            event = rescuer.expect("EVENT", lease + 60)
            recovery_s = float(event["s2_started"]) - t_kill
            with psycopg.connect(dsn, autocommit=True) as conn:
                status = None
                for _ in range(200):
                    row = conn.execute(
                        "SELECT status, lease_expirations FROM umt.runs WHERE id = %s", (run_id,)
                    ).fetchone()
                    status = row[0] if row else None
                    if status == "completed":
                        break
                    time.sleep(0.05)
                s1_rows = conn.execute(
                    "SELECT count(*) FROM umt.steps WHERE run_id = %s AND name = 's1'", (run_id,)
                ).fetchone()
            rescuer.send("STOP")
            rescuer.expect("RESULT", 60)
        finally:
            victim.kill()
            rescuer.close(30)
        self.server.drop_db(dbname)
        result = {
            "recovery_s": recovery_s,
            "reexecuted_completed_steps": int(event["s1_bodies"]),
            "run_status": status,
            "s1_records": int(s1_rows[0]) if s1_rows else None,
        }
        _log(
            f"  recovered in {recovery_s:.3f} s (lease {lease:g} s), re-executed completed "
            f"steps: {result['reexecuted_completed_steps']}, run {status}"
        )
        return result

    # -- memory backend -------------------------------------------------------------------------

    def memory(self) -> dict[str, Any]:
        cfg = self.cfg
        values: list[float | None] = []
        for rep in range(cfg.reps):
            _log(f"memory_backend_runs_per_s: repetition {rep + 1}/{cfg.reps}")
            rate = asyncio.run(_memory_once(cfg.memory_n, cfg.concurrency * 4))
            _log(f"  {rate:.0f} runs/s")
            values.append(rate)
        return {
            "runs_per_s": summary(values),
            "n": cfg.memory_n,
            "steps_per_run": 3,
            "concurrency": cfg.concurrency * 4,
        }


def _setup_here(name: str, dsn: str, n: int, k: int) -> dict[str, Any]:
    """The raw tables, or umt's schema and n enqueued runs, from this process."""
    if name != "umt":
        from bench._raw_child import SETUP

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SETUP)
            if n:
                conn.execute(
                    "INSERT INTO raw_runs (task_name, task_version, input) "
                    "SELECT 'noop', 1, '1' FROM generate_series(1, %s)",
                    (n,),
                )
            conn.execute("VACUUM ANALYZE raw_runs")
        return {}

    async def enqueue() -> dict[str, Any]:
        from bench._umt_child import REGISTRY, bench_drain

        engine = await connect(dsn, registry=REGISTRY, max_size=4, listen=False)
        t0 = time.perf_counter()
        for start in range(0, n, 64):
            await asyncio.gather(
                *(engine.enqueue(bench_drain, k) for _ in range(min(64, n - start)))
            )
        seconds = time.perf_counter() - t0
        await engine.close()
        return {"enqueue_s": seconds, "enqueue_per_s": n / seconds if seconds else 0}

    return asyncio.run(enqueue())


async def _noop(i: int) -> int:
    return i


_FINISHED = [0]
_TARGET = [0]
_ALL_DONE: list[asyncio.Event] = []


@task("bench_memory", version=1)
async def bench_memory(ctx: TaskContext[int]) -> int:
    """Three no-op steps."""
    for i in range(3):
        await ctx.step.run(f"s{i}", _noop, i)
    _FINISHED[0] += 1
    if _FINISHED[0] >= _TARGET[0] and _ALL_DONE:
        _ALL_DONE[0].set()
    return 3


async def _memory_once(n: int, concurrency: int) -> float:
    _FINISHED[0], _TARGET[0] = 0, n
    done = asyncio.Event()
    _ALL_DONE[:] = [done]
    engine = await connect("memory://", registry=Registry([bench_memory]))
    worker = engine.worker(concurrency=concurrency, poll_interval=timedelta(milliseconds=50))
    await worker.start()
    t0 = time.perf_counter()
    for _ in range(n):
        await engine.enqueue(bench_memory, 0)
    await done.wait()
    # The last handlers have returned; wait for their completions to be recorded.
    await asyncio.gather(*(e.task for e in worker._executions.values() if e.task is not None))
    seconds = time.perf_counter() - t0
    await engine.close()
    return n / seconds
