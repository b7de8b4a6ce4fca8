"""Cost as the work grows: enqueue and drain with 1, 2, 4, 8 processes (issue 27, part 2).

For each count N of processes (`--processes`, default 1,2,4,8), three workloads, each on a
fresh database of the same server:

- `enqueue`: N producer processes (`bench/_curve_child.py`, each its own engine, a pool of 4
  connections, single `engine.enqueue` calls with 64 in flight) store `--enqueue-runs` runs
  between them; runs/s is all the runs over the window from the first producer's start to
  the last one's end.
- `drain_1step`, `drain_10step`: `--drain1-runs` 1-step / `--drain10-runs` 10-step runs of
  no-op steps are enqueued beforehand (`enqueue_many`, not measured), then N worker processes
  (`bench/_umt_child.py work`, as `python -m bench` drains: each its own engine with one
  connection, 16 slots, LISTEN on; `--listen 0`: off, a poll every `--poll` s) drain them;
  runs/s is the runs over the window from the first handler's start to the moment the
  monitor sees them all completed.

Repetitions are interleaved (every workload at every N, then again), `--repeats` times;
figures are medians with min-max. Beside runs/s, which a shared machine moves, each point
reports work the machine's load moves little, per run:

- client CPU ms: the sum over the N processes of user + system CPU (`time.process_time`),
  from GO to the end of their work;
- server CPU ms: the postmaster and all its processes (/proc; exited backends through the
  postmaster's reaped-children times), over the same window, the monitor's session taken off;
  only when the server's data directory is readable here (the bench's own embedded server
  is), else null;
- server transactions (`pg_stat_database`, the monitor's polls taken off), statements and
  shared buffers hit + read (`pg_stat_statements`, the monitor's statements left out; null
  without it), WAL bytes (`pg_current_wal_lsn`), each over the whole point (processes'
  start and stop included);
- cores busy: the whole machine's busy CPU time over the window (/proc/stat) in cores, and
  the part of it that was this point's (client + server CPU).

After each point the bench checks that every run was stored exactly once (enqueue: one run per
input, every input once) or completed exactly once (drains: every run completed, one
execution each, the handlers started once per run in all, every step recorded), and exits 1
when one is not.

    python -m bench.worker_curve [--database-url URL] [--processes 1,2,4,8] [--repeats 3]
        [--enqueue-runs 5000] [--drain1-runs 4000] [--drain10-runs 800] [--json PATH]
        [--workloads enqueue,drain_1step,drain_10step] [--listen 0|1] [--poll S]
    python -m bench.worker_curve --quick   # a smoke check: 2 processes, a few hundred runs

Output: a table on stdout, `bench/results/worker_curve.json` (or `--json`) and, with
matplotlib, `worker_curve.png` beside it. Every database it makes is dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from bench._infra import BENCH_DIR, MONITOR_TAG, Child, ChildError, Server, machine_info, summary
from umt_backend_pg import migrate

SCHEMA = "umt"
DB = "bench_curve"
TICK = os.sysconf("SC_CLK_TCK")
WORKLOADS = ("enqueue", "drain_1step", "drain_10step")
FIGURES = (
    "runs_per_s",
    "client_cpu_ms_per_run",
    "server_cpu_ms_per_run",
    "xact_per_run",
    "statements_per_run",
    "buffers_per_run",
    "wal_bytes_per_run",
    "cores_busy",
    "cores_ours",
)
WORKER_CONCURRENCY = 16
PRODUCER_CONNS = 4
OUTSTANDING = 64


def _log(message: str) -> None:
    print(f"[curve] {message}", file=sys.stderr, flush=True)


# -- CPU, from /proc -------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (/proc/stat, all cores)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal
    return (total - idle) / TICK, total / TICK


class ServerCpu:
    """CPU seconds used by a local Postgres: the postmaster, its live processes, and the ones
    that exited (the postmaster reaps them: their times are in its cutime/cstime)."""

    def __init__(self, postmaster: int | None) -> None:
        self.postmaster = postmaster

    @classmethod
    def find(cls, server: Server) -> ServerCpu:
        try:
            with server.connect() as conn:
                row = conn.execute("SHOW data_directory").fetchone()
            pid = int(Path(str(row[0]), "postmaster.pid").read_text().split()[0]) if row else 0
            _stat_fields(pid)
        except (OSError, ValueError, IndexError, psycopg.Error):
            return cls(None)
        return cls(pid)

    def seconds(self) -> float | None:
        if self.postmaster is None:
            return None
        fields = _stat_fields(self.postmaster)
        # fields[1] is the state; utime, stime, cutime, cstime are the 14th-17th of the line.
        total = sum(int(v) for v in fields[11:15])
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                child = _stat_fields(int(entry.name))
                if int(child[1]) == self.postmaster:
                    total += int(child[11]) + int(child[12])
        return total / TICK


# -- counters --------------------------------------------------------------------------------------


def _buffers(server: Server, dbname: str) -> int | None:
    """Shared buffers hit + read by the statements of `dbname` (the monitor's left out)."""
    if not server.statements:
        return None
    with server.connect() as conn:
        row = conn.execute(
            "SELECT coalesce(sum(s.shared_blks_hit + s.shared_blks_read), 0) "
            "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
            "WHERE d.datname = %s AND s.query NOT LIKE %s",
            (dbname, f"%{MONITOR_TAG}%"),
        ).fetchone()
    return int(row[0]) if row else None


class Window:
    """CPU of the machine and of the server from GO to the end of the work."""

    def __init__(self, server_cpu: ServerCpu) -> None:
        self.server_cpu = server_cpu
        self.machine0 = _machine_cpu()
        self.server0 = server_cpu.seconds()
        self.t0 = time.time()
        self.seconds = 0.0
        self.machine_busy = 0.0
        self.server_s: float | None = None

    def close(self, *, monitor_pid: int | None = None) -> None:
        """End the window while the sessions of the work still live (a session that ended
        may not be in its postmaster's reaped times yet); `monitor_pid`, the backend of the
        harness's monitor (started inside the window), is taken off."""
        self.seconds = max(time.time() - self.t0, 1e-9)
        busy, _ = _machine_cpu()
        self.machine_busy = busy - self.machine0[0]
        server1 = self.server_cpu.seconds()
        if self.server0 is not None and server1 is not None:
            monitor = 0.0
            if monitor_pid is not None:
                with contextlib.suppress(OSError, IndexError, ValueError):
                    fields = _stat_fields(monitor_pid)
                    monitor = (int(fields[11]) + int(fields[12])) / TICK
            self.server_s = server1 - self.server0 - monitor


def _figures(
    runs: int,
    rate: float,
    client_cpu_s: float,
    window: Window,
    work: dict[str, Any],
    buffers: int | None,
) -> dict[str, Any]:
    server_s = window.server_s
    return {
        "runs_per_s": rate,
        "client_cpu_ms_per_run": 1000 * client_cpu_s / runs,
        "server_cpu_ms_per_run": None if server_s is None else 1000 * server_s / runs,
        "xact_per_run": work["xact"] / runs,
        "statements_per_run": (None if work["statements"] is None else work["statements"] / runs),
        "buffers_per_run": None if buffers is None else buffers / runs,
        "wal_bytes_per_run": work["wal_bytes"] / runs,
        "cores_busy": window.machine_busy / window.seconds,
        "cores_ours": (client_cpu_s + (server_s or 0.0)) / window.seconds,
        "window_s": window.seconds,
        "loadavg_1m": os.getloadavg()[0],
    }


# -- the points ------------------------------------------------------------------------------------


class Curve:
    def __init__(self, server: Server, args: argparse.Namespace) -> None:
        self.server = server
        self.args = args
        self.server_cpu = ServerCpu.find(server)
        self.failures: list[str] = []

    def _fresh(self) -> str:
        url = self.server.fresh_db(DB)
        asyncio.run(migrate(url, schema=SCHEMA))
        return url

    def enqueue(self, procs: int) -> dict[str, Any]:
        n = self.args.enqueue_runs
        url = self._fresh()
        self.server.wait_idle(DB)
        before, buf0 = self.server.counters(DB), _buffers(self.server, DB)
        share, extra = divmod(n, procs)
        children: list[Child] = []
        try:
            first = 0
            for i in range(procs):
                count = share + (1 if i < extra else 0)
                argv = [sys.executable, "-m", "bench._curve_child", "--dsn", url]
                argv += ["--first", str(first), "--n", str(count)]
                argv += ["--outstanding", str(OUTSTANDING), "--conns", str(PRODUCER_CONNS)]
                children.append(Child(argv, name=f"producer-{i + 1}"))
                first += count
            for child in children:
                child.expect("READY", 180)
            window = Window(self.server_cpu)
            for child in children:
                child.send("GO")
            results = [child.expect("RESULT", self.args.timeout) for child in children]
            window.close()
            for child in children:
                child.send("STOP")
            for child in children:
                child.close(60)
            children = []
        finally:
            for child in children:
                child.kill()
        self.server.wait_idle(DB)
        after, buf1 = self.server.counters(DB), _buffers(self.server, DB)
        work = self.server.work_delta(before, after, monitor_xacts=0)
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*), count(DISTINCT input), min(input::int), max(input::int) "
                "FROM umt.runs WHERE task_name = 'bench_curve_enqueued'"
            ).fetchone()
        assert row is not None
        check = {"stored": int(row[0]), "distinct_inputs": int(row[1])}
        ok = check["stored"] == check["distinct_inputs"] == n and (row[2], row[3]) == (0, n - 1)
        span = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
        cpu = sum(float(r["cpu_s"]) for r in results)
        buffers = None if buf0 is None or buf1 is None else buf1 - buf0
        return self._done("enqueue", procs, n, n / span, cpu, window, work, buffers, check, ok)

    def drain(self, procs: int, k: int) -> dict[str, Any]:
        n = self.args.drain1_runs if k == 1 else self.args.drain10_runs
        url = self._fresh()
        asyncio.run(_enqueue_many(url, n, k))
        self.server.wait_idle(DB)
        before, buf0 = self.server.counters(DB), _buffers(self.server, DB)
        workers: list[Child] = []
        polls = 0
        try:
            for wid in range(1, procs + 1):
                argv = [sys.executable, "-m", "bench._umt_child", "work", "--dsn", url]
                argv += ["--conns", "1", "--concurrency", str(WORKER_CONCURRENCY)]
                argv += ["--listen", str(self.args.listen), "--poll", str(self.args.poll)]
                argv += ["--wid", str(wid)]
                workers.append(Child(argv, name=f"worker-{wid}"))
            for child in workers:
                child.expect("READY", 180)
            window = Window(self.server_cpu)
            for child in workers:
                child.send("GO")
            query = (
                f"SELECT d AS {MONITOR_TAG} FROM (SELECT count(*) FROM umt.runs "
                "WHERE status = 'completed') AS m (d)"
            )
            with psycopg.connect(url, autocommit=True) as mon:
                while True:
                    row = mon.execute(query).fetchone()
                    polls += 1
                    if row is not None and int(row[0]) >= n:
                        t_end = time.time()
                        break
                    if time.time() - window.t0 > self.args.timeout:
                        raise ChildError(f"drain of {n} runs not done in {self.args.timeout} s")
                    for child in workers:
                        if child.proc.poll() is not None:
                            raise ChildError(f"{child.name} died\n{child.stderr_tail()}")
                    time.sleep(0.02)
                window.close(monitor_pid=mon.info.backend_pid)
            for child in workers:
                child.send("STOP")
            results = [child.expect("RESULT", 120) for child in workers]
            for child in workers:
                child.close(60)
            workers = []
        finally:
            for child in workers:
                child.kill()
        self.server.wait_idle(DB)
        after, buf1 = self.server.counters(DB), _buffers(self.server, DB)
        work = self.server.work_delta(before, after, monitor_xacts=polls)
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM umt.runs WHERE status = 'completed'), "
                "(SELECT count(*) FROM umt.runs), "
                "(SELECT count(*) FROM umt.executions), "
                "(SELECT count(DISTINCT run_id) FROM umt.executions), "
                "(SELECT count(*) FROM umt.steps)"
            ).fetchone()
        assert row is not None
        handled = sum(int(r["count"]) for r in results)
        check = {
            "completed": int(row[0]),
            "runs": int(row[1]),
            "executions": int(row[2]),
            "runs_executed": int(row[3]),
            "steps": int(row[4]),
            "handler_starts": handled,
        }
        ok = (
            check["completed"] == check["runs"] == n
            and check["executions"] == check["runs_executed"] == n
            and check["handler_starts"] == n
            and check["steps"] == n * k
        )
        starts = [float(r["first_start"]) for r in results if r.get("first_start")]
        span = max(t_end - (min(starts) if starts else window.t0), 1e-9)
        cpu = sum(float(r["cpu_s"]) for r in results)
        buffers = None if buf0 is None or buf1 is None else buf1 - buf0
        key = "drain_1step" if k == 1 else "drain_10step"
        return self._done(key, procs, n, n / span, cpu, window, work, buffers, check, ok)

    def _done(
        self,
        workload: str,
        procs: int,
        n: int,
        rate: float,
        cpu: float,
        window: Window,
        work: dict[str, Any],
        buffers: int | None,
        check: dict[str, int],
        ok: bool,
    ) -> dict[str, Any]:
        self.server.drop_db(DB)
        out = {"workload": workload, "processes": procs, "runs": n}
        out |= _figures(n, rate, cpu, window, work, buffers)
        out |= {"check": check, "exactly_once": ok, "work": work}
        if not ok:
            self.failures.append(f"{workload} x{procs}: {check}")
        server_ms = out["server_cpu_ms_per_run"]
        _log(
            f"  {workload:<13} x{procs}  {rate:8.1f} runs/s"
            f"  client {out['client_cpu_ms_per_run']:.3f} ms/run"
            f"  server {'-' if server_ms is None else f'{server_ms:.3f}'} ms/run"
            f"  {out['xact_per_run']:.2f} xact/run  {out['wal_bytes_per_run']:,.0f} WAL B/run"
            f"  cores {out['cores_ours']:.2f}/{out['cores_busy']:.2f}  exactly once: {ok}"
        )
        return out


async def _enqueue_many(url: str, n: int, k: int) -> None:
    from bench._umt_child import REGISTRY, bench_drain
    from umt_sdk import connect

    engine = await connect(url, registry=REGISTRY, run_migrations=False, listen=False)
    try:
        for start in range(0, n, 1000):
            await engine.enqueue_many(bench_drain, [k] * min(1000, n - start))
    finally:
        await engine.close()


# -- the report ------------------------------------------------------------------------------------


def _fold(points: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {f: summary([p.get(f) for p in points]) for f in FIGURES}
    out["runs"] = points[0]["runs"]
    out["exactly_once"] = all(p["exactly_once"] for p in points)
    out["repetitions"] = points
    return out


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(result: dict[str, Any]) -> str:
    lines = []
    heads = (
        "| workload | processes | runs/s | x N=1 | client CPU ms/run | server CPU ms/run "
        "| xact/run | statements/run | buffers/run | WAL B/run | cores ours / busy |"
    )
    lines += [heads, "|" + "---|" * heads.count(" | ") + "---|"]
    for workload in WORKLOADS:
        points = result["curve"].get(workload, {})
        base = points.get("1", {}).get("runs_per_s", {}).get("median")
        for procs_key, fig in points.items():
            rate = fig["runs_per_s"]
            scale = rate["median"] / base if base and rate["median"] else None
            lines.append(
                f"| {workload} | {procs_key} "
                f"| {_fmt(rate['median'], 0)} [{_fmt(rate['min'], 0)}-{_fmt(rate['max'], 0)}] "
                f"| {_fmt(scale, 2)} "
                f"| {_fmt(fig['client_cpu_ms_per_run']['median'], 3)} "
                f"| {_fmt(fig['server_cpu_ms_per_run']['median'], 3)} "
                f"| {_fmt(fig['xact_per_run']['median'], 2)} "
                f"| {_fmt(fig['statements_per_run']['median'], 2)} "
                f"| {_fmt(fig['buffers_per_run']['median'], 1)} "
                f"| {_fmt(fig['wal_bytes_per_run']['median'], 0)} "
                f"| {_fmt(fig['cores_ours']['median'], 2)} "
                f"/ {_fmt(fig['cores_busy']['median'], 2)} |"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        _log("plot skipped: matplotlib is not installed (pip install -e '.[bench]')")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: tuple[tuple[str, str], ...] = (
        ("runs_per_s", "runs/s"),
        ("client_cpu_ms_per_run", "client CPU ms/run"),
        ("server_cpu_ms_per_run", "server CPU ms/run"),
        ("xact_per_run", "server xact/run"),
        ("wal_bytes_per_run", "WAL bytes/run"),
        ("cores_busy", "machine cores busy"),
    )
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        for workload in WORKLOADS:
            points = result["curve"].get(workload, {})
            xs = [int(p) for p in points]
            ys = [points[p][key]["median"] for p in points]
            if xs and all(y is not None for y in ys):
                ax.plot(xs, ys, marker="o", label=workload)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("processes")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle(f"umt: cost as the work grows ({result['machine'].get('cpu_count')} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _result(
    points: dict[str, dict[int, list[dict[str, Any]]]],
    procs: list[int],
    args: argparse.Namespace,
    curve: Curve,
    server: Server,
    repeats_done: int,
) -> dict[str, Any]:
    return {
        "curve": {w: {str(p): _fold(reps) for p, reps in by.items()} for w, by in points.items()},
        "config": {
            "processes": procs,
            "repeats": args.repeats,
            "repeats_done": repeats_done,
            "enqueue_runs": args.enqueue_runs,
            "drain1_runs": args.drain1_runs,
            "drain10_runs": args.drain10_runs,
            "worker_concurrency": WORKER_CONCURRENCY,
            "worker_connections": 1,
            "worker_listen": bool(args.listen),
            "worker_poll_s": args.poll,
            "producer_connections": PRODUCER_CONNS,
            "producer_outstanding": OUTSTANDING,
        },
        "exactly_once": not curve.failures,
        "failures": curve.failures,
        "settings": server.settings(),
        "server_cpu_measured": curve.server_cpu.postmaster is not None,
        "notes": server.notes,
        "machine": machine_info(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--processes", default=None, help="comma-separated, default 1,2,4,8")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--enqueue-runs", type=int, default=None)
    parser.add_argument("--drain1-runs", type=int, default=None)
    parser.add_argument("--drain10-runs", type=int, default=None)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--listen", type=int, choices=(0, 1), default=1, help="workers LISTEN")
    parser.add_argument("--poll", type=float, default=1.0, help="workers' poll interval, s")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a point may take")
    parser.add_argument("--quick", action="store_true", help="a smoke check: 2 processes")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    defaults = (
        {"processes": "2", "repeats": 1, "enqueue_runs": 200, "drain1_runs": 200}
        | {"drain10_runs": 40}
        if args.quick
        else {"processes": "1,2,4,8", "repeats": 3, "enqueue_runs": 5000}
        | {"drain1_runs": 4000, "drain10_runs": 800}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    procs = [int(p) for p in str(args.processes).split(",")]
    workloads = args.workloads.split(",")
    if not workloads or not set(workloads) <= set(WORKLOADS):
        parser.error(f"--workloads: a comma-separated subset of {','.join(WORKLOADS)}")
    if args.repeats < 1 or min(procs) < 1:
        parser.error("--repeats and every process count must be at least 1")
    if min(args.enqueue_runs, args.drain1_runs, args.drain10_runs) < max(procs):
        parser.error("every workload needs at least one run per process")
    # `timeout` ends us with SIGTERM: exit through the finally blocks and atexit, which kill
    # the processes, drop the database and stop the bench's own server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = Server.start(args.database_url)
    curve = Curve(server, args)
    steps: list[tuple[str, Callable[[int], dict[str, Any]]]] = [
        ("enqueue", curve.enqueue),
        ("drain_1step", lambda p: curve.drain(p, 1)),
        ("drain_10step", lambda p: curve.drain(p, 10)),
    ]
    steps = [(w, run) for w, run in steps if w in workloads]
    points: dict[str, dict[int, list[dict[str, Any]]]] = {w: {} for w in workloads}
    out = args.json or BENCH_DIR / "results" / "worker_curve.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for rep in range(args.repeats):
            _log(f"repetition {rep + 1}/{args.repeats}")
            for workload, run in steps:
                for p in procs:
                    points[workload].setdefault(p, []).append(run(p))
            # Written after every repetition: a run cut short keeps what it measured.
            result = _result(points, procs, args, curve, server, rep + 1)
            out.write_text(json.dumps(result, indent=2))
    finally:
        server.drop_db(DB)
    print(table(result))
    print(f"results: {out}")
    if plot(result, out.with_suffix(".png")):
        print(f"plot: {out.with_suffix('.png')}")
    if curve.failures:
        print("runs not stored or completed exactly once: " + "; ".join(curve.failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
