"""The scenario harness's peer side (`--system pgqueuer|procrastinate`, bench/_scenario_peer.py),
below the processes: the end-of-run count of acknowledged jobs, lost jobs and the effect ledger,
and the monitor's queue depth, read from tables shaped as the peers' own (the columns the
harness reads). The peers themselves are not installed in the test environment (a virtualenv
of their own, filled from the network; see docs/performance.md), so no peer process runs here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from bench._scenario import Monitor
from bench._scenario_peer import check_peer_jobs, peer_argv, peer_reexecutions
from tests.fixtures.pg import scratch_database

# Acknowledged 1..5. Completed: 1, 2, 3 and 6 (6 committed, its acknowledgement lost to a cut
# session). 4 is still running (a dead worker's), 5 failed. Effects: 1 once, 2 twice (run
# again after a fault), 3 none, 4 once (started, never finished), 6 once.
TABLES = {
    "pgqueuer": [
        "CREATE TABLE public.pgqueuer (id bigint PRIMARY KEY, status text NOT NULL)",
        "CREATE TABLE public.pgqueuer_log (job_id bigint NOT NULL, status text NOT NULL)",
        "INSERT INTO public.pgqueuer VALUES (4, 'picked'), (7, 'queued')",
        "INSERT INTO public.pgqueuer_log VALUES (1, 'successful'), (2, 'successful'), "
        "(3, 'successful'), (6, 'successful'), (5, 'exception')",
    ],
    "procrastinate": [
        "CREATE TABLE public.procrastinate_jobs (id bigint PRIMARY KEY, status text NOT NULL)",
        "INSERT INTO public.procrastinate_jobs VALUES (1, 'succeeded'), (2, 'succeeded'), "
        "(3, 'succeeded'), (4, 'doing'), (5, 'failed'), (6, 'succeeded'), (7, 'todo')",
    ],
}
STATUSES = {
    "pgqueuer": {"picked": 1, "queued": 1, "log:successful": 4, "log:exception": 1},
    "procrastinate": {"succeeded": 4, "doing": 1, "failed": 1, "todo": 1},
}


@pytest.fixture(params=sorted(TABLES))
def peer_db(request: pytest.FixtureRequest, pg_url: str) -> Iterator[tuple[str, str]]:
    system: str = request.param
    with scratch_database(pg_url) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in TABLES[system]:
                conn.execute(statement)
            conn.execute("CREATE TABLE public.bench_effects (run_id bigint NOT NULL)")
            conn.execute("INSERT INTO public.bench_effects VALUES (1), (2), (2), (4), (6)")
        yield system, url


def test_check_peer_jobs_counts_lost_jobs_and_the_effect_ledger(
    peer_db: tuple[str, str], tmp_path: Path
) -> None:
    system, url = peer_db
    ids = tmp_path / "ids"
    ids.write_text("1\n2\n3\n4\n5\n\n")

    runs = check_peer_jobs(url, ids, system, effects=True)

    assert runs["acknowledged"] == 5
    assert runs["found"] == 5
    assert runs["completed"] == 3  # acknowledged and completed: 1, 2, 3
    assert runs["runs_lost"] == 2  # 4 never finished, 5 failed
    assert runs["statuses"] == {**STATUSES[system], "completed": 4}
    assert runs["effects"] == 5
    assert runs["effects_doubled"] == 1  # 2's second
    assert runs["jobs_doubled"] == 1
    assert runs["effects_missing"] == 1  # 3 completed without one
    assert runs["jobs_with_effect"] == 4
    # The workers counted 7 handler starts: 4 jobs started, so 3 more than one each.
    assert peer_reexecutions({**runs, "handler_starts": 7}) == 3
    # A SIGKILLed worker's last starts are lost with it: the doubled effect still counts.
    assert peer_reexecutions({**runs, "handler_starts": 4}) == 1

    without = check_peer_jobs(url, ids, system, effects=False)
    assert "effects" not in without
    assert without["runs_lost"] == 2
    # Without a ledger the starts are set against the completed jobs (all four).
    assert peer_reexecutions({**without, "handler_starts": 5}) == 1


def test_monitor_reads_the_peers_queue_depth_and_tables(peer_db: tuple[str, str]) -> None:
    system, url = peer_db
    monitor = Monitor(url, str(conninfo_to_dict(url)["dbname"]), system)
    try:
        sample = monitor.sample_or_none()
    finally:
        monitor.close()
    assert sample is not None
    assert (sample["pending"], sample["running"]) == (1, 1)
    table = "pgqueuer" if system == "pgqueuer" else "procrastinate_jobs"
    assert sample["tables"][table]["total_bytes"] > 0
    assert "bench_effects" not in sample["tables"]  # the ledger is the harness's, not the peer's


def test_peer_argv_runs_the_peer_script_with_the_scenario_settings() -> None:
    worker, producer = peer_argv(
        "procrastinate",
        "/venv/bin/python",
        "postgresql:///x",
        Path("/tmp/ids"),
        concurrency=32,
        lease_s=10.0,
        rate=100.0,
        producer_conns=4,
        worker_conns=6,
        effect=True,
    )
    assert worker[:3] == ["/venv/bin/python", worker[1], "work"]
    assert worker[1].endswith("bench/peers/scenario_peer.py")
    assert worker[3:] == [
        "--system", "procrastinate", "--dsn", "postgresql:///x", "--concurrency", "32",
        "--lease", "10.0", "--pool", "6", "--effect",
    ]  # fmt: skip
    assert producer[2:] == [
        "produce", "--system", "procrastinate", "--dsn", "postgresql:///x", "--rate", "100.0",
        "--conns", "4", "--ids", "/tmp/ids",
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        peer_argv("dbos", "/venv/bin/python", "x", Path("ids"), concurrency=1, lease_s=1,
                  rate=1, producer_conns=1)  # fmt: skip
    with pytest.raises(SystemExit):
        peer_argv("pgqueuer", "", "x", Path("ids"), concurrency=1, lease_s=1, rate=1,
                  producer_conns=1)  # fmt: skip
