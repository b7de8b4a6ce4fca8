"""`python -m bench`: umt against a raw psycopg ceiling, DBOS, pgqueuer and procrastinate.

Every system runs on the same Postgres (an embedded one in a temp dir, or --database-url), in
a fresh database of its own, with several repetitions interleaved (A B A B ...); figures are
medians with min-max. Peers run as subprocesses of their own virtualenv (see
bench/requirements-peers.txt), never as project dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench._infra import BENCH_DIR, Server, machine_info
from bench._peers import PEERS, default_venv, prepare
from bench._report import markdown, plots, targets
from bench._scenario import SCENARIOS, SYSTEMS, ScenarioConfig, run_scenario, write_scenario
from bench._workloads import Config, Runner

__all__ = ["KEYS", "main"]

KEYS = (
    "raw_ceiling",
    "drain_1step",
    "drain_10step",
    "db_work_per_step",
    "client_cpu_per_step_ms",
    "enqueue_to_start_ms",
    "claim_ms_foreign_backlog",
    "recovery_after_sigkill_s",
    "memory_backend_runs_per_s",
)


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, under 2 minutes")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    p.add_argument("--database-url", help="use this server (default: embedded, temp dir)")
    p.add_argument("--umt-only", action="store_true", help="skip the peers (no installs)")
    p.add_argument("--reps", type=int, help="repetitions (default 3, quick 2)")
    p.add_argument("--workers", type=int, help="worker processes, 1 connection each (2)")
    p.add_argument(
        "--backlog",
        type=int,
        help="foreign pending runs for the claim test (default 200,000; quick 50,000)",
    )
    p.add_argument("--results-dir", type=Path, default=BENCH_DIR / "results")
    p.add_argument(
        "--peers-venv",
        type=Path,
        default=None,
        help="the peers' virtualenv (default .venv-bench-peers)",
    )
    p.add_argument(
        "--no-install-peers",
        action="store_true",
        help="use the peers' virtualenv as it is, install nothing",
    )
    p.add_argument("--only", default="", help=f"comma list of keys: {', '.join(KEYS)}")
    s = p.add_argument_group(
        "long-horizon scenarios",
        "--scenario NAME runs one scenario instead of the figures above (see bench/_scenario.py)",
    )
    s.add_argument("--scenario", choices=sorted(SCENARIOS), help="run this scenario")
    s.add_argument(
        "--system",
        choices=SYSTEMS,
        default="umt",
        help="the system run through it: umt, or a peer from the peers' virtualenv (needs --rate)",
    )
    s.add_argument(
        "--rate",
        type=float,
        help="offered runs/s (default: 70%% of a drain rate measured first; quick caps it at 100)",
    )
    s.add_argument("--warmup-seconds", type=float, help="warmup phase (30; quick 1)")
    s.add_argument("--clean-seconds", type=float, help="clean baseline before the stress (120; 3)")
    s.add_argument(
        "--phase-seconds", type=float, help="the stress phase, or clean for `clean` (300; 3)"
    )
    s.add_argument("--recovery-seconds", type=float, help="recovery phase (120; 3)")
    s.add_argument("--window-seconds", type=float, help="histogram window (10; quick 1)")
    s.add_argument("--concurrency", type=int, help="slots per worker process (32)")
    s.add_argument("--worker-conns", type=int, help="pool size per worker (engine default)")
    s.add_argument("--lease", type=float, help="lease seconds (10)")
    s.add_argument("--high-load-multiplier", type=float, help="high-load rate factor (1.5)")
    s.add_argument("--readers", type=int, help="active-readers connections (4)")
    s.add_argument("--reader-tx-seconds", type=float, help="each reader's transaction (10)")
    s.add_argument(
        "--backend-kill-every", type=float, help="pg-backend-kill: seconds between kills (0.25)"
    )
    s.add_argument("--restarts", type=int, help="postgres-restart: crashes in the phase (2; 1)")
    s.add_argument(
        "--worker-kill-every", type=float, help="repeated-kill: seconds between kills (20; 1.5)"
    )
    s.add_argument("--keep-db", action="store_true", help="keep the scenario's database")
    s.add_argument("--no-explain", action="store_true", help="skip the claim EXPLAIN per phase")
    return p


def _work_node(entry: Any) -> dict[str, Any]:
    if not isinstance(entry, dict) or "missing" in entry:
        return {
            "missing": entry.get("missing", "not run") if isinstance(entry, dict) else "not run"
        }
    keys = (
        "xact_per_step",
        "statements_per_step",
        "wal_bytes_per_step",
        "xact_per_run",
        "statements_per_run",
        "wal_bytes_per_run",
        "rows_written_per_run",
    )
    return {k: entry.get(k) for k in keys}


def run(args: argparse.Namespace) -> dict[str, Any]:
    only = {k.strip() for k in args.only.split(",") if k.strip()}
    unknown = only - set(KEYS)
    if unknown:
        raise SystemExit(f"unknown --only keys: {', '.join(sorted(unknown))}")
    cfg = Config.make(
        args.quick,
        reps=args.reps,
        workers=args.workers,
        umt_only=args.umt_only,
        only=only,
        backlog=args.backlog,
    )
    load_before = list(os.getloadavg())
    started = time.time()
    if args.umt_only:
        peers_python, peer_status = None, {p: {"missing": "skipped (--umt-only)"} for p in PEERS}
    else:
        peers_python, peer_status = prepare(
            args.peers_venv or default_venv(), install=not args.no_install_peers
        )
    _log("starting Postgres" if not args.database_url else "using --database-url")
    server = Server.start(args.database_url)
    runner = Runner(server, cfg, peers_python, peer_status)
    results: dict[str, Any] = {}

    def want(*keys: str) -> bool:
        return not only or any(k in only for k in keys)

    if want(
        "raw_ceiling", "drain_1step", "drain_10step", "db_work_per_step", "client_cpu_per_step_ms"
    ):
        results.update(runner.drains())
        d10 = results.get("drain_10step", {})
        results["db_work_per_step"] = {
            "source": "drain_10step; server counters of the system's own database "
            "(pg_stat_database, pg_stat_statements, pg_current_wal_lsn deltas) "
            "from the start of the workers to their exit",
            "umt": _work_node(d10.get("umt")),
            "dbos": _work_node(d10.get("dbos")),
        }
        cpu: dict[str, Any] = {
            "source": "drain_10step; process CPU of the worker processes from GO to STOP / steps"
        }
        for name in ("umt", "dbos"):
            entry = d10.get(name, {})
            cpu[name] = (
                entry.get("client_cpu_ms_per_step")
                if "missing" not in entry
                else {"missing": entry["missing"]}
            )
        results["client_cpu_per_step_ms"] = cpu
    sections = (
        ("enqueue_to_start_ms", runner.enqueue_to_start),
        ("claim_ms_foreign_backlog", runner.claim_backlog),
        ("recovery_after_sigkill_s", runner.recovery),
        ("memory_backend_runs_per_s", runner.memory),
    )
    for key, measure in sections:
        if not want(key):
            continue
        try:
            results[key] = measure()
        except Exception as exc:  # report the failure, keep the other figures
            _log(f"{key} failed: {exc!r}")
            results[key] = {"error": repr(exc)}
    machine = machine_info()
    results["meta"] = {
        "quick": cfg.quick,
        "reps": cfg.reps,
        "workers": cfg.workers,
        "worker_concurrency": cfg.concurrency,
        "machine": machine,
        "postgres": server.settings(),
        "loadavg_before": load_before,
        "loadavg_after": list(os.getloadavg()),
        "duration_s": time.time() - started,
        "peers": peer_status,
        "config": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(cfg).items()},
        "notes": server.notes,
    }
    results["targets"] = targets(results)
    return results


def write(results: dict[str, Any], args: argparse.Namespace) -> None:
    folder: Path = args.results_dir
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, default=str)
    (folder / "results.json").write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    claim = results.get("claim_ms_foreign_backlog", {})
    if "explain_umt" in claim:
        (folder / "claim_explain.txt").write_text(
            "-- umt claim_runs, pair A, with the foreign backlog\n"
            + claim["explain_umt"]
            + "\n\n-- replaced engine's available_at-ordered claim, same data\n"
            + claim.get("explain_legacy", "")
            + "\n"
        )
    try:
        names = plots(results, folder)
        note = f"Plots: {', '.join(names)}"
    except ImportError:
        note = (
            "Plots skipped: matplotlib is not installed "
            "(pip install -e '.[bench]', or `make bench`)"
        )
    md = markdown(results) + "\n" + note + "\n"
    (folder / "results.md").write_text(md)
    print(md)
    _log(f"wrote {folder / 'results.md'}" + (f" and {args.json}" if args.json else ""))


def scenario(args: argparse.Namespace) -> int:
    cfg = ScenarioConfig.make(
        args.scenario,
        args.quick,
        rate=args.rate,
        warmup_s=args.warmup_seconds,
        clean_s=args.clean_seconds,
        phase_s=args.phase_seconds,
        recovery_s=args.recovery_seconds,
        window_s=args.window_seconds,
        workers=args.workers,
        concurrency=args.concurrency,
        worker_conns=args.worker_conns,
        lease_s=args.lease,
        high_load_multiplier=args.high_load_multiplier,
        readers=args.readers,
        reader_tx_s=args.reader_tx_seconds,
        backend_kill_every_s=args.backend_kill_every,
        restarts=args.restarts,
        worker_kill_every_s=args.worker_kill_every,
        keep_db=args.keep_db or None,
        explain=False if args.no_explain else None,
    )
    if args.system != "umt":
        python, status = prepare(
            args.peers_venv or default_venv(), install=not args.no_install_peers
        )
        if python is None or "missing" in status.get(args.system, {}):
            raise SystemExit(f"--system {args.system}: {status.get(args.system)}")
        cfg.system = args.system
        cfg.peers_python = str(python)
    _log("starting Postgres" if not args.database_url else "using --database-url")
    server = Server.start(args.database_url)
    result = run_scenario(server, cfg)
    written = write_scenario(result, args.results_dir, args.json)
    _log("wrote " + ", ".join(str(p) for p in written))
    runs = result["runs"]
    broken = runs["runs_lost"] or runs.get("effects_doubled") or runs.get("effects_missing")
    # A peer's lost runs and doubled effects are what it is measured for, not a failure.
    return 1 if broken and cfg.system == "umt" else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.scenario:
        return scenario(args)
    results = run(args)
    write(results, args)
    return 0
