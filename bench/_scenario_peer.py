"""The peers (pgqueuer, procrastinate) in the long-horizon scenarios: `--system NAME`.

The harness (bench/_scenario.py) runs a peer exactly as it runs umt: the same open-loop
producer schedule, the same faults (the backend killer terminates any client session of the
scenario's database but the harness's own `bench_*` ones, so the peer's; SIGKILL of a worker
process; the server crashed and restarted), the same windows and monitor (on the peer's own
tables). The processes are bench/peers/scenario_peer.py, in the peers' virtualenv.

What is counted after the drain, from the peer's own tables and the effect ledger:
- completed: pgqueuer, a `pgqueuer_log` row with status `successful` (a finished job is deleted
  from `pgqueuer` and logged); procrastinate, `procrastinate_jobs.status = 'succeeded'` (the
  worker keeps finished jobs: `delete_jobs="never"`);
- runs_lost: acknowledged job ids not completed (a job whose handler failed, or still queued);
- effects: rows of `public.bench_effects (run_id bigint)`, one per execution that got to its
  effect; `effects_doubled` = rows beyond one per job, `effects_missing` = completed jobs
  without a row. The peers have no fencing token, so a job run again after a fault makes its
  effect again: doubles are expected, and are what the comparison shows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from bench._infra import Child

__all__ = ["check_peer_jobs", "install_peer", "peer_argv", "peer_reexecutions"]

SCRIPT = Path(__file__).resolve().parent / "peers" / "scenario_peer.py"

# Job ids of completed jobs, one row each, per peer.
_DONE = {
    "pgqueuer": "SELECT DISTINCT job_id AS id FROM public.pgqueuer_log WHERE status = 'successful'",
    "procrastinate": "SELECT id FROM public.procrastinate_jobs WHERE status = 'succeeded'",
}
# Every job id the peer knows of (queued, running, finished or failed).
_KNOWN = {
    "pgqueuer": "SELECT id FROM public.pgqueuer UNION SELECT job_id FROM public.pgqueuer_log",
    "procrastinate": "SELECT id FROM public.procrastinate_jobs",
}
# Jobs by state: the queue's own statuses (and, for pgqueuer, the log's, as `log:<status>`).
_STATUSES = {
    "pgqueuer": "SELECT status::text, count(*) FROM public.pgqueuer GROUP BY 1 UNION ALL "
    "SELECT 'log:' || status::text, count(DISTINCT job_id) FROM public.pgqueuer_log GROUP BY 1",
    "procrastinate": "SELECT status::text, count(*) FROM public.procrastinate_jobs GROUP BY 1",
}


def peer_argv(
    system: str,
    python: str,
    dsn: str,
    ids_file: Path,
    *,
    concurrency: int,
    lease_s: float,
    rate: float,
    producer_conns: int,
    worker_conns: int = 0,
    effect: bool = False,
) -> tuple[list[str], list[str]]:
    """The worker's and the producer's command lines for a peer."""
    if system not in _DONE:
        raise SystemExit(f"unknown system {system!r}: umt, {', '.join(sorted(_DONE))}")
    if not python:
        raise SystemExit(f"--system {system}: no peers' virtualenv (see --peers-venv)")
    base = [python, str(SCRIPT)]
    worker = [
        *base,
        "work",
        "--system",
        system,
        "--dsn",
        dsn,
        "--concurrency",
        str(concurrency),
        "--lease",
        str(lease_s),
        *(["--pool", str(worker_conns)] if worker_conns else []),
        *(["--effect"] if effect else []),
    ]
    producer = [
        *base,
        "produce",
        "--system",
        system,
        "--dsn",
        dsn,
        "--rate",
        str(rate),
        "--conns",
        str(producer_conns),
        "--ids",
        str(ids_file),
    ]
    return worker, producer


def install_peer(system: str, python: str, dsn: str) -> None:
    """The peer's schema in the scenario's database (its own installer)."""
    argv = [python, str(SCRIPT), "install", "--system", system, "--dsn", dsn]
    child = Child(argv, name="install")
    try:
        child.expect("RESULT", 180)
    finally:
        child.close(30)


def _copy_ids(conn: psycopg.Connection[Any], ids_file: Path) -> None:
    conn.execute("CREATE TEMP TABLE acked (id bigint PRIMARY KEY)")
    with conn.cursor().copy("COPY acked (id) FROM STDIN") as copy, ids_file.open() as f:
        for line in f:
            if line.strip():
                copy.write_row((int(line),))


def check_peer_jobs(
    dsn: str, ids_file: Path, system: str, *, effects: bool = False
) -> dict[str, Any]:
    """What became of every acknowledged job, and of the effects (see the module's doc)."""
    done, known = _DONE[system], _KNOWN[system]
    with psycopg.connect(dsn, autocommit=True) as conn:
        _copy_ids(conn, ids_file)
        row = conn.execute(
            f"SELECT count(*), count(k.id), count(d.id) FROM acked a "
            f"LEFT JOIN ({known}) k ON k.id = a.id LEFT JOIN ({done}) d ON d.id = a.id"
        ).fetchone()
        assert row is not None
        statuses = {str(k): int(v) for k, v in conn.execute(_STATUSES[system]).fetchall()}
        all_done = conn.execute(f"SELECT count(*) FROM ({done}) d").fetchone()
        statuses["completed"] = int(all_done[0]) if all_done else 0
        ledger: dict[str, Any] = {}
        if effects:
            made = conn.execute(
                "SELECT count(*), count(DISTINCT run_id) FROM public.bench_effects"
            ).fetchone()
            missing = conn.execute(
                f"SELECT count(*) FROM ({done}) d WHERE NOT EXISTS "
                "(SELECT 1 FROM public.bench_effects e WHERE e.run_id = d.id)"
            ).fetchone()
            doubled = conn.execute(
                "SELECT count(*) FROM (SELECT run_id FROM public.bench_effects GROUP BY run_id "
                "HAVING count(*) > 1) x"
            ).fetchone()
            assert made is not None
            assert missing is not None
            assert doubled is not None
            ledger = {
                "effects": int(made[0]),
                "effects_doubled": int(made[0]) - int(made[1]),
                "effects_missing": int(missing[0]),
                "jobs_with_effect": int(made[1]),
                "jobs_doubled": int(doubled[0]),
            }
    return {
        **ledger,
        "acknowledged": int(row[0]),
        "found": int(row[1]),
        "runs_lost": int(row[0]) - int(row[2]),
        "completed": int(row[2]),
        "statuses": statuses,
        "execution_outcomes": {},
    }


def peer_reexecutions(runs: dict[str, Any]) -> int:
    """Executions beyond one per job. With an effect ledger: every effect row beyond one per job
    is one, and so is every handler start beyond one per job with an effect (the workers' own
    counts; a SIGKILLed worker's last second of starts dies with it): the larger of the two,
    a floor either way. Without one: handler starts beyond the completed jobs."""
    starts = int(runs.get("handler_starts") or 0)
    if "jobs_with_effect" in runs:
        return max(0, starts - int(runs["jobs_with_effect"]), int(runs["effects_doubled"]))
    return max(0, starts - int(runs["statuses"].get("completed", 0)))
