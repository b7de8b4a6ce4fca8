"""Long-horizon scenarios: `python -m bench --scenario NAME [--quick]`.

After the method of the independent Postgres job-queue benchmark
(hardbyte/postgresql-job-queue-benchmarking, docs/method.md): a producer process offers a fixed
rate of 1-step runs, umt worker processes serve them, and the run goes through phases:

    clean           warmup, clean
    idle-in-tx      warmup, clean, idle-in-tx (one connection holds `BEGIN; SELECT
                    txid_current()` for the phase: vacuum cannot remove what it made dead),
                    recovery
    active-readers  warmup, clean, active-readers (4 REPEATABLE READ connections scanning the
                    hot tables, transactions overlapping), recovery
    high-load       warmup, clean, high-load (1.5x the offered rate), recovery
    pg-backend-kill warmup, clean, backend-kill (`pg_terminate_backend` on one of the engine's
                    sessions, producer's or workers', every 0.25 s), recovery
    postgres-restart
                    warmup, clean, postgres-restart (the server crashed with `pg_ctl stop -m
                    immediate` and started again, twice in the phase), recovery
    repeated-kill   warmup, clean, worker-kill (every 20 s one of the two worker processes is
                    SIGKILLed and a new one started at once), recovery

then the producer stops and the workers drain what is left (phase `drain`). The warmup lasts
its seconds and at least until a run was picked up (a loaded machine may start the workers'
first claim late), at most a minute longer. Every window (10 s;
1 s with --quick; windows restart at each phase boundary) records the pickup latency (enqueue
call to handler start) as a bounded-memory histogram (p50/p95/p99/max), enqueue and completion
rates, queue depth, dead tuples, table and index sizes of the engine's tables, index entries
read per claim-index scan, the oldest transaction's xmin age and a wait-event sample (once a
second). At the end of each phase the claim query is run under EXPLAIN (ANALYZE, BUFFERS) and
rolled back (if the server was down for the phase's last seconds, as soon as it is back).
Runs lost (acknowledged enqueues not completed after the drain) must be 0.

The three chaos scenarios run the step with a fenced side effect (a row written through
`with_attempt_token`, see bench/_scenario_child.py): effects made twice and effects missing
(a completed run without its row) must both be 0.

`--system pgqueuer|procrastinate` runs a peer through the same scenario instead of umt
(bench/_scenario_peer.py, bench/peers/scenario_peer.py): the same producer schedule, faults,
windows and effect ledger, without fencing (the peers have none, so doubles are counted, not
refused).

Output: bench/results/scenario_<name>.json, .txt (the window table) and .png (matplotlib);
a peer's: scenario_<name>_<system>.*.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import queue
import re
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench._hist import Histogram
from bench._infra import MONITOR_TAG, Child, ChildError, Server, machine_info
from bench._scenario_peer import check_peer_jobs, install_peer, peer_argv, peer_reexecutions

__all__ = ["SCENARIOS", "ScenarioConfig", "run_scenario", "write_scenario"]

TASK = "bench_pickup"
SCENARIOS: dict[str, tuple[str, ...]] = {
    "clean": ("warmup", "clean"),
    "idle-in-tx": ("warmup", "clean", "idle-in-tx", "recovery"),
    "active-readers": ("warmup", "clean", "active-readers", "recovery"),
    "high-load": ("warmup", "clean", "high-load", "recovery"),
    "pg-backend-kill": ("warmup", "clean", "backend-kill", "recovery"),
    "postgres-restart": ("warmup", "clean", "postgres-restart", "recovery"),
    "repeated-kill": ("warmup", "clean", "worker-kill", "recovery"),
}
# The scenarios that break something: their step makes a fenced effect, counted at the end.
CHAOS = frozenset({"pg-backend-kill", "postgres-restart", "repeated-kill"})
HOT_TABLES = ("runs", "steps", "executions", "ready_0", "ready_1", "ready_2")
SYSTEMS = ("umt", "pgqueuer", "procrastinate")
# Each system's schema and job table (the one whose dead tuples the tables show as "runs").
JOB_TABLE = {
    "umt": ("umt", "runs"),
    "pgqueuer": ("public", "pgqueuer"),
    "procrastinate": ("public", "procrastinate_jobs"),
}
# A peer's queue depth: (pending, running) from its own job table.
PEER_DEPTH = {
    "pgqueuer": "SELECT count(*) FILTER (WHERE status = 'queued') AS {tag}, "
    "count(*) FILTER (WHERE status = 'picked') FROM public.pgqueuer",
    "procrastinate": "SELECT count(*) FILTER (WHERE status = 'todo') AS {tag}, "
    "count(*) FILTER (WHERE status = 'doing') FROM public.procrastinate_jobs",
}


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


WARMUP_WAIT_S = 60.0
"""How much longer than its seconds the warmup waits for the first pickup."""


@dataclass
class ScenarioConfig:
    name: str
    quick: bool
    rate: float | None = None  # None: rate_fraction x a measured drain rate
    rate_fraction: float = 0.7
    rate_cap: float | None = None  # quick: keep the smoke run light
    calibrate_n: int = 3000
    warmup_s: float = 30.0
    clean_s: float = 120.0
    phase_s: float = 300.0
    recovery_s: float = 120.0
    window_s: float = 10.0
    drain_timeout_s: float = 300.0
    workers: int = 1
    concurrency: int = 32
    worker_conns: int = 0  # 0: the engine's default pool
    producer_conns: int = 4
    lease_s: float = 10.0
    high_load_multiplier: float = 1.5
    readers: int = 4
    reader_tx_s: float = 10.0
    backend_kill_every_s: float = 0.25
    restarts: int = 2
    worker_kill_every_s: float = 20.0
    keep_db: bool = False
    explain: bool = True
    system: str = "umt"  # or a peer: pgqueuer, procrastinate (bench/peers/scenario_peer.py)
    peers_python: str = ""  # the peers' virtualenv's python, for a peer
    phases: list[tuple[str, float]] = field(default_factory=list)

    @classmethod
    def make(cls, name: str, quick: bool, **overrides: Any) -> ScenarioConfig:
        if name not in SCENARIOS:
            raise SystemExit(f"unknown scenario {name!r}: one of {', '.join(SCENARIOS)}")
        if quick:
            cfg = cls(
                name=name,
                quick=True,
                rate_cap=100.0,
                calibrate_n=200,
                warmup_s=1.0,
                clean_s=3.0,
                phase_s=3.0,
                recovery_s=3.0,
                window_s=1.0,
                drain_timeout_s=60.0,
                reader_tx_s=1.5,
                restarts=1,
                worker_kill_every_s=1.5,
                lease_s=2.0,  # a killed worker's runs come back within the smoke run
            )
        else:
            cfg = cls(name=name, quick=False)
        if name == "repeated-kill":
            cfg.workers = 2  # one serves while the other is killed and replaced
        for key, value in overrides.items():
            if value is not None:
                setattr(cfg, key, value)
        length = {
            "warmup": cfg.warmup_s,
            "clean": cfg.clean_s if name != "clean" else cfg.phase_s,
            "idle-in-tx": cfg.phase_s,
            "active-readers": cfg.phase_s,
            "high-load": cfg.phase_s,
            "backend-kill": cfg.phase_s,
            "postgres-restart": cfg.phase_s,
            "worker-kill": cfg.phase_s,
            "recovery": cfg.recovery_s,
        }
        cfg.phases = [(p, length[p]) for p in SCENARIOS[name]]
        return cfg


# -- the disturbances -------------------------------------------------------------------------


class IdleInTx:
    """One connection holding `BEGIN; SELECT txid_current()` (an xid, so the xmin horizon)."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=False)
        row = self.conn.execute("SELECT txid_current()").fetchone()
        self.xid = int(row[0]) if row else None

    def stop(self) -> dict[str, Any]:
        with contextlib.suppress(psycopg.Error):
            self.conn.rollback()
        self.conn.close()
        return {"xid": self.xid}


class ActiveReaders:
    """N REPEATABLE READ connections scanning the hot tables; transactions overlap (staggered)."""

    SCANS = (
        "SELECT status, count(*), max(updated_at) FROM umt.runs GROUP BY status",
        "SELECT count(*), max(finished_at) FROM umt.steps",
        "SELECT outcome, count(*) FROM umt.executions GROUP BY outcome",
    )

    def __init__(self, dsn: str, n: int, tx_s: float) -> None:
        self.stop_event = threading.Event()
        self.scans = [0] * n
        self.transactions = [0] * n
        self.errors: list[str] = []
        self.threads = [
            threading.Thread(target=self._loop, args=(dsn, i, n, tx_s), daemon=True)
            for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def _loop(self, dsn: str, i: int, n: int, tx_s: float) -> None:
        try:
            with psycopg.connect(dsn, autocommit=False) as conn:
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                if self.stop_event.wait(i * tx_s / n):  # stagger: one snapshot always held
                    return
                while not self.stop_event.is_set():
                    began = time.monotonic()
                    while time.monotonic() - began < tx_s and not self.stop_event.is_set():
                        for q in self.SCANS:
                            conn.execute(q).fetchall()
                            self.scans[i] += 1
                        self.stop_event.wait(0.2)
                    conn.commit()
                    self.transactions[i] += 1
        except psycopg.Error as exc:
            self.errors.append(str(exc)[:300])

    def stop(self) -> dict[str, Any]:
        self.stop_event.set()
        for t in self.threads:
            t.join(30)
        return {
            "readers": len(self.threads),
            "scans": sum(self.scans),
            "transactions": sum(self.transactions),
            "errors": self.errors[:5],
        }


class BackendKiller:
    """Every `every_s`, `pg_terminate_backend` on one of the engine's sessions (the producer's
    or a worker's, chosen at random; never the harness's own, named `bench_*`), as a pooler, a
    failover or an operator cuts sessions."""

    def __init__(self, dsn: str, dbname: str, every_s: float) -> None:
        self.stop_event = threading.Event()
        self.kills = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(
            target=self._loop, args=(dsn, dbname, every_s), name="bench-backend-kill", daemon=True
        )
        self.thread.start()

    def _loop(self, dsn: str, dbname: str, every_s: float) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True, application_name="bench_chaos") as conn:
                while not self.stop_event.wait(every_s):
                    row = conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = %s AND backend_type = 'client backend' "
                        "AND pid <> pg_backend_pid() AND application_name NOT LIKE 'bench\\_%%' "
                        "ORDER BY random() LIMIT 1",
                        (dbname,),
                    ).fetchone()
                    if row and row[0]:
                        self.kills += 1
        except psycopg.Error as exc:
            self.errors.append(str(exc)[:300])

    def stop(self) -> dict[str, Any]:
        self.stop_event.set()
        self.thread.join(30)
        return {"backend_kills": self.kills, "errors": self.errors[:5]}


class Restarter:
    """Crashes the server `times` times, evenly through the phase, and starts it again at once
    (`Server.crash_restart`); the seconds each one was down are recorded."""

    def __init__(self, server: Server, times: int, phase_s: float) -> None:
        self.stop_event = threading.Event()
        self.down_s: list[float] = []
        self.errors: list[str] = []
        self.thread = threading.Thread(
            target=self._loop, args=(server, times, phase_s), name="bench-restart", daemon=True
        )
        self.thread.start()

    def _loop(self, server: Server, times: int, phase_s: float) -> None:
        every = phase_s / (times + 1)
        for _ in range(times):
            if self.stop_event.wait(every):
                return
            try:
                self.down_s.append(round(server.crash_restart(), 3))
            except Exception as exc:  # reported; the run's check says what it cost
                self.errors.append(repr(exc)[:300])

    def stop(self) -> dict[str, Any]:
        self.stop_event.set()
        self.thread.join(120)
        return {"restarts": len(self.down_s), "down_s": self.down_s, "errors": self.errors[:5]}


# -- windows ----------------------------------------------------------------------------------


class Window:
    def __init__(self, phase: str, index: int, t_start: float) -> None:
        self.phase = phase
        self.index = index
        self.t_start = t_start
        self.t_end = t_start
        self.lat = Histogram()
        self.started = 0
        self.finished = 0
        self.enqueued = 0
        self.enqueue_errors = 0
        self.producer_lag_s = 0.0
        self.samples: list[dict[str, Any]] = []
        self.waits: dict[str, int] = {}
        self.wait_samples = 0
        self.unreachable = 0  # seconds the monitor could not reach the server

    def row(self, t0: float) -> dict[str, Any]:
        seconds = max(self.t_end - self.t_start, 1e-9)
        last = self.samples[-1] if self.samples else {}
        first = self.samples[0] if self.samples else {}
        out: dict[str, Any] = {
            "phase": self.phase,
            "t_s": round(self.t_start - t0, 3),
            "seconds": round(seconds, 3),
            "pickup": self.lat.summary(),
            "enqueue_per_s": self.enqueued / seconds,
            "completion_per_s": self.finished / seconds,
            "started_per_s": self.started / seconds,
            "enqueue_errors": self.enqueue_errors,
            "producer_lag_s": self.producer_lag_s,
            "queue_depth": last.get("pending"),
            "running": last.get("running"),
            "tables": last.get("tables"),
            "indexes": last.get("indexes"),
            "oldest_xmin_age": max((s.get("xmin_age") or 0 for s in self.samples), default=None),
            "monitor_ms_max": max((s.get("monitor_ms", 0.0) for s in self.samples), default=None),
            "waits": dict(sorted(self.waits.items(), key=lambda kv: -kv[1])),
            "wait_samples": self.wait_samples,
            "unreachable_samples": self.unreachable,
        }
        # Index entries read per scan of the claim indexes, over the window.
        reads: dict[str, Any] = {}
        for name in sorted(last.get("indexes") or {}):
            a = (first.get("indexes") or {}).get(name)
            b = (last.get("indexes") or {}).get(name)
            if a and b and b["idx_scan"] > a["idx_scan"]:
                reads[name] = (b["idx_tup_read"] - a["idx_tup_read"]) / (
                    b["idx_scan"] - a["idx_scan"]
                )
        out["index_tuples_read_per_scan"] = reads
        return out


class Monitor:
    """Once a second: queue depth, table statistics and sizes, wait events, xmin age."""

    def __init__(self, dsn: str, dbname: str, system: str = "umt") -> None:
        self.dsn = dsn
        self.conn: psycopg.Connection[Any] | None = self._connect()
        self.dbname = dbname
        self.system = system
        # Postgres 18 counts each backend's buffer accesses: the monitor's own are taken out of
        # the work per run (its queries read the bloated indexes too).
        row = self.conn.execute(
            "SELECT to_regproc('pg_catalog.pg_stat_get_backend_io') IS NOT NULL"
        ).fetchone()
        self.counts_itself = bool(row and row[0])

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.dsn, autocommit=True, application_name="bench_monitor", connect_timeout=5
        )

    def sample_or_none(self) -> dict[str, Any] | None:
        """A sample, or None while the server cannot be reached (a crash being recovered)."""
        try:
            if self.conn is None or self.conn.closed:
                self.conn = self._connect()
            return self.sample(self.conn)
        except psycopg.OperationalError:
            with contextlib.suppress(Exception):
                if self.conn is not None:
                    self.conn.close()
            self.conn = None
            return None

    def sample(self, c: psycopg.Connection[Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        schema = JOB_TABLE[self.system][0]
        row = c.execute(
            f"SELECT count(*) FILTER (WHERE status = 'pending') AS {MONITOR_TAG}, "
            "count(*) FILTER (WHERE status = 'running') "
            "FROM umt.runs WHERE status IN ('pending', 'running')"
            if self.system == "umt"
            else PEER_DEPTH[self.system].format(tag=MONITOR_TAG)
        ).fetchone()
        pending, running = (int(row[0]), int(row[1])) if row else (None, None)
        tables: dict[str, Any] = {}
        for r in c.execute(
            f"SELECT relname AS {MONITOR_TAG}, n_live_tup, n_dead_tup, n_tup_ins, n_tup_upd, "
            "n_tup_hot_upd, n_tup_del, autovacuum_count, vacuum_count, "
            "pg_relation_size(relid), pg_indexes_size(relid), pg_total_relation_size(relid) "
            "FROM pg_stat_user_tables WHERE schemaname = %s AND relname <> 'bench_effects'",
            (schema,),
        ).fetchall():
            tables[r[0]] = {
                "live": r[1],
                "dead": r[2],
                "ins": r[3],
                "upd": r[4],
                "hot_upd": r[5],
                "del": r[6],
                "autovacuums": r[7],
                "vacuums": r[8],
                "heap_bytes": r[9],
                "index_bytes": r[10],
                "total_bytes": r[11],
            }
        indexes: dict[str, Any] = {}
        for r in c.execute(
            f"SELECT indexrelname AS {MONITOR_TAG}, idx_scan, idx_tup_read, idx_tup_fetch, "
            "pg_relation_size(indexrelid) FROM pg_stat_user_indexes WHERE schemaname = %s "
            "AND relname <> 'bench_effects'",
            (schema,),
        ).fetchall():
            indexes[r[0]] = {
                "idx_scan": r[1],
                "idx_tup_read": r[2],
                "idx_tup_fetch": r[3],
                "bytes": r[4],
            }
        db = c.execute(
            f"SELECT blks_hit + blks_read AS {MONITOR_TAG}, xact_commit + xact_rollback "
            "FROM pg_stat_database WHERE datname = %s",
            (self.dbname,),
        ).fetchone()
        own = None
        if self.counts_itself:
            r = c.execute(
                f"SELECT coalesce(sum(hits) + sum(reads), 0) AS {MONITOR_TAG} "
                "FROM pg_stat_get_backend_io(pg_backend_pid())"
            ).fetchone()
            own = int(r[0]) if r else None
        waits: dict[str, int] = {}
        xmin_age = None
        for r in c.execute(
            f"SELECT state AS {MONITOR_TAG}, coalesce(wait_event_type, 'CPU'), "
            "coalesce(wait_event, 'CPU'), count(*), max(age(backend_xmin)), "
            "max(age(backend_xid)) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid() AND state IS NOT NULL "
            "GROUP BY 1, 2, 3",
            (self.dbname,),
        ).fetchall():
            ages = [a for a in (r[4], r[5]) if a is not None]
            if ages:
                xmin_age = max([xmin_age or 0, *ages])
            if r[0] == "idle":
                continue
            waits[f"{r[0]}:{r[1]}:{r[2]}"] = int(r[3])
        return {
            "t": time.time(),
            "pending": pending,
            "running": running,
            "tables": tables,
            "indexes": indexes,
            "waits": waits,
            "xmin_age": xmin_age,
            "buffers": int(db[0]) if db else None,
            "monitor_buffers": own,
            "transactions": int(db[1]) if db else None,
            "monitor_ms": (time.perf_counter() - t0) * 1000,
        }

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


# -- the run ----------------------------------------------------------------------------------


def _explain_when_up(dsn: str, limit: int, lease_s: float, timeout: float = 60.0) -> str:
    """`_explain_claim` once the server accepts connections again (after a crash)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _explain_claim(dsn, limit, lease_s)
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _explain_claim(dsn: str, limit: int, lease_s: float) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of the worker's claim, rolled back (claims nothing).

    A claim whose timers branch is optional (`%(timers)s`) is explained both ways."""
    from datetime import UTC, datetime, timedelta

    from umt_backend_pg._sql import queries, render

    query = render(queries()["claim_runs"], "umt")
    params: dict[str, Any] = {
        "names": [TASK],
        "versions": [1],
        "limit": limit,
        "scan": limit + max(limit, 16),
        "worker_id": "bench-explain",
        "lease": timedelta(seconds=lease_s),
    }
    variants = [False, True] if "%(timers)s" in query else [None]
    out = []
    for timers in variants:
        if timers is not None:
            params["timers"] = timers
            # A windowed timers read: from 6 s ago (umt_backend_pg._ready), as most reads are.
            params["timers_after"] = datetime.now(UTC) - timedelta(seconds=6)
            params["timers_margin"] = timedelta(seconds=5)
            out.append(f"-- with timers = {timers} (from 6 s ago)")
        with psycopg.connect(
            dsn, cursor_factory=psycopg.ClientCursor, application_name="bench_explain"
        ) as conn:
            try:
                cur = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + query, params)
                out.extend(str(r[0]) for r in cur.fetchall())
            finally:
                conn.rollback()
    return "\n".join(out)


class _Fold:
    """Folds the children's per-second EVENTs into the current window."""

    def __init__(self) -> None:
        self.window: Window | None = None
        self.produced_total = 0
        self.started_total = 0
        self.finished_total = 0
        self.enqueue_errors_total = 0
        self.last_error: str | None = None
        self.results: dict[str, Any] = {}
        self.ended: set[str] = set()
        self.starts_seen: dict[str, int] = {}  # each worker's last starts_total

    def result(self, child: Child, timeout: float) -> Any:
        """The child's RESULT, whether pump() has read it already or not."""
        deadline = time.monotonic() + timeout
        while child.name not in self.results:
            if child.name in self.ended or time.monotonic() > deadline:
                raise ChildError(f"{child.name}: no RESULT\n{child.stderr_tail()}")
            self.pump(child)
            time.sleep(0.05)
        return self.results[child.name]

    def pump(self, child: Child) -> None:
        if child.name in self.ended:
            return
        while True:
            try:
                line = child.lines.get_nowait()
            except queue.Empty:
                return
            if line is None:
                self.ended.add(child.name)
                return
            head, _, rest = line.partition(" ")
            if head == "RESULT":
                self.results[child.name] = json.loads(rest) if rest else {}
                continue
            if head != "EVENT" or not rest:
                continue
            ev = json.loads(rest)
            w = self.window
            if "enqueued" in ev:
                self.produced_total += ev["enqueued"]
                self.enqueue_errors_total += ev["errors"]
                if "last_error" in ev:
                    self.last_error = ev["last_error"]
                if w is not None:
                    w.enqueued += ev["enqueued"]
                    w.enqueue_errors += ev["errors"]
                    w.producer_lag_s = max(w.producer_lag_s, float(ev["lag_s"]))
            else:
                self.starts_seen[child.name] = int(ev.get("starts_total", 0))
                self.started_total += ev["started"]
                self.finished_total += ev["finished"]
                if w is not None:
                    w.started += ev["started"]
                    w.finished += ev["finished"]
                    w.lat.merge(Histogram.from_json(ev["lat"]))


def _fmt(v: float | None, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if abs(v) >= 10000:
        return f"{v:,.0f}"
    return f"{v:,.{digits}f}"


def run_scenario(server: Server, cfg: ScenarioConfig) -> dict[str, Any]:
    import asyncio

    from umt_backend_pg import migrate

    peer = cfg.system != "umt"
    dbname = "bench_scenario_" + cfg.name.replace("-", "_") + (f"_{cfg.system}" if peer else "")
    chaos = cfg.name in CHAOS
    if peer and cfg.rate is None:
        raise SystemExit(f"--system {cfg.system} needs --rate (the calibration drains umt runs)")
    explain = cfg.explain and not peer  # the claim EXPLAIN is umt's claim
    if cfg.name == "postgres-restart" and not server.can_crash:
        raise SystemExit(
            "scenario postgres-restart crashes and restarts the server: it needs the bench's "
            "own embedded Postgres, so leave out --database-url"
        )
    dsn = server.fresh_db(dbname)
    if peer:
        install_peer(cfg.system, cfg.peers_python, dsn)
    else:
        asyncio.run(migrate(dsn))
    if chaos:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE public.bench_effects (run_id bigint NOT NULL)"
                if peer
                else "CREATE TABLE public.bench_effects (run_id uuid NOT NULL, token bigint)"
            )
    started_at = time.time()
    load_before = list(os.getloadavg())
    ids_file = Path(tempfile.mkstemp(prefix="umt-scenario-ids-")[1])
    base = [sys.executable, "-m", "bench._scenario_child"]
    workers: list[Child] = []
    producer: Child | None = None
    fold = _Fold()
    windows: list[Window] = []
    phases_out: list[dict[str, Any]] = []
    explains: dict[str, str] = {}
    monitor = Monitor(dsn, dbname, cfg.system)
    worker_argv = [
        *base,
        "work",
        "--dsn",
        dsn,
        "--concurrency",
        str(cfg.concurrency),
        "--lease",
        str(cfg.lease_s),
        *(["--conns", str(cfg.worker_conns)] if cfg.worker_conns else []),
        *(["--effect"] if chaos else []),
    ]
    producer_argv = [
        *base,
        "produce",
        "--dsn",
        dsn,
        "--rate",
        str(cfg.rate or 1.0),
        "--conns",
        str(cfg.producer_conns),
        "--ids",
        str(ids_file),
    ]
    if peer:
        worker_argv, producer_argv = peer_argv(
            cfg.system,
            cfg.peers_python,
            dsn,
            ids_file,
            concurrency=cfg.concurrency,
            lease_s=cfg.lease_s,
            rate=cfg.rate or 1.0,
            producer_conns=cfg.producer_conns,
            worker_conns=cfg.worker_conns,
            effect=chaos,
        )
    killed: list[Child] = []  # SIGKILLed by worker-kill; their last totals count
    starting: list[_Starting] = []  # their replacements, until READY
    try:
        for wid in range(cfg.workers):
            workers.append(Child(worker_argv, name=f"scenario-w{wid + 1}"))
        producer = Child(producer_argv, name="scenario-producer")
        for child in [*workers, producer]:
            child.expect("READY", 180)

        # The offered rate: a fraction of a drain rate measured here (or --rate).
        calibration: dict[str, Any] = {}
        if cfg.rate is None:
            n = cfg.calibrate_n
            _log(f"scenario {cfg.name}: calibrating, draining {n} pre-enqueued runs")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO umt.runs (id, task_name, task_version, status, priority, "
                    "available_at, input_hash, input) "
                    "SELECT gen_random_uuid(), %s, 1, 'pending', 0, now(), 'h', "
                    "to_jsonb(extract(epoch FROM now())::float8) FROM generate_series(1, %s)",
                    (TASK, n),
                )
                conn.execute("ANALYZE umt.runs")
                t_go = time.time()
                for child in workers:
                    child.send("GO")
                while True:
                    row = conn.execute(
                        f"SELECT count(*) AS {MONITOR_TAG} FROM umt.runs WHERE status = 'completed'"
                    ).fetchone()
                    if row and row[0] >= n:
                        break
                    if time.time() - t_go > cfg.drain_timeout_s:
                        raise ChildError("calibration drain timed out")
                    time.sleep(0.02)
                seconds = time.time() - t_go
                drain_rate = n / seconds
                rate = cfg.rate_fraction * drain_rate
                if cfg.rate_cap is not None:
                    rate = min(rate, cfg.rate_cap)
                calibration = {"n": n, "seconds": seconds, "drain_runs_per_s": drain_rate}
                _log(
                    f"  drain {drain_rate:.0f} runs/s -> offered rate {rate:.0f} runs/s "
                    f"({cfg.rate_fraction:.0%}{', capped' if rate == cfg.rate_cap else ''})"
                )
                for child in workers:
                    fold.pump(child)  # calibration events belong to no window
                fold.started_total = fold.finished_total = 0
        else:
            rate = cfg.rate
            for child in workers:
                child.send("GO")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                f"VACUUM ANALYZE {'.'.join(JOB_TABLE[cfg.system])}"
                if peer
                else "VACUUM ANALYZE umt.runs, umt.steps, umt.executions"
            )
        for child in workers:
            fold.pump(child)
        fold.started_total = fold.finished_total = 0

        children = [producer, *workers]
        producer.send(f"RATE {rate}")
        producer.send("GO")
        t0 = time.time()
        next_sample = t0
        plan = [*cfg.phases, ("drain", cfg.drain_timeout_s)]
        for phase, seconds in plan:
            p_start = time.time()
            disturbance: Any = None
            info: dict[str, Any] = {"phase": phase, "t_s": round(p_start - t0, 3)}
            if phase == "high-load":
                producer.send(f"RATE {rate * cfg.high_load_multiplier}")
            elif phase == "idle-in-tx":
                disturbance = IdleInTx(dsn)
                info["xid"] = disturbance.xid
            elif phase == "active-readers":
                disturbance = ActiveReaders(dsn, cfg.readers, cfg.reader_tx_s)
            elif phase == "backend-kill":
                disturbance = BackendKiller(dsn, dbname, cfg.backend_kill_every_s)
            elif phase == "postgres-restart":
                disturbance = Restarter(server, cfg.restarts, seconds)
            elif phase == "drain":
                producer.send("STOP")
            offered = rate * (cfg.high_load_multiplier if phase == "high-load" else 1.0)
            info["offered_per_s"] = 0.0 if phase == "drain" else offered
            _log(f"phase {phase} ({seconds:g} s, offered {info['offered_per_s']:.0f}/s)")
            k = 0
            window = Window(phase, k, p_start)
            windows.append(window)
            fold.window = window
            next_sample = min(next_sample, p_start)  # every window begins with a sample
            explained = False
            next_kill = p_start + cfg.worker_kill_every_s
            while True:
                now = time.time()
                if phase == "worker-kill" and now >= next_kill and not starting:
                    victim = workers[len(killed) % len(workers)]
                    _kill_worker(victim, fold)
                    killed.append(victim)
                    workers.remove(victim)
                    children.remove(victim)
                    info["worker_kills"] = len(killed)
                    # Its replacement starts at once, in the background (it takes a second or
                    # two to be READY; the windows go on meanwhile).
                    name = f"scenario-w{cfg.workers + len(killed)}"
                    starting.append(_Starting(Child(worker_argv, name=name)))
                    next_kill = now + cfg.worker_kill_every_s
                for new in [w for w in starting if w.ready.is_set()]:
                    starting.remove(new)
                    new.raise_error()
                    workers.append(new.child)
                    children.append(new.child)
                for child in children:
                    fold.pump(child)
                    if child.proc.poll() is not None and not (
                        child is producer and phase == "drain"
                    ):
                        raise ChildError(f"{child.name} died\n{child.stderr_tail()}")
                if now >= next_sample:
                    s = monitor.sample_or_none()
                    next_sample += 1.0
                    if next_sample < now:
                        next_sample = now + 1.0
                    if s is None:
                        window.unreachable += 1
                    else:
                        window.samples.append(s)
                        for key, count in s["waits"].items():
                            window.waits[key] = window.waits.get(key, 0) + count
                        window.wait_samples += 1
                    if (
                        s is not None
                        and phase == "drain"
                        and producer.proc.poll() is not None
                        and not s["pending"]
                        and not s["running"]
                    ):
                        window.t_end = now
                        break
                end = p_start + seconds
                if (
                    explain
                    and not explained
                    and phase not in ("warmup", "drain")
                    and now >= end - min(2.0, cfg.window_s)
                ):
                    with contextlib.suppress(psycopg.OperationalError):  # the server is down:
                        explains[phase] = _explain_claim(dsn, cfg.concurrency, cfg.lease_s)
                        explained = True  # else try again on the next turn
                warming = (
                    phase == "warmup" and fold.started_total == 0 and now < end + WARMUP_WAIT_S
                )
                # --quick (the smoke test's seconds): a phase also lasts until it did what it
                # is there for, on a loaded machine too: a pickup in it, and two kills in
                # worker-kill (a replacement worker can take seconds to start).
                short = (
                    cfg.quick
                    and phase not in ("warmup", "drain")
                    and now < end + WARMUP_WAIT_S
                    and (
                        not any(w.started for w in windows if w.phase == phase)
                        or (phase == "worker-kill" and len(killed) < 2)
                    )
                )
                if now >= end and not warming and not short:
                    window.t_end = now
                    break
                if now >= window.t_start + cfg.window_s:
                    window.t_end = now
                    _log_window(window, t0, JOB_TABLE[cfg.system][1])
                    k += 1
                    window = Window(phase, k, now)
                    windows.append(window)
                    fold.window = window
                    next_sample = now
                time.sleep(0.05)
            _log_window(window, t0, JOB_TABLE[cfg.system][1])
            if explain and not explained and phase not in ("warmup", "drain"):
                # The server was down for the phase's last seconds (a crash): explain the claim
                # as soon as it is back.
                explains[phase] = _explain_when_up(dsn, cfg.concurrency, cfg.lease_s)
            for new in starting:  # a replacement still starting when the phase ends
                new.ready.wait(180)
                new.raise_error()
                workers.append(new.child)
                children.append(new.child)
            starting.clear()
            if disturbance is not None:
                info.update(disturbance.stop())
            if phase == "high-load":
                producer.send(f"RATE {rate}")
            info["seconds"] = round(time.time() - p_start, 3)
            phases_out.append(info)
        producer_result = fold.result(producer, 120)
        producer.close(30)
        producer = None
        for child in workers:
            child.send("STOP")
        worker_results = []
        for child in workers:
            worker_results.append(fold.result(child, 120))
            child.close(60)
        workers = []
        final = monitor.sample_or_none()
        if final is None:
            raise ChildError("the server cannot be reached after the drain")
        check = (
            check_peer_jobs(dsn, ids_file, cfg.system, effects=chaos)
            if peer
            else _check_runs(dsn, ids_file, effects=chaos)
        )
    finally:
        monitor.close()
        for child in [*workers, *(w.child for w in starting), *([producer] if producer else [])]:
            child.kill()
        with contextlib.suppress(OSError):
            ids_file.unlink()
    rows = [w.row(t0) for w in windows]
    for p in phases_out:
        h = Histogram()
        done = enq = 0
        secs = 0.0
        for w, r in zip(windows, rows, strict=True):
            if w.phase == p["phase"]:
                h.merge(w.lat)
                done += w.finished
                enq += w.enqueued
                secs += r["seconds"]
        last = [r for r in rows if r["phase"] == p["phase"]][-1]
        p["pickup"] = h.summary()
        p["completion_per_s"] = done / max(secs, 1e-9)
        p["enqueue_per_s"] = enq / max(secs, 1e-9)
        p["end"] = {
            "queue_depth": last["queue_depth"],
            "tables": last["tables"],
            "indexes": {k: v["bytes"] for k, v in (last["indexes"] or {}).items()},
            "oldest_xmin_age": last["oldest_xmin_age"],
        }
        p["waits"] = dict(
            sorted(
                _sum_waits(r["waits"] for r in rows if r["phase"] == p["phase"]).items(),
                key=lambda kv: -kv[1],
            )[:10]
        )
        p["explain_claim"] = explains.get(p["phase"])
        p["work"] = _phase_work(
            [s for w in windows if w.phase == p["phase"] for s in w.samples],
            done,
            last["index_tuples_read_per_scan"],
            p["explain_claim"],
        )
    cfg_out = asdict(cfg)
    result: dict[str, Any] = {
        "scenario": cfg.name,
        "system": cfg.system,
        "job_table": JOB_TABLE[cfg.system][1],
        "quick": cfg.quick,
        "offered_per_s": rate,
        "calibration": calibration,
        "phases": phases_out,
        "windows": rows,
        "runs": {
            **check,
            "producer_acknowledged": producer_result.get("enqueued"),
            "producer_errors": producer_result.get("errors"),
            # A killed worker sends no RESULT: its last EVENT's total (its last second is lost).
            "handler_starts": sum(int(r["starts"]) for r in worker_results)
            + sum(fold.starts_seen.get(c.name, 0) for c in killed),
            "handler_finishes": sum(int(r["finished"]) for r in worker_results),
        },
        "final": {
            "tables": final["tables"],
            "indexes": {k: v["bytes"] for k, v in final["indexes"].items()},
        },
        "workers": worker_results,
        "meta": {
            "config": cfg_out,
            "machine": machine_info(),
            "postgres": server.settings(),
            "loadavg_before": load_before,
            "loadavg_after": list(os.getloadavg()),
            "duration_s": time.time() - started_at,
            "database": dbname if cfg.keep_db else None,
        },
    }
    # Executions beyond one per completed run (lease takeovers; calibration runs included on
    # both sides), from the database: a SIGKILLed worker's own count of its starts dies with it.
    if peer:  # no executions table: the handler starts the workers counted
        result["runs"]["reexecutions"] = peer_reexecutions(result["runs"])
        result["runs"]["loop_restarts"] = sum(
            int(r.get("loop_restarts", 0)) for r in worker_results
        )
    else:
        result["runs"]["reexecutions"] = sum(check["execution_outcomes"].values()) - int(
            check["statuses"].get("completed", 0)
        )
    if not cfg.keep_db:
        server.drop_db(dbname)
    return result


def _claim_buffers(explain: str | None) -> list[int]:
    """Shared buffers (hit + read) of each claim in an EXPLAIN (BUFFERS) text: its top plan
    node's, one figure per variant (without the timers first, then with them)."""
    found = []
    for chunk in re.split(r"^-- with timers = .*$", explain or "", flags=re.M):
        for line in chunk.splitlines():
            m = re.search(r"Buffers: shared((?: \w+=\d+)+)", line)
            if m:
                counts = dict(kv.split("=") for kv in m.group(1).split())
                found.append(int(counts.get("hit", 0)) + int(counts.get("read", 0)))
                break
    return found


def _phase_work(
    samples: list[dict[str, Any]],
    completed: int,
    reads_at_end: dict[str, float],
    explain: str | None,
) -> dict[str, Any]:
    """Work a phase did, in counts the machine's load cannot move: shared buffers touched and
    transactions per completed run (the whole database; on Postgres 18 also without the
    monitor's own queries, `engine_buffers_per_run`), the share of `runs` updates that were
    HOT, index entries read per scan of every index in the phase's last window, and the shared
    buffers of one claim (its EXPLAIN)."""
    out: dict[str, Any] = {
        "buffers_per_run": None,
        "engine_buffers_per_run": None,  # without the monitor's own (Postgres 18)
        "monitor_buffers_per_run": None,
        "transactions_per_run": None,
        "runs_hot_update_share": None,
        "index_tuples_read_per_scan_at_end": reads_at_end,
        "claim_shared_buffers": _claim_buffers(explain),  # [without timers, with timers]
    }
    if len(samples) < 2:
        return out
    buffers = _grown(samples, lambda s: s.get("buffers"))
    if completed and buffers is not None:
        out["buffers_per_run"] = buffers / completed
        transactions = _grown(samples, lambda s: s.get("transactions"))
        out["transactions_per_run"] = None if transactions is None else transactions / completed
        monitor = _grown(samples, lambda s: s.get("monitor_buffers"))
        if monitor is not None:
            out["monitor_buffers_per_run"] = monitor / completed
            out["engine_buffers_per_run"] = (buffers - monitor) / completed
    updates = _grown(samples, lambda s: ((s.get("tables") or {}).get("runs") or {}).get("upd"))
    hot = _grown(samples, lambda s: ((s.get("tables") or {}).get("runs") or {}).get("hot_upd"))
    if updates and hot is not None:
        out["runs_hot_update_share"] = hot / updates
    return out


def _grown(samples: list[dict[str, Any]], read: Any) -> int | None:
    """How much a cumulative counter grew over the samples. A counter that went down was reset
    (crash recovery discards the statistics; a reconnected monitor is a new backend): from
    there it counts from 0, so its value is the growth since (what happened between the last
    sample before the reset and the reset is lost, at most a second)."""
    values = [v for v in (read(s) for s in samples) if v is not None]
    if len(values) < 2:
        return None
    return sum(b - a if b >= a else b for a, b in itertools.pairwise(values))


def _sum_waits(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for waits in items:
        for k, v in waits.items():
            out[k] = out.get(k, 0) + v
    return out


class _Starting:
    """A worker process started in the background: READY awaited, then told GO."""

    def __init__(self, child: Child) -> None:
        self.child = child
        self.ready = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._start, name=f"start-{child.name}", daemon=True).start()

    def _start(self) -> None:
        try:
            self.child.expect("READY", 180)
            self.child.send("GO")
        except BaseException as exc:  # the harness raises it when it takes the child in
            self.error = exc
        finally:
            self.ready.set()

    def raise_error(self) -> None:
        if self.error is not None:
            raise ChildError(f"{self.child.name} did not start: {self.error}")


def _kill_worker(victim: Child, fold: _Fold) -> None:
    """SIGKILL a worker process, then fold what it had sent before it died."""
    victim.kill()
    deadline = time.monotonic() + 5
    while victim.name not in fold.ended and time.monotonic() < deadline:
        fold.pump(victim)
        time.sleep(0.01)


def _check_runs(dsn: str, ids_file: Path, *, effects: bool = False) -> dict[str, Any]:
    """Every acknowledged enqueue must be a completed run: runs_lost counts those that are not.
    With `effects`, every completed run must have made its fenced effect exactly once."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE acked (id uuid PRIMARY KEY)")
        with conn.cursor().copy("COPY acked (id) FROM STDIN") as copy, ids_file.open() as f:
            for line in f:
                if line.strip():
                    copy.write_row((line.strip(),))
        row = conn.execute(
            "SELECT count(*), count(r.id), "
            "count(*) FILTER (WHERE r.status IS DISTINCT FROM 'completed') "
            "FROM acked a LEFT JOIN umt.runs r ON r.id = a.id"
        ).fetchone()
        assert row is not None
        statuses = dict(
            conn.execute(
                "SELECT status, count(*) FROM umt.runs WHERE task_name = %s GROUP BY status",
                (TASK,),
            ).fetchall()
        )
        outcomes = dict(
            conn.execute("SELECT outcome, count(*) FROM umt.executions GROUP BY outcome").fetchall()
        )
        completed = conn.execute(
            "SELECT count(*) FROM umt.runs r JOIN acked a ON a.id = r.id "
            "WHERE r.status = 'completed'"
        ).fetchone()
        fenced: dict[str, Any] = {}
        if effects:
            made = conn.execute(
                "SELECT count(*), count(DISTINCT run_id) FROM public.bench_effects"
            ).fetchone()
            missing = conn.execute(
                "SELECT count(*) FROM umt.runs r WHERE r.task_name = %s AND r.status = "
                "'completed' AND NOT EXISTS (SELECT 1 FROM public.bench_effects e "
                "WHERE e.run_id = r.id)",
                (TASK,),
            ).fetchone()
            assert made is not None
            assert missing is not None
            fenced = {
                "effects": int(made[0]),
                "effects_doubled": int(made[0]) - int(made[1]),
                "effects_missing": int(missing[0]),
            }
    return {
        **fenced,
        "acknowledged": int(row[0]),
        "found": int(row[1]),
        "runs_lost": int(row[2]),
        "completed": int(completed[0]) if completed else 0,
        "statuses": statuses,
        "execution_outcomes": outcomes,
    }


def _log_window(w: Window, t0: float, job_table: str = "runs") -> None:
    r = w.row(t0)
    p = r["pickup"]
    dead = (r["tables"] or {}).get(job_table, {}).get("dead")
    _log(
        f"  {r['phase']:<14} t={r['t_s']:7.1f}s enq {r['enqueue_per_s']:7.1f}/s "
        f"done {r['completion_per_s']:7.1f}/s p50 {_fmt(p['p50_ms'])} p99 {_fmt(p['p99_ms'])} "
        f"ms depth {r['queue_depth']} dead(runs) {dead}"
    )


# -- output -----------------------------------------------------------------------------------


CHAOS_KEYS = ("backend_kills", "restarts", "down_s", "worker_kills")


def _mb(n: Any) -> str:
    return "-" if n is None else f"{n / 1048576:.1f}"


def table(result: dict[str, Any]) -> str:
    jt = result.get("job_table", "runs")  # a peer's job table stands in for `runs`
    system = result.get("system", "umt")
    lines = [
        *([f"system {system} (job table {jt}, shown as runs)"] if system != "umt" else []),
        f"scenario {result['scenario']} (quick={result['quick']}), offered "
        f"{result['offered_per_s']:.0f} runs/s of 1-step runs; "
        f"{result['meta']['config']['workers']} worker process(es) x concurrency "
        f"{result['meta']['config']['concurrency']}",
        "",
        "per phase:",
        f"{'phase':<15}{'s':>7}{'offered/s':>10}{'enq/s':>8}{'done/s':>8}{'p50 ms':>10}"
        f"{'p95 ms':>10}{'p99 ms':>10}{'max ms':>10}{'depth':>8}{'dead runs':>10}"
        f"{'dead steps':>11}{'dead exec':>10}{'runs MB':>9}{'steps MB':>9}{'exec MB':>9}",
    ]
    for p in result["phases"]:
        t = p["end"]["tables"] or {}
        pk = p["pickup"]
        lines.append(
            f"{p['phase']:<15}{p['seconds']:>7.0f}{p['offered_per_s']:>10.0f}"
            f"{p['enqueue_per_s']:>8.0f}{p['completion_per_s']:>8.0f}{_fmt(pk['p50_ms']):>10}"
            f"{_fmt(pk['p95_ms']):>10}{_fmt(pk['p99_ms']):>10}{_fmt(pk['max_ms']):>10}"
            f"{p['end']['queue_depth'] or 0:>8}"
            f"{t.get(jt, {}).get('dead', '-'):>10}{t.get('steps', {}).get('dead', '-'):>11}"
            f"{t.get('executions', {}).get('dead', '-'):>10}"
            f"{_mb(t.get(jt, {}).get('total_bytes')):>9}"
            f"{_mb(t.get('steps', {}).get('total_bytes')):>9}"
            f"{_mb(t.get('executions', {}).get('total_bytes')):>9}"
        )
    lines += [
        "",
        "work per phase (counts, not times):",
        f"{'phase':<15}{'buffers/run':>12}{'w/o monitor':>12}{'xacts/run':>10}{'runs HOT':>9}"
        f"{'claim bufs':>11}"
        "  index entries read per scan (last window)",
    ]
    for p in result["phases"]:
        w = p.get("work") or {}
        reads = w.get("index_tuples_read_per_scan_at_end") or {}
        # The ready partitions' claim indexes are named by Postgres (ready_N_task_name_...).
        shown = ", ".join(
            f"{k.split('_task_name')[0]} {v:.0f}"
            for k, v in sorted(reads.items())
            if "claim" in k or (k.startswith("ready_") and "task_name" in k)
        )
        hot = w.get("runs_hot_update_share")
        lines.append(
            f"{p['phase']:<15}{_fmt(w.get('buffers_per_run')):>12}"
            f"{_fmt(w.get('engine_buffers_per_run')):>12}"
            f"{_fmt(w.get('transactions_per_run')):>10}"
            f"{'-' if hot is None else f'{hot:.0%}':>9}"
            f"{'/'.join(str(b) for b in w.get('claim_shared_buffers') or []) or '-':>11}"
            f"  {shown}"
        )
    runs = result["runs"]
    chaos = [
        f"{p['phase']}: " + ", ".join(f"{k} {p[k]}" for k in CHAOS_KEYS if p.get(k) is not None)
        for p in result["phases"]
        if any(p.get(k) is not None for k in CHAOS_KEYS)
    ]
    effects = (
        f"; {'fenced effects' if system == 'umt' else 'effects (no fencing)'} "
        f"{runs['effects']}, made twice {runs['effects_doubled']}, "
        f"missing {runs['effects_missing']}"
        if "effects" in runs
        else ""
    )
    lines += [
        "",
        *(["faults: " + "; ".join(chaos)] if chaos else []),
        f"runs: acknowledged {runs['acknowledged']}, completed {runs['completed']}, "
        f"lost {runs['runs_lost']}, re-executions {runs['reexecutions']}, "
        f"producer errors {runs['producer_errors']}{effects}"
        + (f", worker loop restarts {runs['loop_restarts']}" if "loop_restarts" in runs else "")
        + "; execution outcomes "
        f"{runs['execution_outcomes']}",
        "",
        "per window:",
        f"{'phase':<15}{'t s':>7}{'enq/s':>8}{'done/s':>8}{'p50 ms':>10}{'p95 ms':>10}"
        f"{'p99 ms':>10}{'depth':>8}{'dead runs':>10}{'dead steps':>11}{'runs MB':>9}"
        f"{'ready idx/scan':>15}{'queue idx/scan':>15}{'xmin age':>9}  top wait",
    ]
    for r in result["windows"]:
        t = r["tables"] or {}
        pk = r["pickup"]
        waits = [(k, v) for k, v in r["waits"].items() if "ClientRead" not in k]
        top = f"{waits[0][0]} ({waits[0][1] / max(r['wait_samples'], 1):.1f})" if waits else "-"
        per_scan = r["index_tuples_read_per_scan"]
        reads = per_scan.get("runs_claim_ready")
        # The claim index of the `ready` partitions (named by Postgres: ready_N_task_name_...).
        queue = max(
            (v for k, v in per_scan.items() if k.startswith("ready_") and "task_name" in k),
            default=None,
        )
        lines.append(
            f"{r['phase']:<15}{r['t_s']:>7.0f}{r['enqueue_per_s']:>8.0f}"
            f"{r['completion_per_s']:>8.0f}{_fmt(pk['p50_ms']):>10}{_fmt(pk['p95_ms']):>10}"
            f"{_fmt(pk['p99_ms']):>10}{r['queue_depth'] or 0:>8}"
            f"{t.get(jt, {}).get('dead', '-'):>10}{t.get('steps', {}).get('dead', '-'):>11}"
            f"{_mb(t.get(jt, {}).get('total_bytes')):>9}{_fmt(reads):>15}{_fmt(queue):>15}"
            f"{r['oldest_xmin_age'] or 0:>9}  {top}"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["windows"]
    t = [r["t_s"] + r["seconds"] / 2 for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax = axes[0]
    for key, label in (("p50_ms", "p50"), ("p95_ms", "p95"), ("p99_ms", "p99")):
        ax.plot(t, [r["pickup"][key] or float("nan") for r in rows], label=label)
    ax.set_yscale("log")
    ax.set_ylabel("pickup latency, ms")
    ax.legend(loc="upper left")
    ax = axes[1]
    ax.plot(t, [r["enqueue_per_s"] for r in rows], label="enqueued/s")
    ax.plot(t, [r["completion_per_s"] for r in rows], label="completed/s")
    ax.set_ylabel("runs/s")
    ax.legend(loc="upper left")
    ax = axes[2]
    ax.plot(t, [r["queue_depth"] or 0 for r in rows], label="queue depth (pending)")
    ax.set_ylabel("runs")
    ax.legend(loc="upper left")
    ax = axes[3]
    system = result.get("system", "umt")
    names = HOT_TABLES if system == "umt" else sorted((rows[-1]["tables"] or {}) if rows else {})
    for name in names:
        ax.plot(t, [((r["tables"] or {}).get(name) or {}).get("dead", 0) for r in rows], label=name)
    ax.set_ylabel("dead tuples")
    ax.set_xlabel("seconds")
    ax.legend(loc="upper left")
    for p in result["phases"]:
        for a in axes:
            a.axvline(p["t_s"], color="grey", linewidth=0.6, linestyle="--")
        axes[0].annotate(p["phase"], (p["t_s"], 1), xycoords=("data", "axes fraction"))
    fig.suptitle(
        f"{system}, scenario {result['scenario']}, offered {result['offered_per_s']:.0f}/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_scenario(result: dict[str, Any], folder: Path, json_path: Path | None) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    stem = "scenario_" + result["scenario"].replace("-", "_")
    if result.get("system", "umt") != "umt":
        stem += "_" + result["system"]
    text = json.dumps(result, indent=2, default=str)
    written = [folder / f"{stem}.json", folder / f"{stem}.txt"]
    written[0].write_text(text)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text)
    body = table(result)
    explains = [p for p in result["phases"] if p.get("explain_claim")]
    if explains:
        body += "\nclaim_runs under EXPLAIN (ANALYZE, BUFFERS), rolled back, near each phase end:\n"
        for p in explains:
            body += f"\n-- {p['phase']}\n{p['explain_claim']}\n"
    written[1].write_text(body)
    print(table(result))
    try:
        plot(result, folder / f"{stem}.png")
        written.append(folder / f"{stem}.png")
    except ImportError:
        _log("plot skipped: matplotlib is not installed (pip install -e '.[bench]')")
    return written
